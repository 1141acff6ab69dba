"""Tasks: what the policy is trained and evaluated on (nanochat's pattern, style.md #14).

Each task is a module with the same interface (the `Task` protocol below), registered in `TASKS`:

    task = get_task("search_tiny")
    env = task.make_env()                              # retriever for search_tiny, None for math_tiny
    ex = task.load("train", n=64, seed=0)[0]           # Example
    text = task.prompt(ex)                             # what the model sees
    ...generate until eos or one of task.STOP_STRINGS; while task.tool_response(resp, env) returns
    text (at most task.MAX_TURNS times), append it (an observation: no loss) and continue...
    r = task.reward(ex, resp)                          # float, built on task.evaluate (0/1)

The trainer checks capabilities (`STOP_STRINGS`, `MAX_TURNS`), never task names.
"""

from __future__ import annotations

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
        raise ValueError(f"{path} not found: run experiments.tasks.{task}.prepare({data_dir!r}) first (needs a network)")
    df = pd.read_parquet(path)
    order = list(range(len(df)))
    random.Random(seed).shuffle(order)
    return [df.iloc[i].to_dict() for i in order[:n]]


class Task(Protocol):
    """The module interface every task implements (documentation; modules satisfy it)."""

    NAME: str
    Knobs: type  # frozen dataclass of the task's knobs; its defaults are the calibrated ones
    STOP_STRINGS: tuple[str, ...]  # generation pauses on these for the environment; () = single turn
    MAX_TURNS: int  # environment calls allowed per rollout (0 = single turn)
    MAX_NEW_TOKENS: int  # recommended per-turn generation budget

    def load(self, split: str, n: int, seed: int = 0, **knobs) -> list[Example]: ...
    def prompt(self, example: Example) -> str: ...
    def extract_answer(self, response: str) -> str | None: ...
    def evaluate(self, example: Example, response: str) -> int: ...
    def reward(self, example: Example, response: str) -> float: ...
    def demonstration(self, example: Example, rng=None) -> str: ...
    def make_env(self, **knobs) -> Any: ...
    def tool_response(self, response_so_far: str, env: Any) -> str | None: ...


# Imported after Example/make_knobs: the task modules import them from this package.
from experiments.tasks import math, math_tiny, search, search_tiny  # noqa: E402

TASKS: dict[str, ModuleType] = {m.NAME: m for m in (math_tiny, search_tiny, math, search)}


def get_task(name: str) -> ModuleType:
    """The task module registered under `name`; ValueError listing the valid names otherwise."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]
