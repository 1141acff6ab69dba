"""``run(cfg) -> summary metrics``: the one entry used by the CLI, sweep trials and tests, for every backend.

    emapg train experiment=math_tiny_ema_pg seed=1 algo.anchor.tau=0.95

Callers pass a composed DictConfig (``experiments.build.compose``); every section is validated before any work.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ema_pg_core.health import HealthMonitor
from ema_pg_core.local import checkpoints
from ema_pg_core.local.device import resolve_device
from ema_pg_core.local.trainer import Hooks, Interrupted, LocalTrainer, seed_everything
from experiments import build, cli, numerics, owner, progress, records, stages
from experiments.backends import verl as verl_plugin
from experiments.backends.verl import failures as verl_failures
from experiments.backends.verl import launch as verl_backend
from experiments.backends.verl.failures import VerlExited
from experiments.errors import RunFailed, RunInterrupted, StoppedUnhealthy, Terminated, UserError
from experiments.records import RunRecord, make_run_id
from experiments.stages import verl_logged_resume, verl_resume_overrides
from experiments.verl_metrics import attempt_files, eval_rows, read_consistent, stamp, to_rows
from experiments.wandb_logger import NullLogger, WandbLogger, verl_env

# (iteration, metrics row as recorded, checkpoint dir written at this iteration or None) -> None.
# Called once per training iteration, after that iteration's checkpoint (if any) is on disk;
# sweeps use it to report to Ray Tune.
Callback = Callable[[int, dict, "Path | None"], None]


def resolve_run_dir(cfg: DictConfig) -> Path:
    """run_dir, or out_root/<run id> when it is null (a leading ~ expanded in either)."""
    if cfg.run_dir:
        return Path(os.path.expanduser(cfg.run_dir))
    return Path(os.path.expanduser(cfg.out_root)) / make_run_id(cfg.task.name, cfg.experiment, int(cfg.seed))


def run_keys(cfg: DictConfig, run_dir: Path) -> dict:
    """The run's directory and what its `resume` means there (`resume_mode`), as a merge delta."""
    return {"run_dir": str(run_dir), "resume": resume_mode(cfg.resume, run_dir)}


def resume_mode(resume, run_dir: Path) -> bool | str:
    """What `resume` (experiments.build.RESUME_VALUES) means for `run_dir`: auto -> whether it holds a run
    (records.holds_run); true and force need one there (UserError naming run_dir: a mistyped or empty run_dir
    would otherwise quietly start a new run from iteration 0); false stays false."""
    present = records.holds_run(run_dir)
    if resume == "auto":
        return present
    if resume and not present:
        raise UserError(
            f"resume={str(resume).lower()}: run_dir={str(run_dir)!r} holds no run to continue (no config.yaml, "
            "metrics or checkpoints); check the path, or use resume=auto to start a new run when none is there"
        )
    return resume


def _wandb_settings(cfg: DictConfig) -> dict:
    """The W&B run's project, group (the sweep's, else the experiment's), tags, config and mode."""
    group = cfg.logger.group or cfg.sweep.name or cfg.experiment
    config = OmegaConf.to_container(cfg, resolve=True)
    return dict(
        project=cfg.logger.project, group=group, tags=list(cfg.logger.tags), config=config, mode=cfg.logger.mode
    )


def _verl_wandb(cfg: DictConfig, run_dir: Path) -> dict[str, str]:
    """The same W&B run through verl's tracker: WANDB_* settings (experiments.wandb_logger.verl_env); {} with
    logger=none or W&B disabled."""
    return {} if cfg.logger.name == "none" else verl_env(run_dir, **_wandb_settings(cfg))


# The timeline a run keeps in summary.json["timeline"] ({stamp: epoch seconds}), in order: run() entered, record
# opened, W&B logger up, task and model built, training (the evaluation at iteration 0 first) started, that evaluation
# done, the loop done, the final save done (train_wall_time_s: eval0_start to saved). A caller's own stamps (a sweep
# trial's) come first; a step that did not run has none (eval0_end past iteration 0); a verl run keeps none.
STAMPS = ("run", "record", "logger", "model", "eval0_start", "eval0_end", "train_end", "saved")


def run(
    cfg: DictConfig, callback: Callback | None = None, timeline: dict[str, float] | None = None
) -> dict[str, float]:
    """Train one run as configured; return {metric: final value} (+ best_<metric>). A staged run
    (`stages` / `stage`, experiments.stages) trains its stages one after the other in one record.
    `timeline`: the caller's stamps, completed here (STAMPS) and written to summary.json."""
    timeline = {} if timeline is None else timeline
    _stamp(timeline, "run")
    numerics.pin()  # torch is loaded: raises unless the pins of EMAPG_NUMERICS were set before it loaded
    progress.quiet_libraries()
    if cfg.get("stages") or cfg.get("stage") is not None or cfg.get("resume_from"):
        one = lambda c, s: _run_one(c, callback, s, timeline)
        return stages.run_staged(cfg, resolve_run_dir(cfg), build.validate, one)
    return _run_one(cfg, callback, None, timeline)


def main(argv: list[str]) -> int:
    """`emapg train [experiment=<preset>] [key=value ...]`: run the composed config; print its final evaluations."""
    if any(a in ("-h", "--help") for a in argv):
        print(cli.__doc__.split("\n\n")[0])
        print("usage: emapg train [experiment=<preset>] [key=value ...]   (Hydra overrides)\n")
        print("experiment presets:\n  " + "\n  ".join(build.presets()))
        print(
            "\ncommon overrides: seed=1 smoke=true algo.anchor.tau=0.95 algo.anchor.period=10 algo.kl.type=k3 "
            "algo.kl.k=32 algo.kl.tail=paper trainer.iterations=100 logger.mode=online run_dir=... resume=true\n"
            "staged runs (experiments/stages.py): stages=[8k,16k] | stage=16k (a task's stages) | "
            "'stages=[{name: a, set: {trainer.iterations: 40}}, ...]' (any preset)"
        )
        return 0
    bad = [a for a in argv if "=" not in a]
    if bad:
        raise UserError(f"emapg train takes Hydra overrides key=value; got {' '.join(bad)} (see emapg train --help)")
    cfg = build.compose(argv)
    try:
        summary = run(cfg)
    except RunInterrupted as e:  # one line + how to continue
        raise RunInterrupted(f"{e}\nresume with: {resume_command(argv, e)}", e.signame, e.run_dir) from None
    for k in sorted(k for k in summary if k.startswith(("eval/", "eval_anchor/")) and not k.startswith("best_")):
        print(f"{k:40s} {summary[k]:.4f}")
    return 0


def resume_command(argv: list[str], stop: RunInterrupted) -> str:
    """The same `emapg train` command with resume=true and the run directory the stopped run used, quoted twice:
    for Hydra (a path with spaces or special characters) and for the shell."""
    keep = [a for a in argv if not a.startswith(("resume=", "run_dir="))]
    where = [build.path_override("run_dir", str(stop.run_dir))] if stop.run_dir else []
    return shlex.join(["emapg", "train", *keep, *where, "resume=true"])


def _stamp(timeline: dict[str, float], name: str, clock: Callable[[], float] = time.time) -> None:
    """timeline[name] = now. The clock is bound here: tests of train_wall_time_s drive the module's `time`."""
    timeline[name] = round(clock(), 3)


def _run_one(cfg: DictConfig, callback: Callback | None, stage: dict | None, timeline: dict) -> dict[str, float]:
    """One run, or one stage of a staged run (`stage`: experiments.stages.start_info)."""
    local_cfg = build.validate(cfg)  # raises before any work
    build.check_k(cfg)
    if cfg.backend.name == "verl":
        return _run_verl(cfg, callback, stage)  # no timeline: verl times its own steps

    resolve_device(local_cfg.trainer.device)  # cuda without CUDA: refused before any work
    run_dir = resolve_run_dir(cfg)
    cfg = OmegaConf.merge(cfg, run_keys(cfg, run_dir))
    build.check_retriever(cfg)  # an unreachable retriever: refused before any work
    held = owner.acquire(run_dir, "run", records.RUN_BUSY)  # one writer per record, before its checkpoint is read
    try:
        record, state = _open_record(cfg, run_dir, stage, held)
    except BaseException:
        held.release()
        raise
    _stamp(timeline, "record")
    with record:
        none = cfg.logger.name == "none"
        logger = NullLogger() if none else WandbLogger(run_dir=run_dir, name=run_dir.name, **_wandb_settings(cfg))
        _stamp(timeline, "logger")
        with logger:
            try:
                summary = _train(cfg, local_cfg, record, logger, state=state, callback=callback, timeline=timeline)
            except Interrupted as e:  # a checkpoint is on disk: recorded as interrupted, not failed
                record.interrupt(str(e))
                raise RunInterrupted(str(e), e.signame, run_dir) from None
    return _flat_summary(summary)


def _open_record(cfg: DictConfig, run_dir: Path, stage: dict | None, held: owner.Owner) -> tuple[RunRecord, dict]:
    """(the run's record, the state to continue from or None): opened fresh, or resumed from the newest checkpoint
    in run_dir that loads (or from ``resume_from``, a stage's start)."""
    ckpt_dir = run_dir / "checkpoints"
    found = checkpoints.load_newest(ckpt_dir) if cfg.resume else None  # (dir, state, skipped) or None
    own = found is not None  # a checkpoint of this run_dir, not one trained elsewhere
    if found is None and cfg.get("resume_from"):  # a stage started from a local checkpoint trained elsewhere
        step = Path(os.path.expanduser(cfg.resume_from))  # one with state.pt: stages.run_staged checked
        found = step, torch.load(step / checkpoints.STATE, map_location="cpu", weights_only=False), []
    if cfg.resume and found is None and (run_dir / "metrics.jsonl").exists():
        raise ValueError(f"resume={cfg.resume} but {ckpt_dir} holds no checkpoint to continue from")
    for s in found[2] if found else ():
        print(
            f"warning: skipping checkpoint {ckpt_dir / s['checkpoint']} ({s['error']}); resuming from {found[0].name}",
            file=sys.stderr,
        )
    if found and int(found[1]["iteration"]) > int(cfg.trainer.iterations):
        raise UserError(
            f"trainer.iterations={cfg.trainer.iterations}: the checkpoint {found[0]} is at iteration "
            f"{found[1]['iteration']}; a resume may lengthen a run, not shorten it (use a new run_dir)"
        )
    torch.set_num_threads(int(cfg.trainer.threads))
    seed_everything(int(cfg.seed))
    trained = (found[1].get("hooks") or {}).get("config") if own else None  # what this run_dir's checkpoint trained
    ckpt = dict(checkpoint=found[0].name, skipped=found[2], trained=trained) if found else {}
    force = cfg.resume == "force"
    record = RunRecord.create(run_dir, cfg, resume=found is not None, force=force, stage=stage, held=held, **ckpt)
    return record, found[1] if found else None


def _train(cfg, local_cfg, record, logger, *, state: dict | None, callback: Callback | None, timeline):
    task = build.task(cfg)
    policy, tok = build.model(cfg)
    record.numerics = numerics.fingerprint(policy.name_or_path if cfg.model.path is None else None)
    _stamp(timeline, "model")
    bar = None
    rows: dict[int, dict] = {}
    stepped: dict[int, dict] = {}  # a step the health rules are looking at, before its evaluation
    health = HealthCheck(cfg, record, lambda: [on_metrics(it, m) for it, m in stepped.items()])

    def on_step_end(it: int, m: dict) -> None:
        """The health rules see the update before anything else runs on it: a non-finite update is recorded
        and stops the run (StoppedUnhealthy) before an evaluation would sample from NaN probabilities."""
        stepped[it] = m
        health.observe(it, m)
        stepped.clear()

    def on_metrics(it: int, m: dict) -> None:
        if it == 0:
            _stamp(timeline, "eval0_end")
        rows[it] = record.log(it, m)
        logger.log(it, rows[it])
        if bar is not None and it != 0:  # the bar to `it`, with its reward, KL and anchor drift
            bar.update(it - bar.n)
            postfix = {"reward": f"{m.get('train/reward', 0):.2f}", "kl": f"{m.get('kl/value', 0):.2e}"}
            bar.set_postfix({**postfix, "drift": f"{m.get('anchor/drift', 0):.1e}"}, refresh=False)

    def on_iteration_end(it: int, m: dict, ckpt: Path | None) -> None:
        row = rows.pop(it, m)
        if callback is not None:
            callback(it, row, ckpt)

    # training seconds of the attempts before this one, up to its checkpoint: train_wall_time_s covers them all
    earlier_s = float(((state or {}).get("hooks") or {}).get("train_s", 0.0))

    def hooks_state() -> dict:  # kept in each checkpoint (t0: set below, before the first one is written)
        return {**record.state(), "train_s": earlier_s + time.time() - t0}

    hooks = Hooks(
        metrics=on_metrics,
        step_end=on_step_end,
        evals=record.log_evals,
        iteration_end=on_iteration_end,
        state=hooks_state,
    )
    trainer = LocalTrainer(policy, tok, task, local_cfg, Path(cfg.run_dir) / "checkpoints", hooks=hooks)
    if state is not None:
        trainer.load_state_dict(state)
        record.rewind(trainer.iteration)
        health.replay(records.read_metrics(record.run_dir))  # the rules' state as the uninterrupted run had it
    bar = progress.bar(local_cfg.trainer.iterations, f"{cfg.experiment} s{cfg.seed}", initial=trainer.iteration)
    t0 = time.time()  # this attempt's training starts here
    _stamp(timeline, "eval0_start")
    _train_and_save(trainer, Path(cfg.run_dir), bar, timeline)
    extra = {"wandb_run_id": logger.wandb_run_id, "train_wall_time_s": earlier_s + time.time() - t0}
    return record.finish({**extra, "timeline": dict(timeline)})


def _train_and_save(trainer, run_dir: Path, bar, timeline: dict[str, float]) -> None:
    """Train, then save the policy (with its tokenizer) and the anchor as Hugging Face directories under
    <run_dir>/final (stamps: train_end, saved)."""
    try:
        trainer.train()
        _stamp(timeline, "train_end")
        final = run_dir / "final"
        trainer.policy.save_pretrained(final / "policy")
        trainer.tok.save_pretrained(final / "policy")
        trainer.anchor.module.save_pretrained(final / "anchor")
    except OSError as e:  # a full disk, a read-only or vanished directory: the run fails, saying where and why
        raise RunFailed(f"cannot write {e.filename or run_dir}: {e.strerror or e}") from e
    finally:
        bar.close()
    _stamp(timeline, "saved")


class HealthCheck:
    """The run's RL-health rules (``cfg.health``, ema_pg_core.health) over the metrics it logs, on either backend:
    when a rule fires, `observe` closes the record as stopped_unhealthy (the rule, iteration and values) and raises
    StoppedUnhealthy, which ends the run (exit code 3 for `emapg train`, that trial only in a sweep)."""

    def __init__(self, cfg: DictConfig, record: RunRecord, before_stop: Callable[[], None] = lambda: None):
        self.monitor, self.record = HealthMonitor(OmegaConf.to_object(cfg.health)), record
        self.before_stop = before_stop  # what must reach the record before it is closed (the verl evals)

    def observe(self, iteration: int, metrics: dict, fire: bool = True) -> None:
        """Add one iteration; with `fire`, raise when a rule fires on it (without: history only)."""
        breach = self.monitor.observe(iteration, metrics)
        if fire:
            self._raise(breach)

    def replay(self, rows: list[dict]) -> None:
        """A resumed run's kept lines; a rule changed on resume may fire on them (then the run stops here)."""
        self._raise(self.monitor.replay(rows))

    def _raise(self, breach) -> None:
        if breach is not None:
            self.before_stop()
            self.record.stop_unhealthy(breach.to_dict())
            run_dir = self.record.run_dir
            raise StoppedUnhealthy(f"{breach} (run record: {run_dir})", breach.to_dict(), run_dir)


VERL_POLL_S = 10.0  # how often (seconds) a verl run's metrics files are read into the run record while verl runs


def _run_verl(cfg: DictConfig, callback: Callback | None = None, stage: dict | None = None) -> dict[str, float]:
    """The distributed backend: stock verl 0.9.x + our plugin (needs the [verl] extra and GPUs). verl runs in a
    worker thread (``_in_thread``) and logs to ``<run_dir>/verl_metrics.jsonl``, which this thread follows every
    VERL_POLL_S seconds (``_VerlFollower``): a verl run reads like a local one while it runs, and `callback` gets
    each iteration without a checkpoint (verl keeps its own). time_s is when the follower saw a step (up to
    VERL_POLL_S late); per-step wall time is perf/iter_s. A stage starts as ``stage_job_config`` says."""
    verl_plugin.require_verl()  # an install hint, not a traceback, on a machine without the [verl] extra

    run_dir = resolve_run_dir(cfg)
    cfg = OmegaConf.merge(cfg, run_keys(cfg, run_dir), agent_loops_path(cfg))
    job = stage_job_config(cfg, stage)
    with RunRecord.create(run_dir, cfg, resume=bool(cfg.resume), force=cfg.resume == "force", stage=stage) as record:
        follower = _VerlFollower(record, cfg, callback)
        wandb = _verl_wandb(cfg, run_dir)

        def work() -> int:
            try:
                return verl_backend.run_config(job, wandb)
            finally:
                follower.done = True  # the last polls record what verl logged; nothing is left to watch

        try:
            code = _in_thread(work, follower.poll, VERL_POLL_S)
        except BaseException as e:
            follower.poll(report=False, watch=False)  # keep what verl logged (a failed poll, Ctrl-C, a verl error)
            from ray.exceptions import RayError

            # verl may fail on its own after failed rollouts (e.g. a batch left empty): their cause comes first
            failure = verl_failures.first_failure(follower.tolerated) if isinstance(e, RayError) else None
            verl_failures.stop_run()  # verl may still run (a failed rollout, a timeout, a health stop): stop it
            if isinstance(e, RayError):  # verl raised in a Ray actor, or its actor died
                then = f"verl failed: {_last_line(str(e))} (its traceback is in {record.run_dir}/status)"
                raise RunFailed(f"{failure}\nThen {then}" if failure else then) from e
            if isinstance(e, VerlExited):  # a sweep trial's verl job (a child process) failed
                raise RunFailed(str(e)) from None
            if isinstance(e, (KeyboardInterrupt, Terminated)):  # verl resumes from its own last checkpoint
                name = "SIGINT" if isinstance(e, KeyboardInterrupt) else str(e)
                raise RunInterrupted(
                    f"interrupted by {name}; a resume continues from verl's last checkpoint "
                    f"(every trainer.save_every steps) in {run_dir}",
                    name,
                    run_dir,
                ) from None
            raise
        if code:
            raise RunFailed(f"verl exited with status {code}")
        summary = record.finish({"wandb_run_id": wandb.get("WANDB_RUN_ID")})
    return _flat_summary(summary)


def stage_job_config(cfg: DictConfig, stage: dict | None) -> dict:
    """The resolved config verl gets: `cfg`, plus, on a stage's first attempt, the overrides that start it from
    the previous stage's last ``global_step_N`` or ``resume_from`` (not recorded in config.yaml:
    a resume of the same stage continues from its own newest checkpoint whose step verl logged,
    ``experiments.stages.verl_logged_resume``)."""
    job = OmegaConf.to_container(cfg, resolve=True)
    extra = verl_resume_overrides(job, stage)
    if not extra and cfg.resume:  # resumed mid-way: from the newest checkpoint of a step in the record
        extra = verl_logged_resume(job, Path(job["run_dir"]))
    if extra:
        job["backend"]["verl"]["overrides"] = list(job["backend"]["verl"].get("overrides") or []) + extra
    return job


def newest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """(iteration, directory) of the newest checkpoint of a local run's record (``latest`` first), or None."""
    steps = checkpoints.candidates(Path(run_dir) / "checkpoints")
    return (int(steps[0].name.removeprefix("iter_")), steps[0]) if steps else None


def put_checkpoint(run_dir: Path, iteration: int, fill: Callable[[Path], None]) -> None:
    """Make what `fill(directory)` writes the run's checkpoint of `iteration` and its newest (a sweep putting its
    copy back); the ones an earlier attempt wrote after it are removed."""
    root = Path(run_dir) / "checkpoints"
    step = checkpoints.step_dir(root, iteration)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".restore_{step.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    fill(tmp)
    shutil.rmtree(step, ignore_errors=True)
    os.replace(tmp, step)
    for newer in root.glob("iter_*"):
        if newer.name > step.name:
            shutil.rmtree(newer, ignore_errors=True)
    checkpoints.point_latest(root, step)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else text


def _in_thread(work: Callable[[], int], tick: Callable[[], None], every_s: float) -> int:
    """``work()`` in a daemon thread, ``tick()`` here every `every_s` seconds and once more after it
    ended (so the last tick sees all it did, whatever the timing); its result, or its exception
    re-raised here. (Tune's reporting stays in the caller's thread.)"""
    out: dict = {}

    def target() -> None:
        try:
            out["value"] = work()
        except BaseException as e:  # noqa: BLE001  handed to the caller's thread
            out["error"] = e

    thread = threading.Thread(target=target, name="verl", daemon=True)
    thread.start()
    while True:
        thread.join(every_s)
        ended = not thread.is_alive()  # before the tick: work that ends during a tick gets one more
        tick()
        if ended:
            break
    if "error" in out:
        raise out["error"]
    return out["value"]


class _VerlFollower:
    """verl's metrics files -> metrics.jsonl lines and `callback` calls, step by step, while verl runs.

    A poll reads every attempt (``experiments.verl_metrics.to_rows``; a half-written last line
    waits for the next poll) unless no file changed size or mtime since the last one. Steps past the
    last one recorded are appended; a step whose metrics changed (a resumed attempt replaying steps
    after its checkpoint) rewinds the record to just before it and appends again.
    `callback` gets each iteration once, in increasing order; the health rules see each recorded step (``_check``).
    """

    def __init__(self, record: RunRecord, cfg: DictConfig, callback: Callback | None):
        self.record, self.callback = record, callback
        self.timeout_s = float(cfg.backend.verl.step_timeout_s)
        self.tolerated = int(cfg.backend.verl.max_failed_rollouts)
        self.progress_t = time.time()  # when the last new step was seen (or the run started)
        self.done = False
        self.task, self.greedy = cfg.task.name, float(cfg.trainer.eval_temperature) == 0.0
        self.logged: dict[int, dict] = {}
        self.eval_keys: set[tuple] = set()  # (iteration, model, benchmark, problem_id) of the rows in evals.jsonl
        self.reported = -1
        self._stamp: list[tuple] | None = None  # (name, size, mtime) of the files the last poll read
        self.cfg, self.health, self.stopped = cfg, HealthCheck(cfg, record, self._record_evals), False
        self.checked_until = record.last_iteration  # resumed: an earlier attempt checked the steps up to here
        record.rewind(-1)

    def poll(self, report: bool = True, watch: bool = True) -> None:
        """Record (and report) new steps; then, with `watch` and verl still running, raise RunFailed when
        the workers reported more failed rollouts than ``backend.verl.max_failed_rollouts`` or no step
        came for ``backend.verl.step_timeout_s``."""
        self._record(report)
        if watch and not self.done:
            self._watch()

    def _record(self, report: bool) -> None:
        if self.stopped:  # a health rule ended the run: nothing after its step is recorded
            return
        if stamp(attempt_files(self.record.run_dir)) == self._stamp:
            return
        read = read_consistent(self.record.run_dir)
        if read is None:  # the files changed during every read: the next poll reads them
            return
        self._stamp, steps, live = read  # live: the steps the newest attempt logged
        rows = [(step, m) for step, m in to_rows(self.record.run_dir, self.task, self.greedy, steps) if m]
        # the first step that is new or changed below one already recorded: rewind to just before it
        last = max(self.logged, default=-1)
        changed = next((s for s, m in rows if s <= last and self.logged.get(s) != m), None)
        if changed is not None:
            self.record.rewind(changed - 1)
            self.logged = {s: m for s, m in self.logged.items() if s < changed}
            self.eval_keys = {k for k in self.eval_keys if k[0] < changed}
            self._rebuild_health(changed)
        for step, metrics in rows:
            if step in self.logged:
                continue
            self.progress_t = time.time()
            self.logged[step] = metrics
            row = self.record.log(step, metrics)
            self._check(step, metrics, step in live)
            if report and self.callback is not None and step > self.reported:
                self.callback(step, {k: v for k, v in row.items() if k not in ("iteration", "time_s")}, None)
                self.reported = step
        self._record_evals()

    def _record_evals(self) -> None:
        """Per-problem rows of the steps recorded so far (verl_evals.jsonl, our trainer's) -> evals.jsonl."""
        last = max(self.logged, default=-1)
        new = [r for r in eval_rows(self.record.run_dir) if r["iteration"] <= last]
        new = [r for r in new if (r["iteration"], r["model"], r["benchmark"], r["problem_id"]) not in self.eval_keys]
        self.record.log_evals(new)
        self.eval_keys |= {(r["iteration"], r["model"], r["benchmark"], r["problem_id"]) for r in new}

    def _check(self, step: int, metrics: dict, live: bool) -> None:
        """The health rules on a new step (StoppedUnhealthy, after which nothing more is recorded). Only a step of
        the newest attempt fires, and in a resumed run only past what an earlier attempt checked (or replayed by
        this one with new values); older attempts' steps feed the rules' history only."""
        fire = live and (self.checked_until is None or step > self.checked_until)
        try:
            self.health.observe(step, metrics, fire=fire)
        except StoppedUnhealthy:
            self.stopped = True
            raise

    def _rebuild_health(self, changed: int) -> None:
        """A resumed attempt replays steps from `changed` on: the rules restart from the steps kept before it."""
        self.health = HealthCheck(self.cfg, self.record, self._record_evals)
        for step in sorted(self.logged):
            self.health.observe(step, self.logged[step], fire=False)
        if self.checked_until is not None:
            self.checked_until = min(self.checked_until, changed - 1)

    def _watch(self) -> None:
        failure = verl_failures.first_failure(self.tolerated)
        if failure is not None:
            raise RunFailed(failure)
        idle = time.time() - self.progress_t
        if idle > self.timeout_s:
            raise RunFailed(
                f"no training step completed for {idle:.0f} s (backend.verl.step_timeout_s="
                f"{self.timeout_s:g}); stopping the run. verl's own log (stdout/stderr, or the Ray "
                "worker logs) says where it waits."
            )


PACKAGE_PARENT = Path(__file__).resolve().parents[1]  # holds the ``experiments`` package (checkout or site-packages)


def agent_loops_path(cfg: DictConfig) -> dict:
    """backend.verl.agent_loop_config_path made absolute (``~`` expanded, relative to PACKAGE_PARENT) as a merge
    delta ({} when unset): verl resolves a relative path against its agent loop workers' working directory (a Tune
    trial's is its trial directory); the shipped experiments/conf/verl/agent_loops.yaml is packaged with us."""
    path = cfg.backend.verl.get("agent_loop_config_path")
    if not path:
        return {}
    return {"backend": {"verl": {"agent_loop_config_path": str(PACKAGE_PARENT / os.path.expanduser(path))}}}


def _flat_summary(summary: dict) -> dict[str, float]:
    out = {k: v for k, v in summary.get("final", {}).items() if isinstance(v, (int, float))}
    out.update({f"best_{k}": v for k, v in summary.get("best", {}).items() if isinstance(v, (int, float))})
    return out
