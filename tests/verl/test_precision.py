"""Step 1 under verl's default mixed precision: with the anchor holding the actor's weights, every KL
estimator reads 0 on every token through the real passes.

The engines are built as a run builds them: the actor trainable with verl's defaults, the reference
forward-only with model_dtype fp32 (the plugin's setting); neither is given a mixed_precision, so
both compute in bf16 under autocast. The pi_old pass and the anchor pass carry the Top-k flags,
their log-probs become ``old_log_probs`` / ``ref_log_prob`` as the trainer stores them, and the
update pass (train mode, forward + backward) computes the Top-k KL in the logits-processor hook.

Regression: the hook's log-prob of the sampled token was accumulated in fp32 while verl's own
log-probs (the anchor's and pi_old's) come out of a bf16 log_softmax here, so the Top-k tail and the
importance weight saw up to ~3e-2 of rounding per token; k3, which reads verl's log-probs only, was 0.
"""

from functools import partial

import engines
import pytest
import torch

pytestmark = pytest.mark.verl
T = 0.7  # a non-unit rollout temperature: the scaled-logits path of every pass
CASES = [  # (kl type, tail, use_iw, temperature)
    ("k3", "unbiased", False, T),
    ("k3", "unbiased", True, T),
    *[
        (kl, tail, iw, T)
        for kl in ("topk_reverse", "topk_forward")
        for tail in ("paper", "unbiased")
        for iw in (False, True)
    ],
    ("topk_reverse", "unbiased", True, 1.0),
    ("topk_forward", "paper", True, 1.0),  # verl's unit-temperature path
]


def _full(module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in module.state_dict().items()}


@pytest.fixture(scope="module")
def step_one(tiny_path):
    """(actor, reference) with verl's default mixed precision and the same weights."""
    from experiments.backends.verl.engine import reclass

    actor = engines.training_worker(tiny_path, forward_only=False, verl_precision=True)
    ref = engines.training_worker(tiny_path, forward_only=True, verl_precision=True)
    reclass(actor.engine)
    reclass(ref.engine)
    return actor, ref


def test_step_one_setup(step_one):
    """The precondition of the regression: bf16 compute on both sides, identical weights."""
    actor, ref = step_one
    assert actor.engine._autocast_dtype == ref.engine._autocast_dtype == torch.bfloat16
    a, r = _full(actor.engine.module), _full(ref.engine.module)
    assert a.keys() == r.keys() and all(torch.equal(a[n], r[n]) for n in a)


def _recording_loss(
    config, model_output=None, data=None, dp_group=None, student_logits=None, data_format="thd", *, kl, loss, seen
):
    """``emapg_actor_loss``; its final-loss role also records the per-token KL (B, T) it aggregates and the mask."""
    from experiments.backends.verl.loss import emapg_actor_loss

    out = emapg_actor_loss(
        config=config,
        model_output=model_output,
        data=data,
        dp_group=dp_group,
        student_logits=student_logits,
        data_format=data_format,
        kl=kl,
        loss=loss,
    )
    if model_output is not None:
        seen.append(_loss_kl(model_output, data, kl))
    return out


def _loss_kl(model_output, data, kl) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token KL (B, T), response mask (B, T)) as ``final_loss`` sees them: the hook's Top-k KL, or
    the sampled estimator on verl's log-probs."""
    from ema_pg_core.kl import ImportanceWeight, KLInputs, kl_per_token
    from experiments.backends.verl.layout import Layout, padded_response
    from experiments.backends.verl.loss import KL_KEY

    lay = Layout.of(data)
    logp = lay.response(model_output["log_probs"]).detach()  # (B, T)
    resp = lambda key: padded_response(data[key], *logp.shape).to(logp.dtype)  # noqa: E731
    if KL_KEY in model_output:
        kl_tok = lay.response(model_output[KL_KEY])
    else:
        x = KLInputs(logp=logp, ref_logp=resp("ref_log_prob"), old_logp=resp("old_log_probs"))
        kl_tok = kl_per_token(kl.type, x, tail=kl.tail, iw=ImportanceWeight(kl.use_iw, kl.iw_clip_low, kl.iw_clip_high))
    return kl_tok.detach().float(), resp("response_mask").bool()


def _step_one_kl(actor, ref, kl_cfg, temperature: float) -> torch.Tensor:
    """Per-token KL of the update pass at the response tokens, after the pi_old and anchor passes."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.padding import no_padding_2_padding

    from ema_pg_core.config import LossConfig
    from experiments.backends.verl.config import topk_passes
    from experiments.backends.verl.engine import set_pass

    passes = topk_passes(kl_cfg)
    fields, logprobs = {}, {}
    for who, worker, key in (("old", actor, "old_log_probs"), ("ref", ref, "ref_log_prob")):
        td, _ = engines.batch(temperature=temperature)
        td.update(fields)
        set_pass(td, **passes[who])
        tu.assign_non_tensor(td, calculate_entropy=who == "old")  # as the trainer's two passes
        out = worker.infer_batch(td)
        fields.update({k: out[k] for k in out.keys() if k.startswith("emapg_")})
        logprobs[key] = no_padding_2_padding(out["log_probs"], td)  # (B, R) response layout

    td, _ = engines.batch(temperature=temperature)
    td.update({**fields, **logprobs})
    set_pass(td, **passes["train"])
    engines.train_flags(td)  # what TrainingWorker.train_batch injects
    cfg = FSDPActorConfig(
        strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, use_dynamic_bsz=False, rollout_n=1
    )
    seen = []
    loss_fn = partial(_recording_loss, config=cfg, kl=kl_cfg, loss=LossConfig(), seen=seen)
    actor.engine.optimizer_zero_grad()
    with actor.engine.train_mode():
        actor.engine.forward_backward_batch(td, loss_function=loss_fn, forward_only=False)
    actor.engine.optimizer_zero_grad()  # no step: the actor stays equal to the anchor
    ((kl_tok, mask),) = seen
    assert mask.any()
    return kl_tok[mask]


@pytest.mark.parametrize("kl_type,tail,use_iw,temperature", CASES)
def test_step_one_kl_is_zero_per_token(step_one, kl_type, tail, use_iw, temperature):
    from ema_pg_core.config import KLConfig

    kl = _step_one_kl(*step_one, KLConfig(type=kl_type, k=4, tail=tail, coef=0.5, use_iw=use_iw), temperature)
    assert kl.abs().max().item() <= 1e-6, f"{kl_type}/{tail}/iw={use_iw}/T={temperature}: per-token KL {kl.tolist()}"
