"""analysis.load.load_wandb through a stand-in for wandb.Api (offline .wandb files have no public
reader; environment.md). The stand-in serves runs and full-resolution scan_history rows, and
fails the test if the sampled run.history() is touched."""

from __future__ import annotations

import pandas as pd
import pytest

from analysis import load


class FakeRun:
    """The attributes of wandb.apis.public.Run that load_wandb reads."""

    def __init__(self, run_id, name, state, config, rows, group=None, tags=()):
        self.id, self.name, self.state, self.config = run_id, name, state, config
        self.group, self.tags, self.url = group, list(tags), f"https://wandb.example/{run_id}"
        self.summary = {"train/reward": rows[-1].get("train/reward")}  # last value only, as W&B
        self._rows = rows
        self.scanned_with: dict = {}

    def scan_history(self, keys=None, page_size=1000, min_step=0, max_step=None):
        self.scanned_with = {"keys": keys, "page_size": page_size}
        return iter(self._rows)

    def history(self, *args, **kwargs):
        raise AssertionError("run.history() is sampled; load_wandb must use scan_history()")


class FakeApi:
    def __init__(self, runs):
        self._runs = runs
        self.calls: list = []

    def runs(self, path=None, filters=None, order="+created_at", per_page=50):
        self.calls.append((path, filters))
        return list(self._runs)  # ignores filters: the client-side filter must hold


def wandb_rows(synth, seed, tau, spike_at=None):
    """W&B history: our metrics plus W&B's own keys and a media value, with _step = iteration."""
    rows = []
    for r in synth.metric_rows("math_tiny", seed, tau):
        row = {
            **r,
            "_step": r["iteration"],
            "_runtime": r["time_s"],
            "_timestamp": 1.7e9,
            "media/sample": {"_type": "table-file", "path": "x.json"},
        }
        rows.append(row)
    if spike_at is not None:
        rows[spike_at]["eval/math_tiny/acc"] = 0.99  # the max a sampled history could miss
    return rows


@pytest.fixture
def api(synth):
    runs = []
    for seed in range(2):
        for tau in (1.0, 0.9):
            cfg = synth.config("math_tiny", seed, tau)
            runs.append(
                FakeRun(
                    f"id{seed}{int(tau * 10)}",
                    synth.rid("math_tiny", cfg["experiment"], seed),
                    "finished",
                    cfg,
                    wandb_rows(synth, seed, tau, spike_at=3 if seed == 0 else None),
                    group="quickstart",
                    tags=["tiny", "v1"],
                )
            )
    crashed_cfg = synth.config("math_tiny", 5, 0.9)
    runs.append(
        FakeRun(
            "idcrash",
            "crashy-run-1",
            "crashed",
            crashed_cfg,
            wandb_rows(synth, 5, 0.9)[:3],
            group="quickstart",
            tags=["tiny"],
        )
    )
    runs.append(
        FakeRun(
            "idother",
            "other",
            "finished",
            synth.config("math_tiny", 0, 0.9),
            wandb_rows(synth, 0, 0.9),
            group="another-sweep",
            tags=["tiny", "v1"],
        )
    )
    return FakeApi(runs)


def test_same_frames_as_disk(api, sweep_dir):
    runs, metrics = load.load_wandb("emapg", entity="lab", group="quickstart", api=api)
    disk_runs, disk_metrics = load.load_runs(sweep_dir)
    assert {"run_id", "status", "complete", "failed", "variant", "anchor_tau", "kl_k"} <= set(runs.columns)
    assert set(disk_metrics.columns) <= set(metrics.columns)
    assert len(runs) == 5 and set(runs["source"]) == {"wandb"}
    assert not any(c.startswith(("_", "media")) for c in metrics.columns)  # W&B keys and media dropped
    assert api.calls == [("lab/emapg", {"group": "quickstart"})]


def test_full_history_and_recomputed_best(api):
    runs, metrics = load.load_wandb("emapg", group="quickstart", api=api)
    r = runs.set_index("wandb_run_id").loc["id09"]
    assert r["best/eval/math_tiny/acc"] == 0.99  # from the full history, not the summary
    assert "best/train/reward" not in runs  # best only where higher is known to be better
    assert r["final/train/reward"] == pytest.approx(0.1 * 6 + 0.05)
    assert r["metrics_source"] == "wandb.scan_history"
    assert len(metrics[metrics["run_id"] == r["run_id"]]) == 7
    assert all("page_size" in run.scanned_with for run in api._runs[:5])


def test_states_knobs_and_ids(api):
    runs, _ = load.load_wandb("emapg", group="quickstart", api=api)
    crashed = runs.set_index("wandb_run_id").loc["idcrash"]
    assert crashed["status"] == "crashed" and crashed["wandb_state"] == "crashed" and not crashed["complete"]
    assert crashed["run_id"] == "crashy-run-1" and crashed["seed"] == 5
    ema = runs[(runs["anchor_tau"] == 0.9) & runs["complete"]].iloc[0]
    assert ema["variant"] == "EMA-PG (τ=0.9, P=2; topk k=4, unbiased)"
    assert ema["run_id"].startswith("math_tiny__ema_pg_tiny__s")
    assert ema["wandb_url"].startswith("https://")


def test_tag_filter_requires_all_tags(api):
    runs, _ = load.load_wandb("emapg", group="quickstart", tags=["tiny", "v1"], api=api)
    assert len(runs) == 4 and "idcrash" not in set(runs["wandb_run_id"])
    assert api.calls[-1][1] == {"group": "quickstart", "tags": {"$in": ["tiny", "v1"]}}


def test_nested_or_slashed_config_keys(synth):
    rows = wandb_rows(synth, 0, 0.9)
    flat = {
        "algo/kl/type": "k3",
        "algo/anchor/tau": 0.95,
        "task/name": "search_tiny",
        "seed": 1,
        "_wandb": {"cli_version": "0.31"},
    }
    runs, _ = load.load_wandb("p", api=FakeApi([FakeRun("a", "a", "running", flat, rows)]))
    r = runs.iloc[0]
    assert (r["kl_type"], r["anchor_tau"], r["task"], r["status"]) == ("k3", 0.95, "search_tiny", "running")
    assert not any(c.startswith("cfg._wandb") for c in runs.columns)
    assert pd.isna(r["kl_k"])


def test_every_logged_step_is_read():
    """500 steps: a sampled history() would return fewer; scan_history returns them all."""
    rows = [
        {"_step": i, "_runtime": 0.1 * i, "train/reward": 0.1 * i, "eval/math_tiny/acc": 0.5 + 0.001 * i}
        for i in range(500)
    ]
    cfg = {"task": {"name": "math_tiny"}, "seed": 0, "algo": {"anchor": {"tau": 0.9}}}
    runs, metrics = load.load_wandb("proj", api=FakeApi([FakeRun("a", "a", "finished", cfg, rows)]))
    assert len(metrics) == 500 and metrics["iteration"].tolist() == list(range(500))  # _step as iteration
    assert runs.iloc[0]["best/eval/math_tiny/acc"] == pytest.approx(0.5 + 0.001 * 499)
    assert metrics["time_s"].iloc[-1] == pytest.approx(49.9)  # _runtime as time_s
