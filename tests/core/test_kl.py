"""The estimator truth table, proven by exact enumeration (float64) and by seeded Monte Carlo.

Enumeration trick: one position per vocabulary item. Position j holds the same next-token
distributions and the sampled token p = j, so est[j] is the estimate when j is drawn and
    E[est]      = sum_j pi_s(j) est[j]
    E[grad est] = grad of sum_j sg(pi_s(j)) est[j]
exactly, where pi_s is the sampling distribution (pi_theta on-policy, pi_old off-policy).
"""

import math

import pytest
import torch

from ema_pg_core.kl import (
    KL_ESTIMATORS,
    ImportanceWeight,
    KLInputs,
    aggregate,
    get_estimator,
    kl_per_token,
    register_kl,
)

V = 16


@pytest.fixture(autouse=True)
def float64():
    """Exact checks in float64; restored afterwards so other test modules keep float32."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


SAMPLED = ["k1", "k2", "k3", "k3++", "k4", "k5", "k1+", "k3+"]


def make_logits(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    z = (scale * torch.randn(V, generator=g)).requires_grad_(True)
    zr = z.detach() + 0.7 * torch.randn(V, generator=g)  # anchor near the policy
    zo = z.detach() + 0.5 * torch.randn(V, generator=g)  # pi_old, for off-policy sampling
    return z, zr, zo


def enum_inputs(z, zr, zo=None, k=0, head_of="old"):
    """KLInputs with T = V positions, position j sampling token j. Shapes (1, V[, K/V])."""
    logp_all, logr_all = torch.log_softmax(z, -1), torch.log_softmax(zr, -1)
    tok = torch.arange(V)
    head_src = {"old": zo if zo is not None else z.detach(), "ref": zr}[head_of]
    idx = torch.topk(head_src, k).indices if k > 0 else torch.zeros(0, dtype=torch.long)
    idx = idx.expand(1, V, k)
    return KLInputs(
        logp=logp_all[tok][None],
        ref_logp=logr_all[tok][None],
        old_logp=None if zo is None else torch.log_softmax(zo, -1)[tok][None],
        sampled=tok[None],
        topk_idx=idx,
        logits_k=z[idx],
        lse=torch.logsumexp(z, -1).expand(1, V),
        ref_logits_k=zr[idx],
        ref_lse=torch.logsumexp(zr, -1).expand(1, V),
        logits=z.expand(1, V, V),
        ref_logits=zr.expand(1, V, V),
    )


def exact_kl(z, zr, direction):
    lq, lr = torch.log_softmax(z, -1), torch.log_softmax(zr, -1)
    return (lq.exp() * (lq - lr)).sum() if direction == "reverse" else (lr.exp() * (lr - lq)).sum()


NO_IW = ImportanceWeight()


def expectation(name, z, zr, zo=None, k=0, tail="unbiased", iw=NO_IW):
    """Exact (E[value], E[grad wrt z]) of an estimator under pi_s (= pi_old if zo else pi_theta)."""
    head_of = "ref" if get_estimator(name).direction == "forward" else "old"
    x = enum_inputs(z, zr, zo, k, head_of)
    est = kl_per_token(name, x, tail=tail, iw=iw)[0]  # (V,)
    pi_s = torch.softmax(zo if zo is not None else z.detach(), -1)
    mean = (pi_s * est).sum()
    (g,) = torch.autograd.grad(mean, z)
    return mean.detach(), g


def exact(z, zr, direction):
    val = exact_kl(z, zr, direction)
    (g,) = torch.autograd.grad(val, z)
    return val.detach(), g


# --------------------------------------------------------------------------------------
# The paper's Table 1 (docs/algorithm.md): which estimator is unbiased in value / gradient, on-policy
# --------------------------------------------------------------------------------------
TABLE1 = {  # name: (value unbiased, gradient unbiased) for its direction
    "k1": (True, False),
    "k2": (False, True),
    "k3": (True, False),
    "k3++": (True, True),
    "k4": (True, True),
    "k5": (True, True),
    "k1+": (True, True),
    "k3+": (True, True),
    "exact_reverse": (True, True),
    "exact_forward": (True, True),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(TABLE1))
def test_table1_on_policy(name, seed):
    z, zr, _ = make_logits(seed)
    direction = get_estimator(name).direction
    ev, eg = expectation(name, z, zr)
    kv, kg = exact(z, zr, direction)
    value_ok, grad_ok = TABLE1[name]
    assert torch.allclose(ev, kv, atol=1e-10) == value_ok, (ev, kv)
    assert torch.allclose(eg, kg, atol=1e-10) == grad_ok, (eg - kg).abs().max()


def test_k1_expected_gradient_is_zero_and_k3_gradient_is_forward():
    z, zr, _ = make_logits(3)
    _, g1 = expectation("k1", z, zr)
    assert g1.abs().max() < 1e-12
    _, g3 = expectation("k3", z, zr)
    _, g_fwd = exact(z, zr, "forward")
    assert torch.allclose(g3, g_fwd, atol=1e-10)


def test_k2_value_is_half_mean_squared_log_ratio():
    z, zr, _ = make_logits(4)
    ev, _ = expectation("k2", z, zr)
    lq, lr = torch.log_softmax(z.detach(), -1), torch.log_softmax(zr, -1)
    assert torch.allclose(ev, (lq.exp() * 0.5 * (lq - lr) ** 2).sum(), atol=1e-12)


# --------------------------------------------------------------------------------------
# Top-k (docs/algorithm.md): values unbiased; paper tails biased in gradient by +/- grad(mass); unbiased tails exact
# --------------------------------------------------------------------------------------
KS = [0, 1, 5, V]


def head_mass_grad(z, idx):
    (g,) = torch.autograd.grad(torch.softmax(z, -1)[idx].sum(), z)
    return g


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_topk_value_and_gradient(direction, k, seed):
    z, zr, _ = make_logits(seed)
    name = f"topk_{direction}"
    kv, kg = exact(z, zr, direction)
    # q: pi_old's top-k for reverse (on-policy pi_old = pi_theta), the anchor's for forward
    q = torch.topk(z.detach() if direction == "reverse" else zr, k).indices
    ev_u, eg_u = expectation(name, z, zr, k=k, tail="unbiased")
    ev_p, eg_p = expectation(name, z, zr, k=k, tail="paper")
    assert torch.allclose(ev_u, kv, atol=1e-10) and torch.allclose(ev_p, kv, atol=1e-10)
    assert torch.allclose(eg_u, kg, atol=1e-10), (eg_u - kg).abs().max()
    # paper tail: E[grad] - grad KL = +grad pi(q) (reverse) or +grad pi(V \ q) = -grad pi(q) (forward)
    sign = 1.0 if direction == "reverse" else -1.0
    bias = eg_p - kg
    assert torch.allclose(bias, sign * head_mass_grad(z, q), atol=1e-10)
    if 0 < k < V:  # the bias is real, not a rounding artefact
        assert bias.abs().max() > 1e-3


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_topk_endpoints(direction):
    """k=0 is the pure sampled estimator (K4 / K5 = the paper tail); k=|V| is the exact KL."""
    z, zr, _ = make_logits(7)
    name, sampled = f"topk_{direction}", {"reverse": "k4", "forward": "k5"}[direction]
    x0 = enum_inputs(z, zr, k=0, head_of="old" if direction == "reverse" else "ref")
    assert torch.allclose(kl_per_token(name, x0, tail="paper"), kl_per_token(sampled, x0), atol=1e-12)
    xv = enum_inputs(z, zr, k=V, head_of="old" if direction == "reverse" else "ref")
    per_token = kl_per_token(name, xv, tail="paper")
    assert torch.allclose(per_token, exact_kl(z, zr, direction).expand(1, V), atol=1e-12)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_truncated_kl_drops_the_tail(direction):
    z, zr, _ = make_logits(8)
    k = 4
    q = torch.topk(z.detach() if direction == "reverse" else zr, k).indices
    ev, eg = expectation(f"topk_{direction}", z, zr, k=k, tail="none")
    lq, lr = torch.log_softmax(z, -1), torch.log_softmax(zr, -1)
    head = (lq.exp() * (lq - lr))[q].sum() if direction == "reverse" else (lr.exp() * (lr - lq))[q].sum()
    (g,) = torch.autograd.grad(head, z)
    assert torch.allclose(ev, head.detach(), atol=1e-12) and torch.allclose(eg, g, atol=1e-12)
    assert not torch.allclose(ev, exact_kl(z, zr, direction).detach(), atol=1e-4)


# --------------------------------------------------------------------------------------
# Off-policy: sampling from pi_old != pi_theta with s = sg(pi/pi_old) stays unbiased
# --------------------------------------------------------------------------------------
OFF_POLICY_UNBIASED = ["k3++", "k4", "k5", "k1+", "k3+"]


@pytest.mark.parametrize("name", OFF_POLICY_UNBIASED + ["topk_reverse", "topk_forward"])
def test_importance_weighted_is_unbiased_off_policy(name):
    z, zr, zo = make_logits(11)
    direction = get_estimator(name).direction
    kv, kg = exact(z, zr, direction)
    k = 5 if name.startswith("topk") else 0
    iw = ImportanceWeight(enabled=True)
    ev, eg = expectation(name, z, zr, zo=zo, k=k, iw=iw)
    assert torch.allclose(ev, kv, atol=1e-10) and torch.allclose(eg, kg, atol=1e-10)
    # without the weight, sampling from pi_old is biased
    ev0, eg0 = expectation(name, z, zr, zo=zo, k=k)
    assert not (torch.allclose(ev0, kv, atol=1e-6) and torch.allclose(eg0, kg, atol=1e-6))


def test_importance_weight_clip_bounds():
    z, zr, zo = make_logits(12)
    x = enum_inputs(z, zr, zo)
    unclipped = kl_per_token("k4", x, iw=ImportanceWeight(True))
    clipped = kl_per_token("k4", x, iw=ImportanceWeight(True, 0.9, 1.1))
    s = torch.exp(x.logp.detach() - x.old_logp)
    assert torch.allclose(clipped, unclipped / s * s.clamp(0.9, 1.1))
    with pytest.raises(ValueError, match="old_logp"):
        kl_per_token("k4", enum_inputs(z, zr), iw=ImportanceWeight(True))


# --------------------------------------------------------------------------------------
# Sanity properties
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS))
def test_kl_of_distribution_with_itself_is_zero(name):
    z, _, _ = make_logits(5)
    x = enum_inputs(z, z.detach().clone(), k=3, head_of="ref" if get_estimator(name).direction == "forward" else "old")
    for tail in ("paper", "unbiased", "none"):
        assert kl_per_token(name, x, tail=tail).abs().max() < 1e-12


@pytest.mark.parametrize("name", ["exact_reverse", "exact_forward", "k3"])
def test_nonnegative(name):
    z, zr, _ = make_logits(6, scale=3.0)
    assert (kl_per_token(name, enum_inputs(z, zr)) >= -1e-12).all()


@pytest.mark.parametrize("plus,base", [("k1+", "k1"), ("k3+", "k3")])
def test_straight_through_value_and_gradient(plus, base):
    z, zr, _ = make_logits(9)
    x = enum_inputs(z, zr)
    v_plus, v_base, v_k2 = (kl_per_token(n, x)[0] for n in (plus, base, "k2"))
    assert torch.allclose(v_plus, v_base)
    w = torch.rand(V, generator=torch.Generator().manual_seed(0))
    (g_plus,) = torch.autograd.grad((w * v_plus).sum(), z, retain_graph=True)
    (g_k2,) = torch.autograd.grad((w * v_k2).sum(), z)
    assert torch.allclose(g_plus, g_k2)


def test_k3_clamps():
    """K3 clamps log w to [-20, 20] and the value to [-10, 10]: at log w = -30 the value is 10."""
    logp = torch.tensor([[0.0]], requires_grad=True)
    x = KLInputs(logp=logp, ref_logp=torch.tensor([[-30.0]]))
    v = kl_per_token("k3", x)
    assert v.item() == 10.0
    (g,) = torch.autograd.grad(v.sum(), logp)
    assert g.item() == 0.0  # clamp active -> zero gradient (as verl's low_var_kl)


# --------------------------------------------------------------------------------------
# Monte Carlo: the sample mean converges at the rate the exact variance predicts
# --------------------------------------------------------------------------------------
def exact_variance(name, z, zr, k=0, tail="unbiased"):
    head_of = "ref" if get_estimator(name).direction == "forward" else "old"
    est = kl_per_token(name, enum_inputs(z, zr, k=k, head_of=head_of), tail=tail)[0].detach()
    pi = torch.softmax(z.detach(), -1)
    mean = (pi * est).sum()
    return est, pi, mean, (pi * (est - mean) ** 2).sum()


@pytest.mark.parametrize("name", ["k1", "k3", "k3++", "k4", "k5", "topk_reverse", "topk_forward"])
def test_monte_carlo_rate_matches_variance(name):
    z, zr, _ = make_logits(13)
    k = 3 if name.startswith("topk") else 0
    est, pi, mean, var = exact_variance(name, z, zr, k)
    g = torch.Generator().manual_seed(1234)
    R = 400  # independent replications; the sample std of R means has relative sd ~ 1/sqrt(2R) = 3.5%
    for n in (16, 256):
        draws = torch.multinomial(pi, R * n, replacement=True, generator=g).view(R, n)
        means = est[draws].mean(-1)
        # bias of the grand mean: 5 standard errors of R*n draws
        assert abs(means.mean() - mean) < 5 * math.sqrt(var / (R * n))
        # spread of the batch means is sqrt(var / n): within 6 relative sd (~21%)
        ratio = means.std() / math.sqrt(var / n)
        assert abs(ratio - 1) < 6 / math.sqrt(2 * R), (n, ratio.item())


@pytest.mark.parametrize("direction,sampled", [("reverse", "k4"), ("forward", "k5")])
def test_topk_variance_decreases_with_k(direction, sampled):
    """Top-k interpolates between the sampled estimator (k=0) and the exact KL (k=|V|, variance 0).

    Per distribution the variance need not fall at every single step (moving token j into the head
    changes the tail variance by -pi_j t_j (t_j (1 + pi_j) - 2 m), which can be positive), so the
    monotone trend is asserted for the mean over 20 random distributions, with the endpoints per
    distribution (k=0 is K4/K5 exactly, k=|V| has zero variance).
    """
    name, ks = f"topk_{direction}", (0, 1, 2, 4, 8, V)
    table = []
    for seed in range(20):
        z, zr, _ = make_logits(100 + seed, scale=2.0)
        v = [exact_variance(name, z, zr, k)[3].item() for k in ks]
        assert v[-1] < 1e-20
        assert math.isclose(
            exact_variance(name, z, zr, 0, tail="paper")[3].item(),
            exact_variance(sampled, z, zr)[3].item(),
            rel_tol=1e-10,
        )
        table.append(v)
    mean_v = torch.tensor(table).mean(0).tolist()
    assert all(a > b for a, b in zip(mean_v, mean_v[1:])), mean_v


# --------------------------------------------------------------------------------------
# Aggregation (hand-worked)
# --------------------------------------------------------------------------------------
def test_aggregation_modes_hand_worked():
    # seq 0: tokens [1, 2, (pad 9)]; seq 1: tokens [3, (pad 9), (pad 9)]
    x = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate(x, m, "token-mean").item() == pytest.approx(2.0)  # (1+2+3)/3
    assert aggregate(x, m, "seq-mean-token-mean").item() == pytest.approx(2.25)  # (1.5 + 3)/2
    assert aggregate(x, m, "seq-mean-token-sum").item() == pytest.approx(3.0)  # (3 + 3)/2
    assert aggregate(x, m, "sum").item() == pytest.approx(6.0)
    # an empty sequence does not dilute seq-mean-token-mean
    assert aggregate(
        torch.cat([x, x[:1]]), torch.cat([m, torch.zeros(1, 3)]), "seq-mean-token-mean"
    ).item() == pytest.approx(2.25)


# --------------------------------------------------------------------------------------
# Contract and bad input
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS))
def test_every_estimator_returns_B_T(name):
    B, T, K, Vv = 3, 5, 4, 11
    g = torch.Generator().manual_seed(0)
    logits, ref = torch.randn(B, T, Vv, generator=g), torch.randn(B, T, Vv, generator=g)
    tok = torch.randint(Vv, (B, T), generator=g)
    idx = torch.topk(logits, K).indices
    x = KLInputs(
        logp=torch.log_softmax(logits, -1).gather(-1, tok[..., None])[..., 0],
        ref_logp=torch.log_softmax(ref, -1).gather(-1, tok[..., None])[..., 0],
        sampled=tok,
        topk_idx=idx,
        logits_k=logits.gather(-1, idx),
        lse=logits.logsumexp(-1),
        ref_logits_k=ref.gather(-1, idx),
        ref_lse=ref.logsumexp(-1),
        logits=logits,
        ref_logits=ref,
    )
    assert kl_per_token(name, x).shape == (B, T)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown KL estimator.*allowed: .*k3"):
        get_estimator("k7")
    assert get_estimator("low_var_kl").name == "k3"
    x = KLInputs(logp=torch.zeros(2, 3), ref_logp=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="missing KLInputs field.*topk_idx"):
        kl_per_token("topk_reverse", x)
    with pytest.raises(ValueError, match="tail"):
        kl_per_token("k3", x, tail="both")
    with pytest.raises(ValueError, match="ref_logp has shape"):
        kl_per_token("k3", KLInputs(logp=torch.zeros(2, 3), ref_logp=torch.zeros(2, 4)))
    with pytest.raises(ValueError, match="aggregation mode"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3), "mean")
    with pytest.raises(ValueError, match="already registered"):
        register_kl("k3", needs="sampled", direction="reverse", summary="dup")(lambda x, **kw: x.logp)
