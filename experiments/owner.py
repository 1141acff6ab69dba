"""One writer per record: the owner lock of a run, sweep or evaluation directory (this module owns ``owner.lock``).

    with owner.held(run_dir, "run") as before:   # before: what a writer killed mid-way left ({"started", "seen"})
        ...                                      # or None; the file's heartbeat is kept fresh meanwhile

Taking a directory another writer has is refused (``Busy``, exit 2 naming it): the kernel's ``flock`` on the
directory and on ``owner.lock`` (let go however the writer dies), and for a writer on another host whose lock this
host cannot see, a heartbeat counter (``beats``) that has not stood still for GONE_AFTER_S; docs/run-record.md,
"One writer per record", has the details. The file is never removed (that would let a second writer lock a new
file while the first holds the old one).
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

from experiments.errors import UserError

FILE = "owner.lock"
BEAT_S = 2.0  # the heartbeat's period
GONE_AFTER_S = 3 * BEAT_S + 1.0  # a writer on another host whose heartbeat stands still this long is gone
REMEDY = "wait for it to end, or use another directory"


class Busy(UserError):
    """The directory has a live writer; the message names it."""


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None where it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def pid_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, from /proc), or None where that cannot be read:
    with the pid, it names a process for good (a pid alone is reused)."""
    fields = _proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def alive(pid: int, start: str | None = None) -> bool:
    """Is process `pid` (started at `start`, when known) alive on this host? A zombie is not."""
    with contextlib.suppress(PermissionError):  # PermissionError: someone else's process, alive
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
    fields = _proc_stat(pid)
    if fields is None:
        return True  # no /proc: os.kill's answer is all there is
    return fields[0] != "Z" and (start is None or fields[19] == start)


def describe(record: dict, what: str) -> str:
    if not record.get("pid"):
        return f"another emapg {what}"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("started", 0)))
    return f"the {what} pid {record['pid']} on host {record.get('host')} (started {when})"


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


def _flock(fd: int) -> bool:
    """Lock `fd` for this process; False when another holds it. A file system without flock (some network
    file systems refuse it on directories) counts as taken: the heartbeat then judges another host's writer."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


class Owner:
    """A held directory: its descriptors and heartbeat. `release()` lets go (idempotent)."""

    def __init__(self, directory: Path, fds: list[int], before: dict | None):
        self.directory, self._fds, self.before = directory, fds, before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"emapg-owner {directory.name}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        fd = self._fds[-1]
        while not self._stop.wait(BEAT_S):
            try:
                rec = _read(fd)
                _write(fd, {**rec, "seen": time.time(), "beats": int(rec.get("beats", 0)) + 1})
            except OSError:
                pass  # a full disk: the writer's own writes report it; the kernel's lock still holds

    def release(self) -> None:
        if not self._fds:
            return
        self._stop.set()
        self._thread.join()
        fd = self._fds[-1]
        with contextlib.suppress(OSError):
            now = time.time()
            _write(fd, {**_read(fd), "seen": now, "ended": now})
        for f in self._fds:
            os.close(f)  # lets go of the locks
        self._fds = []


def acquire(directory: str | Path, what: str, remedy: str = REMEDY) -> Owner:
    """Take `directory` (created if need be) for this process as the writer of a `what` ("run", "sweep driver",
    "evaluation"); raises Busy naming the live writer, ending with `remedy`."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(20, "is a file, not a directory", str(directory))
    directory.mkdir(parents=True, exist_ok=True)
    fds = [os.open(directory, os.O_RDONLY | os.O_DIRECTORY), os.open(directory / FILE, os.O_RDWR | os.O_CREAT, 0o644)]
    try:
        taken = all(_flock(fd) for fd in fds)
        before = _read(fds[1])
        if not taken or _other_host_alive(fds[1], before):
            raise Busy(f"{directory} is in use by {describe(_read(fds[1]), what)}; {remedy}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    now = time.time()
    me = {"pid": os.getpid(), "pid_start": pid_start(os.getpid()), "host": socket.gethostname(), "what": what}
    _write(fds[1], {**me, "started": now, "seen": now, "beats": 0})
    return Owner(directory, fds, before if "started" in before and "ended" not in before else None)


def _other_host_alive(fd: int, record: dict) -> bool:
    """Does a writer on another host still beat? Its ``beats`` are watched for up to GONE_AFTER_S; only when the
    file names another host and no ``ended`` (this host's writers are the kernel's to judge, through flock)."""
    if "ended" in record or record.get("host") in (None, socket.gethostname()):
        return False
    deadline = time.monotonic() + GONE_AFTER_S
    while time.monotonic() < deadline:
        time.sleep(BEAT_S / 4)
        if _read(fd).get("beats") != record.get("beats"):
            return True
    return False


@contextlib.contextmanager
def held(directory: str | Path, what: str, remedy: str = REMEDY) -> Iterator[dict | None]:
    """Hold `directory` for the block (see `acquire`); yields what a writer killed mid-way left, or None."""
    owner = acquire(directory, what, remedy)
    try:
        yield owner.before
    finally:
        owner.release()


def killed_wall_s(before: dict | None) -> float:
    """Wall time of a writer killed mid-way, from its start to its last heartbeat (0 without one)."""
    if not before:
        return 0.0
    return max(0.0, float(before.get("seen", 0.0)) - float(before.get("started", 0.0)))
