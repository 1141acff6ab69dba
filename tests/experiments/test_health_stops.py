"""A health rule ends a real local run as `stopped_unhealthy` (exit 3), through `emapg train` as a user runs it:
the rule, iteration and values are in the run record; an exact resume is refused (it would stop at the same
iteration); a resume that relaxes the rule continues from the last checkpoint before the stop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments import records
from experiments.cli import main
from tests.experiments.small_run import small_run

# optim.lr=1.0 on the tiny model: one update makes the policy deterministic (train/entropy ~1e-6 at iteration 2,
# 0 after; measured), the collapse an absurd learning rate causes
COLLAPSING = small_run(
    {
        "experiment": "math_tiny_grpo",
        "trainer.eval_every": 10,
        "trainer.save_every": 1,
        "trainer.iterations": 4,
        "optim.lr": 1.0,
    }
)
FLOOR = ["health.entropy_floor.floor=0.01", "health.entropy_floor.patience=1"]
pytestmark = pytest.mark.filterwarnings("ignore:pretrain .* did not reach target_acc")  # 2 warm-start steps, on purpose


@pytest.fixture(autouse=True)
def env(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EMAPG_CACHE", str(tmp_path_factory.getbasetemp() / "health_cache"))
    monkeypatch.setenv("EMAPG_PROGRESS", "0")


def train(run_dir: Path, *extra: str) -> int:
    return main(["train", *COLLAPSING, f"run_dir={run_dir}", *extra])


def test_an_entropy_collapse_stops_the_run_and_only_a_changed_rule_resumes_it(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(run, *FLOOR) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("emapg train: stopped unhealthy: health rule entropy_floor fired at iteration"), err
    state, detail = records.read_status(run)
    health = records.read_summary(run)["health"]
    stop = health["iteration"]
    assert state == "stopped_unhealthy" and records.read_summary(run)["health"] == health
    assert health["rule"] == "entropy_floor" and health["message"] in detail
    assert json.loads(detail.splitlines()[-1]) == health  # the status file's last line: the breach as JSON
    rows = records.read_metrics(run)
    assert [r["iteration"] for r in rows] == list(range(stop + 1)) and 1 <= stop < 4  # stopped early
    assert health["values"]["train/entropy"] == [rows[-1]["train/entropy"]] and rows[-1]["train/entropy"] < 0.01
    assert all(r["train/entropy"] >= 0.01 for r in rows[1:-1])  # it fired at the first value below the floor
    assert (run / "checkpoints" / "latest").read_text() == f"iter_{stop - 1:06d}"  # none of the stopped iteration

    assert train(run, *FLOOR, "resume=true") == 2  # the same settings would stop at the same iteration
    assert "an exact resume would stop there again" in capsys.readouterr().err
    assert records.read_status(run)[0] == "stopped_unhealthy"

    assert train(run, "health.entropy_floor.floor=null", "resume=true") == 0  # the rule relaxed: it continues
    assert records.read_status(run)[0] == "finished" and "health" not in records.read_summary(run)
    assert [r["iteration"] for r in records.read_metrics(run)] == [0, 1, 2, 3, 4]
    (resume,) = records.read_resumes(run)
    assert resume["checkpoint"] == f"iter_{stop - 1:06d}" and not resume["forced"]
    assert resume["changes"] == {"health.entropy_floor.floor": [0.01, None], "health.entropy_floor.patience": [1, 5]}


def test_a_non_finite_update_on_an_evaluation_iteration_stops_the_run_before_the_evaluation(
    tmp_path, capsys, monkeypatch
):
    """NaN advantages at iteration 2 (what algo.adv.eps=0 gives on a group of equal rewards: 0/0), an iteration
    that evaluates: the NaN loss makes the parameters NaN, and an evaluation would sample from NaN
    probabilities. The health stop comes first: the step is recorded, the run ends stopped_unhealthy, exit 3."""
    import ema_pg_core.local.trainer as trainer_module

    real, calls = trainer_module.compute_advantages, []

    def poisoned(*args, **kwargs):
        adv = real(*args, **kwargs)
        calls.append(1)
        return adv * float("nan") if len(calls) == 2 else adv

    monkeypatch.setattr(trainer_module, "compute_advantages", poisoned)
    run = tmp_path / "run"
    assert main(["train", *small_run({"trainer.iterations": 4, "trainer.eval_every": 2}), f"run_dir={run}"]) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("emapg train: stopped unhealthy: health rule nonfinite fired at iteration 2"), err
    assert records.read_status(run)[0] == "stopped_unhealthy"
    rows = records.read_metrics(run)
    assert [r["iteration"] for r in rows] == [0, 1, 2] and rows[-1]["loss/total"] is None  # NaN, recorded
    assert not any(k.startswith("eval/") for k in rows[-1])  # no evaluation of the NaN parameters
