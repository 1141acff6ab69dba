"""The trial's callback -> tune.report translation, without Ray running: one report per training
iteration, each with the checkpoint written at that iteration, the sweep metric in every report,
and the search space's encoding for Tune / Optuna decoded back into config values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sweeps import results
from sweeps import tune as T
from sweeps.spec import parse

ACC = "eval/math_tiny/acc"


@pytest.fixture
def reports(monkeypatch):
    out = []
    monkeypatch.setattr(T.tune, "report", lambda metrics, checkpoint=None: out.append((metrics, checkpoint)))
    return out


def ckpt(tmp_path: Path, it: int) -> Path:
    p = tmp_path / "checkpoints" / f"iter_{it:06d}"
    p.mkdir(parents=True, exist_ok=True)
    (p / "state.pt").write_text(str(it))
    (tmp_path / "checkpoints" / "latest").write_text(p.name)
    return p


def drive(tmp_path, iterations=4, save_every=2) -> T._Reporter:
    """Feed the callback as experiments.run does: each checkpoint with its own iteration's metrics."""
    r = T._Reporter(ACC, "max", last=iterations)
    r(0, {ACC: 0.1}, None)
    for it in range(1, iterations + 1):
        m = {"train/reward": it / 10, **({ACC: it / 10} if it % 2 == 0 else {})}
        saving = it % save_every == 0 or it == iterations
        r(it, m, ckpt(tmp_path, it) if saving else None)
    r.finish()  # as _trial does once run() returned
    return r


def test_one_report_per_iteration_with_its_own_checkpoint(tmp_path, reports):
    drive(tmp_path)
    assert [m["iteration"] for m, _ in reports] == [1, 2, 3, 4]  # iteration 0 stays in the record
    with_ckpt = {m["iteration"]: c for m, c in reports if c is not None}
    assert sorted(with_ckpt) == [2, 4]
    for it, c in with_ckpt.items():
        meta = c.get_metadata()
        assert (meta["iteration"], meta["name"]) == (it, f"iter_{it:06d}")
        assert (Path(c.path) / "state.pt").read_text() == str(it)


def test_the_last_iteration_is_reported_after_the_run_returned(tmp_path, reports):
    """A scheduler may stop the trial at its last report (ASHA at max_t): the run record is finished by then."""
    r = T._Reporter(ACC, "max", last=2)
    r(1, {ACC: 0.1}, None)
    r(2, {ACC: 0.3}, ckpt(tmp_path, 2))
    assert [m["iteration"] for m, _ in reports] == [1]
    r.finish()
    assert [m["iteration"] for m, _ in reports] == [1, 2] and reports[1][1].get_metadata()["iteration"] == 2
    r.finish()
    assert len(reports) == 2


def test_metric_carried_between_evaluations(tmp_path, reports):
    drive(tmp_path)
    assert [m[ACC] for m, _ in reports] == [0.1, 0.2, 0.2, 0.4]  # iteration 1 carries the eval at 0
    assert [m["best_" + ACC] for m, _ in reports] == [0.1, 0.2, 0.2, 0.4]
    assert reports[1][1].get_metadata()["carry"] == {ACC: 0.2, "best_" + ACC: 0.2}


def test_best_metric_respects_mode(reports):
    r = T._Reporter("best_" + ACC, "min")
    for it, v in enumerate([0.5, 0.2, 0.7]):
        r(it, {ACC: v}, None)
    r(3, {}, None)
    assert [m["best_" + ACC] for m, _ in reports] == [0.2, 0.2, 0.2]


def test_metric_never_seen_is_nan(reports):
    r = T._Reporter(ACC, "max")
    r(1, {"train/reward": 1.0}, None)
    assert reports[0][0][ACC] != reports[0][0][ACC]  # NaN: Tune's strict metric check passes


def test_space_encoding_round_trips():
    spec = parse(
        {
            "name": "t",
            "base": {"experiment": "math_tiny_ema_pg"},
            "metric": ACC,
            "search": "random",
            "space": {
                "algo.kl.type,algo.kl.tail": {"choice": [["k3", "none"], ["topk_reverse", "paper"]]},
                "algo.anchor.period": {"int": [1, 3]},
                "algo.kl.coef": {"loguniform": [1e-4, 1e-2]},
            },
            "seeds": [5, 6],
        },
        check_config=False,
    )
    space = T.param_space(spec)
    assert list(space) == ["algo.kl.coef", "algo.anchor.period", "algo.kl.type,algo.kl.tail", "seed"]
    assert space["algo.kl.type,algo.kl.tail"].categories == [0, 1]  # indices: Optuna takes scalars only
    assert (space["algo.anchor.period"].lower, space["algo.anchor.period"].upper) == (1, 4)  # int is inclusive
    import numpy as np

    point, seed = T.decode(
        spec,
        {
            "algo.kl.type,algo.kl.tail": np.int64(1),
            "algo.anchor.period": np.int64(3),
            "algo.kl.coef": np.float64(1e-3),
            "seed": 6,
        },
    )
    assert point == {
        "algo.kl.type": "topk_reverse",
        "algo.kl.tail": "paper",
        "algo.anchor.period": 3,
        "algo.kl.coef": 1e-3,
    }
    assert seed == 6 and type(point["algo.anchor.period"]) is int
    assert (
        T.describe(spec, {"algo.kl.type,algo.kl.tail": 0, "algo.anchor.period": 2, "algo.kl.coef": 0.01, "seed": 5})
        == "type=k3 tail=none period=2 coef=0.01 seed=5"
    )


def test_optuna_seeds_come_from_the_repeat_index():
    spec = parse(
        {
            "name": "t",
            "base": {"experiment": "math_tiny_ema_pg"},
            "metric": ACC,
            "search": "optuna",
            "space": {"algo.anchor.tau": {"uniform": [0.5, 1.0]}},
            "seeds": [3, 4],
        },
        check_config=False,
    )
    assert "seed" not in T.param_space(spec)
    assert T.decode(spec, {"algo.anchor.tau": 0.7, T.TRIAL_INDEX: 1}) == ({"algo.anchor.tau": 0.7}, 4)


def test_restore_puts_the_checkpoint_back(tmp_path, monkeypatch):
    """A restored trial: Tune's checkpoint becomes the run's latest; later checkpoints of the failed attempt go."""
    src = tmp_path / "tune_ckpt"
    src.mkdir()
    (src / "state.pt").write_text("3")
    c = T.tune.Checkpoint.from_directory(str(src))
    c.set_metadata({"iteration": 3, "name": "iter_000003", "carry": {ACC: 0.3}})
    monkeypatch.setattr(T.tune, "get_checkpoint", lambda: c)
    run_dir = tmp_path / "run"
    for it in (3, 4):
        ckpt(run_dir, it)
    assert T._restore(run_dir, T._Reporter(ACC, "max")) == {ACC: 0.3}  # the reporter's carried values
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text() == "iter_000003" and (root / "iter_000003" / "state.pt").read_text() == "3"
    assert not (root / "iter_000004").exists()
    monkeypatch.setattr(T.tune, "get_checkpoint", lambda: None)
    (run_dir / "config.yaml").write_text("seed: 0\n")  # a run record: its own checkpoints are resumed
    rows = [
        {"iteration": 0, ACC: 0.1},
        {"iteration": 2, ACC: 0.5},
        {"iteration": 3, ACC: 0.2},
        {"iteration": 4, ACC: 1},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert T._restore(run_dir, T._Reporter(ACC, "max")) == {ACC: 0.2, "best_" + ACC: 0.5}  # rows up to iteration 3
    assert (root / "iter_000003").is_dir()
    (run_dir / "config.yaml").unlink()  # checkpoints without a run record: a fresh start
    assert T._restore(run_dir, T._Reporter(ACC, "max")) is None and not run_dir.exists()
    run_dir.mkdir()
    assert T._restore(run_dir, T._Reporter(ACC, "max")) is None and not run_dir.exists()  # no checkpoint at all


def test_results_get_what_tune_knows_in_launch_order():
    """sweeps.results gets each trial's id, state, decoded knobs, seed, iterations and error line (the CSV
    itself: tests/sweeps/test_results.py)."""
    spec = parse(
        {
            "name": "t",
            "base": {"experiment": "math_tiny_ema_pg"},
            "metric": ACC,
            "space": {"algo.anchor.tau": {"grid": [1.0, 0.9]}},
        },
        check_config=False,
    )

    class Trial:
        def __init__(self, tid, tau, status, it):
            self.trial_id, self.status, self.config = tid, status, {"algo.anchor.tau": tau, "seed": 0}
            self.last_result, self.error_file = {"training_iteration": it}, None
            self.experiment_tag = f"{tid[-1]}_algo.anchor.tau={tau}"

    known = T._known(spec, [Trial("a_1", 0.9, "ERROR", 1), Trial("a_0", 1.0, "TERMINATED", 3)])
    assert known == [
        results.Trial("a_0", "TERMINATED", {"algo.anchor.tau": 1.0}, 0, iterations=3),
        results.Trial("a_1", "ERROR", {"algo.anchor.tau": 0.9}, 0, iterations=1),
    ]


def test_restore_prefers_the_runs_own_checkpoint_when_it_is_newer_than_tunes(tmp_path, monkeypatch):
    """A driver killed a few seconds after Tune last saved its state: Tune restores the trial with the checkpoint
    of iteration 3, the run directory holds iteration 4 (complete, and its rows): the run continues from 4."""
    src = tmp_path / "tune_ckpt"
    src.mkdir()
    (src / "state.pt").write_text("3")
    c = T.tune.Checkpoint.from_directory(str(src))
    c.set_metadata({"iteration": 3, "name": "iter_000003", "carry": {ACC: 0.3}})
    monkeypatch.setattr(T.tune, "get_checkpoint", lambda: c)
    run_dir = tmp_path / "run"
    for it in (3, 4):
        ckpt(run_dir, it)
    (run_dir / "config.yaml").write_text("seed: 0\n")
    rows = [{"iteration": 2, ACC: 0.2}, {"iteration": 4, ACC: 0.6}, {"iteration": 5, ACC: 0.9}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert T._restore(run_dir, T._Reporter(ACC, "max")) == {ACC: 0.6, "best_" + ACC: 0.6}
    assert (run_dir / "checkpoints" / "iter_000004").is_dir()  # kept: the run resumes from it
