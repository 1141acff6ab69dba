"""A verl job inside a Ray Tune trial and beside other verl jobs (``backends.verl.placement``, ``resources``).

- what a trial reserves for its verl job, per layout (one bundle per rank; the TaskRunner, TransferQueue's
  controller and storage units inside), and what is refused;
- two verl-like jobs on one Ray cluster, each with the run's setup hook: each job's TransferQueue holds only
  its own key, its controller lives in its own namespace (none in TransferQueue's shared one), and a failed
  rollout reported in one job is not seen by the other;
- a real Tune trial that reserves a job's placement group and launches it as ``run_config`` does (a child
  Ray job joining with ``join_trial``): a worker of that job sees verl's runtime environment (its env vars,
  NCCL_DEBUG), ran the setup hook, runs inside the trial's placement group, in its own namespace, and a
  failed rollout it reports reaches the trial's driver (``failures.first_failure``);
- the line a sweep prints while trials wait: what one reserves and what each node has free.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.verl
HERE = Path(__file__).parent


def _verl_config(*overrides: str):
    from omegaconf import OmegaConf

    from experiments import build
    from experiments.backends.verl.launch import to_verl
    from experiments.backends.verl.main import compose

    cfg = build.compose(["experiment=math_deepscaler_ema_pg", "trainer.device=cpu", "backend.verl.rollout_engine=hf"])
    run = OmegaConf.to_container(cfg, resolve=True)
    argv = to_verl(run).argv() + list(overrides)
    return argv, compose(argv)


@pytest.mark.parametrize(
    "nodes, per_node, strategy", [(1, 8, "STRICT_PACK"), (2, 1, "STRICT_SPREAD"), (2, 4, "PACK"), (1, 2, "STRICT_PACK")]
)
def test_a_trial_reserves_one_bundle_per_rank_with_the_taskrunner_and_transfer_queue_inside(nodes, per_node, strategy):
    from experiments.backends.verl.resources import trial_placement

    _, cfg = _verl_config(f"trainer.nnodes={nodes}", f"trainer.n_gpus_per_node={per_node}")
    p = trial_placement(cfg)
    world = nodes * per_node
    units = 8  # the preset's transfer_queue.backend.SimpleStorage.num_data_storage_units
    assert p.strategy == strategy and p.world == world and p.bundles[0] == {}
    assert [b["GPU"] for b in p.bundles[1:]] == [1.0] * world
    per_rank = [3 + sum(u % world == r for u in range(units)) for r in range(world)]
    per_rank[0] += 2  # the TaskRunner and TransferQueue's controller
    assert [b["CPU"] for b in p.bundles[1:]] == per_rank and p.storage_units == units
    assert {i.what for i in p.outside} == {
        "reward-loop workers",
        "agent-loop workers",
        "rollout server actors (hf)",
        "request load balancer",
    }  # none of them reserves anything
    assert "in one " + strategy + " placement group" in p.describe()


def test_pools_a_single_group_cannot_express_are_refused():
    from experiments.backends.verl.resources import trial_placement

    _, cfg = _verl_config("trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=4")
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4 spans nodes"):
        trial_placement(cfg)
    _, cfg = _verl_config("reward.reward_model.enable_resource_pool=true")
    with pytest.raises(ValueError, match="enable_resource_pool=true"):
        trial_placement(cfg)


@pytest.fixture
def local_ray(tmp_path):
    """A Ray head on 127.0.0.1 in this process (12 CPUs, 2 virtual GPUs); its address."""
    os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    import ray

    temp = f"/tmp/emapg_pl_{os.getpid()}"  # short: Ray's unix sockets live here
    ray.init(num_cpus=12, num_gpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, _temp_dir=temp)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        import shutil

        shutil.rmtree(temp, ignore_errors=True)


def test_two_verl_jobs_on_one_cluster_see_only_their_own_transfer_queue_and_failures(local_ray, tmp_path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {**os.environ, "RAY_ADDRESS": local_ray}
    jobs = {
        name: subprocess.Popen(
            [
                sys.executable,
                str(HERE / "ray_jobs.py"),
                "transfer_queue",
                local_ray,
                f"ns_{name}",
                name,
                str(barrier),
                fail,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, fail in (("job_a", "1"), ("job_b", "0"))
    }
    out = {}
    for name, proc in jobs.items():
        stdout, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr[-3000:]
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    assert out["job_a"]["keys"] == ["job_a"] and out["job_b"]["keys"] == ["job_b"]
    assert out["job_a"]["failures"] == 1 and "boom in job_a" in out["job_a"]["cause"]
    assert out["job_b"]["failures"] == 0
    spaces = sorted(c["namespace"] for c in out["job_b"]["controllers"])
    assert spaces == ["ns_job_a", "ns_job_b"]  # one controller per job, none in TransferQueue's shared namespace


def test_a_trial_runs_its_verl_job_as_a_ray_job_of_its_own_in_the_trials_group(local_ray, tmp_path):
    from ray import tune

    from experiments.backends.verl.main import _run_in_trial
    from experiments.backends.verl.resources import trial_placement

    argv, cfg = _verl_config(
        "trainer.n_gpus_per_node=2", "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"
    )
    p = trial_placement(cfg)
    probe_out = tmp_path / "probe.json"
    launcher = (sys.executable, str(HERE / "ray_jobs.py"), "probe", str(probe_out))

    def trial(config):  # as experiments.run._run_verl: verl in a thread, failures polled from here
        import threading
        import time

        import ray

        from experiments.backends.verl.failures import first_failure

        pg = ray.util.get_current_placement_group()
        job = threading.Thread(target=_run_in_trial, args=(argv, pg, tmp_path / "run", launcher))
        job.start()
        failure, t0 = None, time.time()
        while failure is None and job.is_alive() and time.time() - t0 < 180:
            failure = first_failure(0)
            time.sleep(0.5)
        Path(str(probe_out) + ".seen").touch()
        job.join()
        tune.report({"group": pg.id.hex(), "failure": failure or ""})

    factory = tune.PlacementGroupFactory([dict(b) for b in p.bundles], strategy=p.strategy)
    grid = tune.Tuner(
        tune.with_resources(trial, factory),
        run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), verbose=0),
    ).fit()
    [result] = list(grid)
    assert result.error is None, (tmp_path / "run" / "verl_driver.log").read_text()[-3000:]
    seen = json.loads(probe_out.read_text())
    assert seen["env"] == {"VLLM_DISABLE_COMPILE_CACHE": "1", "NCCL_DEBUG": "WARN"}  # verl's runtime env
    assert seen["hook"] and seen["isolated"]  # the setup hook ran in the worker
    assert seen["group"] == result.metrics["group"]  # inside the trial's placement group
    assert seen["namespace"].startswith("emapg_")
    assert "a rollout failed in verl's agent loop" in result.metrics["failure"]  # the trial's driver was told
    assert "probe failure" in result.metrics["failure"]


def test_waiting_trials_say_what_they_reserve_and_what_each_node_has_free():
    from sweeps import spec as sweep_spec
    from sweeps.tune import waiting_line

    s = sweep_spec.load("sweeps/math_deepscaler_ema_pg.yaml")
    free = {"10.0.0.1": {"CPU": 30.0, "GPU": 4.0}, "10.0.0.2": {"CPU": 2.0, "GPU": 0.0}}
    line = waiting_line(s, {"experiment": "math_deepscaler_ema_pg"}, free, 1)
    assert line.startswith("1 trial(s) wait for room: each reserves 34 CPUs and 8 GPUs in one STRICT_PACK")
    assert line.endswith("Free now: 10.0.0.1: 30 CPUs, 4 GPUs; 10.0.0.2: 2 CPUs, 0 GPUs")


def test_a_run_on_a_shared_cluster_says_what_it_waits_for_until_its_demand_is_free():
    from experiments.backends.verl.resources import Item, wait_for_room

    need = [Item("TaskRunner", (), 1, 1.0), Item("workers", (), 2, 6.0, 2.0)]
    frees = iter(
        [{"a": {"CPU": 3.0, "GPU": 0.0}, "b": {"CPU": 2.0, "GPU": 1.0}}] * 13 + [{"a": {"CPU": 7.0, "GPU": 2.0}}]
    )
    clock, said = [0.0], []

    def sleep(s):  # a fake clock: each poll advances it
        clock[0] += s

    import experiments.backends.verl.resources as resources

    real = resources.time.monotonic
    resources.time.monotonic = lambda: clock[0]
    try:
        waited = wait_for_room(
            need,
            say=said.append,
            every_s=30.0,
            free=lambda: next(frees),
            total=lambda: {"CPU": 16, "GPU": 4},
            sleep=sleep,
        )
    finally:
        resources.time.monotonic = real
    assert waited == 65.0  # 13 polls 5 s apart
    assert len(said) == 3  # at once, after 30 s, after 60 s
    assert said[0] == (
        "waiting for room on the Ray cluster (0 s): this run reserves 7 CPUs and 2 GPUs, other jobs hold the rest. "
        "Free now: a: 3 CPUs, 0 GPUs; b: 2 CPUs, 1 GPUs"
    )
    assert said[1].startswith("waiting for room on the Ray cluster (30 s)")
    with pytest.raises(ValueError, match="Ray would wait for them forever"):  # never fits: refused, not awaited
        wait_for_room(need, free=lambda: {}, total=lambda: {"CPU": 4, "GPU": 4}, sleep=sleep)
