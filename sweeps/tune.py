"""Ray Tune runs a sweep spec. The only module that imports ray (docs/architecture.md, "Dependency rules").

    sweep_dir = run_sweep(spec.load("sweeps/quickstart.yaml"))   # -> outputs/sweeps/quickstart
    run_sweep(spec, sweep_dir, resume=True)                       # finish an interrupted sweep

Each trial is one ``experiments.run.run`` (``_trial``), reporting every iteration to Tune with its checkpoint
(``_Reporter``): a trial Tune restores (a scheduler's pause, a retry, ``--resume``) continues from its last
reported checkpoint, nothing retrained.

<sweep_dir>/ holds sweep.yaml (the spec, written whole before anything else; --resume compares the spec with it),
runs/<run_id>/ (a run record per trial, named with its Tune trial id), tune/<name>/ (Tune's state; adaptive seeds:
tune/round_<r>/<name>/), adaptive.jsonl (sweeps.adaptive), sweep.csv and timing.json (sweeps.results), report/.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import math
import os
import pickletools
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import ray
import torch
import yaml
from omegaconf import OmegaConf
from ray import tune
from ray.tune.schedulers import AsyncHyperBandScheduler, FIFOScheduler
from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter, Repeater

from analysis.dashboard import SweepInfo, after_sweep
from experiments import build, numerics, owner, records
from experiments.backends.verl import resources as verl_resources
from experiments.backends.verl.launch import placement_for
from experiments.backends.verl.resources import free_line
from experiments.errors import (
    RunInterrupted,
    StoppedUnhealthy,
    Terminated,
    UserError,
    bounded,
    exit_code_of_signal,
    is_ray_auth_error,
    raise_terminated,
    ray_auth_line,
    shown,
)
from experiments.ops.doctor import answers, parse_address
from experiments.run import newest_checkpoint, put_checkpoint, run
from sweeps import adaptive, results
from sweeps.model import Spec, grid_points
from sweeps.spec import Param, SpecError, read_raw
from sweeps.spec import trials as spec_trials

SETTLE_S = 15.0  # after an interrupted Tune run, how long stopped trials get to close their run records
# sweep.csv statuses that end an adaptive round (stopped_unhealthy is experiments.records.UNHEALTHY)
_ROUND_ENDED = ("finished", "stopped", "failed", "stopped_unhealthy")

TRIAL_INDEX = "__trial_index__"  # set by ray.tune.search.Repeater (optuna x seeds)


# ---------------------------------------------------------------------------- the search space
def _indexed(p) -> bool:
    """Tune (and Optuna) get indices for joint or non-scalar values; the trial maps them back."""
    return len(p.keys) > 1 or not all(isinstance(v, (str, int, float, bool, type(None))) for v in p.values)


def param_space(spec: Spec) -> dict:
    """Tune's space. Tune varies the first grid key fastest: keys go in reverse and `seed` last, so the
    trials run in spec.trials() order (seed slowest: every point of seed 0 first, then seed 1, ...)."""
    space = {}
    for p in reversed(spec.space):
        if p.kind in ("grid", "choice"):
            vals = list(range(len(p.values))) if _indexed(p) else list(p.values)
            space[p.name] = tune.grid_search(vals) if p.kind == "grid" else tune.choice(vals)
        elif p.kind == "int":  # both ends inclusive; Tune's randint excludes the upper end
            space[p.name] = tune.randint(p.values[0], p.values[1] + 1)
        else:  # uniform, loguniform: Tune's samplers of the same names
            space[p.name] = getattr(tune, p.kind)(*p.values)
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
    parts = [f"{k.rsplit('.', 1)[-1]}={format(v, 'g') if isinstance(v, float) else v}" for k, v in point.items()]
    return " ".join(parts + ([f"seed={seed}"] if seed is not None else []))


# ---------------------------------------------------------------------------- the trial
def _trial(config: dict, spec: Spec, sweep_dir: str) -> None:
    """One trial: compose its config, put back Tune's checkpoint if any, run experiments.run.run. Its timeline
    (summary.json) starts here: `worker` (this function entered), `composed` (imports and config done)."""
    timeline = {"worker": round(time.time(), 3)}
    os.environ.setdefault("EMAPG_PROGRESS", "0")  # no per-trial progress bars in the sweep's output
    point, seed = decode(spec, config)
    trial_id = tune.get_context().get_trial_id()
    cfg = build.compose(spec.overrides_for(point, seed))
    timeline["composed"] = round(time.time(), 3)
    run_dir = Path(sweep_dir) / "runs" / records.make_run_id(cfg.task.name, cfg.experiment, cfg.seed, trial_id=trial_id)
    if spec.backend == "verl":  # verl keeps its own checkpoints: <run_dir>/checkpoints, or <checkpoint_dir>/<run id>
        carry, resume = None, "auto"  # continue the record an earlier attempt left, else start
        if cfg.backend.verl.checkpoint_dir is not None:  # one directory for every trial of the sweep
            cfg.backend.verl.checkpoint_dir = str(Path(cfg.backend.verl.checkpoint_dir) / run_dir.name)
    else:
        carry = _restore(run_dir, _Reporter(spec.metric, spec.mode))
        resume = carry is not None
    cfg.sweep.trial_id, cfg.run_dir, cfg.resume = trial_id, str(run_dir), resume
    reporter = _Reporter(spec.metric, spec.mode, carry, last=int(cfg.trainer.iterations))
    try:
        run(cfg, callback=reporter, timeline=timeline)
    except StoppedUnhealthy:  # this trial only: it ends (TERMINATED in Tune, stopped_unhealthy in its record)
        last = records.read_metrics(run_dir)[-1]  # the iteration the rule fired on
        reporter.unhealthy(last["iteration"], {k: v for k, v in last.items() if k not in records.RESERVED})
        return
    reporter.finish()


class _Reporter:
    """run()'s callback -> one tune.report per training iteration (not 0), with its checkpoint (verl: none).

    Tune needs the sweep metric in every result: its latest value and running best (best_<key>) are carried
    forward, in each checkpoint's metadata so a restored trial keeps them. The `last` iteration is reported by
    `finish`, after run() returned: a scheduler stopping the trial there (ASHA at max_t) finds its record finished.
    """

    def __init__(self, metric: str, mode: str, carry: dict | None = None, last: int | None = None):
        self.metric, self.better = metric, (max if mode == "max" else min)
        self.key = metric.removeprefix("best_")
        self.carry: dict[str, float] = dict(carry or {})
        self.last, self.held = last, None

    def absorb(self, metrics: dict) -> None:
        """Carry the metric's latest value and its running best forward from one iteration's metrics."""
        value = metrics.get(self.key)
        if isinstance(value, (int, float)) and not math.isnan(value):
            self.carry[self.key] = float(value)
            best = self.carry.get("best_" + self.key)
            self.carry["best_" + self.key] = float(value) if best is None else self.better(best, float(value))

    def __call__(self, iteration: int, metrics: dict, checkpoint: Path | None) -> None:
        self.absorb(metrics)
        if iteration == 0:
            return
        result = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        # training_iteration: the run's iteration, also for a trial Tune restarted without its checkpoint
        result.update({k: v for k, v in self.carry.items() if k not in metrics}, iteration=iteration)
        result["training_iteration"] = iteration
        result.setdefault(self.metric, float("nan"))  # never seen yet: NaN passes Tune's metric check
        if iteration == self.last:
            self.held = (iteration, result, checkpoint, dict(self.carry))
        else:
            self._report(iteration, result, checkpoint, self.carry)

    def unhealthy(self, iteration: int, metrics: dict) -> None:
        """A health rule ended the run at `iteration`: report that iteration (no checkpoint, ``health/stopped``
        = 1, which the sweep's progress lines show) instead of any held one; nothing follows."""
        self.last, self.held = None, None
        self(iteration, {**metrics, "health/stopped": 1.0}, None)

    def finish(self) -> None:
        """Report the last iteration, held until run() returned."""
        if self.held is not None:
            self._report(*self.held)
            self.held = None

    @staticmethod
    def _report(iteration: int, result: dict, checkpoint: Path | None, carry: dict) -> None:
        if checkpoint is None:
            tune.report(result)
            return
        ckpt = tune.Checkpoint.from_directory(str(checkpoint))
        ckpt.set_metadata({"iteration": iteration, "name": Path(checkpoint).name, "carry": dict(carry)})
        tune.report(result, checkpoint=ckpt)


def _restore(run_dir: Path, reporter: _Reporter) -> dict | None:
    """Put Tune's checkpoint of this trial back as the run's latest and return the reporter's carried values; None =
    a fresh start (an earlier attempt's record without a checkpoint is removed). A driver killed between two of
    Tune's state saves leaves a state without the trial's newest checkpoints: the run then resumes from its own
    newest (complete before reported) when Tune has none or an older one."""
    ckpt = tune.get_checkpoint()
    meta = ckpt.get_metadata() if ckpt is not None else {}
    own = _own_iteration(run_dir)
    if ckpt is not None and own <= int(meta["iteration"]):
        put_checkpoint(run_dir, int(meta["iteration"]), lambda d: ckpt.to_directory(str(d)))
        return dict(meta.get("carry") or {})
    if own < 0:
        shutil.rmtree(run_dir, ignore_errors=True)
        return None
    for row in records.read_metrics(run_dir):
        if row.get("iteration", own + 1) <= own:
            reporter.absorb(row)
    return dict(reporter.carry)


def _own_iteration(run_dir: Path) -> int:
    """The iteration of the newest checkpoint in a run record's own directory; -1 without one (or no record)."""
    newest = newest_checkpoint(run_dir)
    return newest[0] if newest and (run_dir / records.CONFIG).is_file() else -1


# ---------------------------------------------------------------------------- the driver
class _Progress(tune.Callback):
    """One readable line per trial event, and a status line (counts, best so far) every `every` s."""

    def __init__(self, spec: Spec, every: float = 15.0, sweep_dir: Path | None = None):
        self.spec, self.every, self.sweep_dir = spec, every, sweep_dir
        self.t0 = self.last = time.time()
        self.best: tuple[float, str] | None = None
        self.started: set[str] = set()  # trials this invocation started
        self.ended: set[str] = set()  # ... and saw complete or fail

    def setup(self, **info):
        self.t0 = self.last = time.time()

    def _say(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:6.0f}s] {msg}", file=sys.stdout, flush=True)

    def _status(self, trials, trial=None, status: str = "") -> str:
        """Counts by state (`trial` counted as `status`: callbacks run before Tune updates it)."""
        n = Counter(status if t is trial else t.status for t in trials)
        for t in trials:  # trials restored by --resume report nothing new
            self._consider((t.last_result or {}).get(self.spec.metric), t.config)
        best = f" | best {self.spec.metric}={self.best[0]:.4g} ({self.best[1]})" if self.best else ""
        return (
            f"{self.spec.name}: {n['RUNNING']} running, {n['TERMINATED']} done, {n['ERROR']} failed, "
            f"{n['PENDING'] + n['PAUSED']} waiting{best}"
        )

    def _again(self, run_dir: Path | None) -> str:
        """A restarted trial without a Tune checkpoint resumes from its run's own, if it has one."""
        if self.spec.backend == "verl":
            return " from verl's last checkpoint in its run directory"
        newest = newest_checkpoint(run_dir) if run_dir else None
        return f" from its run's checkpoint {newest[1].name}" if newest else " from scratch"

    def on_trial_start(self, iteration, trials, trial, **info):
        # a run record of the trial: an earlier attempt's, or an earlier driver's (a resumed sweep)
        run_dir = records.find_trial_run(Path(self.sweep_dir) / "runs", trial.trial_id) if self.sweep_dir else None
        ckpt = trial.latest_checkpoint_result
        again = trial.trial_id in self.started or ckpt is not None or run_dir is not None
        self.started.add(trial.trial_id)
        it = ckpt.metrics.get("training_iteration", 0) if ckpt is not None else 0
        if it and self.spec.backend == "local":  # the trial resumes from the newer of Tune's and its run's own
            it = max(it, _own_iteration(run_dir) if run_dir else -1)
        self._say(
            f"{'resume ' if again else 'start  '} {describe(self.spec, trial.config)}  [{trial.trial_id}]"
            + (f" from its checkpoint at iteration {it}" if it else (self._again(run_dir) if again else ""))
        )

    def _consider(self, v, config) -> None:
        """Keep the best value seen; a tie goes to the first configuration in describe order, so the line names
        the same one whatever order the results arrive in (a resumed sweep reads them in another)."""
        if not isinstance(v, (int, float)) or math.isnan(v):
            return
        sign, name = (1 if self.spec.mode == "max" else -1), describe(self.spec, config)
        if self.best is None or (sign * v, self.best[1]) > (sign * self.best[0], name):
            self.best = (float(v), name)

    def on_step_end(self, iteration, trials, **info):
        """The status line; for trials Tune cannot start yet, what one reserves and what each node has free."""
        if time.time() - self.last >= self.every:
            self.last = time.time()
            pending = [t for t in trials if t.status == "PENDING"]
            free = verl_resources.free_per_node() if pending else {}
            wait = waiting_line(self.spec, pending[0].config, free, len(pending)) if pending else ""
            self._say(self._status(trials) + (f"\n          {wait}" if wait else ""))

    def on_trial_complete(self, iteration, trials, trial, **info):
        r = trial.last_result or {}
        v = r.get(self.spec.metric)
        line = f"done    {describe(self.spec, trial.config)}  iteration {r.get('training_iteration', 0)}"
        if isinstance(v, (int, float)):
            line += f"  {self.spec.metric}={v:.4g}"
        if r.get("health/stopped"):
            line += "  STOPPED UNHEALTHY (a health rule fired; its run record says which)"
        self._ended(trials, trial, "TERMINATED", line)

    def on_trial_recover(self, iteration, trials, trial, **info):
        self._say(
            f"retry   {describe(self.spec, trial.config)}  from its last checkpoint (failure {trial.num_failures} of "
            f"max {self.spec.max_failures}): {_error_line(trial)}"
        )

    def on_trial_error(self, iteration, trials, trial, **info):
        line = f"FAILED  {describe(self.spec, trial.config)}  {_error_line(trial)}"
        self._ended(trials, trial, "ERROR", line, f"\n          traceback: {trial.error_file}")

    def _ended(self, trials, trial, state: str, line: str, after: str = "") -> None:
        self.ended.add(trial.trial_id)
        self._say(f"{line}  | {self._status(trials, trial, state)}{after}")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self._consider(result.get(self.spec.metric), trial.config)

    def on_experiment_end(self, trials, **info):
        """The last status line. A trial that started in this invocation and neither completed nor failed was
        stopped by the sweep's interruption (Ctrl-C, SIGTERM): Tune lists it as terminated; it is counted apart."""
        stopped = [t for t in trials if t.trial_id in self.started and t.trial_id not in self.ended]
        line = self._status([t for t in trials if t not in stopped])
        self._say(line.replace(" done,", f" done, {len(stopped)} interrupted,", 1) if stopped else line)


_STAMPS: dict[str, dict[str, float]] = {}  # the driver's stamps of this invocation's trials (_Timeline)


class _Timeline(tune.Callback):
    """The driver's stamps of each trial in ``_STAMPS`` (a resumed sweep's callbacks are unpickled copies):
    `started` (its worker ready), `reported` (its last result), `ended`; sweeps.results.timeline reads them."""

    def on_trial_start(self, iteration, trials, trial, **info):
        _STAMPS[trial.trial_id] = {"started": time.time()}

    def on_trial_result(self, iteration, trials, trial, result, **info):
        _STAMPS.setdefault(trial.trial_id, {})["reported"] = time.time()

    def on_trial_complete(self, iteration, trials, trial, **info):
        _STAMPS.setdefault(trial.trial_id, {})["ended"] = time.time()


def waiting_line(spec: Spec, config: dict, free: dict[str, dict[str, float]], n: int) -> str:
    """`n` trials wait: what the first reserves (its whole verl job, or the spec's resources) and what is free."""
    if spec.backend == "verl":
        need = verl_placement(spec, *decode(spec, config)).describe()
    else:
        need = f"{spec.cpu:g} CPUs and {spec.gpu:g} GPUs"
    return f"{n} trial(s) wait for room: each reserves {need}. Free now: {free_line(free)}"


def _error_line(trial) -> str:
    path = trial.error_file
    if not path or not os.path.exists(path):
        return ""
    lines = [ln.strip() for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:300]


def _init_ray(address: str | None, num_cpus: int | None, sweep_dir: Path | None = None) -> bool:
    """Connect to `address` (after ``_check_address``), or start a local Ray on 127.0.0.1; True if we started it.
    Workers get the numerics pins (experiments.numerics): a local Ray's inherit this environment, a cluster's get
    them as the job's runtime_env."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault(WORKER_NICENESS, "0")  # a local Ray's workers (the trials) at the driver's priority
    if address:
        _check_address(address)
        print(f"connecting to the Ray cluster at --address {address}", flush=True)
        try:
            with _ray_signals(f"while connecting to the Ray cluster at --address {address}", sweep_dir):
                ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": numerics.env()})
        except Exception as e:  # a refused token, no Ray there (ConnectionError), another Ray version (RuntimeError)
            if is_ray_auth_error(e):
                raise UserError(ray_auth_line(f"--address {address}", "driver")) from None
            if not isinstance(e, (ConnectionError, RuntimeError)):
                raise
            line = (str(e).strip() or type(e).__name__).splitlines()[0]
            raise UserError(f"--address {address}: cannot join the Ray cluster there: {line}") from None
        return True
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # else Ray may pick a non-loopback interface
    with _ray_signals("while starting a local Ray", sweep_dir):
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
        )
    return True


def _check_address(address: str) -> None:
    """A bounded check that something answers at `address` (ray.init retries an address where nothing listens for
    minutes); "auto" is checked as the RAY_ADDRESS it reads, if set, ray://HOST:PORT as HOST:PORT."""
    target = os.environ.get("RAY_ADDRESS") if address == "auto" else address
    if not target or target in ("auto", "local"):
        return
    try:
        host, port = parse_address(target.split("://", 1)[-1])
    except UserError:
        raise UserError(
            f"--address {address}: expected HOST:PORT (the Ray head's GCS address, e.g. 10.0.0.1:6379), "
            "ray://HOST:PORT or auto"
        ) from None
    answers(host, port, f"--address {address}")


def _check_fits(spec: Spec) -> None:
    """A local Ray never grows: a trial asking for more than the machine has would wait forever (the caller shuts
    Ray down)."""
    have = ray.cluster_resources()
    if spec.backend == "verl":
        p = _first_placement(spec)
        if p.cpus > have.get("CPU", 0) or p.gpus > have.get("GPU", 0):
            raise ValueError(
                f"a verl trial reserves {p.describe()}, but this machine's Ray has {have.get('CPU', 0):g} CPUs and "
                f"{have.get('GPU', 0):g} GPUs; pass --address of a Ray cluster that holds it"
            )
        return
    for name, need in (("CPU", spec.cpu), ("GPU", spec.gpu)):
        if need > have.get(name, 0):
            raise ValueError(
                f"resources.{name.lower()}={need:g} per trial, but this machine's Ray has "
                f"{have.get(name, 0):g} {name}s; lower it, or pass --address of a larger cluster"
            )


def _search_alg(spec: Spec):
    if spec.search in ("grid", "random"):  # constant_grid_search: one random draw shared by all seeds
        return BasicVariantGenerator(
            max_concurrent=spec.max_concurrent or 0, random_state=spec.search_seed, constant_grid_search=True
        )
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    searcher = OptunaSearch(sampler=optuna.samplers.TPESampler(seed=spec.search_seed))
    if len(spec.seed_axis) > 1:  # each suggestion runs once per seed; Optuna sees the mean over seeds
        searcher = Repeater(searcher, repeat=len(spec.seed_axis), set_index=True)
    return ConcurrencyLimiter(searcher, max_concurrent=spec.max_concurrent) if spec.max_concurrent else searcher


def _scheduler(spec: Spec):
    s = spec.scheduler
    if s.type != "asha":
        return FIFOScheduler()
    return AsyncHyperBandScheduler(
        time_attr=s.time_attr, max_t=s.max_t or 100, grace_period=s.grace_period, reduction_factor=s.reduction_factor
    )


def _tune_config(spec: Spec) -> tune.TuneConfig:
    repeats = len(spec.seed_axis) if spec.search == "optuna" else 1  # Repeater: one Tune trial per seed
    return tune.TuneConfig(
        metric=spec.metric,
        mode=spec.mode,
        search_alg=_search_alg(spec),
        scheduler=_scheduler(spec),
        num_samples=spec.num_samples * repeats,
        time_budget_s=spec.time_budget_s,
        reuse_actors=spec.backend == "local",  # one Ray worker per slot runs trial after trial: imports, once
    )


# Ray starts its workers at nice 15 by default: beside two busy processes per core a trial then gets a few percent
# of a CPU (a rehearsal's verl start-up took 35 minutes instead of 3). The raylet of a Ray emapg starts reads this.
WORKER_NICENESS = "RAY_worker_niceness"

DRIVER_BUSY = "wait for it to end, or pass --out <another dir>"


def run_sweep(
    spec: Spec,
    sweep_dir: str | Path | None = None,
    *,
    resume: bool = False,
    address: str | None = None,
    num_cpus: int | None = None,
    progress: bool = True,
    report: bool = True,
) -> Path:
    """Run (or with resume=True finish) the sweep; returns its directory. `num_cpus` sizes a local Ray (default: all
    cores). The directory is checked before anything is written to it, and again once held (a driver may have
    started a sweep there since). SIGTERM / SIGINT end the driver at any point with RunInterrupted."""
    sweep_dir = Path(sweep_dir or Path("outputs") / "sweeps" / spec.name).resolve()
    _check_out(spec, sweep_dir, resume)  # before the owner lock writes into it
    _PHASE[0] = BEFORE_TUNE
    with _handling(_OWN_HANDLERS):
        try:
            with owner.held(sweep_dir, "sweep driver", DRIVER_BUSY) as killed:  # one driver per directory
                _check_out(spec, sweep_dir, resume)
                if not resume:
                    records.atomic_write(sweep_dir / "sweep.yaml", yaml.safe_dump(spec.raw, sort_keys=False))
                killed_s = owner.killed_wall_s(killed) if resume and killed else None
                how = dict(resume=resume, address=address, num_cpus=num_cpus, progress=progress, report=report)
                if spec.adaptive is not None:
                    return run_adaptive(spec, sweep_dir, **how, killed_s=killed_s)
                return _run_tune(spec, sweep_dir, **how, killed_s=killed_s)
        except (Terminated, KeyboardInterrupt) as e:  # outside Tune's run: before it, or after it returned
            raise _interrupted(sweep_dir, "SIGINT" if isinstance(e, KeyboardInterrupt) else "SIGTERM") from None


@contextlib.contextmanager
def _sweep_ray(spec: Spec, address: str | None, num_cpus: int | None, sweep_dir: Path):
    """Ray for the sweep (shut down after if started here), the warm start built and Tune's environment set;
    yields the trials that can run at once (``_slots``)."""
    started = _init_ray(address, num_cpus, sweep_dir)
    try:
        if started and not address:
            _check_fits(spec)
        _warm_start(spec)
        os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", STATE_PERIOD_S)
        # num_to_keep forces a state snapshot whenever a trial has replaced its checkpoints (cheap, and what
        # keeps --resume exact); Tune warns about that on every fast iteration unless told not to.
        os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
        # Tune's legacy reporter is silent at verbose=0: _Progress reports instead
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
        yield _slots(spec)
    finally:
        if started:
            _shutdown_ray()


def _shutdown_ray() -> None:
    """ray.shutdown(), then SIGTERM's handler set again: the shutdown puts SIGTERM back to the OS default beneath
    Python, which still reports its handler, so a SIGTERM in the report or the W&B summary run killed the driver
    without its interrupted line, its lock left for the next --resume to count as a killed driver's."""
    ray.shutdown()
    handler = signal.getsignal(signal.SIGTERM)
    if handler is not None and _main_thread():
        signal.signal(signal.SIGTERM, handler)


def _run_tune(spec, sweep_dir, *, resume, address, num_cpus, progress, report, killed_s) -> Path:
    """run_sweep without adaptive seeds: one Tune experiment (the directory's lock held by the caller)."""
    exp_path = sweep_dir / "tune" / spec.name
    if resume and not _restorable(exp_path):  # stopped before Tune saved anything: nothing ran, the spec is the same
        _afresh(spec, exp_path)
    with _sweep_ray(spec, address, num_cpus, sweep_dir) as slots:
        _STAMPS.clear()
        t0 = time.time()
        stopped_by = _fit(spec, sweep_dir, exp_path, progress)
        wall = time.time() - t0
        _PHASE[0] = AFTER_TUNE
        trials = _trials(exp_path)
        known = _known(spec, trials)
        _settle(sweep_dir, known)
        if resume:
            _set_aside_orphans(sweep_dir, {t.trial_id for t in known})
        if not stopped_by:  # Tune ran to its end: a trial it never created was left out by the time budget
            known += _never_created(spec, known)
        rows = results.write_csv(sweep_dir, spec.metric, spec.mode, known)
    timeline = results.timeline(sweep_dir, rows, _STAMPS, start=t0, end=t0 + wall, slots=slots)
    results.write_timing(
        sweep_dir, spec.name, rows, wall, slots, progress=progress, resumed=resume, killed_s=killed_s, timeline=timeline
    )
    if stopped_by:
        raise _interrupted(sweep_dir, stopped_by[0], sum(r["status"] in _UNFINISHED for r in rows))
    unfinished = sum(t.status in ("RUNNING", "PENDING", "PAUSED") for t in trials)  # stopped without a signal (SIGUSR1)
    if unfinished:
        resume_with = sweep_resume_command(sweep_dir)
        print(f"{spec.name}: {unfinished} trial(s) not finished; continue with: {resume_with}", flush=True)
    if hint := _not_run_hint(spec, rows):
        print(hint, flush=True)
    if report and not unfinished and any(r["run_id"] for r in rows):  # a report of what ran
        _report(spec, sweep_dir, progress)
    return sweep_dir


_UNFINISHED = ("interrupted", "crashed", "pending", "paused")  # sweep.csv statuses that --resume continues
BEFORE_TUNE, AFTER_TUNE = "before Tune started the trials", "after Tune ended (sweep.csv may be stale)"
_PHASE = [BEFORE_TUNE]  # where the driver is outside Tune's run, for the interrupted line


def _interrupted(
    sweep_dir: Path | None, signame: str, unfinished: int | None = None, where: str | None = None
) -> RunInterrupted:
    """The RunInterrupted that ends the driver after SIGTERM/SIGINT: where the driver was (``_PHASE`` by default) or
    how many trials Tune's run left unfinished, and the command that resumes once sweep.yaml is written."""
    if sweep_dir is None or not (sweep_dir / "sweep.yaml").is_file():
        return RunInterrupted(f"interrupted ({signame}) before the sweep started: nothing was run", signame)
    what = f" {where or _PHASE[0]}" if unfinished is None else f": {unfinished} trial(s) not finished"
    resume = f"resume with: {sweep_resume_command(sweep_dir)}"
    return RunInterrupted(f"interrupted ({signame}){what}\n{resume}", signame, sweep_dir)


# How often Tune saves its experiment state (TUNE_GLOBAL_CHECKPOINT_S; Tune's "auto" waits 10 s or more). A trial
# started after the last save is unknown to a driver resumed after a kill: it runs again under a new trial id, and
# the killed attempt's run directory moves to orphaned/ (_set_aside_orphans).
STATE_PERIOD_S = "2"


def _slots(spec: Spec) -> int:
    """Trials that can run at once: the cluster's CPUs (verl: GPUs) / a trial's, at most max_concurrent, at least 1."""
    have = ray.cluster_resources()
    if spec.backend == "verl":
        p = _first_placement(spec)
        fit = int(have.get("GPU", 0) // p.gpus) if p.gpus else 1
    else:
        fit = int(have.get("CPU", 1) // spec.cpu)
    return max(1, min(spec.max_concurrent or 10**6, fit))


def verl_placement(spec: Spec, point: dict, seed: int | None):
    """What a verl trial of (point, seed) reserves (``experiments.backends.verl.resources.TrialPlacement``), from its
    composed config; cached, since Tune asks once per trial."""
    return _placement(tuple(spec.overrides_for(point, seed)))


@functools.lru_cache(maxsize=64)
def _placement(overrides: tuple[str, ...]):
    cfg = build.compose(list(overrides))
    return placement_for(OmegaConf.to_container(cfg, resolve=True))


def _first_placement(spec: Spec):
    """What the sweep's first verl trial reserves (sizes the slots and the local-Ray check)."""
    return verl_placement(spec, grid_points(spec)[0], spec.seed_axis[0])


def _verl_resources(spec: Spec, config: dict) -> tune.PlacementGroupFactory:
    """Tune's resources of a verl trial: one placement group for its whole verl job (``verl_placement``)."""
    p = verl_placement(spec, *decode(spec, config))
    return tune.PlacementGroupFactory([dict(b) for b in p.bundles], strategy=p.strategy)


def sweep_resume_command(sweep_dir: Path) -> str:
    """The command that finishes the sweep in `sweep_dir`: its own copy of the spec (sweep.yaml, what --resume
    compares against) and the same directory, quoted for the shell."""
    return shlex.join(["emapg", "sweep", str(sweep_dir / "sweep.yaml"), "--resume", "--out", str(sweep_dir)])


# ---------------------------------------------------------------------------- signals
# SIGTERM and SIGINT end the driver at any point with the interrupted line and exit 143 / 130, never with Ray's own
# exit: outside Tune's run they unwind it (``_OWN_HANDLERS``), while ray.init blocks they end it from a thread
# (``_ray_signals``), during Tune's run they stop Tune first (``_signals_stop_tune``). Only the main thread can set
# a handler: elsewhere (a driver run in a thread) the caller's handling stands.
RAY_GRACE_S = 2.0  # after a signal while ray.init runs: how long it has to return (the driver then unwinds)
# SIGTERM raises Terminated, SIGINT KeyboardInterrupt: the driver unwinds to RunInterrupted (``run_sweep``)
_OWN_HANDLERS = {signal.SIGTERM: raise_terminated, signal.SIGINT: signal.default_int_handler}


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _handling(handlers: dict):
    """Set `handlers` ({signal: handler}) for the block, the previous ones after it (main thread only)."""
    if not _main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in handlers}
    for s, handler in handlers.items():
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _ray_signals(what: str, sweep_dir: Path | None):
    """Around ray.init, which can block for minutes in Ray's C++ code (no Python handler runs) and sets Ray's own
    SIGTERM handler (``sys.exit(15)``): a thread that sees SIGTERM/SIGINT through Python's wakeup fd ends the
    driver unless ray.init returns within RAY_GRACE_S. Ray's ``SystemExit(15)`` becomes Terminated, and the
    driver's own handlers are put back after it."""
    if not _main_thread():
        yield
        return
    reader, writer = socket.socketpair()
    reader.settimeout(0.2)
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    returned = threading.Event()

    def watch() -> None:
        while not returned.is_set():
            try:
                got = [b for b in reader.recv(64) if b in (signal.SIGTERM, signal.SIGINT)]
            except OSError:  # TimeoutError: no signal within 0.2 s
                continue
            if got and not returned.wait(RAY_GRACE_S):
                name = signal.Signals(got[0]).name
                sys.stdout.flush()
                print(bounded(f"emapg sweep: {_interrupted(sweep_dir, name, where=what)}"), file=sys.stderr, flush=True)
                os._exit(exit_code_of_signal(name))  # ray.init holds the main thread: no unwinding is possible

    watcher = threading.Thread(target=watch, name="emapg-sweep-signals", daemon=True)
    watcher.start()
    try:
        yield
    except SystemExit as e:  # Ray's SIGTERM handler, set by ray.init: the driver's interruption instead
        if e.code != signal.SIGTERM:
            raise
        raise Terminated("SIGTERM") from None
    finally:
        returned.set()
        watcher.join()
        signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()
        for s, handler in _OWN_HANDLERS.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _signals_stop_tune():
    """Around Tuner.fit: the first SIGTERM or SIGINT stops Tune as Ctrl-C does (trials stopped, state saved);
    yields the signals received. A second signal, or one before Tune set its handler, unwinds at once. Tune's
    handler is reached through SIGUSR1; its SIGINT handler is off, so the driver knows which signal it was."""
    got: list[str] = []

    def stop(signum, frame) -> None:
        name = signal.Signals(signum).name
        got.append(name)
        tunes = signal.getsignal(signal.SIGUSR1)
        if len(got) > 1 or not callable(tunes):  # a second signal, or Tune's run not started yet
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise Terminated(name)
        print(f"emapg sweep: {name}: stopping the trials and saving the sweep's state", file=sys.stderr, flush=True)
        tunes(signal.SIGUSR1, frame)

    env = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
    try:  # SIGUSR1: the default until Tune sets its own
        with _handling({signal.SIGUSR1: signal.SIG_DFL, signal.SIGTERM: stop, signal.SIGINT: stop}):
            yield got
    finally:
        if env is None:
            os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
        else:
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = env


# ---------------------------------------------------------------------------- adaptive seeds, in rounds
def run_adaptive(spec: Spec, sweep_dir: Path, *, resume, address, num_cpus, progress, report, killed_s) -> Path:
    """Adaptive seeds (sweeps.adaptive): one Tune experiment per round (<sweep_dir>/tune/round_<r>/<name>), each
    round planned in adaptive.jsonl before it starts and decided there after it ends; --resume continues the
    round the sweep was in (its Tune experiment restored), then plans the rest. sweep.csv holds every round."""
    if resume and not (sweep_dir / adaptive.FILE).is_file():  # stopped before its first round was planned
        _afresh(spec, sweep_dir / "tune")
    wall, rows, stopped_by, undecided = 0.0, [], [], None
    with _sweep_ray(spec, address, num_cpus, sweep_dir) as slots:
        while True:
            rnd, planned = _round_to_run(spec, sweep_dir, adaptive.read_events(sweep_dir))
            if planned is None:
                break
            t0 = time.time()
            _PHASE[0] = BEFORE_TUNE
            if progress:
                print(f"{spec.name}: adaptive seeds, round {rnd}: {len(planned)} trial(s)", flush=True)
            stopped_by = _fit(_round_spec(spec, planned), sweep_dir, _round_path(sweep_dir, spec, rnd), progress)
            _PHASE[0] = AFTER_TUNE
            wall += time.time() - t0
            known = _adaptive_trials(spec, sweep_dir, None if not stopped_by else rnd)
            _settle(sweep_dir, known)
            rows = results.write_csv(sweep_dir, spec.metric, spec.mode, known)
            if stopped_by or any(r["status"] not in _ROUND_ENDED for r in rows):
                undecided = rnd
                break
            if _decide_round(spec, sweep_dir, rnd, rows):
                break
    if undecided is None:  # every round decided: sweep.csv of them all (written above unless none ran here)
        rows = rows or results.write_csv(sweep_dir, spec.metric, spec.mode, _adaptive_trials(spec, sweep_dir))
    results.write_timing(sweep_dir, spec.name, rows, wall, slots, progress=progress, resumed=resume, killed_s=killed_s)
    if stopped_by:
        raise _interrupted(sweep_dir, stopped_by[0], sum(r["status"] in _UNFINISHED for r in rows))
    if undecided is not None:
        hint = _not_run_hint(spec, rows)
        print(
            f"{hint}\n{spec.name}: round {rnd} cannot be decided without them"
            if hint
            else f"{spec.name}: round {rnd} did not finish; continue with: {sweep_resume_command(sweep_dir)}",
            flush=True,
        )
    elif report:
        _report(spec, sweep_dir, progress)
    return sweep_dir


def _round_path(sweep_dir: Path, spec: Spec, rnd: int) -> Path:
    return sweep_dir / "tune" / f"round_{rnd}" / spec.name


def _round_to_run(spec: Spec, sweep_dir: Path, events: list[dict]) -> tuple[int, list[dict] | None]:
    """(round, its trials): the planned round not yet decided, or the next one (planned and recorded here);
    (round, None) when the last decision asked for no more trials."""
    last = events[-1] if events else None
    if last is None:
        rnd, planned = 0, adaptive.first_round(spec)
    elif last["event"] == "plan":
        return last["round"], last["trials"]
    else:
        rnd, planned = last["round"] + 1, adaptive.next_round(spec, last["comparisons"], adaptive.seeds_planned(events))
    if not planned:
        return rnd, None
    adaptive.write_event(sweep_dir, {"event": "plan", "round": rnd, "trials": planned})
    return rnd, planned


def _round_spec(spec: Spec, planned: list[dict]) -> Spec:
    """The spec of one round: a single joint grid entry over the point keys and `seed`, one value per trial."""
    keys = tuple(dict.fromkeys(k for t in planned for k in t["point"]))
    values = tuple(tuple(t["point"][k] for k in keys) + (t["seed"],) for t in planned)
    return replace(spec, space=(Param((*keys, "seed"), "grid", values),), seeds=(0,), adaptive=None)


def _adaptive_trials(spec: Spec, sweep_dir: Path, interrupted: int | None = None) -> list[results.Trial]:
    """What Tune knows of every trial of every round so far, rounds in order, the seed back in its column (and the
    trials the time budget left Tune no time to create, except in round `interrupted`, which --resume continues)."""
    out = []
    for e in adaptive.read_events(sweep_dir):
        exp_path = _round_path(sweep_dir, spec, e["round"])
        if e["event"] != "plan" or not _restorable(exp_path):
            continue
        round_spec = _round_spec(spec, e["trials"])
        known = _known(round_spec, _trials(exp_path))
        if e["round"] != interrupted:
            known += _never_created(round_spec, known)
        for t in known:
            point = {k: v for k, v in t.point.items() if k != "seed"}
            out.append(replace(t, point=point, seed=t.point["seed"]))
    return out


def _decide_round(spec: Spec, sweep_dir: Path, rnd: int, rows: list[dict]) -> bool:
    """Decide every comparison after round `rnd`, record and print it; True when no trial is left to run."""
    seeds_of = adaptive.seeds_planned(adaptive.read_events(sweep_dir))  # every round planned so far
    decided = adaptive.decide(spec, rows, seeds_of)
    n_next = len(adaptive.next_round(spec, decided, seeds_of))
    adaptive.write_event(sweep_dir, {"event": "decide", "round": rnd, "comparisons": decided, "next_trials": n_next})
    print(adaptive.decision_lines(spec, rnd, decided, n_next), flush=True)
    return n_next == 0


# ---------------------------------------------------------------------------- Tune's state files
COMPLETE = ".complete"  # suffix of the last complete copy of a Tune state file (_StateBackup)


def _is_complete(data: bytes) -> bool:
    """A whole JSON document or a whole pickle (checked without building its objects)."""
    try:
        if data.lstrip().startswith(b"{"):
            json.loads(data)
        else:
            pickletools.dis(data, out=io.StringIO())
        return bool(data)
    except Exception:  # noqa: BLE001  truncated or garbled in any way
        return False


class _StateBackup(tune.Callback):
    """After every controller step, copy each changed Tune state file that reads whole to ``<name>.complete``
    (write + rename). Tune rewrites them in place: a driver killed mid-write leaves a truncated file, from which
    ``Tuner.restore`` starts over with trials that have no config; ``_repair_state`` puts the copy back."""

    def __init__(self, exp_path: str):
        self.exp_path = exp_path
        self._seen: dict[str, int] = {}

    def on_step_end(self, iteration: int, trials: list, **info) -> None:
        # Tune's per-session state files: experiment_state-*.json (JSON), the searcher's and callbacks' (pickles)
        for path in sorted(Path(self.exp_path).glob("*state*")):
            if not path.is_file() or path.name.endswith((COMPLETE, ".tmp")):
                continue
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
        print(
            f"{path.name} was cut short (the driver was killed while Tune wrote it); resuming from its last "
            "complete copy: a trial may continue from a checkpoint one step older",
            flush=True,
        )
    return replaced


@contextlib.contextmanager
def _quiet():
    """Silence Tune's tracebacks of failed trials (_Progress names their error files), its warnings about trials
    without results, and its ``Tuner.restore`` hint (the sweep prints its own --resume line)."""
    loggers = [
        logging.getLogger(f"ray.tune.{n}") for n in ("execution.tune_controller", "analysis.experiment_analysis")
    ]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    tune_log = logging.getLogger("ray.tune.tune")
    tune_log.addFilter(_not_tuners_resume_hint)
    try:
        yield
    finally:
        tune_log.removeFilter(_not_tuners_resume_hint)
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _not_tuners_resume_hint(record: logging.LogRecord) -> bool:  # "... Resume experiment with: Tuner.restore(...)"
    return "Tuner.restore(" not in record.getMessage()


def _warm_start(spec: Spec) -> None:
    """Build each tiny model's cached warm start once, here, instead of in every concurrent trial."""
    if spec.backend != "local":
        return
    seen = set()
    for point in grid_points(spec):
        cfg = build.compose(spec.overrides_for(point, spec.seed_axis[0]))
        m = cfg.model
        key = (cfg.task.name, m.hidden, m.layers, m.heads, m.pretrain_steps, m.cache_dir, cfg.trainer.threads)
        if m.path is None and key not in seen:
            seen.add(key)
            print(f"warm start of the tiny {cfg.task.name} model (built once, cached in {m.cache_dir})", flush=True)
            torch.set_num_threads(int(cfg.trainer.threads))  # the trials': the thread count is in its provenance
            build.model(cfg)


# what a sweep writes into its directory (besides its owner lock): their presence marks an emapg sweep
SWEEP_ENTRIES = ("sweep.yaml", "sweep.csv", "timing.json", "tune", "runs", adaptive.FILE, "report", "orphaned")
_OWN_FILES = (owner.FILE, "driver.lock")  # the owner lock (and the one the sweeps wrote before experiments.owner)


def _check_out(spec: Spec, sweep_dir: Path, resume: bool) -> None:
    """Refuse a --out that is not this sweep's (ValueError naming what is there and what to do): a new sweep needs a
    new or empty directory (its owner lock aside), --resume this sweep's sweep.yaml, readable and the same spec."""
    if sweep_dir.exists() and not sweep_dir.is_dir():
        raise ValueError(f"--out {sweep_dir} is a file, not a directory; pass a new or empty directory")
    # what is there besides its owner lock and the temporary files of an interrupted atomic write (.<name>.*.tmp)
    there = sorted(
        p.name
        for p in (sweep_dir.iterdir() if sweep_dir.is_dir() else ())
        if p.name not in _OWN_FILES and not (p.name.startswith(".") and p.name.endswith(".tmp"))
    )
    stored, unreadable = None, None
    if "sweep.yaml" in there:
        try:
            stored = read_raw(sweep_dir / "sweep.yaml")
        except SpecError as e:  # empty or torn (written by a version without atomic writes), or edited
            unreadable = str(e)
    if not resume:
        if there:
            raise ValueError(_occupied(spec, sweep_dir, there, stored, unreadable))
        return
    if unreadable:
        raise ValueError(
            f"--resume: {unreadable}; this copy of the spec the sweep started with cannot be compared with the spec "
            "given: put the original spec there, or pass another --out"
        )
    if stored is None:
        held = f" (it holds {_listed(there)})" if there else ""
        raise ValueError(
            f"--resume: {sweep_dir} holds no sweep to resume (no sweep.yaml){held}; start a new sweep without --resume"
        )
    if stored != spec.raw:
        changed = sorted(k for k in set(stored) | set(spec.raw) if stored.get(k) != spec.raw.get(k))
        raise ValueError(
            f"--resume: the spec differs from the one {sweep_dir} was started with (keys: "
            f"{', '.join(map(str, changed))}); resume with the original spec ({sweep_dir / 'sweep.yaml'}), or start "
            "a new sweep with another --out"
        )


def _occupied(spec: Spec, sweep_dir: Path, there: list[str], stored: dict | None, unreadable: str | None) -> str:
    """Why a new sweep may not start in `sweep_dir`, which holds `there`."""
    if stored == spec.raw:
        return f"{sweep_dir} already holds sweep {spec.name!r}; finish it with --resume, or pass --out <new dir>"
    if stored is not None:
        return (
            f"--out {sweep_dir} already holds sweep {shown(stored.get('name'))}, started with another spec; pass "
            f"another --out (that sweep continues with: {sweep_resume_command(sweep_dir)})"
        )
    if unreadable:
        return (
            f"--out {sweep_dir} already holds a sweep whose spec copy is unreadable ({unreadable}); pass another --out"
        )
    if records.holds_run(sweep_dir):
        return (
            f"--out {sweep_dir} holds a run record ({_listed(there)}: emapg train's), not a sweep; pass another --out"
        )
    ours = [n for n in there if n in SWEEP_ENTRIES]
    if ours:
        return f"--out {sweep_dir} holds a sweep's files ({_listed(ours)}) but no sweep.yaml; pass another --out"
    return (
        f"--out {sweep_dir} is not empty and holds no emapg sweep (it holds {_listed(there)}); pass a new or "
        "empty directory"
    )


def _listed(names: list[str], most: int = 5) -> str:
    more = f", ... ({len(names) - most} more)" if len(names) > most else ""
    return ", ".join(shown(n, 60).strip("'\"") for n in names[:most]) + more


def _fit(spec: Spec, sweep_dir: Path, exp_path: Path, progress: bool) -> list[str]:
    """Run one Tune experiment, or restore it from ``exp_path`` (its state repaired first) if Tune saved it there;
    returns the signals that stopped it ([]: none, ``_signals_stop_tune``)."""
    resources = {"cpu": spec.cpu, "gpu": spec.gpu}
    if spec.backend == "verl":  # the whole verl job, one placement group per trial
        resources = functools.partial(_verl_resources, spec)
    fn = tune.with_resources(tune.with_parameters(_trial, spec=spec, sweep_dir=str(sweep_dir)), resources)
    if _restorable(exp_path):
        _repair_state(exp_path)
        tuner = tune.Tuner.restore(str(exp_path), trainable=fn, resume_errored=True)
    else:
        shutil.rmtree(exp_path, ignore_errors=True)  # what a driver stopped before Tune saved its state left
        tuner = tune.Tuner(
            fn,
            param_space=param_space(spec),
            tune_config=_tune_config(spec),
            run_config=tune.RunConfig(
                name=spec.name,
                storage_path=str(exp_path.parent),
                verbose=0,
                log_to_file=True,
                failure_config=tune.FailureConfig(max_failures=spec.max_failures),
                checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
                callbacks=[_StateBackup(str(exp_path)), _Timeline()]
                + ([_Progress(spec, sweep_dir=sweep_dir)] if progress else []),
            ),
        )
    with _quiet(), _signals_stop_tune() as stopped_by:
        tuner.fit()
    return stopped_by


def _trials(exp_path: Path) -> list:
    with _quiet():
        return tune.ExperimentAnalysis(str(exp_path)).trials


def _restorable(exp_path: Path) -> bool:
    """Tune saved this experiment's state (its tuner.pkl and an experiment state): Tuner.restore can continue it."""
    return tune.Tuner.can_restore(str(exp_path)) and any(exp_path.glob("experiment_state-*.json*"))


def _afresh(spec: Spec, exp_path: Path) -> None:
    """--resume of a sweep stopped before Tune saved its state (in the warm start, while Ray started): nothing ran and
    its sweep.yaml is this spec, so it starts from the beginning (what Tune left there, unrestorable, goes)."""
    print(f"{spec.name}: the sweep was stopped before Tune saved its state; starting it from the beginning", flush=True)
    shutil.rmtree(exp_path, ignore_errors=True)


# ---------------------------------------------------------------------------- after the sweep
def _set_aside_orphans(sweep_dir: Path, trial_ids: set[str]) -> list[Path]:
    """Move the run directories of trials the resumed Tune does not know (started by a killed driver after Tune's
    last state save, their points run again as new trials) to <sweep_dir>/orphaned/; returns the new paths."""
    moved = []
    for run_dir in sorted(p for p in (sweep_dir / "runs").glob("*__*") if p.is_dir()):
        if run_dir.name.rsplit("__", 1)[-1] not in trial_ids:
            dest = sweep_dir / "orphaned" / run_dir.name
            dest.parent.mkdir(exist_ok=True)
            os.replace(run_dir, dest)
            moved.append(dest)
            print(
                f"{run_dir.name}: started by the killed driver after Tune last saved its state; its point ran again "
                f"as a new trial, and this partial record is kept in {dest.parent}",
                flush=True,
            )
    return moved


def _known(spec: Spec, trials) -> list[results.Trial]:
    """What Tune knows of each trial, in launch order, with the time budget's line for a trial it may have cut short:
    a budget that runs out leaves every live trial TERMINATED with its last result not done (a scheduler's stop
    marks it done; a trial whose function returned is not done either, and results.status reads its record)."""
    out = []
    for t in sorted(trials, key=_launch_index):
        last = t.last_result or {}
        it = last.get("training_iteration", 0)
        cut = _budget_line(spec, it) if spec.time_budget_s and t.status == "TERMINATED" and not last.get("done") else ""
        error = _error_line(t) if t.status == "ERROR" else ""
        out.append(results.Trial(t.trial_id, t.status, *decode(spec, t.config), iterations=it, error=error, cut=cut))
    return out


def _budget_line(spec: Spec, iteration: int | None) -> str:
    """Why a trial did not run (sweep.csv's error column): the time budget, and how far the trial got."""
    budget = f"budget.time_budget_s={spec.time_budget_s:g}"
    if iteration:
        return f"not run to its end: the time budget ({budget}) ran out at iteration {iteration}"
    return f"not run: the time budget ({budget}) ran out before it started"


def _never_created(spec: Spec, known: list[results.Trial]) -> list[results.Trial]:
    """The trials of the spec Tune never created (its time budget ran out first), as not-run rows in launch order:
    each grid point and seed beyond the trials Tune knows there (a sampled key has no value)."""
    if not spec.time_budget_s or len(known) >= spec.num_trials:
        return []
    grid = [k for p in spec.space if p.kind == "grid" for k in p.keys]
    with_seed = spec.seed_axis != (None,)

    def where(point: dict, seed) -> str:
        return json.dumps([point.get(k) for k in grid] + [seed], sort_keys=True, default=str)

    have = Counter(where(t.point, t.seed) for t in known)
    out = []
    for row in spec_trials(spec):
        point, seed = {k: row[k] for k in grid}, row.get("seed") if with_seed else None
        key = where(point, seed)
        if have[key]:
            have[key] -= 1
            continue
        out.append(results.Trial("", "TERMINATED", point, seed, cut=_budget_line(spec, None)))
    return out


def _not_run_hint(spec: Spec, rows: list[dict]) -> str | None:
    """The line that says the time budget left trials not run, and that --resume does not run them; None if none."""
    n = sum(r["status"] == results.NOT_RUN for r in rows)
    if not n:
        return None
    return (
        f"{spec.name}: {n} of {len(rows)} trial(s) not run: the time budget (budget.time_budget_s="
        f"{spec.time_budget_s or 0:g}) ran out; --resume does not run them: raise the budget and start the sweep "
        "again with another --out"
    )


def _settle(sweep_dir: Path, trials: list[results.Trial], timeout_s: float = SETTLE_S) -> None:
    """Wait (at most timeout_s) for the run records of trials Tune stopped mid-run to record how they ended: an
    interrupted Tune returns once it asked the trials to stop, while they may still be writing their records."""
    runs = sweep_dir / "runs"
    stopped = [records.find_trial_run(runs, t.trial_id) for t in trials if t.state in ("RUNNING", "PENDING", "PAUSED")]
    open_ = [d for d in stopped if d is not None]
    deadline = time.monotonic() + timeout_s
    while open_ and time.monotonic() < deadline:
        open_ = [d for d in open_ if records.read_state(d) == "running"]
        if open_:
            time.sleep(0.2)


def _launch_index(trial) -> float:
    """Tune's trial counter: its experiment tag starts with it ("3_algo.anchor.tau=0.9,...")."""
    head = str(getattr(trial, "experiment_tag", "")).split("_", 1)[0]
    return int(head) if head.isdigit() else math.inf


def _report(spec: Spec, sweep_dir: Path, progress: bool) -> None:
    """The report, then the sweep-summary W&B run and dashboard (analysis.dashboard.after_sweep). The sweep's results
    stand whatever fails here: a failure is one line with the command that retries it."""
    command = f"emapg report {sweep_dir} --out {sweep_dir / 'report'}"
    try:
        from analysis.report import report  # loads pandas, matplotlib
    except ImportError as e:
        print(f"report skipped (analysis not importable: {e}); later: {command}")
    else:
        try:
            paths = report(sweep_dir, sweep_dir / "report")
        except Exception as e:
            print(f"report failed: {type(e).__name__}: {e}; retry with: {command}")
        else:
            if progress:
                index = [p for p in paths if Path(p).name == "index.md"]
                print(f"  report: {index[0] if index else sweep_dir / 'report'}", flush=True)
    try:
        after_sweep(sweep_dir, SweepInfo.from_spec(spec), say=lambda text: print(text, flush=True))
    except Exception as e:
        print(f"W&B dashboard skipped: {type(e).__name__}: {e}; retry with: emapg dashboard {sweep_dir}", flush=True)
