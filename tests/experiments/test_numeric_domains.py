"""Every numeric setting of the run config refuses NaN, +-inf, a negative number and zero with one line naming the
field (exit 2 through the CLI), unless the value is accepted on purpose: ``ACCEPTED`` lists each such value with
the meaning its field documents. The walk is over the config dataclasses themselves (fast); a completeness test
ties it to the composed schema, so a numeric field added later is walked too. Issue #28."""

from __future__ import annotations

import math
import typing
from dataclasses import fields

import pytest
from omegaconf import DictConfig, OmegaConf

from ema_pg_core.config import (
    SEED_MAX,
    AdvantageConfig,
    AnchorConfig,
    EntropyFloorRule,
    KLConfig,
    KLSpikeRule,
    LengthCapRule,
    LossConfig,
    OptimConfig,
    RolloutConfig,
    TrainerConfig,
    check_batch_split,
    eval_problems,
    probe_prompts,
)
from ema_pg_core.local.trainer import LocalConfig
from experiments.backends.verl.launch import VerlSettings
from experiments.errors import classify
from experiments.schema import ModelConfig, RunConfig, TaskConfig

SECTIONS = {  # dotted prefix in the run config -> the dataclass that validates it
    "algo.kl": KLConfig,
    "algo.anchor": AnchorConfig,
    "algo.loss": LossConfig,
    "algo.adv": AdvantageConfig,
    "rollout": RolloutConfig,
    "optim": OptimConfig,
    "trainer": TrainerConfig,
    "health.entropy_floor": EntropyFloorRule,
    "health.kl_spike": KLSpikeRule,
    "health.length_cap": LengthCapRule,
    "task": TaskConfig,
    "model": ModelConfig,
    "backend.verl": VerlSettings,
}
TOP_LEVEL = {"seed": lambda v: LocalConfig(seed=v)}  # numeric run-config keys outside a section
PROBES = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf, "negative": -1, "zero": 0}

ACCEPTED = {  # (dotted key, probe) -> the documented meaning of that value
    ("algo.kl.k", "zero"): "Top-k with k = 0: a pure sampled tail",
    ("algo.kl.coef", "zero"): "beta = 0: no KL term",
    ("algo.anchor.tau", "zero"): "tau = 0: the anchor copies the policy",
    ("algo.loss.clip_low", "zero"): "ratio clipped below at 1",
    ("algo.loss.clip_high", "zero"): "ratio clipped above at 1",
    ("algo.loss.entropy_coef", "zero"): "no entropy bonus (the paper's value)",
    ("rollout.max_turns", "zero"): "no tool call: answer at once",
    ("optim.beta1", "zero"): "AdamW without momentum",
    ("optim.beta2", "zero"): "AdamW without a second-moment average",
    ("optim.weight_decay", "zero"): "no weight decay",
    ("optim.warmup_iters", "zero"): "no warmup",
    ("trainer.iterations", "zero"): "evaluate the initial model only",
    ("trainer.eval_temperature", "zero"): "greedy evaluation samples",
    ("trainer.save_every", "zero"): "checkpoint only at the end",
    ("trainer.probe_every", "zero"): "no KL probe",
    ("backend.verl.max_failed_rollouts", "zero"): "no failed rollout tolerated",
    ("seed", "zero"): "a seed",
    ("task.data_seed", "zero"): "a seed",
}


def _numeric(cls) -> list[str]:
    """The int/float fields of a dataclass (optional ones included; bools are not numbers here)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        args = set(typing.get_args(hints[f.name])) or {hints[f.name]}
        if args & {int, float} and bool not in args:
            out.append(f.name)
    return out


WALK = [(f"{prefix}.{name}", cls, name) for prefix, cls in SECTIONS.items() for name in _numeric(cls)]
CASES = [(key, label) for key, _, _ in WALK for label in PROBES] + [(k, label) for k in TOP_LEVEL for label in PROBES]


def _build(key: str, value):
    if key in TOP_LEVEL:
        return TOP_LEVEL[key](value)
    cls, name = next((cls, name) for k, cls, name in WALK if k == key)
    return cls(**{name: value})


def test_the_walk_covers_every_numeric_key_of_the_schema():
    """Every int/float leaf of the composed schema (experiments.schema.RunConfig) is walked."""

    def leaves(node: DictConfig, prefix: str) -> list[str]:
        out = []
        for key in node:
            child = node._get_node(key)
            if isinstance(child, DictConfig):
                out += leaves(child, f"{prefix}{key}.")
            elif type(child).__name__ in ("IntegerNode", "FloatNode"):
                out.append(f"{prefix}{key}")
        return out

    schema = set(leaves(OmegaConf.structured(RunConfig), ""))
    walked = {key for key, _, _ in WALK} | set(TOP_LEVEL)
    assert schema == walked, (schema - walked, walked - schema)
    assert len(walked) >= 60


def test_the_allow_list_names_real_cases():
    assert set(ACCEPTED) <= set(CASES)


@pytest.mark.parametrize("key,label", CASES, ids=[f"{k}={label}" for k, label in CASES])
def test_a_numeric_field_refuses_or_documents_each_value(key, label):
    value = PROBES[label]
    if (key, label) in ACCEPTED:
        _build(key, value)  # accepted: the field documents what it means
        return
    with pytest.raises(ValueError) as refused:
        _build(key, value)
    message, code = classify(refused.value)
    assert code == 2 and "\n" not in message, message
    assert key in message, message


@pytest.mark.parametrize(
    "build",
    [
        lambda: LocalConfig(seed=SEED_MAX),
        lambda: TaskConfig(data_seed=SEED_MAX),
    ],
)
def test_the_largest_seed_is_accepted(build):
    build()


def test_the_largest_seed_seeds_every_consumer():
    """SEED_MAX is the tightest consumer's bound: numpy's legacy seeding refuses one more, torch takes it."""
    import numpy as np
    import torch

    np.random.RandomState(SEED_MAX)
    torch.manual_seed(SEED_MAX)
    with pytest.raises(ValueError):
        np.random.RandomState(SEED_MAX + 1)
    with pytest.raises(ValueError, match="seed must be an integer in"):
        LocalConfig(seed=SEED_MAX + 1)


@pytest.mark.parametrize(
    "P,G,m,ok",
    [(2, 2, 1, True), (2, 2, 2, True), (2, 2, 4, True), (2, 2, 3, False), (2, 2, 8, False), (8, 8, 2, True)],
)
def test_mini_batches_must_divide_the_batch(P, G, m, ok):
    rollout, trainer = RolloutConfig(prompts_per_iter=P, group_size=G), TrainerConfig(mini_batches=m)
    if ok:
        check_batch_split(rollout, trainer)
        return
    with pytest.raises(ValueError, match=rf"trainer.mini_batches={m} must divide .* = {P * G} sequences"):
        check_batch_split(rollout, trainer)


def test_eval_and_probe_sizes_never_exceed_the_held_out_split():
    assert eval_problems(TrainerConfig(eval_size=8), 8) == 8
    assert probe_prompts(TrainerConfig(probe_size=None), 8) == 8  # null: the smaller of PROBE_SIZE and the split
    assert probe_prompts(TrainerConfig(probe_size=None), 200) == 16
    with pytest.raises(ValueError, match=r"trainer.eval_size=9 exceeds the held-out split \(task.test_size=8"):
        eval_problems(TrainerConfig(eval_size=9), 8)
    with pytest.raises(ValueError, match=r"trainer.probe_size=9 exceeds the held-out split \(task.test_size=8"):
        probe_prompts(TrainerConfig(probe_size=9), 8)
