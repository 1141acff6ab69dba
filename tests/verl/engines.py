"""Test helpers: verl's real FSDP2 engines on CPU around a tiny Qwen2, and verl-shaped batches.

The engines, the batch and the Top-k passes' fields are the product's (``experiments.backends.verl.standalone``,
which ``benchmarks/verl_loss_pass.py`` runs on too); this module adds what only tests need: a loss pass's value and
gradients, a plain forward to compare with, and the plugin's worker outside Ray.
"""

from __future__ import annotations

import torch

from experiments.backends.verl.standalone import (  # noqa: F401  (the tests' entry point)
    P,
    R,
    actor_and_anchor,
    batch,
    pass_fields,
    perturb,
    save_tiny,
    train_flags,
    training_worker,
)


def loss_pass(actor, make_batch, loss_fn) -> tuple[dict, dict[str, torch.Tensor]]:
    """(verl's metrics, {parameter: gradient}) of one loss pass of `actor` with `loss_fn` over ``make_batch()`` (a fresh
    TensorDict per call): the value through ``infer_batch(compute_loss=True)``, the gradients through
    ``forward_backward_batch`` with TrainingWorker.train_batch's flags; no optimizer step."""
    from verl.utils import tensordict_utils as tu

    td = make_batch()
    tu.assign_non_tensor(td, compute_loss=True)
    metrics = actor.infer_batch(td)["metrics"]
    td = make_batch()
    train_flags(td)  # what TrainingWorker.train_batch injects
    actor.engine.optimizer_zero_grad()
    with actor.engine.train_mode():
        actor.engine.forward_backward_batch(td, loss_function=loss_fn, forward_only=False)
        grads = {
            n: p.grad.full_tensor().clone() for n, p in actor.engine.module.named_parameters() if p.grad is not None
        }
    actor.engine.optimizer_zero_grad()  # no step: the actor stays as it is for the next call
    return metrics, grads


def naive_logits(module, padded, temperature: float = 1.0) -> torch.Tensor:
    """(B, R, V) logits / T predicting each response token, one unpadded forward per sequence."""
    am, ids = padded["attention_mask"], padded["input_ids"]
    B = ids.shape[0]
    out = torch.zeros(B, R, module.config.vocab_size)
    for i in range(B):
        keep = am[i].bool()
        p_len = int(am[i, :P].sum())
        r_len = int(am[i, P:].sum())
        logits = module(input_ids=ids[i, keep][None], use_cache=False).logits[0].float() / temperature
        out[i, :r_len] = logits[p_len - 1 : p_len - 1 + r_len]
    return out


def plain_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)


def emapg_worker(model_path: str, section, rollout_temperature: float = 1.0):
    """Our ``EmaPGActorRolloutRefWorker`` outside Ray: an actor and a reference ``training_worker`` on the tiny
    model, verl's PPO loss config, then ``emapg_setup(section)`` (the RPC methods need only these attributes)."""
    from functools import partial

    from omegaconf import OmegaConf
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    from experiments.backends.verl.worker import EmaPGActorRolloutRefWorker

    w = object.__new__(EmaPGActorRolloutRefWorker)
    w.role, w.distillation_enabled = "actor_rollout_ref", False
    w.config = OmegaConf.create({"rollout": {"temperature": rollout_temperature}})
    w.actor = training_worker(model_path, forward_only=False)
    w.ref = training_worker(model_path, forward_only=True)
    w.loss_fn = partial(
        ppo_loss,
        config=FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, rollout_n=1),
    )
    w.actor.set_loss_fn(w.loss_fn)
    w.emapg_setup(section)
    return w
