"""EMA anchor effective horizon: half-life and time constant (iterations) vs τ, per update period."""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure

from analysis.figures import _common, style

REQUIRED = ("tau", "period", "half_life", "time_constant")


@style.styled
def make(rows: Any, *, title: str | None = None, note: str | None = None) -> Figure:
    """`rows`: anchor-horizon records (analysis.audit_schema.HORIZON_FIELDS), one line per period."""
    df = _common.as_frame(rows, REQUIRED)
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
    return style.finish(
        fig,
        title or f"EMA anchor horizon {style.OURS_ARITHMETIC}",
        style.noted("one EMA update every P iterations: θ_ema ← τ·θ_ema + (1−τ)·θ", note),
    )
