"""analysis.stats against values worked out by hand (in the comments)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis import stats


def test_mean_by_hand():
    s = np.array([[0.1, 0.9], [0.2, 0.5], [0.3, 0.4]])
    assert stats.mean_score(s) == pytest.approx(2.4 / 6)


def test_probability_of_improvement_by_hand():
    # x=[1,2,3], y=[0,2,4]: of 9 pairs, x>y: (1,0) (2,0) (3,0) (3,2) = 4, ties: (2,2) = 1/2 -> 4.5/9
    assert stats.probability_of_improvement([1, 2, 3], [0, 2, 4]) == pytest.approx(0.5)
    assert stats.probability_of_improvement([3, 4], [1, 2]) == 1.0
    assert stats.probability_of_improvement([1, 1], [1, 1]) == 0.5
    # two tasks: task 1 gives 1.0, task 2 x=[0,1] vs y=[1,1] gives (0+0+.5+.5)/4 = 0.25 -> mean 0.625
    assert stats.probability_of_improvement([[3, 0], [4, 1]], [[1, 1], [2, 1]]) == pytest.approx(0.625)


def test_pass_at_k_by_hand():
    assert stats.pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c/n
    assert stats.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert stats.pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert stats.pass_at_k(5, 4, 2) == 1.0  # n-c=1 < k: every draw hits
    assert stats.pass_at_k(5, 0, 3) == 0.0
    np.testing.assert_allclose(stats.pass_at_k([10, 5], [3, 2], 1), [0.3, 0.4])
    # large n: the product form stays finite where the binomials overflow a float
    big = stats.pass_at_k(2000, 1, 1000)
    assert big == pytest.approx(1000 / 2000) and math.isfinite(big)
    exact = 1 - math.comb(200 - 7, 50) / math.comb(200, 50)
    assert stats.pass_at_k(200, 7, 50) == pytest.approx(exact, rel=1e-12)
    with pytest.raises(ValueError):
        stats.pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        stats.pass_at_k(4, 1, 5)


def test_bootstrap_ci_two_point_distribution():
    # x=[0,1]: bootstrap means are 0, 0.5, 1 with prob 1/4, 1/2, 1/4 -> 2.5% and 97.5% quantiles 0, 1
    m, lo, hi = stats.bootstrap_ci([0.0, 1.0], reps=2000, seed=0)
    assert (m, lo, hi) == (0.5, 0.0, 1.0)


def test_bootstrap_is_stratified_by_task():
    # Each task column is constant, so resampling runs *within* a task never changes the mean:
    # the stratified CI collapses to the point. Pooling the 6 values would give a wide CI.
    s = np.array([[0.2, 0.8], [0.2, 0.8], [0.2, 0.8]])
    assert stats.bootstrap_ci(s, reps=500, seed=1) == (0.5, 0.5, 0.5)
    pooled = stats.bootstrap_ci(s.ravel(), reps=500, seed=1)
    assert pooled[2] - pooled[1] > 0.2


def test_bootstrap_seeded_and_sane():
    x = np.array([0.31, 0.35, 0.29, 0.40, 0.33])
    a = stats.bootstrap_ci(x, reps=300, seed=7)
    assert a == stats.bootstrap_ci(x, reps=300, seed=7)  # same seed, same CI
    y = np.random.default_rng(0).normal(size=40)  # many distinct means
    assert stats.bootstrap_ci(y, reps=300, seed=7) != stats.bootstrap_ci(y, reps=300, seed=8)
    m, lo, hi = stats.bootstrap_ci(x, reps=300, seed=0)
    assert m == pytest.approx(x.mean()) and x.min() <= lo < m < hi <= x.max()
    m1, lo1, hi1 = stats.bootstrap_ci([0.4], reps=100)
    assert m1 == 0.4 and math.isnan(lo1) and math.isnan(hi1)  # one seed: no CI
    with pytest.raises(ValueError, match="NaN"):
        stats.bootstrap_ci([0.1, float("nan")])


def test_summarize():
    df = pd.DataFrame({"v": ["a", "a", "a", "b"], "it": [0, 0, 0, 0], "y": [0.1, 0.2, 0.3, 0.5]})
    s = stats.summarize(df, "y", "v", reps=200)
    assert s["mean"].tolist() == pytest.approx([0.2, 0.5]) and s["n"].tolist() == [3, 1]
    assert math.isnan(s.loc[1, "ci_low"])
    c = stats.summarize(df, "y", ["v", "it"], reps=200)  # the curves' bands: per group and iteration
    assert list(c.columns) == ["v", "it", "mean", "ci_low", "ci_high", "n"]


def test_pass_at_k_frame():
    ev = pd.DataFrame(
        {
            "run_id": "r",
            "iteration": 5,
            "model": "policy",
            "benchmark": "b",
            "problem_id": ["p0", "p1"],
            "n": [4, 4],
            "n_correct": [1, 4],
        }
    )
    out = stats.pass_at_k_frame(ev, [1, 2, 8])
    # pass@1: mean(1/4, 1) = 0.625; pass@2: mean(1 - C(3,2)/C(4,2), 1) = mean(0.5, 1) = 0.75
    assert out.loc[0, "pass@1"] == pytest.approx(0.625) and out.loc[0, "pass@2"] == pytest.approx(0.75)
    assert math.isnan(out.loc[0, "pass@8"]) and out.loc[0, "n_problems"] == 2


# ---------------------------------------------------------------- compare: the exact permutation test
def test_sign_flip_p_value_by_hand():
    # d = x - y = (1, 2, 3): the 8 sign flips give sums 6, 4, 2, 0, 0, -2, -4, -6; |sum| >= 6 twice -> p = 2/8
    c = stats.compare([2.0, 3.0, 4.0], [1.0, 1.0, 1.0])
    assert c.p == 0.25 and c.min_p == 0.25 and c.n == 3 and c.paired
    assert c.gain == pytest.approx(3.0 / 1.0 - 1) and c.poi == 1.0
    # 3 seeds can never be clear at 5%: the CI cannot be bounded, the verdict says so
    assert c.ci == (-math.inf, math.inf) and c.verdict == "not separable" and not c.clear
    assert "not separable at 3 seeds (a 95% decision needs >= 6)" in c.describe()
    # 6 seeds all better: p = 2/64, clear at 5%. Five better by 0.5, one worse by 0.5: the flipped sums are
    # 0.5 * (a sum of six +-1), which reaches |2| when at most one sign differs from all the others:
    # 1 + 6 + 6 + 1 = 14 of 64
    assert stats.compare(np.arange(6) + 1.0, np.arange(6) + 0.5).p == 2 / 64
    c = stats.compare([1.5, 2.5, 3.5, 4.5, 5.5, 5.5], [1, 2, 3, 4, 5, 6.0])
    assert c.p == 14 / 64 and c.verdict == "unclear"
    same = stats.compare([0.2, 0.5, 0.8], [0.2, 0.5, 0.8])  # identical runs: no difference at all
    assert same.p == 1.0 and same.gain == 0.0


def test_p_values_equal_scipys_exact_permutation_test():
    from scipy import stats as st

    rng = np.random.default_rng(3)
    for n in (3, 6, 9):
        x, y = rng.normal(1, 0.2, n), rng.normal(1.1, 0.2, n)
        paired = st.permutation_test(
            (x, y), lambda a, b: np.mean(a - b), permutation_type="samples", n_resamples=np.inf
        )
        assert stats.compare(x, y).p == pytest.approx(paired.pvalue, abs=1e-12)
        unpaired = st.permutation_test((x, y), lambda a, b: np.mean(a) - np.mean(b), n_resamples=np.inf)
        assert stats.compare(x, y, paired=False).p == pytest.approx(unpaired.pvalue, abs=1e-12)


def test_ci_is_the_test_inverted():
    # The CI's ends are where the test at the shifted differences turns from keeping to rejecting, and the
    # CI excludes 0 exactly when p <= alpha (the one decision the report, the map and adaptive seeds use).
    rng = np.random.default_rng(0)
    for _ in range(30):
        y = rng.uniform(0.3, 0.5, 8)
        x = y + rng.normal(0.02, 0.03, 8)
        c = stats.compare(x, y)
        lo, hi = (v * y.mean() for v in c.ci)  # back to the mean difference
        d = x - y
        p_at = lambda shift, d=d: stats.compare(d - shift + 1.0, np.ones(8)).p  # noqa: E731 (H0: mean d = shift)
        eps = 1e-6 * (abs(lo) + abs(hi))
        assert p_at(lo + eps) > 0.05 >= p_at(lo - eps) and p_at(hi - eps) > 0.05 >= p_at(hi + eps)
        assert (c.ci[0] > 0 or c.ci[1] < 0) == c.clear == (c.p <= 0.05)


def test_levels_of_sequential_looks():
    # 2 / 2^n is the smallest p-value of n paired seeds: 3 and 5 seeds cannot reach 5%, 7 can
    assert stats.look_alphas([3, 5, 7], 0.05) == [0.0, 0.0, 0.05]
    assert stats.look_alphas([7, 10, 13], 0.05) == pytest.approx([0.05 / 3] * 3)
    assert stats.look_alphas([6, 8, 10], 0.05) == [0.0, 0.025, 0.025]  # 2/64 > 0.05/3: look 6 is dropped
    assert stats.look_alphas([3, 4], 0.05) == [0.0, 0.0]  # nothing can be decided
    assert stats.min_seeds(0.05) == 6 and stats.min_seeds(0.01) == 8 and stats.min_seeds(0.5) == 2


def test_seeds_for_power_matches_the_t_test_tables():
    # A paired t-test at two-sided 5% with 80% power needs 10 seeds at effect size 1 and 34 at 0.5 (Cohen's
    # tables; G*Power gives the same); never fewer than the exact test's 6, None without an effect.
    z = np.array([-1.5, -0.5, 0.5, 1.5])
    z = z / z.std(ddof=1)  # mean 0, sd 1
    assert stats.seeds_for_power(2.0 + 2.0 * z, 0.05) == 10
    assert stats.seeds_for_power(1.0 + 2.0 * z, 0.05) == 34
    assert stats.seeds_for_power(np.full(4, 0.1), 0.05) == 6
    assert stats.seeds_for_power(z, 0.05) is None


def test_paired_probability_of_improvement():
    # per seed: 1 > 0 wins, 2 == 2 ties (1/2), 3 < 5 loses, 4 > 3 wins -> (1 + 0.5 + 0 + 1) / 4
    x, y = [1.0, 2.0, 3.0, 4.0], [0.0, 2.0, 5.0, 3.0]
    assert stats.paired_poi(x, y) == 0.625 == stats.compare(x, y).poi
    # unpaired compares all 16 pairs: x=1 beats 0 (1); x=2 beats 0, ties 2 (1.5); x=3 beats 0, 2,
    # ties 3 (2.5); x=4 beats 0, 2, 3 (3) -> 8 / 16
    assert stats.probability_of_improvement(x, y) == 0.5 == stats.compare(x, y, paired=False).poi
    # two tasks: a mean over seeds and tasks; x wins on task 0 on both seeds, ties once on task 1
    s_x, s_y = np.array([[0.5, 0.2], [0.7, 0.3]]), np.array([[0.4, 0.2], [0.6, 0.4]])
    assert stats.paired_poi(s_x, s_y) == pytest.approx((1 + 0.5 + 1 + 0) / 4)
    with pytest.raises(ValueError, match="same shape"):
        stats.compare([0.5, 0.6], [0.4])
