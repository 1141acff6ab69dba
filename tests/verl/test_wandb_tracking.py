"""A verl run's W&B settings reach verl 0.9.1's own tracker (``verl.utils.tracking.Tracking``), config level,
on CPU: the run config is compiled as `emapg train` compiles it (``experiments.run._verl_wandb`` +
``to_verl``), composed by verl's Hydra (``experiments.backends.verl.main.compose``), the TaskRunner's setup hook
(``emapg.runner_setup`` = ``apply_wandb_env``) sets the variables, and verl's ``Tracking`` opens the W&B run
(offline, in the run directory). No Ray, no training: the tracker is verl's, called as verl's trainer calls it."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.verl


def _composed(run_dir, *overrides):
    from omegaconf import OmegaConf

    from experiments import build
    from experiments.backends.verl.launch import to_verl
    from experiments.backends.verl.main import compose
    from experiments.run import _verl_wandb

    cfg = build.compose(["experiment=math_deepscaler_ema_pg", f"run_dir={run_dir}", *overrides])
    build.validate(cfg)
    wandb = _verl_wandb(cfg, run_dir)
    return compose(to_verl(OmegaConf.to_container(cfg, resolve=True), wandb).argv()), wandb


def _track(config):
    """verl's trainer opens its tracker so (verl/trainer/ppo/v1/trainer_base.py, ``fit``)."""
    from omegaconf import OmegaConf
    from verl.utils.tracking import Tracking

    return Tracking(
        project_name=config.trainer.project_name,
        experiment_name=config.trainer.experiment_name,
        default_backend=config.trainer.logger,
        config=OmegaConf.to_container(config, resolve=True),
    )


@pytest.fixture
def clean_env(monkeypatch):
    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("WANDB_SILENT", "true")
    return monkeypatch


def test_group_tags_id_resume_reach_verls_tracker(tmp_path, clean_env):
    import wandb

    clean_env.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "verl_metrics.jsonl"))  # as the TaskRunner sets it
    from experiments.backends.verl.config import run_runner_setup

    run_dir = tmp_path / "math__math_deepscaler_ema_pg__s0__abc12_00001"
    overrides = ("logger.group=ablate_tau", 'logger.tags=["sweep:ablate_tau","tau=0.9"]', "algo.anchor.tau=0.9")
    config, env = _composed(run_dir, *overrides)
    assert "wandb" in config.trainer.logger and config.trainer.experiment_name == run_dir.name
    assert dict(config.emapg.runner_env) == env
    assert config.emapg.runner_setup == "experiments.backends.verl.launch:apply_wandb_env"
    saved = json.loads((run_dir / "wandb_run.json").read_text())
    ids = []
    for attempt in range(2):  # the second is a resume: same W&B run
        with clean_env.context() as m:
            for key in env:
                m.delenv(key, raising=False)
            run_runner_setup(config.emapg)  # what the TaskRunner does before verl's trainer starts
            tracker = _track(config)
            run = wandb.run
            assert (run.project, run.name, run.group) == ("emapg-math", run_dir.name, "ablate_tau")  # the preset's
            assert tuple(run.tags) == ("sweep:ablate_tau", "tau=0.9") and run.settings.resume == "allow"
            assert run.settings.mode == "offline" and run.config["algo"]["anchor"]["tau"] == 0.9  # the run's config
            assert "actor_rollout_ref" in run.config  # and verl's own sections
            ids.append(run.id)
            tracker.finish()
        if attempt == 0:  # a later attempt composes again: the id persisted in the run directory is reused
            config, env = _composed(run_dir, *overrides, "resume=true")
    assert ids == [saved["id"], saved["id"]]
    offline = sorted((run_dir / "wandb").glob(f"offline-run-*-{saved['id']}"))
    assert len(offline) == 2  # one per attempt, the same W&B run


@pytest.mark.parametrize("override", ["logger=none", "logger.mode=disabled"])
def test_no_wandb_for_verl_when_off(tmp_path, clean_env, override):
    config, env = _composed(tmp_path / "run", override)
    assert env == {} and dict(config.emapg.runner_env) == {} and "wandb" not in config.trainer.logger
    assert not (tmp_path / "run" / "wandb_run.json").exists()
