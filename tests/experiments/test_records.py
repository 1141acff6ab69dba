"""The run record (docs/run-record.md): round trip, atomic writes, failures, resume, partial lines."""

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from experiments import records
from experiments.records import RunRecord, config_hash, make_run_id, read_evals, read_metrics, read_status, read_summary


def cfg(seed=1, **over):
    c = {
        "experiment": "math_tiny_ema_pg",
        "seed": seed,
        "run_dir": None,
        "out_root": "outputs/runs",
        "resume": False,
        "task": {"name": "math_tiny"},
        "algo": {"anchor": {"tau": 0.9, "period": 1}, "kl": {"type": "topk_reverse", "k": 4}},
        "trainer": {"iterations": 5, "label": "${algo.kl.type}-k${algo.kl.k}"},
        "logger": {"name": "wandb", "mode": "offline"},
        "sweep": {"name": None, "trial_id": None},
    }
    c.update(over)
    return OmegaConf.create(c)


class Scalar:
    """Stands in for a 0-d torch tensor / numpy scalar: only .item()."""

    def __init__(self, v):
        self.v = v

    def item(self):
        return self.v


class Vector:
    def item(self):
        raise ValueError("only one element tensors can be converted to Python scalars")


@pytest.fixture
def clock(monkeypatch):
    """A controllable wall clock for time_s: clock.t is the current time."""

    class Clock:
        t = 100.0

        def __call__(self):
            return self.t

    c = Clock()
    monkeypatch.setattr(records, "_clock", c)
    return c


def test_make_run_id_is_the_documented_parseable_format():
    import datetime as dt

    rid = make_run_id("math_tiny", "math_tiny_ema_pg", 3, now=dt.datetime(2026, 1, 2, 3, 4, 5))
    assert rid == "math_tiny__math_tiny_ema_pg__s3__20260102-030405"
    m = re.match(r"^(?P<task>.+?)__(?P<experiment>.+?)__s(?P<seed>-?\d+)__(?P<ts>\d{8}-\d{6})$", rid)
    assert m.groupdict() == {
        "task": "math_tiny",
        "experiment": "math_tiny_ema_pg",
        "seed": "3",
        "ts": "20260102-030405",
    }
    with pytest.raises(ValueError, match="'__'"):
        make_run_id("math__tiny", "x", 0)
    in_sweep = make_run_id("math_tiny", "math_tiny_grpo", 0, trial_id="7e9a1_00003")
    assert in_sweep == "math_tiny__math_tiny_grpo__s0__7e9a1_00003"
    with pytest.raises(ValueError, match="trial_id"):
        make_run_id("math_tiny", "x", 0, trial_id="a/b")


def test_best_exists_only_where_it_means_something():
    """Evaluations: the max. A sweep metric: by the sweep's mode. Losses, times, rewards, perf: no best."""
    rows = [
        {"iteration": 0, "time_s": 0.0, "eval/math_tiny/acc": 0.5},
        {"iteration": 1, "time_s": 9.0, "loss/total": 2.0, "train/reward": 0.1, "perf/iter_s": 9.0},
        {
            "iteration": 2,
            "time_s": 10.0,
            "loss/total": 0.5,
            "train/reward": 0.3,
            "perf/iter_s": 1.0,
            "eval/math_tiny/acc": 0.25,
            "eval_anchor/math_tiny/pass@1": 0.4,
            "kl/value": None,
        },
    ]
    assert records.best_values(rows) == {"eval/math_tiny/acc": 0.5, "eval_anchor/math_tiny/pass@1": 0.4}
    assert records.best_values(rows, "loss/total", "min")["loss/total"] == 0.5
    assert records.best_values(rows, "best_eval/math_tiny/acc", "min")["eval/math_tiny/acc"] == 0.25
    assert records.best_values(rows, "train/reward")["train/reward"] == 0.3
    assert records.final_values(rows[::-1])["loss/total"] == 0.5 and "kl/value" not in records.final_values(rows)
    with pytest.raises(ValueError, match="mode"):
        records.best_values(rows, "loss/total", "lowest")


def test_config_hash_ignores_run_local_keys_only():
    base = config_hash(cfg())
    assert base == config_hash(OmegaConf.to_container(cfg()))  # DictConfig or dict
    assert re.fullmatch(r"[0-9a-f]{12}", base)
    moved = cfg(
        run_dir="/elsewhere",
        out_root="/x",
        resume=True,
        logger={"name": "none", "mode": "online"},
        sweep={"name": "quickstart", "trial_id": "t7"},
    )
    assert config_hash(moved) == base
    assert config_hash(cfg(seed=2)) != base
    assert config_hash(cfg(algo={"anchor": {"tau": 0.95, "period": 1}, "kl": {"type": "k3", "k": 0}})) != base


def test_round_trip(tmp_path, clock):
    run_dir = tmp_path / "math_tiny__math_tiny_ema_pg__s1__20260101-000000"
    with RunRecord.create(run_dir, cfg()) as rec:
        assert read_status(run_dir)[0] == "running"
        rec.log_evals(
            [
                {
                    "iteration": 0,
                    "model": "policy",
                    "benchmark": "math_tiny",
                    "problem_id": "p0",
                    "n": 4,
                    "n_correct": Scalar(3),
                    "greedy_correct": 1,
                }
            ]
        )
        rec.log(0, {"eval/math_tiny/acc": 0.25})
        for it in (1, 2, 3):
            clock.t += 2.0
            rec.log(
                it,
                {
                    "train/reward": Scalar(0.1 * it),
                    "loss/total": [None, 1.0, float("nan"), 0.5][it],
                    "kl/value": float("inf") if it == 2 else 0.01,
                    "anchor/updated": 1,
                },
            )
        summary = rec.finish({"train_wall_time_s": 5.5})

    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert written["trainer"]["label"] == "topk_reverse-k4"  # resolved
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    assert [r["time_s"] for r in rows] == [0.0, 2.0, 4.0, 6.0]
    assert rows[2]["loss/total"] is None and rows[2]["kl/value"] is None  # NaN, inf -> null
    assert rows[1]["train/reward"] == pytest.approx(0.1)
    assert read_evals(run_dir)[0]["n_correct"] == 3
    assert read_status(run_dir) == ("finished", None)
    assert read_summary(run_dir) == summary
    assert summary["final"] == {
        "eval/math_tiny/acc": 0.25,
        "train/reward": pytest.approx(0.3),
        "loss/total": 0.5,
        "kl/value": 0.01,
        "anchor/updated": 1,
    }
    assert summary["best"] == {"eval/math_tiny/acc": 0.25}  # no "best" loss, reward or KL: only eval metrics
    assert {
        k: summary[k]
        for k in (
            "run_id",
            "status",
            "experiment",
            "task",
            "seed",
            "iterations_done",
            "wall_time_s",
            "wandb_run_id",
            "train_wall_time_s",
        )
    } == {
        "run_id": run_dir.name,
        "status": "finished",
        "experiment": "math_tiny_ema_pg",
        "task": "math_tiny",
        "seed": 1,
        "iterations_done": 3,
        "wall_time_s": 6.0,
        "wandb_run_id": None,
        "train_wall_time_s": 5.5,
    }
    assert summary["config_hash"] == config_hash(cfg())
    assert "git_sha" in summary
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def test_analysis_reads_what_records_writes(tmp_path):
    from analysis.load import load_runs

    with RunRecord.create(tmp_path / "runs" / "math_tiny__math_tiny_ema_pg__s1__20260101-000000", cfg()) as rec:
        rec.log(0, {"eval/math_tiny/acc": 0.25})
        rec.log(1, {"train/reward": 0.5, "kl/value": float("nan")})
    runs, metrics = load_runs(tmp_path)
    row = runs.iloc[0]
    assert (row["status"], row["seed"], row["anchor_tau"], row["final/train/reward"]) == ("finished", 1, 0.9, 0.5)
    assert len(metrics) == 2 and math.isnan(metrics["kl/value"].iloc[1])


def test_writes_are_atomic_a_crash_before_replace_leaves_the_old_file(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    rec = RunRecord.create(run_dir, cfg())
    rec.log(0, {"train/reward": 1.0})
    seen = {}

    def crash(src, dst):  # the temp file is complete, the process dies before the rename
        seen[Path(dst).name] = (Path(src).parent, Path(src).read_text())
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(records.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        rec.finish()
    assert seen["summary.json"][0] == run_dir  # temp file in the same directory
    assert json.loads(seen["summary.json"][1])["status"] == "finished"  # it was written in full
    monkeypatch.undo()
    assert read_status(run_dir)[0] == "running"  # status untouched, not half-written
    assert read_summary(run_dir) is None
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "metrics.jsonl", "owner.lock", "status"]


@pytest.mark.parametrize("code", [0, None])
def test_sys_exit_0_inside_the_run_is_an_interruption_not_a_failure(tmp_path, code):
    """Ray Tune ends a trial's function by sys.exit(0) inside tune.report (an ASHA stop, or the sweep
    interrupted by Ctrl-C): the run stopped where it was, with its checkpoint, and did not fail."""
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit):
        with RunRecord.create(run_dir, cfg()) as rec:
            rec.log(1, {"train/reward": 0.2})
            sys.exit(code)
    state, detail = read_status(run_dir)
    assert state == "interrupted" and "Ray Tune ended the trial" in detail
    assert read_summary(run_dir)["status"] == "interrupted"


def test_sys_exit_with_an_error_code_is_a_failure(tmp_path):
    with pytest.raises(SystemExit):
        with RunRecord.create(tmp_path / "run", cfg()):
            sys.exit(3)
    assert read_status(tmp_path / "run")[0] == "failed"


def test_failed_run_keeps_its_error_and_summary(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="NaN loss"):
        with RunRecord.create(run_dir, cfg()) as rec:
            rec.log(0, {"eval/math_tiny/acc": 0.1})
            rec.log(1, {"train/reward": 0.2})
            raise RuntimeError("NaN loss at iteration 2")
    state, error = read_status(run_dir)
    assert state == "failed"
    assert error.startswith("Traceback") and error.splitlines()[-1] == "RuntimeError: NaN loss at iteration 2"
    summary = read_summary(run_dir)
    assert (summary["status"], summary["iterations_done"], summary["final"]["train/reward"]) == ("failed", 1, 0.2)
    with pytest.raises(RuntimeError, match="is failed"):
        rec.log(2, {})


def test_resume_rewinds_to_the_checkpoint_and_continues_time(tmp_path, clock):
    run_dir = tmp_path / "run"
    rec = RunRecord.create(run_dir, cfg())
    for it in range(6):  # checkpoint at 3, crash after logging 5
        rec.log_evals([{"iteration": it, "model": "policy", "problem_id": "p0"}])
        rec.log(it, {"train/reward": float(it)})
        clock.t += 10.0
    (run_dir / "metrics.jsonl").open("a").write('{"iteration": 6, "time_')  # died mid-line
    clock.t += 1000.0  # downtime is not run time
    rec.release()  # the process died: the kernel lets go of run_dir

    rec = RunRecord.create(run_dir, cfg(resume=True), resume=True)
    assert read_status(run_dir)[0] == "running"
    rec.rewind(3)
    assert [r["iteration"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]
    assert [r["iteration"] for r in read_evals(run_dir)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="iterations must increase"):
        rec.log(3, {"train/reward": 3.0})
    clock.t += 5.0
    row = rec.log(4, {"train/reward": 40.0})
    assert row["time_s"] == 35.0  # 30 s at the checkpoint + 5 s since the resume
    rec.finish()
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4]
    assert read_summary(run_dir)["final"]["train/reward"] == 40.0
    assert read_summary(run_dir)["wall_time_s"] == 35.0


def test_resume_without_rewind_drops_only_a_partial_line(tmp_path):
    run_dir = tmp_path / "run"
    rec = RunRecord.create(run_dir, cfg())
    rec.log(0, {"a": 1})
    rec.log(1, {"a": 2})
    rec.finish()
    text = (run_dir / "metrics.jsonl").read_text()
    (run_dir / "metrics.jsonl").write_text(text + '{"iteration": 2, "a"')
    assert [r["iteration"] for r in read_metrics(run_dir)] == [0, 1]  # readers tolerate it
    rec = RunRecord.create(run_dir, cfg(), resume=True)
    assert read_summary(run_dir) is None  # the stale summary is gone
    rec.log(2, {"a": 3})
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert "\n".join(lines[:2]) + "\n" == text and json.loads(lines[2])["a"] == 3  # no line glued to the partial
    assert [r["a"] for r in read_metrics(run_dir)] == [1, 2, 3]


def test_corrupt_line_in_the_middle_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0}\n{"iter\n{"iteration": 2}\n')
    with pytest.raises(ValueError, match="corrupt JSON line"):
        read_metrics(tmp_path)


def test_fresh_create_never_overwrites_a_record_with_data(tmp_path):
    run_dir = tmp_path / "run"
    with RunRecord.create(run_dir, cfg()) as rec:
        rec.log(0, {"a": 1})
    with pytest.raises(FileExistsError, match="resume=true"):
        RunRecord.create(run_dir, cfg())
    # a run that died before its first metric (and its W&B id) is simply started over
    crashed = tmp_path / "crashed"
    RunRecord.create(crashed, cfg()).release()  # the process died: the kernel lets go of run_dir
    (crashed / "wandb_run.json").write_text('{"id": "old", "last_step": null}')
    RunRecord.create(crashed, cfg())
    assert not (crashed / "wandb_run.json").exists()


def test_summary_reads_the_persisted_wandb_id(tmp_path):
    rec = RunRecord.create(tmp_path / "run", cfg())
    (tmp_path / "run" / "wandb_run.json").write_text('{"id": "ab12cd34", "last_step": 0}')
    assert rec.fail("killed by SIGTERM")["wandb_run_id"] == "ab12cd34"
    assert read_status(tmp_path / "run") == ("failed", "killed by SIGTERM")


def test_bad_metrics_fail_loudly(tmp_path):
    rec = RunRecord.create(tmp_path / "run", cfg())
    with pytest.raises(ValueError, match="set by the run record"):
        rec.log(0, {"time_s": 1.0})
    with pytest.raises(TypeError, match="'train/reward'"):
        rec.log(0, {"train/reward": Vector()})
    with pytest.raises(TypeError, match="cannot be written as JSON"):
        rec.log(0, {"x": object()})
    with pytest.raises(ValueError, match="integer 'iteration'"):
        rec.log_evals([{"model": "policy"}])
    assert read_metrics(tmp_path / "run") == [] and not os.path.exists(tmp_path / "run" / "evals.jsonl")
