"""Per-token statistics for Top-k KL without a (B, T, V) log-softmax copy.

Shapes: B sequences, T positions, N = B*T flattened positions, V vocabulary, H hidden, K top-k.

From logits (B, T, V) or from hidden states (B, T, H) + LM-head weight (V, H), on z = logits / temperature:

    logp     (B, T)     log softmax(z)[token]              the sampled token's log-prob
    lse      (B, T)     logsumexp(z)                       the FULL-vocabulary normaliser
    logits_k (B, T, K)  z gathered at ``indices``          (stored indices, or the model's own top-k)
    indices  (B, T, K)  int64                              as given, or top-k of z
    entropy  (B, T)     -sum softmax(z) log softmax(z)     optional

The work runs over blocks of ``chunk_size`` positions x ``vocab_chunk_size`` columns (default: the whole
vocabulary), merging the logsumexp, the entropy (through the softmax mean of z) and the own top-k across
vocabulary blocks online. Both paths are ``torch.autograd.Function``s whose backward *recomputes* each
block's softmax (and, from hidden states, its logits), so neither pass keeps (N, V) alive; half-precision
inputs accumulate in fp32. K logits + one logsumexp per token is the paper's O(K) memory (388 B/token at
K=32 vs 608 KB of fp32 logits at V=151,936). With one vocabulary block the results are the unblocked ones;
with several they agree to rounding (ties in the own top-k may pick another index of equal value).
Measured memory and time: docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ema_pg_core.kl import KLInputs

DEFAULT_CHUNK = 1024
ZBlock = Callable[[int, int], torch.Tensor]  # (v0, v1) -> (n, v1 - v0) scaled logits in the acc dtype


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


def _vocab_blocks(V: int, vchunk: int | None) -> list[tuple[int, int]]:
    """[(v0, v1), ...] covering range(V) in blocks of ``vchunk`` columns (None: one block)."""
    step = V if vchunk is None else max(1, min(vchunk, V))
    return [(v0, min(v0 + step, V)) for v0 in range(0, V, step)]


def _gather_in_block(z: torch.Tensor, cols: torch.Tensor, v0: int) -> torch.Tensor:
    """(n, m) z[:, cols - v0] for columns inside this block [v0, v0 + vc), 0 elsewhere. z: (n, vc)."""
    local = cols - v0
    inside = (local >= 0) & (local < z.shape[-1])
    return torch.where(inside, z.gather(-1, local.clamp(0, z.shape[-1] - 1)), z.new_zeros(()))


def _scatter_in_block_(G: torch.Tensor, cols: torch.Tensor, v0: int, g: torch.Tensor) -> None:
    """G[:, cols - v0] += g for columns inside this block; G: (n, vc), cols/g: (n, m)."""
    local = cols - v0
    inside = (local >= 0) & (local < G.shape[-1])
    G.scatter_add_(-1, local.clamp(0, G.shape[-1] - 1), torch.where(inside, g, g.new_zeros(())))


def _merge_topk(best: tuple | None, z: torch.Tensor, v0: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Running top-k: (values (n, <=k), indices) so far merged with block z (n, vc) starting at v0."""
    v, i = torch.topk(z, min(k, z.shape[-1]), dim=-1)
    if best is None:
        return v, i + v0
    vals, idx = torch.cat([best[0], v], -1), torch.cat([best[1], i + v0], -1)
    top = torch.topk(vals, min(k, vals.shape[-1]), dim=-1)
    return top.values, idx.gather(-1, top.indices)


@dataclass(frozen=True)
class _Plan:
    """How one pass walks the (N, V) logits: ``chunk`` rows at a time, vocabulary ``blocks`` [(v0, v1), ...]
    within a row chunk, on logits / ``temperature``; ``entropy``: compute it (and its gradient) or not."""

    temperature: float
    chunk: int
    blocks: list[tuple[int, int]]
    entropy: bool


class _Saved(NamedTuple):
    """What the forward keeps per row for the backward: tokens (n,), idx (n, K), lse (n,), entropy (n,)."""

    tokens: torch.Tensor
    idx: torch.Tensor
    lse: torch.Tensor
    ent: torch.Tensor


class _Grads(NamedTuple):
    """The gradients of the forward's outputs per row: lse (n,), logits_k (n, K), logp (n,), entropy (n,)."""

    lse: torch.Tensor
    k: torch.Tensor
    logp: torch.Tensor
    ent: torch.Tensor


def _rows_stats(zblock: ZBlock, plan: _Plan, tok: torch.Tensor, idx: torch.Tensor | None, k: int):
    """Stats of one chunk of n positions, vocabulary block by block.

    zblock(v0, v1): (n, vc) scaled logits; tok: (n,); idx: (n, K) stored indices or None (own top-k).
    Returns lse (n,), logits_k (n, K), logp (n,), entropy (n,) (zeros if not wanted), idx (n, K).
    """
    lse = mu = best = None  # mu: E_softmax[z], so that entropy = lse - mu
    tok_z = lk = 0.0
    for v0, v1 in plan.blocks:
        z = zblock(v0, v1)
        lse_b = torch.logsumexp(z, -1)  # (n,)
        mu_b = (torch.softmax(z, -1) * z).sum(-1) if plan.entropy else None
        if lse is None:
            lse, mu = lse_b, mu_b
        else:
            new = torch.logaddexp(lse, lse_b)
            if plan.entropy:
                mu = mu * torch.exp(lse - new) + mu_b * torch.exp(lse_b - new)
            lse = new
        tok_z = tok_z + _gather_in_block(z, tok[:, None], v0)[:, 0]
        if idx is not None:
            lk = lk + _gather_in_block(z, idx, v0)
        elif k > 0:
            best = _merge_topk(best, z, v0, k)
    if idx is None:
        n = tok.shape[0]
        empty = (
            torch.zeros(n, 0, dtype=lse.dtype, device=lse.device),
            torch.zeros(n, 0, dtype=torch.long, device=lse.device),
        )
        lk, idx = best if k > 0 else empty
    ent = lse - mu if plan.entropy else torch.zeros_like(lse)
    return lse, lk, tok_z - lse, ent, idx


def _block_grad(z: torch.Tensor, v0: int, saved: _Saved, g: _Grads, plan: _Plan) -> torch.Tensor:
    """(n, vc) gradient w.r.t. the RAW logits of one block [v0, v0 + vc), recomputing softmax from z (n, vc).

    d lse / dz = p;  d logp / dz = onehot(tok) - p;  d z_k / dz = onehot(idx);
    d H / dz_j = -p_j (log p_j + H).  Raw logits: divide by the temperature.
    """
    lse = saved.lse[:, None]
    p = (z - lse).exp_()  # (n, vc), p of the FULL softmax
    ent_term = g.ent[:, None] * p * (z - lse + saved.ent[:, None]) if plan.entropy else None
    G = p.mul_((g.lse - g.logp)[:, None])  # p is not needed any more: reuse its memory
    _scatter_in_block_(G, saved.tokens[:, None], v0, g.logp[:, None])
    if saved.idx.shape[-1]:
        _scatter_in_block_(G, saved.idx, v0, g.k)
    if ent_term is not None:
        G -= ent_term
    return G if plan.temperature == 1.0 else G.div_(plan.temperature)


def _row_slices(N: int, chunk: int) -> list[slice]:
    """The chunks of ``chunk`` rows covering range(N)."""
    return [slice(s, s + chunk) for s in range(0, N, chunk)]


def _forward_all(ctx, inputs: tuple, zrows: Callable[[slice], ZBlock], plan: _Plan, *, tokens, indices, k: int):
    """Concatenated stats over all N positions (tokens (N,); indices (N, K) or None), ``plan.chunk`` rows at a
    time: lse (N,), logits_k (N, K), logp (N,), entropy (N,), idx (N, K). Saves ``inputs`` + ``_Saved`` and
    ctx.plan for the backward."""
    outs = [[] for _ in range(5)]
    for sl in _row_slices(tokens.shape[0], plan.chunk):
        idx = None if indices is None else indices[sl]
        for o, v in zip(outs, _rows_stats(zrows(sl), plan, tokens[sl], idx, k)):
            o.append(v)
    lse, lk, logp, ent, idx = (torch.cat(o) for o in outs)
    ctx.save_for_backward(*inputs, *_Saved(tokens, idx, lse, ent))
    ctx.plan = plan
    ctx.mark_non_differentiable(idx)
    return lse, lk, logp, ent, idx


def _chunk_grads(zblock: ZBlock, saved: _Saved, grads: _Grads, plan: _Plan):
    """(v0, v1, G) per vocabulary block of one row chunk; G (n, v1 - v0): the gradient w.r.t. its raw logits.
    zblock(v0, v1): (n, v1 - v0) scaled logits of these rows; saved, grads: these rows'."""
    for v0, v1 in plan.blocks:
        yield v0, v1, _block_grad(zblock(v0, v1), v0, saved, grads, plan)


def _row_chunks(saved: tuple, grads: tuple, N: int, chunk: int):
    """(sl, _Saved, _Grads) of each chunk of rows; saved, grads: the whole (N, ...) tensors."""
    for sl in _row_slices(N, chunk):
        yield sl, _Saved(*(t[sl] for t in saved)), _Grads(*(g[sl] for g in grads))


def _logit_rows(logits, acc, temperature) -> Callable[[slice], ZBlock]:
    """sl -> zblock: (v0, v1) -> (n, v1 - v0) logits[sl, v0:v1] / temperature, in acc."""
    return lambda sl: lambda v0, v1: logits[sl, v0:v1].to(acc) / temperature


class _FromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, indices, k, plan):
        zrows = _logit_rows(logits, _acc_dtype(logits.dtype), plan.temperature)
        return _forward_all(ctx, (logits,), zrows, plan, tokens=tokens, indices=indices, k=k)

    @staticmethod
    def backward(ctx, g_lse, g_k, g_logp, g_ent, _g_idx):
        logits, *saved = ctx.saved_tensors  # saved: _Saved's fields
        plan = ctx.plan
        zrows = _logit_rows(logits, saved[2].dtype, plan.temperature)
        grad = torch.empty_like(logits)
        for sl, rows, grads in _row_chunks(saved, (g_lse, g_k, g_logp, g_ent), logits.shape[0], plan.chunk):
            for v0, v1, G in _chunk_grads(zrows(sl), rows, grads, plan):
                grad[sl, v0:v1] = G.to(logits.dtype)
        return grad, None, None, None, None


def _hidden_rows(hidden, weight, bias, acc, temperature) -> Callable[[slice], ZBlock]:
    """sl -> zblock: (v0, v1) -> (n, v1 - v0) scaled logits (hidden[sl] @ W[v0:v1].T + b[v0:v1]) / temperature,
    in acc."""

    def rows(sl: slice) -> ZBlock:
        h = hidden[sl]  # (n, H)

        def zblock(v0: int, v1: int) -> torch.Tensor:
            b = None if bias is None else bias[v0:v1]
            z = torch.nn.functional.linear(h, weight[v0:v1], b).to(acc)  # a fresh tensor: divide in place
            return z if temperature == 1.0 else z.div_(temperature)

        return zblock

    return rows


class _FromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, indices, k, plan):
        zrows = _hidden_rows(hidden, weight, bias, _acc_dtype(hidden.dtype), plan.temperature)
        return _forward_all(ctx, (hidden, weight, bias), zrows, plan, tokens=tokens, indices=indices, k=k)

    @staticmethod
    def backward(ctx, g_lse, g_k, g_logp, g_ent, _g_idx):
        hidden, weight, bias, *saved = ctx.saved_tensors  # saved: _Saved's fields
        plan = ctx.plan
        acc = saved[2].dtype
        g_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        g_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        g_b = None
        if bias is not None and ctx.needs_input_grad[2]:
            g_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device)
        zrows = _hidden_rows(hidden, weight, bias, acc, plan.temperature)
        for sl, rows, grads in _row_chunks(saved, (g_lse, g_k, g_logp, g_ent), hidden.shape[0], plan.chunk):
            h = hidden[sl]
            gh = None if g_h is None else torch.zeros(h.shape, dtype=acc, device=h.device)  # (n, H)
            for v0, v1, G in _chunk_grads(zrows(sl), rows, grads, plan):
                if gh is not None:
                    gh.addmm_(G, weight[v0:v1].to(acc))  # (n, H)
                if g_w is not None:
                    g_w[v0:v1].addmm_(G.T, h.to(acc))  # (vc, H)
                if g_b is not None:
                    g_b[v0:v1] += G.sum(0)
            if g_h is not None:
                g_h[sl] = gh.to(hidden.dtype)
        g_w = None if g_w is None else g_w.to(weight.dtype)
        g_b = None if g_b is None else g_b.to(bias.dtype)
        return (g_h, g_w, g_b, None, None, None, None)


def _prepare(lead, V, tokens, indices, *, k, temperature, chunk_size, vocab_chunk_size, entropy=False):
    """Validate and flatten; returns (tokens (N,), indices (N, K) or None, the _Plan)."""
    B, T = lead
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size!r}")
    if vocab_chunk_size is not None and vocab_chunk_size < 1:
        raise ValueError(f"vocab_chunk_size must be >= 1 or None (whole vocabulary); got {vocab_chunk_size!r}")
    if k < 0:
        raise ValueError(f"k must be >= 0; got {k!r}")
    if indices is None and k > V:
        raise ValueError(f"k={k} exceeds the vocabulary size V={V}")
    if tokens is None:
        tokens = torch.zeros(B, T, dtype=torch.long)
    if tuple(tokens.shape) != (B, T):
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}; expected (B, T) = {(B, T)}")
    if indices is not None and tuple(indices.shape[:2]) != (B, T):
        raise ValueError(f"indices has shape {tuple(indices.shape)}; expected (B, T, K) with (B, T) = {(B, T)}")
    for name, t in (("tokens", tokens), ("indices", indices)):
        if t is not None and t.numel() and (int(t.min()) < 0 or int(t.max()) >= V):  # blocks would silently skip them
            raise ValueError(f"{name} must lie in [0, V) = [0, {V}); got values in [{int(t.min())}, {int(t.max())}]")
    flat_idx = None if indices is None else indices.reshape(B * T, -1).long()
    plan = _Plan(float(temperature), int(chunk_size), _vocab_blocks(V, vocab_chunk_size), entropy)
    return tokens.reshape(-1).long(), flat_idx, plan


def _unflatten(B: int, T: int, out: tuple, want_entropy: bool) -> TokenStats:
    """TokenStats (B, T, ...) from the flat outputs (lse, logits_k, logp, entropy, idx) of the passes."""
    lse, lk, logp, ent, idx = out
    K = idx.shape[-1]
    return TokenStats(
        logp.view(B, T), lse.view(B, T), lk.view(B, T, K), idx.view(B, T, K), ent.view(B, T) if want_entropy else None
    )


def token_stats_from_logits(
    logits: torch.Tensor,
    tokens: torch.Tensor | None = None,
    *,
    k: int = 0,
    indices: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    entropy: bool = False,
    vocab_chunk_size: int | None = None,
) -> TokenStats:
    """Stats from logits (B, T, V), differentiable. With ``indices`` (B, T, K) gather there (k ignored), else
    the own top-k."""
    if logits.ndim != 3:
        raise ValueError(f"logits must be (B, T, V); got shape {tuple(logits.shape)}")
    B, T, V = logits.shape
    sizes = dict(k=k, temperature=temperature, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)
    tok, idx, plan = _prepare((B, T), V, tokens, indices, entropy=entropy, **sizes)
    return _unflatten(B, T, _FromLogits.apply(logits.reshape(B * T, V), tok, idx, k, plan), entropy)


def topk_ids_from_logits(
    logits: torch.Tensor,
    *,
    k: int,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    vocab_chunk_size: int | None = None,
) -> torch.Tensor:
    """(B, T, k) int64 top-k ids of logits (B, T, V): exactly ``token_stats_from_logits(logits, k=k, ...).indices``
    (``torch.topk`` is given the same tensors, so ties resolve alike), without the statistics or autograd."""
    if logits.ndim != 3:
        raise ValueError(f"logits must be (B, T, V); got shape {tuple(logits.shape)}")
    B, T, V = logits.shape
    sizes = dict(k=k, temperature=temperature, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)
    _, _, plan = _prepare((B, T), V, None, None, **sizes)
    N = B * T
    if k == 0 or N == 0:
        return torch.zeros(B, T, k, dtype=torch.long, device=logits.device)
    zrows = _logit_rows(logits.reshape(N, V), _acc_dtype(logits.dtype), plan.temperature)
    out = []
    with torch.no_grad():
        for sl in _row_slices(N, plan.chunk):
            zblock, best = zrows(sl), None
            for v0, v1 in plan.blocks:
                best = _merge_topk(best, zblock(v0, v1), v0, k)
            out.append(best[1])
    return torch.cat(out).view(B, T, k)


def token_stats_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tokens: torch.Tensor | None = None,
    *,
    k: int = 0,
    indices: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    entropy: bool = False,
    vocab_chunk_size: int | None = None,
) -> TokenStats:
    """Stats from hidden states (B, T, H) and the LM head weight (V, H) [+ bias (V,)], never materialising
    (B, T, V) logits; differentiable w.r.t. hidden, weight and bias. At V = 151,936 a ``vocab_chunk_size`` of
    8192-16384 columns keeps the temporaries to tens of MB (docs/benchmarks.md)."""
    if hidden.ndim != 3 or weight.ndim != 2 or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"hidden must be (B, T, H) and weight (V, H); got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    B, T, H = hidden.shape
    sizes = dict(k=k, temperature=temperature, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)
    tok, idx, plan = _prepare((B, T), weight.shape[0], tokens, indices, entropy=entropy, **sizes)
    out = _FromHidden.apply(hidden.reshape(B * T, H), weight, bias, tok, idx, k, plan)
    return _unflatten(B, T, out, entropy)


def kl_inputs(
    policy: TokenStats, anchor: TokenStats, sampled: torch.Tensor, old_logp: torch.Tensor | None = None
) -> KLInputs:
    """Assemble Top-k / sampled KLInputs from the policy's and the anchor's stats at the same indices."""
    return KLInputs(
        logp=policy.logp,
        ref_logp=anchor.logp,
        old_logp=old_logp,
        sampled=sampled,
        topk_idx=policy.indices,
        logits_k=policy.logits_k,
        lse=policy.lse,
        ref_logits_k=anchor.logits_k,
        ref_lse=anchor.lse,
    )
