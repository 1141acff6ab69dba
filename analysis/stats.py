"""Aggregate statistics over seeds, rliable style (Agarwal et al., NeurIPS 2021).

Scores are arrays of shape (R, M): R runs (seeds) x M tasks; a 1-D array is one task.
Aggregates (`mean_score`, `iqm`) reduce the last two axes, so the bootstrap evaluates them on a
whole (reps, R, M) stack at once. Every random function takes an explicit `seed`; nothing uses
global RNG state. Interval estimates are percentile bootstrap CIs, stratified by task: runs are
resampled with replacement independently within each task (rliable's StratifiedBootstrap).

Two methods run with the same seeds share the warm start, the data order and the sampling
streams, so their per-seed difference is far less noisy than the spread across seeds. For such
paired samples (row i of x and of y from the same seed) `paired_bootstrap_ci` resamples seeds
jointly: one draw of seed indices per replicate, applied to both. `bootstrap_ci_two` resamples
the two samples independently (unpaired), for methods whose seeds do not match.

    point, lo, hi = bootstrap_ci(scores, iqm, reps=2000, seed=0)
    p = probability_of_improvement(scores_ema, scores_grpo)    # P(X > Y), ties count 1/2
    g = paired_bootstrap_ci(scores_ema, scores_grpo, relative_gain)   # rows aligned by seed
    q = paired_bootstrap_ci(scores_ema, scores_grpo, paired_poi_statistic)
    pass_at_k(n=32, c=5, k=4)                                  # unbiased Codex estimator
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

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


def iqm(s: np.ndarray) -> np.ndarray:
    """Interquartile mean over runs and tasks (last two axes): the mean after dropping
    floor(n/4) values at each end of the sorted n = R*M scores; scipy.stats.trim_mean(x, 0.25),
    which rliable uses."""
    s = np.asarray(s, dtype=float)
    flat = np.sort(s.reshape(*s.shape[:-2], -1), axis=-1)
    n = flat.shape[-1]
    cut = int(0.25 * n)
    return flat[..., cut : n - cut].mean(axis=-1)


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
    return (point, *_percentile_ci(boot, confidence))


def _percentile_ci(boot: np.ndarray, confidence: float) -> tuple[float, float]:
    lo, hi = np.percentile(boot, [50 * (1 - confidence), 50 * (1 + confidence)])
    return float(lo), float(hi)


def probability_of_improvement(x, y) -> float:
    """P(X > Y) averaged over tasks, ties counted 1/2 (Mann-Whitney U / (Rx*Ry), as rliable)."""
    return float(_poi(as_scores(x), as_scores(y)))


def _poi(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Vectorised over leading axes: x (..., Rx, M), y (..., Ry, M) -> (...)."""
    gt = (x[..., :, None, :] > y[..., None, :, :]).astype(float)
    eq = (x[..., :, None, :] == y[..., None, :, :]).astype(float)
    return (gt + 0.5 * eq).mean(axis=(-3, -2)).mean(axis=-1)


def bootstrap_ci_two(
    x,
    y,
    statistic: Callable[[np.ndarray, np.ndarray], np.ndarray],
    *,
    reps: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(point, lo, hi) for a two-sample statistic, unpaired: both samples are resampled
    independently, stratified by task. The CI is (nan, nan) unless both have at least two runs."""
    x, y = as_scores(x), as_scores(y)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y need the same tasks, got {x.shape[1]} and {y.shape[1]}")
    point = float(statistic(x, y))
    if min(len(x), len(y)) < 2:
        return point, float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    m = np.arange(x.shape[1])
    bx = x[rng.integers(0, len(x), size=(reps, len(x), len(m))), m]
    by = y[rng.integers(0, len(y), size=(reps, len(y), len(m))), m]
    return (point, *_percentile_ci(statistic(bx, by), confidence))


def paired_bootstrap_ci(
    x,
    y,
    statistic: Callable[[np.ndarray, np.ndarray], np.ndarray],
    *,
    reps: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(point, lo, hi) for a two-sample statistic on paired samples: x and y have the same shape
    and row i of both comes from the same seed. Seeds are resampled jointly, stratified by task:
    each replicate draws one set of seed indices per task and takes those rows from x and from y,
    so variation shared by a seed's two runs cancels (x == y gives the CI [0, 0] for
    `relative_gain`). The CI is (nan, nan) with fewer than two seeds."""
    x, y = as_scores(x), as_scores(y)
    if x.shape != y.shape:
        raise ValueError(f"paired samples need the same shape (seeds, tasks), got {x.shape} and {y.shape}")
    point = float(statistic(x, y))
    r, m = x.shape
    if r < 2:
        return point, float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, r, size=(reps, r, m))  # one seed index per (rep, slot, task), shared by x and y
    cols = np.arange(m)
    return (point, *_percentile_ci(statistic(x[idx, cols], y[idx, cols]), confidence))


def relative_gain(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """mean(x) / mean(y) - 1 over the last two axes (the gain of the means, not mean of gains)."""
    return mean_score(x) / mean_score(y) - 1.0


def poi_statistic(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Probability of improvement as a two-sample statistic for `bootstrap_ci_two`."""
    return _poi(x, y)


def paired_poi(x, y) -> float:
    """Paired probability of improvement: the fraction of seeds on which x beats y, ties counted
    1/2, averaged over tasks: mean over seeds i and tasks j of 1[x_ij > y_ij] + 1/2 1[x_ij == y_ij].
    Row i of x and of y must come from the same seed. `probability_of_improvement` instead compares
    every run of x with every run of y (P(X > Y) for independent draws)."""
    x, y = as_scores(x), as_scores(y)
    if x.shape != y.shape:
        raise ValueError(f"paired samples need the same shape (seeds, tasks), got {x.shape} and {y.shape}")
    return float(paired_poi_statistic(x, y))


def paired_poi_statistic(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """`paired_poi` vectorised over leading axes, as a statistic for `paired_bootstrap_ci`:
    x, y (..., R, M) -> (...)."""
    return ((x > y) + 0.5 * (x == y)).mean(axis=(-2, -1))


def pass_at_k(n, c, k: int) -> np.ndarray | float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the large binomials.
    `n` and `c` may be arrays (one entry per problem); requires 0 <= c <= n and 1 <= k <= n.
    """
    n_arr, c_arr = np.broadcast_arrays(np.asarray(n, dtype=int), np.asarray(c, dtype=int))
    if (c_arr < 0).any() or (c_arr > n_arr).any():
        raise ValueError("need 0 <= c <= n")
    if k < 1 or (k > n_arr).any():
        raise ValueError(f"need 1 <= k <= n, got k={k}, min n={n_arr.min()}")
    out = np.empty(n_arr.shape, dtype=float)
    for i, (ni, ci) in enumerate(zip(n_arr.ravel(), c_arr.ravel())):
        out.flat[i] = 1.0 if ni - ci < k else 1.0 - np.prod(1.0 - k / np.arange(ni - ci + 1, ni + 1))
    return float(out) if out.ndim == 0 else out


# ---------------------------------------------------------------- over tidy frames


def summarize(
    frame: pd.DataFrame,
    value: str,
    by: str | list[str],
    *,
    reps: int = 2000,
    seed: int = 0,
    statistic: Aggregate = mean_score,
) -> pd.DataFrame:
    """Per group: mean (or `statistic`), bootstrap CI over the group's rows (runs), n.

    NaN values are dropped first; groups left empty are omitted.
    Columns: *by, "mean", "ci_low", "ci_high", "n".
    """
    keys = [by] if isinstance(by, str) else list(by)
    out = []
    for group, sub in frame.dropna(subset=[value]).groupby(keys, sort=True, dropna=False):
        vals = sub[value].to_numpy(dtype=float)
        point, lo, hi = bootstrap_ci(vals, statistic, reps=reps, seed=seed)
        group = group if isinstance(group, tuple) else (group,)
        out.append({**dict(zip(keys, group)), "mean": point, "ci_low": lo, "ci_high": hi, "n": len(vals)})
    return pd.DataFrame(out, columns=[*keys, "mean", "ci_low", "ci_high", "n"])


def curve_bands(
    metrics: pd.DataFrame, value: str, group: str = "variant", *, x: str = "iteration", reps: int = 1000, seed: int = 0
) -> pd.DataFrame:
    """Mean and bootstrap CI over runs at each x, per group (learning-curve bands).

    Each run contributes its own value at x; points where fewer than two runs logged the
    metric have a NaN CI. Columns: group, x, "mean", "ci_low", "ci_high", "n".
    """
    if value not in metrics:
        raise KeyError(f"metric {value!r} not in the frame; have {sorted(metrics.columns)}")
    return summarize(metrics, value, [group, x], reps=reps, seed=seed)


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
