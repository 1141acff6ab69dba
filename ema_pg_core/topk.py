"""Per-token statistics for Top-k KL without a (B, T, V) log-softmax copy.

Shapes: B sequences, T positions, N = B*T flattened positions, V vocabulary, H hidden, K top-k.

From logits (B, T, V) or from hidden states (B, T, H) + LM-head weight (V, H), compute for every
position, on temperature-scaled logits z = logits / temperature:

    logp     (B, T)     log softmax(z)[token]              the sampled token's log-prob
    lse      (B, T)     logsumexp(z)                       the FULL-vocabulary normaliser
    logits_k (B, T, K)  z gathered at ``indices``          (stored indices, or the model's own top-k)
    indices  (B, T, K)  int64                              as given, or top-k of z
    entropy  (B, T)     -sum softmax(z) log softmax(z)     optional

The work runs over chunks of ``chunk_size`` positions, so at most (chunk_size, V) fp32 exists at a
time. Both paths are custom ``torch.autograd.Function``s whose backward *recomputes* each chunk's
softmax (and, from hidden states, each chunk's logits), so neither the forward nor the backward
keeps (N, V) alive: the logits path saves only a reference to its input; the hidden path saves h
and W. bf16/fp16 inputs are accumulated in fp32. Storing K logits + one logsumexp per token is the
paper's O(K) memory (ema-pg.md §2), e.g. 388 B/token at K=32 vs 608 KB for fp32 logits at V=151,936.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ema_pg_core.kl import KLInputs

DEFAULT_CHUNK = 1024


@dataclass
class TokenStats:
    logp: torch.Tensor  # (B, T)
    lse: torch.Tensor  # (B, T)
    logits_k: torch.Tensor  # (B, T, K)
    indices: torch.Tensor  # (B, T, K) int64
    entropy: torch.Tensor | None = None  # (B, T)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, else the input dtype (fp64 stays fp64 for exact tests)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _chunk_stats(z, tok, idx, k, want_entropy):
    """One chunk. z: (n, V) scaled logits in the accumulation dtype; tok: (n,); idx: (n, K) or None."""
    lse = torch.logsumexp(z, -1)  # (n,)
    if idx is None:
        idx = torch.topk(z, k, dim=-1).indices if k > 0 else torch.zeros(z.shape[0], 0, dtype=torch.long, device=z.device)
    lk = z.gather(-1, idx)  # (n, K)
    logp = z.gather(-1, tok[:, None])[:, 0] - lse  # (n,)
    ent = lse - (torch.softmax(z, -1) * z).sum(-1) if want_entropy else torch.zeros_like(lse)
    return lse, lk, logp, ent, idx


def _chunk_grad(z, lse, ent, tok, idx, g_lse, g_k, g_logp, g_ent, temperature, want_entropy):
    """(n, V) gradient w.r.t. the RAW logits of one chunk, recomputing softmax from z.

    d lse / dz = p;  d logp / dz = onehot(tok) - p;  d z_k / dz = onehot(idx);
    d H / dz_j = -p_j (log p_j + H).  Raw logits: divide by the temperature.
    """
    p = torch.exp(z - lse[:, None])  # (n, V)
    G = p * (g_lse - g_logp)[:, None]
    G.scatter_add_(-1, tok[:, None], g_logp[:, None])
    if idx.shape[-1]:
        G.scatter_add_(-1, idx, g_k)
    if want_entropy:
        G -= g_ent[:, None] * p * (z - lse[:, None] + ent[:, None])
    return G / temperature


class _FromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, indices, k, temperature, chunk, want_entropy):
        N = logits.shape[0]
        acc = _acc_dtype(logits.dtype)
        outs = [[] for _ in range(5)]
        for s in range(0, N, chunk):
            z = logits[s : s + chunk].to(acc) / temperature
            idx = None if indices is None else indices[s : s + chunk]
            for o, v in zip(outs, _chunk_stats(z, tokens[s : s + chunk], idx, k, want_entropy)):
                o.append(v)
        lse, lk, logp, ent, idx = (torch.cat(o) for o in outs)
        ctx.save_for_backward(logits, tokens, idx, lse, ent)
        ctx.cfg = (temperature, chunk, want_entropy)
        ctx.mark_non_differentiable(idx)
        return lse, lk, logp, ent, idx

    @staticmethod
    def backward(ctx, g_lse, g_k, g_logp, g_ent, _g_idx):
        logits, tokens, idx, lse, ent = ctx.saved_tensors
        temperature, chunk, want_entropy = ctx.cfg
        acc = lse.dtype
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            sl = slice(s, s + chunk)
            z = logits[sl].to(acc) / temperature
            G = _chunk_grad(z, lse[sl], ent[sl], tokens[sl], idx[sl], g_lse[sl], g_k[sl], g_logp[sl], g_ent[sl], temperature, want_entropy)
            grad[sl] = G.to(logits.dtype)
        return grad, None, None, None, None, None, None


class _FromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, indices, k, temperature, chunk, want_entropy):
        N = hidden.shape[0]
        acc = _acc_dtype(hidden.dtype)
        outs = [[] for _ in range(5)]
        for s in range(0, N, chunk):
            z = torch.nn.functional.linear(hidden[s : s + chunk], weight, bias).to(acc) / temperature
            idx = None if indices is None else indices[s : s + chunk]
            for o, v in zip(outs, _chunk_stats(z, tokens[s : s + chunk], idx, k, want_entropy)):
                o.append(v)
        lse, lk, logp, ent, idx = (torch.cat(o) for o in outs)
        ctx.save_for_backward(hidden, weight, bias, tokens, idx, lse, ent)
        ctx.cfg = (temperature, chunk, want_entropy)
        ctx.mark_non_differentiable(idx)
        return lse, lk, logp, ent, idx

    @staticmethod
    def backward(ctx, g_lse, g_k, g_logp, g_ent, _g_idx):
        hidden, weight, bias, tokens, idx, lse, ent = ctx.saved_tensors
        temperature, chunk, want_entropy = ctx.cfg
        acc = lse.dtype
        g_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        g_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        g_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if (bias is not None and ctx.needs_input_grad[2]) else None
        for s in range(0, hidden.shape[0], chunk):
            sl = slice(s, s + chunk)
            h = hidden[sl]
            z = torch.nn.functional.linear(h, weight, bias).to(acc) / temperature
            G = _chunk_grad(z, lse[sl], ent[sl], tokens[sl], idx[sl], g_lse[sl], g_k[sl], g_logp[sl], g_ent[sl], temperature, want_entropy)
            if g_h is not None:
                g_h[sl] = (G @ weight.to(acc)).to(hidden.dtype)  # (n, H)
            if g_w is not None:
                g_w.addmm_(G.T, h.to(acc))  # (V, H)
            if g_b is not None:
                g_b += G.sum(0)
        return (g_h, None if g_w is None else g_w.to(weight.dtype), None if g_b is None else g_b.to(bias.dtype),
                None, None, None, None, None, None)


def _prepare(lead, tokens, indices, k, temperature, chunk_size):
    """Validate and flatten; returns (tokens (N,), indices (N, K) or None)."""
    B, T = lead
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size!r}")
    if k < 0:
        raise ValueError(f"k must be >= 0; got {k!r}")
    if tokens is None:
        tokens = torch.zeros(B, T, dtype=torch.long)
    if tuple(tokens.shape) != (B, T):
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}; expected (B, T) = {(B, T)}")
    if indices is not None and tuple(indices.shape[:2]) != (B, T):
        raise ValueError(f"indices has shape {tuple(indices.shape)}; expected (B, T, K) with (B, T) = {(B, T)}")
    flat_idx = None if indices is None else indices.reshape(B * T, -1).long()
    return tokens.reshape(-1).long(), flat_idx


def _unflatten(B, T, lse, lk, logp, ent, idx, want_entropy) -> TokenStats:
    K = idx.shape[-1]
    return TokenStats(logp.view(B, T), lse.view(B, T), lk.view(B, T, K), idx.view(B, T, K), ent.view(B, T) if want_entropy else None)


def token_stats_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor | None = None, *, k: int = 0, indices: torch.Tensor | None = None,
    temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK, entropy: bool = False,
) -> TokenStats:
    """Stats from logits (B, T, V). With ``indices`` (B, T, K) gather there (k ignored), else own top-k.

    Differentiable w.r.t. ``logits``; the backward recomputes softmax chunk by chunk.
    """
    if logits.ndim != 3:
        raise ValueError(f"logits must be (B, T, V); got shape {tuple(logits.shape)}")
    B, T, V = logits.shape
    if indices is None and k > V:
        raise ValueError(f"k={k} exceeds the vocabulary size V={V}")
    tok, idx = _prepare((B, T), tokens, indices, k, temperature, chunk_size)
    out = _FromLogits.apply(logits.reshape(B * T, V), tok, idx, k, float(temperature), int(chunk_size), entropy)
    return _unflatten(B, T, *out, entropy)


def token_stats_from_hidden(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tokens: torch.Tensor | None = None, *,
    k: int = 0, indices: torch.Tensor | None = None, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK,
    entropy: bool = False,
) -> TokenStats:
    """Stats from hidden states (B, T, H) and the LM head weight (V, H) [+ bias (V,)], fused.

    Never materialises (B, T, V) logits: each chunk's logits are computed, reduced and dropped, and
    recomputed in the backward. Differentiable w.r.t. hidden, weight and bias.
    """
    if hidden.ndim != 3 or weight.ndim != 2 or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden must be (B, T, H) and weight (V, H); got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    B, T, H = hidden.shape
    if indices is None and k > weight.shape[0]:
        raise ValueError(f"k={k} exceeds the vocabulary size V={weight.shape[0]}")
    tok, idx = _prepare((B, T), tokens, indices, k, temperature, chunk_size)
    out = _FromHidden.apply(hidden.reshape(B * T, H), weight, bias, tok, idx, k, float(temperature), int(chunk_size), entropy)
    return _unflatten(B, T, *out, entropy)


def kl_inputs(policy: TokenStats, anchor: TokenStats, sampled: torch.Tensor, old_logp: torch.Tensor | None = None) -> KLInputs:
    """Assemble Top-k / sampled KLInputs from the policy's and the anchor's stats at the same indices."""
    return KLInputs(
        logp=policy.logp, ref_logp=anchor.logp, old_logp=old_logp, sampled=sampled, topk_idx=policy.indices,
        logits_k=policy.logits_k, lse=policy.lse, ref_logits_k=anchor.logits_k, ref_lse=anchor.lse,
    )
