"""The distributed backend: EMA-PG as a plugin for stock verl 0.9.1 (no fork, no vendored copy).

    python -m experiments.backends.verl.main actor_rollout_ref.model.path=... emapg.anchor.tau=0.9 ...

What runs inside verl: config.py (the ``emapg:`` section), engine.py (Top-k passes in verl's FSDP engine),
loss.py (the actor loss), worker.py (the EMA anchor, ema.py, and its checkpoints), trainer.py (the V1 trainer
"emapg_sync"), probe.py and evals.py, search_agent.py (Search-R1's agent loop); main.py is the entry point.
emapg's side: launch.py (run config -> verl argv), resources.py and placement.py (what a run reserves on
Ray), failures.py (verl's logged-only errors made fatal), cpu.py and hf_rollout.py (verl on CPU).
docs/verl-plugin.md has the how and why. Importing this package never imports verl.
"""

import os

VERL_VERSION = "0.9.1"
"""The verl release this plugin is written and tested against (its internal APIs change between releases)."""


def require_verl() -> None:
    """Raise ImportError with an install hint unless the pinned verl is importable."""
    try:
        import verl
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the verl backend needs the [verl] extra: pip install -c constraints.txt -e '.[verl]' "
            f"(verl=={VERL_VERSION}; GPU users add vLLM, see docs/scaling-out.md)"
        ) from e
    version = getattr(verl, "__version__", "unknown")
    if version != VERL_VERSION:
        raise ImportError(
            f"experiments.backends.verl is written for verl=={VERL_VERSION}; found verl {version}. "
            "Its engine/worker internals change between releases."
        )

    if os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu":  # ours: known before verl detects it
        from experiments.backends.verl.cpu import register_platform  # loads torch

        register_platform()
