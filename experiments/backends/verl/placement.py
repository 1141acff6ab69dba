"""A verl job inside a Ray Tune trial, and verl jobs side by side on one Ray cluster.

Ray places every actor a Tune trial creates inside the trial's placement group; verl's TaskRunner
then found no room there, and verl's own placement groups asked the cluster for GPUs the trial
never reserved. Like Ray Train, emapg has the trial reserve the whole job, and places the job's
actors in that reservation explicitly (``docs/verl-plugin.md``, "Inside a sweep trial"):

- ``resources.trial_placement``: the trial's placement group: one bundle per rank, rank 0's with
  room for the TaskRunner and TransferQueue's controller. Tune starts a trial when all of it fits.
- ``main.launch``: inside a trial, verl runs as its own Ray job (``python -m
  experiments.backends.verl.main`` in a child process): its own namespace, so the named actors of two
  trials never meet, and verl's own ``ray.init`` with verl's runtime environment (env vars, the
  worker setup hook). The group's id reaches it in ``PLACEMENT_GROUP_ENV``.
- ``main._Launch``: the TaskRunner goes into bundle 0, capturing its children.
- ``trainer.TrialPoolManager`` (from ``EmaPGTrainerSync._init_resource_pool_mgr``): verl's worker
  pool is the trial's group, rank r in bundle r, instead of new groups of verl's own.
- ``isolate_transfer_queue``: TransferQueue 0.1 names its controller in the fixed namespace
  "transfer_queue", one per cluster; every process of a run looks it up in its job's namespace
  instead (the same ``worker_process_setup_hook`` that installs failure forwarding calls it).
"""

from __future__ import annotations

import os

PLACEMENT_GROUP_ENV = "EMAPG_PLACEMENT_GROUP"
"""Hex id of the trial's placement group, in the environment of a verl job launched inside a Tune trial."""
TQ_NAMESPACE = "transfer_queue"
"""The namespace TransferQueue 0.1.11 names its controller in (``transfer_queue.interface``)."""


def storage_bundle(unit: int, ranks: int) -> int:
    """The bundle (rank) of a trial's placement group that holds TransferQueue storage unit `unit`."""
    return unit % ranks


def trial_placement_group():
    """The trial's placement group this verl job runs in (``PLACEMENT_GROUP_ENV``), None outside a trial."""
    hexid = os.environ.get(PLACEMENT_GROUP_ENV)
    if not hexid:
        return None
    import ray
    from ray.util.placement_group import PlacementGroup

    return PlacementGroup(ray.PlacementGroupID(bytes.fromhex(hexid)))


class _NamespacedRay:
    """``ray`` as TransferQueue's interface module sees it: ``get_actor`` in the job's own namespace."""

    def __init__(self, ray):
        self._ray = ray

    def get_actor(self, name, namespace=None):
        return self._ray.get_actor(name, namespace=_own(namespace))

    def __getattr__(self, name):
        return getattr(self._ray, name)


class _NamespacedActorClass:
    """TransferQueue's controller class: ``options(namespace="transfer_queue")`` in the job's own namespace."""

    def __init__(self, cls):
        self._cls = cls

    def options(self, **kwargs):
        if "namespace" in kwargs:
            kwargs["namespace"] = _own(kwargs["namespace"])
        return self._cls.options(**kwargs)

    def __getattr__(self, name):
        return getattr(self._cls, name)


def _own(namespace: str | None) -> str | None:
    if namespace != TQ_NAMESPACE:
        return namespace
    import ray

    return ray.get_runtime_context().namespace


def isolate_transfer_queue() -> None:
    """Make this process's TransferQueue use a controller of its own Ray job, and inside a sweep trial put its
    storage units in the trial's placement group (``resources.trial_placement`` holds their CPUs); idempotent."""
    from transfer_queue import interface
    from transfer_queue.storage.bootstrap import simple_storage_bootstrap

    if not isinstance(interface.ray, _NamespacedRay):
        interface.ray = _NamespacedRay(interface.ray)
        interface.TransferQueueController = _NamespacedActorClass(interface.TransferQueueController)
    if os.environ.get(PLACEMENT_GROUP_ENV):
        simple_storage_bootstrap.get_node_round_robin_scheduling_strategies = _storage_in_trial


def _storage_in_trial(num_actors: int, required_node_resource: str | None = None) -> list:
    """Storage unit i in the trial's bundle ``i % ranks`` (TransferQueue's own: round robin over the nodes,
    outside any reservation)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    class InBundle(PlacementGroupSchedulingStrategy):
        node_id = "the sweep trial's placement group"  # TransferQueue logs where it placed each unit

    pg = trial_placement_group()
    ranks = len(pg.bundle_specs)
    return [InBundle(pg, placement_group_bundle_index=storage_bundle(i, ranks)) for i in range(num_actors)]
