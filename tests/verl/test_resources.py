"""Ray resources of a verl launch (``experiments.backends.verl.resources``), from the composed configs of the
shipped presets; no Ray is started.

- the itemised demand of the math and search presets (1 node x 8 GPUs): TaskRunner 1 CPU,
  TransferQueue controller 1 + 8 storage units x 1 CPU, 8 placement-group bundles x (3 CPUs + 1
  GPU); agent-loop and reward-loop workers, rollout servers and the load balancer reserve nothing;
- that demand does not fit a 2-CPU machine, and the error names the settings and the totals;
- shrunk to 1 storage unit / 1 agent worker / 1 reward worker, it fits a local Ray of the
  computed size (ray_kwargs.ray_init), and one CPU less does not;
- verl's ``remote`` reward manager (reward.num_workers processes per reward-loop worker), rollout
  tensor parallelism, and how the cluster size is read (running Ray, ray_init, detection, address).
"""

import functools

import pytest

pytestmark = pytest.mark.verl

PRESETS = ("math_deepscaler_ema_pg", "search_r1_ema_pg")
SHRUNK = (
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "reward.num_workers=1",
)


@functools.cache
def _composed(preset: str, *verl_overrides: str):
    """verl's composed config for a preset (``experiment=<preset>``), verl overrides appended last."""
    from omegaconf import OmegaConf

    from experiments import build
    from experiments.backends.verl.launch import to_verl
    from experiments.backends.verl.main import compose

    cfg = build.compose([f"experiment={preset}"])
    build.validate(cfg)
    return compose(to_verl(OmegaConf.to_container(cfg, resolve=True)).argv() + list(verl_overrides))


def _table(need):
    return {i.what: (dict(i.settings), i.count, i.cpus, i.gpus) for i in need}


def _no_detection(resource):
    raise AssertionError(f"detected {resource} although the config sets it")


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_demand_is_itemised_with_its_settings(preset):
    from experiments.backends.verl.resources import ray_demand

    need = ray_demand(_composed(preset))
    assert _table(need) == {
        "TaskRunner": ({}, 1, 1, 0),
        "TransferQueue controller": ({}, 1, 1, 0),
        "TransferQueue storage units": ({"transfer_queue.backend.SimpleStorage.num_data_storage_units": 8}, 8, 8, 0),
        "actor/rollout/ref placement groups": ({"trainer.nnodes": 1, "trainer.n_gpus_per_node": 8}, 8, 24, 8),
        "reward-loop workers": ({"reward.num_workers": 8}, 8, 0, 0),
        "agent-loop workers": ({"actor_rollout_ref.rollout.agent.num_workers": 8}, 8, 0, 0),
        "rollout server actors (vllm)": ({"actor_rollout_ref.rollout.tensor_model_parallel_size": 1}, 8, 0, 0),
        "request load balancer": ({}, 1, 0, 0),
    }
    assert (sum(i.cpus for i in need), sum(i.gpus for i in need)) == (34, 8)


@pytest.mark.parametrize("preset", PRESETS)
def test_default_demand_does_not_fit_two_cpus(preset):
    from experiments.backends.verl.resources import check_fits, ray_demand

    with pytest.raises(ValueError) as err:
        check_fits(ray_demand(_composed(preset)), cluster_cpus=2, cluster_gpus=0)
    msg = str(err.value)
    assert "reserves 34 Ray CPUs and 8 GPUs" in msg and "has 2 CPUs and 0 GPUs" in msg
    for setting in (
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=8",
        "trainer.n_gpus_per_node=8",
        "actor_rollout_ref.rollout.agent.num_workers=8",
        "reward.num_workers=8",
    ):
        assert setting in msg
    assert "ray_kwargs.ray_init.num_cpus" in msg  # the way out on a small machine


@pytest.mark.parametrize("preset", PRESETS)
def test_shrunk_demand_fits_a_local_ray_of_the_computed_size(preset):
    from experiments.backends.verl.resources import check_fits, cluster_size, ray_demand

    need = ray_demand(_composed(preset, *SHRUNK))
    cpus, gpus = sum(i.cpus for i in need), sum(i.gpus for i in need)
    assert (cpus, gpus) == (1 + 1 + 1 + 3 * 8, 8)
    assert {i.what: i.count for i in need if i.what.endswith("workers") or "storage" in i.what} == {
        "TransferQueue storage units": 1,
        "reward-loop workers": 1,
        "agent-loop workers": 1,
    }
    sized = _composed(preset, *SHRUNK, f"ray_kwargs.ray_init.num_cpus={cpus}", f"+ray_kwargs.ray_init.num_gpus={gpus}")
    have = cluster_size(sized, detect=_no_detection, existing_address=lambda: None)
    assert have == (cpus, gpus)
    check_fits(ray_demand(sized), *have)
    with pytest.raises(ValueError, match=f"reserves {cpus} Ray CPUs and 8 GPUs, but the Ray cluster has {cpus - 1} "):
        check_fits(need, cpus - 1, gpus)


def test_remote_reward_manager_starts_num_workers_processes_per_reward_worker():
    from experiments.backends.verl.resources import ray_demand

    table = _table(ray_demand(_composed(PRESETS[0], "reward.reward_manager.name=remote", "reward.num_workers=3")))
    settings = {"reward.num_workers": 3, "reward.reward_manager.name": "remote"}
    assert table["remote reward processes"] == (settings, 9, 9, 0)


def test_rollout_servers_follow_the_replicas():
    from experiments.backends.verl.resources import ray_demand

    table = _table(ray_demand(_composed(PRESETS[0], "actor_rollout_ref.rollout.tensor_model_parallel_size=2")))
    assert table["rollout server actors (vllm)"][1:] == (4, 0, 0)  # 8 GPUs / TP 2, one node per replica


def test_cluster_size_sources():
    from omegaconf import OmegaConf

    from experiments.backends.verl.resources import cluster_size

    def cfg(device="cuda", **ray_init):
        ray_kwargs = {"ray_init": {"num_cpus": None, **ray_init}}
        return OmegaConf.create({"trainer": {"device": device}, "ray_kwargs": ray_kwargs})

    detected = {"CPU": 2, "GPU": 0, "NPU": 4}.__getitem__
    none_running = dict(detect=detected, existing_address=lambda: None)
    # Ray running: its totals, whatever the config says
    assert cluster_size(cfg(num_cpus=64), lambda: {"CPU": 16.0, "GPU": 2.0, "memory": 1e9}) == (16, 2)
    assert cluster_size(cfg("npu"), lambda: {"CPU": 16.0, "NPU": 8.0}) == (16, 8)
    # verl starts a local Ray: ray_init's values, detected when unset
    assert cluster_size(cfg(), **none_running) == (2, 0)
    assert cluster_size(cfg(num_cpus=12, num_gpus=3), **none_running) == (12, 3)
    assert cluster_size(cfg("npu"), **none_running) == (2, 4)
    # ray.init joins an existing cluster: unknown until connected
    assert cluster_size(cfg(address="10.0.0.1:6379"), **none_running) is None
    assert cluster_size(cfg(), detect=detected, existing_address=lambda: "10.0.0.1:6379") is None
    assert cluster_size(cfg(address="local"), detect=detected, existing_address=lambda: "10.0.0.1:6379") == (2, 0)


def test_check_fits_counts_gpus_too():
    from experiments.backends.verl.resources import Item, check_fits

    need = [Item("pool", (("trainer.n_gpus_per_node", 2),), 2, 6, 2), Item("loop", (("k", 4),), 4, 0)]
    check_fits(need, 6, 2)
    with pytest.raises(ValueError, match=r"reserves 6 Ray CPUs and 2 GPUs, but the Ray cluster has 64 CPUs and 1 GPU "):
        check_fits(need, 64, 1)
