"""The local backend's KL probe: fixed held-out rollouts re-scored with the exact KL and the estimator.

Shapes: P probe sequences, T response tokens (padded), H hidden, V vocabulary, K top-k.

``make_probe`` samples one response for each of the first held-out prompts (``config.probe_prompts``) with
the initial policy, from its own generator (so the training stream of random numbers is the same with the
probe on or off), and keeps the tokens and the drawing policy's log-probs; checkpoints keep it, so a resumed
run scores the same tokens. ``score_probe`` computes ``kl/exact``, ``kl/estimate_on_probe`` (with the
importance weight s = pi / pi_probe, so that its expectation is the current policy's KL although the tokens
are fixed; a Top-k head is the policy's own top-k (reverse) or the anchor's (forward)) and their gap,
aggregated over the probe's response tokens as the loss aggregates the KL.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from ema_pg_core.config import KLConfig, probe_prompts
from ema_pg_core.kl import ImportanceWeight, get_estimator, kl_per_token
from ema_pg_core.local.batch import Batch, collate, forward_stats, response_hidden
from ema_pg_core.telemetry import exact_kl_from_hidden, probe_inputs, probe_summary
from ema_pg_core.topk import token_stats_from_hidden

PROBE_SEED_OFFSET = 7_000_003
"""The probe's generator is seeded with seed + this offset (apart from the training and eval generators)."""


def make_probe(trainer) -> dict[str, torch.Tensor]:
    """{Batch fields (P, L) / (P, T), "logp" (P, T)}: the probe set, drawn by the trainer's current policy."""
    if not trainer.task.test:
        raise ValueError("trainer.probe_every > 0 needs held-out (test split) prompts for the probe; the task has none")
    examples = trainer.task.test[: probe_prompts(trainer.cfg.trainer, len(trainer.task.test))]
    g = torch.Generator(device=trainer.device).manual_seed(trainer.cfg.seed + PROBE_SEED_OFFSET)
    trainer.policy.eval()
    with torch.no_grad():
        trajs = trainer._rollout(trainer.policy, [trainer.task.prompt(e) for e in examples], generator=g)
        batch = collate(trajs, trainer.tok.pad_token_id, dtype=torch.float32, device=trainer.device)
        stats, _ = forward_stats(trainer.policy, batch, temperature=trainer.cfg.rollout.temperature)
    return {**asdict(batch), "logp": stats.logp}


def probe_batch(probe: dict[str, torch.Tensor], device) -> Batch:
    """The probe's Batch on ``device``."""
    return Batch(*(probe[k].to(device) for k in ("input_ids", "attention_mask", "pred_pos", "tokens", "mask")))


@torch.no_grad()
def score_probe(policy, anchor, probe: dict[str, torch.Tensor], kl: KLConfig, *, agg: str, temperature: float) -> dict:
    """The ``kl/exact``, ``kl/estimate_on_probe`` and ``kl/estimate_gap`` metrics of policy vs anchor on the probe."""
    policy.eval()
    anchor.eval()
    device = next(policy.parameters()).device
    batch = probe_batch(probe, device)
    h, h_ref = response_hidden(policy, batch), response_hidden(anchor, batch)  # (P, T, H) each
    est = get_estimator(kl.type)
    head, ref_head = policy.get_output_embeddings(), anchor.get_output_embeddings()
    w, b, wr, br = head.weight, head.bias, ref_head.weight, ref_head.bias
    exact = exact_kl_from_hidden(
        h, w, b, ref_hidden=h_ref, ref_weight=wr, ref_bias=br, direction=est.direction, temperature=temperature
    )

    def stats(hh, ww, bb):
        return lambda **kw: token_stats_from_hidden(hh, ww, bb, batch.tokens, temperature=temperature, **kw)

    logp_probe = probe["logp"].to(device)
    x = probe_inputs(kl.type, kl.k, stats(h, w, b), stats(h_ref, wr, br), tokens=batch.tokens, probe_logp=logp_probe)
    if est.needs == "full":  # (P, T, V)
        x.logits, x.ref_logits = head(h) / temperature, ref_head(h_ref) / temperature
    iw = ImportanceWeight(True, kl.iw_clip_low, kl.iw_clip_high)
    estimate = kl_per_token(kl.type, x, tail=kl.tail, iw=iw)  # (P, T)
    policy.train()
    return probe_summary(exact, estimate, batch.mask, agg)
