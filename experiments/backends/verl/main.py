"""Launch EMA-PG on verl 0.9.1 (GPUs + vLLM/SGLang; see docs/scaling-out.md).

    python -m experiments.backends.verl.main <verl overrides ...> emapg.kl.type=topk_reverse emapg.anchor.tau=0.9 ...
    python -m experiments.backends.verl.main --print-config <same args>     # compose + validate, no Ray, no GPUs

Composes verl's ``ppo_trainer`` config with the verl overrides (Hydra; verl's defaults and struct checks
apply), adds the validated ``emapg:`` section, checks the plugin's requirements and verl's ``validate_config``,
then runs verl's ``run_ppo`` with a TaskRunner that registers our trainer in its process first.
V1 sync trainer only, Ulysses SP = 1.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import ray
from hydra import compose as hydra_compose
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf, open_dict
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from experiments.backends.verl import require_verl

require_verl()  # before verl's trainer modules detect the platform (VERL_PLATFORM=cpu must be known then)
from verl.trainer.main_ppo import TaskRunnerV1, run_ppo  # noqa: E402
from verl.trainer.ppo.utils import need_critic, need_reference_policy  # noqa: E402
from verl.utils.config import validate_config  # noqa: E402
from verl.utils.device import auto_set_device  # noqa: E402

from experiments.backends.verl.config import rotate, run_runner_setup, split_argv  # noqa: E402
from experiments.backends.verl.failures import RUNNING, VerlExited, create_actor  # noqa: E402
from experiments.backends.verl.placement import PLACEMENT_GROUP_ENV, trial_placement_group  # noqa: E402
from experiments.backends.verl.resources import (  # noqa: E402
    TASK_RUNNER_CPUS,
    _accelerator,
    check_fits,
    cluster_size,
    ray_demand,
    trial_placement,
    wait_for_room,
)

NAMESPACE_ENV = "EMAPG_RAY_NAMESPACE"  # of a verl job inside a sweep trial (one per launch: named actors never meet)
DRIVER_LOG = "verl_driver.log"  # output of the verl job a sweep trial runs as a child process (in the run directory)


def compose(argv: list[str]):
    """verl's ppo_trainer config + our section, validated (the config ``run_ppo`` receives)."""
    from experiments.backends.verl.trainer import check_verl  # loads verl's trainer

    verl_args, section = split_argv(argv)
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = hydra_compose(config_name="ppo_trainer", overrides=verl_args)
    with open_dict(cfg):
        cfg.emapg = section.model_dump()
    check_verl(cfg, section)
    return cfg


class EmaPGTaskRunner(TaskRunnerV1.__ray_actor_class__):
    """verl's TaskRunnerV1, with our trainer registered in its process first."""

    def run(self, config):
        import experiments.backends.verl.trainer  # noqa: F401  registers trainer_mode "emapg_sync"

        run_runner_setup(config.emapg)  # the application's hook (emapg's: W&B for verl's tracker), this process
        if config.emapg.get("metrics_path"):  # verl's "file" logger (created in this process) writes here
            os.makedirs(os.path.dirname(os.path.abspath(config.emapg.metrics_path)), exist_ok=True)
            rotate(config.emapg.metrics_path)  # keep an earlier attempt's lines: verl opens the file "wb"
            os.environ["VERL_FILE_LOGGER_PATH"] = config.emapg.metrics_path
        return super().run(config)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    dry = "--print-config" in argv
    cfg = compose([a for a in argv if a != "--print-config"])
    if cfg.emapg.device == "cpu":  # before verl's device detection (which would report cuda)
        from experiments.backends.verl import cpu, hf_rollout  # loads transformers

        cpu.install()
        hf_rollout.register()

    auto_set_device(cfg)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    if dry:
        print(OmegaConf.to_yaml(cfg))
        return 0
    if trial_placement_group() is not None:
        join_trial(cfg)  # the trial reserved everything already
    else:
        check_resources(cfg)

    run_ppo(cfg, task_runner_class=_Launch(ray.remote(num_cpus=TASK_RUNNER_CPUS)(EmaPGTaskRunner), cfg))
    return 0


class _Launch:
    """What verl's ``run_ppo`` calls ``.remote()`` on: starts the TaskRunner and keeps its handle, so that
    ``failures.stop_run`` can kill it (its workers, servers and TransferQueue share its fate)."""

    def __init__(self, actor_class, config):
        self._cls, self.config = actor_class, config

    def options(self, **kwargs):
        return _Launch(self._cls.options(**kwargs), self.config)

    def remote(self, *args, **kwargs):
        create_actor()  # before any worker exists: their failed rollouts are reported there
        cls, pg = self._cls, trial_placement_group()
        if pg is None:  # Ray is up now: on a shared cluster, wait (visibly) until the run's demand is free
            wait_for_room(ray_demand(self.config), _accelerator(self.config), say=lambda m: print(m, flush=True))
        else:  # rank 0's bundle holds the TaskRunner; what it starts stays in the group
            _check_trial_group(pg, self.config)
            cls = cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
                )
            )
        RUNNING["runner"] = handle = cls.remote(*args, **kwargs)
        return handle


def _check_trial_group(pg, cfg) -> None:
    """The trial's placement group is the one this job needs (``resources.trial_placement``)."""
    want, have = trial_placement(cfg), pg.bundle_specs
    if [b for b in want.bundles if b] != have:
        raise ValueError(
            f"the sweep trial reserved {have}, but this verl job needs {want.describe()}; the sweep computes the "
            "reservation from the same config (sweeps.tune), so the trial's config and this job's differ"
        )


def join_trial(cfg) -> None:
    """In the child process ``launch`` starts inside a sweep trial: verl's own ``ray.init`` joins the trial's
    cluster as a job of its own (``NAMESPACE_ENV``), the trial's placement group in every worker's environment."""
    with open_dict(cfg):  # nothing here may call Ray: RAY_ADDRESS would connect it, without this config
        init = cfg.ray_kwargs.ray_init
        runtime_env = OmegaConf.to_container(init.get("runtime_env") or OmegaConf.create({}), resolve=True)
        runtime_env.setdefault("env_vars", {})[PLACEMENT_GROUP_ENV] = os.environ[PLACEMENT_GROUP_ENV]
        cfg.ray_kwargs.ray_init = {
            "address": os.environ["RAY_ADDRESS"],
            "namespace": os.environ[NAMESPACE_ENV],
            "runtime_env": runtime_env,
        }


def check_resources(cfg) -> None:
    """Refuse, before Ray starts anything, a run whose actors and placement groups cannot all be placed
    (Ray would wait for them forever). On the CPU platform the local cluster is sized to the demand:
    Ray's CPUs are a count of reservations there, not of cores."""
    need = ray_demand(cfg)
    if cfg.emapg.device == "cpu" and not ray.is_initialized() and cfg.ray_kwargs.ray_init.get("num_cpus") is None:
        with open_dict(cfg):
            cfg.ray_kwargs.ray_init.num_cpus = int(sum(item.cpus for item in need))
    have = cluster_size(cfg, ray.cluster_resources if ray.is_initialized() else None)
    if have is not None:  # None: ray.init joins an existing cluster, whose size is known only once connected
        check_fits(need, *have)


def launch(argv: list[str], run_dir: Path | None = None) -> int:
    """Run ``main(argv)`` from this process; inside a Ray Tune trial, as a Ray job of its own (``_run_in_trial``)."""
    pg = ray.util.get_current_placement_group() if ray.is_initialized() else None  # a Tune trial's (sweeps.tune)
    if pg is None:
        return main(argv)
    if run_dir is None:
        raise ValueError("a verl launch inside a sweep trial needs the run directory (for verl_driver.log)")
    return _run_in_trial(argv, pg, run_dir)


def _run_in_trial(argv: list[str], pg, run_dir: Path, launcher: tuple[str, ...] = ()) -> int:
    """verl as a Ray job of its own in a child process that dies with this one, its actors in the trial's group
    ``pg``, its output in ``<run_dir>/verl_driver.log``; ``VerlExited`` on a non-zero exit. `launcher`: for tests."""
    namespace = f"emapg_{uuid.uuid4().hex[:12]}"
    env = {
        **os.environ,
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        PLACEMENT_GROUP_ENV: pg.id.hex(),
        NAMESPACE_ENV: namespace,
        "PYTHONUNBUFFERED": "1",
        "RAY_ENABLE_AUTO_CONNECT": "0",  # only verl's own ray.init (join_trial) connects the child
    }
    env.pop("RAY_JOB_CONFIG_JSON_ENV_VAR", None)  # the trial's job config is not the child's
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / DRIVER_LOG
    with open(log, "a") as out:
        proc = subprocess.Popen(
            [*(launcher or (sys.executable, "-m", "experiments.backends.verl.main")), *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
        )
    RUNNING.update(process=proc, namespace=namespace)
    code = proc.wait()
    if code:
        raise VerlExited(code, log)
    return 0


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the thread that started it dies (Linux ``PR_SET_PDEATHSIG``),
    so that a killed trial never leaves a verl job holding its placement group."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:  # not glibc: Ray still ends the job's actors when the trial's group is removed
        pass


if __name__ == "__main__":
    sys.exit(main())
