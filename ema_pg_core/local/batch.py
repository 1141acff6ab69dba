"""From trajectories to padded tensors, and the per-token statistics forward pass.

Shapes: B sequences, L = max(prompt + response) length (right-padded), T = max response length,
H hidden size, V vocabulary, K top-k.

Row b holds prompt_b + response_b right-padded. Response token j of row b sits at position
P_b + j (P_b = prompt length), and the logits that predict it come from position P_b + j - 1,
so the response's hidden states are gathered at ``pred_pos = P_b + j - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from ema_pg_core.local.rollout import Trajectory
from ema_pg_core.topk import TokenStats, _acc_dtype, token_stats_from_hidden, token_stats_from_logits


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, L) prompt + response, right-padded
    attention_mask: torch.Tensor  # (B, L)
    pred_pos: torch.Tensor  # (B, T) position whose output predicts response token j
    tokens: torch.Tensor  # (B, T) response token ids (pad = 0)
    mask: torch.Tensor  # (B, T) 1 for model-sampled tokens, 0 for environment tokens and padding

    def select(self, rows: torch.Tensor) -> Batch:
        return Batch(*(t[rows] for t in (self.input_ids, self.attention_mask, self.pred_pos, self.tokens, self.mask)))


def _pad(rows: list[list], width: int, value) -> list[list]:
    """Right-pad each row to ``width``."""
    return [r + [value] * (width - len(r)) for r in rows]


def collate(
    trajs: list[Trajectory],
    pad_id: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Batch:
    """Padded (B, L) / (B, T) tensors built directly on ``device`` (one copy per tensor, none per row)."""
    L = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    T = max(1, max(len(t.response_ids) for t in trajs))
    seqs = [t.prompt_ids + t.response_ids for t in trajs]
    pred = [list(range(len(t.prompt_ids) - 1, len(t.prompt_ids) + len(t.response_ids) - 1)) for t in trajs]
    ints = dict(dtype=torch.long, device=device)
    return Batch(
        input_ids=torch.tensor(_pad(seqs, L, pad_id), **ints),  # (B, L)
        attention_mask=torch.tensor(_pad([[1] * len(s) for s in seqs], L, 0), **ints),  # (B, L)
        pred_pos=torch.tensor(_pad(pred, T, 0), **ints),  # (B, T)
        tokens=torch.tensor(_pad([t.response_ids for t in trajs], T, 0), **ints),  # (B, T)
        mask=torch.tensor(_pad([t.response_mask for t in trajs], T, 0), dtype=dtype, device=device),  # (B, T)
    )


def sampler_stats(trajs: list[Trajectory], device: torch.device | str = "cpu") -> TokenStats:
    """The rollout's sampling-time pi_old statistics as (B, T) / (B, T, K) tensors, zero-padded like ``collate``."""
    if any(t.stats is None for t in trajs):
        raise ValueError("sampler_stats needs trajectories sampled with rollout(..., stats_k=...)")
    T = max(1, max(len(t.response_ids) for t in trajs))

    def pad(field: str) -> torch.Tensor:  # (B, T) or (B, T, K)
        out = pad_sequence([getattr(t.stats, field) for t in trajs], batch_first=True)  # (B, max len, ...)
        return torch.nn.functional.pad(out, (0, 0) * (out.ndim - 2) + (0, T - out.shape[1])).to(device)

    return TokenStats(**{f: pad(f) for f in ("logp", "lse", "logits_k", "indices", "entropy")})


def check_model(model) -> None:
    """The statistics are computed as lm_head(final hidden): refuse models that post-process logits."""
    cfg = model.config
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(cfg, attr, None) not in (None, 1.0):
            raise ValueError(
                f"model config sets {attr}={getattr(cfg, attr)}; emapg computes logits as lm_head(hidden) "
                f"and does not support it"
            )


def response_hidden(model, batch: Batch) -> torch.Tensor:
    """(B, T, H) final hidden states at the positions predicting each response token; rows that share a prompt
    (GRPO's G samples of it) share its forward (``_shared_prompt_hidden``)."""
    groups = prompt_groups(batch)
    shared = _shared_prompt_hidden(model, batch, *groups) if groups is not None and _plain_cache(model) else None
    if shared is not None:
        return shared
    hidden = model.base_model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask
    ).last_hidden_state  # (B, L, H)
    H = hidden.shape[-1]
    return hidden.gather(1, batch.pred_pos.unsqueeze(-1).expand(-1, -1, H))


def prompt_groups(batch: Batch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(one row per distinct prompt (U,), each row's prompt index into them (B,)), or None if no prompt repeats.

    A row's prompt is its first ``pred_pos[b, 0] + 1`` tokens; None too when a row's prompt length cannot be
    read that way (``pred_pos[b, 0] == 0``: a one-token prompt or an empty response).
    """
    P = batch.pred_pos[:, 0] + 1  # (B,) prompt lengths
    if bool((P == 1).any()):
        return None
    Pm = int(P.max())
    cols = torch.arange(Pm, device=P.device)  # (Pm,)
    prompts = batch.input_ids[:, :Pm].masked_fill(cols >= P[:, None], -1)  # (B, Pm), -1 past each prompt
    uniq, inverse = torch.unique(prompts, dim=0, return_inverse=True)  # (U, Pm), (B,)
    if len(uniq) == len(prompts):
        return None
    B = len(prompts)
    rows = torch.full((len(uniq),), B, device=P.device).scatter_reduce(
        0, inverse, torch.arange(B, device=P.device), "amin"
    )  # (U,) first row holding each prompt
    return rows, inverse


def _plain_cache(model) -> bool:
    """Does the model's KV cache hold every past position (no sliding window, no linear-attention state)?"""
    cfg = model.config.get_text_config()
    return not getattr(cfg, "use_sliding_window", False) and set(getattr(cfg, "layer_types", None) or ()) <= {
        "full_attention"
    }


def _shared_prompt_hidden(model, batch: Batch, rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor | None:
    """``response_hidden`` with each distinct prompt run once: the same numbers up to float rounding.

    The U distinct prompts (right-padded to the longest, Pm) go through the model once with a KV cache; the
    cache is gathered back to the response rows (a differentiable index: gradients from all rows that share a
    prompt add up in it), and the responses continue from it at positions P_b + j. The attention mask has a
    hole between a short prompt's end and column Pm; positions and mask make every response token see exactly
    what it sees in the full forward. The responses go in chunks of similar length (``length_chunks``), each
    padded to its own longest. Cost: U * Pm + sum over chunks of rows * longest, instead of B * L.
    """
    from transformers.cache_utils import DynamicCache, DynamicLayer

    P = batch.pred_pos[:, 0] + 1  # (B,) prompt lengths
    Pm, T = int(P.max()), batch.tokens.shape[1]
    prompt_mask = (torch.arange(Pm, device=P.device) < P[:, None]).long()  # (B, Pm)
    out = model.base_model(input_ids=batch.input_ids[rows, :Pm], attention_mask=prompt_mask[rows], use_cache=True)
    layers = getattr(out.past_key_values, "layers", [None])
    if not all(type(layer) is DynamicLayer for layer in layers):
        return None  # a cache kind this does not know how to gather: the caller runs the full forward
    resp_len = batch.attention_mask.sum(1) - P  # (B,)
    parts, order = [], []
    for chunk in length_chunks(resp_len.tolist()):
        idx = torch.tensor(chunk, device=P.device)  # (c,) rows of this chunk
        cache = DynamicCache([(layer.keys[inverse[idx]], layer.values[inverse[idx]]) for layer in layers])
        t = int(resp_len[idx].max())
        tail = _continue(model, batch, idx, P=P[idx], prompt_mask=prompt_mask[idx], cache=cache, t=t)  # (c, t, H)
        parts.append(torch.nn.functional.pad(tail, (0, 0, 0, T - tail.shape[1])))  # (c, T, H)
        order.append(idx)
    tail = parts[0] if len(parts) == 1 else torch.cat(parts)[torch.cat(order).argsort()]  # (B, T, H), row order
    H = tail.shape[-1]
    last_prompt = out.last_hidden_state[inverse].gather(1, (P - 1)[:, None, None].expand(-1, 1, H))  # (B, 1, H)
    return torch.cat([last_prompt, tail[:, : T - 1]], 1)  # (B, T, H)


def _continue(model, batch: Batch, idx, *, P, prompt_mask, cache, t: int) -> torch.Tensor:
    """(c, t, H) hidden states of rows idx's first t response tokens after their prompts' cache; the output
    at j predicts response token j + 1. P (c,) prompt lengths, prompt_mask (c, Pm)."""
    j = torch.arange(t, device=P.device)  # (t,)
    L = batch.input_ids.shape[1]
    col = (P[:, None] + j).clamp_max(L - 1)  # (c, t) column of response token j
    resp_mask = batch.attention_mask[idx].gather(1, col) * (P[:, None] + j < L)  # (c, t), 0 past each response
    return model.base_model(
        input_ids=batch.input_ids[idx].gather(1, col),
        attention_mask=torch.cat([prompt_mask, resp_mask], 1),  # (c, Pm + t)
        position_ids=P[:, None] + j,  # (c, t)
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state


def length_chunks(lengths: list[int], max_chunks: int = 4) -> list[list[int]]:
    """Row ids split into at most ``max_chunks`` groups of similar length, shortest group first, each in row order.

    Each group is padded to its own longest, so a split saves rows * (longest - own longest) positions; it
    must save more than an eighth of the one-chunk cost (len * max) per extra chunk, since every chunk is one
    more model call. Exact over the sorted rows (dynamic programming over the distinct lengths).
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    L = [lengths[i] for i in order]
    n, call = len(L), len(L) * max(L, default=0) / 8
    cuts = [j for j in range(n + 1) if j in (0, n) or L[j] != L[j - 1]]  # splitting equal lengths never pays
    best = {(0, 0): (0.0, 0)}  # (chunks, rows covered) -> (cost, where the last chunk starts)
    for c in range(1, max_chunks + 1):
        for j in cuts[1:]:
            options = [(best[c - 1, i][0] + (j - i) * L[j - 1] + call, i) for i in cuts if i < j and (c - 1, i) in best]
            if options:
                best[c, j] = min(options)
    c = min((c for c in range(1, max_chunks + 1) if (c, n) in best), key=lambda c: best[c, n][0], default=0)
    chunks, j = [], n
    while c:
        i = best[c, j][1]
        chunks.append(sorted(order[i:j]))  # rows in batch order within a chunk
        c, j = c - 1, i
    return chunks[::-1]


def forward_stats(
    model,
    batch: Batch,
    *,
    k: int = 0,
    indices: torch.Tensor | None = None,
    temperature: float = 1.0,
    fused: bool = True,
    entropy: bool = False,
    full_logits: bool = False,
) -> tuple[TokenStats, torch.Tensor | None]:
    """Token statistics of ``model`` on the batch's responses, plus (B, T, V) scaled logits if asked (exact KL).
    fused: from hidden states and the LM head in chunks (no (B, T, V) tensor), else from materialised logits."""
    head = model.get_output_embeddings()
    h = response_hidden(model, batch)
    logits = None
    if full_logits or not fused:
        logits = head(h)  # (B, T, V)
    if fused:
        stats = token_stats_from_hidden(
            h, head.weight, head.bias, batch.tokens, k=k, indices=indices, temperature=temperature, entropy=entropy
        )
    else:
        stats = token_stats_from_logits(
            logits, batch.tokens, k=k, indices=indices, temperature=temperature, entropy=entropy
        )
    return stats, (logits.to(_acc_dtype(logits.dtype)) / temperature if full_logits else None)
