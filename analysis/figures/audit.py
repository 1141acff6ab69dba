"""The figures of `emapg figures`, each a function of one list of audit records (analysis.audit_schema; a list of
dicts or a DataFrame) returning a Figure, with no I/O.

    kl_estimators_bias  |bias| of the value and of the gradient, and variances, per KL estimator (log x)
    topk_variance       Top-k KL vs k, from sampled (k=0) to exact (k=|V|): variance and bias of value and gradient
    anchor_horizon      EMA anchor half-life and time constant (iterations) vs τ, per update period
    stability_region    the stable (α, βc) region of our toy quadratic EMA-PG model per η (docs/algorithm.md; not
                        the paper's theorem)
"""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from analysis.figures import style

ESTIMATOR_REQUIRED = ("estimator", "direction", "tail", "k", "value_bias", "grad_bias", "variance", "grad_variance")
VERDICT = {True: "✓", False: "✗"}


def _row_label(r: Any) -> str:
    """ "topk (reverse, k=32, unbiased)", "k3 (reverse)"."""
    extra = [r["direction"]]
    if r.get("k") is not None and r["k"] == r["k"]:
        extra.append(f"k={int(r['k'])}")
    tail = r.get("tail")
    if isinstance(tail, str) and tail:  # None / NaN (from a frame) = no tail
        extra.append(tail)
    label = f"{r['estimator']} ({', '.join(extra)})"
    if "value_unbiased" in r and "grad_unbiased" in r:  # the audit's verdicts
        label += f"  value {VERDICT[bool(r['value_unbiased'])]} grad {VERDICT[bool(r['grad_unbiased'])]}"
    return label


@style.styled
def kl_estimators_bias(rows: Any) -> Figure:
    """`rows`: estimator-table records (analysis.audit_schema.ESTIMATOR_FIELDS)."""
    df = style.as_frame(rows, ESTIMATOR_REQUIRED)
    labels = [_row_label(r) for r in df.to_dict("records")]
    fig, axs = style.new_figure(11.0, 0.32 * len(df) + 1.9, 1, 2, sharey=True)
    _pair(axs[0], labels, df["value_bias"], df["grad_bias"], "|bias| (nats; log scale)")
    _pair(axs[1], labels, df["variance"], df["grad_variance"], "variance per token (nats²; log scale)")
    axs[0].invert_yaxis()
    axs[0].set_ylabel("estimator (direction, k, tail)  audit verdicts")
    style.finish(fig, "KL estimators: bias and variance of the value and of the gradient")
    floor = f"exactly 0 or < {style.FLOOR:.0e} (drawn at the floor)"
    handles = [
        Patch(color=style.color(0), label="value"),
        Patch(color=style.color(1), label="gradient"),
        Patch(facecolor="white", edgecolor="0.3", hatch="///", label=floor),
    ]
    what = "bias: |E[estimate] − exact| as reported by the audit; ✓ / ✗: the audit's unbiasedness verdict"
    return style.legend_below(fig, handles, what, ncols=3)


def _pair(ax: Axes, labels: list[str], value: Any, grad: Any, xlabel: str) -> None:
    y = np.arange(len(labels))
    for off, vals, col in ((-0.2, value, style.color(0)), (0.2, grad, style.color(1))):
        v, floor = style.positive(vals)
        bars = ax.barh(y + off, v, 0.4, color=col)
        for b, f in zip(bars, floor):
            if f:
                b.set_hatch("///")
                b.set_alpha(0.5)
    ax.set_xscale("log")
    ax.set_yticks(y)
    ax.set_yticklabels(labels)
    ax.set_xlabel(xlabel)


TOPK_REQUIRED = ("direction", "tail", "k", "value_variance", "grad_variance")
DASHES = {"paper": "-", "unbiased": "--", "none": ":"}
TOPK_PANELS = (
    ("value_variance", "value variance", "variance (nats²; log scale)"),
    ("grad_variance", "gradient variance", "variance (nats²; log scale)"),
    ("value_bias", "value |bias|", "|bias| (nats; log scale)"),
    ("grad_bias", "gradient |bias|", "|bias| (nats; log scale)"),
)
MARK = dict(xycoords=("data", "axes fraction"), textcoords="offset points", va="center", fontsize=8, color="0.3")


@style.styled
def topk_variance(rows: Any) -> Figure:
    """`rows`: top-k sweep records (analysis.audit_schema.TOPK_FIELDS). One line per (direction: colour, tail: line
    style); bias panels are drawn when the rows carry biases. k=|V| is the largest k in the rows."""
    df = style.as_frame(rows, TOPK_REQUIRED)
    df["tail"] = df["tail"].fillna("none")
    v = int(df["k"].max())
    panels = [p for p in TOPK_PANELS if p[0] in df]
    nrows = 2 if len(panels) > 2 else 1
    fig, axs = style.new_figure(11.0, 3.9 * nrows + 0.5, nrows, 2, sharex=True)
    directions = sorted(df["direction"].unique(), key=lambda d: d != "reverse")
    for ax, (col, what, ylabel) in zip(axs, panels):
        for (direction, tail), s in df.groupby(["direction", "tail"], sort=True):
            s = s.sort_values("k")
            c = style.color(directions.index(direction))
            y, floor = style.positive(s[col])
            ax.plot(s["k"], y, DASHES.get(tail, "-."), color=c, marker="o", ms=3, label=f"{direction}, tail={tail}")
            ax.plot(s["k"][floor], y[floor], "x", color=c, ms=7)
        ax.set_yscale("log")
        ax.set(ylabel=ylabel, title=f"{what} vs k")
        for x, text, ha, dx in ((0, "k=0: sampled\n(K4 / K5)", "left", 4), (v, f"k=|V|={v}:\nexact", "right", -4)):
            ax.axvline(x, color="0.5", ls=":", lw=1)
            ax.annotate(text, (x, 0.55), xytext=(dx, 0), ha=ha, **MARK)
    for ax in axs:
        ax.set_xlabel("k (vocabulary entries computed exactly)")
    style.finish(fig, "Top-k KL interpolates between the sampled (k=0) and the exact (k=|V|) estimator")
    handles, labels = axs[0].get_legend_handles_labels()
    foot = f"×: 0 or below {style.FLOOR:.0e} (float64 rounding), drawn at the floor"
    return style.legend_below(fig, handles, foot, min(3, len(labels)), labels)


@style.styled
def anchor_horizon(rows: Any) -> Figure:
    """`rows`: anchor-horizon records (analysis.audit_schema.HORIZON_FIELDS), one line per period."""
    df = style.as_frame(rows, ("tau", "period", "half_life", "time_constant"))
    fig, axs = style.new_figure(11.0, 4.3, 1, 2, sharex=True)
    panels = (
        (axs[0], "half_life", "half-life (iterations; log scale)"),
        (axs[1], "time_constant", "time constant P/(1−τ) (iterations; log scale)"),
    )
    for ax, col, ylabel in panels:
        for i, (period, s) in enumerate(sorted(df.groupby("period"), key=lambda t: t[0])):
            s = s.sort_values("tau")
            ax.plot(s["tau"], s[col], marker="o", ms=3, color=style.color(i), label=f"P = {period:g}")
        ax.set_yscale("log")
        ax.set(xlabel="EMA weight τ on the old anchor (unitless)", ylabel=ylabel)
    axs[0].legend(loc="upper left", frameon=False, title="update period")
    note = "one EMA update every P iterations: θ_ema ← τ·θ_ema + (1−τ)·θ"
    return style.finish(fig, f"EMA anchor horizon {style.OURS_ARITHMETIC}", note)


MAX_PANELS = 6


@style.styled
def stability_region(rows: Any) -> Figure:
    """`rows`: stability-grid records (analysis.audit_schema.STABILITY_FIELDS); one panel per η
    (at most 6, evenly spaced over the η values present)."""
    df = style.as_frame(rows, ("alpha", "beta_c", "eta", "stable"))
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
    style.finish(fig, f"EMA-PG stability region {style.OURS_TOY}")
    handles = [
        Patch(color=style.color(2), label="stable (spectral radius < 1)"),
        Patch(color="#d9d9d9", label="unstable"),
    ]
    return style.legend_below(fig, handles, model, ncols=2)
