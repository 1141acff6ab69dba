"""The records `emapg figures` renders: the contract between `ema_pg_core.audit` and analysis.

The core computes the numbers (exact enumeration / Monte Carlo, no training) and returns plain
data; analysis only renders it and never imports the core. The records are one dict:

    {
      "estimator_table": [ESTIMATOR_FIELDS rows],   # KL-estimator table + bias figure
      "topk_sweep":      [TOPK_FIELDS rows],        # variance vs k, k = 0 ... |V|
      "anchor_horizon":  [HORIZON_FIELDS rows],     # EMA half-life / time constant vs tau, period
      "stability_grid":  [STABILITY_FIELDS rows],   # our toy quadratic model (docs/algorithm.md)
      "meta":            {...}                      # optional: seed, vocab sizes, n draws, ...;
    }                                               # shown as provenance in the index

Every key is optional: what is missing is skipped, with a note in the index. Rows may carry
extra fields; the listed ones are required (None is allowed where the type says so).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

ESTIMATOR_FIELDS = {
    "estimator": str,
    "direction": str,  # direction: "reverse" | "forward"
    "tail": (str, type(None)),
    "k": (int, type(None)),
    "value_bias": float,
    "grad_bias": float,
    "value_unbiased": bool,
    "grad_unbiased": bool,
    "variance": float,
    "grad_variance": float,
    "bytes_per_token": int,
}
TOPK_FIELDS = {
    "direction": str,
    "tail": (str, type(None)),
    "k": int,
    "value_variance": float,
    "grad_variance": float,
    "value_bias": float,
    "grad_bias": float,
}
HORIZON_FIELDS = {"tau": float, "period": int, "half_life": float, "time_constant": float}
STABILITY_FIELDS = {"alpha": float, "beta_c": float, "eta": float, "stable": bool}
SCHEMA = {
    "estimator_table": ESTIMATOR_FIELDS,
    "topk_sweep": TOPK_FIELDS,
    "anchor_horizon": HORIZON_FIELDS,
    "stability_grid": STABILITY_FIELDS,
}
DIRECTIONS = ("reverse", "forward")


def check_rows(name: str, rows: Any) -> pd.DataFrame:
    """Validate one record list against SCHEMA[name] (a ValueError naming the record, the row and the field) and
    return it as a DataFrame."""
    fields = SCHEMA[name]
    if not isinstance(rows, (list, tuple)) or not rows:
        raise ValueError(f"audit records {name!r}: expected a non-empty list of dicts")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"audit records {name!r}[{i}]: expected a dict, got {type(row).__name__}")
        missing = [f for f in fields if f not in row]
        if missing:
            raise ValueError(f"audit records {name!r}[{i}]: missing fields {missing}; required: {list(fields)}")
        for f, typ in fields.items():
            if not _ok(row[f], typ):
                raise ValueError(f"audit records {name!r}[{i}].{f} = {row[f]!r}: expected {typ}")
        if "direction" in fields and row["direction"] not in DIRECTIONS:
            raise ValueError(
                f"audit records {name!r}[{i}].direction = {row['direction']!r}: expected one of {DIRECTIONS}"
            )
    return pd.DataFrame([dict(r) for r in rows])


def check_records(records: Mapping[str, Any]) -> dict[str, pd.DataFrame]:
    """All known record lists present in `records`, validated, as DataFrames (unknown keys and
    "meta" are left out)."""
    if not isinstance(records, Mapping):
        raise ValueError(f"audit records: expected a dict, got {type(records).__name__}")
    return {name: check_rows(name, records[name]) for name in SCHEMA if records.get(name) is not None}


def _ok(value: Any, typ: Any) -> bool:
    """Type check that accepts ints where floats are expected (and numpy scalars)."""
    types = typ if isinstance(typ, tuple) else (typ,)
    if value is None:
        return type(None) in types
    if bool in types:
        return isinstance(value, bool) or type(value).__name__ == "bool_"
    if float in types or int in types:
        try:
            real = float(value)
        except (TypeError, ValueError):
            return False
        return not isinstance(value, (str, bool)) and (float in types or real.is_integer())
    return isinstance(value, types)
