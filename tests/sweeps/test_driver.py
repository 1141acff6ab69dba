"""The sweep driver before and around Ray: which --out it accepts, its sweep.yaml, --address, and SIGTERM/SIGINT
outside Tune's run. No trial runs here: ray.init is replaced where a test reaches it (``no_ray``), or the driver runs
in a subprocess that never gets past connecting."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from sweep_fakes import disk_full_halfway

from experiments.cli import main
from experiments.errors import UserError
from sweeps import tune as T
from sweeps.spec import load

ROOT = Path(__file__).resolve().parents[2]
BASE = {"experiment": "math_tiny_grpo", "overrides": {"trainer.iterations": 1}}
SENTINEL = "sentinel: the driver got as far as starting Ray"


def write_spec(path: Path, name: str = "a", **changes) -> str:
    """The smallest spec (one trial of one iteration) named `name`, written to `path`."""
    raw = {"name": name, "base": BASE, "space": {"algo.anchor.tau": {"grid": [1.0]}}, "metric": "eval/math_tiny/acc"}
    path.write_text(yaml.safe_dump({**raw, **changes}))
    return str(path)


@pytest.fixture
def no_ray(monkeypatch):
    """A driver that reaches Ray's start ends there with SENTINEL (exit 2): everything before it ran."""

    def refuse(address, num_cpus, sweep_dir=None):
        raise UserError(SENTINEL)

    monkeypatch.setattr(T, "_init_ray", refuse)


def sweep(capsys, *args) -> tuple[int, list[str]]:
    """`emapg sweep *args` in this process: (exit code, the lines it wrote to stderr)."""
    code = main(["sweep", *map(str, args)])
    return code, capsys.readouterr().err.strip().splitlines()


def a_finished_sweep(out: Path, spec_path: str) -> dict[str, bytes]:
    """What `emapg sweep A.yaml --out <out>` leaves (its sweep.yaml, Tune's state, a run, sweep.csv, timing.json);
    returns every file's bytes."""
    (out / "tune" / "a").mkdir(parents=True)
    (out / "tune" / "a" / "tuner.pkl").write_bytes(b"tune")
    (out / "tune" / "a" / "experiment_state-1.json").write_text("{}")
    (out / "runs" / "math_tiny__grpo__s0__x_00000").mkdir(parents=True)
    (out / "sweep.yaml").write_text(yaml.safe_dump(yaml.safe_load(Path(spec_path).read_text()), sort_keys=False))
    (out / "sweep.csv").write_text("trial_id,status\nx_00000,finished\n")
    (out / "timing.json").write_text('{"wall_s": 1}\n')
    return files(out)


def files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------- --out holds one sweep
def test_a_second_sweep_into_a_finished_sweeps_out_is_refused_before_any_work(tmp_path, capsys, no_ray):
    """`emapg sweep A.yaml --out x; emapg sweep B.yaml --out x`: B is refused in one line (exit 2) naming A and how
    to continue it, and x is left as A left it. Before: B was accepted, overwrote A's sweep.yaml (A could no longer
    be resumed), and its runs and sweep.csv went into A's directory."""
    a, b, out = write_spec(tmp_path / "a.yaml", "a"), write_spec(tmp_path / "b.yaml", "b"), tmp_path / "x"
    before = a_finished_sweep(out, a)
    code, err = sweep(capsys, b, "--out", out)
    assert code == 2 and len(err) == 1, err
    assert f"--out {out} already holds sweep 'a', started with another spec; pass another --out" in err[0]
    assert f"emapg sweep {out}/sweep.yaml --resume --out {out}" in err[0]
    assert files(out) == before  # not even an owner lock written
    code, err = sweep(capsys, a, "--out", out)  # the same sweep again, without --resume
    assert code == 2 and err == [f"emapg sweep: error: {out} already holds sweep 'a'; finish it with --resume, or "
                                 "pass --out <new dir>"]  # fmt: skip
    assert files(out) == before


@pytest.mark.parametrize(
    "there, words",
    [
        ({"notes.txt": "mine"}, "is not empty and holds no emapg sweep (it holds notes.txt); pass a new or empty"),
        ({"config.yaml": "seed: 0\n", "status": "finished\n"}, "holds a run record (config.yaml, status: emapg"),
        ({"runs/r/status": "finished\n"}, "holds a sweep's files (runs) but no sweep.yaml; pass another --out"),
    ],
    ids=["unrelated files", "a run record", "a sweep without its sweep.yaml"],
)
def test_an_out_that_is_not_empty_is_refused_naming_what_is_there(tmp_path, capsys, no_ray, there, words):
    """Before: each was accepted, the sweep's files written among what was there."""
    out = tmp_path / "x"
    for name, text in there.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    before = files(out)
    code, err = sweep(capsys, write_spec(tmp_path / "a.yaml"), "--out", out)
    assert code == 2 and len(err) == 1 and words in err[0], err
    assert files(out) == before


@pytest.mark.parametrize("there", [None, [], ["owner.lock"]], ids=["new", "empty", "only an owner lock"])
def test_a_new_or_empty_out_is_taken(tmp_path, capsys, no_ray, there):
    out = tmp_path / "x"
    if there is not None:
        out.mkdir()
        for name in there:
            (out / name).write_text("{}")
    code, err = sweep(capsys, write_spec(tmp_path / "a.yaml"), "--out", out)
    assert (code, err) == (2, [f"emapg sweep: error: {SENTINEL}"])  # got as far as Ray
    assert (out / "sweep.yaml").is_file()


def test_resume_with_another_spec_is_refused_naming_the_keys(tmp_path, capsys, no_ray):
    """Before: a spec with another name was refused for want of its Tune state, without saying the spec differs."""
    a, out = write_spec(tmp_path / "a.yaml", "a"), tmp_path / "x"
    before = a_finished_sweep(out, a)
    code, err = sweep(capsys, write_spec(tmp_path / "b.yaml", "b", seeds=[3]), "--resume", "--out", out)
    assert code == 2 and len(err) == 1, err
    assert f"--resume: the spec differs from the one {out} was started with (keys: name, seeds)" in err[0]
    assert files(out) == before


# ---------------------------------------------------------------------------- sweep.yaml
@pytest.mark.parametrize("text", ["", "name: a\nbase: {experiment: math_tiny_grpo, overr"], ids=["empty", "torn"])
def test_an_empty_or_torn_sweep_yaml_on_resume_is_one_line(tmp_path, capsys, no_ray, text):
    """Before: a TypeError (empty) or a yaml ScannerError (torn) traceback, exit 1."""
    a, out = write_spec(tmp_path / "a.yaml", "a"), tmp_path / "x"
    a_finished_sweep(out, a)
    (out / "sweep.yaml").write_text(text)
    code, err = sweep(capsys, a, "--resume", "--out", out)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"emapg sweep: error: --resume: {out}/sweep.yaml: ")
    assert "cannot be compared with the spec given: put the original spec there, or pass another --out" in err[0]


def test_a_new_sweep_may_start_where_a_killed_atomic_write_left_its_temporary_file(tmp_path, no_ray):
    """A kill during an atomic write (sweep.yaml, sweep.csv, timing.json) leaves `.<name>.<random>.tmp` behind; it
    does not make the directory another sweep's."""
    spec, out = load(write_spec(tmp_path / "a.yaml")), tmp_path / "x"
    out.mkdir()
    for name in (".sweep.csv.k2j4.tmp", ".timing.json.q8w1.tmp"):
        (out / name).write_text("{")
    T._check_out(spec, out, resume=False)


def test_sweep_yaml_is_written_whole_or_not_at_all(tmp_path, capsys, no_ray):
    """A write of sweep.yaml that fails half way (a full disk; a kill mid-write leaves the same) leaves no torn
    sweep.yaml for --resume to trip on. Before: half a sweep.yaml stayed, written in place."""
    spec_path, out = write_spec(tmp_path / "a.yaml"), tmp_path / "x"
    spec = load(spec_path)
    with disk_full_halfway(), pytest.raises(OSError, match="No space left on device"):
        T.run_sweep(spec, out)
    assert not (out / "sweep.yaml").exists() and not list(out.glob(".sweep.yaml*"))
    code, err = sweep(capsys, spec_path, "--resume", "--out", out)
    assert code == 2 and err == [f"emapg sweep: error: --resume: {out} holds no sweep to resume (no sweep.yaml); "
                                 "start a new sweep without --resume"]  # fmt: skip


# ---------------------------------------------------------------------------- signals outside Tune's run
def test_sigint_before_tune_started_is_the_interrupted_line_and_the_resume_command(tmp_path, capsys, monkeypatch):
    """Ctrl-C in the warm start: exit 130, the interrupted line and the command that resumes (Before: no resume
    command, and that command then refused the sweep: no Tune state)."""
    spec_path, out = write_spec(tmp_path / "a.yaml"), tmp_path / "x"
    monkeypatch.setattr(T, "_init_ray", lambda address, num_cpus, sweep_dir=None: False)

    def ctrl_c(spec):
        raise KeyboardInterrupt

    monkeypatch.setattr(T, "_warm_start", ctrl_c)
    code, err = sweep(capsys, spec_path, "--out", out)
    assert code == 130 and err == [
        "emapg sweep: interrupted (SIGINT) before Tune started the trials",
        f"resume with: emapg sweep {out}/sweep.yaml --resume --out {out}",
    ], err


def test_sigterm_while_emapg_sweep_imports_its_modules_is_the_interrupted_line(tmp_path):
    """`emapg sweep` spends seconds importing the sweep's modules (pydantic, torch, Ray) before it runs: a SIGTERM
    there (delivered here while sweeps.spec is being imported) is the interrupted line and exit 143. Before: the
    process died of the signal (no line)."""
    spec_path = write_spec(tmp_path / "a.yaml")
    code = (
        "import os, signal, sys, time\n"
        "class SigtermOnImport:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'sweeps.spec':\n"
        "            os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)\n"
        "sys.meta_path.insert(0, SigtermOnImport())\n"
        "from experiments.cli import main\n"
        f"sys.exit(main(['sweep', {spec_path!r}, '--out', {str(tmp_path / 'x')!r}]))"
    )
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (got.returncode, got.stderr) == (143, "emapg sweep: interrupted (SIGTERM)\n"), got
    assert not (tmp_path / "x").exists()


def test_rays_own_sigterm_exit_in_ray_init_is_the_drivers_interruption(tmp_path, capsys, monkeypatch):
    """ray.init sets Ray's SIGTERM handler, `sys.exit(15)`, at its start: a SIGTERM while Ray starts or connects
    ended the driver with exit 15 and no line. It is the driver's interruption now: exit 143, the line."""
    import ray

    def init_then_sigterm(*args, **kwargs):
        raise SystemExit(signal.SIGTERM)  # what Ray's handler raises

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init_then_sigterm)
    spec_path, out = write_spec(tmp_path / "a.yaml"), tmp_path / "x"
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    code, err = sweep(capsys, spec_path, "--out", out, "--num-cpus", 1)
    assert code == 143 and err == [
        "emapg sweep: interrupted (SIGTERM) before Tune started the trials",
        f"resume with: emapg sweep {out}/sweep.yaml --resume --out {out}",
    ], err
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # the caller's, back


# ---------------------------------------------------------------------------- --address
def _driver(tmp_path: Path, address: str) -> subprocess.Popen:
    """`emapg sweep` with --address in a subprocess, stdout and stderr merged."""
    spec_path, out = write_spec(tmp_path / "a.yaml"), tmp_path / "x"
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.cli", "sweep", spec_path, "--out", str(out), "--address", address],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        start_new_session=True,
    )


def test_an_address_where_nothing_answers_is_one_line_and_exit_2(tmp_path):
    """Before: ray.init retried 127.0.0.1:1 for about 150 s, printing Ray's connection warnings, and ended in a
    traceback. The timeout below only guards against that hang."""
    driver = _driver(tmp_path, "127.0.0.1:1")
    try:
        printed, _ = driver.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)
    lines = printed.strip().splitlines()
    assert driver.returncode == 2 and len(lines) == 1, printed
    assert lines[0].startswith("emapg sweep: error: --address 127.0.0.1:1: nothing answers there (Connection refused)")


def test_sigterm_while_ray_init_connects_ends_the_driver_with_the_interrupted_line(tmp_path):
    """Something listens at the address (the bounded check passes) but it is no Ray: ray.init retries in Ray's C++
    code, where no Python handler runs. A SIGTERM then ends the driver: exit 143, the interrupted line naming the
    address, the resume command. Before: Ray's handler ran only once ray.init gave up, 40 s or more later, and the
    driver exited 15 without a line. The timeout below only guards against that hang."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # never accepts, never answers
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    driver = _driver(tmp_path, address)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(driver.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.time() + 120
        while not any("onnecting to " in line and "Ray cluster" in line for line in lines):
            assert driver.poll() is None and time.time() < deadline, lines
            time.sleep(0.1)
        time.sleep(1.0)  # inside ray.init
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)
        silent.close()
    out = tmp_path / "x"
    assert driver.returncode == 143, lines
    assert lines[-2:] == [
        f"emapg sweep: interrupted (SIGTERM) while connecting to the Ray cluster at --address {address}\n",
        f"resume with: emapg sweep {out}/sweep.yaml --resume --out {out}\n",
    ], lines


@pytest.mark.slow  # a real sweep (about a minute); make test has the same case on the lock alone (test_owner.py)
def test_a_second_driver_after_the_lock_file_was_deleted_is_refused(tmp_path):
    """The audit's case, as written: a sweep running, its lock file deleted, `emapg sweep --resume` on the same --out
    ran a second driver on the same trials (a trial with 383 iterations twice). The directory itself stays locked."""
    out = tmp_path / "out"
    spec = write_spec(tmp_path / "a.yaml", base={**BASE, "overrides": {"trainer.iterations": 100000}})
    cmd = [sys.executable, "-m", "experiments.cli", "sweep", spec, "--out", str(out)]
    env = {**os.environ, "EMAPG_PROGRESS": "0"}
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not list(out.glob("runs/*/metrics.jsonl")):  # a trial is training
            assert first.poll() is None and time.monotonic() < deadline, "the first sweep never started a trial"
            time.sleep(0.5)
        (out / "owner.lock").unlink()
        second = subprocess.run([*cmd, "--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert first.poll() is None, "the first driver must still be running"
    finally:
        first.send_signal(signal.SIGINT)
        first.wait(timeout=300)
    lines = (second.stdout + second.stderr).strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, second.stderr[-2000:]
    assert f"{out.resolve()} is in use by another emapg sweep driver" in lines[0]
