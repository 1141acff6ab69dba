"""A stand-in for experiments.run.run with the same contract, fast enough for scheduling tests.

`fake_run(cfg, callback)` writes a minimal run record (config.yaml, metrics.jsonl, status,
summary.json, checkpoints/iter_<N>/ + latest), calls `callback` the way experiments.run does
(once per training iteration, with the checkpoint written at that iteration or None), resumes from
`<run_dir>/checkpoints/latest` when cfg.resume, and appends every executed iteration to
`<sweep_dir>/calls.jsonl` (kept outside the run directory, so retries and resumes are visible).

The sweep code runs unchanged: the tests' Ray runs `install` in every worker process (Ray's
`worker_process_setup_hook`, RUNTIME_ENV), which replaces experiments.run.run by `dispatch`; a trial
whose `task.knobs.fake` is set runs a stand-in, any other the real trainer. The driver's own
test seams (no warm start, another scheduler) are monkeypatched by the tests.

Behaviour knobs ride in `task.knobs` (free-form for the config; the fake never loads a task):
    fake: "run" (fake_run) or "fail_once" (the real trainer, killed once: real_run_failing_once)
    sleep: seconds per iteration    fail_at: raise at this iteration (before its metrics), fail_times times
    interrupt_at: end as `interrupted` (RunInterrupted) at this iteration, once
    noise: see `score`
The score grows with the iteration and is set by algo.anchor.tau (+ a small seed effect), so a
sweep's ranking is known in advance: higher tau is better.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import json
import os
import shutil
import time
from pathlib import Path

from omegaconf import OmegaConf, open_dict

RUNTIME_ENV = {"worker_process_setup_hook": "sweep_fakes.install"}  # ray.init(runtime_env=...) of the tests


def install() -> None:
    """Ray's worker setup hook: experiments.run.run becomes `dispatch` in this process (once)."""
    import experiments.run as module

    if not hasattr(module.run, "__wrapped__"):
        module.run = functools.wraps(module.run)(functools.partial(dispatch, module.run))


def dispatch(real, cfg, callback=None, timeline=None) -> dict:
    """task.knobs.fake selects the stand-in: "run" -> fake_run (which keeps no timeline), "fail_once" ->
    real_run_failing_once; without it, the real experiments.run.run."""
    fake = (cfg.task.get("knobs") or {}).get("fake")
    if fake is None:
        return real(cfg, callback=callback, timeline=timeline)
    if fake == "run":
        return fake_run(cfg, callback)
    if fake == "fail_once":
        with open_dict(cfg):
            cfg.task.knobs.pop("fake")  # the real task accepts only its own knobs
        return real_run_failing_once(real, cfg, callback, timeline)
    raise ValueError(f"task.knobs.fake={fake!r}: expected run or fail_once")


def score(cfg, iteration: int) -> float:
    """tau * progress + 0.001 * seed; knob `noise`: + noise * progress for tau < 1, its sign alternating with the
    seed (even +, odd -), which makes a paired tau < 1 vs tau = 1 comparison unclear when noise > 1 - tau."""
    its, tau, seed = int(cfg.trainer.iterations), float(cfg.algo.anchor.tau), int(cfg.seed)
    noise = float((cfg.task.get("knobs") or {}).get("noise", 0.0)) * (1 if seed % 2 == 0 else -1) * (tau < 1)
    return (tau + noise) * iteration / its + 0.001 * seed


def fake_run(cfg, callback=None) -> dict:
    run_dir, knobs = Path(cfg.run_dir), dict(cfg.task.knobs)
    sweep_dir = run_dir.parent.parent
    ckpts = run_dir / "checkpoints"
    start = 0
    if cfg.resume and (ckpts / "latest").is_file():
        start = json.loads((ckpts / (ckpts / "latest").read_text().strip() / "state.json").read_text())["iteration"]
        lines = [
            ln for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if json.loads(ln)["iteration"] <= start
        ]
        (run_dir / "metrics.jsonl").write_text("".join(ln + "\n" for ln in lines))  # rewind, as RunRecord does
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        OmegaConf.save(cfg, run_dir / "config.yaml")
    (run_dir / "status").write_text("running\n")
    acc = f"eval/{cfg.task.name}/acc"
    if start == 0:  # the evaluation before training: recorded, not passed to the callback
        _log(run_dir, sweep_dir, cfg, 0, {acc: 0.0})
    for it in range(start + 1, int(cfg.trainer.iterations) + 1):
        time.sleep(float(knobs.get("sleep", 0.0)))
        marker = sweep_dir / "failures" / f"{cfg.sweep.trial_id}"
        failures = len(marker.read_text()) if marker.exists() else 0
        if knobs.get("interrupt_at") == it and failures < 1:  # SIGTERM'd after the previous checkpoint
            from experiments.errors import RunInterrupted

            marker.parent.mkdir(exist_ok=True)
            marker.write_text("x")
            (run_dir / "status").write_text("interrupted\ninterrupted by SIGTERM\n")
            raise RunInterrupted(f"interrupted by SIGTERM after iteration {it - 1}", "SIGTERM", str(run_dir))
        if knobs.get("fail_at") == it and failures < int(knobs.get("fail_times", 1)):
            marker.parent.mkdir(exist_ok=True)
            marker.write_text("x" * (failures + 1))
            (run_dir / "status").write_text("failed\nRuntimeError: injected failure\n")
            raise RuntimeError(f"injected failure at iteration {it}")
        m = {"train/reward": score(cfg, it)}
        if it % int(cfg.trainer.eval_every) == 0 or it == int(cfg.trainer.iterations):
            m[acc] = score(cfg, it)
        _log(run_dir, sweep_dir, cfg, it, m)
        saving = it % int(cfg.trainer.save_every) == 0 or it == int(cfg.trainer.iterations)
        if callback:
            callback(it, m, _save(ckpts, it) if saving else None)
    final = {acc: score(cfg, int(cfg.trainer.iterations))}
    (run_dir / "summary.json").write_text(
        json.dumps({"status": "finished", "final": final, "best": final, "train_wall_time_s": 0.01})
    )
    (run_dir / "status").write_text("finished\n")
    return final


def _save(ckpts: Path, it: int) -> Path:
    path = ckpts / f"iter_{it:06d}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "state.json").write_text(json.dumps({"iteration": it}))
    (ckpts / "latest").write_text(path.name)
    return path


def _log(run_dir: Path, sweep_dir: Path, cfg, it: int, m: dict) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"iteration": it, **m}) + "\n")
    with open(sweep_dir / "calls.jsonl", "a") as f:
        f.write(
            json.dumps(
                {
                    "trial": cfg.sweep.trial_id,
                    "iteration": it,
                    "pid": os.getpid(),
                    "tau": float(cfg.algo.anchor.tau),
                    "period": int(cfg.algo.anchor.period),
                    "seed": int(cfg.seed),
                }
            )
            + "\n"
        )


def calls(sweep_dir: Path) -> list[dict]:
    path = Path(sweep_dir) / "calls.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def pause_once_scheduler(at: int):
    """A FIFO scheduler that pauses every trial once, when it reports iteration `at` (Tune then
    saves it, runs other trials, and later restores it from its last reported checkpoint)."""
    from ray.tune.schedulers import FIFOScheduler, TrialScheduler

    class PauseOnce(FIFOScheduler):
        def __init__(self):
            super().__init__()
            self.paused: set[str] = set()

        def on_trial_result(self, tune_controller, trial, result):
            if result["training_iteration"] == at and trial.trial_id not in self.paused:
                self.paused.add(trial.trial_id)
                return TrialScheduler.PAUSE
            return TrialScheduler.CONTINUE

    return PauseOnce()


def drive(spec_path: str, out: str, address: str, resume: bool = False) -> None:
    """A sweep driver whose trials run the stand-ins (run in a subprocess by the kill-and-resume test)."""
    import ray

    from sweeps import tune as T
    from sweeps.spec import load

    ray.init(address=address, runtime_env=RUNTIME_ENV, log_to_driver=False)  # run_sweep then uses this Ray
    T._warm_start = lambda spec: None  # the stand-in trains no model
    T.run_sweep(load(spec_path), out, resume=resume, address=address, report=False)


def real_run_failing_once(run, cfg, callback=None, timeline=None) -> dict:
    """The real `run`, killed by an exception right after iteration 2's metrics on its first attempt.
    Every attempt is logged to <sweep_dir>/attempts.jsonl (resume flag, iterations seen)."""
    log = Path(cfg.run_dir).parent.parent / "attempts.jsonl"
    first, seen = not log.exists(), []

    def on_iteration(it, metrics, checkpoint):
        seen.append(it)
        callback(it, metrics, checkpoint)
        if first and it == 2:
            raise RuntimeError("injected failure after iteration 2")

    try:
        return run(cfg, callback=on_iteration, timeline=timeline)
    finally:
        with open(log, "a") as f:
            f.write(json.dumps({"resume": bool(cfg.resume), "iterations": seen}) + "\n")


class _DiskFullHalfway:
    """A text file being written: half the first write lands, then the disk is full."""

    def __init__(self, f):
        self.f = f

    def write(self, text):
        self.f.write(text[: len(text) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@contextlib.contextmanager
def disk_full_halfway():
    """Meanwhile, every text file opened for writing in this process is a `_DiskFullHalfway` (a full disk; a kill
    mid-write leaves the same half file)."""
    real_open = io.open

    def torn_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return _DiskFullHalfway(f) if "w" in mode and "b" not in mode else f

    io.open = torn_open
    try:
        yield
    finally:
        io.open = real_open
