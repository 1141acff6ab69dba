"""Learning curves: the policy's and the EMA anchor's eval metric vs iteration, mean ± CI over seeds."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from analysis.figures import _common, style


@style.styled
def make(
    metrics: pd.DataFrame,
    metric: str,
    anchor_metric: str | None = None,
    *,
    group: str = "variant",
    reps: int = 1000,
    seed: int = 0,
    title: str | None = None,
) -> Figure:
    """`metrics`: the metrics frame of analysis.load (one row per run x iteration).

    `metric`: e.g. "eval/math_tiny/acc"; `anchor_metric`: e.g. "eval_anchor/math_tiny/acc"
    (a second panel, skipped when None or never logged). One line per `group` value.
    """
    if metric not in metrics or metrics[metric].notna().sum() == 0:
        raise ValueError(f"metric {metric!r} was never logged")
    panels = [(metric, "policy")]
    if anchor_metric and anchor_metric in metrics and metrics[anchor_metric].notna().any():
        panels.append((anchor_metric, "EMA anchor"))
    return _common.curve_row(metrics, panels, group, reps=reps, seed=seed, title=title, sharey=True)
