"""The run record on disk: the contract between training and analysis (docs/run-record.md).

    with RunRecord.create(run_dir, cfg, resume=False) as rec:  # config.yaml, status=running
        rec.rewind(ckpt_iteration)          # resuming only: drop lines after the checkpoint
        rec.log_evals(rows)                 # per-problem lines of evals.jsonl
        row = rec.log(iteration, metrics)   # one line of metrics.jsonl (+ iteration, time_s)
        rec.finish({"extra": 1.0})          # summary.json, then status=finished
        # or rec.stop_unhealthy(breach.to_dict()): a health rule fired (status=stopped_unhealthy)
    # Ctrl-C / SIGTERM inside the block -> status=interrupted; any other exception -> status=failed
    # with the traceback; either is re-raised. read_state(run_dir) also tells `crashed`: a record left
    # `running` by a process that is gone (its pid, or a heartbeat older than STALE_S).

Whole files are replaced atomically and JSONL lines appended with fsync: a crash loses at most the line being
written, which readers drop (docs/run-record.md). torch is never imported here (`jsonable` reads scalars through
`.item()`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments import owner
from experiments.errors import RecordWriteError, RunInterrupted, Terminated, UserError

CONFIG, METRICS, EVALS, SUMMARY, STATUS = "config.yaml", "metrics.jsonl", "evals.jsonl", "summary.json", "status"
RESUMES = "resumes.jsonl"  # one line per resume: config changes, forced or not, the checkpoint used, those skipped
STAGES = "stages.jsonl"  # a staged run: one line per stage started (experiments.stages)
UNHEALTHY = "stopped_unhealthy"  # ended by an RL-health rule (ema_pg_core.health): summary.json["health"] says why
STATES = ("running", "finished", "interrupted", "failed", UNHEALTHY)  # what the status file's first line says
CRASHED = "crashed"  # never written: read_state's name for a `running` record whose process is gone
STOPPED_BY_EXIT = (
    "stopped by sys.exit(0) during the run: in a sweep, Ray Tune ended the trial (its scheduler stopped it early, "
    "or the sweep was interrupted); the last checkpoint is kept"
)
STALE_S = 600.0  # a `running` record whose owner's heartbeat is this far from now (past or future) reads as crashed
RUN_BUSY = "wait for it to end, or choose another run_dir"
WANDB_STATE = "wandb_run.json"  # written by experiments.wandb_logger: {"id", "last_step", ...}
RESERVED = ("iteration", "time_s")  # set by the record, never by the caller
# Run-local keys that do not change what is trained: left out of config_hash.
HASH_EXCLUDE = ("run_dir", "out_root", "resume", "resume_from", "logger", "sweep", "model.cache_dir")
# Keys a resume may change (besides HASH_EXCLUDE): how long, how often to evaluate/save, how to run.
# Any other change is refused unless resume=force (recorded in resumes.jsonl, flagged by the report).
RESUME_MAY_CHANGE = tuple(
    "trainer.iterations trainer.eval_every trainer.eval_size trainer.eval_n trainer.save_every trainer.keep_checkpoints"
    " trainer.threads backend.verl.step_timeout_s backend.verl.max_failed_rollouts stages health".split()
)
_clock = time.monotonic  # wall seconds for time_s (a module attribute so tests can drive it)


# ---------------------------------------------------------------- ids, hashes, provenance


def make_run_id(
    task: str, experiment: str, seed: int, now: dt.datetime | None = None, trial_id: str | None = None
) -> str:
    """The name of a run directory, for every backend: `{task}__{experiment}__s{seed}__{YYYYmmdd-HHMMSS}`
    (local time), e.g. `math_tiny__math_tiny_ema_pg__s1__20260101-120000`; inside a sweep the last part
    is the Tune trial id instead (`..__s1__7e9a1_00003`), so a restored trial finds its directory again."""
    last = f"{(now or dt.datetime.now()):%Y%m%d-%H%M%S}" if trial_id is None else str(trial_id)
    for what, value in (("task", task), ("experiment", experiment), ("trial_id", last)):
        if not value or "__" in value or "/" in value or os.sep in value:
            raise ValueError(
                f"{what}={value!r} cannot go into a run id: it must be non-empty and contain "
                "neither '__' (the run id separator) nor a path separator"
            )
    return f"{task}__{experiment}__s{int(seed)}__{last}"


def find_trial_run(runs_root: str | Path, trial_id: str) -> Path | None:
    """The run directory of sweep trial `trial_id` below `runs_root` (its run id ends with the trial
    id, see make_run_id), or None when the trial never started a run."""
    found = sorted(p for p in Path(runs_root).glob(f"*__{trial_id}") if p.is_dir())
    return found[0] if found else None


def resolved(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    return OmegaConf.to_container(node, resolve=True)


def config_hash(cfg: DictConfig | Mapping[str, Any]) -> str:
    """12 hex digits of the sha256 of the resolved config without HASH_EXCLUDE: equal for two runs
    that train the same thing (seed included), wherever and however they are logged."""
    pruned = resolved(cfg)
    for dotted in HASH_EXCLUDE:
        parent, _, leaf = dotted.rpartition(".")
        node = _dig(pruned, parent) if parent else pruned
        if isinstance(node, dict):
            node.pop(leaf, None)
    text = json.dumps(pruned, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def git_sha() -> str | None:
    """HEAD of the repository holding this package, or None (installed wheel, no git, no commit)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():  # never pick up an unrelated repository further up
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", sha) else None


# ---------------------------------------------------------------- files


def atomic_write(path: str | Path, text: str) -> None:
    """Replace `path` with `text` all at once: readers see the old file or the new one, never half."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _guarded(fn: Callable, path: Path, *args):
    """fn(path, *args); an OSError becomes RecordWriteError naming `path` (one line for the user)."""
    try:
        return fn(path, *args)
    except OSError as e:
        raise RecordWriteError(f"cannot write the run record {path}: {e.strerror or e}") from e


def _append(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, allow_nan=False) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def jsonable(value: Any, key: str = "") -> Any:
    """A JSON-safe copy: numpy/torch scalars via .item(), NaN/inf -> None; raises TypeError otherwise."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v, f"{key}/{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v, key) for v in value]
    if hasattr(value, "item"):  # numpy scalars, one-element arrays and tensors
        try:
            return jsonable(value.item(), key)
        except (ValueError, RuntimeError) as err:
            raise TypeError(f"{key!r}: a {type(value).__name__} with more than one element is not a scalar") from err
    try:
        return jsonable(float(value), key)
    except (TypeError, ValueError):
        raise TypeError(
            f"{key!r}: {type(value).__name__} cannot be written as JSON (number, bool, str, None, list or dict)"
        ) from None


def scan_jsonl(path: str | Path) -> tuple[list[dict], bool]:
    """(rows of a JSONL file ([] if absent), whether a trailing partial line was dropped). An unparsable
    last line is an interrupted append and is dropped; an unparsable line anywhere else is corruption
    and raises ValueError."""
    path = Path(path)
    if not path.is_file():
        return [], False
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as err:
            if i == len(lines) - 1:
                return rows, True
            raise ValueError(
                f"{path}:{i + 1}: corrupt JSON line ({err}); only the last line of a run record may be partial"
            ) from err
        rows.append(row)
    return rows, False


def read_jsonl(path: str | Path) -> list[dict]:
    return scan_jsonl(path)[0]


def _read_json(path: Path, default: Any = None) -> Any:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else default


def _status_of(run_dir: Path) -> str | None:
    """The status file's state, or None when there is no status file yet."""
    return read_status(run_dir)[0] if (run_dir / STATUS).is_file() else None


def read_metrics(run_dir: str | Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / METRICS)


def read_evals(run_dir: str | Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / EVALS)


def read_status(run_dir: str | Path) -> tuple[str, str | None]:
    """(running | finished | interrupted | failed, the rest of the file: the error of a failed run, the
    message of an interrupted one, the process of a running one), as written."""
    text = (Path(run_dir) / STATUS).read_bytes().decode("utf-8", errors="replace")
    first, _, rest = text.strip().partition("\n")
    return (first.strip() if first.strip() in STATES else "unknown"), rest.strip() or None


def read_state(run_dir: str | Path, now: float | None = None) -> str:
    """The run's state as a reader should show it: the status file's, except that a `running` record whose writer
    is gone reads as `crashed` (docs/run-record.md, `status`): its owner (pid and process start) is not alive on
    this host, or it let go, or its heartbeat is more than STALE_S from now, in the past or in the future."""
    run_dir = Path(run_dir)
    state, rest = read_status(run_dir)
    if state != "running":
        return state
    lock = run_dir / owner.FILE
    try:
        rec = json.loads(lock.read_text(encoding="utf-8")) if lock.is_file() else {}
    except ValueError:
        rec = {}
    proc = rec if isinstance(rec, dict) and rec.get("pid") else dict(re.findall(r"(\w+)=(\S+)", rest or ""))
    pid = str(proc.get("pid", ""))
    if "ended" in proc:
        return CRASHED
    if proc.get("host") == socket.gethostname() and pid.isdigit() and not owner.alive(int(pid), proc.get("pid_start")):
        return CRASHED
    beat = (lock if lock.is_file() else run_dir / STATUS).stat().st_mtime
    return CRASHED if abs((time.time() if now is None else now) - beat) > STALE_S else state


def read_resumes(run_dir: str | Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / RESUMES)


def read_stages(run_dir: str | Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / STAGES)


def holds_run(run_dir: str | Path) -> bool:
    return any((Path(run_dir) / name).exists() for name in (CONFIG, STATUS, METRICS, "checkpoints"))


def stage_progress(run_dir: str | Path) -> tuple[list[str], str | None]:
    """(stages finished, the stage started but not finished or None) of a staged run's record: every
    started stage before the last is finished, and the last one is when the record's status is."""
    started = [r["stage"] for r in read_stages(run_dir)]
    if not started or _status_of(Path(run_dir)) == "finished":
        return started, None
    return started[:-1], started[-1]


# ---------------------------------------------------------------- evaluations outside training (emapg eval)

EVAL_ROOT = "evals"  # <run_dir>/evals/<name>/: one standalone evaluation of the run's models
EVAL_SETTINGS, EVAL_SUMMARY = "eval.json", "eval_summary.json"
EVAL_ROW_KEYS = ("iteration", "model", "benchmark", "problem_id", "n", "n_correct", "greedy_correct")


def eval_dirs(run_dir: str | Path) -> list[Path]:
    """The standalone evaluations of a run (`emapg eval`): <run_dir>/evals/<name>/ with eval.json."""
    return sorted(p.parent for p in (Path(run_dir) / EVAL_ROOT).glob(f"*/{EVAL_SETTINGS}"))


@contextlib.contextmanager
def eval_dir(out_dir: str | Path, settings: Mapping[str, Any]) -> Iterator[list[dict]]:
    """Hold an evaluation directory for the block (one writer: a second `emapg eval` on it exits 2 naming this
    one): write eval.json, or check that the one there has the same settings (a resumed evaluation must not mix
    two); yield the rows already written."""
    out_dir = Path(out_dir)
    if holds_run(out_dir) or (out_dir / "sweep.yaml").exists():
        raise UserError(f"--out {out_dir} holds a run or a sweep record; an evaluation needs a directory of its own")
    path, settings = out_dir / EVAL_SETTINGS, jsonable(dict(settings))
    with owner.held(out_dir, "evaluation", "wait for it to end, or pass --out <another dir>"):
        if path.is_file():
            old = json.loads(path.read_text(encoding="utf-8"))
            if diff := sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k)):
                listed = "; ".join(f"{k}: {old.get(k)!r} -> {settings.get(k)!r}" for k in diff)
                raise ValueError(f"{out_dir} holds an evaluation with other settings ({listed}); use another --out")
        else:
            _guarded(atomic_write, path, json.dumps(settings, indent=1) + "\n")
        yield read_jsonl(out_dir / EVALS)


def append_eval_rows(out_dir: str | Path, rows: list[Mapping[str, Any]]) -> None:
    """Append per-problem rows (the schema of evals.jsonl, EVAL_ROW_KEYS) in one write."""
    out = [jsonable(dict(r)) for r in rows]
    if bad := [r for r in out if set(r) != set(EVAL_ROW_KEYS) or not isinstance(r["iteration"], int)]:
        raise ValueError(f"eval rows need exactly {EVAL_ROW_KEYS} with an integer iteration; got {bad[0]!r}")
    _guarded(_append, Path(out_dir) / EVALS, out)


def write_eval_summary(out_dir: str | Path, summary: Mapping[str, Any]) -> None:
    _guarded(atomic_write, Path(out_dir) / EVAL_SUMMARY, json.dumps(jsonable(dict(summary)), indent=1) + "\n")


def read_summary(run_dir: str | Path) -> dict | None:
    return _read_json(Path(run_dir) / SUMMARY)


def numerics_key(run: Mapping[str, Any] | str | Path) -> tuple[tuple[str, Any], ...] | None:
    """What two runs must share for their numbers to be comparable, from a summary.json dict or a run directory:
    the sorted (dotted field, value) pairs of its "numerics" that `comparable_numerics` keeps. None for a record
    without them (written before they were recorded, a verl run, a run still going)."""
    summary = run if isinstance(run, Mapping) else read_summary(run)
    found = (summary or {}).get("numerics")
    return tuple(sorted(flat(comparable_numerics(found)).items())) if found else None


def comparable_numerics(fingerprint: Mapping[str, Any]) -> dict:
    """The fields of an experiments.numerics fingerprint that two runs (or two warm starts) must share for their
    numbers to be comparable: mode, code paths, thread count, determinism switch, library versions, warm-start
    weights; the CPU's name only in native mode (the reproducible mode's pins make it irrelevant)."""
    return {k: v for k, v in fingerprint.items() if k != "cpu" or fingerprint.get("mode") != "reproducible"}


def read_wandb_state(run_dir: str | Path) -> dict:
    return _read_json(Path(run_dir) / WANDB_STATE, {})


def _rewrite_jsonl(path: Path, keep: Callable[[dict], bool]) -> list[dict]:
    rows = [r for r in read_jsonl(path) if keep(r)]
    if path.exists():
        atomic_write(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows))
    return rows


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _dig(d: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def flat(d: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a nested dict's leaves (an empty dict is a leaf)."""
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


# ---------------------------------------------------------------- final and best values

BEST_PREFIXES = ("eval/", "eval_anchor/")  # accuracies and pass@k: higher is better, so their max is "best"


def final_values(rows: list[dict]) -> dict[str, Any]:
    """{metric: its value at the last iteration that has a finite number for it} (iteration, time_s left out)."""
    final: dict[str, Any] = {}
    for row in sorted(rows, key=lambda r: r["iteration"]):
        final.update({k: v for k, v in row.items() if k not in RESERVED and _is_number(v)})
    return final


def best_values(rows: list[dict], metric: str | None = None, mode: str = "max") -> dict[str, Any]:
    """The best value of each metric for which "best" means something: the max of every `eval/*` and
    `eval_anchor/*` metric, and, for a sweep, its `metric` (a `best_` prefix dropped) by its `mode`
    (min or max). Times, losses, rewards, perf/* have none: whether higher is better is not known."""
    if mode not in ("max", "min"):
        raise ValueError(f"mode={mode!r}: expected 'max' or 'min'")
    key = metric[len("best_") :] if metric and metric.startswith("best_") else metric
    best: dict[str, Any] = {}
    for row in rows:
        for k, v in row.items():
            if not _is_number(v) or k in RESERVED or (k != key and not k.startswith(BEST_PREFIXES)):
                continue
            sign = -1 if k == key and mode == "min" else 1
            if k not in best or sign * v > sign * best[k]:
                best[k] = v
    return best


# ---------------------------------------------------------------- the record


class RunRecord:
    """One run directory. Build it with `RunRecord.create`; see the module docstring."""

    def __init__(self, run_dir: Path, config: dict[str, Any], held: owner.Owner):
        self.run_dir, self.config = Path(run_dir), config
        self.run_id = self.run_dir.name
        self.config_hash, self.git_sha = config_hash(config), git_sha()
        self.status = "running"
        self.last_iteration: int | None = None
        self.forced = False  # resumed with resume=force at some point (summary.json: forced_resume)
        self.numerics: dict | None = None  # experiments.numerics.fingerprint of the process training (local backend)
        self._offset_s, self._t0 = 0.0, _clock()
        self.owner = held  # this process's hold on run_dir (experiments.owner)

    @classmethod
    def create(
        cls,
        run_dir: str | Path,
        cfg: DictConfig | Mapping[str, Any],
        *,
        resume: bool = False,
        force: bool = False,
        checkpoint: str | None = None,
        skipped: list[dict] | tuple = (),
        stage: Mapping[str, Any] | None = None,
        held: owner.Owner | None = None,
        trained: Mapping[str, Any] | None = None,
    ) -> RunRecord:
        """Write config.yaml (resolved) and status=running; drop a stale summary.json.

        resume=False refuses a directory that already holds metrics, a checkpoint or a finished run. resume=True
        keeps metrics.jsonl/evals.jsonl (minus a trailing partial line); call `rewind(iteration)` with the
        checkpoint's iteration next. A change outside RESUME_MAY_CHANGE (and HASH_EXCLUDE) from `trained` (else
        config.yaml) raises ValueError unless `force`. A resume is a line of resumes.jsonl (the changes, `force`,
        the `checkpoint` and the `skipped` ones: {"checkpoint", "error"}); `stage` ({"stage", "index",
        "may_change": dotted keys}) starts a stage instead, which may also change its own keys (stages.jsonl)."""
        run_dir = Path(run_dir)
        held = held or owner.acquire(run_dir, "run", RUN_BUSY)  # one writer per record, before any read or write
        try:
            config = resolved(cfg)
            changes = config_changes(trained if trained is not None else run_dir / CONFIG, config) if resume else {}
            may_change = (*RESUME_MAY_CHANGE, "stage", *stage.get("may_change", ())) if stage else RESUME_MAY_CHANGE
            refused = {k: v for k, v in changes.items() if not _under(k, may_change)}
            if refused and not force:
                raise ValueError(_refusal(run_dir, refused))
            if resume:
                _check_unhealthy_resume(run_dir, changes, force)
            else:
                _check_fresh(run_dir)
            for name in (SUMMARY,) if resume else (SUMMARY, METRICS, EVALS, WANDB_STATE, RESUMES, STAGES):
                (run_dir / name).unlink(missing_ok=True)
            rec = cls(run_dir, config, held)
            _guarded(atomic_write, run_dir / CONFIG, OmegaConf.to_yaml(config))
            rec.rewind(None)  # a resume's complete lines are kept (a fresh record has none)
            if stage is not None:
                head = {"stage": stage["stage"], "index": int(stage["index"])}
                rec._log_continuation(STAGES, checkpoint, changes, bool(refused), head=head)
            elif resume:
                rec._log_continuation(RESUMES, checkpoint, changes, bool(refused), tail={"skipped": list(skipped)})
            rec.forced = any(r.get("forced") for r in read_resumes(run_dir) + read_stages(run_dir))
            rec._write_status("running", f"pid={os.getpid()} host={socket.gethostname()}")
            return rec
        except BaseException:
            held.release()
            raise

    def _log_continuation(self, name: str, checkpoint, changes: dict, forced: bool, *, head=None, tail=None) -> None:
        """One line of stages.jsonl (a stage starts) or resumes.jsonl: after `after_iteration`, from `checkpoint`."""
        entry = {
            "time": dt.datetime.now().isoformat(timespec="seconds"),
            **(head or {}),
            "after_iteration": self.last_iteration,
            "checkpoint": checkpoint,
            **(tail or {}),
            "forced": forced,
            "changes": {k: list(v) for k, v in changes.items()},
        }
        _guarded(_append, self.run_dir / name, [jsonable(entry)])

    # ------------------------------------------------------------ writing
    def elapsed(self) -> float:
        """Wall seconds of this run so far, summed over resumed attempts (see `rewind`)."""
        return self._offset_s + _clock() - self._t0

    def log(self, iteration: int, metrics: Mapping[str, Any]) -> dict:
        """Append one line {"iteration", "time_s", **metrics}; return it (W&B can mirror it as is)."""
        self._check_running()
        iteration = int(iteration)
        if self.last_iteration is not None and iteration <= self.last_iteration:
            raise ValueError(
                f"iteration {iteration} <= {self.last_iteration}, the last one in {self.run_dir / METRICS}; "
                "iterations must increase (after a resume, call rewind(checkpoint_iteration) first)"
            )
        if reserved := [k for k in RESERVED if k in metrics]:
            raise ValueError(f"metric keys {reserved} are set by the run record; do not pass them")
        row = {"iteration": iteration, "time_s": round(self.elapsed(), 3)}
        row.update({str(k): jsonable(v, str(k)) for k, v in metrics.items()})
        _guarded(_append, self.run_dir / METRICS, [row])
        self.last_iteration = iteration
        return row

    def log_evals(self, rows: list[Mapping[str, Any]]) -> None:
        """Append per-problem eval rows; each needs an int "iteration" (rewind keys on it)."""
        self._check_running()
        out = [jsonable(dict(r)) for r in rows]
        if bad := [r for r in out if not isinstance(r.get("iteration"), int)]:
            raise ValueError(f"eval rows need an integer 'iteration'; got {bad[0]!r}")
        _guarded(_append, self.run_dir / EVALS, out)

    def rewind(self, iteration: int | None) -> None:
        """Keep only lines with iteration <= `iteration` (None: all complete lines), so a resumed run never
        duplicates steps. time_s continues from the last kept line's plus the time since `create`: work lost after
        the checkpoint and the downtime before the restart are not counted."""

        def keep(r: dict) -> bool:
            return iteration is None or r["iteration"] <= iteration

        rows = _guarded(_rewrite_jsonl, self.run_dir / METRICS, keep)
        _guarded(_rewrite_jsonl, self.run_dir / EVALS, keep)
        last = max(rows, key=lambda r: r["iteration"]) if rows else None
        self.last_iteration = last["iteration"] if last else None
        self._offset_s = float((last or {}).get("time_s") or 0.0)

    def state(self) -> dict:
        """Small state to keep in a checkpoint: the clock, and the config it was trained under (a resume compares
        against this one, not against config.yaml, which a user may edit or delete)."""
        return {"time_s": self.elapsed(), "iteration": self.last_iteration, "config": self.config}

    def finish(self, extra_summary: Mapping[str, Any] | None = None) -> dict:
        """Write summary.json, then status=finished; return the summary."""
        return self._close("finished", None, extra_summary)

    def interrupt(self, message: str) -> dict:
        """Write summary.json, then status=interrupted followed by `message` (what stopped it, where to resume)."""
        return self._close("interrupted", message, None)

    def stop_unhealthy(self, breach: Mapping[str, Any]) -> dict:
        """Write summary.json with "health" = `breach` ({"rule", "iteration", "message", "values"}, see
        ema_pg_core.health.Breach), then status=stopped_unhealthy followed by the message and the breach as JSON."""
        breach = jsonable(dict(breach))
        detail = f"{breach['message']}\n{json.dumps(breach, allow_nan=False)}"
        return self._close(UNHEALTHY, detail, {"health": breach})

    def fail(self, exc: BaseException | str) -> dict:
        """Write summary.json, then status=failed followed by the error and its traceback."""
        error = "".join(traceback.format_exception(exc)) if isinstance(exc, BaseException) else str(exc)
        return self._close("failed", error, None)

    def __enter__(self) -> RunRecord:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        """A clean exit finishes the record; Ctrl-C, SIGTERM and sys.exit(0) (Ray Tune stopping a trial from
        inside its report: a scheduler's early stop, or the sweep interrupted) interrupt it; any other exception
        fails it. A record already closed is left as it is. The exception, if any, propagates."""
        if self.status == "running":
            try:
                if exc is None:
                    self.finish()
                elif isinstance(exc, KeyboardInterrupt):
                    self.interrupt(str(exc) or "interrupted by SIGINT")
                elif isinstance(exc, Terminated):
                    self.interrupt(f"interrupted by {exc}")
                elif isinstance(exc, RunInterrupted):
                    self.interrupt(str(exc))
                elif isinstance(exc, SystemExit) and exc.code in (0, None):
                    self.interrupt(STOPPED_BY_EXIT)
                else:
                    self.fail(exc)
            except Exception as err:  # keep the original exception; it is re-raised below
                if not isinstance(exc, RecordWriteError):  # that one already names the path
                    print(f"warning: could not record how the run ended in {self.run_dir}: {err}", file=sys.stderr)
        self.release()
        return False

    def release(self) -> None:
        """Let go of run_dir (the block's end does it): another process may then write this record."""
        self.owner.release()

    # ------------------------------------------------------------ internals
    def summary(self, status: str) -> dict:
        """The summary as it would be written now (final/best recomputed from metrics.jsonl)."""
        rows = sorted(read_metrics(self.run_dir), key=lambda r: r["iteration"])
        final, best = final_values(rows), best_values(rows)
        return {
            "run_id": self.run_id,
            "status": status,
            "experiment": _dig(self.config, "experiment"),
            "task": _dig(self.config, "task.name"),
            "seed": _dig(self.config, "seed"),
            "config_hash": self.config_hash,
            "git_sha": self.git_sha,
            "wandb_run_id": read_wandb_state(self.run_dir).get("id"),
            "iterations_done": rows[-1]["iteration"] if rows else 0,
            "wall_time_s": round(self.elapsed(), 3),
            "final": final,
            "best": best,
            "numerics": self.numerics,
        }

    def _close(self, state: str, detail: str | None, extra: Mapping[str, Any] | None) -> dict:
        summary = self.summary(state)
        summary.update(jsonable(dict(extra or {})))
        summary["status"] = state
        if self.forced:
            summary["forced_resume"] = True
        _guarded(atomic_write, self.run_dir / SUMMARY, json.dumps(summary, indent=1, allow_nan=False) + "\n")
        self._write_status(state, detail)
        self.release()
        return summary

    def _write_status(self, state: str, detail: str | None = None) -> None:
        _guarded(atomic_write, self.run_dir / STATUS, state + "\n" + (detail.rstrip() + "\n" if detail else ""))
        self.status = state

    def _check_running(self) -> None:
        if self.status != "running":
            raise RuntimeError(f"the run record {self.run_dir} is {self.status}; nothing more can be logged")


def _check_fresh(run_dir: Path) -> None:
    """Refuse to start a run over one already recorded (nothing is overwritten by accident)."""
    state = _status_of(run_dir)
    has_metrics = (run_dir / METRICS).is_file() and (run_dir / METRICS).stat().st_size > 0
    has_ckpt = (run_dir / "checkpoints" / "latest").exists()
    if state == "finished" or has_metrics or has_ckpt:
        raise FileExistsError(
            f"{run_dir} already holds a run record (status: {state}, metrics: {has_metrics}, "
            f"checkpoint: {has_ckpt}); continue it with resume=true or choose another run_dir"
        )


def _check_unhealthy_resume(run_dir: Path, changes: dict[str, tuple], force: bool) -> None:
    """A run stopped by a health rule resumes only with a change: of its health.* rules, or forced (e.g. a lower
    optim.lr). With neither, an exact resume would replay the same metrics and stop at the same iteration."""
    if _status_of(run_dir) != UNHEALTHY or (force and changes) or any(_under(k, ("health",)) for k in changes):
        return
    health = (read_summary(run_dir) or {}).get("health") or {}
    raise ValueError(
        f"{run_dir} was stopped by health rule {health.get('rule', '?')} at iteration {health.get('iteration', '?')} "
        f"({health.get('message', 'see its status file')}); an exact resume would stop there again: relax the "
        "rule (health.* may change on resume), or change a setting with resume=force (e.g. a lower optim.lr), "
        "or start a new run_dir"
    )


def config_changes(before: Path | Mapping[str, Any], new: dict) -> dict[str, tuple]:
    """{dotted key: (recorded value, new value)} for every key that differs from `before` (the config a checkpoint
    was trained under, or a config.yaml), except HASH_EXCLUDE ({} when there is no config.yaml yet)."""
    if isinstance(before, Path):
        if not before.is_file():
            return {}
        before = OmegaConf.to_container(OmegaConf.load(before))
    old, cur = flat(dict(before)), flat(new)
    return {
        k: (old.get(k), cur.get(k))
        for k in sorted(set(old) | set(cur))
        if old.get(k) != cur.get(k) and not _under(k, HASH_EXCLUDE)
    }


def _under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _refusal(run_dir: Path, refused: dict[str, tuple]) -> str:
    listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in ((k, *v) for k, v in refused.items()))
    return (
        f"resume=true would continue {run_dir} with different settings ({listed}); resume with the recorded "
        f"settings, start a new run_dir, or override deliberately with resume=force (recorded, and flagged "
        f"in reports). A resume may change: {', '.join(RESUME_MAY_CHANGE)}"
    )
