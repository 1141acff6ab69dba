"""Top-k coverage vs k: how much of the policy's mass the top-k head holds (topk/head_mass) and how often the
sampled token falls inside it (1 - topk/tail_frac), each run's mean over training, mean ± CI over seeds.

Left panel: the two coverages. Right panel: what is outside the head, on a log scale (where the differences
between k = 4, 16, 32 live): the tail's mass 1 - head_mass and the tail fraction, floored at ``FLOOR`` (k = |V|
leaves exactly nothing outside). The k axis is logarithmic, linear between 0 and 1 when k = 0 is present."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from analysis import stats
from analysis.figures import style

CURVES = (("topk/head_mass", "policy mass inside the top-k"), ("topk/tail_frac", "sampled tokens inside the top-k"))
TAILS = (("tail_mass", "policy mass outside (1 - head mass)"), ("topk/tail_frac", "sampled tokens outside"))
KNOB = "kl_k"  # the runs column holding k
FLOOR = 1e-7  # the right panel's floor: smaller values (k = |V|: exactly 0) are drawn at it


def per_run(metrics: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """One row per run: run_id, k, and the run's mean head mass and inside fraction over iterations."""
    have = [m for m, _ in CURVES if m in metrics]
    if len(have) < len(CURVES) or metrics[have].notna().sum().min() == 0:
        raise ValueError("no run logged topk/head_mass and topk/tail_frac (a Top-k estimator)")
    means = metrics.groupby("run_id")[have].mean().reset_index()
    means["inside_frac"] = 1.0 - means["topk/tail_frac"]
    means["tail_mass"] = (1.0 - means["topk/head_mass"]).clip(lower=0.0)
    return means.merge(runs[["run_id", KNOB]], on="run_id").dropna(subset=["topk/head_mass", KNOB])


@style.styled
def make(
    metrics: pd.DataFrame, runs: pd.DataFrame, *, reps: int = 1000, seed: int = 0, title: str | None = None
) -> Figure:
    """Two panels over k (see the module docstring); raises ValueError when fewer than two values of k have
    Top-k telemetry."""
    df = per_run(metrics, runs)
    if df[KNOB].nunique() < 2:
        raise ValueError(f"Top-k telemetry for fewer than two values of {KNOB}; no coverage curve")
    fig, (ax, tail) = style.new_figure(10.4, 4.2, ncols=2)
    _curves(ax, df, (("topk/head_mass", CURVES[0][1]), ("inside_frac", CURVES[1][1])), reps=reps, seed=seed)
    ax.set(ylabel="fraction inside the head (mean over training)", ylim=(-0.02, 1.02))
    _curves(tail, df.assign(**{c: df[c].clip(lower=FLOOR) for c, _ in TAILS}), TAILS, reps=reps, seed=seed)
    tail.set_yscale("log")
    tail.set(ylabel="fraction outside the head (log scale)")
    for a in (ax, tail):
        if (df[KNOB] == 0).any():
            a.set_xscale("symlog", linthresh=1.0)
            a.set_xlim(left=0.0)
        else:
            a.set_xscale("log")
        a.set_xlabel(style.knob_name(KNOB))
        a.legend(loc="best", frameon=False)
    return style.finish(fig, title, style.CI_NOTE + f"; dots = runs; right: values < {FLOOR:g} drawn at {FLOOR:g}")


def _curves(ax, df: pd.DataFrame, cols, *, reps: int, seed: int) -> None:
    """Mean ± CI over seeds of each column against k, and the runs as dots."""
    for i, (col, label) in enumerate(cols):
        s = stats.summarize(df, col, [KNOB], reps=reps, seed=seed).sort_values(KNOB)
        x = s[KNOB].to_numpy(float)
        ax.plot(x, s["mean"], color=style.color(i), marker=style.MARKERS[i], label=f"{label} (n={int(s['n'].max())})")
        ok = s["ci_low"].notna().to_numpy()
        ax.fill_between(x[ok], s["ci_low"][ok], s["ci_high"][ok], color=style.color(i), alpha=style.CI_ALPHA, lw=0)
        ax.scatter(df[KNOB], df[col], color=style.color(i), s=10, alpha=0.5)
