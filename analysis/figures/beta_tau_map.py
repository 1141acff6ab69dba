"""The β × τ map: heatmaps over (KL coefficient β, EMA weight τ) of the final policy accuracy, the final
anchor accuracy, and the paired relative gain of each τ < 1 over τ = 1 at the same β (with its CI).

    fig = make(runs, "final/eval/math_tiny/acc", "final/eval_anchor/math_tiny/acc")
    cells = map_cells(runs, metric, anchor_metric)   # the numbers behind the figure, one row per cell

The gain is the report's own comparison (analysis.tables.compare), so the figure and the report's tables agree.
No stability boundary is drawn: placing our toy model's region in (β, τ) needs quantities no run logs
(docs/results.md, "No stability boundary is overlaid").
"""

from __future__ import annotations

import math

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from analysis import tables
from analysis.figures import style

REQUIRED = ("kl_coef", "anchor_tau", "seed")
BASELINE_TAU = 1.0


def map_cells(runs: pd.DataFrame, metric: str, anchor_metric: str | None) -> pd.DataFrame:
    """One row per (kl_coef, anchor_tau): n, policy mean, anchor mean, gain over τ=1 (point, lo, hi) and
    its pairing. Columns: kl_coef, anchor_tau, n, policy, anchor, gain, gain_lo, gain_hi, p, pairing."""
    df = style.as_frame(runs, (*REQUIRED, metric))
    rows = []
    for (beta, tau), cell in df.groupby(["kl_coef", "anchor_tau"], sort=True):
        base = df[(df["kl_coef"] == beta) & (df["anchor_tau"] == BASELINE_TAU)]
        got = None if tau == BASELINE_TAU or base.empty else tables.compare(cell, base, metric)
        vals = cell[metric].dropna()
        anchor = cell[anchor_metric].mean() if anchor_metric and anchor_metric in cell else math.nan  # NaN: none
        gain = (got[0].gain, *got[0].ci, got[0].p, got[1]) if got else (math.nan,) * 4 + ("",)
        row = dict(kl_coef=beta, anchor_tau=tau, n=len(vals), policy=vals.mean(), anchor=anchor)
        rows.append(row | dict(zip(("gain", "gain_lo", "gain_hi", "p", "pairing"), gain)))
    return pd.DataFrame(rows)


@style.styled
def make(runs: pd.DataFrame, metric: str, anchor_metric: str | None = None, *, title: str | None = None) -> Figure:
    """`runs`: analysis.load's runs frame (kl_coef, anchor_tau, seed and the metric columns). Rows β
    (top: smallest), columns τ (left: 1.0, the fixed anchor). Three panels: policy, anchor, gain over τ=1."""
    cells = map_cells(runs, metric, anchor_metric)
    betas = sorted(cells["kl_coef"].unique())
    taus = sorted(cells["anchor_tau"].unique(), reverse=True)
    label, scale = style.metric_label(metric)
    fig, axs = style.new_figure(17.0, 0.75 * len(betas) + 2.6, 1, 3)
    grid = lambda col: cells.pivot(index="kl_coef", columns="anchor_tau", values=col).reindex(betas)[taus]  # noqa: E731
    _heat(ax=axs[0], values=grid("policy") * scale, text=_acc_text(grid("policy") * scale, grid("n")), cmap="viridis")
    axs[0].set_title(f"final {label}")
    if anchor_metric and cells["anchor"].notna().any():
        _heat(ax=axs[1], values=grid("anchor") * scale, text=_acc_text(grid("anchor") * scale, None), cmap="viridis")
        axs[1].set_title("EMA anchor: final greedy accuracy (τ=1: the fixed start)")
    else:
        axs[1].set_visible(False)
    g, lo, hi = grid("gain") * 100, grid("gain_lo") * 100, grid("gain_hi") * 100
    lim = float(np.nanmax(np.abs(np.r_[g.to_numpy().ravel(), 1.0])))
    _heat(ax=axs[2], values=g, text=_gain_text(g, lo, hi, grid("pairing")), cmap="RdBu", vlim=(-lim, lim))
    _mark_clear(axs[2], lo, hi)
    axs[2].set_title("gain over τ=1 at the same β: % relative [95% CI]")
    for ax in axs:
        ax.set_xticks(range(len(taus)), [f"{t:g}" for t in taus])
        ax.set_yticks(range(len(betas)), [f"{b:g}" for b in betas])
        ax.set(xlabel=style.knob_label("anchor_tau"), ylabel=style.knob_label("kl_coef"))
        ax.grid(False)
    note = (
        "cells: mean over seeds (n = seeds); gain: relative gain of the seed means, paired over seeds (p) or "
        "unpaired (u), 95% CI of the exact permutation test (inf: too few seeds to bound it); "
        "boxed: CI excludes 0. No stability boundary drawn: its quantities "
        "are not logged (docs/results.md, the β × τ map)."
    )
    return style.finish(fig, title, note)


def _heat(ax: Axes, values: pd.DataFrame, text: list[list[str]], cmap: str, vlim: tuple | None = None) -> None:
    arr = values.to_numpy(dtype=float)
    lo, hi = vlim or (np.nanmin(arr), np.nanmax(arr))
    colors = matplotlib.colormaps[cmap].with_extremes(bad="#eeeeee")  # empty cells grey
    im = ax.imshow(np.ma.masked_invalid(arr), cmap=colors, vmin=lo, vmax=hi, aspect="auto")
    ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.03)
    mid = (lo + hi) / 2
    for i, row in enumerate(text):
        for j, s in enumerate(row):
            v = arr[i, j]
            dark = cmap == "viridis" and np.isfinite(v) and v < mid  # white text on viridis' dark end
            dark = dark or (cmap == "RdBu" and np.isfinite(v) and abs(v) > 0.6 * hi)
            ax.text(j, i, s, ha="center", va="center", fontsize=8, color="white" if dark else "black")


def _acc_text(acc: pd.DataFrame, n: pd.DataFrame | None) -> list[list[str]]:
    text = acc.map(lambda v: f"{v:.1f}" if np.isfinite(v) else "—")
    if n is not None:
        text += n.map(lambda v: f"\nn={int(v)}" if np.isfinite(v) else "")
    return text.to_numpy().tolist()


def _gain_text(g: pd.DataFrame, lo: pd.DataFrame, hi: pd.DataFrame, pairing: pd.DataFrame) -> list[list[str]]:
    end = lambda x: f"{x:+.1f}" if np.isfinite(x) else "-inf" if x < 0 else "+inf"  # noqa: E731

    def cell(i: int, j: int) -> str:
        v, a, b = g.iat[i, j], lo.iat[i, j], hi.iat[i, j]
        if g.columns[j] == BASELINE_TAU:
            return "baseline"
        if not np.isfinite(v):
            return "—"
        ci = f"\n[{end(a)}, {end(b)}]" if not (np.isnan(a) or np.isnan(b)) else ""
        return f"{v:+.1f}{ci} {'p' if str(pairing.iat[i, j]).startswith('paired') else 'u'}"

    return [[cell(i, j) for j in range(g.shape[1])] for i in range(g.shape[0])]


def _mark_clear(ax: Axes, lo: pd.DataFrame, hi: pd.DataFrame) -> None:
    """A black box around every cell whose CI excludes 0."""
    for i in range(lo.shape[0]):
        for j in range(lo.shape[1]):
            a, b = lo.iat[i, j], hi.iat[i, j]
            if a > 0 or b < 0:  # NaN compares False
                ax.add_patch(Rectangle((j - 0.48, i - 0.48), 0.96, 0.96, fill=False, lw=2, ec="black"))
