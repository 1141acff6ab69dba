"""The local trainer's checkpoint directory: its layout, and finding the newest one that loads.

    checkpoints/
      iter_000010/state.pt     everything to continue exactly (LocalTrainer.state_dict)
      iter_000020/state.pt
      latest                   the name of the newest complete one ("iter_000020")

A checkpoint directory appears only once complete (written as ``.tmp_iter_N``, then renamed), and
``latest`` is replaced atomically after it. A disk that fills up, a copy gone wrong or a crash of
the file system can still leave a truncated ``state.pt`` or an empty ``latest``: `load_newest`
then names the broken one and falls back to the newest checkpoint that loads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LATEST, STATE = "latest", "state.pt"


def step_dir(ckpt_dir: str | Path, iteration: int) -> Path:
    return Path(ckpt_dir) / f"iter_{iteration:06d}"


def point_latest(ckpt_dir: str | Path, step: Path) -> None:
    """Make ``latest`` name `step`, atomically."""
    tmp = Path(ckpt_dir) / f".{LATEST}.tmp"
    tmp.write_text(step.name)
    os.replace(tmp, Path(ckpt_dir) / LATEST)


def candidates(ckpt_dir: str | Path) -> list[Path]:
    """Checkpoints to try, best first: the one ``latest`` names, then every ``iter_*`` newest first."""
    ckpt_dir = Path(ckpt_dir)
    steps = sorted((p for p in ckpt_dir.glob("iter_*") if p.is_dir()), reverse=True)
    pointer = ckpt_dir / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else ""
    first = [ckpt_dir / named] if named and (ckpt_dir / named) in steps else []
    return first + [p for p in steps if p not in first]


def load_newest(
    ckpt_dir: str | Path, map_location: Any = "cpu", load: Callable[[Path], dict] | None = None
) -> tuple[Path, dict, list[dict]] | None:
    """(checkpoint dir, its state, the ones skipped as [{"checkpoint", "error"}]) for the newest
    checkpoint whose state.pt loads, or None when the directory holds no checkpoint at all.
    Raises ValueError naming each checkpoint and why it failed when none loads."""
    load = load or (lambda p: torch.load(p / STATE, map_location=map_location, weights_only=False))
    skipped, pointer = [], Path(ckpt_dir) / LATEST
    named = pointer.read_text().strip() if pointer.exists() else None
    if named == "":
        skipped.append({"checkpoint": LATEST, "error": f"{pointer} is empty"})
    elif named and not (Path(ckpt_dir) / named / STATE).is_file():
        skipped.append({"checkpoint": LATEST, "error": f"{pointer} names {named}, which holds no {STATE}"})
    steps = candidates(ckpt_dir)
    for step in steps:
        try:
            return step, load(step), skipped
        except Exception as e:  # noqa: BLE001  truncated zip, unpickling error, missing file: try the next
            first_line = (str(e).strip() or "unreadable").splitlines()[0]
            skipped.append({"checkpoint": step.name, "error": f"{type(e).__name__}: {first_line}"})
    if not steps and not skipped:
        return None
    tried = "; ".join(f"{s['checkpoint']}: {s['error']}" for s in skipped)
    raise ValueError(f"no intact checkpoint in {ckpt_dir} to resume from ({tried})")
