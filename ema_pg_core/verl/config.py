"""Run config -> verl: the top-level ``emapg:`` section + verl Hydra overrides. Pure Python, no verl.

One sweep YAML drives either backend, because the verl launch is compiled from the same keys the
local backend reads (``algo.*``, ``rollout.*``, ``optim.*``, ``trainer.*``, ``model.path``, ``seed``)
plus ``backend.verl.*`` (``VerlSettings``: GPUs, data files, lengths, memory knobs: things the local
backend has no use for). ``to_verl(run)`` is the only place the mapping lives; the golden test in
tests/verl/golden/ pins its output for the paper's math and search runs.

    emapg.kl.*      = algo.kl.*        (KLConfig: estimator, k, tail, beta, importance weight)
    emapg.anchor.*  = algo.anchor.*    (AnchorConfig: tau, period)
    emapg.loss.*    = algo.loss.*      (LossConfig: clip-low/high, dual clip, entropy, aggregation)

The ``emapg:`` section is read by our trainer/worker/loss only; verl's config dataclasses never see
it (they reject unknown keys). verl keys that mirror it are set too (clip
ratios, loss_agg_mode, kl coef) so verl's own logging and validation agree with what runs.
Fixed requirements of the plugin (FSDP2, a separate fp32 reference, V1 trainer "emapg_sync",
no fused kernels) are emitted as overrides and re-checked at launch (``check_verl``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ema_pg_core.config import AdvantageConfig, AnchorConfig, KLConfig, LossConfig, check_integer, check_number
from ema_pg_core.kl import get_estimator
from ema_pg_core.overrides import hydra_value

TRAINER_MODE = "emapg_sync"
"""Name under which ``ema_pg_core.verl.trainer`` registers its V1 trainer."""
VERL_AGG = {
    "token-mean": "token-mean",
    "seq-mean-token-mean": "seq-mean-token-mean",
    "seq-mean-token-sum": "seq-mean-token-sum",
    "sum": "token-sum",
}
"""Our loss aggregation names -> verl's ``agg_loss`` modes (same formulas; verl's are global-batch normalised)."""
DEVICES = ("cuda", "cpu")
"""``trainer.device`` values of the verl backend: GPUs, or verl's loop on CPU (``ema_pg_core.verl.cpu``)."""
ROLLOUT_ENGINES = ("vllm", "sglang", "hf")
"""``backend.verl.rollout_engine``: verl's GPU engines, or ``ema_pg_core.verl.hf_rollout`` (any device)."""
ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager")
"""``backend.verl.attn_implementation``: the transformers attention of the actor and the reference."""
OLD, REF = "emapg_old_", "emapg_ref_"
"""Prefixes of the Top-k tensors produced by the pi_old pass and by the anchor (reference) pass."""


# --------------------------------------------------------------------------------------
# The emapg: section
# --------------------------------------------------------------------------------------
SECTION_SCALARS = ("metrics_path", "mask_truncated", "device", "probe_every", "probe_size")
"""The emapg section's top-level keys that are values, not groups."""
WANDB_ENV = {
    "WANDB_RUN_ID": "run_id",
    "WANDB_RESUME": "resume",
    "WANDB_RUN_GROUP": "run_group",
    "WANDB_TAGS": "run_tags",
    "WANDB_MODE": "mode",
    "WANDB_DIR": "root_dir",
    "WANDB_CONFIG_PATHS": "config_paths",
}
"""The W&B settings verl 0.9.1's tracker cannot be told otherwise, by environment variable name -> the
``wandb.Settings`` field. Its ``Tracking`` calls ``wandb.init(project, name, entity, config)`` only."""


def apply_wandb_env(section: Any) -> dict[str, str]:
    """Give this process's W&B the ``emapg.wandb`` settings (called in verl's TaskRunner, where verl's
    ``Tracking`` later calls ``wandb.init``); returns them. `section`: a composed config's ``emapg`` node
    or a plain mapping.

    They go to ``wandb.setup`` as settings, not only as environment variables: wandb reads the variables
    once per process (an earlier wandb use would hide them), and wandb 0.31 refuses WANDB_CONFIG_PATHS
    given as a variable (a string where it wants a list). The variables are set too (minus that one)."""
    env = {str(k): str(v) for k, v in dict(section.get("wandb") or {}).items()}
    if not env:
        return env
    import wandb

    settings = {WANDB_ENV[k]: v for k, v in env.items()}
    for key in ("run_tags", "config_paths"):
        if key in settings:
            settings[key] = tuple(settings[key].split(","))
    os.environ.update({k: v for k, v in env.items() if k != "WANDB_CONFIG_PATHS"})
    wandb.setup(settings=wandb.Settings(**settings))
    return env


@dataclass
class EmaPGSection:
    """What our verl plugin reads: the core's own dataclasses (defaults and validation live there)."""

    kl: KLConfig = field(default_factory=KLConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    metrics_path: str | None = None
    """Where verl's "file" logger writes one JSON line per iteration ({"step", "data"}); null = verl's default."""
    mask_truncated: bool = False
    """Drop responses that reached data.max_response_length from the actor update, after the advantages
    (rLLM's mask_truncated_samples, the paper's 8k math stage; ``trainer.drop_truncated``)."""
    device: str = "cuda"
    """cuda (GPUs, verl's own platform detection) | cpu (``ema_pg_core.verl.cpu``: development, rehearsals)."""
    probe_every: int = 0
    """The KL probe every this many iterations (0 = none): ``trainer.probe_every`` resolved (ema_pg_core.verl.probe)."""
    probe_size: int = 16
    """Prompts in the probe: the first ones of the run's first training batch (``trainer.probe_size``)."""
    wandb: dict[str, str] = field(default_factory=dict)
    """W&B settings for verl's tracker, by WANDB_* variable name (``WANDB_ENV``); the TaskRunner applies them
    in its own process before verl's ``Tracking`` calls ``wandb.init`` (``apply_wandb_env``). Empty: none."""

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(
                f"trainer.device={self.device!r} is not allowed with the verl backend; allowed: {', '.join(DEVICES)}"
            )
        for name in ("probe_every", "probe_size"):
            value, low = getattr(self, name), int(name == "probe_size")
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"emapg.{name} must be an integer >= {low}; got {value!r}")
        if not isinstance(self.mask_truncated, bool):
            raise ValueError(f"emapg.mask_truncated must be true or false; got {self.mask_truncated!r}")
        est = get_estimator(self.kl.type)
        if self.kl.coef > 0 and est.needs == "full":
            raise ValueError(
                f"algo.kl.type={self.kl.type!r} needs full (B, T, V) anchor logits, which the verl backend "
                "does not ship between workers; use topk_reverse/topk_forward (k up to the vocabulary size "
                "is exact) or a sampled estimator"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EmaPGSection:
        """Build and validate from a plain mapping (unknown keys are errors, naming the allowed ones)."""
        parts = {}
        for name, typ in (("kl", KLConfig), ("anchor", AnchorConfig), ("loss", LossConfig)):
            sub = dict(d.get(name) or {})
            allowed = {f.name for f in fields(typ)}
            unknown = sorted(set(sub) - allowed)
            if unknown:
                raise ValueError(f"unknown emapg.{name} key(s) {unknown}; allowed: {', '.join(sorted(allowed))}")
            parts[name] = typ(**sub)
        unknown = sorted(set(d) - {"kl", "anchor", "loss", "wandb", *SECTION_SCALARS})
        if unknown:
            raise ValueError(
                f"unknown emapg key(s) {unknown}; allowed: kl, anchor, loss, wandb, {', '.join(SECTION_SCALARS)}"
            )
        wandb = {str(k): str(v) for k, v in (d.get("wandb") or {}).items()}
        if set(wandb) - set(WANDB_ENV):
            raise ValueError(
                f"unknown emapg.wandb key(s) {sorted(set(wandb) - set(WANDB_ENV))}; allowed: {', '.join(WANDB_ENV)}"
            )
        return cls(**parts, wandb=wandb, **{k: d[k] for k in SECTION_SCALARS if d.get(k) is not None})

    def to_dict(self) -> dict[str, Any]:
        return {
            "kl": asdict(self.kl),
            "anchor": asdict(self.anchor),
            "loss": asdict(self.loss),
            **{k: getattr(self, k) for k in SECTION_SCALARS},
            "wandb": dict(self.wandb),
        }

    @classmethod
    def from_config(cls, node: Any) -> EmaPGSection:
        """From the ``emapg`` node of a composed verl config (an OmegaConf node, resolved here; the trainer's
        ``config.emapg`` and the workers' ``actor_rollout_ref.emapg``) or a plain mapping."""
        if not isinstance(node, dict):
            from omegaconf import OmegaConf  # the verl side only: this module imports no omegaconf

            node = OmegaConf.to_container(node, resolve=True)
        return cls.from_dict(node)


def uses_topk(kl: KLConfig) -> bool:
    """The estimator declares Top-k inputs (capability flag, never the name) and the KL is on."""
    return kl.coef > 0 and get_estimator(kl.type).needs == "topk"


def head_keys(kl: KLConfig) -> dict[str, str]:
    """Where the Top-k head lives: ids (pi_old's for reverse, the anchor's for forward) and the anchor's
    log-probs at them (``engine.set_pass(logp=True)``)."""
    reverse = get_estimator(kl.type).direction == "reverse"
    return {"ids": f"{OLD if reverse else REF}topk_ids", "ref_logp_k": f"{REF}logp_k"}


def topk_passes(kl: KLConfig) -> dict[str, dict[str, Any]]:
    """Per pass ("old", "ref", "train"), the engine instructions (``engine.set_pass`` keyword arguments).

    Only what the loss reads travels to the update: the head ids (int32) and the anchor's log-probs there
    (fp32), 8K bytes per token; pi_old's values at its own top-k are never read, so its pass sends ids only."""
    off = {"mode": "off"}
    if not uses_topk(kl):
        return {"old": off, "ref": off, "train": off}
    train = {"mode": "train"}
    if get_estimator(kl.type).direction == "reverse":  # q = top-k of pi_old; anchor gathers there
        return {
            "old": {"mode": "ids", "k": kl.k, "prefix": OLD},
            "ref": {"mode": "gather", "ids_key": f"{OLD}topk_ids", "prefix": REF, "logp": True},
            "train": train,
        }
    ref = {"mode": "self", "k": kl.k, "prefix": REF, "logp": True}  # q = anchor's top-k
    return {"old": off, "ref": ref, "train": train}


def anchor_due(iteration: int, anchor: AnchorConfig) -> bool:
    """``EmaAnchor.due``: update after iterations period, 2*period, ... (1-based), never when tau = 1."""
    return anchor.tau < 1.0 and iteration > 0 and iteration % anchor.period == 0


# --------------------------------------------------------------------------------------
# verl-only settings (backend.verl.*)
# --------------------------------------------------------------------------------------
VERL_COUNTS = (
    "nnodes",
    "n_gpus_per_node",
    "max_prompt_length",
    "tensor_parallel_size",
    "max_token_len_per_gpu",
    "micro_batch_size_per_gpu",
    "max_tool_response_length",
    "total_epochs",
)
"""The integer settings of ``VerlSettings`` that must be >= 1 (counts and lengths)."""


@dataclass
class VerlSettings:
    """Settings only the verl backend has. Paper values: 8xH100 per run."""

    nnodes: int = 1
    n_gpus_per_node: int = 8
    """GPUs per node given to this run's verl workers (actor, reference and rollout are colocated)."""
    train_files: str = "~/data/emapg/math/train.parquet"
    """verl parquet (experiments/tasks/<task>.py prepare writes it)."""
    val_files: str = "~/data/emapg/math/test.parquet"
    reward_fn: str = "experiments.tasks.math:compute_score"
    """module:function with verl's compute_score(data_source, solution_str, ground_truth, extra_info) signature."""
    max_prompt_length: int = 1024
    max_response_length: int | None = None
    """Total response tokens (all turns); null = rollout.max_new_tokens (single-turn tasks)."""
    rollout_engine: str = "vllm"
    """vllm | sglang (GPUs) | hf (``ema_pg_core.verl.hf_rollout``: HF generate, the engine of trainer.device=cpu)."""
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.6
    """Share of each GPU's memory the rollout engine may take, in (0, 1]."""
    use_dynamic_bsz: bool = True
    max_token_len_per_gpu: int = 16384
    """Token budget per GPU for dynamic micro-batches (training and log-prob passes)."""
    micro_batch_size_per_gpu: int = 8
    """Used when use_dynamic_bsz is false."""
    param_offload: bool = False
    optimizer_offload: bool = False
    gradient_checkpointing: bool = True
    attn_implementation: str | None = None
    """Attention of the actor and the reference (verl's ``actor_rollout_ref.model.override_config.
    attn_implementation``): sdpa | flash_attention_2 | eager; null = sdpa on GPUs, eager on CPU. verl's own
    default, flash_attention_2, needs the flash-attn package, which the README's GPU install leaves out (no
    wheel for torch 2.11 + CUDA 13; docs/verl-plugin.md, "Installing on GPUs"); set flash_attention_2 where
    it is installed (verl's image), for speed."""
    multi_turn: bool = False
    """A multi-turn agent loop (search): rollout.max_turns tool calls, then one answer turn."""
    tool_config_path: str | None = None
    """verl's tool list (multi_turn.tool_config_path); needed by verl's tool_agent, unused by other loops."""
    max_tool_response_length: int = 500
    agent_loop: str = "tool_agent"
    """verl agent loop for multi_turn: tool_agent (verl's, hermes JSON tool calls) or a loop named in
    agent_loop_config_path (experiments' search_r1 speaks Search-R1's <search> tags)."""
    agent_loop_config_path: str | None = None
    """YAML list of {name, _target_} agent loops verl registers (agent.agent_loop_config_path). verl
    resolves a relative path against its working directory; `emapg train` makes it absolute first."""
    retriever_url: str | None = None
    """`emapg retriever serve` URL for a search agent loop (verl's rollout.custom.retriever_url)."""
    max_failed_rollouts: int = 0
    """Failed rollouts (an exception in the rollout server, agent loop, tool/retriever or reward) a run
    tolerates; one more ends it with that exception (verl alone logs them and may wait forever)."""
    step_timeout_s: float = 7200.0
    """`emapg train` stops a verl run (status failed) when no training step completes for this long
    (start-up included; finite, > 0): the last line of defence against a hang."""
    mask_truncated: bool = False
    """Drop responses that hit max_response_length from the actor update, after the advantages (the
    paper's 8k math stage, rLLM's mask_truncated_samples; emapg.mask_truncated)."""
    val_before_train: bool = False
    checkpoint_dir: str | None = None
    """trainer.default_local_dir; null = verl's checkpoints/<project>/<experiment>."""
    total_epochs: int = 100
    """Cap only: training stops at trainer.iterations."""
    overrides: list[str] = field(default_factory=list)
    """Raw verl Hydra overrides appended last (escape hatch; they win)."""

    def __post_init__(self):
        if self.rollout_engine not in ROLLOUT_ENGINES:
            raise ValueError(
                f"backend.verl.rollout_engine={self.rollout_engine!r}; allowed: {', '.join(ROLLOUT_ENGINES)}"
            )
        if self.attn_implementation is not None and self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"backend.verl.attn_implementation={self.attn_implementation!r}; allowed: "
                f"{', '.join(ATTN_IMPLEMENTATIONS)}, null (sdpa on GPUs, eager on CPU)"
            )
        if self.multi_turn and self.agent_loop == "tool_agent" and not self.tool_config_path:
            raise ValueError(
                "backend.verl.multi_turn=true with agent_loop=tool_agent needs backend.verl.tool_config_path"
            )
        if self.multi_turn and self.agent_loop == "search_r1" and not self.retriever_url:
            raise ValueError(
                "backend.verl.agent_loop=search_r1 needs backend.verl.retriever_url (an `emapg retriever "
                "serve` URL reachable from every rollout node, e.g. http://127.0.0.1:8000)"
            )
        for name in VERL_COUNTS:
            check_integer(f"backend.verl.{name}", getattr(self, name), 1)
        check_integer("backend.verl.max_response_length", self.max_response_length, 1, null=True)
        check_number("backend.verl.gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, low_open=True)
        check_integer("backend.verl.max_failed_rollouts", self.max_failed_rollouts, 0)
        check_number("backend.verl.step_timeout_s", self.step_timeout_s, 0, low_open=True, why=" (seconds)")
        if ":" not in self.reward_fn:
            raise ValueError(f"backend.verl.reward_fn={self.reward_fn!r} must be 'module:function'")


@dataclass
class VerlJob:
    """A compiled verl launch: verl Hydra overrides and the emapg: section."""

    overrides: list[str]
    emapg: dict[str, Any]

    def command(self, python: str = "python") -> list[str]:
        """argv of ``python -m ema_pg_core.verl.main``: verl overrides, then emapg.* (dotted)."""
        return [python, "-m", "ema_pg_core.verl.main", *self.overrides, *_dotted("emapg", self.emapg)]

    def shell(self, python: str = "python") -> str:
        """The same command as one shell-quoted line (for scripts, SLURM, the Ray Jobs entrypoint)."""
        import shlex

        return " \\\n    ".join(shlex.quote(a) for a in self.command(python))


# --------------------------------------------------------------------------------------
# The mapping
# --------------------------------------------------------------------------------------
A, R, T, D = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "trainer.", "data."


def _probe_size(tr, prompts_per_iter: int) -> int:
    """``trainer.probe_size``, or for null the smaller of ``PROBE_SIZE`` and the first batch's prompts."""
    from ema_pg_core.config import PROBE_SIZE

    return tr.probe_size if tr.probe_size is not None else min(PROBE_SIZE, prompts_per_iter)


def to_verl(run: Mapping[str, Any], wandb: Mapping[str, str] | None = None) -> VerlJob:
    """Compile a resolved run config (plain mapping of the experiments schema) into a verl launch. `wandb`:
    the WANDB_* settings of the run's W&B run (``experiments.wandb_logger.verl_env``; {} = no W&B; None = W&B
    as ``logger`` says, without them)."""
    from ema_pg_core.config import OptimConfig, RolloutConfig, TrainerConfig

    algo = run.get("algo", {})
    vs = VerlSettings(**(run.get("backend", {}).get("verl") or {}))
    metrics = os.path.join(run["run_dir"], "verl_metrics.jsonl") if run.get("run_dir") else None
    tr = TrainerConfig(**run.get("trainer", {}))
    ro, opt = RolloutConfig(**run.get("rollout", {})), OptimConfig(**run.get("optim", {}))
    section = EmaPGSection.from_dict(
        {
            **{k: algo.get(k, {}) for k in ("kl", "anchor", "loss")},
            "metrics_path": metrics,
            "mask_truncated": vs.mask_truncated,
            "device": tr.device,
            "probe_every": tr.probe_period,
            "probe_size": _probe_size(tr, ro.prompts_per_iter),
            "wandb": dict(wandb or {}),
        }
    )
    adv = AdvantageConfig(**algo.get("adv", {}))
    model_path = (run.get("model") or {}).get("path")
    if not model_path:
        raise ValueError("the verl backend needs model.path (an HF model id or directory)")
    _refuse(tr, ro, section)
    o = {
        **_algorithm_keys(section, adv),
        **_rollout_data_keys(ro, tr, vs),
        **_training_keys(opt, tr, vs, ro, model_path, int(run.get("seed", 0))),
    }
    if section.loss.dual_clip_c is not None:
        o[f"{A}clip_ratio_c"] = section.loss.dual_clip_c
    if not vs.use_dynamic_bsz:
        o[f"{A}ppo_micro_batch_size_per_gpu"] = vs.micro_batch_size_per_gpu
        o[f"{R}log_prob_micro_batch_size_per_gpu"] = vs.micro_batch_size_per_gpu
        o["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"] = vs.micro_batch_size_per_gpu
    if vs.multi_turn:
        o.update(_multi_turn_keys(ro, vs))
    if vs.checkpoint_dir:
        o[f"{T}default_local_dir"] = vs.checkpoint_dir
    o.update(_device_keys(section.device, vs))
    o.update(_logger(run, wandb))
    return VerlJob([f"{k}={hydra_value(v)}" for k, v in o.items()] + list(vs.overrides), section.to_dict())


def _refuse(tr, ro, section: EmaPGSection) -> None:
    """Settings the verl backend cannot honour, refused before any work."""
    if tr.probe_period and section.probe_size > ro.prompts_per_iter:
        raise ValueError(
            f"trainer.probe_size={tr.probe_size} > rollout.prompts_per_iter={ro.prompts_per_iter}: on the verl "
            f"backend the KL probe is taken from the first batch's prompts; allowed: 1..{ro.prompts_per_iter}, "
            "null (the smaller of 16 and prompts_per_iter), or trainer.probe_every=0 (no probe)"
        )
    if tr.old_logprobs == "rollout":
        raise ValueError(
            "trainer.old_logprobs=rollout is not allowed with the verl backend (verl recomputes pi_old's "
            "log-probs); allowed values: auto, recompute"
        )
    if ro.prompts_per_iter % tr.mini_batches:
        raise ValueError(
            f"rollout.prompts_per_iter={ro.prompts_per_iter} "
            f"must be divisible by trainer.mini_batches={tr.mini_batches} "
            "(verl counts ppo_mini_batch_size in prompts)"
        )


def _algorithm_keys(section: EmaPGSection, adv: AdvantageConfig) -> dict[str, Any]:
    """The plugin's requirements, GRPO, and verl's mirror of the loss our function computes."""
    kl, loss = section.kl, section.loss
    return {
        f"{T}use_v1": True,
        f"{T}v1.trainer_mode": TRAINER_MODE,
        f"{A}strategy": "fsdp2",
        "actor_rollout_ref.ref.fsdp_config.model_dtype": "fp32",
        "actor_rollout_ref.model.use_fused_kernels": False,
        "algorithm.adv_estimator": "grpo",
        "algorithm.norm_adv_by_std_in_grpo": adv.mode == "grpo",
        "algorithm.use_kl_in_reward": False,
        "algorithm.kl_ctrl.kl_coef": 0.0,
        f"{A}use_kl_loss": True,
        f"{A}kl_loss_coef": kl.coef,
        f"{A}kl_loss_type": "emapg",
        f"{A}clip_ratio_low": loss.clip_low,
        f"{A}clip_ratio_high": loss.clip_high,
        f"{A}loss_agg_mode": VERL_AGG[loss.agg],
        f"{A}entropy_coeff": loss.entropy_coef,
    }


def _rollout_data_keys(ro, tr, vs: VerlSettings) -> dict[str, Any]:
    return {
        f"{R}name": vs.rollout_engine,
        f"{R}n": ro.group_size,
        f"{R}temperature": ro.temperature,
        f"{R}top_p": ro.top_p,
        f"{R}tensor_model_parallel_size": vs.tensor_parallel_size,
        f"{R}gpu_memory_utilization": vs.gpu_memory_utilization,
        f"{R}val_kwargs.n": tr.eval_n,
        f"{R}val_kwargs.temperature": tr.eval_temperature,
        f"{R}val_kwargs.do_sample": tr.eval_temperature > 0,
        f"{R}calculate_log_probs": True,
        f"{D}train_files": vs.train_files,
        f"{D}val_files": vs.val_files,
        f"{D}train_batch_size": ro.prompts_per_iter,
        f"{D}max_prompt_length": vs.max_prompt_length,
        f"{D}max_response_length": vs.max_response_length or ro.max_new_tokens,
        "reward.custom_reward_function.path": "pkg://" + vs.reward_fn.split(":")[0],  # verl's load_module syntax
        "reward.custom_reward_function.name": vs.reward_fn.split(":")[1],
    }


def _training_keys(opt, tr, vs: VerlSettings, ro, model_path: str, seed: int) -> dict[str, Any]:
    return {
        f"{A}optim.lr": opt.lr,
        f"{A}optim.betas": [opt.beta1, opt.beta2],
        f"{A}optim.weight_decay": opt.weight_decay,
        f"{A}optim.clip_grad": opt.grad_clip,
        f"{A}optim.lr_warmup_steps": opt.warmup_iters or -1,
        f"{A}ppo_epochs": tr.ppo_epochs,
        f"{A}ppo_mini_batch_size": ro.prompts_per_iter // tr.mini_batches,
        f"{A}data_loader_seed": seed,
        f"{R}seed": seed,
        "actor_rollout_ref.model.path": model_path,
        "actor_rollout_ref.model.use_remove_padding": True,
        "actor_rollout_ref.model.enable_gradient_checkpointing": vs.gradient_checkpointing,
        f"{A}use_dynamic_bsz": vs.use_dynamic_bsz,
        f"{A}ppo_max_token_len_per_gpu": vs.max_token_len_per_gpu,
        f"{A}fsdp_config.param_offload": vs.param_offload,
        f"{A}fsdp_config.optimizer_offload": vs.optimizer_offload,
        f"{T}total_training_steps": tr.iterations,
        f"{T}total_epochs": vs.total_epochs,
        f"{T}save_freq": tr.save_every if tr.save_every > 0 else -1,
        f"{T}test_freq": tr.eval_every,
        f"{T}max_actor_ckpt_to_keep": tr.keep_checkpoints,
        f"{T}val_before_train": vs.val_before_train,
        f"{T}nnodes": vs.nnodes,
        f"{T}n_gpus_per_node": vs.n_gpus_per_node,
    }


def _device_keys(device: str, vs: VerlSettings) -> dict[str, Any]:
    """Every worker process of the Ray cluster verl starts runs our setup hook (failed rollouts become
    fatal: ``ema_pg_core.verl.failures``). trainer.device=cpu: verl's loop on the CPU platform
    (``ema_pg_core.verl.cpu``) with the hf rollout engine.

    The local Ray cluster verl starts advertises one virtual GPU per rank, every Ray worker process
    installs the CPU platform (a ``worker_process_setup_hook``), and the model runs with eager
    attention (unless ``backend.verl.attn_implementation`` says sdpa) and without torch.compile. Ray binds
    to 127.0.0.1. On GPUs the attention is sdpa unless set: verl's default needs flash-attn.
    """
    from ema_pg_core.verl import cpu, failures

    hook = "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook"
    attn = "+actor_rollout_ref.model.override_config.attn_implementation"
    if device == "cuda":
        if vs.rollout_engine == "hf":
            raise ValueError("backend.verl.rollout_engine=hf runs with trainer.device=cpu (on GPUs use vllm or sglang)")
        return {hook: failures.SETUP_HOOK, attn: vs.attn_implementation or "sdpa"}
    if vs.attn_implementation == "flash_attention_2":
        raise ValueError(
            "backend.verl.attn_implementation=flash_attention_2 needs CUDA (flash-attn); with trainer.device=cpu "
            "use sdpa, eager or null (eager)"
        )
    if vs.rollout_engine != "hf":
        raise ValueError(
            f"trainer.device=cpu needs backend.verl.rollout_engine=hf (got {vs.rollout_engine!r}: "
            "vLLM and SGLang need GPUs)"
        )
    return {
        "trainer.device": "cpu",
        "+ray_kwargs.ray_init.num_gpus": vs.nnodes * vs.n_gpus_per_node,
        hook: cpu.SETUP_HOOK,
        "+ray_kwargs.ray_init._node_ip_address": "127.0.0.1",
        "+ray_kwargs.ray_init.include_dashboard": False,
        attn: vs.attn_implementation or "eager",
        f"{A}use_torch_compile": False,
    }


def _multi_turn_keys(ro, vs: VerlSettings) -> dict[str, Any]:
    """The agent loop and its limits; ``rollout.custom`` (verl's free-form dict) carries the retriever URL."""
    o = {f"{R}multi_turn.enable": True}
    if vs.tool_config_path:
        o[f"{R}multi_turn.tool_config_path"] = vs.tool_config_path
    o.update(
        {
            f"{R}multi_turn.max_assistant_turns": ro.max_turns + 1,
            f"{R}multi_turn.max_tool_response_length": vs.max_tool_response_length,
            f"{R}agent.default_agent_loop": vs.agent_loop,
        }
    )
    if vs.agent_loop_config_path:
        o[f"{R}agent.agent_loop_config_path"] = vs.agent_loop_config_path
    if vs.agent_loop != "tool_agent":  # our loops cap each generation turn like the local backend
        o[f"+{R}custom.max_turn_tokens"] = ro.max_new_tokens
    if vs.retriever_url:  # rollout.custom is absent from verl's YAML (RolloutConfig.custom: Optional[dict])
        o[f"+{R}custom.retriever_url"] = vs.retriever_url
    return o


def _logger(run: Mapping[str, Any], wandb: Mapping[str, str] | None = None) -> dict[str, Any]:
    """verl's loggers and names: the experiment name (W&B's run name, verl's checkpoint folder) is the run
    id, the name of the run directory, as for the local backend (else task__experiment__seed)."""
    lg = run.get("logger") or {}
    on = bool(wandb) if wandb is not None else lg.get("name", "none") == "wandb" and lg.get("mode") != "disabled"
    loggers = ["console", "file"] + (["wandb"] if on else [])
    name = f"{(run.get('task') or {}).get('name', 'task')}__{run.get('experiment', 'custom')}__{run.get('seed', 0)}"
    name = os.path.basename(os.path.normpath(run["run_dir"])) if run.get("run_dir") else name
    return {
        "trainer.logger": loggers,
        "trainer.project_name": lg.get("project", "emapg"),
        "trainer.experiment_name": name,
    }


def checkpoint_root(run: Mapping[str, Any]) -> str:
    """Where verl writes ``global_step_N`` for this run: backend.verl.checkpoint_dir, else verl's default
    ``checkpoints/<project>/<experiment name>`` (relative to the working directory)."""
    vs = (run.get("backend") or {}).get("verl") or {}
    if vs.get("checkpoint_dir"):
        return str(vs["checkpoint_dir"])
    names = _logger(run)
    return os.path.join("checkpoints", names["trainer.project_name"], names["trainer.experiment_name"])


def _dotted(prefix: str, d: Mapping[str, Any]) -> list[str]:
    out = []
    for k, v in d.items():
        if isinstance(v, Mapping):
            out += _dotted(f"{prefix}.{k}", v)
        else:
            out.append(f"{prefix}.{k}={hydra_value(v)}")
    return out


def split_argv(argv: list[str]) -> tuple[list[str], EmaPGSection]:
    """(verl overrides, validated emapg section) from ``main``'s argv (``emapg.a.b=v`` -> section). Values are
    read by Hydra's override parser, the reader ``hydra_value`` writes for (YAML would read 1e-05 as a string)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    verl_args, section = [], {}
    for arg in argv:
        if arg.startswith(("emapg.", "+emapg.")):
            key, _, value = arg.lstrip("+").partition("=")
            parts = key.split(".")[1:]
            parsed = OverridesParser.create().parse_override(f"key={value}").value() if value != "" else None
            if len(parts) == 1 and parts[0] in SECTION_SCALARS:
                section[parts[0]] = parsed
            elif len(parts) == 2:
                section.setdefault(parts[0], {})[parts[1]] = parsed
            else:
                raise ValueError(
                    f"{arg!r}: emapg overrides are emapg.<kl|anchor|loss>.<field>=<value> or "
                    f"emapg.<{'|'.join(SECTION_SCALARS)}>=<value>"
                )
        else:
            verl_args.append(arg)
    return verl_args, EmaPGSection.from_dict(section)


def rotate(path: str | Path) -> Path:
    """verl's file logger opens its file with mode "wb" (a resumed run would truncate it). Move a
    non-empty `path` aside to `<stem>.<n><suffix>` (the next free n >= 1) so that
    the new attempt can open `path` for writing; returns `path`. A missing or empty file is left alone."""
    path = Path(path)
    if path.is_file() and path.stat().st_size > 0:
        n = 1
        while (aside := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
            n += 1
        path.rename(aside)
    return path
