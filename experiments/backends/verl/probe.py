"""The KL probe on the verl backend: ``kl/exact``, ``kl/estimate_on_probe``, ``kl/estimate_gap`` (docs/run-record.md).

Shapes: P probe sequences; sequence i has L_i = prompt + response tokens and T_i response tokens; V vocabulary.

The local backend's measurement (``ema_pg_core.local.probe``): fixed tokens re-scored every
``trainer.probe_every`` iterations with the exact KL between the policy (verl's actor) and the anchor (verl's
reference) and with the configured estimator, importance-weighted by pi / pi_probe. Two differences forced by
verl: the tokens are the first response of each of the first ``probe_size`` prompts of the first training
batch (verl generates held-out prompts only inside validation), and the logits come from the engines' pass
mode "keep", one sequence per micro-batch, in chunks of at most ``PROBE_LOGITS_BYTES`` per model. Every rank
holds the whole probe; it is saved with each checkpoint (``PROBE_FILE``), so a resumed run scores the same
tokens against the same pi_probe.
"""

from __future__ import annotations

import torch
from verl.utils import tensordict_utils as tu

from ema_pg_core.config import KLConfig
from ema_pg_core.kl import ImportanceWeight
from ema_pg_core.telemetry import probe_scores_from_logits, probe_summary
from experiments.backends.verl.engine import set_pass
from experiments.backends.verl.layout import lengths

PROBE_FILE = "emapg_probe.pt"  # in global_step_N: {"data": the probe's TensorDict, "logp": [(T_i,)] pi_probe}
PROBE_LOGITS_BYTES = 2**30  # logits held per model at once while scoring the probe (at least one sequence)


def pick(uids: list[str], tags: list[dict], n: int) -> list[int]:
    """Batch positions of the first response of each of the first ``n`` distinct prompts (uids); padding skipped."""
    seen, out = set(), []
    for i, (uid, tag) in enumerate(zip(uids, tags)):
        if tag.get("is_padding", False) or uid in seen:
            continue
        seen.add(uid)
        out.append(i)
        if len(out) == n:
            break
    return out


def chunks(lengths_: list[int], vocab: int, budget: int = PROBE_LOGITS_BYTES) -> list[list[int]]:
    """Consecutive sequence indices grouped so that each group's (sum L_i, V) logits take <= ``budget`` bytes."""
    out, cur, used = [], [], 0
    for i, n in enumerate(lengths_):
        size = n * vocab * 4  # bytes, counted as fp32
        if cur and used + size > budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += size
    return out + ([cur] if cur else [])


def _rows(t: torch.Tensor, n: list[int]) -> list[torch.Tensor]:
    """Rows of a jagged nested (B, *) or padded (B, W) tensor, row i cut to its first n[i] entries."""
    return [r[:k] for r, k in zip(t.unbind(), n)]


def _keep(worker, probe, idx: list[int], temperature: float) -> list[torch.Tensor]:
    """[(L_i, V)] logits / temperature of ``worker``'s model for probe sequences ``idx`` (one micro-batch each)."""
    sub = tu.index_select_tensor_dict(probe, idx)
    set_pass(sub, "keep")
    offsets = sub["input_ids"].offsets()
    tu.assign_non_tensor(
        sub,
        temperature=temperature,
        calculate_entropy=False,
        compute_loss=False,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=1,
        global_token_num=[int(x) for x in offsets.diff()],
    )
    engine = worker.engine
    try:
        worker.infer_batch(sub)
        kept = engine.probe_logits
    finally:
        engine.probe_logits = []
    if len(kept) != len(idx):
        raise RuntimeError(f"the KL probe expected {len(idx)} micro-batches of logits; the engine kept {len(kept)}")
    return kept


@torch.no_grad()
def score(
    actor, ref, probe, *, kl: KLConfig, agg: str, temperature: float, probe_logp: list[torch.Tensor] | None = None
) -> tuple[dict[str, float], list[torch.Tensor]]:
    """(the probe metrics, [(T_i,)] the policy's log-probs of each sequence's response tokens).

    ``actor`` / ``ref``: verl ``TrainingWorker``s (engines re-classed to ours); ``probe_logp``: pi_probe (None: at
    capture, the importance weight is 1)."""
    p_len, r_len, _ = lengths(probe)
    p_len, r_len = p_len.tolist(), r_len.tolist()
    tokens, masks = _rows(probe["responses"], r_len), _rows(probe["response_mask"], r_len)
    vocab = actor.model_config.hf_config.vocab_size
    iw = ImportanceWeight(True, kl.iw_clip_low, kl.iw_clip_high)
    exact, estimate, logp = [], [], []
    for idx in chunks([p + r for p, r in zip(p_len, r_len)], vocab):
        zp, zr = _keep(actor, probe, idx, temperature), _keep(ref, probe, idx, temperature)
        for i, a, b in zip(idx, zp, zr):
            resp = slice(p_len[i] - 1, p_len[i] - 1 + r_len[i])  # positions predicting the response tokens
            old = None if probe_logp is None else probe_logp[i][None].to(a.device)
            s = probe_scores_from_logits(
                a[resp][None], b[resp].to(a.device)[None], tokens[i][None].to(a.device).long(),
                name=kl.type, k=kl.k, tail=kl.tail, iw=iw, probe_logp=old,
            )  # fmt: skip
            exact.append(s["exact"][0].cpu())
            estimate.append(s["estimate"][0].cpu())
            logp.append(s["logp"][0].cpu())
    pad = lambda xs: torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)  # noqa: E731  [(T_i,)] -> (P, T)
    exact_, estimate_ = pad(exact), pad(estimate)
    return probe_summary(exact_, estimate_, pad([m.to(exact_.dtype) for m in masks]), agg), logp
