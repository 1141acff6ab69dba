"""Training dynamics: the KL estimate and the anchor drift vs iteration, mean ± CI over seeds."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from analysis.figures import _common, style


@style.styled
def make(
    metrics: pd.DataFrame,
    *,
    kl_metric: str = "kl/value",
    drift_metric: str = "anchor/drift",
    group: str = "variant",
    reps: int = 1000,
    seed: int = 0,
    title: str | None = None,
) -> Figure:
    """Two panels (the KL value, the anchor drift ‖θ−θ_ema‖/‖θ‖); a panel whose metric was never
    logged is left out. Raises ValueError if neither was logged."""
    panels = [m for m in (kl_metric, drift_metric) if m in metrics and metrics[m].notna().any()]
    if not panels:
        raise ValueError(f"neither {kl_metric!r} nor {drift_metric!r} was logged")
    return _common.curve_row(metrics, [(m, m) for m in panels], group, reps=reps, seed=seed, title=title)
