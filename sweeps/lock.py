"""One sweep driver per output directory: ``<sweep_dir>/driver.lock`` (this module owns the file).

    with lock.held(sweep_dir, resume=True) as killed:   # killed: what a driver killed mid-sweep left, or None
        ...                                             # the sweep; the file's heartbeat is kept fresh meanwhile

The file holds the owner's pid, host, start time and a heartbeat (``seen``, every ``BEAT_S``), and
``ended`` once that driver returned. It is locked with ``flock`` for as long as the driver runs: taking it
is atomic, and the kernel lets go of it when the process dies, however it dies (a SIGKILL included), so a
lock is never broken by guesswork. The file itself is never removed (removing it would let a second driver
lock a new file while a first still holds the old one). A second driver on the same directory is refused
before it writes anything, with the owner named. A file without ``ended`` that nobody holds was left by a
killed driver: its ``seen - started`` is the wall time that invocation spent, which ``timing.json`` counts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

FILE = "driver.lock"
BEAT_S = 2.0


def _read(fd: int) -> dict:
    """The lock file's record, or {} (empty: being rewritten, or written by nothing yet)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _write(fd: int, record: dict) -> None:
    data = json.dumps(record).encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def _owner(record: dict) -> str:
    if not record:
        return "another emapg sweep driver"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("started", 0)))
    return f"the sweep driver pid {record.get('pid')} on host {record.get('host')} (started {when})"


def acquire(sweep_dir: Path) -> tuple[int, dict | None]:
    """(the locked file's descriptor, what a killed driver left: {"started", "seen"} or None).
    Raises ValueError naming the running driver when another one holds the directory."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(sweep_dir / FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _read(fd)
        os.close(fd)
        raise ValueError(
            f"{sweep_dir} is in use by {_owner(owner)}; wait for it to end, or pass --out <another dir>"
        ) from None
    before = _read(fd)
    killed = before if "started" in before and "ended" not in before else None
    now = time.time()
    _write(fd, {"pid": os.getpid(), "host": socket.gethostname(), "started": now, "seen": now})
    return fd, killed


@contextlib.contextmanager
def held(sweep_dir: Path, *, resume: bool) -> Iterator[dict | None]:
    """Hold the directory's lock for the block; yields what a killed driver left (see ``acquire``)."""
    if resume and not sweep_dir.is_dir():
        raise ValueError(f"--resume: {sweep_dir} holds no sweep to resume (the directory does not exist)")
    fd, killed = acquire(sweep_dir)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(BEAT_S):
            _write(fd, {**_read(fd), "seen": time.time()})

    thread = threading.Thread(target=beat, name="emapg-sweep-lock", daemon=True)
    thread.start()
    try:
        yield killed
    finally:
        stop.set()
        thread.join()
        now = time.time()
        _write(fd, {**_read(fd), "seen": now, "ended": now})
        os.close(fd)  # releases the lock


def killed_wall_s(killed: dict | None) -> float:
    """Wall time of a driver killed mid-sweep, from its start to its last heartbeat (0 without one)."""
    if not killed:
        return 0.0
    return max(0.0, float(killed.get("seen", 0.0)) - float(killed.get("started", 0.0)))
