"""The smallest real local run the experiment tests train end to end (a 2-step warm start, 2 prompts x 2 samples
of at most 12 tokens, 4 held-out problems), as Hydra overrides; each test changes only what it is about."""

SMALL_RUN = {
    "experiment": "math_tiny_ema_pg",
    "logger.name": "none",
    "trainer.threads": 1,
    "rollout.prompts_per_iter": 2,
    "rollout.group_size": 2,
    "rollout.max_new_tokens": 12,
    "trainer.eval_every": 2,
    "trainer.eval_size": 4,
    "trainer.eval_n": 1,
    "task.train_size": 40,
    "task.test_size": 8,
    "model.pretrain_steps": 2,
}


def small_run(changes: dict | None = None) -> list[str]:
    """["key=value", ...] of SMALL_RUN with ``changes`` applied (new keys appended)."""
    return [f"{k}={v}" for k, v in {**SMALL_RUN, **(changes or {})}.items()]


def one_point_spec(path) -> str:
    """Write the smallest valid sweep spec (one trial of one iteration) to `path`; return it as a string, for the
    tests whose sweep must be refused before any trial runs."""
    import yaml

    spec = {
        "name": "s",
        "base": {"experiment": "math_tiny_grpo", "overrides": {"trainer.iterations": 1}},
        "space": {"algo.anchor.tau": {"grid": [1.0]}},
        "metric": "eval/math_tiny/acc",
    }
    path.write_text(yaml.safe_dump(spec))
    return str(path)
