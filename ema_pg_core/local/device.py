"""``trainer.device`` -> a ``torch.device``, checked against this machine.

``TrainerConfig`` checks only the syntax (sweep drivers validate configs on CPU head nodes);
``resolve_device`` is where availability is checked, once, before a run builds anything.
"""

from __future__ import annotations

import re

import torch

from ema_pg_core.config import DEVICE_PATTERN, LOCAL_DEVICES


def resolve_device(name: str) -> torch.device:
    """cpu | cuda | cuda:N | auto (cuda if available, else cpu) -> torch.device with an explicit CUDA index;
    ValueError when it is not here."""
    if not isinstance(name, str) or re.fullmatch(DEVICE_PATTERN, name) is None:
        raise ValueError(f"trainer.device={name!r} is not allowed; allowed values: {', '.join(LOCAL_DEVICES)}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"trainer.device={name!r} but CUDA is not available on this machine; allowed here: cpu, auto")
    n = torch.cuda.device_count()
    index = torch.cuda.current_device() if name in ("cuda", "auto") else int(name.split(":")[1])
    if index >= n:
        raise ValueError(f"trainer.device={name!r} but this machine has {n} CUDA device(s): cuda:0 .. cuda:{n - 1}")
    return torch.device("cuda", index)
