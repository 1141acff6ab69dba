"""How runs stop and continue, through `emapg train` as a user runs it: a resume never mixes two
configs, SIGTERM/SIGINT are `interrupted` (exit 143/130) and resume exactly, a SIGKILLed run reads
as `crashed`, a corrupt checkpoint falls back to the previous one, and a write error names the file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments import owner, records
from experiments.cli import main
from tests.experiments.small_run import small_run

ROOT = Path(__file__).resolve().parents[2]
SMALL = small_run({"trainer.save_every": 1, "trainer.keep_checkpoints": 2})
VOLATILE = ("time_s",)  # wall-clock; perf/* too
pytestmark = pytest.mark.filterwarnings("ignore:pretrain .* did not reach target_acc")  # 2 warm-start steps, on purpose


@pytest.fixture(autouse=True)
def env(tmp_path_factory, monkeypatch):
    cache = tmp_path_factory.getbasetemp() / "stops_cache"  # one warm start for the module's runs
    monkeypatch.setenv("EMAPG_CACHE", str(cache))
    monkeypatch.setenv("EMAPG_PROGRESS", "0")
    return cache


def train(run_dir: Path, *extra: str) -> int:
    return main(["train", *SMALL, f"run_dir={run_dir}", *extra])


def comparable(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by iteration, without wall-clock keys."""
    return {
        r["iteration"]: {k: v for k, v in r.items() if k not in VOLATILE and not k.startswith("perf/")}
        for r in records.read_metrics(run_dir)
    }


def assert_same_from(a: Path, b: Path, start: int) -> None:
    """Iterations >= start of `a` equal `b`'s, on every key both logged (a run's last iteration adds an eval)."""
    ra, rb = comparable(a), comparable(b)
    its = [i for i in ra if i >= start]
    assert its and set(its) <= set(rb)
    for i in its:
        both = set(ra[i]) & set(rb[i])
        assert {k: ra[i][k] for k in both} == {k: rb[i][k] for k in both}, f"iteration {i} differs"
        assert any(k.startswith("train/") for k in both) or i == 0


# ---------------------------------------------------------------- resume integrity


def test_resume_with_a_changed_algorithm_key_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train(run_dir, "trainer.iterations=2") == 0
    files = lambda: {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != "owner.lock"}  # noqa: E731
    before = files()
    assert train(run_dir, "trainer.iterations=2", "resume=true", "algo.anchor.tau=0.5", "algo.kl.type=k3") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "algo.anchor.tau: 0.9 -> 0.5" in err and "algo.kl.type: 'topk_reverse' -> 'k3'" in err
    assert "resume=force" in err
    assert files() == before  # nothing touched (but the owner lock, taken before anything is read)


@pytest.mark.parametrize("how", ["deleted", "edited"])
def test_resume_compares_with_the_checkpoints_config_not_an_editable_config_yaml(tmp_path, capsys, how):
    """The audit's case: config.yaml deleted, or edited to match the command line, let resume=true continue a
    tau 0.9 / topk_reverse checkpoint as tau 0.5 / k3 with "forced": false. The checkpoint knows what it trained."""
    run_dir = tmp_path / "run"
    assert train(run_dir, "trainer.iterations=2") == 0
    changed = ("algo.anchor.tau=0.5", "algo.kl.type=k3")
    if how == "deleted":
        (run_dir / "config.yaml").unlink()
    else:
        text = (run_dir / "config.yaml").read_text().replace("tau: 0.9", "tau: 0.5").replace("topk_reverse", "k3")
        (run_dir / "config.yaml").write_text(text)
    capsys.readouterr()
    assert train(run_dir, "trainer.iterations=3", "resume=true", *changed) == 2
    err = capsys.readouterr().err
    assert "algo.anchor.tau: 0.9 -> 0.5" in err and "algo.kl.type: 'topk_reverse' -> 'k3'" in err
    assert train(run_dir, "trainer.iterations=3", "resume=force", *changed) == 0  # forced: recorded as such
    (entry,) = records.read_resumes(run_dir)
    assert entry["forced"] and entry["changes"]["algo.anchor.tau"] == [0.9, 0.5]
    assert records.read_summary(run_dir)["forced_resume"] is True


def test_a_resume_cannot_shorten_a_run(tmp_path, capsys):
    """The audit's case: trainer.iterations=2 resume=true on a 4-iteration run left config.yaml (2) and
    summary.json (4 iterations done) disagreeing. Refused before any work, the record untouched."""
    run_dir = tmp_path / "run"
    assert train(run_dir, "trainer.iterations=4") == 0
    before = (run_dir / "summary.json").read_text(), (run_dir / "config.yaml").read_text()
    capsys.readouterr()
    assert train(run_dir, "trainer.iterations=2", "resume=true") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trainer.iterations=2" in err[0] and "at iteration 4" in err[0]
    assert ((run_dir / "summary.json").read_text(), (run_dir / "config.yaml").read_text()) == before


def test_resume_extending_iterations_is_allowed_recorded_and_exact(tmp_path):
    assert train(tmp_path / "run", "trainer.iterations=2") == 0
    assert train(tmp_path / "run", "trainer.iterations=4", "resume=true") == 0
    (entry,) = records.read_resumes(tmp_path / "run")
    assert entry["changes"] == {"trainer.iterations": [2, 4]} and entry["forced"] is False
    assert (entry["checkpoint"], entry["after_iteration"], entry["skipped"]) == ("iter_000002", 2, [])
    assert records.read_summary(tmp_path / "run")["status"] == "finished"
    assert train(tmp_path / "straight", "trainer.iterations=4") == 0
    assert_same_from(tmp_path / "run", tmp_path / "straight", 0)


def test_resume_auto_starts_a_missing_run_and_continues_a_present_one(tmp_path):
    """resume=auto: start when run_dir holds no run, continue (exactly, recorded) when it holds one; resume=true on
    a run_dir without a run is refused (tests/experiments/test_bad_inputs.py), never a quiet fresh start."""
    run_dir = tmp_path / "run"
    assert train(run_dir, "trainer.iterations=2", "resume=auto") == 0
    assert records.read_resumes(run_dir) == [] and records.read_summary(run_dir)["status"] == "finished"
    assert train(run_dir, "trainer.iterations=3", "resume=auto") == 0
    (entry,) = records.read_resumes(run_dir)
    assert (entry["checkpoint"], entry["after_iteration"]) == ("iter_000002", 2)
    assert records.read_summary(run_dir)["status"] == "finished"


def test_resume_force_is_recorded_and_flagged_in_the_report(tmp_path):
    run_dir = tmp_path / "runs" / "run"
    assert train(run_dir, "trainer.iterations=2") == 0
    assert train(run_dir, "trainer.iterations=3", "resume=force", "algo.anchor.tau=0.5") == 0
    (entry,) = records.read_resumes(run_dir)
    assert entry["forced"] is True and entry["changes"]["algo.anchor.tau"] == [0.9, 0.5]
    assert records.read_summary(run_dir)["forced_resume"] is True
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "report"), "--reps", "50"]) == 0
    import pandas as pd

    runs = pd.read_csv(tmp_path / "report" / "runs.csv")
    assert runs["forced_resume"].tolist() == [True]
    assert "resumed with resume=force" in (tmp_path / "report" / "index.md").read_text()


# ---------------------------------------------------------------- stops


def _spawn(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.cli", "train", *SMALL, f"run_dir={run_dir}", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )


def _wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path, iteration: int, timeout_s: float = 240) -> None:
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + timeout_s
    while not (latest.is_file() and latest.read_text().strip() >= f"iter_{iteration:06d}"):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.05)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_the_run_interrupted_and_it_resumes_exactly(tmp_path, sig, code):
    assert train(tmp_path / "warm", "trainer.iterations=0") == 0  # the warm start, outside the timed child
    run_dir = tmp_path / "run"
    proc = _spawn(run_dir, "trainer.iterations=500")
    _wait_for_checkpoint(proc, run_dir, 1)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "Traceback" not in err
    state, message = records.read_status(run_dir)
    assert state == "interrupted" and message.startswith(f"interrupted by {sig.name} after iteration")
    stopped = records.read_summary(run_dir)["iterations_done"]
    assert f"emapg train: interrupted by {sig.name} after iteration {stopped}" in err
    assert f"run_dir={run_dir} resume=true" in err.strip().splitlines()[-1]  # the resume command
    total = stopped + 2
    assert train(run_dir, f"trainer.iterations={total}", "resume=true") == 0
    assert train(tmp_path / "straight", f"trainer.iterations={total}") == 0
    assert_same_from(run_dir, tmp_path / "straight", 0)
    assert max(comparable(run_dir)) == total


def test_a_sigkilled_run_reads_as_crashed(tmp_path):
    assert train(tmp_path / "warm", "trainer.iterations=0") == 0
    run_dir = tmp_path / "runs" / "run"
    proc = _spawn(run_dir, "trainer.iterations=500")
    _wait_for_checkpoint(proc, run_dir, 1)
    proc.kill()
    proc.communicate(timeout=60)
    assert records.read_status(run_dir)[0] == "running"  # as the process left it
    assert records.read_state(run_dir) == "crashed"
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "report"), "--reps", "50"]) == 0
    import pandas as pd

    assert pd.read_csv(tmp_path / "report" / "runs.csv")["status"].tolist() == ["crashed"]


def test_read_state_tells_a_live_run_from_a_dead_one(tmp_path):
    import socket

    (tmp_path / "status").write_text(f"running\npid={os.getpid()} host={socket.gethostname()}\n")
    assert records.read_state(tmp_path) == "running"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "status").write_text(f"running\npid={dead.stdout.strip()} host={socket.gethostname()}\n")
    assert records.read_state(tmp_path) == "crashed"  # its pid is gone on this host
    (tmp_path / "status").write_text("running\npid=1 host=another-node\n")  # elsewhere: only the heartbeat tells
    assert records.read_state(tmp_path) == "running"
    assert records.read_state(tmp_path, now=time.time() + records.STALE_S + 1) == "crashed"
    (tmp_path / "status").write_text("interrupted\ninterrupted by SIGTERM\n")
    assert records.read_state(tmp_path, now=time.time() + 10 * records.STALE_S) == "interrupted"


# ---------------------------------------------------------------- checkpoints


def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train(run_dir, "trainer.iterations=4") == 0
    state = run_dir / "checkpoints" / "iter_000004" / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    assert train(run_dir, "trainer.iterations=6", "resume=true") == 0
    err = capsys.readouterr().err
    assert f"warning: skipping checkpoint {state.parent}" in err and "resuming from iter_000003" in err
    (entry,) = records.read_resumes(run_dir)
    assert entry["checkpoint"] == "iter_000003" and [s["checkpoint"] for s in entry["skipped"]] == ["iter_000004"]
    assert train(tmp_path / "straight", "trainer.iterations=6") == 0
    assert_same_from(run_dir, tmp_path / "straight", 4)  # re-trained from the checkpoint on
    assert sorted(comparable(run_dir)) == list(range(7))


def test_no_intact_checkpoint_is_a_clear_error(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train(run_dir, "trainer.iterations=2") == 0
    for state in (run_dir / "checkpoints").glob("iter_*/state.pt"):
        state.write_bytes(b"")
    capsys.readouterr()
    assert train(run_dir, "trainer.iterations=3", "resume=true") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"emapg train: error: no intact checkpoint in {run_dir / 'checkpoints'}")
    assert "iter_000002:" in err and "iter_000001:" in err and "\n" not in err


# ---------------------------------------------------------------- write failures


def test_a_write_error_names_the_file_and_is_recorded(tmp_path, monkeypatch, capsys):
    real = records._append

    def full_disk(path, rows):
        if Path(path).name == records.METRICS and any(r.get("iteration", 0) >= 2 for r in rows):
            raise OSError(28, "No space left on device")
        return real(path, rows)

    monkeypatch.setattr(records, "_append", full_disk)
    run_dir = tmp_path / "run"
    assert train(run_dir, "trainer.iterations=3") == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"emapg train: run failed: cannot write the run record {run_dir / 'metrics.jsonl'}: No space left on device"
    )
    state, error = records.read_status(run_dir)
    assert state == "failed" and "No space left on device" in error
    assert [r["iteration"] for r in records.read_metrics(run_dir)] == [0, 1]


def test_when_even_the_status_cannot_be_written_the_run_reads_as_crashed(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    real_append, real_write = records._append, records.atomic_write

    def gone(*args):
        raise OSError(30, "Read-only file system")

    def append(path, rows):
        if any(r.get("iteration", 0) >= 1 for r in rows):  # the disk goes read-only after iteration 0
            monkeypatch.setattr(records, "atomic_write", gone)
            gone()
        return real_append(path, rows)

    monkeypatch.setattr(records, "_append", append)
    assert train(run_dir, "trainer.iterations=2") == 1
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].endswith("Read-only file system") and "Traceback" not in err
    monkeypatch.setattr(records, "atomic_write", real_write)
    assert records.read_status(run_dir)[0] == "running"  # nothing more could be written
    assert records.read_state(run_dir, now=time.time() + records.STALE_S + 1) == "crashed"


def test_the_record_keeps_its_heartbeat_while_running(tmp_path, monkeypatch):
    monkeypatch.setattr(owner, "BEAT_S", 0.05)
    rec = records.RunRecord.create(tmp_path / "run", {"seed": 0})
    lock = tmp_path / "run" / owner.FILE
    deadline = time.monotonic() + 10
    while json.loads(lock.read_text() or "{}").get("beats", 0) < 2:
        assert time.monotonic() < deadline, "no heartbeat"
        time.sleep(0.01)
    assert records.read_state(tmp_path / "run") == "running"
    rec.finish()
    beats = json.loads(lock.read_text())
    time.sleep(0.3)
    assert json.loads(lock.read_text()) == beats and "ended" in beats  # stopped with the run
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "finished"


def test_a_resumed_runs_training_time_counts_its_earlier_attempts(tmp_path, monkeypatch):
    """summary.json's train_wall_time_s (what a sweep's overhead counts as training) sums the attempts: the
    first one's training up to its checkpoint, then this one's. On a clock that moves 100 s per reading in the
    first attempt and 1 s in the second, the resumed figure holds the first attempt's hundreds of seconds."""
    from experiments import run as run_module

    now = {"t": 0.0, "step": 100.0}

    def clock() -> float:
        now["t"] += now["step"]
        return now["t"]

    monkeypatch.setattr(run_module, "time", type("FakeTime", (), {"time": staticmethod(clock)}))
    run_dir = tmp_path / "run"
    assert train(run_dir, "trainer.iterations=2") == 0
    assert records.read_summary(run_dir)["train_wall_time_s"] == 300  # t0, the checkpoint at 2, the end
    now["step"] = 1.0
    assert train(run_dir, "trainer.iterations=4", "resume=true") == 0
    resumed = records.read_summary(run_dir)["train_wall_time_s"]
    assert 200 < resumed < 220  # 200 s up to the checkpoint + this attempt's readings (before: this attempt's only)


def test_the_summary_keeps_the_runs_timeline(tmp_path):
    """summary.json["timeline"]: run_module.STAMPS in order, on one clock; its training span (eval0_start to saved)
    is train_wall_time_s. A run resumed past iteration 0 has no evaluation at 0: no eval0_end."""
    from experiments.run import STAMPS

    run_dir = tmp_path / "run"
    assert train(run_dir, "trainer.iterations=2") == 0
    summary = records.read_summary(run_dir)
    stamps = summary["timeline"]
    assert list(stamps) == list(STAMPS)
    assert all(a <= b for a, b in zip(stamps.values(), list(stamps.values())[1:]))
    assert stamps["saved"] - stamps["eval0_start"] == pytest.approx(summary["train_wall_time_s"], abs=0.05)
    assert train(run_dir, "trainer.iterations=3", "resume=true") == 0
    assert list(records.read_summary(run_dir)["timeline"]) == [s for s in STAMPS if s != "eval0_end"]


# ---------------------------------------------------------------- one writer per record


def test_a_second_writer_on_a_run_dir_is_refused_naming_the_first(tmp_path):
    """The audit's case: `emapg train ... run_dir=runs/x resume=auto` twice at once interleaved 174 metric rows
    for 121 iterations, both `finished`. Now the second exits 2 in one line naming the first, which goes on alone."""
    run_dir = tmp_path / "x"
    args = [sys.executable, "-m", "experiments.cli", "train"]
    args += small_run({"trainer.iterations": 5000, "trainer.save_every": 1}) + [f"run_dir={run_dir}", "resume=auto"]
    env = {**os.environ, "EMAPG_PROGRESS": "0"}
    first = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "checkpoints" / "latest").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.poll() else ""
            time.sleep(0.2)
        second = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert first.poll() is None, "the first run must still be going"
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    lines = (second.stdout + second.stderr).strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert f"{run_dir} is in use by the run pid {first.pid} on host" in lines[0]
    its = [r["iteration"] for r in records.read_metrics(run_dir)]
    assert its == sorted(set(its)) and records.read_status(run_dir)[0] == "interrupted"
    assert records.read_resumes(run_dir) == []  # the refused writer wrote nothing


def test_a_full_disk_while_a_checkpoint_is_written_fails_the_run_in_one_line(tmp_path, monkeypatch, capsys):
    """The audit's case: on a full disk torch's zip writer raises a RuntimeError around the file's OSError, so the
    trainer's handler never ran: a traceback, `.tmp_iter_*` left behind, status `running`."""
    import torch

    def full(obj, f, *args, **kwargs):  # what torch.save does on a full disk (seen on a 64 KiB tmpfs)
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904

    monkeypatch.setattr(torch, "save", full)
    run_dir = tmp_path / "run"
    assert train(run_dir, "trainer.iterations=2") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err) and err[-1].endswith("No space left on device")
    assert not list((run_dir / "checkpoints").glob(".tmp_*"))
    assert records.read_state(run_dir) == "failed"


def test_a_dead_writer_reads_crashed_even_when_its_pid_was_reused_or_its_clock_runs_ahead(tmp_path):
    """The audit's cases: a dead run whose pid was reused, or whose heartbeat lies in the future (clock skew
    between hosts), read `running` forever."""
    run_dir = tmp_path / "run"
    records.RunRecord.create(run_dir, {"seed": 0}).release()  # the writer dies without closing its record
    lock = run_dir / owner.FILE
    rec = json.loads(lock.read_text())
    lock.write_text(json.dumps({**{k: v for k, v in rec.items() if k != "ended"}, "pid_start": "1"}))
    assert records.read_state(run_dir) == "crashed"  # this pid is alive, but it is not that process
    lock.write_text(json.dumps({**{k: v for k, v in rec.items() if k != "ended"}, "host": "elsewhere"}))
    assert records.read_state(run_dir) == "running"  # another host, a fresh heartbeat
    ahead = time.time() + 86400
    os.utime(lock, (ahead, ahead))
    assert records.read_state(run_dir) == "crashed"  # a heartbeat a day ahead vouches for nothing


def test_a_garbage_status_file_does_not_stop_a_resume(tmp_path, capsys):
    """The audit's case: a status file of random bytes gave a UnicodeDecodeError traceback on resume."""
    run_dir = tmp_path / "run"
    assert train(run_dir, "trainer.iterations=2") == 0
    (run_dir / "status").write_bytes(b"\xff\xfe\x00garbage\x89\n\xc3")
    assert records.read_status(run_dir)[0] == "unknown"
    assert train(run_dir, "trainer.iterations=3", "resume=true") == 0
    assert records.read_state(run_dir) == "finished" and "Traceback" not in capsys.readouterr().err
