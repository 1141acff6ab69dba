"""analysis: loading (disk and a W&B stand-in), statistics against hand-worked values, tables,
every figure, the report and the no-training figures, and the import boundary."""

from __future__ import annotations

import math
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from analysis import load, stats
from analysis.report import figures, main_report, report


# ------------------------------------------------------------------ loading
def test_load_keeps_and_flags_failed_and_partial_runs(sweep_dir):
    runs, metrics = load.load_runs(sweep_dir)
    assert len(runs) == 11  # 9 complete + 1 failed + 1 partial: nothing dropped
    by_status = runs["status"].value_counts().to_dict()
    assert by_status["finished"] == 9 and by_status["failed"] == 1 and by_status["running"] == 1
    failed = runs[runs["status"] == "failed"].iloc[0]
    assert "NaN loss" in str(failed.get("error", "")) or not bool(failed["complete"])
    partial = runs[runs["status"] == "running"].iloc[0]
    # the truncated last line is ignored, the complete lines before it are kept
    its = metrics[metrics["run_id"] == partial["run_id"]]["iteration"].tolist()
    assert its == sorted(its) and 0 < len(its) < 5
    # one row per run x iteration for the complete runs (iterations 0..6)
    done = runs[runs["status"] == "finished"]["run_id"]
    assert metrics[metrics["run_id"].isin(done)].groupby("run_id").size().eq(7).all()


class FakeRun(SimpleNamespace):
    def scan_history(self, page_size=1000):
        self.scanned = True
        return iter(self.rows)

    def history(self, *a, **k):  # the sampled API must never be used
        raise AssertionError("history() is sampled; use scan_history()")


class FakeApi:
    def __init__(self, runs):
        self._runs = runs

    def runs(self, path, filters=None):
        return list(self._runs)


def test_load_wandb_reads_full_history_through_scan_history():
    rows = [{"_step": i, "_runtime": 0.1 * i, "train/reward": 0.1 * i, "eval/math_tiny/acc": 0.5 + 0.01 * i} for i in range(500)]
    a = FakeRun(id="abc", name="math_tiny__ema__s0__x", config={"task": {"name": "math_tiny"}, "seed": 0,
                "algo": {"anchor": {"tau": 0.9}}}, state="finished", group="quickstart", tags=["q"], url=None, rows=rows)
    b = FakeRun(id="def", name="other", config={"seed": 1}, state="crashed", group="elsewhere", tags=[], url=None, rows=rows[:3])
    runs, metrics = load.load_wandb("proj", group="quickstart", api=FakeApi([a, b]))
    assert len(runs) == 1 and a.scanned
    assert len(metrics) == 500  # every logged step, not a sample
    assert metrics["eval/math_tiny/acc"].max() == pytest.approx(0.5 + 0.01 * 499)


# ------------------------------------------------------------------ statistics
def test_pass_at_k_hand_worked():
    # n=5, c=2: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7; pass@4 = 1 - 0 = 1
    assert stats.pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert stats.pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert stats.pass_at_k(5, 2, 4) == pytest.approx(1.0)
    assert stats.pass_at_k(5, 0, 3) == 0.0
    np.testing.assert_allclose(stats.pass_at_k([4, 4], [1, 4], 2), [1 - 3 / 6, 1.0])
    with pytest.raises(ValueError):
        stats.pass_at_k(3, 4, 1)


def test_probability_of_improvement_and_iqm_hand_worked():
    # x = [1, 3], y = [2, 2]: pairs (1>2? no), (3>2 yes) x2 -> P = 2/4 = 0.5; ties count 1/2
    assert stats.probability_of_improvement([1.0, 3.0], [2.0, 2.0]) == pytest.approx(0.5)
    assert stats.probability_of_improvement([2.0], [2.0]) == pytest.approx(0.5)
    assert stats.probability_of_improvement([5.0, 6.0], [1.0, 2.0]) == pytest.approx(1.0)
    # IQM of 1..8: the middle half {3,4,5,6} -> 4.5
    assert float(stats.iqm(stats.as_scores(np.arange(1.0, 9.0)))) == pytest.approx(4.5)


def test_bootstrap_ci_is_seeded_and_brackets_the_mean():
    x = [0.2, 0.4, 0.5, 0.9]
    p1, lo1, hi1 = stats.bootstrap_ci(x, reps=200, seed=3)
    p2, lo2, hi2 = stats.bootstrap_ci(x, reps=200, seed=3)
    assert (p1, lo1, hi1) == (p2, lo2, hi2)
    assert p1 == pytest.approx(0.5) and lo1 <= p1 <= hi1 and lo1 >= 0.2 and hi1 <= 0.9
    assert all(math.isnan(v) for v in stats.bootstrap_ci([0.3], reps=50)[1:])  # one seed: no interval


# ------------------------------------------------------------------ report and figures
def test_report_on_a_sweep_writes_tables_figures_and_index(sweep_dir, tmp_path):
    out = tmp_path / "rep"
    paths = report(sweep_dir, out, reps=200)
    names = {p.name for p in paths}
    assert "index.md" in names and "index.html" in names
    assert any(n.endswith(".png") for n in names) and any(n.endswith(".pdf") for n in names)
    assert any(n.endswith(".tex") for n in names) and any(n.endswith(".csv") for n in names)
    index = (out / "index.md").read_text()
    assert "math_tiny" in index
    for p in paths:
        assert p.exists() and p.stat().st_size > 0
    assert main_report([str(sweep_dir), "--out", str(tmp_path / "rep2"), "--reps", "50"]) == 0


def test_no_training_figures_from_the_core_audit(tmp_path):
    from ema_pg_core import audit  # the test may import the core; the analysis package may not

    paths = figures(audit.records(), tmp_path / "figs")
    names = {p.name for p in paths}
    assert {"kl_estimators_bias.png", "topk_variance.png", "anchor_horizon.png", "stability_region.png", "index.md"} <= names
    table = next(p for p in paths if p.suffix == ".md" and p.name != "index.md").read_text()
    assert "topk_reverse" in table and "paper" in table and "unbiased" in table


def test_figures_render_on_synthetic_audit_records(audit_records, tmp_path):
    paths = figures(audit_records, tmp_path / "synthetic")
    assert sum(p.suffix == ".png" for p in paths) == 4


# ------------------------------------------------------------------ boundary
def test_analysis_never_imports_torch_or_the_core():
    code = ("import sys, importlib, pkgutil, analysis, analysis.figures\n"
            "for m in pkgutil.walk_packages(analysis.__path__, 'analysis.'): importlib.import_module(m.name)\n"
            "bad = sorted({n.split('.')[0] for n in sys.modules} & {'torch', 'ema_pg_core', 'ray'})\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


# ------------------------------------------------------------------ tables (golden)
def test_tables_against_a_small_golden_frame(tmp_path):
    import pandas as pd

    from analysis import tables

    df = pd.DataFrame({"method": ["GRPO", "EMA-PG"], "acc": ["41.0 ± 2.0", "47.5 ± 1.5"]})
    assert tables.to_markdown(df) == "| method | acc |\n|---|---|\n| GRPO | 41.0 ± 2.0 |\n| EMA-PG | 47.5 ± 1.5 |\n"
    tex = tables.to_latex(df, caption="c", label="t")
    assert tex.splitlines()[5:13] == ["\\begin{tabular}{lr}", "\\toprule", "method & acc \\\\", "\\midrule",
                                      "GRPO & 41.0 $\\pm$ 2.0 \\\\", "EMA-PG & 47.5 $\\pm$ 1.5 \\\\", "\\bottomrule",
                                      "\\end{tabular}"]
    path = tables.to_csv(df, tmp_path / "t.csv")
    assert pd.read_csv(path).equals(df)


def test_paper_numbers_are_only_the_verified_ones():
    from analysis import paper

    text = repr(vars(paper))
    for number in ("50.8", "53.9", "29.7", "44.1", "27.4", "40.1"):
        assert number in text
