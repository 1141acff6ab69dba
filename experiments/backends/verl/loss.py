"""The actor loss under verl: PPO surrogate + beta * any ``ema_pg_core.kl`` estimator.

Shapes: B sequences, T response width, nnz packed tokens, V vocabulary, K top-k.

Installed with ``TrainingWorker.set_loss_fn`` (as verl's own ``ppo_loss``); verl calls it in two roles:

1. **logits processor** (``student_logits`` (1, nnz, V) given; Top-k estimators only): the training logits
   exist only here, so the per-token Top-k KL is computed here on the local backend's (B, T[, K]) inputs and
   returned packed as (1, nnz), with verl's log-probs of the sampled tokens (``LOGP_KEY``: the engine tells
   verl to skip its own pass). The ``topk/*`` telemetry goes to the final loss as a non-tensor entry
   (``TOPK_METRICS``), not as per-token parts verl would wrap in nested tensors.
2. **final loss** (``model_output`` given): the core's ``ppo_clip_per_token`` (times verl's rollout-correction
   weights when present) + beta * KL - c_ent * entropy, each aggregated with verl's ``agg_loss`` and its global
   batch info, so accumulation over micro-batches and ranks gives the mini-batch loss.

With one micro-batch on one rank the value equals ``ema_pg_core.loss.policy_loss`` (tested).
"""

from __future__ import annotations

import torch
from verl.trainer.ppo.core_algos import agg_loss
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.utils.torch_functional import logprobs_from_logits

from ema_pg_core.config import KLConfig, LossConfig
from ema_pg_core.kl import ImportanceWeight, KLInputs, get_estimator, kl_per_token
from ema_pg_core.loss import ppo_clip_per_token
from ema_pg_core.telemetry import topk_parts, topk_summary
from ema_pg_core.topk import token_stats_from_logits
from experiments.backends.verl.config import VERL_AGG, head_keys
from experiments.backends.verl.layout import Layout, padded_response

KL_KEY = "emapg_kl"  # per-token Top-k KL from the logits-processor pass, packed (nnz,)
LOGP_KEY = "log_probs"  # verl's log-probs of the sampled tokens, from the same pass: verl's model_output key
TOPK_METRICS = "emapg_topk_metrics"  # the hook's ``topk/*`` metrics of its micro-batch, for the final loss


def emapg_actor_loss(
    *, config, model_output=None, data=None, dp_group=None, student_logits=None, data_format="thd", kl, loss
):
    """verl loss function (bind ``config``, ``kl``, ``loss`` with functools.partial; module-level, picklable)."""
    if student_logits is not None:
        return topk_kl_packed(student_logits, data, kl)
    return final_loss(config, model_output, data, kl, loss)


def _iw(kl: KLConfig) -> ImportanceWeight:
    return ImportanceWeight(kl.use_iw, kl.iw_clip_low, kl.iw_clip_high)


def topk_kl_packed(student_logits: torch.Tensor, data, kl: KLConfig) -> dict[str, torch.Tensor]:
    """{KL_KEY: (1, nnz) per-token Top-k KL at the positions predicting response tokens (0 elsewhere),
    LOGP_KEY: (1, nnz) verl's log-probs of the sampled tokens (``logprobs_from_logits``, with its gradient)};
    the micro-batch's ``topk/*`` metrics go into `data` under ``TOPK_METRICS`` (``_topk_metrics``)."""
    if student_logits.ndim != 3 or student_logits.shape[0] != 1:
        raise ValueError(f"expected (1, nnz, V) training logits; got {tuple(student_logits.shape)}")
    lay = Layout.of(data)  # the positions, once for every field below
    keys = head_keys(kl)
    ids = data[keys["ids"]].values().long()  # (nnz, K)
    tokens = torch.roll(data["input_ids"].values(), shifts=-1, dims=0)  # (nnz,) token predicted at each position
    st = token_stats_from_logits(student_logits, tokens[None], indices=ids[None])  # (1, nnz[, K])
    verl_logp = logprobs_from_logits(student_logits[0], tokens, inplace_backward=False)  # (nnz,) verl's log_probs
    logp = lay.response(_as_verl_logp(st.logp[0], verl_logp))  # (B, T)
    B, T = logp.shape
    resp = lambda key: padded_response(data[key], B, T).to(logp.dtype)  # noqa: E731
    ref_logits_k, ref_lse = anchor_head(data, lay, kl, logp.dtype)  # (B, T, K), (B, T)
    x = KLInputs(
        logp=logp,
        ref_logp=resp("ref_log_prob"),
        old_logp=resp("old_log_probs"),
        sampled=lay.response(tokens),
        topk_idx=lay.response(ids),
        logits_k=lay.response(st.logits_k[0]),
        lse=lay.response(st.lse[0]),
        ref_logits_k=ref_logits_k,
        ref_lse=ref_lse,
    )
    per_token = kl_per_token(kl.type, x, tail=kl.tail, iw=_iw(kl))  # (B, T)
    mask = padded_response(data["response_mask"], B, T).to(torch.bool)  # (B, T), the final loss's
    tu.assign_non_tensor(data, **{TOPK_METRICS: _topk_metrics(x, per_token, lay, mask, kl)})
    return {KL_KEY: lay.packed(per_token)[None], LOGP_KEY: verl_logp[None]}


def anchor_head(data, lay: Layout, kl: KLConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(ref_logits_k (B, T, K), ref_lse (B, T)) of ``KLInputs`` from the anchor pass's log-probs at the head.

    The estimators read the two only as ``ref_logits_k - ref_lse``, so the pass sends that difference (fp32) and
    it enters with logsumexp 0: in fp32 ``v - 0`` is ``v``, bit for bit what the estimators took before."""
    ref_logp_k = lay.response(data[head_keys(kl)["ref_logp_k"]].values()).to(dtype)  # (B, T, K)
    return ref_logp_k, ref_logp_k.new_zeros(ref_logp_k.shape[:-1])


def _as_verl_logp(logp: torch.Tensor, verl_logp: torch.Tensor) -> torch.Tensor:
    """(nnz,) ``logp`` with the value `verl_logp` (verl's ``logprobs_from_logits``), the gradient of ``logp``.

    The tail and the importance weight compare it with ``ref_log_prob`` and ``old_log_probs``, which verl
    computes with that function. On bf16 logits verl's may round to bf16 while ours accumulates in fp32: up to
    ~3e-2 apart per token, a Top-k KL of ~1e-3 between identical policy and anchor. With verl's value the three
    are one function of the logits."""
    return verl_logp.detach().to(logp.dtype) + (logp - logp.detach())  # value: verl's exactly; gradient: d logp


def _topk_metrics(x: KLInputs, per_token: torch.Tensor, lay: Layout, mask: torch.Tensor, kl: KLConfig) -> dict:
    """The ``topk/*`` metrics of one micro-batch (``telemetry.topk_summary``); per_token, mask: (B, T). Every part
    is zeroed past each response's end; the figures equal the local backend's (tests/verl/test_loss.py)."""
    parts = topk_parts(x, kl.type, tail=kl.tail, iw=_iw(kl))  # (B, T) each, no gradient
    parts["estimate"] = per_token.detach()
    keep = lambda t: torch.where(lay.valid.to(t.device), t, t.new_zeros(()))  # noqa: E731
    return topk_summary({k: keep(v) for k, v in parts.items()}, mask, get_estimator(kl.type).direction)


def final_loss(config, model_output, data, kl: KLConfig, loss: LossConfig):
    """(scalar loss, metrics) for one micro-batch; see the module docstring."""
    lay = Layout.of(data)  # the positions, once for every field below
    logp = lay.response(model_output["log_probs"])  # (B, T)
    B, T = logp.shape
    resp = lambda key: padded_response(data[key], B, T)  # noqa: E731
    mask = resp("response_mask").to(torch.bool)
    old, adv = resp("old_log_probs").to(logp.dtype), resp("advantages").to(logp.dtype)

    gbi = config.global_batch_info
    gbi.update(
        dp_size=data["dp_size"],
        batch_num_tokens=data["batch_num_tokens"],
        global_batch_size=data["global_batch_size"],
        loss_scale_factor=config.loss_scale_factor,
    )
    mode = VERL_AGG[loss.agg]
    agg = lambda x: agg_loss(loss_mat=x, loss_mask=mask, loss_agg_mode=mode, **gbi)  # noqa: E731
    summed = data["dp_size"] > 1 or data["batch_num_tokens"] is not None or data["global_batch_size"] is not None
    how = AggregationType.SUM if summed else AggregationType.MEAN

    pg_tok, ind = ppo_clip_per_token(logp, old, adv, loss)
    if "rollout_is_weights" in data.keys():
        pg_tok = pg_tok * resp("rollout_is_weights").to(pg_tok.dtype)
    pg = agg(pg_tok)
    total = pg
    m = lambda x: (x * mask).sum() / mask.sum().clamp_min(1)  # noqa: E731  token-mean statistics
    metrics = {
        "pg_loss": Metric(value=pg, aggregation=how),
        "pg_clipfrac": m(ind["clip"]).item(),
        "pg_clipfrac_lower": m(ind["dual_clip"]).item(),
        "ppo_kl": m(ind["neg_log_ratio"]).item(),
    }
    if kl.coef > 0:
        est = get_estimator(kl.type)
        if est.needs == "topk":
            kl_tok = lay.response(model_output[KL_KEY]).to(logp.dtype)
            metrics["emapg/topk_k"] = float(data[head_keys(kl)["ids"]].values().shape[-1])  # the head the KL used
            topk = tu.get_non_tensor_data(data, TOPK_METRICS, None)  # left by the hook, topk_kl_packed
            if topk is None:
                raise RuntimeError(f"no {TOPK_METRICS} in the micro-batch: verl did not call the Top-k KL hook")
            metrics.update(topk)
        elif est.needs == "sampled":
            x = KLInputs(logp=logp, ref_logp=resp("ref_log_prob").to(logp.dtype), old_logp=old)
            kl_tok = kl_per_token(kl.type, x, tail=kl.tail, iw=_iw(kl))
        else:
            raise ValueError(
                f"KL estimator {kl.type!r} needs full-vocabulary logits; not supported by the verl backend"
            )
        kl_value = agg(kl_tok)
        total = total + kl.coef * kl_value
        metrics.update({"kl_loss": Metric(value=kl_value, aggregation=how), "kl_coef": kl.coef})
    if "entropy" in model_output:
        ent = agg(lay.response(model_output["entropy"]))
        metrics["entropy_loss"] = Metric(value=ent, aggregation=how)
        if loss.entropy_coef:
            total = total - loss.entropy_coef * ent
    return total, metrics
