"""verl's real FSDP2 engine on CPU in a test process: the product's CPU platform
(``experiments.backends.verl.cpu.install``) and a gloo process group of the caller's (``init_gloo``).

verl's engine needs a process group even at world size 1; outside Ray, nothing creates it.
"""

from __future__ import annotations

import os
import socket

from experiments.backends.verl.cpu import install  # noqa: F401  (the tests' entry point)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int = 0, world_size: int = 1, port: int | None = None) -> None:
    """A gloo process group on 127.0.0.1 (verl's engine needs one even at world size 1)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port or free_port()),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
