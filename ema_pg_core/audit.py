"""The numbers behind ``emapg figures``: exact, no training, plain records (lists of dicts).

    records = audit.records()        # {"estimator_table", "topk_sweep", "anchor_horizon",
                                     #  "stability_grid", "meta"}; schemas: analysis/audit_schema.py

Estimators are audited by exact enumeration (the trick of tests/core/test_kl.py): over a small
vocabulary V, position j of a (1, V) batch holds the same next-token distributions and the
sampled token p = j, so for the sampling distribution pi_s (pi_theta on-policy, pi_old off-policy)

    E[est]      = sum_j pi_s(j) est_j                          (exact, float64)
    E[grad est] = grad_z sum_j sg(pi_s(j)) est_j = sum_j pi_s(j) g_j,   g_j = grad_z est_j
    Var[est]    = sum_j pi_s(j) (est_j - E[est])^2
    tr Cov[g]   = sum_j pi_s(j) ||g_j - E[g]||^2                (the per-sample gradient covariance)

where z are the policy logits (softmax parameterisation). The random distributions follow the
tests: z ~ N(0, 1), anchor zr = z + 0.7 N(0, 1), pi_old zo = z + 0.5 N(0, 1), one draw per seed.
"Bias" is the max over seeds of |E[value] - KL| and of max_i |E[grad] - grad KL|_i, where KL is
the exact KL of the estimator's direction; a verdict is "unbiased" when the bias is < 1e-8.

The anchor horizon and the stability region are arithmetic on the EMA rule and on a toy quadratic
model of our own (not the paper's theorem): docs/algorithm.md, "Horizon" and "Stability of a toy
model".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from ema_pg_core.kl import KL_ESTIMATORS, REQUIRED, TAILS, ImportanceWeight, KLInputs, kl_per_token

F64 = torch.float64
UNBIASED_TOL = 1e-8
VARIANCE_FLOOR = 1e-28  # (1e-14)^2: below float64 resolution of O(1) estimates
BYTES_VOCAB = 151_936  # Qwen2.5 vocabulary
BYTES_K = 32  # the paper's k
_INDEX_FIELDS = {"sampled", "topk_idx"}  # int64; every other field is an fp32 value
_K_FIELDS = {"topk_idx", "logits_k", "ref_logits_k"}
_V_FIELDS = {"logits", "ref_logits"}


# --------------------------------------------------------------------------------------
# Memory accounting
# --------------------------------------------------------------------------------------
def bytes_per_token(needs: str, *, V: int = BYTES_VOCAB, K: int = BYTES_K, iw: bool = False) -> int:
    """Bytes per token of the ``KLInputs`` fields an estimator with capability ``needs`` reads: fp32 values
    (4 B) and int64 ids (8 B), K-wide fields x K, V-wide x V, +4 B for old_logp under the importance weight.
    At V=151,936, K=32: sampled 8 B, topk 536 B, full 1,215,488 B."""
    total = 0
    for f in REQUIRED[needs]:
        width = K if f in _K_FIELDS else V if f in _V_FIELDS else 1
        total += width * (8 if f in _INDEX_FIELDS else 4)
    return total + (4 if iw and needs != "full" else 0)


# --------------------------------------------------------------------------------------
# Exact enumeration
# --------------------------------------------------------------------------------------
def random_logits(seed: int, V: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(V,) policy logits z (requires grad), anchor zr = z + 0.7 eps, pi_old zo = z + 0.5 eps; float64."""
    g = torch.Generator().manual_seed(seed)
    z = (scale * torch.randn(V, generator=g, dtype=F64)).requires_grad_(True)
    zr = z.detach() + 0.7 * torch.randn(V, generator=g, dtype=F64)
    zo = z.detach() + 0.5 * torch.randn(V, generator=g, dtype=F64)
    return z, zr, zo


def enum_inputs(z: torch.Tensor, zr: torch.Tensor, zo: torch.Tensor | None, q: torch.Tensor) -> KLInputs:
    """KLInputs with B=1, T=V positions, position j sampling token j; q: (K,) head indices."""
    V = z.shape[0]
    logp, logr = torch.log_softmax(z, -1), torch.log_softmax(zr, -1)
    tok = torch.arange(V)
    idx = q.expand(1, V, q.shape[0])
    return KLInputs(
        logp=logp[None],
        ref_logp=logr[None],
        old_logp=None if zo is None else torch.log_softmax(zo, -1)[None],
        sampled=tok[None],
        topk_idx=idx,
        logits_k=z[idx],
        lse=torch.logsumexp(z, -1).expand(1, V),
        ref_logits_k=zr[idx],
        ref_lse=torch.logsumexp(zr, -1).expand(1, V),
        logits=z.expand(1, V, V),
        ref_logits=zr.expand(1, V, V),
    )


def exact_kl(z: torch.Tensor, zr: torch.Tensor, direction: str) -> tuple[float, torch.Tensor]:
    """Exact KL(pi || pi_ref) (reverse) or KL(pi_ref || pi) (forward) and its gradient (V,) w.r.t. z."""
    lq, lr = torch.log_softmax(z, -1), torch.log_softmax(zr, -1)
    kl = (lq.exp() * (lq - lr)).sum() if direction == "reverse" else (lr.exp() * (lr - lq)).sum()
    (g,) = torch.autograd.grad(kl, z)
    return kl.item(), g


def head_indices(z, zr, zo, direction: str, k: int) -> torch.Tensor:
    """(k,) q: pi_old's top-k for reverse (pi_old = pi_theta on-policy), the anchor's for forward."""
    src = zr if direction == "forward" else (zo if zo is not None else z.detach())
    return torch.topk(src, k).indices if k > 0 else torch.zeros(0, dtype=torch.long)


def per_sample_grads(est: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """(V, V) Jacobian d est_j / d z: one vmapped backward."""
    eye = torch.eye(est.shape[0], dtype=est.dtype)
    return torch.autograd.grad(est, z, grad_outputs=eye, is_grads_batched=True, retain_graph=True)[0]


def moments(name: str, z, zr, zo=None, *, k: int = 0, tail: str = "unbiased") -> dict[str, float]:
    """value_bias, grad_bias (max-abs), value_variance and grad_variance (trace of the per-sample gradient's
    covariance) of estimator ``name`` under pi_s (pi_old = softmax(zo) if given, with s on)."""
    direction = KL_ESTIMATORS[name].direction
    q = head_indices(z, zr, zo, direction, k)
    iw = ImportanceWeight(enabled=zo is not None)
    est = kl_per_token(name, enum_inputs(z, zr, zo, q), tail=tail, iw=iw)[0]  # (V,)
    jac = per_sample_grads(est, z)  # (V, V): row j is g_j
    pi_s = torch.softmax(zo if zo is not None else z.detach(), -1)
    est = est.detach()
    mean, gmean = (pi_s * est).sum(), pi_s @ jac
    kl, kl_grad = exact_kl(z, zr, direction)
    return {
        "value_bias": abs(mean.item() - kl),
        "grad_bias": (gmean - kl_grad).abs().max().item(),
        "value_variance": _zero_if_rounding((pi_s * (est - mean) ** 2).sum().item()),
        "grad_variance": _zero_if_rounding((pi_s * ((jac - gmean) ** 2).sum(-1)).sum().item()),
    }


def _zero_if_rounding(var: float) -> float:
    """A constant estimate (exact KL; Top-k at k=|V|) leaves ~1e-34 of float64 rounding: report 0."""
    return 0.0 if var < VARIANCE_FLOOR else var


def _over_seeds(name: str, V: int, seeds: Iterable[int], off_policy: bool, **kw) -> dict[str, float]:
    """Biases: max over seeds; variances: mean over seeds."""
    ms = []
    for seed in seeds:
        z, zr, zo = random_logits(seed, V)
        ms.append(moments(name, z, zr, zo if off_policy else None, **kw))
    agg = {key: max(m[key] for m in ms) for key in ("value_bias", "grad_bias")}
    agg.update({key: sum(m[key] for m in ms) / len(ms) for key in ("value_variance", "grad_variance")})
    return agg


def estimator_table(V: int = 16, k: int = 4, seeds: Iterable[int] = range(8), off_policy: bool = False) -> list[dict]:
    """One row per registered estimator (Top-k ones once per tail mode), by exact enumeration (schema:
    analysis/audit_schema.py); bytes at V=151,936 and K=32, not at the audit's V, k. ``off_policy``: the samples
    come from pi_old, with the importance weight s on (exact KL ignores s)."""
    seeds = list(seeds)
    rows = []
    for name, est in KL_ESTIMATORS.items():
        is_topk = est.needs == "topk"
        for tail in TAILS if is_topk else (None,):
            m = _over_seeds(name, V, seeds, off_policy, k=k if is_topk else 0, tail=tail or "unbiased")
            rows.append(
                {
                    "estimator": name,
                    "direction": est.direction,
                    "tail": tail,
                    "k": k if is_topk else None,
                    "value_bias": m["value_bias"],
                    "grad_bias": m["grad_bias"],
                    "value_unbiased": bool(m["value_bias"] < UNBIASED_TOL),
                    "grad_unbiased": bool(m["grad_bias"] < UNBIASED_TOL),
                    "variance": m["value_variance"],
                    "grad_variance": m["grad_variance"],
                    "bytes_per_token": bytes_per_token(est.needs, iw=off_policy),
                }
            )
    return rows


def topk_sweep(
    V: int = 16,
    ks: Sequence[int] | None = None,
    directions: Sequence[str] = ("reverse", "forward"),
    tails: Sequence[str] = TAILS,
    seeds: Iterable[int] = range(8),
) -> list[dict]:
    """Top-k KL from k=0 (pure K4 / K5 tail) to k=|V| (exact), on-policy, by exact enumeration: rows of
    direction, tail, k, the variances (means over seeds) and the biases (max over seeds)."""
    seeds = list(seeds)
    rows = []
    for direction in directions:
        for tail in tails:
            for k in ks if ks is not None else range(V + 1):
                m = _over_seeds(f"topk_{direction}", V, seeds, False, k=k, tail=tail)
                rows.append({"direction": direction, "tail": tail, "k": int(k), **m})
    return rows


# --------------------------------------------------------------------------------------
# EMA anchor horizon (docs/algorithm.md, "Horizon"): one update every P iterations, weight tau on the old anchor
# --------------------------------------------------------------------------------------
def half_life(tau: float, period: int) -> float:
    """Iterations until a policy snapshot's weight in the anchor halves: P ln(1/2) / ln(tau)."""
    if tau >= 1.0:
        return math.inf
    return 0.0 if tau <= 0.0 else period * math.log(0.5) / math.log(tau)


def time_constant(tau: float, period: int) -> float:
    """Mean age of the anchor's mixture in iterations, P / (1 - tau) (inf for a fixed anchor)."""
    return math.inf if tau >= 1.0 else period / (1.0 - tau)


def anchor_horizon(
    taus: Sequence[float] = (0.5, 0.7, 0.8, 0.85, 0.9, 0.925, 0.95, 0.975, 0.99),
    periods: Sequence[int] = (1, 5, 10, 20),
) -> list[dict]:
    """Rows {"tau", "period", "half_life", "time_constant"}; tau = 1 gives inf (fixed anchor)."""
    return [
        {"tau": float(t), "period": int(p), "half_life": half_life(t, p), "time_constant": time_constant(t, p)}
        for p in periods
        for t in taus
    ]


# --------------------------------------------------------------------------------------
# Stability of our toy model (docs/algorithm.md): quadratic reward, quadratic KL, EMA every step
# --------------------------------------------------------------------------------------
def iteration_matrix(alpha, a, beta_c, eta) -> np.ndarray:
    """(..., 2, 2) M with (e, e_ema)' = M (e, e_ema), errors relative to theta*.

    theta' = theta + alpha [a (theta* - theta) - beta c (theta - theta_ema)]
    theta_ema' = eta theta_ema + (1 - eta) theta'
    """
    alpha, a, beta_c, eta = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (alpha, a, beta_c, eta)))
    d = 1.0 - alpha * (a + beta_c)
    row0 = np.stack([d, alpha * beta_c], -1)
    row1 = np.stack([(1 - eta) * d, eta + (1 - eta) * alpha * beta_c], -1)
    return np.stack([row0, row1], -2)


def spectral_radius(alpha, a, beta_c, eta) -> np.ndarray:
    """(...,) max |eigenvalue| of ``iteration_matrix``."""
    return np.abs(np.linalg.eigvals(iteration_matrix(alpha, a, beta_c, eta))).max(-1)


def stable_closed_form(alpha, a, beta_c, eta) -> np.ndarray:
    """alpha (a + 2 eta / (1 + eta) beta c) < 2, valid for a > 0 and 0 <= eta < 1 (Jury criterion)."""
    alpha, a, beta_c, eta = (np.asarray(x, dtype=float) for x in (alpha, a, beta_c, eta))
    return alpha * (a + 2 * eta / (1 + eta) * beta_c) < 2


def stability_grid(
    alphas: Sequence[float] | None = None,
    beta_cs: Sequence[float] | None = None,
    etas: Sequence[float] = (0.0, 0.5, 0.9, 0.95, 0.99),
    a: float = 1.0,
) -> list[dict]:
    """Rows {"alpha", "beta_c", "eta", "stable" (spectral radius < 1), "a", "spectral_radius", "closed_form"}."""
    # the default grid is offset so that no point lies exactly on the boundary (radius 1 = rounding noise)
    alphas = 0.05 * (np.arange(50) + 2**-0.5) if alphas is None else np.asarray(alphas, dtype=float)
    beta_cs = np.linspace(0.0, 20.0, 41) if beta_cs is None else np.asarray(beta_cs, dtype=float)
    E, B, A = np.meshgrid(np.asarray(etas, dtype=float), beta_cs, alphas, indexing="ij")
    rho = spectral_radius(A, a, B, E)
    closed = stable_closed_form(A, a, B, E)
    return [
        {
            "alpha": float(al),
            "beta_c": float(bc),
            "eta": float(et),
            "stable": bool(r < 1.0),
            "a": float(a),
            "spectral_radius": float(r),
            "closed_form": bool(c),
        }
        for al, bc, et, r, c in zip(A.ravel(), B.ravel(), E.ravel(), rho.ravel(), closed.ravel())
    ]


# --------------------------------------------------------------------------------------
# Everything `emapg figures` renders
# --------------------------------------------------------------------------------------
def records(V: int = 16, k: int = 4, seeds: Iterable[int] = range(8)) -> dict:
    """{"estimator_table", "topk_sweep", "anchor_horizon", "stability_grid", "meta"} (plain data)."""
    seeds = list(seeds)
    return {
        "estimator_table": estimator_table(V, k, seeds),
        "topk_sweep": topk_sweep(V, seeds=seeds),
        "anchor_horizon": anchor_horizon(),
        "stability_grid": stability_grid(),
        "meta": {
            "vocab_size": V,
            "k": k,
            "n_distributions": len(seeds),
            "sampling": "on-policy",
            "method": "exact enumeration, float64",
            "bytes_at": f"V={BYTES_VOCAB}, K={BYTES_K}, fp32 + int64",
            "stability_model": "toy quadratic (ours, not the paper's theorem), a=1",
        },
    }
