"""Test-only: run verl 0.9.1's real FSDP2 engine on CPU (verl-0.9.md §3.6).

verl has no CPU platform; on a machine without GPUs it reports device "cuda" and backend "nccl".
`install()` registers a "cpu" platform (device "cpu", backend gloo), selects it with
VERL_PLATFORM=cpu, makes the engine registry look up the cuda entry (VERL_ENGINE_DEVICE=cuda: the
FSDP engine is registered for cuda/npu only), and turns off pinned memory for the forward-only
reference's CPUOffloadPolicy (pinning needs an accelerator). The process group must be initialised
by the caller with gloo before an engine is built (`init_gloo`).

Never import this outside tests: it changes process-wide verl state.
"""

from __future__ import annotations

import contextlib
import os
import socket
import types

import torch


def _noop(*args, **kwargs):
    return None


_DEVICE_MODULE = types.SimpleNamespace(
    empty_cache=_noop, synchronize=_noop, max_memory_allocated=lambda *a, **k: 0, max_memory_reserved=lambda *a, **k: 0,
    memory_allocated=lambda *a, **k: 0, memory_reserved=lambda *a, **k: 0, reset_peak_memory_stats=_noop,
    is_available=lambda: False, device_count=lambda: 0, current_device=lambda: "cpu", set_device=_noop,
    manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed, mem_get_info=lambda *a, **k: (0, 0),
    get_device_name=lambda *a, **k: "cpu", get_device_properties=lambda *a, **k: types.SimpleNamespace(total_memory=0, name="cpu"),
    get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state, Stream=None,
    current_stream=lambda *a, **k: types.SimpleNamespace(synchronize=_noop, wait_stream=_noop),
)


def install() -> None:
    """Register and select the CPU platform; idempotent. Call before verl builds anything."""
    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    os.environ.setdefault("VERL_DISABLE_FLASH_ATTN_CE", "1")
    from verl.plugin.platform import platform_manager as pm
    from verl.plugin.platform.platform_base import PlatformBase

    if pm.PlatformRegistry.get("cpu") is None:

        @pm.PlatformRegistry.register(platform="cpu")
        class PlatformCPU(PlatformBase):
            device_name = "cpu"
            vendor_name = "cpu"
            device_module = _DEVICE_MODULE

            def is_available(self):
                return True

            def is_platform_available(self, use_smi_check=False):
                return False  # never auto-detected; only selected through VERL_PLATFORM

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
                return "CPU"

            def ray_noset_envvars(self):
                return []

            def is_ipc_supported(self):
                return False

            def cudart(self):
                return None

    if pm._current_platform is None or pm._current_platform.device_name != "cpu":
        pm._current_platform = pm._create_platform("cpu")

    # forward-only engines force CPUOffloadPolicy(pin_memory=True); pinning needs an accelerator
    from torch.distributed.fsdp import CPUOffloadPolicy

    from verl.workers.engine.fsdp import transformer_impl

    transformer_impl.CPUOffloadPolicy = lambda pin_memory=True, **kw: CPUOffloadPolicy(pin_memory=False, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int = 0, world_size: int = 1, port: int | None = None) -> None:
    """A gloo process group on 127.0.0.1 (verl's engine needs one even at world size 1)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or free_port()), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
