"""Test helpers: verl's real FSDP2 engines on CPU around a tiny Qwen2, and verl-shaped batches.

The tiny model is ``ema_pg_core.local.tiny.build_model(build_tokenizer())`` saved with
``save_pretrained`` (no download). Engines run in fp32 (mixed_precision fp32; verl's default
autocasts to bf16, ``verl_precision=True``) with eager attention, so verl's outputs can be compared
with a plain forward.
"""

from __future__ import annotations

import torch

P, R = 6, 7  # padded prompt / response widths of the test batch


def save_tiny(path, seed: int = 0) -> str:
    from ema_pg_core.local.tiny import build_model, build_tokenizer

    tok = build_tokenizer()
    model = build_model(tok, hidden=64, layers=2, heads=4, seed=seed)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def training_worker(
    model_path: str,
    forward_only: bool,
    remove_padding: bool = True,
    micro: int = 4,
    dynamic_tokens: int | None = None,
    verl_precision: bool = False,
    attn: str = "eager",
):
    """A verl TrainingWorker (outside Ray) with an FSDP2 engine; the shim must be installed.

    ``dynamic_tokens``: verl's dynamic micro-batches (token budget per micro-batch; they are
    re-ordered by length and restored afterwards), else fixed micro-batches of ``micro`` sequences.
    ``verl_precision``: verl's default mixed precision (no ``mixed_precision`` given: bf16 compute
    under autocast, fp32 master weights) instead of fp32 throughout. ``attn``: the transformers attention.
    """
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    mc = HFModelConfig(
        path=model_path,
        override_config={"attn_implementation": attn},
        use_remove_padding=remove_padding,
        enable_gradient_checkpointing=False,
    )
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    ec = FSDPEngineConfig(
        strategy="fsdp2",
        forward_only=forward_only,
        use_torch_compile=False,
        model_dtype="fp32",
        mixed_precision=None if verl_precision else fp32,
        use_dynamic_bsz=dynamic_tokens is not None,
        micro_batch_size_per_gpu=micro,
        infer_micro_batch_size_per_gpu=micro,
        max_token_len_per_gpu=dynamic_tokens,
        infer_max_token_len_per_gpu=dynamic_tokens,
    )
    contents = ["model"] if forward_only else ["model", "optimizer", "extra"]
    oc = None if forward_only else FSDPOptimizerConfig(lr=1e-2, clip_grad=1e9)
    w = TrainingWorker(
        TrainingWorkerConfig(
            model_type="language_model",
            model_config=mc,
            engine_config=ec,
            optimizer_config=oc,
            checkpoint_config=CheckpointConfig(save_contents=contents, load_contents=contents),
        )
    )
    w.reset()
    return w


LENGTHS = ((6, 7), (3, 4), (4, 1), (2, 5))  # (prompt, response) tokens of the test batch's sequences


def batch(seed: int = 0, vocab: int = 100, temperature: float = 1.0, drop: tuple[int, ...] = (), lengths=LENGTHS):
    """(TensorDict in verl's no-padding layout, dict of the padded tensors) for `lengths` sequences (at most (P, R)
    tokens each); the rows in `drop` get an all-zero response_mask (a response left out of the update)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    plens, rlens = zip(*lengths)
    B = len(plens)
    prompts, responses = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
    am = torch.zeros(B, P + R, dtype=torch.long)
    for i in range(B):
        prompts[i, P - plens[i] :] = torch.randint(4, vocab, (plens[i],), generator=g)
        responses[i, : rlens[i]] = torch.randint(4, vocab, (rlens[i],), generator=g)
        am[i, P - plens[i] : P + rlens[i]] = 1
    input_ids = torch.cat([prompts, responses], 1)
    pos = (am.cumsum(1) - 1).clamp_min(0)
    mask = am[:, P:].clone()
    mask[list(drop)] = 0
    extra = {  # response-layout inputs of the loss
        "old_log_probs": -torch.rand(B, R, generator=g) * 3 * mask,
        "ref_log_prob": -torch.rand(B, R, generator=g) * 3 * mask,
        "advantages": torch.randn(B, 1, generator=g).expand(B, R) * mask,
    }
    padded = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": input_ids,
        "attention_mask": am,
        "position_ids": pos,
        "response_mask": mask,
        **extra,
    }
    td = TensorDict({k: v.clone() for k, v in padded.items()}, batch_size=B)
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(
        td,
        temperature=temperature,
        calculate_entropy=False,
        compute_loss=False,
        global_token_num=[int(x) for x in am.sum(1)],
        global_batch_size=B,
    )
    return td, padded


def train_flags(td, dynamic: bool = False) -> None:
    """The non-tensor flags TrainingWorker.train_batch injects before the engine's forward-backward."""
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(
        td,
        use_remove_padding=True,
        use_dynamic_bsz=dynamic,
        micro_batch_size_per_gpu=1 if dynamic else 4,
        max_token_len_per_gpu=16,
        use_fused_kernels=False,
    )


def loss_pass(actor, batch, loss_fn) -> tuple[dict, dict[str, torch.Tensor]]:
    """(verl's metrics, {parameter: gradient}) of one loss pass of `actor` with `loss_fn` over ``batch()`` (a fresh
    TensorDict per call): the value through ``infer_batch(compute_loss=True)``, the gradients through
    ``forward_backward_batch`` with TrainingWorker.train_batch's flags; no optimizer step."""
    from verl.utils import tensordict_utils as tu

    td = batch()
    tu.assign_non_tensor(td, compute_loss=True)
    metrics = actor.infer_batch(td)["metrics"]
    td = batch()
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


def perturb(module, scale: float, seed: int) -> None:
    """Add scale * N(0, 1) noise to every local shard of ``module``'s parameters, in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            loc = p.to_local()
            loc.add_(scale * torch.randn(loc.shape, generator=g))


def actor_and_anchor(model_path):
    """(actor, anchor): training workers on the same tiny model with the plugin's engine class, the anchor's
    weights perturbed so that it differs from the policy."""
    from experiments.backends.verl.engine import reclass

    actor = training_worker(model_path, forward_only=False)
    ref = training_worker(model_path, forward_only=True)
    perturb(ref.engine.module, 0.05, seed=1)
    reclass(actor.engine)
    reclass(ref.engine)
    return actor, ref


def pass_fields(actor, ref, passes, temperature: float = 0.8) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    """({pass: bytes per token it adds}, {key: nested tensor} all passes added): pi_old's pass on `actor`, then the
    anchor's on `ref`, over the test batch, with the pass flags ``passes["old"]``, ``passes["ref"]``."""
    from experiments.backends.verl.engine import set_pass

    verl_own = set(actor.infer_batch(batch(temperature=temperature)[0]).keys())  # mode "off": plain verl's
    per_token, fields = {}, {}
    for who, worker in (("old", actor), ("ref", ref)):
        td, _ = batch(temperature=temperature)
        td.update(fields)
        set_pass(td, **passes[who])
        out = worker.infer_batch(td)
        added = {k: out[k] for k in out.keys() if k not in verl_own}
        assert all(isinstance(t, torch.Tensor) and t.is_nested for t in added.values()), list(added)
        nnz = td["input_ids"].values().numel()
        nbytes = sum(t.values().nbytes for t in added.values())
        assert nbytes % nnz == 0, (who, nbytes, nnz)
        per_token[who] = nbytes // nnz
        fields.update(added)
    return per_token, fields
