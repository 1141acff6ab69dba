"""RL-health rules (ema_pg_core/health.py) on synthetic metric streams: each rule fires where the stream goes bad
and at no point of a healthy stream; the monitor's state is a function of the stream alone; every rule's section
of the config validates itself."""

from __future__ import annotations

import math
import types
from dataclasses import fields

import pytest
import torch

from ema_pg_core.config import EntropyFloorRule, HealthConfig, KLSpikeRule, LengthCapRule
from ema_pg_core.health import HEALTH_RULES, NONFINITE_METRICS, HealthMonitor, register_rule


def healthy_stream(n: int = 40) -> list[dict]:
    """A run that learns: entropy drifting 2.0 -> 1.2, KL rising slowly with +-20% wiggle, a few capped responses."""
    rows = [{"iteration": 0, "eval/math_tiny/acc": 0.1}]  # the evaluation before training: no training keys
    for it in range(1, n + 1):
        wiggle = 1 + 0.2 * math.sin(it)
        rows.append(
            {
                "iteration": it,
                "train/entropy": 2.0 - 0.8 * it / n,
                "kl/value": 1e-3 * it * wiggle,
                "train/len_capped": 0.1 + 0.05 * math.cos(it),
                "loss/total": 0.1 * wiggle,
                "loss/pg": -0.05 * wiggle,
                "train/grad_norm": 0.5 * wiggle,
            }
        )
    return rows


def strict() -> HealthConfig:
    """Every optional rule on, with thresholds the healthy stream stays clear of."""
    return HealthConfig(
        entropy_floor=EntropyFloorRule(floor=0.5, patience=3),
        kl_spike=KLSpikeRule(factor=5.0, window=10, min_history=3),
        length_cap=LengthCapRule(frac=0.5, patience=2),
    )


def first_breach(health: HealthConfig | None, rows: list[dict]):
    return HealthMonitor(health).replay(rows)


def with_values(rows: list[dict], key: str, values: dict[int, float]) -> list[dict]:
    """A copy of `rows` with rows[it][key] = value for each (it, value)."""
    out = [dict(r) for r in rows]
    for it, v in values.items():
        out[it][key] = v
    return out


def test_a_healthy_stream_never_fires():
    assert first_breach(strict(), healthy_stream()) is None
    assert first_breach(None, healthy_stream()) is None  # defaults: only nonfinite, which stays quiet


def test_the_registry_and_the_config_agree():
    """Every rule but nonfinite has a section named after it (and nothing else has one); nonfinite has none."""
    sections = {f.name for f in fields(HealthConfig)}
    assert sections == set(HEALTH_RULES) - {"nonfinite"}
    assert HEALTH_RULES["nonfinite"].metrics == NONFINITE_METRICS
    with pytest.raises(ValueError, match="registered twice"):
        register_rule("kl_spike", ("kl/value",))(lambda history: None)


@pytest.mark.parametrize("key", NONFINITE_METRICS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None])  # None: NaN as the record stores it
def test_nonfinite_fires_at_the_first_bad_value_with_default_settings(key, bad):
    rows = with_values(healthy_stream(), key, {7: bad})
    b = first_breach(HealthConfig(), rows)
    assert (b.rule, b.iteration) == ("nonfinite", 7)
    assert list(b.values) == [key] and key in b.message


def test_entropy_floor_fires_after_patience_iterations_below_the_floor():
    # below 0.5 at iterations 10, 11, 12 (patience 3): fires at 12, not at 10 or 11
    rows = with_values(healthy_stream(), "train/entropy", {10: 0.4, 11: 0.1, 12: 0.01})
    b = first_breach(strict(), rows)
    assert (b.rule, b.iteration) == ("entropy_floor", 12)
    assert b.values == {"train/entropy": [0.4, 0.1, 0.01]}
    # one healthy value in between restarts the count
    rows = with_values(healthy_stream(), "train/entropy", {10: 0.4, 11: 0.9, 12: 0.01, 13: 0.3})
    assert first_breach(strict(), rows) is None
    # the same collapse with the rule off (the default): no fire
    assert first_breach(HealthConfig(), with_values(healthy_stream(), "train/entropy", {10: 0.0, 11: 0.0})) is None


def test_kl_spike_fires_above_factor_times_the_running_median():
    rows = healthy_stream()
    prev = [rows[i]["kl/value"] for i in range(10, 20)]  # the window of 10 before iteration 20
    median = sorted(prev)[4] / 2 + sorted(prev)[5] / 2
    just_below, above = 5.0 * median * 0.999, 5.0 * median * 1.001
    assert first_breach(strict(), with_values(rows, "kl/value", {20: just_below})) is None
    b = first_breach(strict(), with_values(rows, "kl/value", {20: above}))
    assert (b.rule, b.iteration) == ("kl_spike", 20)
    assert b.values["running_median"] == pytest.approx(median, rel=1e-12)


def test_kl_spike_needs_history_and_a_positive_median():
    zeros = [{"iteration": i, "kl/value": 0.0} for i in range(1, 8)] + [{"iteration": 8, "kl/value": 1.0}]
    assert first_breach(strict(), zeros) is None  # a median of 0 gives no scale
    early = [{"iteration": 1, "kl/value": 1e-3}, {"iteration": 2, "kl/value": 1e-3}, {"iteration": 3, "kl/value": 9.0}]
    assert first_breach(strict(), early) is None  # 2 previous values < min_history=3
    b = first_breach(strict(), early[:2] + [{"iteration": 3, "kl/value": 1e-3}, {"iteration": 4, "kl/value": 9.0}])
    assert (b.rule, b.iteration) == ("kl_spike", 4)


def test_length_cap_fires_when_the_capped_share_stays_high():
    rows = with_values(healthy_stream(), "train/len_capped", {5: 0.6, 6: 0.5})
    b = first_breach(strict(), rows)
    assert (b.rule, b.iteration, b.values) == ("length_cap", 6, {"train/len_capped": [0.6, 0.5]})
    assert first_breach(strict(), with_values(healthy_stream(), "train/len_capped", {5: 0.6, 7: 0.9})) is None


def test_the_monitor_state_is_the_stream_alone():
    """Replaying a prefix, then observing the rest, fires exactly where one pass over the whole stream does."""
    rows = with_values(healthy_stream(), "train/entropy", {25: 0.3, 26: 0.2, 27: 0.1})
    whole = first_breach(strict(), rows)
    m = HealthMonitor(strict())
    assert m.replay(rows[:26]) is None
    later = [m.observe(r["iteration"], r) for r in rows[26:]]
    assert next(b for b in later if b) == whole and whole.iteration == 27


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: EntropyFloorRule(floor=0.0), "health.entropy_floor.floor"),
        (lambda: EntropyFloorRule(floor=0.1, patience=0), "health.entropy_floor.patience"),
        (lambda: KLSpikeRule(factor=1.0), "health.kl_spike.factor"),
        (lambda: KLSpikeRule(window=0), "health.kl_spike.window"),
        (lambda: KLSpikeRule(window=4, min_history=5), "health.kl_spike.min_history"),
        (lambda: LengthCapRule(frac=1.5), "health.length_cap.frac"),
        (lambda: LengthCapRule(frac=0.5, patience=True), "health.length_cap.patience"),
    ],
)
def test_each_rule_field_is_validated_by_name(make, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()


# ---------------------------------------------------------------- the metric length_cap reads
class Scripted(torch.nn.Module):
    """A causal LM stand-in whose greedy choice is `script[i]` at the i-th generated position (then eos)."""

    def __init__(self, vocab: int, prompt_len: int, script: list[int], eos: int):
        super().__init__()
        self.vocab, self.prompt_len, self.script, self.eos = vocab, prompt_len, script, eos
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # rollout reads the device from the parameters

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True):
        step = int(position_ids[0, -1]) + 1 - self.prompt_len  # generated tokens so far
        token = self.script[step] if step < len(self.script) else self.eos
        logits = torch.full((*input_ids.shape, self.vocab), -1e4)
        logits[..., token] = 0.0
        return types.SimpleNamespace(logits=logits, past_key_values=None)


@pytest.mark.parametrize(
    "script, capped",
    [
        ("abc", True),  # cut at max_new_tokens=3
        ("ab", False),  # eos as the 3rd token: it finished exactly at the cap
        ("a", False),  # eos as the 2nd
    ],
)
def test_a_response_is_capped_only_when_cut_at_max_new_tokens(script, capped):
    from ema_pg_core.local.rollout import rollout
    from ema_pg_core.local.tiny import build_tokenizer

    tok = build_tokenizer()
    prompt = "1+1="
    ids = [tok.convert_tokens_to_ids(c) for c in script]
    model = Scripted(len(tok), len(tok(prompt, add_special_tokens=False)["input_ids"]), ids, tok.eos_token_id)
    (traj,) = rollout(model, tok, [prompt], max_new_tokens=3, greedy=True)
    assert len(traj.response_ids) == min(3, len(script) + 1) and traj.capped is capped
