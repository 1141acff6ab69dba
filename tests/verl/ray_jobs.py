"""Ray drivers the placement tests start as child processes (each its own Ray job on the test's cluster).

python tests/verl/ray_jobs.py transfer_queue <address> <namespace> <name> <barrier dir> <fail: 0|1>
python -m experiments.backends.verl.main ... is what a sweep trial starts; ``probe_main`` stands in for it here.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path


def transfer_queue(address: str, namespace: str, name: str, barrier: str, fail: str) -> None:
    """One verl-like job: the run's setup hook in every worker, its FailureLog, a TaskRunner stand-in that starts
    TransferQueue, puts a key named after the job, optionally logs a failed rollout, waits for the other job to
    have done the same, and lists the keys its TransferQueue holds. Prints one JSON line."""
    import ray

    from experiments.backends.verl.failures import SETUP_HOOK, create_actor

    ray.init(address=address, namespace=namespace, runtime_env={"worker_process_setup_hook": SETUP_HOOK})
    log = create_actor()

    @ray.remote(num_cpus=0)
    class Runner:
        def go(self) -> list[str]:
            import transfer_queue as tq
            from omegaconf import OmegaConf
            from tensordict import TensorDict

            tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
            import torch

            tq.kv_put(key=name, partition_id="train", fields=TensorDict({"x": torch.ones(1, 2)}, batch_size=1))
            if fail == "1":
                logging.getLogger("agent_loop").error("Error in _run_prompt: boom in %s", name)
            _meet(barrier, "put", name)  # both jobs have put their key
            keys = sorted(tq.kv_list("train").get("train", {}))
            named = [
                a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == "TransferQueueController"
            ]
            _meet(barrier, "listed", name)  # neither job ends (and takes its controller along) before both looked
            return keys, named

    keys, named = ray.get(Runner.remote().go.remote(), timeout=120)
    time.sleep(1.0)  # the failure report is fire-and-forget
    failure, count = ray.get(log.first.remote())
    print(json.dumps({"keys": keys, "failures": count, "cause": (failure or {}).get("cause"), "controllers": named}))
    sys.stdout.flush()


def _meet(barrier: str, stage: str, name: str, jobs: int = 2) -> None:
    """Wait until `jobs` jobs have reached `stage` (a file each in `barrier`)."""
    Path(barrier, f"{stage}.{name}").touch()
    while len(list(Path(barrier).glob(f"{stage}.*"))) < jobs:
        time.sleep(0.2)


def probe_main(probe_out: str, argv: list[str]) -> int:
    """What ``experiments.backends.verl.main`` does in a sweep trial's child, with a TaskRunner that only reports what
    its workers see: the composed verl config joins the trial (``join_trial``) and verl's ``run_ppo`` starts Ray
    and the TaskRunner (``_Launch``: in the trial's group). The TaskRunner then logs a failed rollout and waits
    until the trial has seen it (``<output>.seen``)."""
    import ray
    from omegaconf import open_dict

    from experiments.backends.verl import require_verl

    require_verl()  # before verl detects a platform: registers ours when VERL_PLATFORM=cpu (as main does)
    from verl.trainer.main_ppo import run_ppo

    from experiments.backends.verl.main import _Launch, compose, join_trial

    cfg = compose(argv)
    join_trial(cfg)
    with open_dict(cfg):  # where the TaskRunner writes what its child saw (every worker of the job has it)
        cfg.ray_kwargs.ray_init.runtime_env.env_vars.PROBE_OUT = probe_out

    class Probe:
        def run(self, config):
            @ray.remote(num_cpus=0)
            def child():
                import logging as lg

                from experiments.backends.verl import failures, placement

                hooked = any(isinstance(h, failures._Forward) for h in lg.getLogger().handlers)
                pg = ray.util.get_current_placement_group()
                from transfer_queue import interface

                return {
                    "env": {k: os.environ.get(k) for k in ("VLLM_DISABLE_COMPILE_CACHE", "NCCL_DEBUG")},
                    "hook": hooked,
                    "isolated": isinstance(interface.ray, placement._OwnNamespace),
                    "group": pg.id.hex() if pg else None,
                    "namespace": ray.get_runtime_context().namespace,
                }

            out = ray.get(child.remote())
            Path(os.environ["PROBE_OUT"]).write_text(json.dumps(out))
            # a failed rollout, as verl's agent loop logs it; wait until the trial's driver has seen it
            logging.getLogger("agent_loop").error("Error in _run_prompt: probe failure")
            seen, t0 = Path(os.environ["PROBE_OUT"] + ".seen"), time.time()
            while not seen.exists() and time.time() - t0 < 120:
                time.sleep(0.2)

    run_ppo(cfg, task_runner_class=_Launch(ray.remote(num_cpus=1)(Probe), cfg))
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "transfer_queue":
        transfer_queue(*sys.argv[2:])
    else:
        sys.exit(probe_main(sys.argv[2], sys.argv[3:]))
