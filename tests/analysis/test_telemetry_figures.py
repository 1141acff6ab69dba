"""The KL telemetry figures (curves.kl_probe, topk_coverage) and their place in the report, on hand-made frames:
one panel per method, the per-run coverage means, and clear refusals without telemetry."""

from __future__ import annotations

import pandas as pd
import pytest

from analysis.figures import curves, topk_coverage


def _metrics(with_probe: bool = True) -> pd.DataFrame:
    rows = []
    for run, (variant, k) in enumerate([("A", 1), ("A", 1), ("B", 4), ("B", 4)]):
        for it in range(1, 7):
            row = {"run_id": f"r{run}", "variant": variant, "iteration": it, "seed": run % 2,
                   "topk/head_mass": 0.1 * k + 0.01 * it, "topk/tail_frac": 1.0 - 0.2 * k}  # fmt: skip
            if with_probe and it % 2 == 0:
                row.update({"kl/exact": 0.01 * it, "kl/estimate_on_probe": 0.012 * it})
            rows.append(row)
    return pd.DataFrame(rows)


def _runs() -> pd.DataFrame:
    return pd.DataFrame({"run_id": ["r0", "r1", "r2", "r3"], "kl_k": [1, 1, 4, 4]})


def test_kl_probe_has_one_panel_per_method_with_both_curves():
    fig = curves.kl_probe(_metrics(), reps=50)
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in shown] == ["A", "B"]
    for ax in shown:
        labels = [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]
        assert labels == ["exact (n=2)", "estimate (n=2)"]
        exact = next(line for line in ax.get_lines() if line.get_label() == "exact (n=2)")
        assert list(exact.get_xdata()) == [2, 4, 6] and list(exact.get_ydata()) == pytest.approx([0.02, 0.04, 0.06])


def test_kl_probe_refuses_runs_without_the_probe():
    with pytest.raises(ValueError, match="no run logged kl/exact"):
        curves.kl_probe(_metrics(with_probe=False))


def test_topk_coverage_means_per_run_and_the_inside_fraction():
    df = topk_coverage.per_run(_metrics(), _runs()).set_index("run_id")
    assert df.loc["r2", "topk/head_mass"] == pytest.approx(0.4 + 0.01 * 3.5)  # mean over iterations 1..6
    assert df.loc["r0", "inside_frac"] == pytest.approx(0.2) and df.loc["r3", "inside_frac"] == pytest.approx(0.8)
    assert df.loc["r2", "tail_mass"] == pytest.approx(1 - 0.435)
    fig = topk_coverage.make(_metrics(), _runs(), reps=50)
    ax, tail = fig.axes
    line = ax.get_lines()[0]
    assert list(line.get_xdata()) == [1, 4] and list(line.get_ydata()) == pytest.approx([0.135, 0.435])
    assert list(tail.get_lines()[0].get_ydata()) == pytest.approx([1 - 0.135, 1 - 0.435])  # the tail's mass
    assert tail.get_yscale() == "log" and ax.get_xscale() == "log"


def test_topk_coverage_needs_two_values_of_k():
    runs = _runs().assign(kl_k=4)
    with pytest.raises(ValueError, match="fewer than two values"):
        topk_coverage.make(_metrics(), runs)
    with pytest.raises(ValueError, match="no run logged topk/head_mass"):
        topk_coverage.make(_metrics().drop(columns=["topk/head_mass"]), _runs())
