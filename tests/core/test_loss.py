"""Hand-worked examples for every PPO clip branch, the dual clip, aggregation and GRPO advantages."""

import math

import pytest
import torch

from ema_pg_core.advantages import compute_advantages
from ema_pg_core.config import AdvantageConfig, AnchorConfig, KLConfig, LossConfig
from ema_pg_core.kl import KLInputs
from ema_pg_core.loss import policy_loss, ppo_clip_per_token

L = LossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)


def per_token(ratio, adv, cfg=L):
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    pg, ind = ppo_clip_per_token(
        logp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([[adv]], dtype=torch.float64), cfg
    )
    (g,) = torch.autograd.grad(pg.sum(), logp)
    return pg.item(), g.item(), ind["clip"].item(), ind["dual_clip"].item()


@pytest.mark.parametrize(
    "ratio,adv,loss,grad,clip,dual",
    [
        # A > 0, rho inside [0.8, 1.28]: loss = -A rho = -1.1, d/dlogp = -A rho = -1.1
        (1.1, 1.0, -1.1, -1.1, 0, 0),
        # A > 0, rho = 1.5 > 1.28 (clip-higher): loss = -A * 1.28 = -1.28, gradient 0
        (1.5, 1.0, -1.28, 0.0, 1, 0),
        # A > 0, rho = 0.5 < 0.8: max(-0.5, -0.8) = -0.5 unclipped, gradient -0.5
        (0.5, 1.0, -0.5, -0.5, 0, 0),
        # A < 0, rho = 0.5 < 0.8: max(0.5, 0.8) = 0.8 clipped, gradient 0
        (0.5, -1.0, 0.8, 0.0, 1, 0),
        # A < 0, rho = 2.0: max(2.0, 1.28) = 2.0 unclipped (below dual cap 3), gradient = -A rho = 2
        (2.0, -1.0, 2.0, 2.0, 0, 0),
        # A < 0, rho = 5.0: max(5, 1.28) = 5 > cap -c A = 3 -> dual clip 3, gradient 0
        (5.0, -1.0, 3.0, 0.0, 0, 1),
    ],
)
def test_ppo_clip_branches(ratio, adv, loss, grad, clip, dual):
    got = per_token(ratio, adv)
    assert got[0] == pytest.approx(loss) and got[1] == pytest.approx(grad, abs=1e-12)
    assert (got[2], got[3]) == (clip, dual)


def test_without_dual_clip_a_negative_advantage_is_unbounded():
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=None)
    assert per_token(5.0, -1.0, cfg)[0] == pytest.approx(5.0)


def test_total_loss_adds_beta_times_aggregated_kl_and_entropy_bonus():
    # two sequences, T = 2, second token of seq 1 masked. logp = old_logp so rho = 1, pg = -A.
    logp = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    ref_logp = torch.tensor([[-1.0, 0.0], [-0.5, 7.0]], dtype=torch.float64)
    x = KLInputs(logp=logp, ref_logp=ref_logp)
    ent = torch.tensor([[0.3, 0.6], [0.9, 5.0]], dtype=torch.float64)
    kl_cfg = KLConfig(type="k1", coef=0.1)
    loss_cfg = LossConfig(agg="token-mean", entropy_coef=0.01)
    total, stats = policy_loss(logp, logp.detach(), adv, mask, x, loss_cfg=loss_cfg, kl_cfg=kl_cfg, entropy=ent)
    # pg tokens: [-1, -1, 2] -> mean 0;  k1 = logp - ref = [1, 0, 0.5] -> mean 0.5;  entropy mean 0.6
    assert stats["loss/pg"] == pytest.approx(0.0)
    assert stats["kl/value"] == pytest.approx(0.5)
    assert stats["train/entropy"] == pytest.approx(0.6)
    assert total.item() == pytest.approx(0.0 + 0.1 * 0.5 - 0.01 * 0.6)
    # seq-mean-token-mean: pg = mean(-1, 2) = 0.5; kl = mean(0.5, 0.5) = 0.5; ent = mean(0.45, 0.9) = 0.675
    total2, s2 = policy_loss(
        logp,
        logp.detach(),
        adv,
        mask,
        x,
        loss_cfg=LossConfig(agg="seq-mean-token-mean", entropy_coef=0.01),
        kl_cfg=kl_cfg,
        entropy=ent,
    )
    assert (s2["loss/pg"], s2["kl/value"], s2["train/entropy"]) == pytest.approx((0.5, 0.5, 0.675))
    assert total2.item() == pytest.approx(0.5 + 0.05 - 0.00675)
    # sum: pg = -1 - 1 + 2 = 0, kl = 1 + 0 + 0.5 = 1.5
    _, s3 = policy_loss(logp, logp.detach(), adv, mask, x, loss_cfg=LossConfig(agg="sum"), kl_cfg=kl_cfg)
    assert (s3["loss/pg"], s3["kl/value"]) == pytest.approx((0.0, 1.5))
    with pytest.raises(ValueError, match="no KL inputs"):
        policy_loss(logp, logp.detach(), adv, mask, None, loss_cfg=loss_cfg, kl_cfg=kl_cfg)


def test_grpo_advantages_hand_worked():
    # group 7: rewards [1, 0, 0, 1] -> mean 0.5, unbiased std sqrt(1/3) = 0.57735
    # group 3: rewards [1, 1] -> std 0 -> A = 0;  group 9: single response -> mean 0, std 1
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    g = torch.tensor([7, 7, 7, 7, 3, 3, 9])
    a = compute_advantages(r, g, "grpo")  # eps = 1e-6 keeps the zero-std group at 0
    s = math.sqrt(1 / 3)
    assert a.tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0.0, 0.0, 1.0], rel=1e-5)
    assert compute_advantages(r, g, "dr_grpo").tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 1.0])


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match=r"algo.kl.type='k9'.*allowed values: .*k3"):
        KLConfig(type="k9")
    with pytest.raises(ValueError, match=r"algo.kl.k must be an integer >= 0"):
        KLConfig(k=-1)
    with pytest.raises(ValueError, match=r"algo.kl.tail"):
        KLConfig(tail="biased")
    with pytest.raises(ValueError, match=r"algo.anchor.tau must be in \[0, 1\]"):
        AnchorConfig(tau=1.5)
    with pytest.raises(ValueError, match=r"algo.anchor.period must be an integer >= 1"):
        AnchorConfig(period=0)
    with pytest.raises(ValueError, match=r"algo.loss.agg"):
        LossConfig(agg="mean")
    with pytest.raises(ValueError, match=r"dual_clip_c must be > 1"):
        LossConfig(dual_clip_c=0.5)
    with pytest.raises(ValueError, match=r"algo.adv.mode"):
        AdvantageConfig(mode="gae")
    with pytest.raises(ValueError, match="advantage mode"):
        compute_advantages(torch.ones(2), torch.zeros(2), "ppo")
    with pytest.raises(ValueError, match=r"must both be \(B,\)"):
        compute_advantages(torch.ones(2, 1), torch.zeros(2), "grpo")
