"""One sweep driver per output directory (sweeps/lock.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sweeps import lock
from tests.experiments.small_run import one_point_spec

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_driver_is_refused_naming_the_first(tmp_path):
    with lock.held(tmp_path / "out", resume=False) as killed:
        assert killed is None
        with pytest.raises(
            ValueError, match=rf"^{tmp_path / 'out'} is in use by the sweep driver pid {os.getpid()} on "
        ):
            lock.acquire(tmp_path / "out")
    fd, killed = lock.acquire(tmp_path / "out")  # released, and it ended: nothing to count
    assert killed is None
    os.close(fd)


def test_a_killed_driver_releases_the_directory_and_leaves_its_wall_time(tmp_path, monkeypatch):
    out = tmp_path / "out"
    code = (
        "import sys, time; from pathlib import Path; from sweeps import lock; lock.BEAT_S = 0.2\n"
        "with lock.held(Path(sys.argv[1]), resume=False):\n    print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    time.sleep(1.0)
    with pytest.raises(ValueError, match=rf"is in use by the sweep driver pid {holder.pid} on "):
        lock.acquire(out)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    fd, killed = lock.acquire(out)
    os.close(fd)
    assert killed["pid"] == holder.pid and 0.5 < lock.killed_wall_s(killed) < 5


def test_emapg_sweep_on_a_directory_in_use_exits_2_in_one_line(tmp_path):
    spec = one_point_spec(tmp_path / "s.yaml")
    with lock.held(tmp_path / "out", resume=False):
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
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [lock.FILE]  # nothing else written
    assert json.loads((tmp_path / "out" / lock.FILE).read_text())["ended"]
