"""verl 0.9.1 on CPU: a "cpu" device platform, for development and for rehearsals of GPU runs.

verl has no CPU platform: without GPUs it reports device "cuda" and backend "nccl", registers its FSDP engine
for cuda/npu only, and reserves one Ray "GPU" per rank. ``install()`` selects a "cpu" platform (gloo, no-op
device calls) through verl's registry (``VERL_PLATFORM=cpu``), looks the FSDP engine up under "cuda"
(``VERL_ENGINE_DEVICE``), unpins the reference's ``CPUOffloadPolicy`` and gives verl's process group plain
"gloo" (torch refuses its "cpu:gloo,cpu:gloo"). The platform still names "GPU" as its Ray resource, so a CPU
Ray cluster advertises one virtual GPU per rank; every Ray worker process installs it through Ray's
``worker_process_setup_hook`` (``setup_worker``). With a GPU none of this is used.
"""

from __future__ import annotations

import contextlib
import os
import types

import torch

from experiments.backends.verl import failures

SETUP_HOOK = "experiments.backends.verl.cpu.setup_worker"  # Ray's worker_process_setup_hook on CPU


def _const(value):
    """A function of any arguments that returns `value`."""
    return lambda *args, **kwargs: value


_noop = _const(None)
_DEVICE_MODULE = types.SimpleNamespace(  # what verl calls on torch.cuda, as no-ops on CPU
    empty_cache=_noop,
    synchronize=_noop,
    max_memory_allocated=_const(0),
    max_memory_reserved=_const(0),
    memory_allocated=_const(0),
    memory_reserved=_const(0),
    reset_peak_memory_stats=_noop,
    is_available=_const(False),
    device_count=_const(0),
    current_device=_const("cpu"),
    set_device=_noop,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    mem_get_info=_const((0, 0)),
    get_device_name=_const("cpu"),
    get_device_properties=_const(types.SimpleNamespace(total_memory=0, name="cpu")),
    get_rng_state=torch.get_rng_state,
    set_rng_state=torch.set_rng_state,
    Stream=None,
    current_stream=_const(types.SimpleNamespace(synchronize=_noop, wait_stream=_noop)),
)


def register_platform() -> None:
    """Make "cpu" a platform name verl knows (idempotent): before verl detects its platform whenever
    ``VERL_PLATFORM=cpu`` is already in the environment."""
    from verl.plugin.platform import PlatformBase, PlatformRegistry

    if PlatformRegistry.get("cpu") is not None:
        return

    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = _DEVICE_MODULE
        is_available = _const(True)
        is_platform_available = _const(False)  # never auto-detected; selected only through VERL_PLATFORM=cpu
        current_device = _const("cpu")
        device_count = _const(0)
        set_device = synchronize = manual_seed = manual_seed_all = set_allocator_settings = empty_cache = _noop
        profiler_start = profiler_stop = cudart = _noop
        get_device_capability = _const((None, None))
        communication_backend_name = _const("gloo")
        visible_devices_envvar = _const("CUDA_VISIBLE_DEVICES")
        ray_resource_name = _const("GPU")  # virtual GPUs of a CPU Ray cluster: verl's placement groups stay as they are
        is_ipc_supported = _const(False)

        def ray_noset_envvars(self):
            return []

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

    PlatformRegistry.register(platform="cpu")(PlatformCPU)


def install() -> None:
    """Register and select the CPU platform in this process; idempotent. Call before verl builds anything."""
    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    os.environ.setdefault("VERL_DISABLE_FLASH_ATTN_CE", "1")
    from verl.plugin.platform import platform_manager as pm

    register_platform()
    if pm._current_platform is None or pm._current_platform.device_name != "cpu":
        pm._current_platform = pm._create_platform("cpu")
    _patch_offload_policy()
    _patch_process_group()


def _patch_offload_policy() -> None:
    """Forward-only engines force ``CPUOffloadPolicy(pin_memory=True)``; pinning needs an accelerator."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    from verl.workers.engine.fsdp import transformer_impl

    if getattr(transformer_impl.CPUOffloadPolicy, "_emapg_cpu", False):
        return

    def unpinned(pin_memory=True, **kw):
        return CPUOffloadPolicy(pin_memory=False, **kw)

    unpinned._emapg_cpu = True
    transformer_impl.CPUOffloadPolicy = unpinned


def _patch_process_group() -> None:
    """verl's process-group initialiser with "gloo" whenever it would pass "cpu:gloo,cpu:gloo"."""
    from verl.utils import distributed

    original = distributed.initialize_global_process_group_ray
    if getattr(original, "_emapg_cpu", False):
        return

    def initialize(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    initialize._emapg_cpu = True
    distributed.initialize_global_process_group_ray = initialize
    from verl.workers import engine_workers  # imported the name before us: patch its binding too

    engine_workers.initialize_global_process_group_ray = initialize


def setup_worker() -> None:
    """Ray ``worker_process_setup_hook`` of a CPU run: the platform, our rollout engine, then the GPU run's hook."""
    install()
    from experiments.backends.verl import hf_rollout  # loads transformers, verl

    hf_rollout.register()
    failures.setup_worker()
