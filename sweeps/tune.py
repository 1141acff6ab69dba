"""Ray Tune runs a sweep spec. The only module that imports ray (style.md #10).

    sweep_dir = run_sweep(spec.load("sweeps/quickstart.yaml"))   # -> outputs/sweeps/quickstart
    run_sweep(spec, sweep_dir, resume=True)                       # finish an interrupted sweep

Each trial is one ``experiments.run.run(cfg, callback)`` (or the injected `trainable`, same
signature) with the spec's base + point overrides, its seed, and the sweep's bookkeeping keys
(sweep.name/trial_id, logger.group = the sweep name, tags). The callback reports every training
iteration to Tune with the checkpoint written at that iteration, so ``training_iteration`` equals
the run's iteration; a trial restored by Tune (a scheduler's pause, a retry after a failure,
``--resume``) copies its last reported checkpoint back into its run directory and continues with
``resume=true``: the iteration counter continues, nothing is retrained.

<sweep_dir>/
    sweep.yaml       the spec (analysis.report reads its metric)
    runs/<run_id>/   one run record per trial; run_id = {task}__{experiment}__s{seed}__{tune trial id}
    tune/<name>/     Tune's experiment state, results and checkpoints (what --resume restores)
    sweep.csv        one row per trial: knobs, status, final and best metrics
    timing.json      wall time of this invocation, summed trial training time, orchestration overhead
    report/          analysis.report.report(sweep_dir, ...) when the analysis package is importable
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import ray
import yaml
from ray import tune

from sweeps.spec import Spec, grid_points

# (cfg, callback) -> summary; callback(iteration, metrics, checkpoint dir or None), as experiments.run.run
Trainable = Callable[[Any, Callable | None], dict]
TRIAL_INDEX = "__trial_index__"  # set by ray.tune.search.Repeater (optuna x seeds)
_PRIMITIVE = (str, int, float, bool, type(None))


# ---------------------------------------------------------------------------- the search space
def _indexed(p) -> bool:
    """Tune (and Optuna) get indices for joint or non-scalar values; the trial maps them back."""
    return len(p.keys) > 1 or not all(isinstance(v, _PRIMITIVE) for v in p.values)


def param_space(spec: Spec) -> dict:
    """Tune's space. Tune varies the first grid key fastest: keys go in reverse and `seed` last, so the
    trials run in spec.trials() order (seed slowest: every point of seed 0 first, then seed 1, ...)."""
    space = {}
    for p in reversed(spec.space):
        vals = list(range(len(p.values))) if _indexed(p) else list(p.values)
        if p.kind == "grid":
            space[p.name] = tune.grid_search(vals)
        elif p.kind == "choice":
            space[p.name] = tune.choice(vals)
        elif p.kind == "uniform":
            space[p.name] = tune.uniform(*p.values)
        elif p.kind == "loguniform":
            space[p.name] = tune.loguniform(*p.values)
        else:  # int: both ends inclusive; Tune's randint excludes the upper end
            space[p.name] = tune.randint(p.values[0], p.values[1] + 1)
    if spec.seed_axis != (None,) and spec.search != "optuna":
        space["seed"] = tune.grid_search(list(spec.seeds))
    return space


def decode(spec: Spec, config: dict) -> tuple[dict, int | None]:
    """A Tune trial config -> ({config key: value}, seed); seed None when `seed` is a space key."""
    point = {}
    for p in spec.space:
        v = config[p.name]
        v = v.item() if hasattr(v, "item") else v  # numpy scalars from samplers
        if _indexed(p):
            v = p.values[int(v)]
        elif p.kind == "int":
            v = int(v)
        elif p.kind in ("uniform", "loguniform"):
            v = float(v)
        point.update(p.assign(v))
    if spec.seed_axis == (None,):
        return point, None
    if "seed" in config:
        return point, int(config["seed"])
    return point, spec.seeds[int(config.get(TRIAL_INDEX, 0))]


def describe(spec: Spec, config: dict) -> str:
    point, seed = decode(spec, config)
    parts = [f"{k.rsplit('.', 1)[-1]}={v:g}" if isinstance(v, float) else f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point.items()]
    return " ".join(parts + ([f"seed={seed}"] if seed is not None else []))


# ---------------------------------------------------------------------------- the trial
@dataclass(frozen=True)
class _Job:
    spec: Spec
    sweep_dir: str
    trainable: Trainable | None = None


def _run(cfg, callback):
    from experiments.run import run

    return run(cfg, callback=callback)


def _trial(config: dict, job: _Job) -> None:
    """One trial: compose its config, restore Tune's checkpoint if any, train, report."""
    os.environ.setdefault("EMAPG_PROGRESS", "0")  # no per-trial progress bars in the sweep's output
    from experiments import build

    spec = job.spec
    point, seed = decode(spec, config)
    trial_id = tune.get_context().get_trial_id()
    cfg = build.compose(spec.overrides_for(point, seed))
    run_dir = Path(job.sweep_dir) / "runs" / f"{cfg.task.name}__{cfg.experiment}__s{cfg.seed}__{trial_id}"
    reporter = _Reporter(spec.metric, spec.mode)
    resumed = _restore(run_dir, reporter)
    cfg.sweep.trial_id, cfg.run_dir, cfg.resume = trial_id, str(run_dir), resumed
    (job.trainable or _run)(cfg, reporter)
    reporter.finish(run_dir)


class _Reporter:
    """run()'s callback -> tune.report, once per training iteration, with that iteration's checkpoint.

    A checkpoint is matched to its iteration by its directory name (iter_<N>). experiments.run
    passes each iteration's checkpoint with that iteration's metrics; a caller that hands a
    checkpoint over one call later is handled too: a report without its checkpoint is held until
    the next callback (or the end of the run) shows whether one exists for its iteration.
    Iteration 0 (the evaluation before training) stays in the run record only, which keeps
    Tune's training_iteration equal to the run's iteration. Tune needs the sweep metric in every
    result: between evaluations the latest value is carried forward (best_<key> = running best).
    """

    def __init__(self, metric: str, mode: str):
        self.metric, self.sign = metric, (1 if mode == "max" else -1)
        self.key = metric[len("best_"):] if metric.startswith("best_") else metric
        self.carry: dict[str, float] = {}
        self.pending: tuple[int, dict, dict] | None = None  # (iteration, result, carry at that iteration)

    def __call__(self, iteration: int, metrics: dict, checkpoint: Path | None) -> None:
        value = metrics.get(self.key)
        if isinstance(value, (int, float)) and not math.isnan(value):
            self.carry[self.key] = float(value)
            best = self.carry.get("best_" + self.key)
            if best is None or self.sign * value > self.sign * best:
                self.carry["best_" + self.key] = float(value)
        ckpt_it = _checkpoint_iteration(checkpoint)
        if self.pending is not None:
            owns = checkpoint is not None and ckpt_it in (self.pending[0], None)
            self._report(*self.pending, checkpoint if owns else None)
            checkpoint = None if owns else checkpoint
            self.pending = None
        if iteration == 0:
            return
        result = {**{k: v for k, v in metrics.items() if isinstance(v, (int, float))}, **self._carried(metrics), "iteration": iteration}
        if checkpoint is not None and ckpt_it == iteration:
            self._report(iteration, result, dict(self.carry), checkpoint)
        else:
            self.pending = (iteration, result, dict(self.carry))

    def finish(self, run_dir: Path) -> None:
        """Report the last iteration with the run's final checkpoint (after run() returned)."""
        if self.pending is None:
            return
        latest = run_dir / "checkpoints" / "latest"
        ckpt = run_dir / "checkpoints" / latest.read_text().strip() if latest.is_file() else None
        self._report(*self.pending, ckpt if ckpt is not None and _checkpoint_iteration(ckpt) == self.pending[0] else None)
        self.pending = None

    def _carried(self, metrics: dict) -> dict:
        out = {k: v for k, v in self.carry.items() if k not in metrics}
        out.setdefault(self.metric, self.carry.get(self.metric, float("nan")))
        return out

    @staticmethod
    def _report(iteration: int, result: dict, carry: dict, checkpoint: Path | None) -> None:
        if checkpoint is None:
            tune.report(result)
            return
        ckpt = tune.Checkpoint.from_directory(str(checkpoint))
        ckpt.set_metadata({"iteration": iteration, "name": Path(checkpoint).name, "carry": carry})
        tune.report(result, checkpoint=ckpt)


def _checkpoint_iteration(path: Path | None) -> int | None:
    m = re.search(r"(\d+)$", Path(path).name) if path is not None else None
    return int(m.group(1)) if m else None


def _restore(run_dir: Path, reporter: _Reporter) -> bool:
    """Put Tune's checkpoint of this trial back as the run's latest checkpoint; False = fresh start."""
    ckpt = tune.get_checkpoint()
    if ckpt is None:
        shutil.rmtree(run_dir, ignore_errors=True)  # an earlier attempt that never reported a checkpoint
        return False
    meta = ckpt.get_metadata()
    name, root = meta["name"], run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".restore_{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    ckpt.to_directory(str(tmp))
    shutil.rmtree(root / name, ignore_errors=True)
    os.replace(tmp, root / name)
    for newer in root.glob("iter_*"):  # written after the reported checkpoint by the failed attempt
        if newer.name > name:
            shutil.rmtree(newer, ignore_errors=True)
    (root / ".latest.tmp").write_text(name)  # the trainer's pointer format (LocalTrainer.latest_checkpoint)
    os.replace(root / ".latest.tmp", root / "latest")
    reporter.carry = dict(meta.get("carry") or {})
    return True


# ---------------------------------------------------------------------------- the driver
class _Progress(tune.Callback):
    """One readable line per trial event, and a status line (counts, best so far) every `every` s."""

    def __init__(self, spec: Spec, every: float = 15.0):
        self.spec, self.every = spec, every
        self.t0 = self.last = time.time()
        self.best: tuple[float, str] | None = None
        self.started: set[str] = set()

    def setup(self, **info):
        self.t0 = self.last = time.time()

    def _say(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:6.0f}s] {msg}", file=sys.stdout, flush=True)

    def _status(self, trials, trial=None, status: str = "") -> str:
        """Counts by state (`trial` counted as `status`: callbacks run before Tune updates it)."""
        states = [status if t is trial else t.status for t in trials]
        n = {s: states.count(s) for s in ("RUNNING", "PENDING", "PAUSED", "TERMINATED", "ERROR")}
        for t in trials:  # trials restored by --resume report nothing new
            self._consider((t.last_result or {}).get(self.spec.metric), t.config)
        best = f" | best {self.spec.metric}={self.best[0]:.4g} ({self.best[1]})" if self.best else ""
        return (f"{self.spec.name}: {n['RUNNING']} running, {n['TERMINATED']} done, {n['ERROR']} failed, "
                f"{n['PENDING'] + n['PAUSED']} waiting{best}")

    def on_trial_start(self, iteration, trials, trial, **info):
        again = trial.trial_id in self.started or trial.latest_checkpoint_result is not None
        self.started.add(trial.trial_id)
        ckpt = trial.latest_checkpoint_result
        it = ckpt.metrics.get("training_iteration", 0) if ckpt is not None else 0
        self._say(f"{'resume ' if again else 'start  '} {describe(self.spec, trial.config)}  [{trial.trial_id}]"
                  + (f" from its checkpoint at iteration {it}" if it else (" from scratch" if again else "")))

    def _consider(self, v, config) -> None:
        sign = 1 if self.spec.mode == "max" else -1
        if isinstance(v, (int, float)) and not math.isnan(v) and (self.best is None or sign * v > sign * self.best[0]):
            self.best = (float(v), describe(self.spec, config))

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self._consider(result.get(self.spec.metric), trial.config)

    def on_step(self, iteration, trials, **info):
        if time.time() - self.last >= self.every:
            self.last = time.time()
            self._say(self._status(trials))

    def on_trial_complete(self, iteration, trials, trial, **info):
        r = trial.last_result or {}
        v = r.get(self.spec.metric)
        self._say(f"done    {describe(self.spec, trial.config)}  iteration {r.get('training_iteration', 0)}"
                  + (f"  {self.spec.metric}={v:.4g}" if isinstance(v, (int, float)) else "")
                  + f"  | {self._status(trials, trial, 'TERMINATED')}")

    def on_trial_recover(self, iteration, trials, trial, **info):
        self._say(f"retry   {describe(self.spec, trial.config)}  from its last checkpoint (failure {trial.num_failures} of "
                  f"max {self.spec.max_failures}): {_error_line(trial)}")

    def on_trial_error(self, iteration, trials, trial, **info):
        self._say(f"FAILED  {describe(self.spec, trial.config)}  {_error_line(trial)}  | {self._status(trials, trial, 'ERROR')}"
                  f"\n          traceback: {trial.error_file}")

    def on_experiment_end(self, trials, **info):
        self._say(self._status(trials))


def _error_line(trial) -> str:
    path = trial.error_file
    if not path or not os.path.exists(path):
        return ""
    lines = [ln.strip() for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:300]


def _init_ray(address: str | None, num_cpus: int | None) -> bool:
    """Connect to `address`, or start a local Ray on 127.0.0.1 (no dashboard). True if we started it."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address:
        ray.init(address=address, log_to_driver=False)
        return True
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # else Ray may pick a non-loopback interface
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    return True


def _check_fits(spec: Spec) -> None:
    """A local Ray never grows: a trial asking for more than the machine has would wait forever."""
    have = ray.cluster_resources()
    for name, need in (("CPU", spec.cpu), ("GPU", spec.gpu if spec.backend == "local" else 0)):
        if need > have.get(name, 0):
            ray.shutdown()
            raise ValueError(f"resources.{name.lower()}={need:g} per trial, but this machine's Ray has "
                             f"{have.get(name, 0):g} {name}s; lower it, or pass --address of a larger cluster")


def _search_alg(spec: Spec):
    from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter, Repeater

    if spec.search in ("grid", "random"):  # constant_grid_search: one random draw shared by all seeds
        return BasicVariantGenerator(max_concurrent=spec.max_concurrent or 0, random_state=spec.search_seed,
                                     constant_grid_search=True)
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    searcher = OptunaSearch(sampler=optuna.samplers.TPESampler(seed=spec.search_seed))
    if len(spec.seed_axis) > 1:  # each suggestion runs once per seed; Optuna sees the mean over seeds
        searcher = Repeater(searcher, repeat=len(spec.seed_axis), set_index=True)
    return ConcurrencyLimiter(searcher, max_concurrent=spec.max_concurrent) if spec.max_concurrent else searcher


def _scheduler(spec: Spec):
    from ray.tune.schedulers import AsyncHyperBandScheduler, FIFOScheduler

    s = spec.scheduler
    if s.type == "asha":
        return AsyncHyperBandScheduler(time_attr=s.time_attr, max_t=s.max_t or 100, grace_period=s.grace_period,
                                       reduction_factor=s.reduction_factor)
    return FIFOScheduler()


def _tune_config(spec: Spec, scheduler) -> tune.TuneConfig:
    repeats = len(spec.seed_axis) if spec.search == "optuna" else 1  # Repeater: one Tune trial per seed
    return tune.TuneConfig(metric=spec.metric, mode=spec.mode, search_alg=_search_alg(spec),
                           scheduler=scheduler or _scheduler(spec), num_samples=spec.num_samples * repeats,
                           time_budget_s=spec.time_budget_s)


def run_sweep(spec: Spec, sweep_dir: str | Path | None = None, *, resume: bool = False, address: str | None = None,
              trainable: Trainable | None = None, scheduler=None, num_cpus: int | None = None,
              progress: bool = True, report: bool = True) -> Path:
    """Run (or with resume=True finish) the sweep; returns its directory.

    `trainable(cfg, callback)` replaces experiments.run.run (tests); `scheduler` replaces the spec's
    (any Tune TrialScheduler); `num_cpus` sizes a local Ray (default: all cores).
    """
    sweep_dir = Path(sweep_dir or Path("outputs") / "sweeps" / spec.name).resolve()
    exp_path = sweep_dir / "tune" / spec.name
    _prepare(spec, sweep_dir, exp_path, resume)
    started = _init_ray(address, num_cpus)
    if started and not address:
        _check_fits(spec)
    if trainable is None:
        _warm_start(spec)
    # num_to_keep forces a state snapshot whenever a trial has replaced its checkpoints (cheap, and what
    # keeps --resume exact); Tune warns about that on every fast iteration unless told not to.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's legacy reporter is silent at verbose=0; _Progress reports
    try:
        resources = {"cpu": spec.cpu, "gpu": spec.gpu if spec.backend == "local" else 0}  # verl claims its own GPUs
        fn = tune.with_resources(tune.with_parameters(_trial, job=_Job(spec, str(sweep_dir), trainable)), resources)
        if resume:
            _repair_state(exp_path)
            tuner = tune.Tuner.restore(str(exp_path), trainable=fn, resume_errored=True)
        else:
            tuner = tune.Tuner(fn, param_space=param_space(spec), tune_config=_tune_config(spec, scheduler),
                               run_config=tune.RunConfig(
                                   name=spec.name, storage_path=str(sweep_dir / "tune"), verbose=0, log_to_file=True,
                                   failure_config=tune.FailureConfig(max_failures=spec.max_failures),
                                   checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
                                   callbacks=[_StateBackup(str(exp_path))] + ([_Progress(spec)] if progress else [])))
        slots = max(1, min(spec.max_concurrent or 10**6, int(ray.cluster_resources().get("CPU", 1) // spec.cpu)))
        t0 = time.time()
        with _quiet():
            tuner.fit()
            wall = time.time() - t0
            trials = tune.ExperimentAnalysis(str(exp_path)).trials
        rows = write_csv(spec, sweep_dir, trials)
    finally:
        if started:
            ray.shutdown()
    _timing(spec, sweep_dir, rows, wall, slots, progress)
    unfinished = [t for t in trials if t.status in ("RUNNING", "PENDING", "PAUSED")]
    if unfinished:
        print(f"{spec.name}: {len(unfinished)} trial(s) not finished; continue with: "
              f"emapg sweep <spec.yaml> --resume --out {sweep_dir}", flush=True)
    elif report:
        _report(sweep_dir, progress)
    return sweep_dir


# ---------------------------------------------------------------------------- Tune's state files
COMPLETE = ".complete"
"""Suffix of the last complete copy of a Tune state file (``_StateBackup``)."""


def _state_files(exp_path: Path) -> list[Path]:
    """Tune's per-session state files: experiment_state-*.json (JSON), the searcher's and callbacks' (pickles)."""
    return sorted(p for p in exp_path.glob("*state*") if p.is_file() and not p.name.endswith((COMPLETE, ".tmp")))


def _is_complete(data: bytes) -> bool:
    """A whole JSON document or a whole pickle (checked without building its objects)."""
    import io
    import pickletools

    try:
        if data.lstrip().startswith(b"{"):
            json.loads(data)
        else:
            pickletools.dis(data, out=io.StringIO())
        return bool(data)
    except Exception:  # noqa: BLE001  truncated or garbled in any way
        return False


class _StateBackup(tune.Callback):
    """Keep the last complete copy of each Tune state file beside it (``<name>.complete``).

    Tune rewrites its state files in place (open "w", then dump): a driver killed mid-write (SIGKILL, OOM,
    preemption) leaves a truncated experiment_state-*.json, and ``Tuner.restore`` then starts over with
    trials that have no config. After every controller step, each state file that changed and reads
    whole is copied (write + rename, so the copy itself is never partial); ``_repair_state`` puts the
    copy back before a resume. Pickled into tuner.pkl with the run config, so a resumed sweep keeps it.
    """

    def __init__(self, exp_path: str):
        self.exp_path = exp_path
        self._seen: dict[str, int] = {}

    def on_step_end(self, iteration: int, trials: list, **info) -> None:
        for path in _state_files(Path(self.exp_path)):
            stamp = path.stat().st_mtime_ns
            if self._seen.get(path.name) == stamp:
                continue
            data = path.read_bytes()
            if _is_complete(data):
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_bytes(data)
                os.replace(tmp, path.with_name(path.name + COMPLETE))
                self._seen[path.name] = stamp


def _repair_state(exp_path: Path) -> list[str]:
    """Before a resume: replace each state file that does not read whole by its last complete copy.
    Returns the names replaced (each also printed)."""
    replaced = []
    for copy in sorted(exp_path.glob(f"*{COMPLETE}")):
        path = copy.with_name(copy.name[: -len(COMPLETE)])
        if path.is_file() and _is_complete(path.read_bytes()):
            continue
        shutil.copyfile(copy, path)
        replaced.append(path.name)
        print(f"{path.name} was cut short (the driver was killed while Tune wrote it); resuming from its last "
              "complete copy: a trial may continue from a checkpoint one step older", flush=True)
    return replaced


@contextlib.contextmanager
def _quiet():
    """Tune logs each failed trial's traceback (it is in the trial's error file; _Progress names it) and
    warns about trials without results yet (interrupted ones): keep the sweep's output readable."""
    loggers = [logging.getLogger(n) for n in ("ray.tune.execution.tune_controller", "ray.tune.analysis.experiment_analysis")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _warm_start(spec: Spec) -> None:
    """Build each tiny model's cached warm start once, here, instead of in every concurrent trial."""
    if spec.backend != "local":
        return
    from experiments import build

    seen = set()
    for point in grid_points(spec):
        cfg = build.compose(spec.overrides_for(point, spec.seed_axis[0]))
        m = cfg.model
        key = (cfg.task.name, m.hidden, m.layers, m.heads, m.pretrain_steps, m.cache_dir)
        if m.path is None and key not in seen:
            seen.add(key)
            print(f"warm start of the tiny {cfg.task.name} model (built once, cached in {m.cache_dir})", flush=True)
            build.model(cfg)


def _prepare(spec: Spec, sweep_dir: Path, exp_path: Path, resume: bool) -> None:
    """Refuse to mix sweeps in one directory; on resume, insist on the spec the sweep started with."""
    if resume:
        if not tune.Tuner.can_restore(str(exp_path)) or not (sweep_dir / "sweep.yaml").is_file():
            raise ValueError(f"--resume: {sweep_dir} holds no sweep {spec.name!r} to resume (looked for {exp_path})")
        stored = yaml.safe_load((sweep_dir / "sweep.yaml").read_text(encoding="utf-8"))
        if stored != spec.raw:
            changed = sorted(k for k in set(stored) | set(spec.raw) if stored.get(k) != spec.raw.get(k))
            raise ValueError(f"--resume: the spec differs from the one {sweep_dir} was started with (keys: "
                             f"{', '.join(changed)}); resume with the original spec, or start a new sweep with --out")
        return
    if exp_path.exists():
        raise ValueError(f"{sweep_dir} already holds sweep {spec.name!r}; finish it with --resume, or pass --out <new dir>")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "sweep.yaml").write_text(yaml.safe_dump(spec.raw, sort_keys=False), encoding="utf-8")


# ---------------------------------------------------------------------------- after the sweep
STATUS = {"TERMINATED": "finished", "ERROR": "failed", "RUNNING": "interrupted", "PENDING": "pending", "PAUSED": "paused"}


def write_csv(spec: Spec, sweep_dir: Path, trials) -> list[dict]:
    """<sweep_dir>/sweep.csv, one row per trial in launch order: trial id, run id, status, knobs, final and best
    metrics (from the run records)."""
    key = spec.metric[len("best_"):] if spec.metric.startswith("best_") else spec.metric
    rows = []
    for t in sorted(trials, key=_launch_index):
        point, seed = decode(spec, t.config)
        found = sorted((sweep_dir / "runs").glob(f"*__{t.trial_id}"))
        run_dir = found[0] if found else None
        final, best, summary = _record_metrics(run_dir)
        status = STATUS.get(t.status, t.status.lower())
        run_status = _run_status(run_dir)
        if status == "finished" and run_status not in (None, "finished"):
            status = "stopped"  # ended early by the scheduler or the time budget
        elif status == "failed" and run_status in ("interrupted", "crashed"):
            status = run_status  # SIGTERM/SIGINT or a killed trial process: --resume continues it
        row = {"trial_id": t.trial_id, "run_id": run_dir.name if run_dir else "", "status": status, **point,
               **({"seed": seed} if seed is not None else {}),
               "iterations": (t.last_result or {}).get("training_iteration", 0),
               "train_time_s": summary.get("train_wall_time_s", summary.get("wall_time_s", final.get("time_s", ""))),
               f"final/{key}": final.get(key, ""), f"best/{key}": best.get(key, "")}
        row.update({f"final/{k}": v for k, v in sorted(final.items()) if k != "time_s"})
        row.update({f"best/{k}": v for k, v in sorted(best.items()) if k != "time_s"})
        row["error"] = _error_line(t) if t.status == "ERROR" else ""
        rows.append(row)
    cols = list(dict.fromkeys(k for r in rows for k in r if k != "error")) + ["error"]
    tmp = sweep_dir / ".sweep.csv.tmp"
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols, restval="")
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, sweep_dir / "sweep.csv")
    return rows


def _launch_index(trial) -> float:
    """Tune's trial counter: its experiment tag starts with it ("3_algo.anchor.tau=0.9,...")."""
    head = str(getattr(trial, "experiment_tag", "")).split("_", 1)[0]
    return int(head) if head.isdigit() else math.inf


def _run_status(run_dir: Path | None) -> str | None:
    """The run record's state (experiments.records.read_state: `crashed` for a record left running), or None."""
    from experiments.records import read_state

    if run_dir is None or not (run_dir / "status").is_file():
        return None
    return read_state(run_dir)


def _record_metrics(run_dir: Path | None) -> tuple[dict, dict, dict]:
    """(final, best, summary) of a run record: summary.json when written, else metrics.jsonl."""
    if run_dir is None:
        return {}, {}, {}
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    final, best = {}, {}
    if (run_dir / "metrics.jsonl").is_file():
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a trailing partial line of a crashed run
                continue
            for k, v in row.items():
                if k != "iteration" and isinstance(v, (int, float)) and not math.isnan(v):
                    final[k] = v
                    best[k] = max(best.get(k, v), v)
    final.update(summary.get("final") or {})
    best.update(summary.get("best") or {})
    return final, best, summary


def _timing(spec: Spec, sweep_dir: Path, rows: list[dict], wall: float, slots: int, progress: bool) -> None:
    """timing.json: overhead = 1 - (summed trial training time) / (wall time x trial slots)."""
    train = sum(float(r["train_time_s"]) for r in rows if isinstance(r["train_time_s"], (int, float)))
    slots = max(1, min(slots, len(rows)))
    t = {"wall_s": round(wall, 2), "trials": len(rows), "slots": slots, "train_s_sum": round(train, 2),
         "overhead_fraction": round(1 - train / (wall * slots), 4) if wall > 0 else None}
    (sweep_dir / "timing.json").write_text(json.dumps(t, indent=1) + "\n")
    if progress:
        n = {s: sum(r["status"] == s for r in rows) for s in ("finished", "stopped", "failed", "interrupted", "crashed")}
        others = "".join(f", {n[s]} {s}" for s in ("interrupted", "crashed") if n[s])
        print(f"{spec.name}: {n['finished']} finished, {n['stopped']} stopped early, {n['failed']} failed{others} of {len(rows)} "
              f"trials in {wall:.0f}s (training {train:.0f}s over {slots} slot(s); orchestration overhead "
              f"{t['overhead_fraction']:.0%})\n  {sweep_dir / 'sweep.csv'}", flush=True)


def _report(sweep_dir: Path, progress: bool) -> None:
    try:
        from analysis.report import report
    except ImportError as e:
        print(f"report skipped (analysis not importable: {e}); later: emapg report {sweep_dir} --out {sweep_dir / 'report'}")
        return
    try:
        paths = report(sweep_dir, sweep_dir / "report")
    except Exception as e:  # the sweep's results stand; say why the report is missing
        print(f"report failed: {type(e).__name__}: {e}; retry with: emapg report {sweep_dir} --out {sweep_dir / 'report'}")
        return
    if progress:
        index = [p for p in paths if Path(p).name == "index.md"]
        print(f"  report: {index[0] if index else sweep_dir / 'report'}", flush=True)
