"""`emapg sweep --address` against a cluster whose token authentication refuses this driver: one line, exit 2."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from experiments.cli import main
from experiments.errors import RAY_TOKEN_AUTH_DOCS, is_ray_auth_error
from tests.experiments.small_run import one_point_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def listening():
    """An address where something accepts connections (the driver's bounded check before ray.init passes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"127.0.0.1:{s.getsockname()[1]}"


def test_a_refused_token_is_one_line_naming_the_fix(tmp_path, monkeypatch, capsys, listening):
    def refuse(*args, **kwargs):  # what ray.init raised against a `ray start` head (Ray 2.60, token auth on)
        raise ray.exceptions.AuthenticationError("InvalidAuthToken: Authentication token is missing or incorrect")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    spec = one_point_spec(tmp_path / "s.yaml")
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out"), "--address", listening]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--address {listening}: the Ray cluster refused this driver's authentication" in err[0]
    assert "RAY_AUTH_TOKEN_PATH=" in err[0] and "RAY_AUTH_MODE=disabled" in err[0] and RAY_TOKEN_AUTH_DOCS in err[0]


def test_no_ray_at_an_answering_address_is_one_line(tmp_path, monkeypatch, capsys, listening):
    """ray.init's ConnectionError (something answers, but no Ray head there): one line naming --address, exit 2."""

    def no_ray(*args, **kwargs):
        raise ConnectionError(f"Failed to connect to Ray cluster at {listening}\nmore detail")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_ray)
    spec = one_point_spec(tmp_path / "s.yaml")
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out"), "--address", listening]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"emapg sweep: error: --address {listening}: cannot join the Ray cluster there: Failed to connect to Ray "
        f"cluster at {listening}"
    ]


def test_other_connection_errors_are_not_called_authentication():
    assert not is_ray_auth_error(ConnectionError("Could not find any running Ray instance"))
    assert is_ray_auth_error(RuntimeError("grpc: InvalidAuthToken"))


def test_ray_inits_connection_error_raised_from_a_refused_token_is_authentication():
    """What ray.init raises after ~20 s of refused tokens (Ray 2.60, seen against a `ray start` head): a
    ConnectionError whose context holds the GCS's InvalidAuthToken."""
    try:
        try:
            raise RuntimeError("Failed to connect to GCS. Last connection error: ... InvalidAuthToken: ...")
        except RuntimeError:
            raise ConnectionError("Failed to connect to Ray cluster at 127.0.0.1:24100")  # noqa: B904
    except ConnectionError as e:
        assert is_ray_auth_error(e)


def test_a_local_rays_workers_run_at_the_drivers_priority():
    """Ray starts workers at nice 15 by default: beside two busy processes per core a rehearsal's trials got a few
    percent of a CPU each and verl's start-up took 35 minutes. The local Ray the driver starts runs them at nice 0.
    In a subprocess: a Ray started, used and shut down in the test process left the next sweep's trials cancelled."""
    code = (
        "import os, ray\n"
        "from sweeps import tune as T\n"
        "os.environ.pop(T.WORKER_NICENESS, None)\n"
        "assert T._init_ray(None, 1)\n"
        "print(ray.get(ray.remote(lambda: os.nice(0)).remote()), os.nice(0))\n"
        "ray.shutdown()\n"
    )
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert got.returncode == 0, got.stderr[-2000:]
    worker, driver = got.stdout.split()[-2:]
    assert worker == driver


def test_a_sigterm_after_the_drivers_ray_shut_down_reaches_its_handler():
    """ray.shutdown() puts SIGTERM back to the OS default beneath Python (which still reports its handler): a SIGTERM
    in a sweep's report or W&B summary run killed the driver by the signal, silently, its lock left behind
    (seen 2026-11-29 on an adaptive sweep). The driver sets the handler again after the shutdown."""
    code = (
        "import os, signal\n"
        "from sweeps import tune as T\n"
        "assert T._init_ray(None, 1)\n"
        "signal.signal(signal.SIGTERM, lambda *a: print('handled', flush=True))\n"
        "T._shutdown_ray()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
    )
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert (got.returncode, got.stdout.split()[-1:]) == (0, ["handled"]), got.stderr[-2000:]
