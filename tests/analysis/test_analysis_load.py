"""analysis.load on synthetic run records in the documented format (docs/run-record.md)."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from analysis import load
from experiments import records


def test_finds_every_run_and_drops_none(sweep_dir):
    runs, metrics = load.load_runs(sweep_dir)
    assert len(runs) == 11  # 9 finished + 1 failed + 1 partial
    assert runs["status"].value_counts().to_dict() == {"finished": 9, "failed": 1, "running": 1}
    assert runs["complete"].sum() == 9 and runs["failed"].sum() == 1
    assert set(metrics["run_id"]) == set(runs["run_id"])  # the unfinished runs keep their curves
    # 9 runs x 7 lines, failed: 4 lines, partial: 5 lines of which the last is cut -> 4
    assert len(metrics) == 9 * 7 + 4 + 4


def test_failed_run_is_flagged_with_its_error(sweep_dir):
    runs, _ = load.load_runs(sweep_dir)
    failed = runs[runs["failed"]].iloc[0]
    assert failed["error"] == "RuntimeError: NaN loss"  # the traceback's last line
    assert failed["metrics_source"] == "metrics.jsonl"  # no summary.json: recomputed
    assert failed["final/train/reward"] == pytest.approx(0.1 * 3 + 0.05 + 0.07)  # iteration 3, seed 7


def test_partial_run_ignores_truncated_last_line(sweep_dir):
    runs, metrics = load.load_runs(sweep_dir)
    part = runs[runs["status"] == "running"].iloc[0]
    assert bool(part["truncated"]) and not part["complete"]
    assert part["n_iterations_logged"] == 4 and part["iterations_done"] == 3
    assert metrics.loc[metrics["run_id"] == part["run_id"], "iteration"].tolist() == [0, 1, 2, 3]
    # best over the kept lines; eval only at iterations 0 and 2: acc = 0.2 + 0.1*2 + 0.02*8
    assert part["best/eval/math_tiny/acc"] == pytest.approx(0.56)


def test_knobs_are_flattened_from_config(sweep_dir):
    runs, metrics = load.load_runs(sweep_dir)
    ema = runs[(runs["anchor_tau"] == 0.9) & runs["complete"]].iloc[0]
    assert (ema["task"], ema["kl_type"], ema["kl_k"], ema["kl_tail"], ema["kl_coef"]) == (
        "math_tiny",
        "topk",
        4,
        "unbiased",
        0.01,
    )
    assert (ema["anchor_period"], ema["sweep_name"], ema["backend"], ema["iterations"]) == (2, "quickstart", "local", 6)
    assert ema["method"] == "EMA-PG" and ema["variant"] == "EMA-PG (τ=0.9, P=2; topk k=4, unbiased)"
    assert ema["cfg.task.n_problems"] == 5  # every scalar config entry, dotted
    grpo = runs[runs["anchor_tau"] == 1.0].iloc[0]
    assert grpo["method"] == "GRPO" and grpo["variant"] == "GRPO (k3)"
    assert pd.isna(grpo["anchor_period"]) and grpo["cfg.algo.anchor.period"] == 2  # inert: masked
    assert {"variant", "seed", "anchor_tau", "complete"} <= set(metrics.columns)


def test_inert_knobs_are_masked():
    """k and tail do nothing for K3; the period does nothing for a fixed anchor."""
    knobs = {"kl_type": "k3", "kl_k": 32, "kl_tail": "unbiased", "anchor_tau": 1.0, "anchor_period": 10}
    assert load.mask_inert_knobs(knobs) == {**knobs, "kl_k": None, "kl_tail": None, "anchor_period": None}
    topk = {"kl_type": "topk_reverse", "kl_k": 32, "kl_tail": "paper", "anchor_tau": 0.9, "anchor_period": 10}
    assert load.mask_inert_knobs(topk) == topk


def test_summary_final_matches_recomputed(sweep_dir):
    runs, _ = load.load_runs(sweep_dir)
    fin = runs[runs["complete"]]
    assert (fin["metrics_source"] == "summary.json").all()
    for run_dir in load.find_run_dirs(sweep_dir):
        raw = load.read_run(run_dir)
        if raw.summary:
            rows = load.clean_rows(raw.rows)[0]
            final, best = records.final_values(rows), records.best_values(rows)
            assert final == pytest.approx(raw.summary["final"]) and best == pytest.approx(raw.summary["best"])


def test_iteration_zero_holds_only_eval(sweep_dir):
    _, metrics = load.load_runs(sweep_dir)
    it0 = metrics[metrics["iteration"] == 0]
    assert it0["train/reward"].isna().all() and it0["eval/math_tiny/acc"].notna().all()


def test_missing_summary_on_finished_run_is_recomputed(tmp_path, synth):
    rows = synth.metric_rows("math_tiny", 0, 0.9)
    cfg = synth.config("math_tiny", 0, 0.9, sweep=None)
    synth.write_run(tmp_path, synth.rid("math_tiny", "e", 0), cfg, rows, summary=False)
    runs, _ = load.load_runs(tmp_path)
    r = runs.iloc[0]
    assert r["complete"] and r["metrics_source"] == "metrics.jsonl" and pd.isna(r["config_hash"])
    assert r["final/eval/math_tiny/acc"] == pytest.approx(rows[6]["eval/math_tiny/acc"])
    assert r["experiment"] == "ema_pg_tiny" and r["seed"] == 0 and pd.isna(r["sweep_name"])


def test_relogged_iterations_on_disk_are_refused(tmp_path, synth):
    """A resume rewinds metrics.jsonl before it logs again, so a record that re-logs iterations was written by two
    processes: refused, naming the line (W&B's history keeps the last line: test_report_integrity)."""
    rows = [{"iteration": i, "time_s": float(i), "train/reward": float(i)} for i in range(4)]
    rows += [{"iteration": i, "time_s": 10.0 + i, "train/reward": 10.0 + i} for i in (2, 3, 4)]
    synth.write_run(tmp_path, "r", synth.config("math_tiny", 0, 0.9), rows, summary=False)
    with pytest.raises(ValueError, match=r"metrics.jsonl:5: iteration 2 repeats an iteration already logged"):
        load.load_runs(tmp_path)


def test_corrupt_middle_line_is_an_error(tmp_path, synth):
    d = synth.write_run(tmp_path, "r", synth.config("math_tiny", 0, 0.9), synth.metric_rows("math_tiny", 0, 0.9))
    lines = (d / "metrics.jsonl").read_text().splitlines()
    lines[2] = lines[2][:10]
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:3: corrupt JSON line"):
        load.load_runs(tmp_path)


def test_find_ignores_checkpoints_and_needs_status(tmp_path, synth):
    d = synth.write_run(tmp_path, "r", synth.config("math_tiny", 0, 0.9), synth.metric_rows("math_tiny", 0, 0.9))
    (d / "checkpoints" / "iter_2").mkdir()
    for f in ("config.yaml", "status"):
        (d / "checkpoints" / "iter_2" / f).write_text("x: 1\n")
    (tmp_path / "not_a_run").mkdir()
    (tmp_path / "not_a_run" / "config.yaml").write_text("a: 1\n")  # no status file
    assert load.find_run_dirs(tmp_path) == [d]


def test_empty_and_missing_directories(tmp_path):
    runs, metrics = load.load_runs(tmp_path)
    assert runs.empty and metrics.empty and "run_id" in runs and "iteration" in metrics
    with pytest.raises(FileNotFoundError):
        load.load_runs(tmp_path / "nope")


def test_load_evals(sweep_dir):
    ev = load.load_evals(sweep_dir)
    assert len(ev) == 9 * 2 * 2 * 5  # runs x iterations x models x problems
    assert {"run_id", "variant", "seed", "n", "n_correct", "problem_id"} <= set(ev.columns)
    assert list(ev.columns[:3]) == ["run_id", "task", "variant"]


def test_parse_run_id():
    assert load.parse_run_id("search_tiny__ema_pg__s3__20260102-030405") == {
        "task": "search_tiny",
        "experiment": "ema_pg",
        "seed": 3,
        "timestamp": "20260102-030405",
    }
    assert load.parse_run_id("nonsense") == {}


def test_jsonl_reader_truncation_flag(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"iteration": 0}) + "\n" + '{"iteration": 1, "a"')
    rows, truncated = records.scan_jsonl(p)
    assert rows == [{"iteration": 0}] and truncated
    p.write_text(json.dumps({"iteration": 0}))  # complete last line without newline
    assert records.scan_jsonl(p) == ([{"iteration": 0}], False)
    assert math.isnan(load.clean_rows([{"iteration": 0, "x": None}])[0][0]["x"])


def test_runs_at_different_kl_coefficients_get_different_labels():
    """A β sweep (the β × τ map): the label names β, so runs at different β are never pooled in one row."""
    runs = pd.DataFrame(
        {
            "run_id": ["a", "b", "c", "d", "e"],
            "task": ["t", "t", "t", "t", "u"],
            "variant": ["GRPO (k3)", "GRPO (k3)", "EMA-PG (τ=0.9, P=10; k3)", "no KL", "GRPO (k3)"],
            "kl_coef": [0.1, 1.0, 1.0, 0.0, 0.5],
        }
    )
    assert load.label_coefs(runs) == {
        "a": "GRPO (k3, β=0.1)",
        "b": "GRPO (k3, β=1)",
        "c": "EMA-PG (τ=0.9, P=10; k3, β=1)",
    }  # d: no KL keeps its label; e: the only coefficient of its task
    assert load.label_coefs(runs[runs["run_id"].isin(["a", "e"])]) == {}
