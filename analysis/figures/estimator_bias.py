"""KL-estimator audit: |bias| of the value and of the gradient, and variances, per estimator (log x)."""
from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from analysis.figures import _common, style

REQUIRED = ("estimator", "direction", "tail", "k", "value_bias", "grad_bias", "variance", "grad_variance")


def row_label(r: Any) -> str:
    """"topk (reverse, k=32, unbiased)", "k3 (reverse)"."""
    extra = [r["direction"]]
    if r.get("k") is not None and r["k"] == r["k"]:
        extra.append(f"k={int(r['k'])}")
    tail = r.get("tail")
    if isinstance(tail, str) and tail:  # None / NaN (from a frame) = no tail
        extra.append(tail)
    return f"{r['estimator']} ({', '.join(extra)})"


@style.styled
def make(rows: Any, *, title: str | None = None, note: str | None = None) -> Figure:
    """`rows`: estimator-table records (analysis.audit_schema.ESTIMATOR_FIELDS)."""
    df = _common.as_frame(rows, REQUIRED)
    labels = [row_label(r) for r in df.to_dict("records")]
    fig, axs = style.new_figure(11.0, 0.32 * len(df) + 1.9, 1, 2, sharey=True)
    _pair(axs[0], labels, df["value_bias"], df["grad_bias"], "|bias| (nats; log scale)", "bias")
    _pair(axs[1], labels, df["variance"], df["grad_variance"],
          "variance per token (nats²; log scale)", "variance")
    axs[0].invert_yaxis()
    foot = f"hatched: exactly 0 or below {style.FLOOR:.0e} (drawn at the floor)"
    return style.finish(fig, title or "KL estimators: bias and variance of the value and the gradient",
                        foot + (f"; {note}" if note else ""))


def _pair(ax: Axes, labels: list[str], value: Any, grad: Any, xlabel: str, what: str) -> None:
    y = np.arange(len(labels))
    for off, vals, name, col in ((-0.2, value, f"value {what}", style.color(0)),
                                 (0.2, grad, f"gradient {what}", style.color(1))):
        v, floor = _common.positive(vals)
        bars = ax.barh(y + off, v, 0.4, color=col, label=name)
        for b, f in zip(bars, floor):
            if f:
                b.set_hatch("///")
                b.set_alpha(0.5)
    ax.set_xscale("log")
    ax.set_yticks(y)
    ax.set_yticklabels(labels)
    ax.set_xlabel(xlabel)
    ax.legend(loc="lower right", frameon=False)
