"""Top-k KL: variance of the value and of the gradient vs k, from sampled (k=0) to exact (k=|V|)."""
from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure

from analysis.figures import _common, style

REQUIRED = ("direction", "tail", "k", "value_variance", "grad_variance")


@style.styled
def make(rows: Any, *, vocab_size: int | None = None, title: str | None = None,
         note: str | None = None) -> Figure:
    """`rows`: top-k sweep records (analysis.audit_schema.TOPK_FIELDS), one line per
    (direction, tail). `vocab_size` marks k=|V| (default: the largest k in the rows)."""
    df = _common.as_frame(rows, REQUIRED)
    v = int(vocab_size or df["k"].max())
    fig, axs = style.new_figure(11.0, 4.3, 1, 2, sharex=True)
    groups = sorted(df.groupby(["direction", df["tail"].fillna("none")]).groups)
    for ax, col, what in ((axs[0], "value_variance", "value"), (axs[1], "grad_variance", "gradient")):
        for i, (direction, tail) in enumerate(groups):
            s = df[(df["direction"] == direction) & (df["tail"].fillna("none") == tail)].sort_values("k")
            y, floor = _common.positive(s[col])
            ax.plot(s["k"], y, marker="o", ms=3, color=style.color(i), label=f"{direction}, tail={tail}")
            ax.plot(s["k"][floor], y[floor], "x", color=style.color(i), ms=7)
        ax.set_yscale("log")
        ax.set(xlabel="k (top-k entries computed exactly)", ylabel=f"variance of the {what} (log scale)",
               title=f"{what} variance vs k")
        ax.axvline(0, color="0.5", ls=":", lw=1)
        ax.axvline(v, color="0.5", ls=":", lw=1)
        ax.annotate("k=0: sampled\n(K4 / K5)", (0, 1), xycoords=("data", "axes fraction"),
                    xytext=(4, -4), textcoords="offset points", va="top", fontsize=8)
        ax.annotate(f"k=|V|={v}:\nexact", (v, 1), xycoords=("data", "axes fraction"),
                    xytext=(-4, -4), textcoords="offset points", va="top", ha="right", fontsize=8)
    axs[0].legend(loc="lower left", frameon=False)
    foot = f"×: exactly 0 (no sampled term), drawn at {style.FLOOR:.0e}"
    return style.finish(fig, title or "Top-k KL interpolates between the sampled and the exact estimator",
                        foot + (f"; {note}" if note else ""))
