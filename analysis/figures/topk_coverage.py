"""Top-k coverage vs k: how much of the policy's mass the top-k head holds (topk/head_mass) and how often the
sampled token falls inside it (1 - topk/tail_frac), each run's mean over training, mean ± CI over seeds."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis import stats
from analysis.figures import style

CURVES = (("topk/head_mass", "policy mass inside the top-k"), ("topk/tail_frac", "sampled tokens inside the top-k"))


def per_run(metrics: pd.DataFrame, runs: pd.DataFrame, knob: str = "kl_k") -> pd.DataFrame:
    """One row per run: run_id, the knob, and the run's mean head mass and inside fraction over iterations."""
    have = [m for m, _ in CURVES if m in metrics]
    if len(have) < len(CURVES) or metrics[have].notna().sum().min() == 0:
        raise ValueError("no run logged topk/head_mass and topk/tail_frac (a Top-k estimator)")
    means = metrics.groupby("run_id")[have].mean().reset_index()
    means["inside_frac"] = 1.0 - means["topk/tail_frac"]
    return means.merge(runs[["run_id", knob]], on="run_id").dropna(subset=["topk/head_mass", knob])


@style.styled
def make(
    metrics: pd.DataFrame,
    runs: pd.DataFrame,
    *,
    knob: str = "kl_k",
    reps: int = 1000,
    seed: int = 0,
    title: str | None = None,
) -> Figure:
    """One panel, two lines over k; raises ValueError when fewer than two values of k have Top-k telemetry."""
    df = per_run(metrics, runs, knob)
    if df[knob].nunique() < 2:
        raise ValueError(f"Top-k telemetry for fewer than two values of {knob}; no coverage curve")
    fig, (ax,) = style.new_figure(6.2, 4.2)
    for i, (col, label) in enumerate((("topk/head_mass", CURVES[0][1]), ("inside_frac", CURVES[1][1]))):
        s = stats.summarize(df, col, [knob], reps=reps, seed=seed).sort_values(knob)
        x = s[knob].to_numpy(float)
        ax.plot(x, s["mean"], color=style.color(i), marker=style.MARKERS[i], label=f"{label} (n={int(s['n'].max())})")
        ok = s["ci_low"].notna().to_numpy()
        ax.fill_between(x[ok], s["ci_low"][ok], s["ci_high"][ok], color=style.color(i), alpha=style.CI_ALPHA, lw=0)
        ax.scatter(df[knob], df[col], color=style.color(i), s=10, alpha=0.5)
    if (df[knob] > 0).all() and np.ptp(df[knob].to_numpy(float)) > 0:
        ax.set_xscale("log")
    ax.set(xlabel=style.knob_name(knob), ylabel="fraction (mean over training)", ylim=(-0.02, 1.02))
    ax.legend(loc="best", frameon=False)
    return style.finish(fig, title, style.CI_NOTE + "; dots = runs")
