"""The β × τ map (analysis/figures/beta_tau_map.py) on a synthetic paired sweep: hand-checked cell numbers,
the rendered figure, and the report building it only when β and τ both vary with τ = 1 among them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis import report, stats
from analysis.figures import beta_tau_map, style

ACC, ANCHOR = "final/eval/math_tiny/acc", "final/eval_anchor/math_tiny/acc"
BASE = {0: 0.40, 1: 0.50, 2: 0.45, 3: 0.55, 4: 0.35, 5: 0.60}  # τ = 1 per seed: a large seed-to-seed spread


def runs_frame() -> pd.DataFrame:
    """β ∈ {0, 0.1} × τ ∈ {1, 0.9, 0.5}, 6 seeds (the fewest an exact paired test can decide at 95%).
    At β = 0 every τ scores as τ = 1 (the KL term is off);
    at β = 0.1, τ = 0.9 adds +0.05 on every seed (clear when paired) and τ = 0.5 adds ±0.05 (unclear)."""
    rows = []
    for beta in (0.0, 0.1):
        for tau in (1.0, 0.9, 0.5):
            for s, y in BASE.items():
                add = 0.0 if beta == 0 or tau == 1 else 0.05 if tau == 0.9 else 0.05 * (-1) ** s
                anchor = 0.35 if tau == 1 else 0.35 + (1 - tau) * 0.2
                rows.append(
                    dict(run_id=f"r{beta}_{tau}_{s}", task="math_tiny", kl_coef=beta, anchor_tau=tau, seed=s)
                    | {ACC: y + add, ANCHOR: anchor, "complete": True}
                )
    return pd.DataFrame(rows)


def test_cells_are_the_reports_paired_gain_over_tau_1():
    cells = beta_tau_map.map_cells(runs_frame(), ACC, ANCHOR).set_index(["kl_coef", "anchor_tau"])
    assert len(cells) == 6 and (cells["n"] == 6).all()
    assert cells.loc[(0.1, 1.0), "policy"] == pytest.approx(np.mean(list(BASE.values())))
    assert np.isnan(cells.loc[(0.1, 1.0), "gain"]) and cells.loc[(0.1, 1.0), "pairing"] == ""
    same = cells.loc[(0.0, 0.5)]  # identical runs: the paired CI is exactly [0, 0]
    assert (same["gain"], same["gain_lo"], same["gain_hi"]) == (0.0, 0.0, 0.0)
    clear = cells.loc[(0.1, 0.9)]
    y = np.array(list(BASE.values()))
    c = stats.compare(y + 0.05, y)
    assert (clear["gain"], clear["gain_lo"], clear["gain_hi"], clear["p"]) == (c.gain, *c.ci, c.p)
    assert clear["gain"] == pytest.approx(0.05 / y.mean()) and clear["gain_lo"] > 0 and c.p == 2 / 64
    assert clear["pairing"] == "paired, 6 seeds"
    unclear = cells.loc[(0.1, 0.5)]
    assert unclear["gain_lo"] < 0 < unclear["gain_hi"]
    assert cells.loc[(0.1, 0.5), "anchor"] == pytest.approx(0.45)


def test_figure_renders_three_labelled_heatmaps(tmp_path):
    fig = beta_tau_map.make(runs_frame(), ACC, ANCHOR, title="map")
    heat = [ax for ax in fig.axes if ax.get_visible() and ax.images]
    assert len(heat) == 3 and all(ax.get_xlabel() and ax.get_ylabel() for ax in heat)
    assert [t.get_text() for t in heat[0].get_xticklabels()] == ["1", "0.9", "0.5"]
    texts = [t.get_text() for t in heat[2].texts]
    assert texts.count("baseline") == 2 and "+0.0\n[+0.0, +0.0] p" in texts
    assert len(heat[2].patches) == 1  # one boxed cell: the CI of β = 0.1, τ = 0.9 excludes 0
    paths = style.save(fig, tmp_path / "map")
    assert all(p.stat().st_size > 1000 for p in paths)
    no_anchor = beta_tau_map.make(runs_frame(), ACC, None)
    assert len([ax for ax in no_anchor.axes if ax.get_visible() and ax.images]) == 2


def test_report_draws_the_map_only_for_a_beta_tau_grid(tmp_path):
    runs = runs_frame()
    out, skipped = report._task_beta_tau_map(
        "math_tiny", runs, pd.DataFrame(), None, tmp_path, reps=100, seed=0, sweep_metric="eval/math_tiny/acc"
    )
    assert [p.name for p in out[0].paths] == ["math_tiny_beta_tau_map.png", "math_tiny_beta_tau_map.pdf"]
    assert skipped == []
    only_tau = runs[runs["kl_coef"] == 0.1]
    assert report._task_beta_tau_map(
        "math_tiny", only_tau, None, None, tmp_path, reps=10, seed=0, sweep_metric=None
    ) == (
        [],
        [],
    )
    no_base = runs[runs["anchor_tau"] != 1.0]
    _, why = report._task_beta_tau_map("math_tiny", no_base, None, None, tmp_path, reps=10, seed=0, sweep_metric=None)
    assert "no run has τ = 1" in why[0]
