"""Progress bars, one way everywhere (training iterations, the warm start, retriever encoding).

On a terminal a bar redraws live. On a file or a pipe (a SLURM log, ``emapg cluster logs``, CI)
tqdm would write a line ten times a second; there it writes one every `LOG_INTERVAL_S`.
``EMAPG_PROGRESS=0`` turns every bar off (sweeps set it for their trials), Hugging Face's own
("Loading weights", downloads) too: ``quiet_libraries``, called by the CLI and ``experiments.run.run``.
"""

from __future__ import annotations

import os
import sys

LOG_INTERVAL_S = 30.0  # seconds between two bar lines when stderr is not a terminal


def enabled() -> bool:
    """False when the user (or a sweep) set ``EMAPG_PROGRESS=0``."""
    return os.environ.get("EMAPG_PROGRESS", "1") != "0"


def quiet_libraries() -> None:
    """With bars off, also turn off the bars transformers and huggingface_hub draw themselves (transformers' switch
    turns off both)."""
    if enabled():
        return
    import transformers.utils.logging

    transformers.utils.logging.disable_progress_bar()


def bar(total: int | None, desc: str, *, initial: int = 0, unit: str = "it", show: bool = True):
    """A tqdm bar on stderr, or a disabled one (same interface) when `show` is False or bars are off."""
    from tqdm.auto import tqdm

    live = _on_terminal(sys.stderr)
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        dynamic_ncols=live,
        mininterval=0.1 if live else LOG_INTERVAL_S,
        disable=not (show and enabled()),
    )


def _on_terminal(stream) -> bool:
    """`stream.isatty()`, False for a stream that cannot say (Ray's workers replace stderr with a Tee
    that has no isatty) or is closed."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
