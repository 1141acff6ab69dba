"""The run's W&B settings cross the verl launch intact: to_verl puts them in the emapg.wandb section of the
command line, split_argv reads them back as the same strings (ids that look like numbers included), and
an unknown key is refused. Pure Python: no verl, no wandb."""

from pathlib import Path

import pytest
import yaml

from ema_pg_core.verl.config import EmaPGSection, split_argv, to_verl

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
    _, section = split_argv(job.command()[3:])
    assert section.wandb == env


def test_no_wandb_settings_no_wandb_logger():
    job = to_verl(yaml.safe_load(RUN.read_text()), {})
    assert "trainer.logger=[console,file]" in job.overrides and job.emapg["wandb"] == {}


def test_unknown_wandb_key_is_refused():
    with pytest.raises(ValueError, match=r"unknown emapg.wandb key\(s\) \['WANDB_NOTES'\]; allowed: WANDB_RUN_ID"):
        EmaPGSection.from_dict({"wandb": {"WANDB_NOTES": "x"}})
