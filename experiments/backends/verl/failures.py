"""Errors verl only logs, made fatal: a failed rollout ends the run with its cause instead of a hang.

verl 0.9.1's V1 agent loop catches an exception raised while a prompt is rolled out (rollout server, agent
loop, tool or retriever, reward), logs "Error in _run_prompt ..." and goes on; when every rollout fails the
trainer waits forever. Every Ray worker process of the run gets a logging handler (``setup_worker``, the
``worker_process_setup_hook``) that sends such records to one named actor (``FailureLog``); the driver asks it
for the first failure whenever it polls verl's metrics (``first_failure``) and ends the run with it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import traceback

from experiments.backends.verl import attention

ACTOR = "emapg_failure_log"  # the FailureLog actor, in the run's Ray namespace
PATTERNS = ("Error in _run_prompt",)  # starts of the log messages that mean a rollout failed
SETUP_HOOK = "experiments.backends.verl.failures.setup_worker"  # Ray's worker_process_setup_hook on GPUs
MAX_KEPT = 5
RUNNING: dict = {}
"""In the process that launched a run: its TaskRunner ("runner") and ``FailureLog`` ("failure_log") handles;
inside a sweep trial, the child process running verl ("process") and its Ray namespace ("namespace")."""
STOP_GRACE_S = 10.0  # how long a verl child process gets to exit after SIGTERM before it is killed


class VerlExited(RuntimeError):
    """The verl job a sweep trial ran as a child process exited with a non-zero status."""

    def __init__(self, code: int, log):
        super().__init__(code, log)  # args stay (code, log): Ray and Tune copy and pickle exceptions
        self.code, self.log, self.cause = code, log, _cause(log)

    def __str__(self) -> str:
        return f"verl exited with status {self.code}: {self.cause} (its output: {self.log})"


def _cause(log) -> str:
    """The last line of the child's output that names an error, else its last line."""
    try:
        lines = [ln.strip() for ln in open(log, errors="replace").read().splitlines() if ln.strip()]
    except OSError:
        return "no output"
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln or ln.startswith("emapg ")]
    return ((errors or lines or ["no output"])[-1])[:300]


class FailureLog:
    """Ray actor: the first failures reported by the run's workers."""

    def __init__(self):
        self.failures: list[dict] = []
        self.count = 0

    def report(self, failure: dict) -> None:
        self.count += 1
        if len(self.failures) < MAX_KEPT:
            self.failures.append(failure)

    def first(self) -> tuple[dict | None, int]:
        return (self.failures[0] if self.failures else None), self.count


def create_actor():
    """The run's ``FailureLog`` (created by the launching process, before the TaskRunner and its workers)."""
    import ray

    RUNNING["failure_log"] = actor = ray.remote(num_cpus=0)(FailureLog).options(name=ACTOR, get_if_exists=True).remote()
    return actor


class _Forward(logging.Handler):
    """Sends records that mean a failed rollout to the ``FailureLog`` actor (never raises)."""

    def __init__(self):
        super().__init__(level=logging.ERROR)
        self._actor = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if not message.startswith(PATTERNS):
                return
            exc = "".join(traceback.format_exception(*record.exc_info)) if record.exc_info else ""
            if self._actor is None:
                import ray

                self._actor = ray.get_actor(ACTOR)
            cause = exc.strip().splitlines()[-1].strip() if exc.strip() else message
            self._actor.report.remote({"message": message, "traceback": exc, "pid": os.getpid(), "cause": cause})
        except Exception:  # noqa: BLE001  a log handler must not fail the code that logs
            pass


def setup_worker() -> None:
    """Ray ``worker_process_setup_hook`` of a run on GPUs: failure forwarding (idempotent), a TransferQueue of the
    run's own, and our attention registered with transformers."""
    from experiments.backends.verl.placement import isolate_transfer_queue  # loads ray

    root = logging.getLogger()
    if not any(isinstance(h, _Forward) for h in root.handlers):
        root.addHandler(_Forward())
    isolate_transfer_queue()
    attention.register()


def first_failure(tolerated: int = 0) -> str | None:
    """The first failure the run's workers reported, once there are more than `tolerated` (else None)."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        actor = RUNNING.get("failure_log")
        if actor is None and RUNNING.get("namespace"):  # the FailureLog of the verl child process this trial started
            RUNNING["failure_log"] = actor = ray.get_actor(ACTOR, namespace=RUNNING["namespace"])
        if actor is None:
            return None
        failure, count = ray.get(actor.first.remote(), timeout=10)
    except Exception:  # noqa: BLE001  no actor yet (verl still starting), or the cluster is gone
        return None
    if failure is None or count <= tolerated:
        return None
    more = f" (and {count - 1} more)" if count > 1 else ""
    return (
        f"a rollout failed in verl's agent loop{more}; backend.verl.max_failed_rollouts={tolerated}: "
        f"{failure['cause']}\n"
        f"--- worker traceback (pid {failure['pid']}) ---\n{failure['traceback'] or failure['message']}"
    )


def stop_run() -> None:
    """Kill the TaskRunner (or verl child process) this process launched, if any. By handle: looking the actor up
    by name from the driver can block on its class."""
    import ray

    _stop_child(RUNNING.pop("process", None))
    handle = RUNNING.pop("runner", None)
    RUNNING.clear()  # the namespace and the FailureLog of the run stopped
    if handle is not None and ray.is_initialized():
        ray.kill(handle)


def _stop_child(proc) -> None:
    """SIGTERM the verl child process, SIGKILL it after STOP_GRACE_S; its Ray job ends with it."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
