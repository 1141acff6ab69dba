"""Top-k statistics inside verl's FSDP engine, from the logits that exist only there.

Shapes: nnz = packed tokens of a micro-batch (verl's remove-padding layout), V vocabulary, K top-k.

``EmaPGFSDPEngineWithLMHead`` wraps ``prepare_model_outputs``, the one place verl 0.9.1 materialises
logits; the trainer switches it per pass with non-tensor flags on the batch (``set_pass``):

    "ids"     pi_old pass, reverse KL: own top-k ids     -> <prefix>topk_ids (nnz, K) int32
    "self"    anchor pass, forward KL: own top-k ids + log-probs there (or logits + logsumexp)
    "gather"  anchor pass, reverse KL: log-probs at the ids under ``ids_key`` (or logits + logsumexp)
    "train"   actor update: verl's logits-processor hook runs the loss's Top-k KL and returns verl's
              log-probs too (``distillation_only``: one full-vocabulary log-softmax, not two)
    "keep"    the KL probe: append each micro-batch's (nnz, V) logits / temperature to ``probe_logits``

With ``logp`` the pass sends ``<prefix>logp_k`` (nnz, K) fp32 = logits_k - lse taken in fp32, else
``<prefix>logits_k`` (nnz, K) and ``<prefix>lse`` (nnz,). Nothing of size V leaves the worker: 8K bytes
per token for either direction (tests/verl/test_payload.py).

``CAP_KEY`` (emapg.mask_truncated) zeroes the masks of training responses of at least that many tokens
here, in the worker, before verl counts the loss tokens; ``DROP_KEY`` makes ``global_batch_size`` (verl's
seq-mean denominator) the kept sequences over the data-parallel group, so a masked response is dropped
from the seq-mean modes exactly as from token-mean.

The worker re-classes the engines verl built (``reclass``) instead of replacing verl's private registry.
"""

from __future__ import annotations

import torch
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from ema_pg_core.topk import token_stats_from_logits, topk_ids_from_logits
from experiments.backends.verl.layout import lengths, token_rows

MODE, K, IDS_KEY, PREFIX = "emapg_topk_mode", "emapg_topk_k", "emapg_topk_ids_key", "emapg_topk_prefix"
LOGP = "emapg_topk_logp"
MODES = ("off", "ids", "self", "gather", "train", "keep")
DROP_KEY = "emapg_drop_masked_seqs"  # flag: sequences with an all-zero loss mask leave the seq-mean denominator too
CAP_KEY = "emapg_truncation_cap"  # int flag (0: off): responses of at least this many tokens leave the update
TRAIN_FLAGS = {"distillation_use_topk": True, "distillation_only": True}  # mode "train": the hook gives log_probs


def set_pass(td, mode: str = "off", *, k: int = 0, ids_key: str = "", prefix: str = "", logp: bool = False) -> None:
    """Attach this pass's Top-k instructions to a TensorDict (or dict of extra_info) as non-tensors."""
    if mode not in MODES:
        raise ValueError(f"top-k pass mode {mode!r} unknown; allowed: {MODES}")
    flags = {MODE: mode, K: int(k), IDS_KEY: ids_key, PREFIX: prefix, LOGP: bool(logp)}
    if isinstance(td, dict):
        td.update(flags)
    else:
        tu.assign_non_tensor(td, **flags)


def _flag(td, key, default):
    return tu.get_non_tensor_data(data=td, key=key, default=default)


def drop_truncated(mask: torch.Tensor, response_lens: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask with the rows of responses that reached `cap` tokens zeroed, which rows), as rLLM's
    mask_truncated_samples drops them. mask: jagged nested (B, *) or dense (B, T); response_lens: (B,)."""
    truncated = response_lens.to(mask.device) >= cap  # (B,)
    keep = (~truncated).to(mask.dtype)  # (B,)
    if not mask.is_nested:
        return mask * keep[:, None], truncated
    values = mask.values() * keep[token_rows(mask.offsets())]  # (nnz,)
    return torch.nested.nested_tensor_from_jagged(values, offsets=mask.offsets()), truncated


def mask_truncated_(data, cap: int) -> None:
    """Zero the ``response_mask`` (the loss's) and ``loss_mask`` (verl's token count) rows of `data`'s responses
    of at least `cap` tokens (new tensors under the same keys)."""
    response_lens = lengths(data)[1]  # (B,)
    for key in ("response_mask", "loss_mask"):
        if key in data.keys():
            data[key] = drop_truncated(data[key], response_lens, cap)[0]


def kept_sequences(loss_mask: torch.Tensor) -> int:
    """Number of rows of `loss_mask` (jagged nested (B, *) or dense (B, S)) with any nonzero entry."""
    if not loss_mask.is_nested:
        return int((loss_mask.sum(-1) > 0).sum())
    offsets = loss_mask.offsets()  # (B + 1,)
    per_row = torch.zeros(len(offsets) - 1, device=offsets.device).index_add_(
        0, token_rows(offsets), loss_mask.values().float()
    )  # (B,)
    return int((per_row > 0).sum())


class EmaPGFSDPEngineWithLMHead(FSDPEngineWithLMHead):
    """``FSDPEngineWithLMHead`` + Top-k statistics on request (see the module docstring)."""

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        cap = int(_flag(data, CAP_KEY, 0))
        if cap > 0:
            mask_truncated_(data, cap)
        if _flag(data, DROP_KEY, False):
            kept = torch.tensor(kept_sequences(data["loss_mask"]), dtype=torch.int64, device=get_device_id())
            torch.distributed.all_reduce(kept, op=torch.distributed.ReduceOp.SUM, group=self.get_data_parallel_group())
            tu.assign_non_tensor(data, global_batch_size=max(int(kept.item()), 1))  # all dropped: the loss is 0 anyway
        return super().forward_backward_batch(data, loss_function, forward_only)

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        mode = _flag(micro_batch, MODE, "off")
        if mode == "train":
            tu.assign_non_tensor(micro_batch, **TRAIN_FLAGS)
        if mode == "keep":
            self.probe_logits.append(_packed_scaled_logits(output, output_args, micro_batch).detach())  # (nnz, V)
        extra = self._topk_outputs(output, output_args, micro_batch, mode) if mode in ("ids", "self", "gather") else {}
        model_output = super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
        model_output.update(extra)
        return model_output

    def _topk_outputs(self, output, output_args, micro_batch, mode) -> dict[str, torch.Tensor]:
        logits = _packed_scaled_logits(output, output_args, micro_batch)  # (nnz, V)
        prefix, cu = _flag(micro_batch, PREFIX, ""), micro_batch["input_ids"].offsets()
        nest = lambda v: torch.nested.nested_tensor_from_jagged(v, cu)  # noqa: E731
        if mode == "ids":  # the ids "self" would send, without its logsumexp
            ids = topk_ids_from_logits(logits[None], k=int(_flag(micro_batch, K, 0)))[0]  # (nnz, K)
            return {f"{prefix}topk_ids": nest(ids.to(torch.int32))}
        tokens = output_args["input_ids_rmpad_rolled"].reshape(-1)  # (nnz,) the token each position predicts
        if mode == "gather":
            ids = micro_batch[_flag(micro_batch, IDS_KEY, "")]
            ids = (ids.values() if ids.is_nested else ids).long()
            stats = token_stats_from_logits(logits[None], tokens[None], indices=ids[None].to(logits.device))
        else:
            stats = token_stats_from_logits(logits[None], tokens[None], k=int(_flag(micro_batch, K, 0)))
        logits_k, lse = stats.logits_k[0].float(), stats.lse[0].float()  # (nnz, K), (nnz,)
        if _flag(micro_batch, LOGP, False):  # the fp32 difference the estimators would take of the two
            out = {f"{prefix}logp_k": nest(logits_k - lse[:, None])}
        else:
            out = {f"{prefix}logits_k": nest(logits_k), f"{prefix}lse": nest(lse)}
        if mode == "self":
            out[f"{prefix}topk_ids"] = nest(stats.indices[0].to(torch.int32))
        return out


def _packed_scaled_logits(output, output_args, micro_batch) -> torch.Tensor:
    """(nnz, V) logits / temperature in verl's packed order, for either input layout."""
    if output_args.get("pad_size", 0):
        raise NotImplementedError("EMA-PG's logits (Top-k KL, KL probe) need Ulysses SP = 1 and pad_to_length=False")
    logits = output.logits
    if type(logits).__name__ == "DTensor":  # tensor parallel: vocab-sharded
        logits = logits.full_tensor()
    if "temperature_rmpad" in output_args:  # remove-padding path: (1, nnz, V)
        logits = logits.squeeze(0)
        if not output_args.get("temperature_is_one", False):
            logits = logits / output_args["temperature_rmpad"].unsqueeze(-1).to(logits.dtype)
        return logits
    # padded path: (B, S, V) -> valid positions of each sequence, concatenated
    temperature = output_args["temperature"]  # (B,)
    if not output_args.get("temperature_is_one", False):
        logits = logits / temperature[:, None, None].to(logits.dtype)
    lens = micro_batch["input_ids"].offsets().diff().tolist()
    return torch.cat([logits[i, :n] for i, n in enumerate(lens)])


def reclass(engine) -> None:
    """Turn verl's FSDPEngineWithLMHead instance into ours (no state changes; type-checked)."""
    if type(engine) is EmaPGFSDPEngineWithLMHead:
        return
    if type(engine) is not FSDPEngineWithLMHead:
        raise TypeError(
            f"EMA-PG's Top-k KL needs verl's FSDPEngineWithLMHead (strategy fsdp2); got {type(engine).__name__}"
        )
    engine.__class__ = EmaPGFSDPEngineWithLMHead
    engine.probe_logits = []  # filled in pass mode "keep" (the KL probe), emptied by its reader
