"""verl's metrics -> the run record (docs/run-record.md), so analysis, sweeps and W&B grouping read a
verl run exactly like a local one.

verl's "file" logger writes one JSON line per training step, ``{"step": N, "data": {key: value}}``,
to ``VERL_FILE_LOGGER_PATH``; our TaskRunner points it at ``<run_dir>/verl_metrics.jsonl``. verl opens
that file with mode "wb", so a resumed run would truncate it: ``rotate`` (in
``experiments.backends.verl.config``, called by the TaskRunner) moves a non-empty file aside
to ``verl_metrics.<n>.jsonl`` first, and ``read_attempts`` reads every attempt in order, later
attempts overriding the steps they replay (a resume restarts after its checkpoint).

Key mapping (verl 0.9.1 names on the left): TRAIN_KEYS (verl's training metrics); anchor/*, SAME_KEYS (our
trainer's, the KL probe's) and actor/topk/* -> topk/* (our loss's Top-k telemetry) keep their names; and

    val-core/<source>/<var>/mean@N       -> eval/<source>/acc    (greedy validation: T = 0)
                                            eval/<source>/pass@1 (sampled: mean over N samples)
    and eval/<task>/<acc|pass@1>         =  the unweighted mean over the sources of that step,
                                            as the paper's "average" column
    val-anchor-core/...                  -> eval_anchor/... the same for the EMA anchor (our trainer)

Per-problem rows: our trainer appends them to ``<run_dir>/verl_evals.jsonl`` (``experiments.backends.verl.evals``)
in the schema of evals.jsonl; ``eval_rows`` reads them for the run record.

Everything else stays in the raw file only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ema_pg_core.telemetry import PROBE_KEYS
from experiments.backends.verl.config import rotate  # noqa: F401  (re-exported: the TaskRunner calls it)
from experiments.backends.verl.evals import FILE as EVALS_FILE
from experiments.records import read_jsonl

FILE = "verl_metrics.jsonl"
TRAIN_KEYS = {
    "critic/score/mean": "train/reward",
    "response_length/mean": "train/response_len",
    "response_length/clip_ratio": "train/len_capped",  # share of responses at the length cap
    "actor/pg_loss": "loss/pg",
    "actor/kl_loss": "kl/value",
    "actor/pg_clipfrac": "loss/clip_frac",
    "actor/pg_clipfrac_lower": "loss/dual_clip_frac",
    "actor/ppo_kl": "loss/approx_kl",
    "actor/entropy": "train/entropy",
    "actor/grad_norm": "train/grad_norm",
    "timing_s/step": "perf/iter_s",
    "train/dropped_truncated": "train/dropped_truncated",  # logged by our trainer
}
SAME_KEYS = (*PROBE_KEYS, "perf/probe_s")  # logged by our trainer under their run-record names
_VAL = re.compile(r"^val-(?P<who>core|anchor-core)/(?P<source>[^/]+)/(?P<var>[^/]+)/mean@(?P<n>\d+)$")
_WHO = {"core": "eval", "anchor-core": "eval_anchor"}  # verl's validation of the policy / of the EMA anchor


def attempt_files(run_dir: str | Path) -> list[Path]:
    """The verl metrics files of `run_dir`, oldest attempt first (rotated ones by n, then the live one)."""
    run_dir = Path(run_dir)
    stem, suffix = Path(FILE).stem, Path(FILE).suffix
    rotated = [
        (int(m.group(1)), p)
        for p in run_dir.glob(f"{stem}.*{suffix}")
        if (m := re.fullmatch(rf"{re.escape(stem)}\.(\d+){re.escape(suffix)}", p.name))
    ]
    live = run_dir / FILE
    return [p for _, p in sorted(rotated)] + ([live] if live.is_file() else [])


def read_attempts(files: Iterable[str | Path]) -> dict[int, dict[str, Any]]:
    """{step: verl's metrics of that step}; a step trained again by a later attempt replaces the
    earlier line, and within one file later lines of a step update earlier ones. A later attempt's
    line without training metrics (the validation a resumed run does first, logged at its
    checkpoint's step) is added to that step instead: the step's training is in the checkpoint.
    A trailing partial line (a crash mid-write) is dropped; any other unreadable line is an error
    naming file and line."""
    steps: dict[int, dict[str, Any]] = {}
    for f in files:
        lines = Path(f).read_text().splitlines()
        this: dict[int, dict[str, Any]] = {}
        for i, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if i == len(lines):
                    break
                raise ValueError(f"{f}:{i}: not a JSON line of verl's file logger") from None
            if not isinstance(row, dict) or "step" not in row or not isinstance(row.get("data"), dict):
                raise ValueError(f"{f}:{i}: expected {{'step': int, 'data': {{...}}}}; got {line[:80]!r}")
            this.setdefault(int(row["step"]), {}).update(row["data"])
        for step, data in this.items():
            if trained_step(data) or step not in steps:
                steps[step] = data
            else:
                steps[step].update(data)
    return steps


def trained_step(data: Mapping[str, Any]) -> bool:
    """verl logged a training iteration in this line (not only validation)."""
    return any(k.startswith(("training/", "actor/", "timing_s/")) for k in data)


def convert(data: Mapping[str, Any], task: str, greedy: bool) -> dict[str, float]:
    """One step of verl metrics -> run-record metrics (see the module docstring)."""
    out = {ours: data[theirs] for theirs, ours in TRAIN_KEYS.items() if theirs in data}
    out.update({k: v for k, v in data.items() if k.startswith("anchor/") or k in SAME_KEYS})
    out.update({k[len("actor/") :]: v for k, v in data.items() if k.startswith("actor/topk/")})
    name = "acc" if greedy else "pass@1"
    per_source: dict[str, dict[str, float]] = {}
    for key, value in data.items():
        if (m := _VAL.match(key)) and m["var"] in ("acc", "reward"):
            per_source.setdefault(_WHO[m["who"]], {})[m["source"]] = float(value)
    for prefix, values in per_source.items():
        for source, value in sorted(values.items()):
            out[f"{prefix}/{source}/{name}"] = value
        if task not in values:
            out[f"{prefix}/{task}/{name}"] = sum(values.values()) / len(values)
    return out


def eval_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """The per-problem rows our verl trainer wrote (``experiments.backends.verl.evals``), one per (iteration, model,
    benchmark, problem): a step validated again by a resumed attempt keeps its latest rows. A trailing
    partial line is dropped."""
    rows: dict[tuple, dict[str, Any]] = {}
    for r in read_jsonl(Path(run_dir) / EVALS_FILE):
        rows[(r["iteration"], r["model"], r["benchmark"], r["problem_id"])] = r
    return sorted(rows.values(), key=lambda r: (r["iteration"], r["model"] != "policy", r["benchmark"]))


def to_rows(
    run_dir: str | Path, task: str, greedy: bool, steps: dict[int, dict[str, Any]] | None = None
) -> list[tuple[int, dict[str, float]]]:
    """(iteration, metrics) of every step in `run_dir`'s verl metrics files (or of `steps`, as read_attempts
    gives them), in step order."""
    steps = read_attempts(attempt_files(run_dir)) if steps is None else steps
    return [(step, convert(steps[step], task, greedy)) for step in sorted(steps)]


def stamp(files: Iterable[Path]) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of each file: what changes when verl appends a line or an attempt rotates."""
    return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def read_consistent(run_dir: str | Path, tries: int = 20) -> tuple[list[tuple], dict[int, dict], set[int]] | None:
    """(the files' stamp, read_attempts of them, the steps of the newest attempt's file) from a read during which
    no file changed, or None after `tries` reads that each raced a change. A new attempt renames the live file
    (``rotate``) and starts a new one: a read that listed the files before that and read them after would take
    the new attempt for the old one and miss the old one's steps."""
    run_dir = Path(run_dir)
    for _ in range(tries):
        try:
            files = attempt_files(run_dir)
            before = stamp(files)
            steps, newest = read_attempts(files), set(read_attempts(files[-1:]))
            if stamp(attempt_files(run_dir)) == before:
                return before, steps, newest
        except FileNotFoundError:  # renamed between the listing and the read
            pass
    return None
