"""The verl backend's adapter: a resolved run config -> a verl launch of the plugin, and that launch run.

``to_verl(run)`` is the only place the mapping lives: the keys the local backend reads (``algo.*``,
``rollout.*``, ``optim.*``, ``trainer.*``, ``model.path``, ``seed``) plus ``backend.verl.*`` (``VerlSettings``)
become verl overrides and the ``emapg:`` section; the verl keys that mirror the section are set too, so verl's
logging and validation agree with what runs. tests/verl/golden/ pins its output for the paper's runs.
Pure Python: verl is imported only by ``run_config`` and ``placement_for``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ema_pg_core.config import (
    PROBE_SIZE,
    AdvantageConfig,
    AnchorConfig,
    KLConfig,
    LossConfig,
    OptimConfig,
    RolloutConfig,
    TrainerConfig,
    check_integer,
    check_number,
)
from ema_pg_core.overrides import hydra_value
from experiments.backends.verl import attention, cpu, failures
from experiments.backends.verl.config import DEVICES, TRAINER_MODE, VERL_AGG, EmaPGSection

ROLLOUT_ENGINES = ("vllm", "sglang", "hf")  # verl's GPU engines, or hf_rollout.py (any device)
ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager", attention.NAME)
RUNNER_SETUP = "experiments.backends.verl.launch:apply_wandb_env"  # every launch's (a no-op without W&B settings)

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


def apply_wandb_env(env: Mapping[str, str]) -> dict[str, str]:
    """Give this process's W&B the run's settings `env` (WANDB_* names); returns them. ``emapg.runner_setup``:
    verl's TaskRunner calls it in its own process, before its ``Tracking`` calls ``wandb.init``.

    As ``wandb.setup`` settings, not only variables: wandb reads the variables once per process, and wandb 0.31
    refuses WANDB_CONFIG_PATHS as a variable (a string where it wants a list)."""
    env = {str(k): str(v) for k, v in env.items()}
    if set(env) - set(WANDB_ENV):
        raise ValueError(f"unknown W&B setting(s) {sorted(set(env) - set(WANDB_ENV))}; allowed: {', '.join(WANDB_ENV)}")
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
"""The integer settings of ``VerlSettings`` that must be >= 1."""


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
    """vllm | sglang (GPUs) | hf (``hf_rollout.py``: HF generate, the engine of trainer.device=cpu)."""
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
    """Attention of the actor and the reference: sdpa | flash_attention_2 | eager | emapg_varlen; null = on GPUs
    flash_attention_2 where flash-attn is installed, else emapg_varlen (PyTorch's varlen kernel on verl's packed
    batches; the GPU install has no flash-attn: docs/verl-plugin.md, "Installing on GPUs"), eager on CPU."""
    multi_turn: bool = False
    """A multi-turn agent loop (search): rollout.max_turns tool calls, then one answer turn."""
    tool_config_path: str | None = None
    """verl's tool list (multi_turn.tool_config_path); needed by verl's tool_agent, unused by other loops."""
    max_tool_response_length: int = 500
    agent_loop: str = "tool_agent"
    """verl agent loop for multi_turn: tool_agent (verl's, hermes JSON tool calls) or a loop named in
    agent_loop_config_path (experiments' search_r1 speaks Search-R1's <search> tags)."""
    agent_loop_config_path: str | None = None
    """YAML list of {name, _target_} agent loops verl registers (`emapg train` makes it absolute)."""
    retriever_url: str | None = None
    """`emapg retriever serve` URL for a search agent loop (verl's rollout.custom.retriever_url)."""
    max_failed_rollouts: int = 0
    """Failed rollouts a run tolerates; one more ends it with that exception (verl alone logs them and may hang)."""
    step_timeout_s: float = 7200.0
    """`emapg train` fails a verl run when no training step completes for this long (start-up included)."""
    mask_truncated: bool = False
    """Drop responses that hit max_response_length from the actor update (emapg.mask_truncated)."""
    val_before_train: bool = False
    checkpoint_dir: str | None = None
    """trainer.default_local_dir; null = <run_dir>/checkpoints, as on the local backend."""
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
                f"{', '.join(ATTN_IMPLEMENTATIONS)}, null (flash_attention_2 or {attention.NAME} on GPUs, eager on CPU)"
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
        for name in (f.name for f in fields(self) if f.type == "bool"):  # the annotations are strings here
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"backend.verl.{name} must be true or false; got {getattr(self, name)!r}")
        if ":" not in self.reward_fn:
            raise ValueError(f"backend.verl.reward_fn={self.reward_fn!r} must be 'module:function'")


@dataclass
class VerlJob:
    """A compiled verl launch: verl Hydra overrides and the emapg: section."""

    overrides: list[str]
    emapg: dict[str, Any]

    def argv(self) -> list[str]:
        """The arguments ``experiments.backends.verl.main`` reads: verl overrides, then emapg.* (dotted)."""
        return [*self.overrides, *_dotted("emapg", self.emapg)]

    def command(self) -> list[str]:
        return ["python", "-m", "experiments.backends.verl.main", *self.argv()]


A, R, T, D = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "trainer.", "data."


def to_verl(run: Mapping[str, Any], wandb: Mapping[str, str] | None = None) -> VerlJob:
    """Compile a resolved run config (plain mapping of the experiments schema) into a verl launch. `wandb`:
    the WANDB_* settings of the run's W&B run (``experiments.wandb_logger.verl_env``; {} = no W&B; None = W&B
    as ``logger`` says, without them)."""
    algo = run.get("algo", {})
    vs = VerlSettings(**(run.get("backend", {}).get("verl") or {}))
    metrics = os.path.join(run["run_dir"], "verl_metrics.jsonl") if run.get("run_dir") else None
    tr = TrainerConfig(**run.get("trainer", {}))
    ro, opt = RolloutConfig(**run.get("rollout", {})), OptimConfig(**run.get("optim", {}))
    if tr.device not in DEVICES:
        raise ValueError(
            f"trainer.device={tr.device!r} is not allowed with the verl backend; allowed: {', '.join(DEVICES)}"
        )
    section = EmaPGSection(  # the run config's dataclasses, each checked under its algo.* name first
        kl=KLConfig(**algo.get("kl", {})),
        anchor=AnchorConfig(**algo.get("anchor", {})),
        loss=LossConfig(**algo.get("loss", {})),
        metrics_path=metrics,
        mask_truncated=vs.mask_truncated,
        device=tr.device,
        probe_every=tr.resolved_probe_every,
        probe_size=min(PROBE_SIZE, ro.prompts_per_iter) if tr.probe_size is None else tr.probe_size,
        runner_setup=RUNNER_SETUP,
        runner_env=dict(wandb or {}),
    )
    adv = AdvantageConfig(**algo.get("adv", {}))
    model_path = (run.get("model") or {}).get("path")
    if not model_path:
        raise ValueError("the verl backend needs model.path (an HF model id or directory)")
    _refuse(tr, ro, section)
    o = {
        **_algorithm_keys(section, adv),
        **_rollout_data_keys(ro, tr, vs),
        **_training_keys(opt, tr, vs, ro, model_path=model_path, seed=int(run.get("seed", 0))),
    }
    if section.loss.dual_clip_c is not None:
        o[f"{A}clip_ratio_c"] = section.loss.dual_clip_c
    if not vs.use_dynamic_bsz:
        o[f"{A}ppo_micro_batch_size_per_gpu"] = vs.micro_batch_size_per_gpu
        o[f"{R}log_prob_micro_batch_size_per_gpu"] = vs.micro_batch_size_per_gpu
        o["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"] = vs.micro_batch_size_per_gpu
    if vs.multi_turn:
        o.update(_multi_turn_keys(ro, vs))
    if vs.checkpoint_dir or run.get("run_dir"):
        o[f"{T}default_local_dir"] = checkpoint_root(run)
    o.update(_device_keys(section.device, vs))
    o.update(_logger(run, wandb))
    return VerlJob([f"{k}={hydra_value(v)}" for k, v in o.items()] + list(vs.overrides), section.model_dump())


def _refuse(tr, ro, section: EmaPGSection) -> None:
    """Settings the verl backend cannot honour, refused before any work."""
    if tr.resolved_probe_every and section.probe_size > ro.prompts_per_iter:
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


def _training_keys(opt, tr, vs: VerlSettings, ro, *, model_path: str, seed: int) -> dict[str, Any]:
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
    """Every Ray worker process runs our setup hook (``failures``; on CPU ``cpu`` too). trainer.device=cpu: verl's
    loop on the CPU platform with the hf rollout engine, one virtual GPU per rank, Ray bound to 127.0.0.1 and no
    torch.compile. The attention: ``attention.choose``."""
    hook = "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook"
    attn = attention.choose(vs.attn_implementation, device)[0]
    attn = {"+actor_rollout_ref.model.override_config.attn_implementation": attn}
    if device == "cuda":
        if vs.rollout_engine == "hf":
            raise ValueError("backend.verl.rollout_engine=hf runs with trainer.device=cpu (on GPUs use vllm or sglang)")
        return {hook: failures.SETUP_HOOK, **attn}
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
        **attn,
        f"{A}use_torch_compile": False,
    }


def _multi_turn_keys(ro, vs: VerlSettings) -> dict[str, Any]:
    """The agent loop and its limits; ``rollout.custom`` (verl's free-form dict) carries the retriever URL."""
    o = {f"{R}multi_turn.enable": True}
    if vs.tool_config_path:
        o[f"{R}multi_turn.tool_config_path"] = vs.tool_config_path
    o[f"{R}multi_turn.max_assistant_turns"] = ro.max_turns + 1
    o[f"{R}multi_turn.max_tool_response_length"] = vs.max_tool_response_length
    o[f"{R}agent.default_agent_loop"] = vs.agent_loop
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
    """Where verl writes ``global_step_N`` for this run: backend.verl.checkpoint_dir, else <run_dir>/checkpoints,
    `~` expanded and made absolute here (verl expands neither, and its ranks resolve a relative path in their own
    working directory, which on a cluster started by `ray start` is not this one's); without a run_dir (a config
    checked before its run directory is known), verl's default ``checkpoints/<project>/<experiment name>``."""
    vs = (run.get("backend") or {}).get("verl") or {}
    if vs.get("checkpoint_dir"):
        return os.path.abspath(os.path.expanduser(str(vs["checkpoint_dir"])))
    if run.get("run_dir"):
        return os.path.join(os.path.abspath(os.path.expanduser(run["run_dir"])), "checkpoints")
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


def run_config(run: Mapping[str, Any], wandb: Mapping[str, str] | None = None) -> int:
    """Launch a resolved run config (``backend.name == "verl"``) in this process (``main.launch``); `wandb`: as
    ``to_verl``'s."""
    from experiments.backends.verl.main import launch  # loads verl, ray

    return launch(to_verl(run, wandb).argv(), Path(run["run_dir"]) if run.get("run_dir") else None)


def placement_for(run: Mapping[str, Any]):
    """What a sweep trial of the resolved run config ``run`` reserves for its verl job; starts nothing."""
    from experiments.backends.verl.main import compose, trial_placement  # loads verl, ray

    return trial_placement(compose(to_verl(run).argv()))
