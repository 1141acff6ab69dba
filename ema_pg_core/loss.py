"""PPO clipped surrogate (+ clip-higher, dual clip) + beta * KL - c_ent * entropy (docs/algorithm.md).

Per token, with rho = exp(clamp(log pi - log pi_old, -20, 20)) and advantage A:
    pg     = max(-A * rho, -A * clip(rho, 1 - eps_low, 1 + eps_high))
    if A < 0 and dual clip c:  pg = min(pg, -c * A)
Every per-token term is aggregated with the same mode (kl.aggregate); the KL per token comes from
any registered estimator (ema_pg_core.kl). Returns the loss and a dict of float statistics.
"""

from __future__ import annotations

import torch

from ema_pg_core.config import KLConfig, LossConfig
from ema_pg_core.kl import ImportanceWeight, KLInputs, aggregate, get_estimator, kl_per_token
from ema_pg_core.telemetry import topk_parts, topk_summary


def ppo_clip_per_token(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(B, T) clipped surrogate loss and (B, T) indicator tensors for statistics.

    logp, old_logp: (B, T); adv: (B, T) advantages broadcast over tokens.
    """
    log_ratio = (logp - old_logp).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    pg = torch.maximum(unclipped, clipped)
    clip_hit = (clipped > unclipped).to(logp.dtype)
    dual_hit = torch.zeros_like(pg)
    if cfg.dual_clip_c is not None:
        cap = -adv * cfg.dual_clip_c
        dual_hit = ((adv < 0) & (pg > cap)).to(logp.dtype)
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
    return pg, {"ratio": ratio.detach(), "clip": clip_hit, "dual_clip": dual_hit, "neg_log_ratio": -log_ratio.detach()}


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    kl_inputs: KLInputs | None,
    *,
    loss_cfg: LossConfig,
    kl_cfg: KLConfig,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Total loss = agg(pg) + beta * agg(KL) - c_ent * agg(entropy).

    logp, old_logp, mask, entropy: (B, T); adv: (B,) or (B, T); kl_inputs feeds kl_cfg.type
    (its ``logp`` should be the same tensor as ``logp``). kl_inputs may be None only if beta = 0.
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, mask {tuple(mask.shape)} must match (B, T)"
        )
    if adv.ndim == 1:
        adv = adv.unsqueeze(-1).expand_as(logp)
    agg = loss_cfg.agg
    pg_tok, ind = ppo_clip_per_token(logp, old_logp, adv, loss_cfg)
    pg = aggregate(pg_tok, mask, agg)
    total = pg
    stats = {
        "loss/pg": pg.item(),
        "loss/clip_frac": aggregate(ind["clip"], mask, "token-mean").item(),
        "loss/dual_clip_frac": aggregate(ind["dual_clip"], mask, "token-mean").item(),
        "loss/approx_kl": aggregate(ind["neg_log_ratio"], mask, "token-mean").item(),
        "loss/ratio_mean": aggregate(ind["ratio"], mask, "token-mean").item(),
    }
    if kl_cfg.coef > 0:
        if kl_inputs is None:
            raise ValueError("algo.kl.coef > 0 but no KL inputs were given")
        iw = ImportanceWeight(kl_cfg.use_iw, kl_cfg.iw_clip_low, kl_cfg.iw_clip_high)
        kl = aggregate(kl_per_token(kl_cfg.type, kl_inputs, tail=kl_cfg.tail, iw=iw), mask, agg)
        total = total + kl_cfg.coef * kl
        stats["kl/value"] = kl.item()
        est = get_estimator(kl_cfg.type)
        if est.needs == "topk":  # topk/* from the (B, T, K) inputs already here: O(K) per token
            parts = topk_parts(kl_inputs, kl_cfg.type, tail=kl_cfg.tail, iw=iw)
            stats.update(topk_summary(parts, mask, est.direction))
    if entropy is not None:
        ent = aggregate(entropy, mask, agg)
        stats["train/entropy"] = ent.item()
        if loss_cfg.entropy_coef:
            total = total - loss_cfg.entropy_coef * ent
    stats["loss/total"] = total.item()
    return total, stats
