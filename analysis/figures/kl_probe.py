"""The exact KL beside its estimate: kl/exact and kl/estimate_on_probe on the fixed probe set vs iteration,
one panel per method (variant), mean ± CI over seeds (docs/run-record.md, "Metric keys")."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from analysis.figures import _common, style

EXACT, ESTIMATE = "kl/exact", "kl/estimate_on_probe"


@style.styled
def make(
    metrics: pd.DataFrame,
    *,
    group: str = "variant",
    reps: int = 1000,
    seed: int = 0,
    title: str | None = None,
) -> Figure:
    """One panel per group with both curves; raises ValueError if no run logged the probe."""
    if any(m not in metrics or metrics[m].notna().sum() == 0 for m in (EXACT, ESTIMATE)):
        raise ValueError(f"no run logged {EXACT} and {ESTIMATE} (trainer.probe_every = 0, or the verl backend)")
    probed = metrics[metrics[EXACT].notna()]
    names = sorted(probed[group].dropna().unique())
    fig, axs = style.panel_grid(len(names), 4.6, 3.6, (0.6, 0.0))
    for ax, name in zip(axs, names):
        sub = probed[probed[group] == name]
        _common.band(ax, sub, EXACT, group, reps=reps, seed=seed, label_suffix=": exact", colors={name: style.color(0)})
        _common.band(
            ax, sub, ESTIMATE, group, reps=reps, seed=seed, linestyle="--", label_suffix=": estimate",
            colors={name: style.color(1)},
        )  # fmt: skip
        for line in ax.get_lines():  # the panel's title names the method: keep "exact (n=..)" in the legend
            line.set_label(line.get_label().removeprefix(f"{name}: "))
        ax.axhline(0.0, color="0.6", lw=0.8)
        ax.set(xlabel="training iteration", ylabel="KL(policy, anchor) on the probe (nats)", title=name)
        ax.legend(loc="best", frameon=False, fontsize="small")
    note = style.CI_NOTE + "; exact = full-vocabulary KL, estimate = the loss's estimator on the same tokens"
    return style.finish(fig, title, note)
