"""RL-health rules: small pure functions over a run's metric stream that say when training has gone bad.

    monitor = HealthMonitor(cfg.health)          # ema_pg_core.config.HealthConfig
    breach = monitor.observe(iteration, metrics) # None, or the Breach that ends the run (status stopped_unhealthy)

One registry, ``HEALTH_RULES``: ``rule(history, **params) -> Fired | None``, where ``history`` maps each
metric the rule reads to its values so far (oldest first) and ``params`` are the fields of its section
``health.<name>`` of ``HealthConfig``; a rule whose threshold is null is off. ``nonfinite`` is always on.

Why: a sweep's scheduler (ASHA) looks only at the target metric, so a run whose entropy has collapsed, whose
KL has exploded or whose loss is NaN would keep its slot until the end.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any

History = Mapping[str, Sequence[float]]  # metric -> its values so far, oldest first (NaN for a non-finite one)
Fired = tuple[str, dict[str, Any]]  # (why, in words; {metric: the value or values that made the rule fire})


@dataclass(frozen=True)
class HealthRule:
    name: str
    metrics: tuple[str, ...]  # the metric keys the rule reads (docs/run-record.md)
    check: Callable[..., Fired | None]


@dataclass(frozen=True)
class Breach:
    """A rule that fired: which, at which iteration, why, and the metric values it fired on."""

    rule: str
    iteration: int
    message: str
    values: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return f"health rule {self.rule} fired at iteration {self.iteration}: {self.message}"


HEALTH_RULES: dict[str, HealthRule] = {}


def register_rule(name: str, metrics: tuple[str, ...]):
    """Decorator: add a rule kind to HEALTH_RULES under `name`, reading `metrics`."""

    def deco(fn: Callable[..., Fired | None]):
        if name in HEALTH_RULES:
            raise ValueError(f"health rule {name!r} is registered twice")
        HEALTH_RULES[name] = HealthRule(name, tuple(metrics), fn)
        return fn

    return deco


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


NONFINITE_METRICS = ("loss/total", "loss/pg", "kl/value", "train/grad_norm")
"""What `nonfinite` watches: the loss, its KL term and the gradient norm (before clipping)."""


@register_rule("nonfinite", NONFINITE_METRICS)
def nonfinite(history: History) -> Fired | None:
    """Fires when the latest value of any watched metric is NaN or +-inf (always on)."""
    bad = {m: v[-1] for m, v in history.items() if v and not _finite(v[-1])}
    if not bad:
        return None
    return f"non-finite {', '.join(sorted(bad))}", {m: _show(v) for m, v in bad.items()}


@register_rule("entropy_floor", ("train/entropy",))
def entropy_floor(history: History, floor: float | None, patience: int) -> Fired | None:
    """Fires when train/entropy (nats per response token) was below `floor` for the last `patience` values."""
    vals = list(history.get("train/entropy", ()))[-patience:]
    if floor is None or len(vals) < patience or not all(_finite(v) and v < floor for v in vals):
        return None
    return (
        f"train/entropy below {floor:g} for {patience} iteration(s) (last {vals[-1]:.4g})",
        {"train/entropy": vals},
    )


@register_rule("kl_spike", ("kl/value",))
def kl_spike(history: History, factor: float | None, window: int, min_history: int) -> Fired | None:
    """Fires when kl/value exceeds `factor` x the median of its previous `window` values (at least
    `min_history` of them, finite). A median of 0 (the anchor still equals the policy) gives no scale: no fire."""
    vals = list(history.get("kl/value", ()))
    if factor is None or len(vals) < 2:
        return None
    before = [v for v in vals[:-1][-window:] if _finite(v)]
    if len(before) < min_history or not _finite(vals[-1]):
        return None
    median = statistics.median(before)
    if median <= 0 or vals[-1] <= factor * median:
        return None
    return (
        f"kl/value {vals[-1]:.4g} > {factor:g} x its running median {median:.4g} (over {len(before)} iterations)",
        {"kl/value": vals[-1], "running_median": median},
    )


@register_rule("length_cap", ("train/len_capped",))
def length_cap(history: History, frac: float | None, patience: int) -> Fired | None:
    """Fires when at least `frac` of the responses hit the length cap (train/len_capped) in each of the
    last `patience` iterations."""
    vals = list(history.get("train/len_capped", ()))[-patience:]
    if frac is None or len(vals) < patience or not all(_finite(v) and v >= frac for v in vals):
        return None
    return (
        f"train/len_capped >= {frac:g} for {patience} iteration(s) (last {vals[-1]:.3g})",
        {"train/len_capped": vals},
    )


def _show(v: Any) -> Any:
    """A non-finite value as JSON can hold it: "nan", "inf", "-inf" (None stays None: null in the record)."""
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


class HealthMonitor:
    """Feeds each iteration's metrics to every registered rule; the first rule that fires wins.

    Its state is only the history of the watched metrics, so a resumed run that replays its kept
    metric lines (``replay``) reaches the same state as the uninterrupted run.
    """

    def __init__(self, health: Any = None):
        if health is None:
            from ema_pg_core.config import HealthConfig  # loads torch

            health = HealthConfig()  # the defaults: only nonfinite is on
        sections = {name: getattr(health, name, None) for name in HEALTH_RULES}  # None: no section (nonfinite)
        self.params = {name: asdict(s) if is_dataclass(s) else {} for name, s in sections.items()}
        self.watched = sorted({m for r in HEALTH_RULES.values() for m in r.metrics})
        self.history: dict[str, list[float]] = {m: [] for m in self.watched}

    def observe(self, iteration: int, metrics: Mapping[str, Any]) -> Breach | None:
        """Add one iteration's metrics (None = a non-finite value as the run record stores it); return the
        Breach of the first rule that fires on a metric logged in this iteration, else None."""
        seen = {m for m in self.watched if m in metrics}
        for m in seen:
            v = metrics[m]
            self.history[m].append(float("nan") if v is None else float(v))
        for name, rule in HEALTH_RULES.items():
            if not seen.intersection(rule.metrics):
                continue
            fired = rule.check({m: self.history[m] for m in rule.metrics}, **self.params[name])
            if fired is not None:
                return Breach(name, int(iteration), fired[0], fired[1])
        return None

    def replay(self, rows: Sequence[Mapping[str, Any]]) -> Breach | None:
        """Observe logged rows in order (a resumed run's kept lines); the first Breach, if any."""
        for row in rows:
            breach = self.observe(int(row["iteration"]), row)
            if breach is not None:
                return breach
        return None
