"""Ablation: a final metric vs one knob (τ, period, k as lines; KL type as bars), mean ± CI over seeds."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from analysis import stats
from analysis.figures import style


@style.styled
def make(
    runs: pd.DataFrame,
    knob: str,
    metric: str,
    *,
    hue: str | None = None,
    reps: int = 1000,
    seed: int = 0,
    title: str | None = None,
) -> Figure:
    """`metric` (e.g. "final/eval/math_tiny/acc") against `knob` (e.g. "anchor_tau"), columns of analysis.load's
    runs frame; `hue`: a column splitting the runs into lines / bar groups. Bars when the knob is not numeric."""
    for col in (knob, metric, *([hue] if hue else [])):
        if col not in runs:
            raise ValueError(f"column {col!r} not in the runs frame")
    df = runs.dropna(subset=[knob, metric]).assign(_hue=runs[hue] if hue else "all runs")
    if df.empty:
        raise ValueError(f"no run has both {knob!r} and {metric!r}")
    categorical = not pd.api.types.is_numeric_dtype(df[knob]) or df[knob].dtype == bool
    summary = stats.summarize(df, metric, ["_hue", knob], reps=reps, seed=seed)
    label, scale = style.metric_label(metric)
    fig, (ax,) = style.new_figure(6.4, 4.2)
    (_bars if categorical else _lines)(ax, summary, knob, scale)
    ax.set(xlabel=style.knob_label(knob), ylabel=label)
    ax.legend(loc="best", frameon=False, title=hue)
    return style.finish(fig, title, "error bars: 95% bootstrap CI over seeds; n = runs per point")


def _yerr(s: pd.DataFrame, scale: float) -> np.ndarray:
    lo = (s["mean"] - s["ci_low"]).fillna(0).clip(lower=0)
    hi = (s["ci_high"] - s["mean"]).fillna(0).clip(lower=0)
    return np.vstack([lo, hi]) * scale


def _lines(ax: Axes, summary: pd.DataFrame, knob: str, scale: float) -> None:
    colors = style.group_colors(summary["_hue"])
    for name, s in summary.groupby("_hue", sort=True):
        s = s.sort_values(knob)
        lo, hi = int(s["n"].min()), int(s["n"].max())
        label = f"{name} (n={lo})" if lo == hi else f"{name} (n={lo}–{hi})"
        yerr = _yerr(s, scale)
        ax.errorbar(s[knob], s["mean"] * scale, yerr=yerr, color=colors[name], marker="o", capsize=3, label=label)
    values = summary[knob].astype(float)
    if values.min() >= 0 and values.max() / max(values[values > 0].min(), 1e-12) > 50:
        ax.set_xscale("symlog", linthresh=max(values[values > 0].min(), 1e-12))
    ax.set_xticks(sorted(values.unique()))
    ax.set_xticklabels([f"{v:g}" for v in sorted(values.unique())], rotation=0)


def _bars(ax: Axes, summary: pd.DataFrame, knob: str, scale: float) -> None:
    cats = sorted(summary[knob].astype(str).unique())
    hues = sorted(summary["_hue"].unique())
    width = 0.8 / len(hues)
    colors = style.group_colors(hues)
    for j, name in enumerate(hues):
        s = summary[summary["_hue"] == name].assign(_c=lambda d: d[knob].astype(str))
        x = np.array([cats.index(c) for c in s["_c"]]) + (j - (len(hues) - 1) / 2) * width
        bars = ax.bar(x, s["mean"] * scale, width, yerr=_yerr(s, scale), capsize=3, color=colors[name], label=str(name))
        ax.bar_label(bars, labels=[f"n={int(n)}" for n in s["n"]], fontsize=7, padding=2)
    ax.set_xticks(range(len(cats)))
    long = max(map(len, cats)) > 8
    ax.set_xticklabels(cats, rotation=20 if long else 0, ha="right" if long else "center")
