"""EmaPGTrainerSync's validation: per-problem rows for the policy, then the EMA anchor validated with
its weights in the actor (sleep, swap in, weight sync, validate, sleep, swap back, weight sync), and
before any update the policy's rows copied as the anchor's. verl's `_validate` is replaced by a stand-in
that calls our two hooks the way verl 0.9.1's does; verl's own `_val_metrics_update` computes the metrics."""

import json

import pytest
from omegaconf import OmegaConf

pytestmark = pytest.mark.verl


class Recorder:
    def __init__(self, calls):
        self.calls = calls

    def sleep_replicas(self):
        self.calls.append("sleep")

    def update_weights(self, steps=None):
        self.calls.append(f"sync@{steps}")

    def anchor_in_actor(self, on):
        self.calls.append(f"anchor_in_actor({on})")


@pytest.fixture
def trainer(tmp_path, monkeypatch):
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from experiments.backends.verl.trainer import EmaPGTrainerSync

    calls = []

    def validate(self):  # verl's order: generations (prompts, scores per sample), then the metrics
        calls.append(f"validate:{self._eval_as}")
        ok = [1.0, 1.0, 0.0, 1.0] if self._eval_as == "policy" else [0.0, 1.0, 0.0, 0.0]
        self._maybe_log_val_generations(["p1", "p1", "p2", "p2"], ["o"] * 4, ok)
        return self._val_metrics_update(
            ["amc"] * 4, ["u1", "u1", "u2", "u2"], {"reward": ok}, [], expected_acc_counts=None
        )

    monkeypatch.setattr(PPOTrainerSync, "_validate", validate, raising=False)
    t = object.__new__(EmaPGTrainerSync)
    t.config = OmegaConf.create(
        {"trainer": {"log_val_generations": 0}, "actor_rollout_ref": {"rollout": {"val_kwargs": {"do_sample": True}}}}
    )
    t._evals, t._eval_as, t._val_samples, t._val_rows = str(tmp_path / "verl_evals.jsonl"), "policy", ([], []), []
    t.checkpoint_manager = t.actor_rollout_wg = Recorder(calls)
    return t, calls, tmp_path / "verl_evals.jsonl"


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_anchor_is_validated_with_its_own_weights_and_the_actor_restored(trainer):
    t, calls, path = trainer
    t.global_steps = 3
    metrics = t._validate()
    assert calls == [
        "validate:policy",
        "sleep",
        "anchor_in_actor(True)",
        "sync@3",
        "validate:anchor",
        "sleep",
        "anchor_in_actor(False)",
        "sync@3",
    ]
    assert metrics["val-core/amc/reward/mean@2"] == pytest.approx(0.75)
    assert metrics["val-anchor-core/amc/reward/mean@2"] == pytest.approx(0.25)
    got = [(r["iteration"], r["model"], r["n"], r["n_correct"]) for r in rows(path)]
    assert got == [(3, "policy", 2, 2), (3, "policy", 2, 1), (3, "anchor", 2, 1), (3, "anchor", 2, 0)]
    assert t._eval_as == "policy"


def test_before_any_update_the_policys_rows_are_the_anchors(trainer):
    t, calls, path = trainer
    t.global_steps = 0
    metrics = t._validate()
    assert calls == ["validate:policy"]  # no swap, no extra weight sync
    assert metrics["val-anchor-core/amc/reward/mean@2"] == metrics["val-core/amc/reward/mean@2"]
    got = [(r["model"], r["problem_id"], r["n_correct"]) for r in rows(path)]
    assert [g[1:] for g in got[:2]] == [g[1:] for g in got[2:]] and [g[0] for g in got] == ["policy"] * 2 + [
        "anchor"
    ] * 2
