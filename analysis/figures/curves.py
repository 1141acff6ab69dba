"""Curves vs training iteration, mean ± CI over seeds, from the metrics frame of analysis.load (one row per run x
iteration; one line per method).

    learning_curves    the policy's and the EMA anchor's eval metric
    training_dynamics  the KL estimate and the anchor drift
    kl_probe           the exact KL beside its estimate on the fixed probe set (kl/exact, kl/estimate_on_probe), one
                       panel per method (docs/run-record.md, "Metric keys")
"""

from __future__ import annotations

import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from analysis import stats
from analysis.figures import style

GROUP = "variant"  # one line (kl_probe: one panel) per method
EXACT, ESTIMATE = "kl/exact", "kl/estimate_on_probe"


def _band(
    ax: Axes,
    metrics: pd.DataFrame,
    metric: str,
    *,
    reps: int,
    seed: int,
    scale: float = 1.0,
    linestyle: str = "-",
    label: str | None = None,
    colors: dict[str, str] | None = None,
) -> None:
    """Plot mean ± bootstrap-CI band over runs of `metric` vs iteration, one line per method that logged it, named
    after the method or `label`."""
    curves = stats.summarize(metrics, metric, [GROUP, "iteration"], reps=reps, seed=seed)
    for i, (name, c) in enumerate(curves.groupby(GROUP, sort=True)):
        col = (colors or {}).get(name, style.color(i))
        # later lines thinner, with their own marker, so identical curves stay visible
        marker = style.MARKERS[i % len(style.MARKERS)]
        look = dict(lw=max(1.0, 2.6 - 0.6 * i), marker=marker, ms=4 if len(c) < 30 else 0, zorder=3 + i)
        line_label = f"{label or name} (n={int(c['n'].max())})"
        ax.plot(c["iteration"], c["mean"] * scale, linestyle=linestyle, color=col, label=line_label, **look)
        ok = c["ci_low"].notna()
        lo, hi = c.loc[ok, "ci_low"] * scale, c.loc[ok, "ci_high"] * scale
        ax.fill_between(c.loc[ok, "iteration"], lo, hi, color=col, alpha=style.CI_ALPHA, lw=0)


def _row(
    metrics: pd.DataFrame, panels: list[tuple[str, str]], *, reps: int, seed: int, title: str | None, **kw
) -> Figure:
    """A row of panels, one per (metric, panel title): each method's mean ± CI band vs iteration, a colour per method
    shared across the panels. `kw`: new_figure's (e.g. sharey)."""
    fig, axs = style.new_figure(5.2 * len(panels) + 0.6, 4.2, 1, len(panels), **kw)
    colors = style.group_colors(metrics[GROUP].dropna())
    for ax, (m, name) in zip(axs, panels):
        label, scale = style.metric_label(m)
        _band(ax, metrics, m, reps=reps, seed=seed, scale=scale, colors=colors)
        ax.set(xlabel="training iteration (rollout batches)", ylabel=label, title=name)
    axs[0].legend(loc="best", frameon=False)
    return style.finish(fig, title, style.CI_NOTE + "; n = runs (seeds) per line")


@style.styled
def learning_curves(
    metrics: pd.DataFrame,
    metric: str,
    anchor_metric: str | None = None,
    *,
    reps: int = 1000,
    seed: int = 0,
    title: str | None = None,
) -> Figure:
    """`metric`: e.g. "eval/math_tiny/acc"; `anchor_metric`: e.g. "eval_anchor/math_tiny/acc" (a second panel,
    skipped when None or never logged)."""
    if metric not in metrics or metrics[metric].notna().sum() == 0:
        raise ValueError(f"metric {metric!r} was never logged")
    panels = [(metric, "policy")]
    if anchor_metric and anchor_metric in metrics and metrics[anchor_metric].notna().any():
        panels.append((anchor_metric, "EMA anchor"))
    return _row(metrics, panels, reps=reps, seed=seed, title=title, sharey=True)


@style.styled
def training_dynamics(metrics: pd.DataFrame, *, reps: int = 1000, seed: int = 0, title: str | None = None) -> Figure:
    """Two panels (kl/value, the anchor drift ‖θ−θ_ema‖/‖θ‖); a panel whose metric was never logged is left out.
    Raises ValueError if neither was logged."""
    panels = [m for m in ("kl/value", "anchor/drift") if m in metrics and metrics[m].notna().any()]
    if not panels:
        raise ValueError("neither 'kl/value' nor 'anchor/drift' was logged")
    return _row(metrics, [(m, m) for m in panels], reps=reps, seed=seed, title=title)


@style.styled
def kl_probe(metrics: pd.DataFrame, *, reps: int = 1000, seed: int = 0, title: str | None = None) -> Figure:
    """One panel per method with both curves; raises ValueError if no run logged the probe."""
    if any(m not in metrics or metrics[m].notna().sum() == 0 for m in (EXACT, ESTIMATE)):
        raise ValueError(f"no run logged {EXACT} and {ESTIMATE} (trainer.probe_every = 0, or the verl backend)")
    probed = metrics[metrics[EXACT].notna()]
    names = sorted(probed[GROUP].dropna().unique())
    fig, axs = style.panel_grid(len(names), 4.6, 3.6, (0.6, 0.0))
    for ax, name in zip(axs, names):
        sub = probed[probed[GROUP] == name]
        _band(ax, sub, EXACT, reps=reps, seed=seed, label="exact", colors={name: style.color(0)})
        _band(ax, sub, ESTIMATE, reps=reps, seed=seed, linestyle="--", label="estimate", colors={name: style.color(1)})
        ax.axhline(0.0, color="0.6", lw=0.8)
        ax.set(xlabel="training iteration", ylabel="KL(policy, anchor) on the probe (nats)", title=name)
        ax.legend(loc="best", frameon=False, fontsize="small")
    note = style.CI_NOTE + "; exact = full-vocabulary KL, estimate = the loss's estimator on the same tokens"
    return style.finish(fig, title, note)
