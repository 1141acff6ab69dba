"""verl 0.9.1 on CPU: a "cpu" device platform, for development and for rehearsals of GPU runs.

verl has no CPU platform. On a machine without GPUs it reports device "cuda" and backend "nccl",
its FSDP engine is registered for cuda/npu only, and its worker groups reserve one Ray "GPU" per
rank. ``install()`` makes the real engines, workers and trainer run on CPU in this process:

- registers and selects a "cpu" platform (device "cpu", collective backend gloo, no-op device
  calls) through verl's own platform registry (``VERL_PLATFORM=cpu``);
- ``VERL_ENGINE_DEVICE=cuda``: the engine registry looks up the FSDP engine under "cuda" (the only
  effect of that variable is the lookup; the engine itself runs where its tensors are);
- the forward-only reference's ``CPUOffloadPolicy`` without pinned memory (pinning needs a GPU);
- the process group as plain "gloo": verl builds ``"cpu:gloo,<device>:<backend>"``, which for
  the cpu device is ``"cpu:gloo,cpu:gloo"``, a string torch refuses.

The platform still names "GPU" as its Ray resource, so verl's placement groups are unchanged; a CPU
Ray cluster advertises as many (virtual) GPUs as verl has ranks (``ray_init.num_gpus``). Every Ray
worker process installs the platform at start-up through Ray's ``worker_process_setup_hook``
(``setup_worker``; ``experiments.backends.verl.config`` sets it for ``trainer.device=cpu``).

Nothing here runs on GPUs: with a GPU, verl detects its own platform and none of this is used.
"""

from __future__ import annotations

import contextlib
import os
import types

import torch

from experiments.backends.verl import failures

SETUP_HOOK = "experiments.backends.verl.cpu.setup_worker"
"""Ray ``worker_process_setup_hook`` that installs the platform in each Ray worker process."""


def _noop(*args, **kwargs):
    return None


_DEVICE_MODULE = types.SimpleNamespace(  # what verl calls on torch.cuda, as no-ops on CPU
    empty_cache=_noop,
    synchronize=_noop,
    max_memory_allocated=lambda *a, **k: 0,
    max_memory_reserved=lambda *a, **k: 0,
    memory_allocated=lambda *a, **k: 0,
    memory_reserved=lambda *a, **k: 0,
    reset_peak_memory_stats=_noop,
    is_available=lambda: False,
    device_count=lambda: 0,
    current_device=lambda: "cpu",
    set_device=_noop,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    mem_get_info=lambda *a, **k: (0, 0),
    get_device_name=lambda *a, **k: "cpu",
    get_device_properties=lambda *a, **k: types.SimpleNamespace(total_memory=0, name="cpu"),
    get_rng_state=torch.get_rng_state,
    set_rng_state=torch.set_rng_state,
    Stream=None,
    current_stream=lambda *a, **k: types.SimpleNamespace(synchronize=_noop, wait_stream=_noop),
)


def register_platform() -> None:
    """Make "cpu" a platform name verl knows (idempotent); selecting it is ``install``'s job. Needed before
    verl detects its platform whenever ``VERL_PLATFORM=cpu`` is already in the environment."""
    from verl.plugin.platform import PlatformBase, PlatformRegistry

    if PlatformRegistry.get("cpu") is not None:
        return

    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = _DEVICE_MODULE

        def is_available(self):
            return True

        def is_platform_available(self, use_smi_check=False):
            return False  # never auto-detected; selected only through VERL_PLATFORM=cpu

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 0

        set_device = synchronize = manual_seed = manual_seed_all = set_allocator_settings = empty_cache = _noop
        profiler_start = profiler_stop = _noop

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def ray_resource_name(self):
            return "GPU"  # virtual GPUs of a CPU Ray cluster: verl's placement groups stay as they are

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

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
    """Ray ``worker_process_setup_hook`` of a CPU run: the platform and our rollout engine, then what the hook of a
    run on GPUs does (``failures.setup_worker``)."""
    install()
    from experiments.backends.verl import hf_rollout  # loads transformers, verl

    hf_rollout.register()
    failures.setup_worker()
