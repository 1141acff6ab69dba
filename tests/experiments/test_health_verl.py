"""Health rules on the verl backend: the follower that turns verl's metrics file into the run record stops the run
(stopped_unhealthy, verl's workers stopped the way the failure paths stop them) at the step a rule fires on; a
resumed run's older attempts feed the rules but never fire again. Hand-written lines in verl 0.9.1's file-logger
format (as in test_verl_metrics.py); no verl, no GPU."""

import json
import math
import types

import pytest

from experiments import build
from experiments.backends.verl.config import rotate
from experiments.errors import StoppedUnhealthy
from experiments.records import RunRecord, read_metrics, read_status, read_summary
from experiments.run import _VerlFollower, run
from experiments.verl_metrics import FILE

TRAIN = {"critic/score/mean": 0.25, "actor/pg_loss": -0.01, "actor/kl_loss": 0.003, "actor/grad_norm": 0.4}


def _write(path, rows):
    """verl's file logger writes NaN as the bare token NaN (json.dumps' default)."""
    path.write_text("".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in rows))


def _cfg(run_dir, *extra):
    return build.compose(["experiment=math_deepscaler_ema_pg", f"run_dir={run_dir}", "logger=none", *extra])


def test_the_follower_stops_at_a_kl_spike_and_records_nothing_after_it(tmp_path):
    cfg = _cfg(tmp_path, "health.kl_spike.factor=10", "health.kl_spike.min_history=2")
    kl = {1: 0.003, 2: 0.004, 3: 0.05, 4: 0.003}  # step 3: 0.05 > 10 x median(0.003, 0.004) = 0.035
    reported = []
    with pytest.raises(StoppedUnhealthy) as stop, RunRecord.create(tmp_path, cfg) as record:
        follower = _VerlFollower(record, cfg, lambda it, m, ckpt: reported.append(it))
        _write(tmp_path / FILE, [(s, {**TRAIN, "actor/kl_loss": v}) for s, v in kl.items()])
        try:
            follower.poll()  # records step 3, closes the record as stopped_unhealthy, raises
        finally:
            follower.poll(report=False, watch=False)  # what _run_verl's failure path does next: records nothing
    assert stop.value.breach["rule"] == "kl_spike" and stop.value.breach["iteration"] == 3
    assert stop.value.breach["values"] == {"kl/value": 0.05, "running_median": pytest.approx(0.0035)}
    assert [r["iteration"] for r in read_metrics(tmp_path)] == [1, 2, 3] and reported == [1, 2]
    assert read_status(tmp_path)[0] == "stopped_unhealthy" and read_summary(tmp_path)["health"] == stop.value.breach


@pytest.fixture
def fake_verl(monkeypatch):
    """`experiments.backends.verl.launch.run_config` writing `steps` like verl would; stop_run calls are counted."""
    fake = types.SimpleNamespace(steps={}, stops=0)

    def run_config(run, *rest):  # (the job, and W&B settings when the run has them)
        _write(rotate(f"{run['run_dir']}/{FILE}"), list(fake.steps.items()))
        return 0

    def stop_run():
        fake.stops += 1

    monkeypatch.setattr("experiments.backends.verl.launch.run_config", run_config)
    monkeypatch.setattr("experiments.backends.verl.require_verl", lambda: None)
    monkeypatch.setattr("experiments.backends.verl.failures.stop_run", stop_run)
    monkeypatch.setattr("experiments.run.VERL_POLL_S", 0.0)
    return fake


def test_a_nan_gradient_ends_a_verl_run_unhealthy_and_stops_verl(fake_verl, tmp_path):
    fake_verl.steps = {1: TRAIN, 2: {**TRAIN, "actor/grad_norm": math.nan}, 3: TRAIN}
    reported = []
    with pytest.raises(StoppedUnhealthy, match="nonfinite fired at iteration 2"):
        run(_cfg(tmp_path / "run"), callback=lambda it, m, ckpt: reported.append(it))
    assert fake_verl.stops == 1 and reported == [1]
    assert [r["iteration"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    assert read_summary(tmp_path / "run")["health"]["values"] == {"train/grad_norm": "nan"}

    # resumed with a change (forced): verl replays from its step-1 checkpoint. Until the new attempt has logged
    # step 2 again, the old attempt's NaN step is read back but never fires; the new, finite step 2 replaces it.
    fake_verl.steps = {2: {**TRAIN, "actor/grad_norm": 0.5}, 3: TRAIN}
    run(_cfg(tmp_path / "run", "optim.lr=1e-7", "resume=force"))
    assert read_status(tmp_path / "run")[0] == "finished"
    assert [r["train/grad_norm"] for r in read_metrics(tmp_path / "run")] == [0.4, 0.5, 0.4]


def test_an_older_attempts_bad_step_never_fires_only_the_newest_attempts_do(tmp_path):
    cfg = _cfg(tmp_path)
    bad = {**TRAIN, "actor/pg_loss": math.inf}
    _write(tmp_path / FILE, [(1, TRAIN), (2, TRAIN), (3, bad)])  # an earlier attempt, stopped at step 3
    with RunRecord.create(tmp_path, cfg) as record:
        for s in (1, 2, 3):
            record.log(s, {"loss/pg": 0.0})
        record.stop_unhealthy({"rule": "nonfinite", "iteration": 3, "message": "non-finite loss/pg", "values": {}})
    rotate(tmp_path / FILE)
    _write(tmp_path / FILE, [(2, {**TRAIN, "actor/pg_loss": -0.02})])  # the resumed attempt replays step 2 ...
    cfg = _cfg(tmp_path, "optim.lr=1e-7", "resume=force")
    with RunRecord.create(tmp_path, cfg, resume=True, force=True) as record:
        follower = _VerlFollower(record, cfg, None)
        follower.poll(watch=False)  # ... while the old attempt's step 3 is still the newest step 3: no fire
        assert [r["iteration"] for r in read_metrics(tmp_path)] == [1, 2, 3]
        again = {**TRAIN, "actor/pg_loss": -math.inf}  # it diverges there too (other values: a replayed step
        _write(tmp_path / FILE, [(2, {**TRAIN, "actor/pg_loss": -0.02}), (3, again)])  # is new when it differs)
        with pytest.raises(StoppedUnhealthy, match="iteration 3"):
            follower.poll(watch=False)


def test_verls_share_of_capped_responses_is_what_length_cap_reads():
    from experiments.verl_metrics import convert

    # verl 0.9.1's compute_data_metrics: mean of (response_length == max_response_length)
    assert convert({"response_length/clip_ratio": 0.25}, task="math", greedy=False) == {"train/len_capped": 0.25}


def test_a_poll_that_races_a_new_attempt_reads_a_consistent_set_of_files(tmp_path, monkeypatch):
    """verl rotates its metrics file when an attempt starts (rotate: the live file moves to .1, a new one is
    written). A poll that listed the files before the rotation and read them after it would see the new attempt
    under the live name and miss the old one (here: steps 2, 3 without step 1), then find step 1 on the next
    poll, below what it had recorded (seen under load in `make test`: "iteration 1 <= 3")."""
    import experiments.verl_metrics as vm

    cfg = _cfg(tmp_path)
    _write(tmp_path / FILE, [(1, TRAIN), (2, TRAIN), (3, TRAIN)])  # an earlier attempt
    real, raced = vm.read_attempts, []

    def racing(files):
        if not raced:  # the new attempt starts between the listing and the reading of the files
            raced.append(1)
            rotate(tmp_path / FILE)
            _write(tmp_path / FILE, [(2, {**TRAIN, "actor/grad_norm": 0.5}), (3, TRAIN)])
        return real(files)

    monkeypatch.setattr(vm, "read_attempts", racing)
    with RunRecord.create(tmp_path, cfg) as record:
        follower = _VerlFollower(record, cfg, None)
        follower.poll(watch=False)
        follower.poll(watch=False)
    assert raced and [(r["iteration"], r["train/grad_norm"]) for r in read_metrics(tmp_path)] == [
        (1, 0.4),
        (2, 0.5),
        (3, 0.4),
    ]
