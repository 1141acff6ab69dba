"""Token-level KL estimators: one registry, one signature.

Shapes (legend): B = batch x group (sequences), T = response length, K = top-k, V = vocabulary.

Every estimator is a pure function ``fn(x: KLInputs, *, tail, iw) -> (B, T)`` registered once in
``KL_ESTIMATORS`` with metadata that says what it needs:

    needs="sampled"  log-probs of the sampled token only (O(1) per token)
    needs="topk"     + top-k logits of both models and their full logsumexp (O(K) per token)
    needs="full"     full (B, T, V) logits of both models (O(V) per token)

The trainer checks ``needs``, never the name. Notation (the paper's):
p ~ pi_sampling is the sampled token, r = pi(p)/sg(pi(p)) (value 1, gradient grad log pi(p)),
w = pi_ref(p)/pi(p), s = sg(pi(p)/pi_old(p)) the importance weight (optionally clipped).
"Reverse" is KL(pi || pi_ref), "forward" KL(pi_ref || pi); pi_ref is the (EMA) anchor.

What each estimator's expectation is (exact enumeration in tests/core/test_kl.py; the paper's
Table 1, plus the Top-k estimators; derivations in docs/algorithm.md):

    name           direction  E[value]          E[grad]
    k1             reverse    KL                0                     (gradient biased)
    k2             reverse    E[(log w)^2 / 2]  grad KL               (value biased)
    k3             reverse    KL                grad KL(ref||pi)      (gradient is the forward one)
    k3++           reverse    KL                grad KL
    k4             reverse    KL                grad KL
    k5             forward    KL                grad KL
    k1+, k3+       reverse    KL                grad KL               (straight-through: value of
                                                                       k1/k3, gradient of k2)
    exact_reverse  reverse    KL (exact)        grad KL (exact)
    exact_forward  forward    KL (exact)        grad KL (exact)
    topk_reverse   reverse    KL unless tail=none;  gradient: tail=unbiased exact,
    topk_forward   forward    tail=paper biased by +grad(pi mass of head) (reverse) or
                              +grad(pi mass of tail) (forward), tail=none drops the tail.

Temperature: every input logit/log-prob is already divided by the rollout temperature by its
producer (``ema_pg_core.topk``, the trainer); the estimators never see raw logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Literal

import torch

Needs = Literal["sampled", "topk", "full"]
TAILS = ("paper", "unbiased", "none")
LOG_RATIO_CLAMP = 20.0  # reference clamps: K3/K5 log w to [-20, 20]; iw log-ratio to [-20, 20]
K3_VALUE_CLAMP = 10.0  # K3 value clamped to [-10, 10] (verl low_var_kl)


# --------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------
@dataclass
class KLInputs:
    """Everything any estimator may need; each estimator declares which fields it reads.

    logp:         (B, T)    log pi_theta(p), differentiable
    ref_logp:     (B, T)    log pi_ref(p), constant
    old_logp:     (B, T)    log pi_old(p) = log pi_sampling(p), constant; None = on-policy (s = 1)
    sampled:      (B, T)    int64 sampled token ids (needed by Top-k for the tail mask)
    topk_idx:     (B, T, K) int64 head indices q (pi_old's for reverse, the anchor's for forward)
    logits_k:     (B, T, K) pi_theta logits gathered at topk_idx, differentiable
    lse:          (B, T)    pi_theta full-vocabulary logsumexp, differentiable
    ref_logits_k: (B, T, K) anchor logits at topk_idx
    ref_lse:      (B, T)    anchor full-vocabulary logsumexp
    logits:       (B, T, V) pi_theta logits (exact estimators), differentiable
    ref_logits:   (B, T, V) anchor logits (exact estimators)
    """

    logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None
    sampled: torch.Tensor | None = None
    topk_idx: torch.Tensor | None = None
    logits_k: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    ref_logits_k: torch.Tensor | None = None
    ref_lse: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    ref_logits: torch.Tensor | None = None


REQUIRED: dict[str, tuple[str, ...]] = {
    "sampled": ("logp", "ref_logp"),
    "topk": ("logp", "ref_logp", "sampled", "topk_idx", "logits_k", "lse", "ref_logits_k", "ref_lse"),
    "full": ("logits", "ref_logits"),
}


def check_inputs(x: KLInputs, needs: Needs, name: str) -> tuple[int, int]:
    """Raise ValueError naming a missing or mis-shaped field; return (B, T)."""
    missing = [f for f in REQUIRED[needs] if getattr(x, f) is None]
    if missing:
        raise ValueError(f"KL estimator {name!r} needs {needs} inputs; missing KLInputs field(s): {', '.join(missing)}")
    ref = x.logits if needs == "full" else x.logp
    B, T = ref.shape[:2]
    for f in fields(x):
        t = getattr(x, f.name)
        if t is not None and tuple(t.shape[:2]) != (B, T):
            raise ValueError(f"KLInputs.{f.name} has shape {tuple(t.shape)}; expected leading (B, T) = {(B, T)}")
    if needs == "topk":
        K = x.topk_idx.shape[-1]
        for f in ("logits_k", "ref_logits_k"):
            if getattr(x, f).shape != x.topk_idx.shape:
                raise ValueError(
                    f"KLInputs.{f} has shape {tuple(getattr(x, f).shape)}; expected (B, T, K) = {(B, T, K)}"
                )
    if needs == "full" and x.logits.shape != x.ref_logits.shape:
        raise ValueError(
            f"KLInputs.ref_logits shape {tuple(x.ref_logits.shape)} != logits shape {tuple(x.logits.shape)}"
        )
    return B, T


# --------------------------------------------------------------------------------------
# Importance weight s = sg(pi/pi_old), optionally clipped to [low, high]
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImportanceWeight:
    """The off-policy weight s of Alg 1/2. ``enabled=False`` means s = 1 (on-policy)."""

    enabled: bool = False
    clip_low: float | None = None
    clip_high: float | None = None


def importance_weight(x: KLInputs, iw: ImportanceWeight) -> torch.Tensor | float:
    """(B, T) stop-gradient s = exp(clamp(log pi - log pi_old, -20, 20)), clipped; 1.0 when off."""
    if not iw.enabled:
        return 1.0
    if x.old_logp is None:
        raise ValueError("importance weighting is on (use_iw=True) but KLInputs.old_logp is None")
    s = torch.exp((x.logp.detach() - x.old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if iw.clip_low is not None or iw.clip_high is not None:
        s = s.clamp(min=iw.clip_low, max=iw.clip_high)
    return s


# --------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimator:
    name: str
    fn: Callable[..., torch.Tensor]
    needs: Needs
    direction: Literal["reverse", "forward"]
    summary: str


KL_ESTIMATORS: dict[str, Estimator] = {}
ALIASES = {
    "kl": "k1",
    "mse": "k2",
    "low_var_kl": "k3",
    "k3plusplus": "k3++",
    "low_var_kl+": "k3+",
    "full_reverse": "exact_reverse",
    "full_forward": "exact_forward",
}


def register_kl(name: str, *, needs: Needs, direction: str, summary: str):
    """Decorator: add an estimator to ``KL_ESTIMATORS``; a duplicate name is an error."""

    def deco(fn):
        if name in KL_ESTIMATORS:
            raise ValueError(f"KL estimator {name!r} is already registered")
        KL_ESTIMATORS[name] = Estimator(name, fn, needs, direction, summary)
        return fn

    return deco


def get_estimator(name: str) -> Estimator:
    """Look up by name or alias; unknown names raise a ValueError listing the valid ones."""
    key = ALIASES.get(name, name)
    if key not in KL_ESTIMATORS:
        raise ValueError(
            f"unknown KL estimator (kl.type) {name!r}; allowed: {', '.join(sorted(KL_ESTIMATORS))}"
            f" (aliases: {', '.join(sorted(ALIASES))})"
        )
    return KL_ESTIMATORS[key]


def kl_per_token(
    name: str, x: KLInputs, *, tail: str = "unbiased", iw: ImportanceWeight = ImportanceWeight()
) -> torch.Tensor:
    """Per-token KL estimate (B, T) of estimator ``name`` after validating its inputs."""
    if tail not in TAILS:
        raise ValueError(f"kl tail must be one of {TAILS}; got {tail!r}")
    est = get_estimator(name)
    B, T = check_inputs(x, est.needs, est.name)
    out = est.fn(x, tail=tail, iw=iw)
    assert out.shape == (B, T), (est.name, out.shape)
    return out


# --------------------------------------------------------------------------------------
# Sampled estimators (O(1) per token). s multiplies the whole estimate.
# --------------------------------------------------------------------------------------
def _log_ratio(x: KLInputs) -> torch.Tensor:
    """(B, T) log(pi/pi_ref)(p) = -log w, differentiable in pi."""
    return x.logp - x.ref_logp


def _log_r(x: KLInputs) -> torch.Tensor:
    """(B, T) log r = log pi(p) - sg(log pi(p)): value 0, gradient grad log pi(p)."""
    return x.logp - x.logp.detach()


def _k3_value(x: KLInputs) -> torch.Tensor:
    """(B, T) w - log w - 1 with verl's clamps (log w to [-20, 20], value to [-10, 10])."""
    log_w = (x.ref_logp - x.logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(log_w) - log_w - 1).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)


def _k2_value(x: KLInputs) -> torch.Tensor:
    return 0.5 * _log_ratio(x) ** 2


def _straight_through(value: torch.Tensor, grad_source: torch.Tensor) -> torch.Tensor:
    """Value of ``value``, gradient of ``grad_source``."""
    return value.detach() + grad_source - grad_source.detach()


@register_kl("k1", needs="sampled", direction="reverse", summary="log pi - log pi_ref; expected gradient 0")
def k1(x, *, tail, iw):
    return importance_weight(x, iw) * _log_ratio(x)


@register_kl("k2", needs="sampled", direction="reverse", summary="(log w)^2/2; biased value, unbiased gradient")
def k2(x, *, tail, iw):
    return importance_weight(x, iw) * _k2_value(x)


@register_kl(
    "k3", needs="sampled", direction="reverse", summary="w - log w - 1 (low_var_kl); gradient is the forward-KL one"
)
def k3(x, *, tail, iw):
    return importance_weight(x, iw) * _k3_value(x)


@register_kl("k3++", needs="sampled", direction="reverse", summary="r * K3; unbiased value and gradient")
def k3pp(x, *, tail, iw):
    r = torch.exp(_log_r(x))
    return importance_weight(x, iw) * r * _k3_value(x)


@register_kl(
    "k4", needs="sampled", direction="reverse", summary="r * sg(log pi - log pi_ref); unbiased value and gradient"
)
def k4(x, *, tail, iw):
    r = torch.exp(_log_r(x))
    return importance_weight(x, iw) * r * _log_ratio(x).detach()


@register_kl(
    "k5", needs="sampled", direction="forward", summary="sg(w) log w + log r; unbiased forward value and gradient"
)
def k5(x, *, tail, iw):
    log_w = (x.ref_logp - x.logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return importance_weight(x, iw) * (torch.exp(log_w).detach() * log_w + _log_r(x))


@register_kl("k1+", needs="sampled", direction="reverse", summary="value of K1, gradient of K2")
def k1_st(x, *, tail, iw):
    return importance_weight(x, iw) * _straight_through(_log_ratio(x), _k2_value(x))


@register_kl("k3+", needs="sampled", direction="reverse", summary="value of K3, gradient of K2")
def k3_st(x, *, tail, iw):
    return importance_weight(x, iw) * _straight_through(_k3_value(x), _k2_value(x))


# --------------------------------------------------------------------------------------
# Exact full-vocabulary KL (O(V) per token). No importance weight: nothing is sampled.
# --------------------------------------------------------------------------------------
def _full_logprobs(x: KLInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, V) log pi and log pi_ref over the whole vocabulary (half-precision logits in fp32)."""
    logq = torch.log_softmax(x.logits.float() if x.logits.dtype in (torch.float16, torch.bfloat16) else x.logits, -1)
    return logq, torch.log_softmax(x.ref_logits.to(logq.dtype), -1)


@register_kl("exact_reverse", needs="full", direction="reverse", summary="sum_j pi (log pi - log pi_ref), exact")
def exact_reverse(x, *, tail, iw):
    logq, logr = _full_logprobs(x)
    return (logq.exp() * (logq - logr)).sum(-1)


@register_kl("exact_forward", needs="full", direction="forward", summary="sum_j pi_ref (log pi_ref - log pi), exact")
def exact_forward(x, *, tail, iw):
    logq, logr = _full_logprobs(x)
    return (logr.exp() * (logr - logq)).sum(-1)


# --------------------------------------------------------------------------------------
# Top-k KL (Alg 1 / Alg 2): exact head over q, normalised with the FULL logsumexp, plus a
# sampled tail masked to p not in q and weighted by s.
# --------------------------------------------------------------------------------------
def tail_mask(sampled: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """(B, T) float 1[p not in q] from sampled (B, T) and q (B, T, K)."""
    return (topk_idx != sampled.unsqueeze(-1)).all(-1).to(torch.get_default_dtype())


def _head_logprobs(x: KLInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, K) log pi(j) and log pi_ref(j) for j in q, with full-vocabulary normalisation."""
    return x.logits_k - x.lse.unsqueeze(-1), x.ref_logits_k - x.ref_lse.unsqueeze(-1)


def _with_tail(x: KLInputs, head: torch.Tensor, t: torch.Tensor, iw) -> torch.Tensor:
    """(B, T) head + s * 1[p not in q] * t: the sampled tail term t (B, T) counts only off the top-k."""
    mask = tail_mask(x.sampled, x.topk_idx).to(head.dtype)
    return head + importance_weight(x, iw) * mask * t


@register_kl(
    "topk_reverse",
    needs="topk",
    direction="reverse",
    summary="exact head over pi_old's top-k + s*1[p not in q]*K4 tail (Alg 1)",
)
def topk_reverse(x, *, tail, iw):
    """Alg 1. Head: sum_{j in q} pi(j)(log pi(j) - log pi_ref(j)), fully differentiable.

    Tail (p not in q, weighted by s):
      paper:    r * sg(log pi(p) - log pi_ref(p))            (K4)   E[grad] = grad KL + grad pi(q)
      unbiased: K4 + log r                                          E[grad] = grad KL
      none:     0 (Truncated KL: value misses the tail's share of the KL)
    """
    logq_k, logr_k = _head_logprobs(x)
    head = (logq_k.exp() * (logq_k - logr_k)).sum(-1)
    if tail == "none":
        return head
    t = torch.exp(_log_r(x)) * _log_ratio(x).detach()
    if tail == "unbiased":
        t = t + _log_r(x)
    return _with_tail(x, head, t, iw)


@register_kl(
    "topk_forward",
    needs="topk",
    direction="forward",
    summary="exact head over the anchor's top-k + s*1[p not in q]*K5 tail (Alg 2)",
)
def topk_forward(x, *, tail, iw):
    """Alg 2. Head: sum_{j in q} pi_ref(j)(log pi_ref(j) - log pi(j)); gradient only into pi.

    Tail (p not in q, weighted by s), log w clamped to [-20, 20]:
      paper:    sg(w) log w + log r                         (K5)   E[grad] = grad KL + grad pi(not q)
      unbiased: sg(w) log w                                        E[grad] = grad KL
      none:     0 (Truncated KL)
    """
    logq_k, logr_k = _head_logprobs(x)
    head = (logr_k.exp().detach() * (logr_k - logq_k)).sum(-1)
    if tail == "none":
        return head
    log_w = (x.ref_logp - x.logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    t = torch.exp(log_w).detach() * log_w
    if tail == "paper":
        t = t + _log_r(x)
    return _with_tail(x, head, t, iw)


# --------------------------------------------------------------------------------------
# Aggregation of a (B, T) per-token quantity into the scalar that enters the loss
# --------------------------------------------------------------------------------------
def _token_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp_min(1)


def _seq_mean_token_mean(x, mask):
    per_seq_n = mask.sum(-1)
    per_seq = (x * mask).sum(-1) / per_seq_n.clamp_min(1)  # (B,)
    has = (per_seq_n > 0).to(x.dtype)
    return (per_seq * has).sum() / has.sum().clamp_min(1)


def _seq_mean_token_sum(x, mask):
    return (x * mask).sum(-1).mean()


def _sum(x, mask):
    return (x * mask).sum()


LOSS_AGG: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token-mean": _token_mean,  # search recipe: mean over all response tokens of the micro-batch
    "seq-mean-token-mean": _seq_mean_token_mean,  # math recipe: mean per sequence, then over sequences
    "seq-mean-token-sum": _seq_mean_token_sum,  # the paper's formula: sum over positions, mean over sequences
    "sum": _sum,
}


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Scalar from (B, T) values and a (B, T) 0/1 mask.

    Effective beta: the paper's Fig. 1 sums the KL over the L response positions, the released
    code averages ("token-mean"/"seq-mean-token-mean"). With coefficient beta, a mean-aggregated
    KL equals a summed one with beta / L, so beta=0.001 under token-mean is a per-sequence
    coefficient about L times weaker than the same beta under "seq-mean-token-sum".
    """
    if mode not in LOSS_AGG:
        raise ValueError(f"loss aggregation mode {mode!r} unknown; allowed: {', '.join(LOSS_AGG)}")
    if per_token.shape != mask.shape:
        raise ValueError(f"per_token shape {tuple(per_token.shape)} != mask shape {tuple(mask.shape)}")
    return LOSS_AGG[mode](per_token, mask.to(per_token.dtype))
