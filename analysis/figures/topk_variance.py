"""Top-k KL vs k, from sampled (k=0) to exact (k=|V|): variance and bias of the value and the gradient."""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure

from analysis.figures import _common, style

REQUIRED = ("direction", "tail", "k", "value_variance", "grad_variance")
DASHES = {"paper": "-", "unbiased": "--", "none": ":"}
PANELS = (
    ("value_variance", "value variance", "variance (nats²; log scale)"),
    ("grad_variance", "gradient variance", "variance (nats²; log scale)"),
    ("value_bias", "value |bias|", "|bias| (nats; log scale)"),
    ("grad_bias", "gradient |bias|", "|bias| (nats; log scale)"),
)
MARK = dict(xycoords=("data", "axes fraction"), textcoords="offset points", va="center", fontsize=8, color="0.3")


@style.styled
def make(rows: Any, *, vocab_size: int | None = None, title: str | None = None, note: str | None = None) -> Figure:
    """`rows`: top-k sweep records (analysis.audit_schema.TOPK_FIELDS). One line per
    (direction: colour, tail: line style); bias panels are drawn when the rows carry biases.
    `vocab_size` marks k=|V| (default: the largest k in the rows)."""
    df = _common.as_frame(rows, REQUIRED)
    df["tail"] = df["tail"].fillna("none")
    v = int(vocab_size or df["k"].max())
    panels = [p for p in PANELS if p[0] in df]
    nrows = 2 if len(panels) > 2 else 1
    fig, axs = style.new_figure(11.0, 3.9 * nrows + 0.5, nrows, 2, sharex=True)
    directions = sorted(df["direction"].unique(), key=lambda d: d != "reverse")
    for ax, (col, what, ylabel) in zip(axs, panels):
        for (direction, tail), s in df.groupby(["direction", "tail"], sort=True):
            s = s.sort_values("k")
            c = style.color(directions.index(direction))
            y, floor = _common.positive(s[col])
            ax.plot(s["k"], y, DASHES.get(tail, "-."), color=c, marker="o", ms=3, label=f"{direction}, tail={tail}")
            ax.plot(s["k"][floor], y[floor], "x", color=c, ms=7)
        ax.set_yscale("log")
        ax.set(ylabel=ylabel, title=f"{what} vs k")
        for x, text, ha, dx in ((0, "k=0: sampled\n(K4 / K5)", "left", 4), (v, f"k=|V|={v}:\nexact", "right", -4)):
            ax.axvline(x, color="0.5", ls=":", lw=1)
            ax.annotate(text, (x, 0.55), xytext=(dx, 0), ha=ha, **MARK)
    for ax in axs:
        ax.set_xlabel("k (vocabulary entries computed exactly)")
    style.finish(fig, title or "Top-k KL interpolates between the sampled (k=0) and the exact (k=|V|) estimator")
    handles, labels = axs[0].get_legend_handles_labels()
    foot = f"×: 0 or below {style.FLOOR:.0e} (float64 rounding), drawn at the floor"
    return style.legend_below(fig, handles, style.noted(foot, note), min(3, len(labels)), labels)
