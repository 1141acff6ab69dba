import pytest
import torch
from torch import nn

from ema_pg_core.anchor import EmaAnchor, ema_update_
from ema_pg_core.config import AnchorConfig


class Tiny(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.lin = nn.Linear(4, 3).to(dtype)
        self.norm = nn.LayerNorm(3).to(dtype)
        self.register_buffer("scale", torch.ones(3, dtype=dtype))  # floating buffer: mixed
        self.register_buffer("pos", torch.arange(3))  # integer buffer: skipped


def perturb_(m, seed, eps=1.0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in list(m.parameters()) + [m.scale]:
            t.add_(eps * torch.randn(t.shape, generator=g).to(t.dtype))
        m.pos.add_(1)


def flat(m):
    return torch.cat([t.detach().float().flatten() for t in list(m.parameters()) + [m.scale]])


def test_anchor_starts_as_the_initial_policy_and_is_a_copy():
    pol = Tiny()
    a = EmaAnchor(pol, AnchorConfig(tau=0.9, period=1))
    assert torch.equal(flat(a.module), flat(pol))
    perturb_(pol, 0)
    assert not torch.equal(flat(a.module), flat(pol))
    assert not any(p.requires_grad for p in a.module.parameters())


def test_tau_one_leaves_the_anchor_untouched_and_tau_zero_copies():
    pol = Tiny()
    fixed, copy_ = EmaAnchor(pol, AnchorConfig(1.0, 1)), EmaAnchor(pol, AnchorConfig(0.0, 1))
    before = flat(fixed.module)
    perturb_(pol, 1)
    assert fixed.update(1, pol) is False and torch.equal(flat(fixed.module), before)
    assert copy_.update(1, pol) is True and torch.equal(flat(copy_.module), flat(pol))


def test_update_is_the_ema_formula_on_params_and_floating_buffers_only():
    pol = Tiny()
    a = EmaAnchor(pol, AnchorConfig(tau=0.75, period=1))
    old = flat(a.module)
    perturb_(pol, 2)
    a.update(1, pol)
    assert torch.allclose(flat(a.module), 0.75 * old + 0.25 * flat(pol), atol=1e-6)
    assert torch.equal(a.module.pos, torch.arange(3))  # integer buffer untouched


def test_period_schedule_fires_after_iterations_p_2p_3p():
    pol = Tiny()
    a = EmaAnchor(pol, AnchorConfig(tau=0.5, period=10))
    fired = [it for it in range(0, 36) if a.update(it, pol)]
    assert fired == [10, 20, 30] and a.num_updates == 3
    assert AnchorConfig(0.5, 1).due(1) and not AnchorConfig(0.5, 1).due(0) and not AnchorConfig(1.0, 1).due(1)


def test_drift_metric():
    pol = Tiny()
    a = EmaAnchor(pol, AnchorConfig(0.9, 1))
    assert a.drift(pol)["anchor/drift"] == 0.0
    perturb_(pol, 3)
    d = a.drift(pol)
    expect = (flat(pol) - flat(a.module)).norm() / flat(pol).norm()
    assert d["anchor/drift"] == pytest.approx(expect.item(), rel=1e-5)


def test_state_round_trip_continues_identically():
    pol = Tiny()
    a = EmaAnchor(pol, AnchorConfig(0.8, 2, fp32_shadow=True))
    perturb_(pol, 4)
    a.update(2, pol)
    b = EmaAnchor(Tiny(), AnchorConfig(0.8, 2, fp32_shadow=True))
    b.load_state_dict(a.state_dict())
    assert torch.equal(flat(a.module), flat(b.module)) and b.num_updates == 1
    perturb_(pol, 5)
    a.update(4, pol), b.update(4, pol)
    assert torch.equal(flat(a.module), flat(b.module))
    with pytest.raises(ValueError, match="fp32_shadow"):
        EmaAnchor(Tiny(), AnchorConfig(0.8, 2)).load_state_dict(a.state_dict())


def test_fp32_shadow_accumulates_what_bf16_rounds_away():
    """(1 - tau) * (theta - theta_ema) below bf16's half-ulp is lost every step in bf16.

    A parameter at 1.0 in bf16 has ulp 2^-7 = 0.0078; the policy sits at 1.0078125 (one ulp up)
    and tau = 0.95, so each step moves the anchor by 0.05 * 0.0078 = 0.00039 < ulp/2: plain bf16
    never moves; the fp32 shadow converges towards the policy and the bf16 copy follows it.
    """
    pol = Tiny(torch.bfloat16)
    with torch.no_grad():
        for t in list(pol.parameters()) + [pol.scale]:
            t.fill_(1.0)
    plain, shadow = EmaAnchor(pol, AnchorConfig(0.95, 1)), EmaAnchor(pol, AnchorConfig(0.95, 1, fp32_shadow=True))
    with torch.no_grad():
        for t in list(pol.parameters()) + [pol.scale]:
            t.fill_(1.0078125)
    for it in range(1, 101):
        plain.update(it, pol), shadow.update(it, pol)
    assert torch.all(flat(plain.module) == 1.0)  # rounded away, 100 times
    assert torch.all(flat(shadow.module) == 1.0078125)  # shadow: 1 + ulp * (1 - 0.95^100) rounds up
    assert abs(shadow.shadow[0][0, 0].item() - (1 + 0.0078125 * (1 - 0.95**100))) < 1e-6


def test_ema_update_function_and_bad_arguments():
    a, p = [torch.zeros(3), torch.ones(2)], [torch.ones(3), torch.zeros(2)]
    ema_update_(a, p, 0.9)
    assert torch.allclose(a[0], torch.full((3,), 0.1)) and torch.allclose(a[1], torch.full((2,), 0.9))
    for bad in (-0.1, 1.01, "0.9"):
        with pytest.raises(ValueError, match="tau must be in"):
            AnchorConfig(bad, 1)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="period must be an integer >= 1"):
            AnchorConfig(0.9, bad)
