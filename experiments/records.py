"""The run record on disk: the contract between training and analysis (docs/run-record.md).

    with RunRecord.create(run_dir, cfg, resume=False) as rec:  # config.yaml, status=running
        rec.rewind(ckpt_iteration)          # resuming only: drop lines after the checkpoint
        rec.log_evals(rows)                 # per-problem lines of evals.jsonl
        row = rec.log(iteration, metrics)   # one line of metrics.jsonl (+ iteration, time_s)
        rec.finish({"extra": 1.0})          # summary.json, then status=finished
    # an exception inside the block -> summary.json + status=failed with the traceback; re-raised

Whole files (config.yaml, summary.json, status) are replaced atomically: a temp file in the same
directory, fsynced, then `os.replace`. JSONL lines are appended, flushed and fsynced, so a crash
loses at most the line being written and readers drop that trailing partial line.
Values go through `.item()`/`float()` (numpy and torch scalars; torch is never imported here);
non-finite floats (NaN, +-inf) are written as null, so the files are strict JSON and
`analysis.load` reads null back as NaN.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
import re
import subprocess
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

from omegaconf import DictConfig, OmegaConf

CONFIG, METRICS, EVALS, SUMMARY, STATUS = "config.yaml", "metrics.jsonl", "evals.jsonl", "summary.json", "status"
WANDB_STATE = "wandb_run.json"  # written by experiments.wandb_logger: {"id", "last_step", ...}
RESERVED = ("iteration", "time_s")  # set by the record, never by the caller
# Run-local keys that do not change what is trained: left out of config_hash.
HASH_EXCLUDE = ("run_dir", "out_root", "resume", "logger", "sweep", "model.cache_dir")
_clock = time.monotonic  # wall seconds for time_s (a module attribute so tests can drive it)


# ---------------------------------------------------------------- ids, hashes, provenance

def make_run_id(task: str, experiment: str, seed: int, now: dt.datetime | None = None) -> str:
    """`{task}__{experiment}__s{seed}__{YYYYmmdd-HHMMSS}` (local time), e.g.
    `math_tiny__math_tiny_ema_pg__s1__20260101-120000`."""
    for what, value in (("task", task), ("experiment", experiment)):
        if not value or "__" in value or "/" in value or os.sep in value:
            raise ValueError(f"{what}={value!r} cannot go into a run id: it must be non-empty and contain "
                             "neither '__' (the run id separator) nor a path separator")
    return f"{task}__{experiment}__s{int(seed)}__{(now or dt.datetime.now()):%Y%m%d-%H%M%S}"


def resolved(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The config as a plain, fully resolved dict."""
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    return OmegaConf.to_container(node, resolve=True)


def config_hash(cfg: DictConfig | Mapping[str, Any]) -> str:
    """12 hex digits of the sha256 of the resolved config without HASH_EXCLUDE: equal for two runs
    that train the same thing (seed included), wherever and however they are logged."""
    pruned = resolved(cfg)
    for dotted in HASH_EXCLUDE:
        *parents, leaf = dotted.split(".")
        node: Any = pruned
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
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
        raise TypeError(f"{key!r}: {type(value).__name__} cannot be written as JSON (number, bool, str, None, "
                        "list or dict)") from None


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSONL file ([] if absent). An unparsable last line is an interrupted append and is
    dropped; an unparsable line anywhere else is corruption and raises ValueError."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as err:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: corrupt line ({err}); only the last line may be partial") from err
        rows.append(row)
    return rows


def read_metrics(run_dir: str | Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / METRICS)


def read_evals(run_dir: str | Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / EVALS)


def read_status(run_dir: str | Path) -> tuple[str, str | None]:
    """(running | finished | failed, the error and traceback of a failed run or None)."""
    first, _, rest = (Path(run_dir) / STATUS).read_text(encoding="utf-8").strip().partition("\n")
    return first.strip() or "unknown", rest.strip() or None


def read_summary(run_dir: str | Path) -> dict | None:
    path = Path(run_dir) / SUMMARY
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def read_wandb_state(run_dir: str | Path) -> dict:
    path = Path(run_dir) / WANDB_STATE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


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


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


# ---------------------------------------------------------------- the record

class RunRecord:
    """One run directory. Build it with `RunRecord.create`; see the module docstring."""

    def __init__(self, run_dir: Path, config: dict[str, Any]):
        self.run_dir, self.config = Path(run_dir), config
        self.run_id = self.run_dir.name
        self.config_hash, self.git_sha = config_hash(config), git_sha()
        self.status = "running"
        self.last_iteration: int | None = None
        self._offset_s, self._t0 = 0.0, _clock()

    @classmethod
    def create(cls, run_dir: str | Path, cfg: DictConfig | Mapping[str, Any], resume: bool = False) -> "RunRecord":
        """Write config.yaml (resolved) and status=running; drop a stale summary.json.

        resume=False refuses a directory that already holds metrics, a checkpoint or a finished run
        (nothing is overwritten by accident). resume=True keeps metrics.jsonl/evals.jsonl (minus a
        trailing partial line) and continues time_s from the last line; call `rewind(iteration)`
        with the checkpoint's iteration next.
        """
        run_dir = Path(run_dir)
        config = resolved(cfg)
        if resume:
            _warn_if_changed(run_dir / CONFIG, config)
        else:
            _check_fresh(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in (SUMMARY,) if resume else (SUMMARY, METRICS, EVALS, WANDB_STATE):
            (run_dir / name).unlink(missing_ok=True)
        rec = cls(run_dir, config)
        atomic_write(run_dir / CONFIG, OmegaConf.to_yaml(config))
        if resume:
            rec.rewind(None)
        rec._write_status("running")
        return rec

    # ------------------------------------------------------------ writing
    def elapsed(self) -> float:
        """Wall seconds of this run so far, summed over resumed attempts (see `rewind`)."""
        return self._offset_s + _clock() - self._t0

    def log(self, iteration: int, metrics: Mapping[str, Any]) -> dict:
        """Append one line {"iteration", "time_s", **metrics}; return it (W&B can mirror it as is)."""
        self._check_running()
        iteration = int(iteration)
        if self.last_iteration is not None and iteration <= self.last_iteration:
            raise ValueError(f"iteration {iteration} <= {self.last_iteration}, the last one in {self.run_dir / METRICS}; "
                             "iterations must increase (after a resume, call rewind(checkpoint_iteration) first)")
        if reserved := [k for k in RESERVED if k in metrics]:
            raise ValueError(f"metric keys {reserved} are set by the run record; do not pass them")
        row = {"iteration": iteration, "time_s": round(self.elapsed(), 3)}
        row.update({str(k): jsonable(v, str(k)) for k, v in metrics.items()})
        _append(self.run_dir / METRICS, [row])
        self.last_iteration = iteration
        return row

    def log_evals(self, rows: list[Mapping[str, Any]]) -> None:
        """Append per-problem eval rows; each needs an int "iteration" (rewind keys on it)."""
        self._check_running()
        out = [jsonable(dict(r)) for r in rows]
        if bad := [r for r in out if not isinstance(r.get("iteration"), int)]:
            raise ValueError(f"eval rows need an integer 'iteration'; got {bad[0]!r}")
        _append(self.run_dir / EVALS, out)

    def rewind(self, iteration: int | None, time_s: float | None = None) -> None:
        """Keep only lines with iteration <= `iteration` (None: all complete lines), so a run resumed
        from that checkpoint never duplicates or overlaps steps. time_s continues from `time_s`
        (e.g. `state()["time_s"]` saved in the checkpoint), by default from the last kept line, plus
        the time since `create`: work lost between the checkpoint and the crash, and the downtime
        before the restart, are not counted."""
        def keep(r: dict) -> bool:
            return iteration is None or r["iteration"] <= iteration

        rows = _rewrite_jsonl(self.run_dir / METRICS, keep)
        _rewrite_jsonl(self.run_dir / EVALS, keep)
        last = max(rows, key=lambda r: r["iteration"]) if rows else None
        self.last_iteration = last["iteration"] if last else None
        # this attempt's clock keeps running from create(): its start-up time counts, the downtime does not
        self._offset_s = float(time_s if time_s is not None else (last or {}).get("time_s") or 0.0)

    def state(self) -> dict:
        """Small state to keep in a checkpoint (the clock)."""
        return {"time_s": self.elapsed(), "iteration": self.last_iteration}

    def finish(self, extra_summary: Mapping[str, Any] | None = None) -> dict:
        """Write summary.json, then status=finished; return the summary."""
        summary = self._write_summary("finished", extra_summary)
        self._write_status("finished")
        return summary

    def fail(self, exc: BaseException | str, extra_summary: Mapping[str, Any] | None = None) -> dict:
        """Write summary.json, then status=failed followed by the error and its traceback."""
        if isinstance(exc, BaseException):
            error = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        else:
            error = str(exc)
        summary = self._write_summary("failed", extra_summary)
        self._write_status("failed", error)
        return summary

    def __enter__(self) -> "RunRecord":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and self.status != "failed":
            try:
                self.fail(exc)
            except Exception as err:  # keep the original exception; it is re-raised below
                warnings.warn(f"could not record the failure in {self.run_dir}: {err!r}", stacklevel=2)
        elif exc is None and self.status == "running":
            self.finish()
        return False

    # ------------------------------------------------------------ internals
    def summary(self, status: str) -> dict:
        """The summary as it would be written now (final/best recomputed from metrics.jsonl)."""
        final: dict[str, Any] = {}
        best: dict[str, Any] = {}
        rows = sorted(read_metrics(self.run_dir), key=lambda r: r["iteration"])
        for row in rows:
            for k, v in row.items():
                if k not in RESERVED and _is_number(v):
                    final[k] = v
                    best[k] = max(best.get(k, v), v)
        return {
            "run_id": self.run_id, "status": status, "experiment": _dig(self.config, "experiment"),
            "task": _dig(self.config, "task.name"), "seed": _dig(self.config, "seed"),
            "config_hash": self.config_hash, "git_sha": self.git_sha,
            "wandb_run_id": read_wandb_state(self.run_dir).get("id"),
            "iterations_done": rows[-1]["iteration"] if rows else 0, "wall_time_s": round(self.elapsed(), 3),
            "final": final, "best": best,
        }

    def _write_summary(self, status: str, extra: Mapping[str, Any] | None) -> dict:
        summary = self.summary(status)
        summary.update(jsonable(dict(extra or {})))
        summary["status"] = status
        atomic_write(self.run_dir / SUMMARY, json.dumps(summary, indent=1, allow_nan=False) + "\n")
        return summary

    def _write_status(self, state: str, error: str | None = None) -> None:
        atomic_write(self.run_dir / STATUS, state + "\n" + (error.rstrip() + "\n" if error else ""))
        self.status = state

    def _check_running(self) -> None:
        if self.status != "running":
            raise RuntimeError(f"the run record {self.run_dir} is {self.status}; nothing more can be logged")


def _check_fresh(run_dir: Path) -> None:
    state = read_status(run_dir)[0] if (run_dir / STATUS).is_file() else None
    has_metrics = (run_dir / METRICS).is_file() and (run_dir / METRICS).stat().st_size > 0
    has_ckpt = (run_dir / "checkpoints" / "latest").exists()
    if state == "finished" or has_metrics or has_ckpt:
        raise FileExistsError(f"{run_dir} already holds a run record (status: {state}, metrics: {has_metrics}, "
                              f"checkpoint: {has_ckpt}); continue it with resume=true or choose another run_dir")


def _warn_if_changed(old_path: Path, new: dict) -> None:
    if not old_path.is_file():
        return
    old, cur = _flat(OmegaConf.to_container(OmegaConf.load(old_path))), _flat(new)
    skip = tuple(HASH_EXCLUDE)
    changed = [f"{k}: {old.get(k)!r} -> {cur.get(k)!r}" for k in sorted(set(old) | set(cur))
               if old.get(k) != cur.get(k) and not k.startswith(skip)]
    if changed:
        more = f" (+{len(changed) - 8} more)" if len(changed) > 8 else ""
        warnings.warn(f"resuming {old_path.parent} with a changed config: {'; '.join(changed[:8])}{more}", stacklevel=3)
