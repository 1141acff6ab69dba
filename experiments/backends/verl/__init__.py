"""The distributed backend: EMA-PG as a plugin for stock verl 0.9.1 (no fork, no vendored copy).

    python -m experiments.backends.verl.main actor_rollout_ref.model.path=... emapg.anchor.tau=0.9 ...
    experiments.backends.verl.main.launch(argv, run_dir)                          # the same, from this process
    # emapg compiles argv from a run config: experiments.backends.verl.launch.to_verl(run_cfg).command()

What each file adds to verl (how and why, in more detail: docs/verl-plugin.md):

    config.py   pure: the top-level `emapg:` section (EmaPGSection: KL, anchor, loss, probe, the
                TaskRunner's setup hook) read from `emapg.*` arguments, and the Top-k passes' plan
    ema.py      pure torch: the EMA update of the anchor from the policy on local FSDP2 shards
                (`ema_pg_core.anchor.ema_update_` on each rank's shard; no gather) + drift metrics
    layout.py   verl's packed (nnz, *) full-sequence layout <-> our (B, T, *) response layout
    engine.py   FSDPEngineWithLMHead subclass: top-k ids / log-probs (or logits + logsumexp) at them in
                the pi_old and reference passes (`ema_pg_core.topk`); only (nnz, K) leaves the worker
    loss.py     the actor loss: PPO surrogate + beta * any `ema_pg_core.kl` estimator, installed as
                verl's loss function (the Top-k KL runs in verl's logits-processor hook)
    worker.py   ActorRolloutRefWorker subclass: EMA RPC, anchor saved beside each checkpoint and
                restored on resume (missing anchor = error), engine re-class, loss install
    trainer.py  V1 sync trainer subclass ("emapg_sync"): Top-k flags per pass, EMA after the actor
                update every `period` iterations, `anchor/*` metrics
    main.py     entry point: verl's ppo_trainer config + the `emapg:` section -> run_ppo
    probe.py, evals.py   the KL probe; per-problem rows of verl's validation (and the anchor's turn at it)
    search_agent.py      the Search-R1 tool protocol as a verl agent loop (experiments/conf/verl/agent_loops.yaml)

emapg's side of the launch: launch.py (a run config -> verl argv, `to_verl`; a launch in this process),
resources.py and placement.py (what a run reserves on Ray, inside a Tune trial), failures.py (verl's
logged-only errors made fatal), cpu.py and hf_rollout.py (verl on CPU, with a transformers rollout engine).

Only config.py, ema.py and layout.py's pure helpers import without verl; every other module
imports verl and is imported lazily. Importing `experiments.backends.verl` never imports verl.
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
