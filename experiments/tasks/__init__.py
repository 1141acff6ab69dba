"""Tasks: what the policy is trained and evaluated on (nanochat's pattern: one module per task).

Each task is one module of this package with the same interface (the `Task` protocol below); every
module here is found and registered in `TASKS` under its `NAME` when the package is imported, so a
new task is one new file (helpers that are not tasks go in modules named `_*`):

    task = get_task("search_tiny")
    env = task.make_env()                              # retriever for search_tiny, None for math_tiny
    ex = task.load("train", n=64, seed=0)[0]           # Example
    text = task.prompt(ex)                             # what the model sees
    ...generate until eos or one of task.STOP_STRINGS; while task.tool_response(resp, env) returns
    text (at most task.MAX_TURNS times), append it (an observation: no loss) and continue...
    r = task.reward(ex, resp)                          # float, built on task.evaluate (0/1)

The trainer checks capabilities (`STOP_STRINGS`, `MAX_TURNS`), never task names. `TaskAdapter`
(below) is what the local trainer consumes: a task module with its loaded splits and environment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from types import ModuleType
from typing import Any, Protocol


@dataclass(frozen=True)
class Example:
    """One problem. `answer` is the gold answer (a list = any of these aliases is correct)."""

    id: str
    """Stable, unique within a task (used as problem_id in evals.jsonl)."""
    prompt: str
    """The problem text; `task.prompt(example)` gives the exact model input."""
    answer: str | list[str]
    """Gold answer(s)."""
    meta: dict = field(default_factory=dict, compare=False)
    """Task-specific details (source, hops, terms, ...)."""


@dataclass(frozen=True)
class Source:
    """One data set a task's `prepare` loads (its `sources()` lists them): how `prepare` calls its
    loader for it, and where it comes from on the Hugging Face hub (`emapg data prepare`)."""

    args: tuple[str, ...]
    """The arguments `prepare` passes to its loader for this data set, e.g. ("amc",) or ("nq", "test")."""
    dataset: str
    """Hugging Face dataset id."""
    config: str | None
    splits: tuple[str, ...]
    """The split to read: the first of these the data set has."""
    fields: tuple[str, ...]
    """The columns `prepare` reads from each row."""


def make_knobs(cls: type, task: str, knobs: dict[str, Any]):
    """`cls(**knobs)` with a ValueError naming unknown knobs and the allowed ones."""
    allowed = [f.name for f in fields(cls)]
    unknown = sorted(set(knobs) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {task} knob(s) {unknown}; allowed: {', '.join(allowed)}")
    return cls(**knobs)


def read_prepared(task: str, data_dir: str, split: str, n: int, seed: int) -> list[dict[str, Any]]:
    """Up to `n` rows of `<data_dir>/<split>.parquet` (verl's schema, written by the task's
    `prepare`) in a `seed`-shuffled order; ValueError naming the missing file otherwise."""
    import os
    import random

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
    return [df.iloc[i].to_dict() for i in order[:n]]


def prepared_examples(
    task: str, data_dir: str, split: str, n: int, seed: int, example_id: Callable[[dict[str, Any]], str]
) -> list[Example]:
    """`read_prepared`'s rows as Examples: the user message as prompt, the ground truth list as answer,
    the data source in meta; `example_id(row)` gives each id (unique within the task)."""
    return [
        Example(
            id=example_id(r),
            prompt=r["prompt"][0]["content"],
            answer=list(r["reward_model"]["ground_truth"]),
            meta={"source": r["data_source"]},
        )
        for r in read_prepared(task, data_dir, split, n, seed)
    ]


class Task(Protocol):
    """The module interface every task implements (documentation; modules satisfy it).

    Required: NAME, Knobs, MAX_NEW_TOKENS, load, prompt, evaluate. The rest is optional; a module
    that leaves it out gets the single-turn default (`_defaults`) when it is registered.
    """

    NAME: str
    Knobs: type  # frozen dataclass of the task's knobs; its defaults are the calibrated ones
    MAX_NEW_TOKENS: int  # recommended per-turn generation budget
    STOP_STRINGS: tuple[str, ...]  # generation pauses on these for the environment; default () = single turn
    MAX_TURNS: int  # environment calls allowed per rollout; default 0 (single turn)
    PRETRAIN: dict[str, Any]  # calibrated warm start (experiments.pretrain.PretrainConfig fields); default {}

    def load(self, split: str, n: int, seed: int = 0, **knobs) -> list[Example]: ...
    def prompt(self, example: Example) -> str: ...
    def evaluate(self, example: Example, response: str) -> int: ...
    def reward(self, example: Example, response: str) -> float: ...  # default: float(evaluate)
    def demonstration(self, example: Example, rng=None) -> str: ...  # default: NotImplementedError
    def make_env(self, **knobs) -> Any: ...  # default: checks the knobs, returns None
    def tool_response(self, response_so_far: str, env: Any) -> str | None: ...  # default: None

    # verl backend (real data): prepare(out_dir, loader) writes verl parquet; sources() -> list[Source]
    # lists what it loads (`emapg data prepare` needs both)


REQUIRED = ("NAME", "Knobs", "MAX_NEW_TOKENS", "load", "prompt", "evaluate")
TOOL_MEMBERS = ("MAX_TURNS", "make_env", "tool_response")
"""What a tool task (non-empty STOP_STRINGS) must define itself."""


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

    return {
        "STOP_STRINGS": (),
        "MAX_TURNS": 0,
        "PRETRAIN": {},
        "reward": reward,
        "demonstration": demonstration,
        "make_env": make_env,
        "tool_response": tool_response,
    }


def register(module: ModuleType) -> ModuleType:
    """Check `module` against the `Task` protocol and fill in the optional members it leaves out."""
    missing = [m for m in REQUIRED if not hasattr(module, m)]
    if getattr(module, "STOP_STRINGS", ()):
        missing += [m for m in TOOL_MEMBERS if not hasattr(module, m)]
    if missing:
        raise TypeError(
            f"task module {module.__name__} lacks {', '.join(missing)} (the Task protocol of "
            "experiments.tasks; modules that are not tasks are named _*)"
        )
    for name, default in _defaults(module).items():
        if not hasattr(module, name):
            setattr(module, name, default)
    if (module.MAX_TURNS > 0) != bool(module.STOP_STRINGS):
        raise TypeError(f"task module {module.__name__}: MAX_TURNS > 0 needs STOP_STRINGS, and the reverse")
    return module


def _discover() -> dict[str, ModuleType]:
    """Every task module of this package by its NAME (modules named _* are skipped)."""
    import importlib
    import pkgutil

    found: dict[str, ModuleType] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = register(importlib.import_module(f"{__name__}.{info.name}"))
        if module.NAME in found:
            raise TypeError(f"task name {module.NAME!r} is used by {found[module.NAME].__name__} and {module.__name__}")
        found[module.NAME] = module
    return found


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
    """The trainer's Task protocol (ema_pg_core.local.trainer) on top of a task module: its name, loaded
    splits and environment; prompt, reward and evaluate are the module's."""

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
