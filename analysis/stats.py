"""Aggregate statistics over seeds, and the one procedure that compares two methods.

Scores are arrays of shape (R, M): R runs (seeds) x M tasks; a 1-D array is one task. An aggregate (`mean_score`)
reduces the last two axes, so the bootstrap evaluates it on a whole (reps, R, M) stack at once. Every random
function takes an explicit `seed`. Descriptive intervals are percentile bootstrap CIs stratified by task, rliable
style (Agarwal et al., NeurIPS 2021).

Deciding whether one method beats another is `compare`: an exact permutation test (paired over seeds
when both methods ran the same seeds, which share the warm start, data order and sampling streams),
whose CI is the test inverted, so "the CI excludes 0" and "p <= alpha" are the same decision. Its
false-"clear" rate under no effect is at most alpha at every n (tests/analysis/test_error_rates.py
measures it); sequential looks (adaptive seeds) split alpha with `look_alphas`.

    point, lo, hi = bootstrap_ci(scores, reps=2000, seed=0)
    c = compare(scores_ema, scores_grpo, paired=True, alpha=0.05)   # c.gain, c.ci, c.p, c.verdict
    alphas = look_alphas([3, 5, 7], 0.05)                           # per-look levels of adaptive seeds
    pass_at_k(n=32, c=5, k=4)                                       # unbiased Codex estimator
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from experiments.tasks.math import pass_at_k  # the one unbiased estimator; stats.pass_at_k for callers here

Aggregate = Callable[[np.ndarray], np.ndarray]


def as_scores(scores: Sequence[float] | np.ndarray) -> np.ndarray:
    """(R,) or (R, M) -> float (R, M); raises on NaN or an empty array."""
    s = np.asarray(scores, dtype=float)
    if s.ndim == 1:
        s = s[:, None]
    if s.ndim != 2 or s.shape[0] == 0 or s.shape[1] == 0:
        raise ValueError(f"scores must be (runs,) or (runs, tasks) and non-empty, got {s.shape}")
    if np.isnan(s).any():
        raise ValueError("scores contain NaN; drop missing runs before aggregating")
    return s


def mean_score(s: np.ndarray) -> np.ndarray:
    """Mean over runs and tasks (the last two axes)."""
    return np.asarray(s).mean(axis=(-2, -1))


def bootstrap_ci(
    scores, statistic: Aggregate = mean_score, reps: int = 2000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """(point, ci_low, ci_high): percentile CI of `statistic` under a stratified bootstrap.

    With a single run there is no spread to resample: the CI is (nan, nan).
    """
    s = as_scores(scores)
    point = float(statistic(s))
    r, m = s.shape
    if r < 2:
        return point, float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, r, size=(reps, r, m))  # a run index per (rep, slot, task)
    boot = statistic(s[idx, np.arange(m)])  # (reps,)
    lo, hi = np.percentile(boot, [50 * (1 - confidence), 50 * (1 + confidence)])
    return point, float(lo), float(hi)


def probability_of_improvement(x, y) -> float:
    """P(X > Y) averaged over tasks, ties counted 1/2 (Mann-Whitney U / (Rx*Ry), as rliable)."""
    x, y = as_scores(x)[:, None, :], as_scores(y)[None, :, :]  # (Rx, 1, M), (1, Ry, M)
    return float(((x > y) + 0.5 * (x == y)).mean(axis=(0, 1)).mean())


# ---------------------------------------------------------------- comparing two methods
#
# `compare` decides every comparison the platform prints (report tables, the β × τ map, adaptive seeds). Paired:
# 2^n sign flips of the per-seed differences (Fisher's randomization test); unpaired: every split of the pooled
# runs into groups of the two sizes. Exact for any distribution of the scores (discrete, heavy tailed), which a
# percentile bootstrap over 3-10 seeds is not (Colas et al. 2019, arXiv:1904.06979); the price: with n paired
# seeds the smallest p-value is 2 / 2^n, so a two-sided 95% decision needs at least 6 seeds.

EXACT_MAX = 1 << 16  # every sign flip / relabelling up to this many; beyond, this many drawn at random (seeded)


@dataclass(frozen=True)
class Comparison:
    """x against y in one metric. `gain` = mean(x) / mean(y) - 1; `ci` its CI at level 1 - alpha, the
    permutation test inverted for a shift of the mean difference and divided by mean(y) (+-inf: the
    test cannot reject any shift on that side at this n); `p` the two-sided p-value of no difference;
    `min_p` the smallest p-value this design can give; `poi` the probability of improvement (paired:
    the fraction of seeds with x > y, ties 1/2; unpaired: P(X > Y) over all pairs of runs)."""

    paired: bool
    n: int  # paired seeds, or runs of x + runs of y
    gain: float
    ci: tuple[float, float]
    p: float
    alpha: float
    min_p: float
    poi: float
    diffs: np.ndarray = field(repr=False)  # (n,) paired per-seed differences x - y (empty when unpaired)

    @functools.cached_property
    def seeds_needed(self) -> int | None:
        """Paired: seeds for 80% power at the observed effect (`seeds_for_power`); None unpaired or without one."""
        return seeds_for_power(self.diffs, self.alpha) if self.paired else None

    @property
    def clear(self) -> bool:
        return self.p <= self.alpha

    @property
    def verdict(self) -> str:
        """'clear', 'not separable' (no data at this n could be clear) or 'unclear'."""
        return "clear" if self.clear else "not separable" if self.min_p > self.alpha else "unclear"

    def describe(self) -> str:
        """One line: the verdict, p, and what it would take."""
        if self.clear:
            return f"clear, p={self.p:.3g}"
        n = self.seeds_needed
        need = "" if n is None else f"; 80% power at this effect: {f'~{n}' if n <= 1000 else '> 1000'} seeds"
        if self.verdict == "not separable":
            floor = f"a {1 - self.alpha:.0%} decision needs >= {min_seeds(self.alpha)}" if self.paired else "too few"
            return f"not separable at {self.n} {'seeds' if self.paired else 'runs'} ({floor}){need}"
        return f"not clear, p={self.p:.3g}{need}"


def compare(x, y, *, paired: bool = True, alpha: float = 0.05, seed: int = 0) -> Comparison:
    """Compare runs x with runs y, (R,) or (R, M) scores; paired: rows aligned by seed (same shape)."""
    x, y = as_scores(x), as_scores(y)
    if paired and x.shape != y.shape:
        raise ValueError(f"paired samples need the same shape (seeds, tasks), got {x.shape} and {y.shape}")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y need the same tasks, got {x.shape[1]} and {y.shape[1]}")
    z0, u, w = _design(x, y, paired, seed)  # data (n,), shift direction (n,), statistics' weights (G, n)
    base = float(mean_score(y))
    gain = float(mean_score(x)) / base - 1.0 if base != 0 else math.nan
    shift = float(w[0] @ z0)  # the observed mean difference (w[0] is the identity)
    p = _p_value(w, z0)
    min_p = _p_value(w, z0 - 1e6 * (np.abs(z0).max() + 1) * u)  # a shift that orders every pair
    lo, hi = _invert(w, z0, u, shift=shift, alpha=alpha, min_p=min_p)
    ci = (lo / base, hi / base) if base > 0 else (math.nan, math.nan)
    poi = paired_poi(x, y) if paired else probability_of_improvement(x, y)
    n = z0.size if paired else len(x) + len(y)
    return Comparison(paired, n, gain, ci, p, alpha, min_p, poi, z0 if paired else np.empty(0))


def _design(x: np.ndarray, y: np.ndarray, paired: bool, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(z0, u, w): the test statistic under transformation g at shift delta is w[g] @ (z0 - delta * u), the
    mean difference of the transformed data; row 0 of w is the identity."""
    if paired:
        d = (x - y).mean(axis=1)  # (n,) per-seed differences, averaged over tasks
        n = d.size
        if 1 << n <= EXACT_MAX:
            signs = 1 - 2 * ((np.arange(1 << n)[:, None] >> np.arange(n)) & 1)  # (2^n, n), row 0 all +1
        else:
            signs = np.random.default_rng(seed).choice([-1, 1], size=(EXACT_MAX, n))
            signs[0] = 1
        return d, np.ones(n), signs / n
    a, b = x.mean(axis=1), y.mean(axis=1)  # (na,), (nb,) per-run scores
    na, n = a.size, a.size + b.size
    if math.comb(n, na) <= EXACT_MAX:
        member = np.zeros((math.comb(n, na), n), dtype=bool)
        for g, idx in enumerate(itertools.combinations(range(n), na)):  # the first is (0, ..., na-1)
            member[g, list(idx)] = True
    else:
        rng = np.random.default_rng(seed)
        member = np.argsort(rng.random((EXACT_MAX, n)), axis=1) < na
        member[0] = np.arange(n) < na
    w = np.where(member, 1.0 / na, -1.0 / (n - na))  # (G, n) mean of group x minus mean of group y
    return np.concatenate([a, b]), np.r_[np.ones(na), np.zeros(n - na)], w


def _p_value(w: np.ndarray, z: np.ndarray) -> float:
    """Two-sided: the fraction of transformations whose |statistic| reaches the observed one (ties count)."""
    t = w @ z  # (G,)
    tol = 1e-9 * float(np.abs(z).max())  # float rounding of sums of the same numbers in another order
    return float(np.mean(np.abs(t) >= abs(t[0]) - tol))


def _invert(w, z0, u, *, shift: float, alpha: float, min_p: float) -> tuple[float, float]:
    """The shifts delta the test does not reject at alpha (p > alpha), as [lo, hi]; +-inf where no shift on
    that side can be rejected at this n. Each statistic is linear in delta, w[g] @ z0 - delta * w[g] @ u, so
    p(delta) steps only where |statistic g| crosses |statistic 0|: each end is found by bisection outward from
    the observed shift, then set to the crossing point it brackets (exact, e.g. 0 for identical runs)."""
    if min_p > alpha:
        return -math.inf, math.inf
    a, b = w @ z0, w @ u  # (G,), (G,)
    with np.errstate(divide="ignore", invalid="ignore"):
        cross = np.concatenate([(a - a[0]) / (b - b[0]), (a + a[0]) / (b + b[0])])  # (2G,) where p may step
    cross = cross[np.isfinite(cross)]
    span = float(np.ptp(z0)) + abs(shift) or 1.0  # the data's scale (any scale when every value is equal)
    out = []
    for sign in (-1.0, 1.0):
        inside, outside = shift, shift + sign * 4 * span  # p(outside) = min_p <= alpha: rejected
        for _ in range(60):
            mid = (inside + outside) / 2
            if _p_value(w, z0 - mid * u) > alpha:
                inside = mid
            else:
                outside = mid
        near = cross[np.abs(cross - outside) <= 1e-9 * span]
        out.append((float(near[np.argmin(np.abs(near - outside))]) if near.size else outside) + 0.0)  # no -0.0
    return out[0], out[1]


def min_seeds(alpha: float) -> int:
    """The fewest paired seeds at which the exact two-sided sign-flip test can reach alpha: 2 / 2^n <= alpha."""
    return max(2, math.ceil(1 - math.log2(alpha)))


def seeds_for_power(d: np.ndarray, alpha: float, power: float = 0.8, most: int = 1000) -> int | None:
    """Paired seeds for `power` at the effect these per-seed differences show (mean / sd, a paired t-test's
    noncentral t; never below `min_seeds`). None when the mean difference is 0; most + 1 when beyond `most`."""
    from scipy import stats as st  # loads scipy.stats

    d = np.asarray(d, dtype=float)
    m, s = float(d.mean()), float(d.std(ddof=1)) if d.size > 1 else math.nan
    if m == 0 or not math.isfinite(s):
        return None
    floor = min_seeds(alpha)
    if s == 0:
        return floor
    n = np.arange(floor, most + 1)  # (N,) candidate seed counts
    t, nc = st.t.ppf(1 - alpha / 2, n - 1), abs(m) / s * np.sqrt(n)
    ok = np.flatnonzero(st.nct.sf(t, n - 1, nc) + st.nct.cdf(-t, n - 1, nc) >= power)
    return int(n[ok[0]]) if ok.size else most + 1


def look_alphas(looks: Sequence[int], alpha: float) -> list[float]:
    """The level of each look of a sequential comparison (seed counts `looks`, in order) so that the chance of
    ever calling a no-effect comparison clear is at most alpha: alpha is split equally (Bonferroni) over the
    looks at which the exact paired test can reach their share; the others get 0 (they cannot decide)."""
    usable = list(range(len(looks)))
    while usable:
        share = alpha / len(usable)
        keep = [k for k in usable if 2.0 ** (1 - looks[k]) <= share]
        if keep == usable:
            break
        usable = keep
    return [alpha / len(usable) if k in usable else 0.0 for k in range(len(looks))]


def paired_poi(x, y) -> float:
    """Paired probability of improvement: the fraction of seeds (row i of x and of y from the same seed) on which
    x beats y, ties 1/2, averaged over tasks. `probability_of_improvement` compares every run of x with every y."""
    x, y = as_scores(x), as_scores(y)
    if x.shape != y.shape:
        raise ValueError(f"paired samples need the same shape (seeds, tasks), got {x.shape} and {y.shape}")
    return float(((x > y) + 0.5 * (x == y)).mean())


# ---------------------------------------------------------------- over tidy frames


def summarize(frame: pd.DataFrame, value: str, by: str | list[str], *, reps: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Per group: mean, bootstrap CI over the group's rows (runs), n; NaN values dropped first.
    Columns: *by, "mean", "ci_low", "ci_high", "n"."""
    keys = [by] if isinstance(by, str) else list(by)
    out = []
    for group, sub in frame.dropna(subset=[value]).groupby(keys, sort=True, dropna=False):
        vals = sub[value].to_numpy(dtype=float)
        point, lo, hi = bootstrap_ci(vals, reps=reps, seed=seed)
        group = group if isinstance(group, tuple) else (group,)
        out.append({**dict(zip(keys, group)), "mean": point, "ci_low": lo, "ci_high": hi, "n": len(vals)})
    return pd.DataFrame(out, columns=[*keys, "mean", "ci_low", "ci_high", "n"])


def pass_at_k_frame(
    evals: pd.DataFrame, ks: Sequence[int], by: Sequence[str] = ("run_id", "iteration", "model", "benchmark")
) -> pd.DataFrame:
    """Unbiased pass@k per group of `by` (mean over the group's problems), for each k in `ks`
    that every problem of the group supports (k <= n); other cells are NaN."""
    rows = []
    for group, sub in evals.groupby(list(by), sort=True):
        n, c = sub["n"].to_numpy(int), sub["n_correct"].to_numpy(int)
        row = dict(zip(by, group))
        row.update({f"pass@{k}": (float(np.mean(pass_at_k(n, c, k))) if k <= n.min() else np.nan) for k in ks})
        row["n_problems"] = len(sub)
        rows.append(row)
    return pd.DataFrame(rows, columns=[*by, *(f"pass@{k}" for k in ks), "n_problems"])
