"""Shared plotting helpers for the figure modules (no I/O)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

from analysis.figures import style


def as_frame(rows: Any, required: Iterable[str]) -> pd.DataFrame:
    """A DataFrame from a list of dicts or a DataFrame; raises if it is empty or lacks columns."""
    df = rows.copy() if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    missing = [c for c in required if c not in df]
    if df.empty or missing:
        raise ValueError(f"need a non-empty table with columns {list(required)}; missing {missing}")
    return df


def group_colors(names: Iterable[str]) -> dict[str, str]:
    """A stable colour per group name (sorted), shared across panels."""
    return {n: style.color(i) for i, n in enumerate(sorted(set(names)))}


def positive(values: Any) -> tuple[np.ndarray, np.ndarray]:
    """(|values| floored at style.FLOOR for a log axis, mask of values at or below the floor)."""
    v = np.abs(np.asarray(values, dtype=float))
    at_floor = ~(v > style.FLOOR)
    return np.where(at_floor, style.FLOOR, v), at_floor
