"""The loss through verl's entry (engine forward_step -> logits-processor hook -> final loss) equals
``ema_pg_core.loss.policy_loss`` on the same tensors, in value and in parameter gradients.

The verl side runs the real FSDP2 engine: the pi_old and anchor passes produce the Top-k fields
(our engine class), then the actor's loss pass with our loss function. The reference side is a
plain HF forward of the same weights with ``ema_pg_core.topk`` statistics and ``policy_loss``.
On one rank, with one micro-batch (verl's global-batch normalisation is then the local mean) and
with verl's dynamic micro-batches (the per-micro-batch losses must add up to the mini-batch's).
"""

from functools import partial

import engines
import pytest
import torch

pytestmark = pytest.mark.verl

CASES = [  # (kl type, tail, use_iw, agg)
    ("topk_reverse", "unbiased", True, "token-mean"),
    ("topk_reverse", "paper", False, "seq-mean-token-mean"),
    ("topk_forward", "paper", True, "token-mean"),
    ("k3", "unbiased", False, "seq-mean-token-mean"),
    ("k4", "unbiased", True, "token-mean"),
]


def _pair(tiny_path, dynamic_tokens=None):
    from experiments.backends.verl.engine import reclass

    micro = 1 if dynamic_tokens else 4
    actor = engines.training_worker(tiny_path, forward_only=False, micro=micro, dynamic_tokens=dynamic_tokens)
    ref = engines.training_worker(tiny_path, forward_only=True, micro=micro, dynamic_tokens=dynamic_tokens)
    with torch.no_grad():
        for p in ref.engine.module.parameters():
            p.to_local().add_(0.05 * torch.randn_like(p.to_local()))
    reclass(actor.engine)
    reclass(ref.engine)
    return actor, ref


@pytest.fixture(scope="module")
def engines_pair(tiny_path):
    return _pair(tiny_path)


@pytest.fixture(scope="module")
def engines_dynamic(tiny_path):
    """Dynamic micro-batches of <= 16 tokens: the batch is split and re-ordered by verl."""
    return _pair(tiny_path, dynamic_tokens=16)


def _plain(tiny_path, worker):
    m = engines.plain_model(tiny_path)
    full = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
        for n, p in worker.engine.module.state_dict().items()
    }
    m.load_state_dict(full, strict=False)
    return m


def _train_batch(actor, ref, kl_cfg, T, drop=()):
    """The update-pass TensorDict with the Top-k fields produced by the engines' own passes."""
    from experiments.backends.verl.config import topk_passes
    from experiments.backends.verl.engine import set_pass

    passes = topk_passes(kl_cfg)
    fields = {}
    for who, worker in (("old", actor), ("ref", ref)):
        if passes[who]["mode"] == "off":
            continue
        td, _ = engines.batch(temperature=T)
        td.update(fields)
        set_pass(td, **passes[who])
        out = worker.infer_batch(td)
        fields.update({k: out[k] for k in out.keys() if k.startswith("emapg_")})
    td, padded = engines.batch(temperature=T, drop=drop)
    td.update(fields)
    set_pass(td, **passes["train"])
    return td, padded, fields


@pytest.mark.parametrize("kl_type,tail,use_iw,agg", CASES)
def test_loss_through_verl_equals_core(engines_pair, tiny_path, kl_type, tail, use_iw, agg):
    _check(engines_pair, tiny_path, kl_type, tail, use_iw, agg, dynamic=False)


@pytest.mark.parametrize("kl_type,tail,use_iw,agg", [CASES[0], CASES[3]])
def test_micro_batched_loss_equals_core(engines_dynamic, tiny_path, kl_type, tail, use_iw, agg):
    """Several micro-batches: verl's global-batch normalisation adds up to the mini-batch loss and gradient."""
    _check(engines_dynamic, tiny_path, kl_type, tail, use_iw, agg, dynamic=True)


@pytest.mark.parametrize("kl_type,tail,use_iw,agg", [CASES[1], CASES[0]])
def test_masked_out_response_is_dropped_from_the_loss(engines_pair, tiny_path, kl_type, tail, use_iw, agg):
    """mask_truncated: a response with an all-zero mask (trainer.drop_truncated) and the engine's DROP_KEY
    give the loss and gradients of the core over the other three (its seq-mean skips empty rows)."""
    _check(engines_pair, tiny_path, kl_type, tail, use_iw, agg, dynamic=False, drop=(1,))


def test_without_drop_key_verl_counts_the_masked_response(engines_pair, tiny_path):
    """The control: verl alone divides seq-mean-token-mean by the mini-batch size (4), not by the 3 kept."""
    with pytest.raises(AssertionError):
        _check(engines_pair, tiny_path, *CASES[1], dynamic=False, drop=(1,), drop_key=False)


@pytest.mark.parametrize(
    "kl_type,tail,use_iw,agg,jagged",
    [(*CASES[1], False), (*CASES[0], False), (*CASES[3], True), (*CASES[4], True)],
)
def test_truncation_cap_masks_the_capped_response_in_the_engine(engines_pair, kl_type, tail, use_iw, agg, jagged):
    """mask_truncated without TransferQueue writes: the full masks, as TransferQueue holds them (``response_mask``
    and ``loss_mask``, dense or jagged), with the engine's CAP_KEY give verl's loss value and gradients of the
    batch whose capped response (row 0, 7 tokens) had its masks zeroed beforehand, bit for bit."""
    from experiments.backends.verl.engine import CAP_KEY, DROP_KEY

    actor, ref = engines_pair
    capped = _verl_value_and_grads(actor, ref, kl_type, tail, use_iw, agg, jagged, {CAP_KEY: 7, DROP_KEY: True})
    zeroed = _verl_value_and_grads(actor, ref, kl_type, tail, use_iw, agg, jagged, {DROP_KEY: True}, drop=(0,))
    kept = _verl_value_and_grads(actor, ref, kl_type, tail, use_iw, agg, jagged, {CAP_KEY: 8, DROP_KEY: True})
    full = _verl_value_and_grads(actor, ref, kl_type, tail, use_iw, agg, jagged, {})
    assert capped[0] == zeroed[0] and kept[0] == full[0] and capped[0] != full[0]
    assert capped[1].keys() == zeroed[1].keys() and capped[1]
    for n, g in capped[1].items():
        assert torch.equal(g, zeroed[1][n]), n
        assert torch.equal(kept[1][n], full[1][n]), n


def _verl_value_and_grads(actor, ref, kl_type, tail, use_iw, agg, jagged, flags, drop=()):
    """(loss value, {parameter: gradient}) of verl's loss pass over the test batch with these non-tensor flags;
    ``jagged``: response_mask and loss_mask as TransferQueue hands them to the worker, jagged (B, *)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig

    from ema_pg_core.config import KLConfig, LossConfig
    from experiments.backends.verl.loss import emapg_actor_loss

    kl_cfg = KLConfig(type=kl_type, k=4, tail=tail, coef=0.5, use_iw=use_iw)
    cfg = FSDPActorConfig(
        strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, use_dynamic_bsz=False, rollout_n=1
    )
    loss_fn = partial(emapg_actor_loss, config=cfg, kl=kl_cfg, loss=LossConfig(agg=agg, dual_clip_c=3.0))
    actor.set_loss_fn(loss_fn)

    def batch():
        td = _train_batch(actor, ref, kl_cfg, 0.8, drop)[0]
        if jagged:
            lens = td["attention_mask"][:, engines.P :].sum(1)  # (B,) response tokens
            rows = torch.cat([row[:n] for row, n in zip(td["response_mask"], lens.tolist(), strict=True)])
            offsets = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
            td["response_mask"] = torch.nested.nested_tensor_from_jagged(rows, offsets=offsets)
            td["loss_mask"] = torch.nested.nested_tensor_from_jagged(rows.clone(), offsets=offsets)
        tu.assign_non_tensor(td, **flags)
        return td

    metrics, grads = engines.loss_pass(actor, batch, loss_fn)
    return metrics["loss"], grads


def _check(pair, tiny_path, kl_type, tail, use_iw, agg, dynamic, drop=(), drop_key=True):
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig

    from ema_pg_core.config import KLConfig, LossConfig
    from ema_pg_core.kl import KLInputs, get_estimator
    from ema_pg_core.loss import policy_loss
    from ema_pg_core.topk import kl_inputs, token_stats_from_logits
    from experiments.backends.verl.engine import DROP_KEY
    from experiments.backends.verl.loss import emapg_actor_loss

    actor, ref = pair
    T = 0.8
    kl_cfg = KLConfig(type=kl_type, k=4, tail=tail, coef=0.5, use_iw=use_iw)
    loss_cfg = LossConfig(agg=agg, dual_clip_c=3.0)
    cfg = FSDPActorConfig(
        strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, use_dynamic_bsz=False, rollout_n=1
    )
    loss_fn = partial(emapg_actor_loss, config=cfg, kl=kl_cfg, loss=loss_cfg)
    actor.set_loss_fn(loss_fn)

    # verl: value through infer_batch(compute_loss=True), gradients through forward_backward_batch
    td, padded, fields = _train_batch(actor, ref, kl_cfg, T, drop)
    tu.assign_non_tensor(td, compute_loss=True, **{DROP_KEY: bool(drop) and drop_key})
    verl_metrics = actor.infer_batch(td)["metrics"]
    verl_loss = verl_metrics["loss"]
    td, _, _ = _train_batch(actor, ref, kl_cfg, T, drop)
    tu.assign_non_tensor(td, **{DROP_KEY: bool(drop) and drop_key})
    engines.train_flags(td, dynamic)  # what TrainingWorker.train_batch injects
    actor.engine.optimizer_zero_grad()
    with actor.engine.train_mode():
        actor.engine.forward_backward_batch(td, loss_function=loss_fn, forward_only=False)
        verl_grads = {n: p.grad.full_tensor() for n, p in actor.engine.module.named_parameters() if p.grad is not None}

    # the core, on a plain forward of the same weights
    policy, anchor = _plain(tiny_path, actor), _plain(tiny_path, ref)
    mask = padded["response_mask"]
    z = engines.naive_logits(policy, padded, T)
    with torch.no_grad():
        zr = engines.naive_logits(anchor, padded, T)
    sampled = padded["responses"]
    old, ref_lp, adv = padded["old_log_probs"], padded["ref_log_prob"], padded["advantages"]
    if get_estimator(kl_type).needs == "topk":
        from verl.workers.utils.padding import no_padding_2_padding

        head = "emapg_old_topk_ids" if get_estimator(kl_type).direction == "reverse" else "emapg_ref_topk_ids"
        ids = no_padding_2_padding(fields[head], td).long()
        pol = token_stats_from_logits(z, sampled, indices=ids)
        anc = token_stats_from_logits(zr, sampled, indices=ids)
        x = kl_inputs(pol, anc, sampled, old_logp=old)
        x.ref_logp = ref_lp  # the loss uses the reference log-prob verl computed (here: the batch's)
        logp = pol.logp
    else:
        logp = torch.log_softmax(z, -1).gather(-1, sampled[..., None])[..., 0]
        x = KLInputs(logp=logp, ref_logp=ref_lp, old_logp=old)
    core_loss, core_stats = policy_loss(logp, old, adv, mask, x, loss_cfg=loss_cfg, kl_cfg=kl_cfg)
    core_loss.backward()
    core_grads = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}

    assert verl_loss == pytest.approx(core_loss.item(), rel=1e-4, abs=1e-6)
    _check_topk_metrics(verl_metrics, core_stats, single=not dynamic and not drop)
    assert core_grads.keys() == verl_grads.keys()
    for n in core_grads:
        torch.testing.assert_close(verl_grads[n], core_grads[n], atol=2e-5, rtol=1e-3, msg=n)


def _check_topk_metrics(verl_metrics, core_stats, single: bool):
    """The topk/* telemetry: the same keys as the local backend's ``policy_loss``; with one micro-batch, the
    same values (several micro-batches average per micro-batch, as verl does for every metric)."""
    verl_topk = {k: v for k, v in verl_metrics.items() if k.startswith("topk/")}
    core_topk = {k: v for k, v in core_stats.items() if k.startswith("topk/")}
    assert verl_topk.keys() == core_topk.keys()
    for k, v in core_topk.items():
        got = verl_topk[k]
        while single and isinstance(got, list):  # verl keeps per-micro-batch lists: [[value]] for one micro-batch
            assert len(got) == 1, k
            got = got[0]
        if single:
            assert got == pytest.approx(v, rel=1e-4, abs=1e-5), k
