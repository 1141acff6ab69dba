"""The one place for figure styling (sizes, fonts, colours, axis labels with units), saving, and the helpers the
figure modules share.

Figures are built on the Agg canvas directly (`new_figure`), without pyplot: no global figure
registry, no backend switch, headless-safe, and nothing leaks across a long report.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import matplotlib as mpl
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

RC = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 8.5,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "figure.dpi": 100,
    "savefig.dpi": 150,
    "savefig.bbox": "tight",
    "pdf.fonttype": 42,
    "lines.linewidth": 1.8,
}
# colour-blind-safe (Okabe-Ito); GRPO variants get greys/blues, EMA-PG variants warm colours
PALETTE = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#000000"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
CI_ALPHA = 0.2
CI_NOTE = "shaded: 95% percentile-bootstrap CI over seeds"
OURS_TOY = "[ours: toy quadratic model, not the paper's theorem]"
OURS_ARITHMETIC = "[ours: arithmetic on the EMA rule, not a result of the paper]"
FLOOR = 1e-15  # log-scale stand-in for 0 or float64 rounding (drawn hatched / marked, labelled)

KNOBS = {  # knob -> (short name for titles, axis label with unit)
    "anchor_tau": ("EMA weight τ", "EMA weight τ on the old anchor (unitless)"),
    "anchor_period": ("anchor update period", "anchor update period P (iterations)"),
    "kl_k": ("top-k size k", "top-k size k (vocabulary entries)"),
    "kl_type": ("KL estimator", "KL estimator"),
    "kl_tail": ("Top-k tail mode", "Top-k tail mode"),
    "kl_coef": ("KL coefficient β", "KL coefficient β (unitless)"),
}
METRIC_LABELS = {
    "kl/value": ("per-token KL estimate (nats)", 1.0),
    "anchor/drift": ("anchor drift ‖θ − θ_ema‖ / ‖θ‖ (relative)", 1.0),
    "train/reward": ("mean training reward", 1.0),
    "train/response_len": ("mean response length (tokens)", 1.0),
    "train/entropy": ("policy entropy (nats / token)", 1.0),
    "perf/tokens_per_s": ("throughput (tokens / s)", 1.0),
}


def styled(make: Callable[..., Figure]) -> Callable[..., Figure]:
    """Decorator for figure builders: run `make` with RC in force (rc is read when artists are created and saved)."""

    @functools.wraps(make)
    def wrapper(*args: Any, **kwargs: Any) -> Figure:
        with mpl.rc_context(RC):
            return make(*args, **kwargs)

    return wrapper


def new_figure(
    width: float = 6.4, height: float = 4.0, nrows: int = 1, ncols: int = 1, **kw: Any
) -> tuple[Figure, np.ndarray]:
    """(Figure on the Agg canvas, flat array of its axes); call inside a `styled` builder."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False, **kw)).ravel()


def panel_grid(n: int, width: float, height: float, pad: tuple[float, float], **kw: Any) -> tuple[Figure, np.ndarray]:
    """`n` panels of `width` x `height`, at most three a row (plus `pad`: the figure's margins); the grid's
    spare axes hidden. Returns the figure and its first `n` axes."""
    ncols = min(3, n)
    nrows = -(-n // ncols)
    fig, axs = new_figure(width * ncols + pad[0], height * nrows + pad[1], nrows, ncols, **kw)
    for ax in axs[n:]:
        ax.set_visible(False)
    return fig, axs[:n]


def legend_below(fig: Figure, handles: list, title: str, ncols: int, labels: list[str] | None = None) -> Figure:
    """A figure-wide legend under the panels, its `title` in small print (what the marks mean)."""
    kw = dict(loc="outside lower center", ncols=ncols, frameon=False, title=title, title_fontsize=8)
    fig.legend(handles=handles, labels=labels, **kw)
    return fig


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def group_colors(names: Iterable[str]) -> dict[str, str]:
    """A stable colour per group name (sorted), shared across panels."""
    return {n: color(i) for i, n in enumerate(sorted(set(names)))}


def positive(values: Any) -> tuple[np.ndarray, np.ndarray]:
    """(|values| floored at FLOOR for a log axis, mask of values at or below the floor)."""
    v = np.abs(np.asarray(values, dtype=float))
    at_floor = ~(v > FLOOR)
    return np.where(at_floor, FLOOR, v), at_floor


def as_frame(rows: Any, required: Iterable[str]) -> pd.DataFrame:
    """A DataFrame from a list of dicts or a DataFrame; raises if it is empty or lacks columns."""
    df = rows.copy() if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    missing = [c for c in required if c not in df]
    if df.empty or missing:
        raise ValueError(f"need a non-empty table with columns {list(required)}; missing {missing}")
    return df


def metric_label(metric: str) -> tuple[str, float]:
    """(axis label with unit, scale) for a metric key; accuracies are shown in percent."""
    if metric in METRIC_LABELS:
        return METRIC_LABELS[metric]
    m = re.match(r"^(?:final/|best/)?(eval|eval_anchor)/(?P<b>[^/]+)/(?P<m>acc|pass@\d+)$", metric)
    if m:
        who = "EMA anchor" if m[1] == "eval_anchor" else "policy"
        what = "greedy accuracy" if m["m"] == "acc" else m["m"]
        return f"{who} {what} on {m['b']} (%)", 100.0
    return metric, 1.0


def knob_label(knob: str) -> str:
    """Axis label with unit, e.g. "anchor update period P (iterations)"."""
    return KNOBS[knob][1] if knob in KNOBS else knob


def knob_name(knob: str) -> str:
    """Short name for titles, e.g. "EMA weight τ"."""
    return KNOBS[knob][0] if knob in KNOBS else knob


def finish(fig: Figure, title: str | None = None, note: str | None = None) -> Figure:
    """Add a suptitle and a small footnote (e.g. the CI definition, a provenance label)."""
    if title:
        fig.suptitle(title, fontsize=11.5)
    if note:
        fig.supxlabel(note, fontsize=7.5, color="0.35", ha="right", x=0.995)
    return fig


def save(fig: Figure, path_stem: str | Path) -> list[Path]:
    """Write <path_stem>.png and <path_stem>.pdf; returns both paths."""
    stem = Path(path_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".pdf")]
    with mpl.rc_context(RC):
        for p in paths:
            fig.savefig(p)
    return paths
