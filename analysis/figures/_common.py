"""Shared plotting helpers for the figure modules (no I/O)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from analysis import stats
from analysis.figures import style


def as_frame(rows: Any, required: Iterable[str]) -> pd.DataFrame:
    """A DataFrame from a list of dicts or a DataFrame; raises if it is empty or lacks columns."""
    df = rows.copy() if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    missing = [c for c in required if c not in df]
    if df.empty or missing:
        raise ValueError(f"need a non-empty table with columns {list(required)}; missing {missing}")
    return df


def band(
    ax: Axes,
    metrics: pd.DataFrame,
    metric: str,
    group: str,
    *,
    reps: int,
    seed: int,
    scale: float = 1.0,
    linestyle: str = "-",
    label_suffix: str = "",
    colors: dict[str, str] | None = None,
) -> int:
    """Plot mean ± bootstrap-CI band over runs of `metric` vs iteration, one line per group.

    Returns the number of lines drawn (0 when the metric was never logged)."""
    if metric not in metrics or metrics[metric].notna().sum() == 0:
        return 0
    curves = stats.curve_bands(metrics, metric, group=group, reps=reps, seed=seed)
    for i, (name, c) in enumerate(curves.groupby(group, sort=True)):
        col = (colors or {}).get(name, style.color(i))
        # later lines thinner, with their own marker, so identical curves stay visible
        marker = style.MARKERS[i % len(style.MARKERS)]
        look = dict(lw=max(1.0, 2.6 - 0.6 * i), marker=marker, ms=4 if len(c) < 30 else 0, zorder=3 + i)
        label = f"{name}{label_suffix} (n={int(c['n'].max())})"
        ax.plot(c["iteration"], c["mean"] * scale, linestyle=linestyle, color=col, label=label, **look)
        ok = c["ci_low"].notna()
        lo, hi = c.loc[ok, "ci_low"] * scale, c.loc[ok, "ci_high"] * scale
        ax.fill_between(c.loc[ok, "iteration"], lo, hi, color=col, alpha=style.CI_ALPHA, lw=0)
    return curves[group].nunique()


def curve_row(
    metrics: pd.DataFrame, panels: list[tuple[str, str]], group: str, *, reps: int, seed: int, title: str | None, **kw
) -> Figure:
    """A row of panels, one per (metric, panel title): each group's mean ± CI band vs iteration, a colour per group
    shared across the panels. `kw`: new_figure's (e.g. sharey)."""
    fig, axs = style.new_figure(5.2 * len(panels) + 0.6, 4.2, 1, len(panels), **kw)
    colors = group_colors(metrics[group].dropna())
    for ax, (m, name) in zip(axs, panels):
        label, scale = style.metric_label(m)
        band(ax, metrics, m, group, reps=reps, seed=seed, scale=scale, colors=colors)
        ax.set(xlabel="training iteration (rollout batches)", ylabel=label, title=name)
    axs[0].legend(loc="best", frameon=False)
    return style.finish(fig, title, style.CI_NOTE + "; n = runs (seeds) per line")


def group_colors(names: Iterable[str]) -> dict[str, str]:
    """A stable colour per group name (sorted), shared across panels."""
    return {n: style.color(i) for i, n in enumerate(sorted(set(names)))}


def positive(values: Any) -> tuple[np.ndarray, np.ndarray]:
    """(|values| floored at style.FLOOR for a log axis, mask of values at or below the floor)."""
    v = np.abs(np.asarray(values, dtype=float))
    at_floor = ~(v > style.FLOOR)
    return np.where(at_floor, style.FLOOR, v), at_floor
