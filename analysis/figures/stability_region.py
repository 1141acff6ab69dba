"""Stability region of our toy quadratic EMA-PG model (docs/algorithm.md; not the paper's theorem)."""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from analysis.figures import _common, style

REQUIRED = ("alpha", "beta_c", "eta", "stable")
MAX_PANELS = 6


@style.styled
def make(rows: Any, *, title: str | None = None, note: str | None = None) -> Figure:
    """`rows`: stability-grid records (analysis.audit_schema.STABILITY_FIELDS); one panel per η
    (at most 6, evenly spaced over the η values present)."""
    df = _common.as_frame(rows, REQUIRED)
    etas = np.sort(df["eta"].unique())
    if len(etas) > MAX_PANELS:
        etas = etas[np.linspace(0, len(etas) - 1, MAX_PANELS).round().astype(int)]
    fig, axs = style.panel_grid(len(etas), 4.0, 3.6, (0.4, 0.6), sharex=True, sharey=True)
    cmap = ListedColormap(["#d9d9d9", style.color(2)])
    for ax, eta in zip(axs, etas):
        s = df[df["eta"] == eta]
        grid = s.pivot_table(index="beta_c", columns="alpha", values="stable", aggfunc="min")
        if grid.size == len(s) and not grid.isna().any().any():
            ax.pcolormesh(grid.columns, grid.index, grid.to_numpy(float), cmap=cmap, vmin=0, vmax=1, shading="nearest")
        else:
            ax.scatter(
                s["alpha"], s["beta_c"], c=s["stable"].astype(float), cmap=cmap, vmin=0, vmax=1, marker="s", s=12
            )
        ax.set_title(f"η = {eta:g}")
        ax.grid(False)
        ax.set(xlabel="step size α (unitless)", ylabel="β·c: KL coef × curvature (unitless)")
        ax.tick_params(labelbottom=True, labelleft=True)  # shared axes hide inner labels
    model = "θ' = θ + α[a(θ*−θ) − βc(θ−θ_ema)],  θ_ema' = ηθ_ema + (1−η)θ'"
    if "a" in df and df["a"].nunique() == 1:
        model += f",  a = {df['a'].iloc[0]:g}"
    style.finish(fig, title or f"EMA-PG stability region {style.OURS_TOY}")
    handles = [
        Patch(color=style.color(2), label="stable (spectral radius < 1)"),
        Patch(color="#d9d9d9", label="unstable"),
    ]
    return style.legend_below(fig, handles, style.noted(model, note), ncols=2)
