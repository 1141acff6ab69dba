"""Every figure module renders on synthetic data: labelled axes, a legend, PNG + PDF written."""

from __future__ import annotations

import sys

import pytest
from matplotlib.figure import Figure

from analysis import load
from analysis.figures import ablation, audit, curves, style


def check(fig: Figure, tmp_path, name: str) -> None:
    assert isinstance(fig, Figure)
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert visible and all(ax.get_xlabel() for ax in visible)
    # a y label on every axes, or on one it shares its y axis with (side-by-side panels)
    assert all(any(s.get_ylabel() for s in ax.get_shared_y_axes().get_siblings(ax)) for ax in visible)
    assert any(ax.get_legend() for ax in visible) or fig.legends
    paths = style.save(fig, tmp_path / name)
    assert [p.suffix for p in paths] == [".png", ".pdf"] and all(p.stat().st_size > 1000 for p in paths)


@pytest.fixture
def frames(sweep_dir):
    runs, metrics = load.load_runs(sweep_dir)
    return runs[runs["complete"]], metrics[metrics["complete"]]


def test_learning_curves(frames, tmp_path):
    _, metrics = frames
    fig = curves.learning_curves(metrics, "eval/math_tiny/acc", "eval_anchor/math_tiny/acc", reps=100)
    assert len(fig.axes) == 2 and "(%)" in fig.axes[0].get_ylabel()
    assert fig.axes[1].get_title() == "EMA anchor"
    ci_bands = [c for c in fig.axes[0].collections if c.get_alpha() == style.CI_ALPHA]
    assert len(ci_bands) == 3  # one band per variant
    check(fig, tmp_path, "curves")
    assert len(curves.learning_curves(metrics, "eval/math_tiny/acc", "eval_anchor/nope/acc").axes) == 1
    with pytest.raises(ValueError, match="never logged"):
        curves.learning_curves(metrics, "eval/nope/acc")


def test_training_dynamics(frames, tmp_path):
    _, metrics = frames
    fig = curves.training_dynamics(metrics, reps=100)
    assert fig.axes[0].get_ylabel() == "per-token KL estimate (nats)"
    check(fig, tmp_path, "dynamics")
    with pytest.raises(ValueError):
        curves.training_dynamics(metrics.drop(columns=["kl/value", "anchor/drift"]))


@pytest.mark.parametrize("knob", ["anchor_tau", "kl_type"])
def test_ablation(frames, tmp_path, knob):
    runs, _ = frames
    fig = ablation.make(runs, knob, "final/eval/math_tiny/acc", reps=100)
    assert fig.axes[0].get_xlabel() == style.knob_label(knob)
    check(fig, tmp_path, f"ablation_{knob}")


def test_ablation_numeric_lines_with_hue(frames):
    runs, _ = frames
    fig = ablation.make(runs, "anchor_tau", "final/eval/math_tiny/acc", hue="kl_type", reps=100)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["k3 (n=3)", "topk (n=3)"]
    with pytest.raises(ValueError, match="not in the runs frame"):
        ablation.make(runs, "nope", "final/eval/math_tiny/acc")


def test_estimator_bias(audit_records, tmp_path):
    fig = audit.kl_estimators_bias(audit_records["estimator_table"])
    assert fig.axes[0].get_xscale() == "log"
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert "topk (reverse, k=4, paper)  value ✓ grad ✗" in ticks and "k3 (reverse)  value ✓ grad ✗" in ticks
    check(fig, tmp_path, "bias")


def test_topk_variance(audit_records, tmp_path):
    fig = audit.topk_variance(audit_records["topk_sweep"])
    assert len(fig.axes) == 4 and all(ax.get_yscale() == "log" for ax in fig.axes)  # variance + bias
    assert len(fig.legends[0].get_texts()) == 4  # (reverse, forward) x (paper, unbiased)
    check(fig, tmp_path, "topk")


def test_anchor_horizon(audit_records, tmp_path):
    fig = audit.anchor_horizon(audit_records["anchor_horizon"])
    assert "[ours:" in fig.get_suptitle() and "iterations" in fig.axes[0].get_ylabel()
    check(fig, tmp_path, "horizon")


def test_stability_region(audit_records, tmp_path):
    fig = audit.stability_region(audit_records["stability_grid"])
    assert style.OURS_TOY in fig.get_suptitle()
    assert [ax.get_title() for ax in fig.axes] == ["η = 0", "η = 0.5", "η = 0.9"]
    check(fig, tmp_path, "stability")
    irregular = audit_records["stability_grid"][:-5]  # not a full grid: scatter
    assert audit.stability_region(irregular).axes[0].collections


def test_no_pyplot_state():
    """Figures live on their own Agg canvas: pyplot is never imported by the figure modules."""
    assert "matplotlib.pyplot" not in sys.modules or not __import__("matplotlib.pyplot").pyplot.get_fignums()
