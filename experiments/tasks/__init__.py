"""Tasks: what the policy is trained and evaluated on (nanochat's pattern: one module per task).

Each task is one module with the same interface (the `TaskModule` protocol below); every module of
this package is found and registered in `TASKS` under its `NAME` when the package is imported, so a
new task is one new file (helpers that are not tasks go in modules named `_*`). A task module outside
this package is registered by `add(module)` in-process, or for every process of a run or sweep (Ray
workers included) by naming it in `$EMAPG_TASKS` (importable module names, comma-separated):

    task = get_task("search_tiny")
    env = task.make_env()                              # retriever for search_tiny, None for math_tiny
    ex = task.load("train", n=64, seed=0)[0]           # Example
    text = task.prompt(ex)                             # what the model sees
    ...generate until eos or one of task.STOP_STRINGS; while task.tool_response(resp, env) returns
    text (at most task.MAX_TURNS times), append it (an observation: no loss) and continue...
    r = task.reward(ex, resp)                          # float, built on task.evaluate (0/1)

A task module carries everything the rest of the tree needs to know about it, so nothing outside
it branches on task names: the trainer checks capabilities (`STOP_STRINGS`, `MAX_TURNS`), the warm
start reads `PRETRAIN`, the report reads `REPORTING`, `emapg rehearse` reads `REHEARSAL` and
`rehearsal_data`, and Hydra finds the presets of a task outside this package in its `CONF_DIR`.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import pkgutil
import random
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

ENV_TASKS = "EMAPG_TASKS"  # names task modules outside this package (importable names, comma-separated)


@dataclass(frozen=True)
class Example:
    """One problem. `answer` is the gold answer (a list = any of these aliases is correct)."""

    id: str  # stable, unique within a task (problem_id in evals.jsonl)
    prompt: str  # the problem text; `task.prompt(example)` gives the exact model input
    answer: str | list[str]
    meta: dict = field(default_factory=dict, compare=False)  # task-specific details (source, hops, terms, ...)


@dataclass(frozen=True)
class Source:
    """One data set a task's `prepare` loads (its `sources()` lists them): how `prepare` calls its
    loader for it, and where it comes from on the Hugging Face hub (`emapg data prepare`)."""

    args: tuple[str, ...]  # what `prepare` passes to its loader for this data set, e.g. ("amc",) or ("nq", "test")
    dataset: str  # Hugging Face dataset id
    config: str | None
    splits: tuple[str, ...]  # the split to read: the first of these the data set has
    fields: tuple[str, ...]  # the columns `prepare` reads from each row


@dataclass(frozen=True)
class Reporting:
    """What `emapg report` (analysis) reads from a task: plain data, so that analysis never imports
    more than this package's modules (no torch: task modules import heavy libraries inside functions)."""

    # Display names of the main table's columns, in order (a paper-format table: the published numbers of
    # `paper` beside ours, gains, an Average column); () = the per-benchmark acc / pass@1 / anchor table.
    benchmarks: tuple[str, ...] = ()
    names: dict[str, str] = field(default_factory=dict)  # logged name (lower case, alphanumerics) -> display name
    # Eval metrics in order of preference: curves and ablations plot the first logged; the paper-format table
    # reports the first.
    metrics: tuple[str, ...] = ("acc", "pass@1")
    paper: str | None = None  # the setting of analysis.paper whose published numbers the paper-format table shows


@dataclass(frozen=True)
class Rehearsal:
    """Sizes of the task's CPU rehearsal of a verl preset (`emapg rehearse`, experiments.ops.rehearse)."""

    prompt_tokens: int  # backend.verl.max_prompt_length: the longest generated prompt, chat template included
    turn_tokens: int  # rollout.max_new_tokens: one turn of the tiny model
    # The rest are of a multi-turn preset. backend.verl.max_response_length (all turns and observations);
    # None = turn_tokens.
    response_tokens: int | None = None
    max_turns: int = 2  # rollout.max_turns
    tool_response_tokens: int = 48  # backend.verl.max_tool_response_length


@dataclass
class RehearsalData:
    """What a task's `rehearsal_data(out_dir, rows)` wrote: its verl parquet files, (prompt, response)
    pairs for the tiny model's SFT, and for a retrieval task the corpus file (jsonl, `emapg retriever
    serve --corpus`)."""

    files: dict[str, str]
    sft: list[tuple[str, str]]
    corpus: str | None = None
    prompts: list[str] = field(default_factory=list)


def make_knobs(cls: type, task: str, knobs: dict[str, Any]):
    """`cls(**knobs)` with a ValueError naming unknown knobs and the allowed ones."""
    allowed = [f.name for f in fields(cls)]
    if unknown := sorted(set(knobs) - set(allowed)):
        raise ValueError(f"unknown {task} knob(s) {unknown}; allowed: {', '.join(allowed)}")
    return cls(**knobs)


def hash_split(key: str, buckets: int) -> str:
    """'test' for 1 in `buckets` keys (by a stable hash of `key`), else 'train': disjoint for every seed and n."""
    return "test" if int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % buckets == 0 else "train"


def check_load(split: str, n) -> None:
    """A generated task's `load` arguments: split 'train' or 'test', n an integer >= 1 (ValueError otherwise)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test'; got {split!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1; got {n!r}")


def write_prepared(out_dir: str, tables: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """Each table of verl rows as `<out_dir>/<name>.parquet` (what `prepared_examples` reads); {name: path}."""
    import pandas as pd

    out_dir = os.path.expanduser(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    written = {name: os.path.join(out_dir, f"{name}.parquet") for name in tables}
    for name, rows in tables.items():
        pd.DataFrame(rows).to_parquet(written[name], index=False)
    return written


def prepared_examples(
    task: str, data_dir: str, split: str, *, n: int, seed: int, example_id: Callable[[dict[str, Any]], str]
) -> list[Example]:
    """Up to `n` rows of `<data_dir>/<split>.parquet` (verl's schema, written by the task's `prepare`) in a
    `seed`-shuffled order, as Examples: the user message as prompt, the ground truth list as answer, the data
    source in meta; `example_id(row)` gives each id (unique within the task). ValueError naming a missing file."""
    import pandas as pd

    path = os.path.join(os.path.expanduser(data_dir), f"{split}.parquet")
    if not os.path.isfile(path):
        raise ValueError(
            f"{path} not found: run experiments.tasks.{task}.prepare({data_dir!r}) first "
            f"(or `emapg data prepare {task} --out {data_dir}`)"
        )
    df = pd.read_parquet(path)
    order = list(range(len(df)))
    random.Random(seed).shuffle(order)
    rows = [df.iloc[i].to_dict() for i in order[:n]]
    return [
        Example(
            id=example_id(r),
            prompt=r["prompt"][0]["content"],
            answer=list(r["reward_model"]["ground_truth"]),
            meta={"source": r["data_source"]},
        )
        for r in rows
    ]


class TaskModule(Protocol):
    """The interface every task module implements (documentation; modules satisfy it). The trainer's
    view of a task is another protocol, ema_pg_core.local.trainer.TrainerTask (`TaskAdapter`).

    Required: NAME, Knobs, MAX_NEW_TOKENS, load, prompt, evaluate. The rest is optional; a module
    that leaves it out gets the single-turn default (`_defaults`) when it is registered.
    """

    NAME: str
    Knobs: type  # frozen dataclass of the task's knobs; its defaults are the calibrated ones
    MAX_NEW_TOKENS: int  # recommended per-turn generation budget
    STOP_STRINGS: tuple[str, ...]  # generation pauses on these for the environment; default () = single turn
    MAX_TURNS: int  # environment calls allowed per rollout; default 0 (single turn)
    PRETRAIN: dict[str, Any]  # calibrated warm start (experiments.pretrain.PretrainConfig fields); default {}
    REPORTING: Reporting  # what the report shows; default Reporting() (per-benchmark acc, pass@1, anchor acc)
    REHEARSAL: Rehearsal | None  # `emapg rehearse` sizes, with rehearsal_data; default None (no rehearsal)
    CONF_DIR: str | None  # a Hydra config dir with the task's presets (experiment/*.yaml), for a task
    # outside this package; default None (presets in experiments/conf)

    def load(self, split: str, n: int, seed: int = 0, **knobs) -> list[Example]: ...
    def prompt(self, example: Example) -> str: ...
    def evaluate(self, example: Example, response: str) -> int: ...
    def reward(self, example: Example, response: str) -> float: ...  # default: float(evaluate)
    def demonstration(self, example: Example, rng=None) -> str: ...  # default: NotImplementedError
    def make_env(self, **knobs) -> Any: ...  # default: checks the knobs, returns None
    def tool_response(self, response_so_far: str, env: Any) -> str | None: ...  # default: None
    def rehearsal_data(self, out_dir: Path, rows: dict[str, int]) -> RehearsalData: ...  # with REHEARSAL

    # verl backend (real data): prepare(out_dir, loader) writes verl parquet; sources() -> list[Source]
    # lists what it loads (`emapg data prepare` needs both)


REQUIRED = ("NAME", "Knobs", "MAX_NEW_TOKENS", "load", "prompt", "evaluate")
TOOL_MEMBERS = ("MAX_TURNS", "make_env", "tool_response")  # what a tool task (STOP_STRINGS) defines itself


def _defaults(module: ModuleType) -> dict[str, Any]:
    """The optional members of `module` as a single-turn task without an environment has them."""

    def reward(example: Example, response: str) -> float:
        return float(module.evaluate(example, response))

    def demonstration(example: Example, rng=None) -> str:
        raise NotImplementedError(f"{module.NAME} has no demonstrations; start from a pretrained model (model.path)")

    def make_env(**knobs) -> None:
        make_knobs(module.Knobs, module.NAME, knobs)  # unknown knobs raise, as for tasks with an environment
        return None

    def tool_response(response_so_far: str, env: Any = None) -> None:
        return None

    constants = dict(STOP_STRINGS=(), MAX_TURNS=0, PRETRAIN={}, REPORTING=Reporting(), REHEARSAL=None, CONF_DIR=None)
    return constants | dict(reward=reward, demonstration=demonstration, make_env=make_env, tool_response=tool_response)


def register(module: ModuleType) -> ModuleType:
    """Check `module` against the `TaskModule` protocol and fill in the optional members it leaves out
    (`add` also enters it in `TASKS`)."""
    missing = [m for m in REQUIRED if not hasattr(module, m)]
    if getattr(module, "STOP_STRINGS", ()):
        missing += [m for m in TOOL_MEMBERS if not hasattr(module, m)]
    if getattr(module, "REHEARSAL", None) is not None and not hasattr(module, "rehearsal_data"):
        missing.append("rehearsal_data")
    if missing:
        raise TypeError(
            f"task module {module.__name__} lacks {', '.join(missing)} (the TaskModule protocol of "
            "experiments.tasks; modules that are not tasks are named _*)"
        )
    for name, default in _defaults(module).items():
        if not hasattr(module, name):
            setattr(module, name, default)
    if (module.MAX_TURNS > 0) != bool(module.STOP_STRINGS):
        raise TypeError(f"task module {module.__name__}: MAX_TURNS > 0 needs STOP_STRINGS, and the reverse")
    return module


def _discover() -> dict[str, ModuleType]:
    """Every task module of this package by its NAME (modules named _* are skipped), then those $EMAPG_TASKS
    names."""
    found: dict[str, ModuleType] = {}
    names = [f"{__name__}.{m.name}" for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)]
    names = [n for n in names if not n.rsplit(".", 1)[1].startswith("_")]
    names += [n.strip() for n in os.environ.get(ENV_TASKS, "").split(",") if n.strip()]
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            if name.startswith(f"{__name__}."):
                raise
            raise ImportError(f"{ENV_TASKS} names {name!r}, which cannot be imported ({e})") from e
        _enter(found, register(module))
    return found


def _enter(registry: dict[str, ModuleType], module: ModuleType) -> None:
    """Put `module` into `registry` under its NAME; TypeError when another module holds that name."""
    held = registry.get(module.NAME)
    if held is not None and held is not module:
        raise TypeError(f"task name {module.NAME!r} is used by {held.__name__} and {module.__name__}")
    registry[module.NAME] = module


# ------------------------------------------------------------------------------ the trainer's view
@dataclass
class ToolEnvAdapter:
    """The trainer's ToolEnv on top of a task module with STOP_STRINGS + tool_response(text, env)."""

    module: Any
    env: Any

    @property
    def stop(self) -> str:
        return self.module.STOP_STRINGS[0]

    def respond(self, response_so_far: str) -> str | None:
        return self.module.tool_response(response_so_far, self.env)


@dataclass
class TaskAdapter:
    """A `TrainerTask` (ema_pg_core.local.trainer, what the core trainer consumes) on top of a task module:
    its name, loaded splits and environment; prompt, reward and evaluate are the module's."""

    name: str
    module: Any
    train: list
    test: list
    env: ToolEnvAdapter | None = None

    def prompt(self, example) -> str:
        return self.module.prompt(example)

    def reward(self, example, response: str) -> float:
        return float(self.module.reward(example, response))

    def evaluate(self, example, response: str) -> int:
        return int(self.module.evaluate(example, response))


# Discovered after Example/make_knobs: the task modules import them from this package.
TASKS: dict[str, ModuleType] = _discover()


def get_task(name: str) -> ModuleType:
    """The task module registered under `name`; ValueError listing the valid names otherwise."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def add(module: ModuleType | str) -> ModuleType:
    """Register a task module (or its importable name) in this process's `TASKS`; returns the module. Other
    processes (a sweep's Ray workers) see it when its name is in $EMAPG_TASKS."""
    module = register(importlib.import_module(module) if isinstance(module, str) else module)
    _enter(TASKS, module)
    return module


def reporting(name: str) -> Reporting:
    """What the report shows for task `name`: its module's REPORTING, or the default for a name that is not
    registered (records of a task this install lacks, a bare test double)."""
    return getattr(TASKS.get(name), "REPORTING", None) or Reporting()


def conf_dirs() -> list[str]:
    """The Hydra config directories of the registered tasks that have one (`CONF_DIR`), absolute."""
    return sorted(
        {str(Path(m.CONF_DIR).expanduser().resolve()) for m in TASKS.values() if getattr(m, "CONF_DIR", None)}
    )
