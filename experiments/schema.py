"""The run config schema: experiment-level sections + the core's dataclasses (defaults live there).

Registered as Hydra structured configs (``experiments.build.compose``); YAML files under ``experiments/conf``
hold only deltas. ``build.py`` turns a composed config into these dataclasses, which validate
themselves in ``__post_init__``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ema_pg_core.config import (
    AlgoConfig,
    HealthConfig,
    OptimConfig,
    RolloutConfig,
    TrainerConfig,
    check_integer,
    check_seed,
)
from experiments.backends.verl.launch import VerlSettings


@dataclass
class TaskConfig:
    name: str = "math_tiny"  # a task of experiments.tasks.TASKS (a module of experiments/tasks/, by its NAME)
    train_size: int = 4000  # training problems generated (seeded, disjoint from the test split), >= 1
    test_size: int = 200
    """Held-out problems generated, >= 1; the first trainer.eval_size are evaluated (and the KL probe's prompts
    drawn), so on the local backend both are at most test_size."""
    data_seed: int = 1234
    """Seed of the problem generator (fixed across run seeds, so every seed sees the same data); in
    [0, ema_pg_core.config.SEED_MAX]."""
    knobs: dict[str, Any] = field(default_factory=dict)  # difficulty knobs for the task's loader (e.g. digits, hops)
    retriever_url: str | None = None
    """Tool tasks: an `emapg retriever serve` URL (http:// or https://; a run checks that it answers before
    any work: experiments.build.check_retriever); null = in-process BM25."""

    def __post_init__(self):
        check_integer("task.train_size", self.train_size, 1)
        check_integer("task.test_size", self.test_size, 1)
        check_seed("task.data_seed", self.data_seed)
        url = self.retriever_url
        if not (url is None or (isinstance(url, str) and url.startswith(("http://", "https://")))):
            raise ValueError(f"task.retriever_url={url!r} is not an http:// or https:// URL (or null: in-process BM25)")


@dataclass
class ModelConfig:
    name: str = "tiny"
    path: str | None = None  # a local HF causal-LM directory; null = the tiny model warm-started on the task (cached)
    hidden: int = 128
    """The tiny model's hidden size, >= 1 and divisible by heads (model.path null only, as the next three)."""
    layers: int = 2  # its transformer layers, >= 1
    heads: int = 4  # its attention heads, >= 1
    pretrain_steps: int | None = None  # warm-start SFT steps, >= 1; null = the task's calibrated default
    cache_dir: str = "${oc.env:EMAPG_CACHE,${oc.env:HOME}/.cache/emapg}"  # warm starts, keyed by a config hash

    def __post_init__(self):
        for name in ("hidden", "layers", "heads"):
            check_integer(f"model.{name}", getattr(self, name), 1)
        if self.hidden % self.heads:
            raise ValueError(f"model.hidden={self.hidden} must be divisible by model.heads={self.heads}")
        check_integer("model.pretrain_steps", self.pretrain_steps, 1, null=True)


@dataclass
class LoggerConfig:
    name: str = "wandb"  # wandb | none
    project: str = "emapg"
    mode: str = "offline"  # offline (no account, `wandb sync` later) | online | disabled; WANDB_MODE overrides
    group: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class BackendConfig:
    name: str = "local"  # local (this process) | verl (the distributed backend)
    verl: VerlSettings = field(default_factory=VerlSettings)  # read by the verl backend only


@dataclass
class SweepConfig:
    """The run's place in a sweep (``sweep.name``, ``sweep.trial_id``), set by the sweep for each trial; null
    outside one. (What the dashboard reads of a sweep spec is ``analysis.dashboard.SweepInfo``.)"""

    name: str | None = None
    trial_id: str | None = None


@dataclass
class RunConfig:
    experiment: str = "custom"  # preset name (set by experiment/*.yaml)
    seed: int = 0  # in [0, ema_pg_core.config.SEED_MAX] (checked by ema_pg_core.local.trainer.LocalConfig)
    run_dir: str | None = None  # where the run record goes; null = ${out_root}/<run_id>
    out_root: str = "outputs/runs"
    resume: Any = False
    """false | true: continue from run_dir's newest intact checkpoint (exactly), refusing any change of the
    config other than experiments.records.RESUME_MAY_CHANGE | force: continue with the changes (recorded
    in resumes.jsonl, flagged by `emapg report`)."""
    smoke: bool = False  # tiny sizes, 2 iterations: a seconds-long end-to-end check of any preset
    stages: list[Any] = field(default_factory=list)
    """A staged run (experiments.stages): each entry a stage name of the task's STAGES (e.g. 8k) or
    {name, set: {dotted key: value}}; every stage continues the previous one's last checkpoint, anchor
    included, in the same run_dir. Empty: one stage (or the task's STAGES when `stage` is set)."""
    stage: str | None = None  # run the stages up to and including this one (null: all of them)
    resume_from: str | None = None
    """With `stage`: the previous stage's last checkpoint, trained elsewhere (a local iter_N directory, or a
    verl global_step_N directory); the stages before `stage` are then not run."""
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    health: HealthConfig = field(default_factory=HealthConfig)  # a rule that fires: the run is stopped_unhealthy
    backend: BackendConfig = field(default_factory=BackendConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
