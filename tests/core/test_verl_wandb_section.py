"""The run's W&B settings cross the verl launch intact: to_verl puts them in the emapg.runner_env section of
the command line with the hook that applies them (emapg.runner_setup), split_argv reads them back as the same
strings (ids that look like numbers included), the core calls the hook by name, and an unknown W&B key or a
malformed hook name is refused. Pure Python: no verl, no wandb."""

from pathlib import Path

import pytest
import yaml

from experiments.backends.verl.config import EmaPGSection, run_runner_setup, split_argv
from experiments.backends.verl.launch import RUNNER_SETUP, apply_wandb_env, to_verl

RUN = Path(__file__).resolve().parents[1] / "verl" / "golden" / "math_deepscaler_8k.run.yaml"


@pytest.mark.parametrize("run_id", ["0012e4x9", "00012345", "1e5", "true", "null"])
def test_wandb_section_round_trips_through_the_command_line(run_id):
    env = {
        "WANDB_RUN_ID": run_id,
        "WANDB_RESUME": "allow",
        "WANDB_RUN_GROUP": "ablate_tau",
        "WANDB_TAGS": "sweep:ablate_tau,tau=0.9",
        "WANDB_MODE": "offline",
        "WANDB_DIR": "/tmp/a b/run",
    }
    job = to_verl(yaml.safe_load(RUN.read_text()), env)
    assert "trainer.logger=[console,file,wandb]" in job.overrides
    _, section = split_argv(job.argv())
    assert section.runner_env == env and section.runner_setup == RUNNER_SETUP


def test_no_wandb_settings_no_wandb_logger():
    job = to_verl(yaml.safe_load(RUN.read_text()), {})
    assert "trainer.logger=[console,file]" in job.overrides and job.emapg["runner_env"] == {}


def test_unknown_wandb_key_is_refused():
    with pytest.raises(ValueError, match=r"unknown W&B setting\(s\) \['WANDB_NOTES'\]; allowed: WANDB_RUN_ID"):
        apply_wandb_env({"WANDB_NOTES": "x"})


def test_the_core_calls_the_runner_setup_hook_by_name(monkeypatch):
    seen = []
    monkeypatch.setattr("experiments.backends.verl.launch.apply_wandb_env", seen.append)
    run_runner_setup({"runner_setup": RUNNER_SETUP, "runner_env": {"WANDB_MODE": 1}})
    run_runner_setup({"runner_setup": None, "runner_env": {"WANDB_MODE": "x"}})  # no hook: nothing is called
    assert seen == [{"WANDB_MODE": "1"}]


@pytest.mark.parametrize("name", ["experiments.backends.verl", "a b:c", ":f", "m:", 3])
def test_a_malformed_runner_setup_is_refused(name):
    with pytest.raises(ValueError, match=r"emapg.runner_setup must be 'module:function' or null"):
        EmaPGSection.model_validate({"runner_setup": name})
