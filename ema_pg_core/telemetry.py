"""KL telemetry both backends log (keys: docs/run-record.md): the exact KL beside its estimate on the
probe set (``kl/*``), and the Top-k head's coverage (``topk/*``).

The exact KL runs over blocks of ``chunk_size`` positions x ``vocab_chunk_size`` columns, two passes over
the vocabulary (the two logsumexps, then sum_j p_j (log p_j - log r_j)), so it never holds (N, V); the
Top-k quantities come from the (B, T, K) head logits and full logsumexps the estimators already receive.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ema_pg_core.kl import ImportanceWeight, KLInputs, aggregate, get_estimator, kl_per_token, tail_mask
from ema_pg_core.topk import (
    DEFAULT_CHUNK,
    TokenStats,
    ZBlock,
    _acc_dtype,
    _hidden_rows,
    _logit_rows,
    _row_slices,
    _vocab_blocks,
    kl_inputs,
    token_stats_from_logits,
)

PROBE_KEYS = ("kl/exact", "kl/estimate_on_probe", "kl/estimate_gap")
"""Logged at iterations probe_every, 2*probe_every, ... (``trainer.probe_every``), with ``perf/probe_s``."""
TOPK_KEYS = ("topk/head_mass", "topk/tail_frac", "topk/tail_share")
"""Logged every iteration by the Top-k estimators (+ ``TOPK_FORWARD_KEYS`` for forward Top-k)."""
TOPK_FORWARD_KEYS = ("topk/anchor_head_mass",)

EXACT_VOCAB_CHUNK = 8192
"""Vocabulary columns per block of the exact KL (a smaller vocabulary is one block)."""


def _rows_exact_kl(zp: ZBlock, zr: ZBlock, blocks, forward: bool) -> torch.Tensor:
    """(n,) KL(p || r) per row (r and p swapped when ``forward``): sum_j p_j (log p_j - log r_j)."""
    if forward:
        zp, zr = zr, zp
    lse_p = lse_r = None
    for v0, v1 in blocks:
        bp, br = torch.logsumexp(zp(v0, v1), -1), torch.logsumexp(zr(v0, v1), -1)
        lse_p = bp if lse_p is None else torch.logaddexp(lse_p, bp)
        lse_r = br if lse_r is None else torch.logaddexp(lse_r, br)
    out = torch.zeros_like(lse_p)
    for v0, v1 in blocks:
        lp = zp(v0, v1) - lse_p[:, None]  # (n, vc)
        lr = zr(v0, v1) - lse_r[:, None]
        out += (lp.exp() * (lp - lr)).sum(-1)
    return out


@torch.no_grad()
def exact_kl_blocks(
    rows_p, rows_r, N: int, V: int, *, direction: str, chunk_size: int, vocab_chunk_size
) -> torch.Tensor:
    """(N,) exact KL per position, no gradient; rows_p / rows_r: slice -> ZBlock of the policy's / the anchor's
    scaled logits. direction "reverse": KL(policy || anchor); "forward": KL(anchor || policy)."""
    blocks = _vocab_blocks(V, vocab_chunk_size)
    forward = direction == "forward"
    return torch.cat([_rows_exact_kl(rows_p(sl), rows_r(sl), blocks, forward) for sl in _row_slices(N, chunk_size)])


def exact_kl_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    ref_hidden: torch.Tensor,
    ref_weight: torch.Tensor,
    ref_bias: torch.Tensor | None,
    direction: str,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    vocab_chunk_size: int | None = EXACT_VOCAB_CHUNK,
) -> torch.Tensor:
    """(B, T) exact KL from both models' hidden states (B, T, H) and LM heads (V, H) [+ bias (V,)]."""
    B, T, H = hidden.shape
    if ref_hidden.shape[:2] != (B, T) or ref_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"policy hidden {tuple(hidden.shape)} / head {tuple(weight.shape)} and anchor hidden "
            f"{tuple(ref_hidden.shape)} / head {tuple(ref_weight.shape)} must share (B, T) and V"
        )
    acc = _acc_dtype(hidden.dtype)
    rows_p = _hidden_rows(hidden.reshape(B * T, H), weight, bias, acc, temperature)
    rows_r = _hidden_rows(ref_hidden.reshape(B * T, -1), ref_weight, ref_bias, acc, temperature)
    return exact_kl_blocks(
        rows_p,
        rows_r,
        B * T,
        weight.shape[0],
        direction=direction,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
    ).view(B, T)


def exact_kl_from_logits(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    *,
    direction: str,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    vocab_chunk_size: int | None = EXACT_VOCAB_CHUNK,
) -> torch.Tensor:
    """(N,) exact KL from raw logits (N, V) of both models (the verl engine's packed layout)."""
    if logits.shape != ref_logits.shape or logits.ndim != 2:
        raise ValueError(f"logits {tuple(logits.shape)} and ref_logits {tuple(ref_logits.shape)} must be equal (N, V)")
    acc = _acc_dtype(logits.dtype)
    rows_p, rows_r = _logit_rows(logits, acc, temperature), _logit_rows(ref_logits, acc, temperature)
    return exact_kl_blocks(
        rows_p, rows_r, *logits.shape, direction=direction, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size
    )


# --------------------------------------------------------------------------------------
# Top-k head coverage
# --------------------------------------------------------------------------------------
def topk_parts(x: KLInputs, name: str, *, tail: str, iw: ImportanceWeight) -> dict[str, torch.Tensor]:
    """Per-token (B, T) Top-k telemetry of estimator ``name``, no gradient: both models' mass inside q, whether
    the sampled token is outside q (tail), the estimate's exact head (tail "none") and the whole estimate."""
    with torch.no_grad():
        return {
            "head_mass": (x.logits_k - x.lse.unsqueeze(-1)).exp().sum(-1),
            "anchor_head_mass": (x.ref_logits_k - x.ref_lse.unsqueeze(-1)).exp().sum(-1),
            "tail": tail_mask(x.sampled, x.topk_idx).to(x.lse.dtype),
            "head": kl_per_token(name, x, tail="none", iw=iw),
            "estimate": kl_per_token(name, x, tail=tail, iw=iw),
        }


def topk_summary(parts: dict[str, torch.Tensor], mask: torch.Tensor, direction: str) -> dict[str, float]:
    """Token means over ``mask`` (B, T) of ``topk_parts``: the ``topk/*`` metrics (anchor's mass: forward only)."""
    mean = lambda t: float(aggregate(t, mask, "token-mean"))  # noqa: E731
    m = mask.to(parts["head"].dtype)
    tail_abs = float(((parts["estimate"] - parts["head"]).abs() * m).sum())
    total_abs = float((parts["head"].abs() * m).sum()) + tail_abs
    out = {
        "topk/head_mass": mean(parts["head_mass"]),
        "topk/tail_frac": mean(parts["tail"]),
        "topk/tail_share": tail_abs / total_abs if total_abs > 0 else 0.0,
    }
    if direction == "forward":
        out["topk/anchor_head_mass"] = mean(parts["anchor_head_mass"])
    return out


def probe_inputs(
    name: str,
    k: int,
    stats_p: Callable[..., TokenStats],
    stats_r: Callable[..., TokenStats],
    *,
    tokens: torch.Tensor,
    probe_logp: torch.Tensor,
) -> KLInputs:
    """KLInputs of estimator ``name`` on the probe tokens (B, T); ``stats_p`` / ``stats_r`` (``k=`` or
    ``indices=``) -> the policy's / the anchor's TokenStats there. The head is the policy's own top-k
    (reverse Top-k) or the anchor's (forward Top-k); ``probe_logp`` (B, T) is the log-prob of the policy
    that drew the tokens (the importance weight's denominator)."""
    est = get_estimator(name)
    if est.needs == "topk" and est.direction == "reverse":
        pol = stats_p(k=k)
        anc = stats_r(indices=pol.indices)
    elif est.needs == "topk":
        anc = stats_r(k=k)
        pol = stats_p(indices=anc.indices)
    else:
        pol, anc = stats_p(), stats_r()
    return kl_inputs(pol, anc, tokens, old_logp=probe_logp)


@torch.no_grad()
def probe_scores_from_logits(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    name: str,
    k: int,
    tail: str,
    iw: ImportanceWeight,
    probe_logp: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token (B, T) probe scores from both models' scaled logits (B, T, V) (the verl backend's probe, per
    sequence): the exact KL in estimator ``name``'s direction, the estimate on ``tokens`` with the importance
    weight pi / pi_probe (``probe_logp`` None: the policy drew the tokens, weight 1), and the policy's logp."""
    B, T, V = logits.shape
    direction = get_estimator(name).direction
    exact = exact_kl_from_logits(logits.reshape(B * T, V), ref_logits.reshape(B * T, V), direction=direction)

    def stats(z):
        return lambda **kw: token_stats_from_logits(z, tokens, **kw)

    x = probe_inputs(name, k, stats(logits), stats(ref_logits), tokens=tokens, probe_logp=probe_logp)
    x.old_logp = x.logp if probe_logp is None else probe_logp.to(x.logp.dtype)  # (B, T)
    if get_estimator(name).needs == "full":
        x.logits, x.ref_logits = logits, ref_logits
    return {"exact": exact.view(B, T), "estimate": kl_per_token(name, x, tail=tail, iw=iw), "logp": x.logp}


def probe_summary(exact: torch.Tensor, estimate: torch.Tensor, mask: torch.Tensor, agg: str) -> dict[str, float]:
    """``kl/exact``, ``kl/estimate_on_probe`` and their gap from (B, T) per-token values, aggregated as the loss."""
    e, s = float(aggregate(exact, mask, agg)), float(aggregate(estimate, mask, agg))
    return {"kl/exact": e, "kl/estimate_on_probe": s, "kl/estimate_gap": s - e}
