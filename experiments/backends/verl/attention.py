"""Attention for verl's packed micro-batches without flash-attn: PyTorch's varlen kernel behind transformers.

verl's FSDP engine packs a micro-batch into one row (``use_remove_padding``, on in every preset), position ids
restarting at 0 for each sequence. flash-attn's varlen kernel attends within each sequence; the GPU install has no
flash-attn (docs/verl-plugin.md), and transformers' sdpa masks the whole N x N block-diagonal product instead, many
times the cost at verl's token budgets (docs/benchmarks.md, "sdpa for packed batches on a GPU"). ``varlen_attention``
finds the sequences in the position ids and runs ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 in
PyTorch) on CUDA in bf16/fp16, and causal sdpa per sequence otherwise (the CPU: the reference the tests compare
with). A custom name gets no mask from transformers (``masking_utils``), so the position ids alone say what attends
to what; padded rows work too (verl's pads repeat a position, so each pad is a sequence of one).

Every verl process registers it (``register``, from the worker setup hook); ``choose`` picks it for
``backend.verl.attn_implementation=null`` on CUDA when flash-attn is absent.
"""

from __future__ import annotations

import importlib.util
import inspect
import weakref

import torch
import torch.nn.functional as F

NAME = "emapg_varlen"  # backend.verl.attn_implementation, and its name in transformers' AttentionInterface

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None
# torch 2.11 (the GPU install's) has no enable_gqa: its heads are repeated to the query's instead
GQA = varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def choose(explicit: str | None, device: str) -> tuple[str, str]:
    """(the attn_implementation verl's actor and reference load, why)."""
    if explicit is not None:
        return explicit, "set by backend.verl.attn_implementation"
    if device != "cuda":
        return "eager", "backend.verl.attn_implementation=null on CPU"
    if flash_attn_installed():
        return "flash_attention_2", "backend.verl.attn_implementation=null on CUDA, flash-attn installed"
    return NAME, "backend.verl.attn_implementation=null on CUDA without flash-attn"


def register() -> None:
    """Make ``NAME`` an attention transformers can load (idempotent); called in every process of a verl run."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)


def sequence_offsets(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) position ids -> (S + 1,) int32 offsets of the S sequences in the B * T flattened tokens: a sequence
    starts at each row's start and wherever a position does not follow the one before it."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    idx = starts.flatten().nonzero()[:, 0]
    return torch.cat([idx, idx.new_tensor([position_ids.numel()])]).to(torch.int32)


_LAST: tuple = (None, -1, None, 0)  # (weakref to the position ids, their version, offsets, longest sequence)


def _offsets(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``sequence_offsets`` and the longest sequence, once per forward: every layer (and a checkpointed layer's
    recomputation) gets the same position ids tensor, and each computation syncs the GPU (nonzero, max)."""
    global _LAST
    ref, version, offsets, longest = _LAST
    if ref is None or ref() is not position_ids or version != position_ids._version:
        offsets = sequence_offsets(position_ids)
        longest = int((offsets[1:] - offsets[:-1]).max())
        _LAST = (weakref.ref(position_ids), position_ids._version, offsets, longest)
    return offsets, longest


def varlen_attention(module, query, key, value, attention_mask, *, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention signature: query (B, Hq, T, D), key and value (B, Hkv, T, D) -> ((B, T, Hq, D), None).
    ``attention_mask`` is None for a custom attention; the sequences come from ``kwargs["position_ids"]``."""
    b, hq, t, d = query.shape
    pos = kwargs.get("position_ids")
    if pos is None or pos.shape != (b, t) or key.shape[2] != t or not getattr(module, "is_causal", True):
        raise ValueError(
            f"attn_implementation={NAME} runs a causal forward over whole sequences with their (B, T) position ids "
            "(verl's training and log-prob passes); for generation with a cache use sdpa"
        )
    if dropout or kwargs.get("sliding_window"):
        raise ValueError(f"attn_implementation={NAME} has no attention dropout or sliding window; use sdpa")
    offsets, longest = _offsets(pos)
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value))  # (B*T, H, D)
    if varlen_attn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out = varlen_kernel(q, k, v, offsets, longest, scale=scaling)
    else:
        out = _per_sequence(q, k, v, offsets, scaling)
    return out.view(b, t, hq, d), None


def varlen_kernel(q, k, v, offsets, longest: int, *, scale=None) -> torch.Tensor:
    """(N, Hq, D), (N, Hkv, D) x 2 -> (N, Hq, D): PyTorch's FlashAttention-2, causal within each sequence."""
    if not GQA and k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    gqa = {"enable_gqa": True} if GQA else {}
    return varlen_attn(q, k, v, offsets, offsets, longest, longest, scale=scale, window_size=(-1, 0), **gqa)


def _per_sequence(q, k, v, offsets, scale) -> torch.Tensor:
    """(N, Hq, D), (N, Hkv, D) x 2 -> (N, Hq, D): causal sdpa over each sequence on its own."""
    bounds = offsets.tolist()
    outs = [
        F.scaled_dot_product_attention(
            *(x[s:e].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scale, enable_gqa=True
        ).transpose(0, 1)
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs)
