"""The decision procedure's error rates, measured: how often a comparison with no effect is called clear, and how
often a real effect is found, for the report's fixed seed counts and for adaptive seeds with the shipped settings.

Scores are drawn in two shapes, each paired over seeds (a seed's two runs share its warm start and streams):
- normal: x_i = 10 + s_i + e_i, y_i = 10 + s_i + f_i, with s, e, f standard normal;
- accuracy: the greedy accuracy over 64 held-out problems, discrete and heavy-tailed: a seed's quality
  q_i = 0.4 + 0.06 t_2 (Student t with 2 degrees of freedom), each run's accuracy Binomial(64, q_i + u) / 64 with a
  run-level jitter u ~ N(0, 0.03); ties between a seed's two runs are common.
Under no effect, x and y are drawn alike; under the alternative x gets +`EFFECT` (1 sd of a paired difference for
normal, +8 accuracy points for accuracy). The false-"clear" rate must stay within its nominal 5% plus three Monte
Carlo standard errors, sqrt(0.05 * 0.95 / N); the bootstrap percentile CI the report used before is measured
beside it, to show what the test catches. The figures are printed (docs/results.md quotes them)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from analysis import stats
from experiments.user_yaml import read
from sweeps import adaptive as A
from sweeps.spec import parse

N = 2000  # datasets per setting
ALPHA = 0.05
TOL = ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / N)  # 0.0646 at N = 2000
MAP = Path(__file__).resolve().parents[2] / "sweeps" / "map_beta_tau.yaml"
EFFECT = {"normal": 2**0.5, "accuracy": 0.08}


def draw(shape: str, n: int, effect: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(x, y): (N, n) scores of N datasets of n paired seeds."""
    if shape == "normal":
        s = 10 + rng.normal(size=(N, n))  # positive means: the gain is relative to y's
        return s + rng.normal(size=(N, n)) + effect, s + rng.normal(size=(N, n))
    q = 0.4 + 0.06 * rng.standard_t(2, size=(N, n))
    acc = lambda shift: rng.binomial(64, np.clip(q + shift + rng.normal(0, 0.03, (N, n)), 0, 1)) / 64  # noqa: E731
    return acc(effect), acc(0.0)


def clear_rate(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean([stats.compare(a, b, alpha=ALPHA).clear for a, b in zip(x, y)]))


def bootstrap_rate(x: np.ndarray, y: np.ndarray) -> float:
    """The previous rule: a 95% percentile bootstrap CI of the mean paired difference excludes 0."""
    cis = [stats.bootstrap_ci(a - b, reps=1000, seed=i)[1:] for i, (a, b) in enumerate(zip(x, y))]
    return float(np.mean([lo > 0 or hi < 0 for lo, hi in cis]))


def shipped_adaptive_spec():
    """The shipped β × τ map's adaptive settings (start, step, max, stop_when, confidence) on one comparison."""
    raw = read(MAP, "sweep spec")
    raw["space"] = {"algo.anchor.tau": {"grid": [1.0, 0.5]}}
    return parse(raw)


def adaptive_clear_rate(spec, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Run the real planner (first_round, decide, next_round) on each dataset, revealing seed i of both points
    when it is planned: (fraction whose comparison was ever decided with a CI that excludes 0, mean seeds used)."""
    column = A._column(spec)
    clear, used = [], []
    for xs, ys in zip(x, y):
        planned = A.first_round(spec)
        seeds_of: dict[str, int] = {}
        hit = False
        while planned:
            for t in planned:
                k = A.point_key(t["point"])
                seeds_of[k] = seeds_of.get(k, 0) + 1
            rows = [
                {"algo.anchor.tau": tau, "seed": s, "status": "finished", column: (ys if tau == 1.0 else xs)[s]}
                for tau in (1.0, 0.5)
                for s in range(seeds_of[A.point_key({"algo.anchor.tau": tau})])
            ]
            (d,) = A.decide(spec, rows, seeds_of)
            hit = hit or d["ci"][0] > 0 or d["ci"][1] < 0
            planned = A.next_round(spec, [d], seeds_of)
        clear.append(hit)
        used.append(seeds_of[A.point_key({"algo.anchor.tau": 0.5})])
    return float(np.mean(clear)), float(np.mean(used))


@pytest.mark.parametrize("shape", ["normal", "accuracy"])
def test_false_clear_rate_holds_at_every_n_and_under_adaptive_stopping(shape, capsys):
    rng = np.random.default_rng({"normal": 0, "accuracy": 1}[shape])
    lines = [f"{shape} scores, {N} datasets per setting, nominal {ALPHA:.0%} (bound {TOL:.4f}):"]
    for n in (3, 5, 7):
        x0, y0 = draw(shape, n, 0.0, rng)
        x1, y1 = draw(shape, n, EFFECT[shape], rng)
        null, power = clear_rate(x0, y0), clear_rate(x1, y1)
        boot = bootstrap_rate(x0, y0) if n == 3 else None
        assert null <= TOL, (shape, n, null)
        lines.append(
            f"  n={n:2d}: false clear {null:.4f}, power {power:.3f} at +{EFFECT[shape]:g}"
            + (f"  (percentile bootstrap CI: false clear {boot:.3f})" if boot is not None else "")
        )
        if boot is not None:
            assert boot > TOL  # the rule this replaces fails the same check: the check can fail
        if n >= 7:
            assert power > 0.2  # a test that never rejects would pass the null check; this one finds effects
    spec = shipped_adaptive_spec()
    a = spec.adaptive
    x0, y0 = draw(shape, a.max, 0.0, rng)
    x1, y1 = draw(shape, a.max, EFFECT[shape], rng)
    (null, seeds0), (power, seeds1) = adaptive_clear_rate(spec, x0, y0), adaptive_clear_rate(spec, x1, y1)
    assert null <= TOL, (shape, "adaptive", null)
    lines.append(
        f"  adaptive (start {a.start}, step {a.step}, max {a.max}, alpha per look "
        f"{ {n: round(v, 4) for n, v in A.levels(spec).items()} }): false clear "
        f"{null:.4f} ({seeds0:.1f} seeds on average), power {power:.3f} at +{EFFECT[shape]:g} ({seeds1:.1f} seeds)"
    )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
