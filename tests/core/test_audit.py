"""ema_pg_core.audit: the records behind `emapg figures` say what the paper's Table 1 and docs/algorithm.md say."""

import math

import numpy as np
import pytest

from ema_pg_core import audit
from ema_pg_core.kl import KL_ESTIMATORS

SEEDS = range(3)  # the figures use 8; three distributions already separate 1e-16 from 1e-2

# (estimator, tail): (value unbiased, gradient unbiased) -- Table 1 and the Top-k tails (docs/algorithm.md)
EXPECTED = {
    ("k1", None): (True, False),  # E[grad] = 0
    ("k2", None): (False, True),  # value is E[(log w)^2 / 2]
    ("k3", None): (True, False),  # E[grad] is the forward-KL gradient
    ("k3++", None): (True, True),
    ("k4", None): (True, True),
    ("k5", None): (True, True),
    ("k1+", None): (True, True),  # straight-through: value of k1, gradient of k2
    ("k3+", None): (True, True),
    ("exact_reverse", None): (True, True),
    ("exact_forward", None): (True, True),
    ("topk_reverse", "paper"): (True, False),  # + grad pi(head)
    ("topk_reverse", "unbiased"): (True, True),
    ("topk_reverse", "none"): (False, False),  # Truncated KL drops the tail
    ("topk_forward", "paper"): (True, False),  # + grad pi(tail)
    ("topk_forward", "unbiased"): (True, True),
    ("topk_forward", "none"): (False, False),
}


@pytest.fixture(scope="module")
def table():
    return audit.estimator_table(V=16, k=4, seeds=SEEDS)


def test_table_has_every_estimator_and_tail_once(table):
    assert [(r["estimator"], r["tail"]) for r in table] == list(EXPECTED)
    assert set(KL_ESTIMATORS) == {r["estimator"] for r in table}
    for r in table:
        assert (r["k"] == 4) == (r["tail"] is not None) and r["direction"] == KL_ESTIMATORS[r["estimator"]].direction


@pytest.mark.parametrize("off_policy", [False, True])
def test_table_verdicts_match_table1_and_the_tail_claims(table, off_policy):
    rows = table if not off_policy else audit.estimator_table(V=16, k=4, seeds=SEEDS, off_policy=True)
    for r in rows:
        key = (r["estimator"], r["tail"])
        assert (r["value_unbiased"], r["grad_unbiased"]) == EXPECTED[key], (key, r["value_bias"], r["grad_bias"])
        # unbiased means float64 rounding (~1e-16); biased means a real O(0.01-0.1) gap, never borderline
        for ok, bias in ((r["value_unbiased"], r["value_bias"]), (r["grad_unbiased"], r["grad_bias"])):
            assert bias < 1e-13 if ok else bias > 1e-2, (key, bias)


def test_table_variances_and_memory(table):
    by = {(r["estimator"], r["tail"]): r for r in table}
    for name in ("exact_reverse", "exact_forward"):
        assert by[name, None]["variance"] == 0.0 and by[name, None]["grad_variance"] == 0.0
        assert by[name, None]["bytes_per_token"] == 2 * 151_936 * 4
    assert by["topk_reverse", "none"]["variance"] == 0.0  # head only: deterministic given the prefix
    assert by["k3", None]["variance"] < by["k1", None]["variance"]  # the point of low_var_kl
    assert by["k4", None]["variance"] == pytest.approx(by["k1", None]["variance"], rel=1e-12)  # same value
    assert by["k4", None]["bytes_per_token"] == 8
    assert by["topk_forward", "paper"]["bytes_per_token"] == 32 * (8 + 4 + 4) + 4 * 4 + 8 == 536
    assert audit.bytes_per_token("sampled", iw=True) == 12 and audit.bytes_per_token("full", iw=True) == 1_215_488
    for r in table:
        assert isinstance(r["value_unbiased"], bool) and isinstance(r["bytes_per_token"], int)


def test_topk_sweep_interpolates_between_sampled_and_exact():
    V = 8
    rows = audit.topk_sweep(V=V, seeds=SEEDS)
    assert len(rows) == 2 * 3 * (V + 1)
    sampled = {r["estimator"]: r for r in audit.estimator_table(V=V, k=1, seeds=SEEDS)}
    for direction, tail0 in (("reverse", "k4"), ("forward", "k5")):
        for tail in ("paper", "unbiased", "none"):
            s = sorted((r for r in rows if r["direction"] == direction and r["tail"] == tail), key=lambda r: r["k"])
            assert [r["k"] for r in s] == list(range(V + 1))
            assert (
                s[-1]["value_variance"] == 0.0 and s[-1]["value_bias"] < 1e-13 and s[-1]["grad_bias"] < 1e-13
            )  # exact
            if tail == "paper":  # k=0 is exactly K4 / K5
                assert s[0]["value_variance"] == pytest.approx(sampled[tail0]["variance"], rel=1e-10)
            if tail != "none":
                assert s[0]["value_variance"] > s[V // 2]["value_variance"] > s[-1]["value_variance"]
                assert all(r["value_bias"] < 1e-13 for r in s)
            inner = s[1:-1]
            if tail == "unbiased":
                assert all(r["grad_bias"] < 1e-13 for r in s)
            elif tail == "paper":  # the mass term vanishes only at k = 0 and k = |V|
                assert s[0]["grad_bias"] < 1e-13 and all(r["grad_bias"] > 1e-3 for r in inner)
            else:
                assert all(r["value_bias"] > 1e-3 for r in s[:-1])


def test_anchor_horizon_matches_the_spec_table():
    """docs/algorithm.md, "Horizon", P = 10: tau 0.9 -> half-life 65.8, time constant 100; tau 0.95 -> 135.1, 200."""
    rows = {r["tau"]: r for r in audit.anchor_horizon(taus=(0.9, 0.95, 1.0), periods=(10,))}
    assert rows[0.9]["half_life"] == pytest.approx(65.8, abs=0.05) and rows[0.9]["time_constant"] == pytest.approx(100)
    assert rows[0.95]["half_life"] == pytest.approx(135.1, abs=0.05) and rows[0.95]["time_constant"] == pytest.approx(
        200
    )
    assert math.isinf(rows[1.0]["half_life"]) and math.isinf(rows[1.0]["time_constant"])  # fixed anchor
    # per-iteration decay tau^(1/P): 0.98952 and 0.99488 (spec table)
    assert 0.9**0.1 == pytest.approx(0.98952, abs=5e-6) and 0.95**0.1 == pytest.approx(0.99488, abs=5e-6)
    assert audit.half_life(0.0, 10) == 0.0


def test_stability_closed_form_agrees_with_eigenvalues_on_random_draws():
    """alpha (a + 2 eta/(1+eta) beta c) < 2  <=>  spectral radius < 1, for a > 0, 0 <= eta < 1."""
    rng = np.random.default_rng(0)
    n = 20_000
    alpha, a, bc, eta = rng.uniform(0, 3, n), rng.uniform(0.01, 3, n), rng.uniform(0, 10, n), rng.uniform(0, 0.999, n)
    margin = np.abs(alpha * (a + 2 * eta / (1 + eta) * bc) - 2) > 1e-9  # drop draws on the boundary itself
    rho = audit.spectral_radius(alpha, a, bc, eta)
    closed = audit.stable_closed_form(alpha, a, bc, eta)
    assert margin.sum() > 0.99 * n
    assert np.array_equal((rho < 1)[margin], closed[margin])
    assert 0.2 < closed.mean() < 0.8  # both regions are well sampled


def test_stability_limits_and_grid():
    # eta -> 1 (fixed anchor): alpha (a + beta c) < 2
    assert audit.stable_closed_form(0.5, 1.0, 2.9, 1 - 1e-9) and not audit.stable_closed_form(0.5, 1.0, 3.1, 1 - 1e-9)
    # a = 0: a marginal eigenvalue 1 (policy and anchor drift together)
    assert audit.spectral_radius(0.1, 0.0, 2.0, 0.9) == pytest.approx(1.0, abs=1e-12)
    grid = audit.stability_grid()
    assert all(r["stable"] == r["closed_form"] for r in grid)
    assert all(isinstance(r["stable"], bool) for r in grid)
    stable = [r["stable"] for r in grid]
    assert 0.1 < sum(stable) / len(stable) < 0.9


def test_records_match_the_analysis_schema():
    pytest.importorskip("pandas")
    from analysis.audit_schema import SCHEMA, check_records

    rec = audit.records(V=6, k=2, seeds=range(2))
    frames = check_records(rec)
    assert set(frames) == set(SCHEMA) and isinstance(rec["meta"], dict)
