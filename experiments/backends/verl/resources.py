"""The Ray CPUs and GPUs a verl run reserves, checked against the cluster before launch.

Ray never reports a request it cannot satisfy: an actor or placement group that does not fit waits
forever, and a verl run on a small machine hangs silently. ``ray_demand`` lists what verl 0.9.1's V1
synchronous trainer reserves for a composed config, each item with the settings that size it:
the TaskRunner, TransferQueue's controller and SimpleStorage units (1 CPU each), one placement group per
node of {3 CPUs + 1 GPU} bundles per pool, and the ``remote`` reward manager's processes. Actors created
without a resource request (agent-loop and reward-loop workers, rollout servers, the load balancer) hold 0
CPUs for life (https://docs.ray.io/en/latest/ray-core/patterns/limit-running-tasks.html); they are listed
with 0 CPUs, because they are processes all the same. ``check_fits`` refuses a demand the cluster cannot
hold; ``cluster_size`` says how big that cluster is, before or after Ray starts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import ray
import ray._private.accelerators as accelerators
import ray._private.utils as ray_utils
from omegaconf import OmegaConf
from ray._private.services import find_bootstrap_address
from ray._private.state import available_resources_per_node

from experiments.backends.verl.placement import storage_bundle

TASK_RUNNER_CPUS = 1  # the TaskRunner actor experiments.backends.verl.main launches
BUNDLE_CPUS = 3  # of each one-GPU bundle (verl's ResourcePoolManager.max_colocate_count)
TQ_ACTOR_CPUS = 1  # TransferQueue's controller and each of its SimpleStorage units
REMOTE_REWARD_CPUS = 1  # each reward process of verl's "remote" reward manager


@dataclass(frozen=True)
class Item:
    """One kind of Ray actor (or placement-group bundle) a run starts, and what it reserves in total."""

    what: str
    settings: tuple[tuple[str, object], ...]  # the config keys that size the item, with their values
    count: int
    cpus: float
    gpus: float = 0.0
    note: str = ""

    @property
    def sizes(self) -> str:
        return " x ".join(f"{k}={v}" for k, v in self.settings) or "fixed"

    def describe(self) -> str:
        held = _amount(self.cpus, "CPU") + (f", {_amount(self.gpus, 'GPU')}" if self.gpus else "")
        return f"{self.what} [{self.sizes}]: {held}" + (f" ({self.note})" if self.note else "")


def _amount(n: float, unit: str) -> str:
    return f"{n:g} {unit}" + ("" if n == 1 else "s")


def _get(config, key: str, default=None):
    return OmegaConf.select(config, key, default=default)


def _bundles(what: str, config, pool: str) -> Item:
    """A worker pool: one STRICT_PACK placement group per node (``<pool>.nnodes``) of ``<pool>.n_gpus_per_node``
    bundles {CPU: 3, GPU: 1}."""
    nnodes_key, gpus_key = f"{pool}.nnodes", f"{pool}.n_gpus_per_node"
    nnodes, per_node = int(_get(config, nnodes_key)), int(_get(config, gpus_key))
    n = nnodes * per_node
    note = f"{BUNDLE_CPUS} CPUs + 1 GPU per bundle; one node holds each node's {per_node} bundles"
    return Item(what, ((nnodes_key, nnodes), (gpus_key, per_node)), n, BUNDLE_CPUS * n, n, note)


def _transfer_queue(config) -> list[Item]:
    items = [Item("TransferQueue controller", (), 1, TQ_ACTOR_CPUS, note="always on with verl's V1 trainer")]
    backend = _get(config, "transfer_queue.backend.storage_backend", "SimpleStorage")
    if backend == "SimpleStorage":
        key = "transfer_queue.backend.SimpleStorage.num_data_storage_units"
        n = int(_get(config, key))
        items.append(Item("TransferQueue storage units", ((key, n),), n, TQ_ACTOR_CPUS * n))
    return items


def _rollout_servers(config) -> Item:
    """One server actor per node of each rollout replica (replicas: trainer GPUs / rollout TP x DP x PP)."""
    r = "actor_rollout_ref.rollout."
    tp, dp, pp = (
        int(_get(config, r + k, 1))
        for k in ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size")
    )
    per_replica = tp * dp * pp
    world = int(_get(config, "trainer.nnodes")) * int(_get(config, "trainer.n_gpus_per_node"))
    per_node = min(int(_get(config, r + "n_gpus_per_node", per_replica)), per_replica)
    count = (world // per_replica) * (per_replica // per_node)
    what, note = f"rollout server actors ({_get(config, r + 'name')})", "no Ray resources; they use the workers' GPUs"
    return Item(what, ((r + "tensor_model_parallel_size", tp),), count, 0, note=note)


def _reward(config) -> list[Item]:
    key = "reward.num_workers"
    n = int(_get(config, key))
    items = [Item("reward-loop workers", ((key, n),), n, 0, note="no Ray resources")]
    manager = _get(config, "reward.reward_manager.name")
    if manager == "remote" and _get(config, "reward.reward_manager.source", "register") == "register":
        settings = ((key, n), ("reward.reward_manager.name", manager))
        note = f"{n} per reward-loop worker"
        items.append(Item("remote reward processes", settings, n * n, REMOTE_REWARD_CPUS * n * n, note=note))
    return items


def worker_pool(config) -> Item:
    """The actor/rollout/ref workers' placement groups (``emapg doctor`` checks a node's GPUs against them).
    `config`: a composed verl config, or any mapping with trainer.nnodes and trainer.n_gpus_per_node."""
    return _bundles("actor/rollout/ref placement groups", config, "trainer")


def ray_demand(config) -> list[Item]:
    """What a launch of ``config`` (a composed verl config) reserves in Ray, item by item: verl's V1 sync trainer
    with hybrid rollout; transient tasks, a custom agent-loop manager and TransferQueue backends other than
    SimpleStorage left out."""
    agents = int(_get(config, "actor_rollout_ref.rollout.agent.num_workers"))
    items = [
        Item("TaskRunner", (), 1, TASK_RUNNER_CPUS, note="ray.remote(num_cpus=1) in experiments.backends.verl.main"),
        *_transfer_queue(config),
        worker_pool(config),
    ]
    if _get(config, "reward.reward_model.enable_resource_pool", False):
        items.append(_bundles("reward-model placement groups", config, "reward.reward_model"))
    if _get(config, "distillation.enabled", False):
        items.append(_bundles("teacher placement groups", config, "distillation"))
    agent_settings = (("actor_rollout_ref.rollout.agent.num_workers", agents),)
    return [
        *items,
        *_reward(config),
        Item("agent-loop workers", agent_settings, agents, 0, note="no Ray resources"),
        _rollout_servers(config),
        Item("request load balancer", (), 1, 0, note="no Ray resources"),
    ]


def check_fits(need: Sequence[Item], cluster_cpus: float, cluster_gpus: float) -> None:
    """Raise ValueError naming the settings behind the demand when ``need`` exceeds the cluster. Compares totals:
    exact on one node, necessary but not sufficient on several (a placement group needs one node's bundles)."""
    cpus, gpus = sum(i.cpus for i in need), sum(i.gpus for i in need)
    if cpus <= cluster_cpus and gpus <= cluster_gpus:
        return
    held = "".join(f"\n  {i.describe()}" for i in need if i.cpus or i.gpus)
    free = "; ".join(f"{i.count} {i.what} [{i.sizes}]" for i in need if not (i.cpus or i.gpus))
    raise ValueError(
        f"this verl run reserves {_amount(cpus, 'Ray CPU')} and {_amount(gpus, 'GPU')}, but the Ray cluster has "
        f"{_amount(cluster_cpus, 'CPU')} and {_amount(cluster_gpus, 'GPU')} (Ray would wait for them forever):{held}"
        + (f"\n  started as well, reserving nothing: {free}" if free else "")
        + "\nLower these settings, or give Ray more (ray_kwargs.ray_init.num_cpus / num_gpus for the local Ray "
        "verl starts, or a bigger cluster)."
    )


def _accelerator(config) -> str:
    """The Ray resource verl's placement groups ask for: "NPU" on Ascend, else "GPU" (cuda, and cpu rehearsals)."""
    return "NPU" if _get(config, "trainer.device") == "npu" else "GPU"


def _detected(resource: str) -> float:
    """What a new local Ray finds on this machine, as ``ray.init`` does it (CPUs: cgroup-aware count)."""
    if resource == "CPU":
        return float(ray_utils.get_num_cpus())
    manager = accelerators.get_accelerator_manager_for_resource(resource)
    if manager is None:
        return 0.0
    n = manager.get_current_node_num_accelerators()
    visible = manager.get_current_process_visible_accelerator_ids()
    return float(n if visible is None else min(n, len(visible)))


def _existing_address() -> str | None:
    """The cluster a bare ``ray.init()`` joins instead of starting one: $RAY_ADDRESS, else the last ``ray start``."""
    return os.environ.get("RAY_ADDRESS") or find_bootstrap_address(None)


def cluster_size(
    config,
    cluster_resources: Callable[[], Mapping[str, float]] | None = None,
    *,
    detect: Callable[[str], float] = _detected,
    existing_address: Callable[[], str | None] = _existing_address,
) -> tuple[float, float] | None:
    """(CPUs, GPUs) of the Ray cluster the run will use; None when unknown before Ray starts.

    With Ray running, pass ``ray.cluster_resources`` (totals). Otherwise verl's ``ray.init(**ray_init)`` starts a
    local Ray of ``ray_init.num_cpus``/``num_gpus``, each ``detect``ed when unset, or joins an existing cluster
    (``ray_init.address`` other than "local", or one ``existing_address`` finds): None."""
    accelerator = _accelerator(config)
    if cluster_resources is not None:
        have = cluster_resources()
        return float(have.get("CPU", 0)), float(have.get(accelerator, 0))
    address = _get(config, "ray_kwargs.ray_init.address")
    if (address is not None and address != "local") or (address is None and existing_address()):
        return None
    cpus = _get(config, "ray_kwargs.ray_init.num_cpus")
    gpus = _get(config, "ray_kwargs.ray_init." + ("num_gpus" if accelerator == "GPU" else f"resources.{accelerator}"))
    return (float(detect("CPU") if cpus is None else cpus), float(detect(accelerator) if gpus is None else gpus))


# ---------------------------------------------------------------------------- a verl job inside a Ray Tune trial
@dataclass(frozen=True)
class TrialPlacement:
    """The one placement group a Ray Tune trial reserves for its whole verl job (``trial_placement``).

    ``bundles[0]`` is Tune's head bundle, empty (the trial's process only follows verl's metrics files); Ray drops
    it, so rank r's bundle is index r of the group."""

    bundles: tuple[dict[str, float], ...]
    strategy: str
    world: int  # ranks (= GPUs): trainer.nnodes x trainer.n_gpus_per_node
    outside: tuple[Item, ...]  # what the job starts outside the group (placed by verl or TransferQueue)
    storage_units: int  # TransferQueue's, one CPU each, in rank storage_bundle(i, world)'s bundle

    @property
    def cpus(self) -> float:
        return sum(b.get("CPU", 0.0) for b in self.bundles)

    @property
    def gpus(self) -> float:
        return sum(v for b in self.bundles for k, v in b.items() if k != "CPU")

    def describe(self) -> str:
        rank = f"{self.world} x {{{BUNDLE_CPUS} CPUs + 1 GPU}} (one per rank)"
        held = f"{_amount(self.cpus, 'CPU')} and {_amount(self.gpus, 'GPU')} in one {self.strategy} placement group"
        extra = "; ".join(i.describe() for i in self.outside if i.cpus or i.gpus)
        return (
            f"{held}: {rank}, + {TASK_RUNNER_CPUS + TQ_ACTOR_CPUS} CPUs on rank 0's for the TaskRunner and "
            f"TransferQueue's controller, + {self.storage_units} TransferQueue storage unit(s) of {TQ_ACTOR_CPUS} "
            "CPU on the ranks' bundles in turn" + (f"; outside it: {extra}" if extra else "")
        )


def trial_placement(config) -> TrialPlacement:
    """The placement group a Tune trial reserves for a verl job of ``config`` (a composed verl config).

    One bundle per rank, {3 CPUs + 1 GPU} as verl's own groups; rank 0's also holds the TaskRunner and
    TransferQueue's controller. STRICT_PACK on one node; STRICT_SPREAD for one rank per node; else PACK (Ray
    fills one node before the next; verl's own per-node groups do not promise distinct nodes either).
    Refused: separate reward-model or teacher pools and a rollout replica spanning nodes, which verl places by
    node and one group cannot express."""
    nnodes, per_node = int(_get(config, "trainer.nnodes")), int(_get(config, "trainer.n_gpus_per_node"))
    for key, what in (
        ("reward.reward_model.enable_resource_pool", "a separate reward-model pool"),
        ("distillation.enabled", "a teacher pool"),
    ):
        if _get(config, key, False):
            raise ValueError(f"{key}=true: {what} is not supported inside a sweep trial (backend: verl)")
    tp = int(_get(config, "actor_rollout_ref.rollout.tensor_model_parallel_size", 1))
    if tp > per_node:
        raise ValueError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} spans nodes "
            f"(trainer.n_gpus_per_node={per_node}); inside a sweep trial a rollout replica must fit one node"
        )
    accelerator, world = _accelerator(config), nnodes * per_node
    need = ray_demand(config)
    units = next((i.count for i in need if i.what == "TransferQueue storage units"), 0)
    cpus = [
        BUNDLE_CPUS + TQ_ACTOR_CPUS * sum(storage_bundle(u, world) == r for u in range(units)) for r in range(world)
    ]
    cpus[0] += TASK_RUNNER_CPUS + TQ_ACTOR_CPUS
    bundles = ({}, *({"CPU": float(c), accelerator: 1.0} for c in cpus))
    strategy = "STRICT_PACK" if nnodes == 1 else "STRICT_SPREAD" if per_node == 1 else "PACK"
    inside = ("TaskRunner", "TransferQueue controller", "TransferQueue storage units", "actor/rollout/ref placement")
    return TrialPlacement(bundles, strategy, world, tuple(i for i in need if not i.what.startswith(inside)), units)


# ---------------------------------------------------------------------------- waiting for room on a shared cluster
WAIT_SAY_S = 30.0  # how often a run waiting for room on a shared Ray cluster says what it waits for


def free_per_node() -> dict[str, dict[str, float]]:
    """Unreserved CPUs and GPUs of each alive node, by address (Ray's own per-node view, as verl reads it)."""
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    out: dict[str, dict[str, float]] = {}
    for node, res in available_resources_per_node().items():
        if node in ips:
            key = ips[node] if ips[node] not in out else f"{ips[node]} ({node[:8]})"
            out[key] = {k: float(v) for k, v in res.items() if k in ("CPU", "GPU", "NPU")}
    return out


def free_line(free: Mapping[str, Mapping[str, float]]) -> str:
    """'10.0.0.1: 30 CPUs, 4 GPUs; ...' (or 'no node')."""
    nodes = [f"{ip}: {r.get('CPU', 0):g} CPUs, {r.get('GPU', 0):g} GPUs" for ip, r in sorted(free.items())]
    return "; ".join(nodes) or "no node"


def wait_for_room(
    need: Sequence[Item],
    accelerator: str = "GPU",
    *,
    say: Callable[[str], None] = print,
    every_s: float = WAIT_SAY_S,
    free: Callable[[], Mapping[str, Mapping[str, float]]] = free_per_node,
    total: Callable[[], Mapping[str, float]] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Return once the cluster's free CPUs and GPUs hold `need` (a run joining a shared cluster, where other jobs
    hold part of it); say what it waits for at once and every `every_s` seconds until then. A demand larger than
    the whole cluster is refused (``check_fits``): it would wait forever. Returns the seconds waited."""
    have = (total or ray.cluster_resources)()
    check_fits(need, float(have.get("CPU", 0)), float(have.get(accelerator, 0)))
    cpus, gpus = sum(i.cpus for i in need), sum(i.gpus for i in need)
    t0, said = time.monotonic(), None
    while True:
        now = free()
        if (
            sum(r.get("CPU", 0) for r in now.values()) >= cpus
            and sum(r.get(accelerator, 0) for r in now.values()) >= gpus
        ):
            return time.monotonic() - t0
        if said is None or time.monotonic() - said >= every_s:
            said = time.monotonic()
            say(
                f"waiting for room on the Ray cluster ({said - t0:.0f} s): this run reserves {_amount(cpus, 'CPU')} "
                f"and {_amount(gpus, accelerator)}, other jobs hold the rest. Free now: {free_line(now)}"
            )
        sleep(min(5.0, every_s))
