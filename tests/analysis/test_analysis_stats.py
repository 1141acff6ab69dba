"""analysis.stats against values worked out by hand (in the comments)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis import stats


def test_mean_and_iqm_by_hand():
    # sorted: 1 2 3 4 7 8 9 100; n=8, drop int(0.25*8)=2 at each end -> mean(3,4,7,8) = 22/4 = 5.5
    assert stats.iqm(stats.as_scores([1, 2, 3, 4, 100, 7, 8, 9])) == pytest.approx(5.5)
    # n=5: drop int(1.25)=1 at each end -> mean(2,3,4) = 3 (scipy.stats.trim_mean(x, 0.25) agrees)
    assert stats.iqm(stats.as_scores([5, 1, 4, 2, 3])) == pytest.approx(3.0)
    # (runs x tasks): IQM pools all 6 scores: sorted 0.1 .2 .3 .4 .5 .9, drop 1 each end -> 0.35
    s = np.array([[0.1, 0.9], [0.2, 0.5], [0.3, 0.4]])
    assert stats.iqm(s) == pytest.approx(0.35)
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
    a = stats.bootstrap_ci(x, stats.iqm, reps=300, seed=7)
    assert a == stats.bootstrap_ci(x, stats.iqm, reps=300, seed=7)  # same seed, same CI
    y = np.random.default_rng(0).normal(size=40)  # many distinct means
    assert stats.bootstrap_ci(y, reps=300, seed=7) != stats.bootstrap_ci(y, reps=300, seed=8)
    m, lo, hi = stats.bootstrap_ci(x, reps=300, seed=0)
    assert m == pytest.approx(x.mean()) and x.min() <= lo < m < hi <= x.max()
    m1, lo1, hi1 = stats.bootstrap_ci([0.4], reps=100)
    assert m1 == 0.4 and math.isnan(lo1) and math.isnan(hi1)  # one seed: no CI
    with pytest.raises(ValueError, match="NaN"):
        stats.bootstrap_ci([0.1, float("nan")])


def test_two_sample_statistics():
    # gain of means: mean(x)=0.45, mean(y)=0.30 -> 0.5; constant samples -> degenerate CI
    g = stats.bootstrap_ci_two([0.45, 0.45], [0.3, 0.3], stats.relative_gain, reps=200)
    assert g == pytest.approx((0.5, 0.5, 0.5))
    p = stats.bootstrap_ci_two([0.5, 0.6, 0.7], [0.1, 0.2, 0.3], stats.poi_statistic, reps=200)
    assert p == (1.0, 1.0, 1.0)
    assert math.isnan(stats.bootstrap_ci_two([0.5], [0.1, 0.2], stats.relative_gain)[1])


def test_summarize_and_curve_bands():
    df = pd.DataFrame({"v": ["a", "a", "a", "b"], "it": [0, 0, 0, 0], "y": [0.1, 0.2, 0.3, 0.5]})
    s = stats.summarize(df, "y", "v", reps=200)
    assert s["mean"].tolist() == pytest.approx([0.2, 0.5]) and s["n"].tolist() == [3, 1]
    assert math.isnan(s.loc[1, "ci_low"])
    c = stats.curve_bands(df.rename(columns={"it": "iteration"}), "y", group="v")
    assert list(c.columns) == ["v", "iteration", "mean", "ci_low", "ci_high", "n"]


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


def test_paired_ci_excludes_zero_where_unpaired_straddles_it():
    # x = y + 0.01 on every seed, with a between-seed spread of 0.3: the gain of the means is
    # 0.01 / 0.5 = +2%. Resampling seeds jointly keeps every replicate's gain at 0.01 / mean(y*) > 0
    # (between 0.01/0.8 and 0.01/0.2); resampling each method on its own mixes the spread in.
    y = np.array([0.2, 0.5, 0.8])
    x = y + 0.01
    g, lo, hi = stats.paired_bootstrap_ci(x, y, stats.relative_gain, reps=2000, seed=0)
    assert g == pytest.approx(0.02) and 0.01 / 0.8 - 1e-12 <= lo and hi <= 0.01 / 0.2 + 1e-12
    gu, lou, hiu = stats.bootstrap_ci_two(x, y, stats.relative_gain, reps=2000, seed=0)
    assert gu == pytest.approx(0.02) and lou < 0 < hiu


def test_paired_resampling_uses_the_same_seeds_for_both():
    # x == y: with shared indices every replicate is exactly 0 (and P(improvement) exactly 1/2);
    # independent indices give nonzero gains.
    x = np.array([0.2, 0.5, 0.8, 0.4])
    assert stats.paired_bootstrap_ci(x, x.copy(), stats.relative_gain, reps=500) == (0.0, 0.0, 0.0)
    assert stats.paired_bootstrap_ci(x, x.copy(), stats.paired_poi_statistic, reps=500) == (0.5, 0.5, 0.5)
    _, lo, hi = stats.bootstrap_ci_two(x, x.copy(), stats.relative_gain, reps=500)
    assert lo < 0 < hi
    # stratified by task: each task column is resampled with one index set, shared by x and y
    s = np.array([[0.2, 0.9], [0.6, 0.1]])
    assert stats.paired_bootstrap_ci(s, s.copy(), stats.relative_gain, reps=200) == (0.0, 0.0, 0.0)
    assert math.isnan(stats.paired_bootstrap_ci([0.5], [0.4], stats.relative_gain)[1])  # one seed: no CI
    with pytest.raises(ValueError, match="same shape"):
        stats.paired_bootstrap_ci([0.5, 0.6], [0.4], stats.relative_gain)


def test_paired_probability_of_improvement():
    # per seed: 1 > 0 wins, 2 == 2 ties (1/2), 3 < 5 loses, 4 > 3 wins -> (1 + 0.5 + 0 + 1) / 4
    x, y = [1.0, 2.0, 3.0, 4.0], [0.0, 2.0, 5.0, 3.0]
    assert stats.paired_poi(x, y) == 0.625
    # unpaired compares all 16 pairs: x=1 beats 0 (1); x=2 beats 0, ties 2 (1.5); x=3 beats 0, 2,
    # ties 3 (2.5); x=4 beats 0, 2, 3 (3) -> 8 / 16
    assert stats.probability_of_improvement(x, y) == 0.5
    p, lo, hi = stats.paired_bootstrap_ci(x, y, stats.paired_poi_statistic, reps=2000, seed=0)
    assert p == 0.625 and 0 <= lo < p < hi <= 1
    assert (lo * 8).is_integer() and (hi * 8).is_integer()  # a mean of 4 values in {0, 1/2, 1}
    # two tasks: a mean over seeds and tasks; x wins on task 0 on both seeds, ties once on task 1
    s_x, s_y = np.array([[0.5, 0.2], [0.7, 0.3]]), np.array([[0.4, 0.2], [0.6, 0.4]])
    assert stats.paired_poi(s_x, s_y) == pytest.approx((1 + 0.5 + 1 + 0) / 4)
