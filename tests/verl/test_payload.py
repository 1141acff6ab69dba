"""The Top-k payload: what the pi_old and anchor passes add to the batch (it travels to the actor update
through verl's TransferQueue), measured on the real FSDP2 engines, and the loss it gives.

Bytes per token: the ``nbytes`` of every tensor a pass returns beyond plain verl's (mode "off"), summed
and divided by the batch's packed tokens (nnz, prompt + response). The fields are nested (nnz, *) tensors;
their jagged offsets ((B + 1) int64 per field) are per sequence, not per token, and not counted. At K:

    passes as ``topk_passes`` sets them       pi_old pass       anchor pass          total
    reverse Top-k                            ids 4K            log-probs 4K         8K      (256 B at K = 32)
    forward Top-k                            -                 ids 4K + log-probs 4K  8K    (256 B)
    before (pi_old "self", no ``logp``)
    reverse Top-k                            ids 4K + logits 4K + lse 4   logits 4K + lse 4   12K + 8 (392 B)
    forward Top-k                            -                 ids 4K + logits 4K + lse 4     8K + 4  (260 B)

The loss does not change: with the earlier passes and the earlier reader of the anchor's values (its logits
and logsumexp, as two fields), verl's loss value, gradients and ``topk/*`` metrics are bit for bit today's.
"""

from functools import partial

import engines
import pytest
import torch

pytestmark = pytest.mark.verl

K = 32  # the paper's k; the tiny model's vocabulary has 100 ids
OLD, REF = "emapg_old_", "emapg_ref_"
NOW = {  # bytes per token each pass adds, the formula above
    "topk_reverse": {"old": 4 * K, "ref": 4 * K},
    "topk_forward": {"old": 0, "ref": 4 * K + 4 * K},
}
BEFORE_PASSES = {  # the pass flags before pi_old's "ids" mode and the ``logp`` flag
    "topk_reverse": {
        "old": {"mode": "self", "k": K, "prefix": OLD},
        "ref": {"mode": "gather", "ids_key": f"{OLD}topk_ids", "prefix": REF},
    },
    "topk_forward": {"old": {"mode": "off"}, "ref": {"mode": "self", "k": K, "prefix": REF}},
}
BEFORE = {
    "topk_reverse": {"old": 4 * K + 4 * K + 4, "ref": 4 * K + 4},
    "topk_forward": {"old": 0, "ref": 4 * K + 4 * K + 4},
}


@pytest.fixture(scope="module")
def pair(tiny_path):
    return engines.actor_and_anchor(tiny_path)


@pytest.mark.parametrize("kl_type", ["topk_reverse", "topk_forward"])
def test_payload_bytes_per_token(pair, kl_type):
    from ema_pg_core.config import KLConfig
    from experiments.backends.verl.config import topk_passes

    actor, ref = pair
    now, _ = engines.pass_fields(actor, ref, topk_passes(KLConfig(type=kl_type, k=K)))
    before, _ = engines.pass_fields(actor, ref, {**BEFORE_PASSES[kl_type], "train": {"mode": "train"}})
    print(f"{kl_type} K={K}: bytes per token before {before} = {sum(before.values())}, now {now} = {sum(now.values())}")
    assert before == BEFORE[kl_type]
    assert now == NOW[kl_type] and sum(now.values()) == 8 * K


def _old_anchor_head(data, lay, kl, dtype):
    """The loss's reader of the anchor's values before ``anchor_head``: its logits at the head and logsumexp."""
    read = lambda key: lay.response(data[key].values()).to(dtype)  # noqa: E731
    return read(f"{REF}logits_k"), read(f"{REF}lse")


class _VerlLayout:
    """The loss's layout before ``Layout``: verl's ``no_padding_2_padding`` for every field, which derives the
    positions again on each call (the packed direction, which the loss uses for its outputs, is ``Layout``'s)."""

    def __init__(self, data):
        from verl.workers.utils.padding import no_padding_2_padding

        from experiments.backends.verl.layout import Layout

        self.data, self.packed, self.to_response = data, Layout.of(data).packed, no_padding_2_padding
        self.valid = no_padding_2_padding(torch.ones(data["input_ids"].values().shape[0], dtype=torch.bool), data)

    of = classmethod(lambda cls, data: cls(data))

    def response(self, packed):
        return self.to_response(packed, self.data)


def _loss(actor, fields, kl_cfg, T=0.8):
    """(loss value, metrics, {parameter: gradient}) of verl's loss pass over the test batch with these fields."""
    from verl.workers.config import FSDPActorConfig

    from ema_pg_core.config import LossConfig
    from experiments.backends.verl.engine import set_pass
    from experiments.backends.verl.loss import emapg_actor_loss

    cfg = FSDPActorConfig(
        strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, use_dynamic_bsz=False, rollout_n=1
    )
    loss_fn = partial(emapg_actor_loss, config=cfg, kl=kl_cfg, loss=LossConfig(agg="token-mean"))
    actor.set_loss_fn(loss_fn)

    def batch():
        td, _ = engines.batch(temperature=T)
        td.update(fields)
        set_pass(td, "train")
        return td

    metrics, grads = engines.loss_pass(actor, batch, loss_fn)
    return metrics["loss"], metrics, grads


@pytest.mark.parametrize("kl_type,tail,use_iw", [("topk_reverse", "unbiased", True), ("topk_forward", "paper", True)])
def test_loss_is_unchanged_by_the_smaller_payload(pair, monkeypatch, kl_type, tail, use_iw):
    from ema_pg_core.config import KLConfig
    from experiments.backends.verl import loss
    from experiments.backends.verl.config import topk_passes

    actor, ref = pair
    kl_cfg = KLConfig(type=kl_type, k=K, tail=tail, coef=0.5, use_iw=use_iw)
    _, fields = engines.pass_fields(actor, ref, topk_passes(kl_cfg))
    value, metrics, grads = _loss(actor, fields, kl_cfg)

    _, before_fields = engines.pass_fields(actor, ref, {**BEFORE_PASSES[kl_type], "train": {"mode": "train"}})
    with monkeypatch.context() as m:
        m.setattr(loss, "anchor_head", _old_anchor_head)
        before_value, before_metrics, before_grads = _loss(actor, before_fields, kl_cfg)

    assert value == before_value
    assert metrics.keys() == before_metrics.keys()
    compared = [k for k in metrics if k.startswith(("topk/", "kl_loss", "pg_", "ppo_kl"))]
    wanted = {"kl_loss", "topk/head_mass", "topk/tail_share"} | (
        {"topk/anchor_head_mass"} if "forward" in kl_type else set()
    )
    assert wanted <= set(compared), compared  # the forward KL's telemetry reads the anchor's values too
    assert {k: _plain(metrics[k]) for k in compared} == {k: _plain(before_metrics[k]) for k in compared}
    assert abs(_plain(metrics["kl_loss"])[0]) > 1e-3  # a Top-k KL that depends on the anchor's values
    assert grads.keys() == before_grads.keys() and grads
    for n, g in grads.items():
        assert torch.equal(g, before_grads[n]), n


def _plain(v):
    """A verl metric (Metric, nested lists of them or of numbers) as a flat list of numbers."""
    from verl.utils.metric import Metric

    if isinstance(v, Metric):
        return [float(x) for x in v.values]
    if isinstance(v, list):
        return [x for e in v for x in _plain(e)]
    return [float(v)]


@pytest.mark.parametrize("kl_type,tail,use_iw", [("topk_reverse", "paper", True), ("topk_forward", "unbiased", False)])
def test_one_log_prob_pass_gives_the_loss_of_two(pair, monkeypatch, kl_type, tail, use_iw):
    """The hook's ``log_probs`` (verl's function, once per micro-batch) against verl computing them again after
    the hook (``distillation_only`` off, the code before): the same loss, metrics and gradients, bit for bit;
    and one full-vocabulary log-prob computation per micro-batch instead of two."""
    from verl.utils import torch_functional as verl_F
    from verl.workers.engine.fsdp import transformer_impl

    from ema_pg_core.config import KLConfig
    from experiments.backends.verl import engine, loss
    from experiments.backends.verl.config import topk_passes

    actor, ref = pair
    kl_cfg = KLConfig(type=kl_type, k=K, tail=tail, coef=0.5, use_iw=use_iw)
    _, fields = engines.pass_fields(actor, ref, topk_passes(kl_cfg))
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return verl_F.logprobs_from_logits(*args, **kwargs)

    for module in (transformer_impl, loss):
        monkeypatch.setattr(module, "logprobs_from_logits", counted)
    value, metrics, grads = _loss(actor, fields, kl_cfg)
    once = len(calls)
    with monkeypatch.context() as m:
        m.setattr(engine, "TRAIN_FLAGS", {"distillation_use_topk": True})  # verl computes its log_probs itself
        calls.clear()
        before_value, before_metrics, before_grads = _loss(actor, fields, kl_cfg)
    assert (once, len(calls)) == (2, 4)  # two micro-batch passes in _loss (the value, then the gradients)

    assert value == before_value
    assert metrics.keys() == before_metrics.keys()
    compared = [k for k in metrics if not k.startswith("perf/")]  # perf/: memory in use, time
    assert {k: _plain(metrics[k]) for k in compared} == {k: _plain(before_metrics[k]) for k in compared}
    assert abs(_plain(metrics["kl_loss"])[0]) > 1e-3 and abs(_plain(metrics["pg_loss"])[0]) > 0
    assert grads.keys() == before_grads.keys() and grads
    for n, g in grads.items():
        assert torch.equal(g, before_grads[n]), n


@pytest.mark.parametrize("kl_type", ["topk_reverse", "topk_forward"])
def test_loss_is_unchanged_by_the_layout_computed_once(pair, monkeypatch, kl_type):
    """The loss moves its fields between verl's packed layout and the response layout with one ``Layout`` per
    micro-batch; with verl's ``no_padding_2_padding`` on every field (the loss before) its value, its ``topk/*``
    metrics and every gradient are the same bit for bit."""
    from ema_pg_core.config import KLConfig
    from experiments.backends.verl import loss
    from experiments.backends.verl.config import topk_passes

    actor, ref = pair
    kl_cfg = KLConfig(type=kl_type, k=K, tail="unbiased", coef=0.5, use_iw=True)
    _, fields = engines.pass_fields(actor, ref, topk_passes(kl_cfg))
    value, metrics, grads = _loss(actor, fields, kl_cfg)
    with monkeypatch.context() as m:
        m.setattr(loss, "Layout", _VerlLayout)
        before_value, before_metrics, before_grads = _loss(actor, fields, kl_cfg)
    assert value == before_value and abs(_plain(metrics["kl_loss"])[0]) > 1e-3
    assert metrics.keys() == before_metrics.keys()
    compared = [k for k in metrics if not k.startswith("perf/")]  # perf/: the process's memory, its clock
    assert {"kl_loss", "topk/head_mass", "topk/tail_frac", "topk/tail_share", "pg_loss"} <= set(compared), compared
    assert {k: _plain(metrics[k]) for k in compared} == {k: _plain(before_metrics[k]) for k in compared}
    assert grads.keys() == before_grads.keys() and grads
    for n, g in grads.items():
        assert torch.equal(g, before_grads[n]), n
