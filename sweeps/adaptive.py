"""Adaptive seeds: add seeds only where a paired comparison is not yet clear (docs/sweeps.md). Pure: never ray.

    trials = first_round(spec)                       # round 0: every grid point at the start seeds
    decided = decide(spec, rows, seeds_of)           # after a round: per comparison, stop or add seeds
    nxt = next_round(spec, decided, seeds_of)        # the trials of the next round ([] = the sweep is over)

A comparison (a value of the compare key vs the baseline, at one point of the other grid keys) is decided with the
report's exact paired test, each look at its own level (``levels``) so that the looks together call a no-effect
comparison clear at most 1 - confidence of the time.

<sweep_dir>/adaptive.jsonl, one JSON object a line, appended in order (the sweep's decisions, and what
--resume reads to continue the round it was in):
    {"event": "plan", "round": r, "trials": [{"point": {...}, "seed": s}, ...]}
    {"event": "decide", "round": r, "comparisons": [{"point", "baseline", "seeds", "paired", "gain", "ci", "p",
     "alpha", "decision": stop | more | max, "why", "next_seeds"}, ...], "next_trials": n}
    ("ci" at level 1 - alpha, +-Infinity where unbounded; "p" the exact two-sided p-value)
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

from sweeps.model import Spec, grid_points

FILE = "adaptive.jsonl"


def point_key(point: dict) -> str:
    """A point's identity (JSON with sorted keys): equal for equal points, also after a JSON round trip."""
    return json.dumps(point, sort_keys=True)


# ---------------------------------------------------------------------------- the plan
def comparisons(spec: Spec) -> list[tuple[dict, dict]]:
    """(point, baseline point) for every grid point whose compare key is not the baseline, in grid order."""
    c = spec.adaptive.compare
    return [(p, {**p, c.key: c.baseline}) for p in grid_points(spec) if p[c.key] != c.baseline]


def first_round(spec: Spec) -> list[dict]:
    """Round 0: every grid point at the start seeds (seed slowest, as a plain sweep launches them)."""
    a = spec.adaptive
    return [{"point": p, "seed": s} for s in range(a.first, a.first + a.start) for p in grid_points(spec)]


def worst_case(spec: Spec) -> int:
    """Trials if no comparison is ever decided: every point at `max` seeds (each point is compared or is the
    baseline of a comparison, since the compare key has another value than the baseline)."""
    return len(grid_points(spec)) * spec.adaptive.max


def looks(spec: Spec) -> list[int]:
    """The seed counts at which a comparison is decided: start, start + step, ..., max."""
    a = spec.adaptive
    return [*range(a.start, a.max, a.step), a.max]


def levels(spec: Spec) -> dict[int, float]:
    """The test level (alpha) of each look, {seeds: alpha}; they sum to 1 - confidence."""
    from analysis import stats  # loads pandas, numpy

    n = looks(spec)
    return dict(zip(n, stats.look_alphas(n, 1 - spec.adaptive.confidence)))


def plan_text(spec: Spec) -> str:
    """The dry run's description of the adaptive plan (rounds, rule, levels, worst-case trial count)."""
    a, c = spec.adaptive, spec.adaptive.compare
    rules = " or ".join(r if x is None else f"{r} {x:g}" for r, x in a.rules)
    n_comp, n_pts = len(comparisons(spec)), len(grid_points(spec))
    at = ", ".join(f"{n}: {lvl:.3g}" for n, lvl in levels(spec).items())
    return "\n".join(
        [
            f"  adaptive seeds: round 0 runs seeds {a.first}..{a.first + a.start - 1} at all {n_pts} points; then per "
            f"comparison ({n_comp}: each {c.key} != {c.baseline!r} vs {c.key}={c.baseline!r} at the same point)",
            f"  +{a.step} seeds while not ({rules}) on the exact paired test of {_column(spec)}, up to {a.max} seeds;",
            f"  level per look (seeds: alpha; {1 - a.confidence:.3g} in all, 0 = cannot decide): {at}",
            f"  trials: {n_pts * a.start} in round 0, at most {worst_case(spec)} in all (worst case); below: round 0",
        ]
    )


def _column(spec: Spec) -> str:
    """The sweep.csv column compared: final/<metric>, or best/<key> for a best_<key> metric."""
    metric = spec.adaptive.metric or spec.metric
    return f"best/{metric[len('best_') :]}" if metric.startswith("best_") else f"final/{metric}"


# ---------------------------------------------------------------------------- deciding
def paired_values(rows: list[dict], column: str, point: dict, base: dict) -> tuple[list[float], list[float]]:
    """(x, y): `column` of the finished trials of `point` and `base` on the seeds both have, aligned by seed."""

    def by_seed(p: dict) -> dict[int, float]:
        out = {}
        for r in rows:
            if r.get("status") == "finished" and all(str(r.get(k)) == str(v) for k, v in p.items()):
                v = _number(r.get(column))
                if v is not None:
                    out[int(r["seed"])] = v
        return out

    x, y = by_seed(point), by_seed(base)
    common = sorted(set(x) & set(y))
    return [x[s] for s in common], [y[s] for s in common]


def _number(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def rule_met(spec: Spec, c) -> str | None:
    """The first `stop_when` rule the comparison `c` (analysis.stats.Comparison) meets, worded; None if none."""
    lo, hi = c.ci
    for rule, x in spec.adaptive.rules:
        if rule == "ci_excludes_zero" and c.clear:
            return "CI excludes 0"
        if rule == "ci_width_below" and math.isfinite(lo) and math.isfinite(hi) and hi - lo < x:
            return f"CI width {hi - lo:.3g} < {x:g}"
    return None


def decide(spec: Spec, rows: list[dict], seeds_of: dict[str, int]) -> list[dict]:
    """One decision per comparison from the sweep's rows so far; `seeds_of`: seeds planned per point key."""
    from analysis import stats  # loads pandas, numpy, scipy

    a, column, level = spec.adaptive, _column(spec), levels(spec)
    out = []
    for point, base in comparisons(spec):
        x, y = paired_values(rows, column, point, base)
        have = seeds_of.get(point_key(point), 0)
        alpha = level.get(have, 0.0)
        c = stats.compare(x, y, alpha=alpha) if len(x) >= 2 and sum(y) > 0 else None
        met = rule_met(spec, c) if c else None
        decision, nxt = (
            ("stop", have) if met else ("max", have) if have >= a.max else ("more", min(a.max, have + a.step))
        )
        why = met or (f"{a.max} seeds reached" if decision == "max" else "rule not met")
        if c and not met and c.verdict == "not separable":
            why += f" (no {len(x)}-seed result can be clear at alpha {alpha:.3g})"
        out.append(
            dict(point=point, baseline=base, seeds=have, paired=len(x), gain=c.gain if c else math.nan)
            | dict(ci=list(c.ci) if c else [math.nan, math.nan], p=c.p if c else math.nan, alpha=alpha)
            | dict(decision=decision, why=why if c else f"{why} ({len(x)} paired seed(s): no test)", next_seeds=nxt)
        )
    return out


def next_round(spec: Spec, decided: list[dict], seeds_of: dict[str, int]) -> list[dict]:
    """The trials that bring each `more` comparison (and its baseline point) to its next seed count."""
    want: dict[str, tuple[dict, int]] = {}
    for d in decided:
        if d["decision"] == "more":
            for p in (d["point"], d["baseline"]):
                k = point_key(p)
                want[k] = (p, max(want.get(k, (p, 0))[1], d["next_seeds"]))
    first = spec.adaptive.first
    trials = [{"point": p, "seed": first + i} for k, (p, n) in want.items() for i in range(seeds_of.get(k, 0), n)]
    return sorted(trials, key=lambda t: t["seed"])  # seed slowest, points in grid order


def seeds_planned(events: list[dict]) -> dict[str, int]:
    """Seeds planned so far per point key (from the plan events)."""
    return dict(Counter(point_key(t["point"]) for e in events if e["event"] == "plan" for t in e["trials"]))


def decision_lines(spec: Spec, rnd: int, decided: list[dict], n_next: int) -> str:
    """What the sweep prints after a round: one line per comparison, then what happens next."""
    from analysis.tables import fmt_gain  # loads pandas, numpy

    key = spec.adaptive.compare.key
    lines = [f"adaptive seeds, round {rnd}: paired relative gain in {_column(spec)} ({key} vs baseline)"]
    for d in decided:
        where = " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in d["point"].items())
        ci = f"{fmt_gain(d['gain'], *d['ci'])}, p={d['p']:.3g} at alpha {d['alpha']:.3g}"
        ci = ci if math.isfinite(d["gain"]) else "no test"
        nxt = f" -> {d['next_seeds']} seeds" if d["decision"] == "more" else ""
        lines.append(f"  {where}: {d['paired']} paired seeds, {ci}: {d['decision']} ({d['why']}){nxt}")
    lines.append(f"  next: {n_next} trial(s) in round {rnd + 1}" if n_next else "  every comparison is decided")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the record
def write_event(sweep_dir: str | Path, event: dict[str, Any]) -> None:
    """Append one event to <sweep_dir>/adaptive.jsonl (flushed and synced: --resume trusts it)."""
    with open(Path(sweep_dir) / FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(event, allow_nan=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_events(sweep_dir: str | Path) -> list[dict]:
    """Every event of <sweep_dir>/adaptive.jsonl in order ([] without one); a cut-off last line is dropped."""
    path = Path(sweep_dir) / FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the driver died mid-write: that event never happened
            break
    return out
