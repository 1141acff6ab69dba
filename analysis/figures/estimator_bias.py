"""KL-estimator audit: |bias| of the value and of the gradient, and variances, per estimator (log x)."""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from analysis.figures import _common, style

REQUIRED = ("estimator", "direction", "tail", "k", "value_bias", "grad_bias", "variance", "grad_variance")
MARK = {True: "✓", False: "✗"}


def row_label(r: Any) -> str:
    """ "topk (reverse, k=32, unbiased)", "k3 (reverse)"."""
    extra = [r["direction"]]
    if r.get("k") is not None and r["k"] == r["k"]:
        extra.append(f"k={int(r['k'])}")
    tail = r.get("tail")
    if isinstance(tail, str) and tail:  # None / NaN (from a frame) = no tail
        extra.append(tail)
    label = f"{r['estimator']} ({', '.join(extra)})"
    if "value_unbiased" in r and "grad_unbiased" in r:  # the audit's verdicts
        label += f"  value {MARK[bool(r['value_unbiased'])]} grad {MARK[bool(r['grad_unbiased'])]}"
    return label


@style.styled
def make(rows: Any, *, title: str | None = None, note: str | None = None) -> Figure:
    """`rows`: estimator-table records (analysis.audit_schema.ESTIMATOR_FIELDS)."""
    df = _common.as_frame(rows, REQUIRED)
    labels = [row_label(r) for r in df.to_dict("records")]
    fig, axs = style.new_figure(11.0, 0.32 * len(df) + 1.9, 1, 2, sharey=True)
    _pair(axs[0], labels, df["value_bias"], df["grad_bias"], "|bias| (nats; log scale)")
    _pair(axs[1], labels, df["variance"], df["grad_variance"], "variance per token (nats²; log scale)")
    axs[0].invert_yaxis()
    axs[0].set_ylabel("estimator (direction, k, tail)  audit verdicts")
    style.finish(fig, title or "KL estimators: bias and variance of the value and of the gradient")
    floor = f"exactly 0 or < {style.FLOOR:.0e} (drawn at the floor)"
    handles = [
        Patch(color=style.color(0), label="value"),
        Patch(color=style.color(1), label="gradient"),
        Patch(facecolor="white", edgecolor="0.3", hatch="///", label=floor),
    ]
    what = "bias: |E[estimate] − exact| as reported by the audit; ✓ / ✗: the audit's unbiasedness verdict"
    return style.legend_below(fig, handles, style.noted(what, note), ncols=3)


def _pair(ax: Axes, labels: list[str], value: Any, grad: Any, xlabel: str) -> None:
    y = np.arange(len(labels))
    for off, vals, col in ((-0.2, value, style.color(0)), (0.2, grad, style.color(1))):
        v, floor = _common.positive(vals)
        bars = ax.barh(y + off, v, 0.4, color=col)
        for b, f in zip(bars, floor):
            if f:
                b.set_hatch("///")
                b.set_alpha(0.5)
    ax.set_xscale("log")
    ax.set_yticks(y)
    ax.set_yticklabels(labels)
    ax.set_xlabel(xlabel)
