"""A task is one registry entry: a throwaway task module written by this test outside experiments/tasks, with
its presets in its own config directory (its CONF_DIR), goes through a 2-iteration sweep on a local Ray (the
trial workers register it from $EMAPG_TASKS), the report (its REPORTING) and a rehearsal config build (its
REHEARSAL and rehearsal_data). Nothing of it is committed: no task-name branch anywhere knows it."""

from __future__ import annotations

import os
import textwrap

import pytest
import yaml

NAME = "echo_digit"
MODULE = "echo_digit_task"
TASK = '''
"""echo_digit: repeat the digit before "=" (the throwaway task of tests/experiments/test_task_plugin.py)."""

import os
import random
from dataclasses import dataclass

from experiments.tasks import Example, Rehearsal, RehearsalData, Reporting

NAME = "echo_digit"
MAX_NEW_TOKENS = 4
PRETRAIN = dict(steps=2, target_acc=None, eval_every=1, batch_size=4, val_size=4)
REPORTING = Reporting(benchmarks=("Echo",), names={"echodigit": "Echo"}, metrics=("acc",))
REHEARSAL = Rehearsal(prompt_tokens=32, turn_tokens=4)
CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "echo_conf")


@dataclass(frozen=True)
class Knobs:
    """None: the echo task has no difficulty knobs (task.knobs.<name> for those that do)."""


def load(split, n, seed=0, **knobs):
    rng = random.Random(f"{split}/{seed}")
    return [Example(f"{NAME}/{split}/{i}", f"{d}=", str(d)) for i, d in enumerate(rng.randrange(10) for _ in range(n))]


def prompt(example):
    return example.prompt


def evaluate(example, response):
    return int(response.strip() == example.answer)


def demonstration(example, rng=None):
    return example.answer


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(solution_str.strip() in list(ground_truth))


def rehearsal_data(out_dir, rows):
    import pandas as pd

    os.makedirs(out_dir, exist_ok=True)
    files = {}
    for split in ("train", "test"):
        files[split] = os.path.join(out_dir, f"{split}.parquet")
        table = [
            {
                "data_source": NAME,
                "prompt": [{"role": "user", "content": ex.prompt}],
                "ability": "echo",
                "reward_model": {"style": "rule", "ground_truth": [ex.answer]},
                "extra_info": {"split": split, "index": i},
            }
            for i, ex in enumerate(load(split, rows[split]))
        ]
        pd.DataFrame(table).to_parquet(files[split], index=False)
    return RehearsalData(files=files, sft=[(ex.prompt, ex.answer) for ex in load("train", 8, seed=1)])
'''
PRESET = """
# @package _global_
defaults:
  - override /task: echo_digit
  - override /algo: {algo}
  - _self_

experiment: echo_digit_{algo}
"""
VERL_PRESET = """
# @package _global_
defaults:
  - override /task: echo_digit
  - override /model: hf
  - override /algo: ema_pg
  - override /backend: verl
  - _self_

experiment: echo_digit_verl
model: {path: unused}
backend:
  verl:
    reward_fn: echo_digit_task:compute_score
"""


@pytest.fixture
def echo_task(tmp_path, monkeypatch):
    """The throwaway task: its module and presets in a temporary directory, named in $EMAPG_TASKS (with the
    directory on PYTHONPATH) for every process started from here, and registered in this one by `add`."""
    from hydra.core.config_store import ConfigStore

    from experiments import tasks

    root = tmp_path / "plugin"
    (root / "echo_conf" / "experiment").mkdir(parents=True)
    (root / f"{MODULE}.py").write_text(textwrap.dedent(TASK))
    for algo in ("grpo", "ema_pg"):
        (root / "echo_conf" / "experiment" / f"echo_digit_{algo}.yaml").write_text(PRESET.format(algo=algo))
    (root / "echo_conf" / "experiment" / "echo_digit_verl.yaml").write_text(VERL_PRESET)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(tasks.ENV_TASKS, MODULE)
    for key, value in {
        "EMAPG_CACHE": str(tmp_path / "cache"),
        "WANDB_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(tasks, "TASKS", dict(tasks.TASKS))  # the registry as it was, after the test
    module = tasks.add(MODULE)
    yield module
    ConfigStore.instance().repo.get("task", {}).pop(f"{NAME}.yaml", None)


def test_registering_checks_the_module_and_refuses_a_second_holder_of_its_name(echo_task):
    import types

    from experiments import build, tasks

    assert tasks.get_task(NAME) is echo_task and tasks.add(echo_task) is echo_task  # again: the same module
    assert {"echo_digit_grpo", "echo_digit_ema_pg", "echo_digit_verl"} <= set(build.presets())
    assert "echo_digit_grpo" not in build.presets(tasks_dirs=False)  # what resolve_presets snapshots
    other = types.ModuleType("other")
    other.NAME, other.Knobs, other.MAX_NEW_TOKENS = NAME, echo_task.Knobs, 4
    other.load, other.prompt, other.evaluate = echo_task.load, echo_task.prompt, echo_task.evaluate
    with pytest.raises(TypeError, match=f"task name '{NAME}' is used by {MODULE} and other"):
        tasks.add(other)
    other.NAME, other.REHEARSAL = "other", echo_task.REHEARSAL
    with pytest.raises(TypeError, match="lacks rehearsal_data"):
        tasks.add(other)


def test_a_name_in_emapg_tasks_that_cannot_be_imported_is_named(monkeypatch):
    import subprocess
    import sys

    env = {**os.environ, "EMAPG_TASKS": "no_such_task_module"}
    out = subprocess.run(
        [sys.executable, "-c", "import experiments.tasks"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert "EMAPG_TASKS names 'no_such_task_module', which cannot be imported" in out.stderr


@pytest.mark.filterwarnings("ignore:pretrain .* did not reach target_acc")
def test_a_throwaway_task_runs_a_sweep_and_gets_its_report(echo_task, tmp_path):
    """Two smoke-sized trials (GRPO and EMA-PG, 2 iterations each) of the throwaway task in Ray workers, and the
    report's table in the layout its REPORTING asks for: the paper format, its one benchmark as "Echo"."""
    from sweeps import tune
    from sweeps.spec import parse

    spec = parse(
        {
            "name": "echo",
            "base": {"overrides": {"smoke": True, "logger": "none"}},
            "space": {"experiment": {"grid": ["echo_digit_grpo", "echo_digit_ema_pg"]}},
            "metric": f"eval/{NAME}/acc",
            "max_concurrent": 2,
        }
    )
    out = tune.run_sweep(spec, tmp_path / "echo", num_cpus=2, progress=False)
    runs = sorted((out / "runs").iterdir())
    assert len(runs) == 2
    for run_dir in runs:
        assert (run_dir / "status").read_text().startswith("finished")
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["task"]["name"] == NAME
        assert f'"eval/{NAME}/acc"' in (run_dir / "metrics.jsonl").read_text()
    table = (out / "report" / f"{NAME}_main.md").read_text()
    header = table.splitlines()[2]  # after the caption and a blank line
    assert header.startswith("| method | Echo | Average |"), table
    assert "— paper" not in table  # no analysis.paper setting named: no paper rows
    assert (out / "report" / f"{NAME}_curve_{NAME}.png").is_file()  # its REPORTING.metrics: acc


def test_a_throwaway_task_builds_a_rehearsal_config(echo_task, tmp_path):
    """`emapg rehearse`'s config of the task's verl preset: the task's data, written by its rehearsal_data, and
    its REHEARSAL sizes; the result composes and validates as `emapg train` would (no verl needed)."""
    from experiments import build
    from experiments.ops.rehearse import Shared, rehearsal_overrides

    target = ["experiment=echo_digit_verl"]
    data = Shared(tmp_path / "shared").data(NAME)
    assert sorted(data.files) == ["test", "train"] and all(os.path.isfile(f) for f in data.files.values())
    model = tmp_path / "model"
    model.mkdir()
    overrides = rehearsal_overrides(build.compose(target), str(model), data, tmp_path / "run", steps=3)
    cfg = build.compose(target + overrides)
    build.validate(cfg)
    assert (cfg.task.name, cfg.backend.name, cfg.backend.verl.train_files) == (NAME, "verl", data.files["train"])
    assert (cfg.backend.verl.max_prompt_length, cfg.rollout.max_new_tokens) == (32, 4)
    assert cfg.backend.verl.max_response_length == 4
