"""A verl job inside a Ray Tune trial, and verl jobs side by side on one Ray cluster (docs/verl-plugin.md,
"Inside a sweep trial").

Like Ray Train, the trial reserves the whole job (``resources.trial_placement``) and the job's actors are placed
in it explicitly: ``main.launch`` runs verl as its own Ray job in a child process (its own namespace, its own
``ray.init``; the group's id in ``PLACEMENT_GROUP_ENV``), ``main._Launch`` puts the TaskRunner in bundle 0,
``trainer.TrialPoolManager`` puts rank r in bundle r, and ``isolate_transfer_queue`` gives each job its own
TransferQueue controller (TransferQueue 0.1 names it in one fixed namespace per cluster).
"""

from __future__ import annotations

import os

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

PLACEMENT_GROUP_ENV = "EMAPG_PLACEMENT_GROUP"  # hex id of the trial's placement group, in the verl job's environment
TQ_NAMESPACE = "transfer_queue"  # where TransferQueue 0.1.11 names its controller (transfer_queue.interface)


def storage_bundle(unit: int, ranks: int) -> int:
    """The bundle (rank) of a trial's placement group that holds TransferQueue storage unit `unit`."""
    return unit % ranks


def trial_placement_group():
    """The trial's placement group this verl job runs in (``PLACEMENT_GROUP_ENV``), None outside a trial."""
    hexid = os.environ.get(PLACEMENT_GROUP_ENV)
    if not hexid:
        return None
    return PlacementGroup(ray.PlacementGroupID(bytes.fromhex(hexid)))


class _OwnNamespace:
    """``ray`` and TransferQueue's controller class as TransferQueue's interface module sees them: its fixed
    namespace replaced by the job's own (``get_actor``; ``options``)."""

    def __init__(self, target):
        self._target = target

    def get_actor(self, name, namespace=None):
        return self._target.get_actor(name, namespace=_own(namespace))

    def options(self, **kwargs):
        if "namespace" in kwargs:
            kwargs["namespace"] = _own(kwargs["namespace"])
        return self._target.options(**kwargs)

    def __getattr__(self, name):
        return getattr(self._target, name)


def _own(namespace: str | None) -> str | None:
    if namespace != TQ_NAMESPACE:
        return namespace
    return ray.get_runtime_context().namespace


def isolate_transfer_queue() -> None:
    """Make this process's TransferQueue use a controller of its own Ray job, and inside a sweep trial put its
    storage units in the trial's placement group (``resources.trial_placement`` holds their CPUs); idempotent."""
    from transfer_queue import interface
    from transfer_queue.storage.bootstrap import simple_storage_bootstrap

    if not isinstance(interface.ray, _OwnNamespace):
        interface.ray = _OwnNamespace(interface.ray)
        interface.TransferQueueController = _OwnNamespace(interface.TransferQueueController)
    if os.environ.get(PLACEMENT_GROUP_ENV):
        simple_storage_bootstrap.get_node_round_robin_scheduling_strategies = _storage_in_trial


class _InBundle(PlacementGroupSchedulingStrategy):
    node_id = "the sweep trial's placement group"  # TransferQueue logs where it placed each unit


def _storage_in_trial(num_actors: int, required_node_resource: str | None = None) -> list:
    """Storage unit i in the trial's bundle ``i % ranks`` (TransferQueue's own: round robin over the nodes,
    outside any reservation)."""
    pg = trial_placement_group()
    ranks = len(pg.bundle_specs)
    return [_InBundle(pg, placement_group_bundle_index=storage_bundle(i, ranks)) for i in range(num_actors)]
