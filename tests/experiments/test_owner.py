"""One writer per record directory (experiments/owner.py): runs, sweeps, evaluations."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from experiments import owner
from tests.experiments.small_run import one_point_spec

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_driver_is_refused_naming_the_first(tmp_path):
    with owner.held(tmp_path / "out", "sweep driver") as killed:
        assert killed is None
        with pytest.raises(
            ValueError, match=rf"^{tmp_path / 'out'} is in use by the sweep driver pid {os.getpid()} on "
        ):
            owner.acquire(tmp_path / "out", "sweep driver")
    again = owner.acquire(tmp_path / "out", "sweep driver")  # released, and it ended: nothing to count
    assert again.before is None
    again.release()


def test_a_killed_driver_releases_the_directory_and_leaves_its_wall_time(tmp_path, monkeypatch):
    out = tmp_path / "out"
    code = (
        "import sys, time; from pathlib import Path; from experiments import owner; owner.BEAT_S = 0.2\n"
        "with owner.held(Path(sys.argv[1]), 'sweep driver'):\n    print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    time.sleep(1.0)
    with pytest.raises(ValueError, match=rf"is in use by the sweep driver pid {holder.pid} on "):
        owner.acquire(out, "sweep driver")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    again = owner.acquire(out, "sweep driver")
    again.release()
    assert again.before["pid"] == holder.pid and 0.5 < owner.killed_wall_s(again.before) < 5


def test_emapg_sweep_on_a_directory_in_use_exits_2_in_one_line(tmp_path):
    spec = one_point_spec(tmp_path / "s.yaml")
    with owner.held(tmp_path / "out", "sweep driver"):
        got = subprocess.run(
            [sys.executable, "-m", "experiments.cli", "sweep", str(spec), "--out", str(tmp_path / "out")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert got.returncode == 2, got.stderr
    lines = (got.stdout + got.stderr).strip().splitlines()
    assert len(lines) == 1 and "is in use by the sweep driver pid" in lines[0] and "--out <another dir>" in lines[0]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [owner.FILE]  # nothing else written
    assert json.loads((tmp_path / "out" / owner.FILE).read_text())["ended"]


def test_deleting_the_lock_file_does_not_free_a_held_directory(tmp_path):
    """The audit's case: driver.lock deleted mid-sweep, then a second driver on the same trials. The directory
    itself is locked too, so the second writer is still refused."""
    with owner.held(tmp_path / "out", "sweep driver"):
        (tmp_path / "out" / owner.FILE).unlink()
        with pytest.raises(owner.Busy, match="is in use by another emapg sweep driver"):
            owner.acquire(tmp_path / "out", "sweep driver")


def test_a_writer_on_another_host_is_judged_by_its_heartbeat_not_by_clocks(tmp_path, monkeypatch):
    """flock does not reach across hosts on some shared file systems: a record naming another host whose beats
    move is alive (here its clock lies a day in the future); once they stand still, the directory is free."""
    monkeypatch.setattr(owner, "BEAT_S", 0.1)
    monkeypatch.setattr(owner, "GONE_AFTER_S", 0.6)
    out = tmp_path / "out"
    out.mkdir()
    path = out / owner.FILE
    future = time.time() + 86400
    path.write_text(json.dumps({"pid": 4242, "host": "elsewhere", "started": future, "seen": future, "beats": 0}))
    stop = threading.Event()

    def beat():
        n = 0
        while not stop.wait(0.05):
            n += 1
            path.write_text(json.dumps({"pid": 4242, "host": "elsewhere", "started": future, "beats": n}))

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        with pytest.raises(owner.Busy, match="the run pid 4242 on host elsewhere"):
            owner.acquire(out, "run")
    finally:
        stop.set()
        thread.join()
    with owner.held(out, "run") as before:
        assert before["host"] == "elsewhere"


def test_a_reused_pid_is_not_the_owner(tmp_path):
    """A pid names a process only with its start time: this process's pid with another start is not alive."""
    me = os.getpid()
    assert owner.alive(me, owner.pid_start(me))
    assert not owner.alive(me, "1")
