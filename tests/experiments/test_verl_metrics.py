"""verl's file-logger lines -> the run record: key mapping (hand-written lines in verl 0.9.1's
format), attempts across resumes, and `experiments.run.run` with the verl backend end to end
through a stand-in for verl's launcher (no verl, no GPU)."""

import json

import pytest

from experiments import build
from experiments.backends.verl.config import rotate
from experiments.records import read_metrics, read_status, read_summary
from experiments.run import run
from experiments.verl_metrics import FILE, attempt_files, convert, read_attempts, to_rows

STEP = {  # one training step as verl 0.9.1 logs it, with a validation
    "critic/score/mean": 0.25,
    "response_length/mean": 812.5,
    "actor/pg_loss": -0.01,
    "actor/kl_loss": 0.003,
    "actor/pg_clipfrac": 0.02,
    "actor/pg_clipfrac_lower": 0.0,
    "actor/ppo_kl": 1e-4,
    "actor/entropy": 0.6,
    "actor/grad_norm": 0.4,
    "timing_s/step": 95.0,
    "anchor/drift": 0.01,
    "anchor/updated": 1.0,
    "val-core/aime2024/reward/mean@8": 0.30,
    "val-core/amc/reward/mean@8": 0.50,
    "val-aux/aime2024/reward/std@8": 0.1,
    "val-core/aime2024/reward/best@8/mean": 0.6,
    "perf/mfu/actor": 0.3,
}


def test_convert_maps_verl_keys_and_averages_the_sources():
    out = convert(STEP, task="math", greedy=False)
    assert out == {
        "train/reward": 0.25,
        "train/response_len": 812.5,
        "loss/pg": -0.01,
        "kl/value": 0.003,
        "loss/clip_frac": 0.02,
        "loss/dual_clip_frac": 0.0,
        "loss/approx_kl": 1e-4,
        "train/entropy": 0.6,
        "train/grad_norm": 0.4,
        "perf/iter_s": 95.0,
        "anchor/drift": 0.01,
        "anchor/updated": 1.0,
        "eval/aime2024/pass@1": 0.30,
        "eval/amc/pass@1": 0.50,
        "eval/math/pass@1": pytest.approx(0.40),  # (0.30 + 0.50) / 2, unweighted like the paper's average
    }
    greedy = convert({"val-core/nq/acc/mean@1": 1.0, "val-core/hotpotqa/acc/mean@1": 0.0}, task="search", greedy=True)
    assert greedy == {"eval/nq/acc": 1.0, "eval/hotpotqa/acc": 0.0, "eval/search/acc": 0.5}
    assert convert({"critic/score/mean": 0.1}, task="math", greedy=False) == {"train/reward": 0.1}  # no eval step


def _write(path, rows, tail=""):
    path.write_text("".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in rows) + tail)


def test_attempts_rotate_and_a_resume_replaces_the_steps_it_replays(tmp_path):
    live = tmp_path / FILE
    rotate(live)  # nothing to move yet
    assert attempt_files(tmp_path) == []
    _write(live, [(1, {"a": 1}), (2, {"a": 2}), (3, {"a": 3})], tail='{"step": 4, "da')  # crashed mid-line
    rotate(live)
    _write(live, [(3, {"a": 30}), (4, {"a": 40})])  # resumed from the step-2 checkpoint
    rotate(live)
    _write(live, [(5, {"a": 50}), (5, {"b": 5})])
    assert [p.name for p in attempt_files(tmp_path)] == ["verl_metrics.1.jsonl", "verl_metrics.2.jsonl", FILE]
    assert read_attempts(attempt_files(tmp_path)) == {
        1: {"a": 1},
        2: {"a": 2},
        3: {"a": 30},
        4: {"a": 40},
        5: {"a": 50, "b": 5},
    }
    (tmp_path / "verl_metrics.1.jsonl").write_text('{"step": 1, "data": {}}\nnot json\n{"step": 2, "data": {}}\n')
    with pytest.raises(ValueError, match=r"verl_metrics.1.jsonl:2: not a JSON line"):
        read_attempts(attempt_files(tmp_path))


def test_a_resumed_attempts_first_validation_joins_the_checkpoint_step(tmp_path):
    """verl validates first after a resume and logs it at the checkpoint's step: that step's training
    metrics (in the checkpoint) stay, the validation is added; a step trained again is replaced."""
    live = tmp_path / FILE
    train = {"actor/pg_loss": 0.1, "training/global_step": 2, "anchor/updated": 1.0}
    _write(live, [(1, {"actor/pg_loss": 0.0}), (2, train)])
    rotate(live)
    _write(live, [(2, {"val-core/aime2024/reward/mean@1": 0.5}), (3, {"actor/pg_loss": 0.3})])
    steps = read_attempts(attempt_files(tmp_path))
    assert steps[2] == {**train, "val-core/aime2024/reward/mean@1": 0.5}
    assert steps[3] == {"actor/pg_loss": 0.3}
    _write(live, [(2, {"actor/pg_loss": 0.9})])  # an attempt that trained step 2 again replaces it
    assert read_attempts(attempt_files(tmp_path))[2] == {"actor/pg_loss": 0.9}


class FakeVerl:
    """`experiments.backends.verl.launch.run_config` stand-in: writes verl's file-logger lines like verl would
    (to the path our TaskRunner rotates), then returns 0 or crashes. Set `steps`/`crash` per call."""

    def __init__(self):
        self.steps, self.crash, self.calls = (1, 2), False, []

    def run_config(self, run, wandb=None):
        self.calls.append(run)
        with open(rotate(f"{run['run_dir']}/{FILE}"), "w") as f:
            for s in self.steps:
                f.write(json.dumps({"step": s, "data": {**STEP, "val-core/aime2024/reward/mean@8": 0.1 * s}}) + "\n")
        if self.crash:
            raise RuntimeError("NCCL timeout")
        return 0


@pytest.fixture
def fake_verl(monkeypatch):
    fake = FakeVerl()
    monkeypatch.setattr("experiments.backends.verl.launch.run_config", lambda *a, **k: fake.run_config(*a, **k))
    monkeypatch.setattr("experiments.backends.verl.require_verl", lambda: None)
    return fake


def test_verl_run_writes_a_run_record_and_keeps_lines_of_a_crash(fake_verl, tmp_path):
    cfg = build.compose(["experiment=math_deepscaler_ema_pg", f"run_dir={tmp_path}/run", "logger=none"])
    fake_verl.crash = True
    with pytest.raises(RuntimeError, match="NCCL timeout"):
        run(cfg)
    assert read_status(tmp_path / "run")[0] == "failed"
    assert [r["iteration"] for r in read_metrics(tmp_path / "run")] == [1, 2]  # kept

    fake_verl.crash, fake_verl.steps = False, (2, 3)  # verl resumes from its step-1 checkpoint
    reported = []
    final = run(
        build.compose(["experiment=math_deepscaler_ema_pg", f"run_dir={tmp_path}/run", "logger=none", "resume=true"]),
        callback=lambda it, metrics, ckpt: reported.append((it, metrics["eval/aime2024/pass@1"], ckpt)),
    )
    assert reported == [(1, 0.1, None), (2, 0.2, None), (3, pytest.approx(0.3), None)]  # a sweep's reporter
    rows = read_metrics(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert [r["eval/aime2024/pass@1"] for r in rows] == pytest.approx([0.1, 0.2, 0.3])
    assert [c["run_dir"] for c in fake_verl.calls] == [f"{tmp_path}/run"] * 2  # -> emapg.metrics_path
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "finished" and summary["iterations_done"] == 3
    # the GPU sweep's metric (sweeps/math_deepscaler_ema_pg.yaml) is produced
    assert final["eval/aime2024/pass@1"] == pytest.approx(0.3) and final["best_eval/aime2024/pass@1"] == pytest.approx(
        0.3
    )
    assert to_rows(tmp_path / "run", "math", greedy=False)[0][1]["eval/math/pass@1"] == pytest.approx((0.1 + 0.5) / 2)


def test_a_verl_run_is_recorded_and_reported_while_it_runs(monkeypatch, tmp_path):
    """verl runs in a worker thread; the caller's thread turns each logged step into a metrics line
    and a callback while verl is still running (a sweep's trial sees every iteration live)."""
    import threading

    monkeypatch.setattr("experiments.run.VERL_POLL_S", 0.01)
    monkeypatch.setattr("experiments.backends.verl.require_verl", lambda: None)
    seen_live = threading.Event()
    callers = set()

    def run_config(run, wandb=None):  # logs step 1, then waits until step 1 was recorded and reported
        with open(rotate(f"{run['run_dir']}/{FILE}"), "w") as f:
            f.write(json.dumps({"step": 1, "data": STEP}) + "\n")
            f.flush()
            if not seen_live.wait(timeout=30):
                raise AssertionError("step 1 was not reported while verl was running")
            assert [r["iteration"] for r in read_metrics(run["run_dir"])] == [1]
            f.write(json.dumps({"step": 2, "data": STEP}) + "\n")
        return 0

    monkeypatch.setattr("experiments.backends.verl.launch.run_config", run_config)

    def callback(it, metrics, ckpt):
        callers.add(threading.current_thread().name)
        if it == 1:
            seen_live.set()

    reported = []
    run(
        build.compose(["experiment=math_deepscaler_ema_pg", f"run_dir={tmp_path}/run", "logger=none"]),
        callback=lambda it, m, ckpt: (reported.append((it, m["train/reward"], ckpt)), callback(it, m, ckpt)),
    )
    assert reported == [(1, 0.25, None), (2, 0.25, None)]
    assert callers == {threading.current_thread().name}  # Tune's report stays in the trial's thread
    assert [r["iteration"] for r in read_metrics(tmp_path / "run")] == [1, 2]


def test_follower_rewinds_a_step_a_resumed_attempt_replays(tmp_path):
    from experiments.records import RunRecord
    from experiments.run import _VerlFollower

    cfg = build.compose(["experiment=math_deepscaler_ema_pg", f"run_dir={tmp_path}", "logger=none"])
    reported = []
    with RunRecord.create(tmp_path, cfg) as record:
        follower = _VerlFollower(record, cfg, lambda it, m, ckpt: reported.append((it, m["train/reward"])))
        _write(
            tmp_path / FILE, [(1, {"critic/score/mean": 0.1}), (2, {"critic/score/mean": 0.2})], tail='{"step": 3, "da'
        )  # half-written: waits for the next poll
        follower.poll()
        assert [(r["iteration"], r["train/reward"]) for r in read_metrics(tmp_path)] == [(1, 0.1), (2, 0.2)]
        rotate(tmp_path / FILE)  # a new attempt, resumed from the step-1 checkpoint, replays step 2
        _write(tmp_path / FILE, [(2, {"critic/score/mean": 0.25}), (3, {"critic/score/mean": 0.3})])
        follower.poll()
        follower.poll()  # nothing new: nothing changes
    assert [(r["iteration"], r["train/reward"]) for r in read_metrics(tmp_path)] == [(1, 0.1), (2, 0.25), (3, 0.3)]
    assert reported == [(1, 0.1), (2, 0.2), (3, 0.3)]  # each iteration once, in order


def test_follower_stops_a_run_on_failed_rollouts_or_no_progress_but_not_a_finished_one(tmp_path, monkeypatch):
    from experiments.backends.verl import failures
    from experiments.records import RunRecord
    from experiments.run import RunFailed, _VerlFollower

    reported = {"count": 0}
    monkeypatch.setattr(
        failures, "first_failure", lambda tolerated=0: "boom" if reported["count"] > tolerated else None
    )
    cfg = build.compose(
        [
            "experiment=math_deepscaler_ema_pg",
            f"run_dir={tmp_path}",
            "logger=none",
            "backend.verl.max_failed_rollouts=1",
            "backend.verl.step_timeout_s=100",
        ]
    )
    with pytest.raises(RunFailed, match="boom"), RunRecord.create(tmp_path, cfg) as record:
        follower = _VerlFollower(record, cfg, None)
        reported["count"] = 1
        follower.poll()  # one failed rollout is tolerated
        follower.progress_t -= 150  # no step for 150 s ...
        _write(tmp_path / FILE, [(1, {"critic/score/mean": 0.1})])
        follower.poll()  # ... but this poll sees step 1: the timer restarts instead of stopping the run
        follower.done = True
        reported["count"] = 2
        follower.poll()  # verl has returned: nothing to watch
        follower.done, reported["count"] = False, 1
        follower.progress_t -= 150
        stalled = r"no training step completed for 1\d\d s \(backend.verl.step_timeout_s=100\)"
        with pytest.raises(RunFailed, match=stalled):
            follower.poll()
        follower.progress_t += 150
        reported["count"] = 2
        follower.poll()  # the second failed rollout is one too many


@pytest.mark.parametrize("poll_s", [0.0, 30.0])  # verl ends before the first tick, or before any timed one
def test_a_crash_after_some_steps_keeps_and_reports_them_then_raises(fake_verl, tmp_path, monkeypatch, poll_s):
    monkeypatch.setattr("experiments.run.VERL_POLL_S", poll_s)
    fake_verl.crash, fake_verl.steps = True, (1, 2, 3)
    reported = []
    with pytest.raises(RuntimeError, match="NCCL timeout"):
        run(
            build.compose(["experiment=math_deepscaler_ema_pg", f"run_dir={tmp_path}/run", "logger=none"]),
            callback=lambda it, m, ckpt: reported.append(it),
        )
    assert [r["iteration"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]
    assert reported == [1, 2, 3] and read_status(tmp_path / "run")[0] == "failed"


def test_the_last_tick_comes_after_the_work_ended_even_when_it_ends_during_a_tick():
    """The interleaving CI hit: verl finishes while a tick is running. That tick saw the work
    unfinished, so one more must follow (before the fix the loop saw the thread gone and stopped)."""
    import threading
    import time

    from experiments.run import _in_thread

    go, done, seen = threading.Event(), [], []

    def work():
        go.wait(timeout=30)
        done.append(True)
        return 7

    def tick():
        seen.append(bool(done))
        if not go.is_set():  # the first tick: let the work run to its end and its thread go away
            go.set()
            deadline = time.monotonic() + 30
            while any(t.name == "verl" for t in threading.enumerate()) and time.monotonic() < deadline:
                time.sleep(0.001)

    assert _in_thread(work, tick, every_s=0.0) == 7
    assert seen[0] is False and seen[-1] is True  # the last tick saw everything the work did


@pytest.mark.parametrize("stop, code", [(KeyboardInterrupt(), 130), ("SIGTERM", 143)], ids=["SIGINT", "SIGTERM"])
def test_a_stopped_verl_run_is_interrupted_not_failed(fake_verl, tmp_path, monkeypatch, capsys, stop, code):
    """Ctrl-C or SIGTERM (experiments.errors.Terminated, raised by the CLI's handler) while verl runs:
    verl's workers are stopped, the steps it logged are kept, the record says interrupted."""
    from experiments.cli import main
    from experiments.errors import Terminated

    stopped = []
    monkeypatch.setattr("experiments.backends.verl.failures.stop_run", lambda: stopped.append(True))
    real = fake_verl.run_config

    def run_config(run, wandb=None):
        real(run)
        raise Terminated(stop) if isinstance(stop, str) else stop

    fake_verl.run_config = run_config
    assert main(["train", "experiment=math_deepscaler_ema_pg", f"run_dir={tmp_path}/run", "logger=none"]) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"run_dir={tmp_path}/run resume=true" in err
    state, message = read_status(tmp_path / "run")
    assert state == "interrupted" and "verl's last checkpoint" in message
    assert [r["iteration"] for r in read_metrics(tmp_path / "run")] == [1, 2] and stopped == [True]


# ---------------------------------------------------------------- per-problem rows and the anchor's evaluation
def test_validation_samples_become_one_row_per_problem_and_model():
    from experiments.backends.verl.evals import anchor_keys, problem_id, problem_rows

    # two prompts x 3 samples, interleaved as verl may return them; scores are the 0/1 reward
    sources = ["aime2024", "amc", "aime2024", "amc", "aime2024", "amc"]
    uids = ["u1", "u2", "u1", "u2", "u1", "u2"]
    prompts = ["p1", "p2", "p1", "p2", "p1", "p2"]
    scores = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    rows = problem_rows(4, "anchor", sources=sources, uids=uids, prompts=prompts, scores=scores, greedy=False)
    assert rows == [
        {"iteration": 4, "model": "anchor", "benchmark": "aime2024", "problem_id": problem_id("aime2024", "p1"),
         "n": 3, "n_correct": 2, "greedy_correct": None},
        {"iteration": 4, "model": "anchor", "benchmark": "amc", "problem_id": problem_id("amc", "p2"),
         "n": 3, "n_correct": 1, "greedy_correct": None},
    ]  # fmt: skip
    assert [
        r["greedy_correct"]
        for r in problem_rows(0, "policy", sources=sources, uids=uids, prompts=prompts, scores=scores, greedy=True)
    ] == [1, 0]
    assert problem_id("amc", "p2") == problem_id("amc", "p2") != problem_id("amc", "p3")  # stable, per prompt
    with pytest.raises(ValueError, match="misaligned"):
        problem_rows(0, "policy", sources=sources, uids=uids[:-1], prompts=prompts, scores=scores, greedy=False)
    assert anchor_keys({"val-core/amc/reward/mean@3": 0.5, "val-aux/num_turns/min": 1, "x": 2}) == {
        "val-anchor-core/amc/reward/mean@3": 0.5,
        "val-anchor-aux/num_turns/min": 1,
        "x": 2,
    }


def test_convert_maps_the_anchors_validation_to_eval_anchor():
    data = {
        "val-core/aime2024/reward/mean@8": 0.25,
        "val-core/amc/reward/mean@8": 0.5,
        "val-anchor-core/aime2024/reward/mean@8": 0.125,
        "val-anchor-core/amc/reward/mean@8": 0.375,
    }
    out = convert(data, "math", greedy=False)
    assert out["eval_anchor/aime2024/pass@1"] == 0.125 and out["eval_anchor/amc/pass@1"] == 0.375
    assert out["eval_anchor/math/pass@1"] == pytest.approx(0.25) and out["eval/math/pass@1"] == pytest.approx(0.375)


def test_anchor_weights_go_into_the_actor_and_the_actor_comes_back_exactly():
    import torch

    from experiments.backends.verl.evals import load_anchor_, restore_actor_

    g = torch.Generator().manual_seed(0)
    actor = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g, dtype=torch.float64)]
    anchor = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g, dtype=torch.float64)]
    before = [a.clone() for a in actor]
    saved = load_anchor_(actor, anchor)
    assert all(torch.equal(a, r) for a, r in zip(actor, anchor))
    restore_actor_(actor, saved)
    assert all(torch.equal(a, b) for a, b in zip(actor, before))


def test_follower_records_the_rows_of_the_steps_it_recorded(tmp_path):
    from experiments.backends.verl.evals import FILE as EVALS
    from experiments.backends.verl.evals import append_rows
    from experiments.records import RunRecord, read_evals
    from experiments.run import _VerlFollower

    def row(it, model, pid, c):
        return {"iteration": it, "model": model, "benchmark": "aime2024", "problem_id": pid, "n": 2,
                "n_correct": c, "greedy_correct": None}  # fmt: skip

    cfg = build.compose(["experiment=math_deepscaler_ema_pg", f"run_dir={tmp_path}", "logger=none"])
    with RunRecord.create(tmp_path, cfg) as record:
        follower = _VerlFollower(record, cfg, None)
        append_rows(str(tmp_path / EVALS), [row(0, "policy", "a", 1), row(0, "anchor", "a", 1)])
        append_rows(str(tmp_path / EVALS), [row(2, "policy", "a", 2), row(2, "anchor", "a", 0)])  # step 2 pending
        _write(tmp_path / FILE, [(0, {"val-core/aime2024/reward/mean@2": 0.5}), (1, {"critic/score/mean": 0.1})])
        follower.poll()
        assert {(r["iteration"], r["model"]) for r in read_evals(tmp_path)} == {(0, "policy"), (0, "anchor")}
        _write(tmp_path / FILE, [(0, {"val-core/aime2024/reward/mean@2": 0.5}), (1, {"critic/score/mean": 0.1}),
                                 (2, {"critic/score/mean": 0.2})])  # fmt: skip
        follower.poll()
        follower.poll()
    got = sorted((r["iteration"], r["model"], r["n_correct"]) for r in read_evals(tmp_path))
    assert got == [(0, "anchor", 1), (0, "policy", 1), (2, "anchor", 0), (2, "policy", 2)]  # each once
