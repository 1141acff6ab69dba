"""A sweep's results, read from its trials' run records (the source of truth; Tune adds what only it knows of
each trial, `Trial`): sweep.csv (``write_csv``, columns and statuses in docs/run-record.md) and timing.json
(``write_timing``, ``timeline``). No Ray here.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments import records

# Tune's trial state -> sweep.csv's status (a trial still RUNNING when the sweep ended was interrupted); any other
# state (PENDING, PAUSED) lowercased
STATUS = {"TERMINATED": "finished", "ERROR": "failed", "RUNNING": "interrupted"}
NOT_RUN = "not_run"  # sweep.csv's status of a trial the time budget stopped, or never started (``Trial.cut``)


@dataclass(frozen=True)
class Trial:
    """What Tune knows of one trial."""

    trial_id: str
    state: str  # Tune's: TERMINATED, ERROR, RUNNING, PENDING, PAUSED
    point: dict[str, Any] = field(default_factory=dict)  # {config key: value}
    seed: int | None = None  # None when `seed` is a key of the point
    iterations: int = 0  # the last training_iteration Tune saw
    error: str = ""  # the last line of a failed trial's error file
    cut: str = ""  # why Tune may have ended it before it ended itself (its time budget ran out), or never created it


def status(trial_state: str, run_state: str | None, cut: str = "") -> str:
    """sweep.csv's status from Tune's trial state and the run record's (read_state, None without one). `cut`
    (``Trial.cut``): Tune ended the trial without a scheduler's decision, which leaves it not run unless its record
    says it ran to its end (its function returned first)."""
    if cut and run_state not in ("finished", records.UNHEALTHY):
        return NOT_RUN
    out = STATUS.get(trial_state, trial_state.lower())
    if run_state == records.UNHEALTHY:  # the trial function returned after its run's health stop
        return records.UNHEALTHY
    if out == "finished" and run_state not in (None, "finished"):
        return "stopped"  # ended early by the scheduler or the time budget
    if out in ("failed", "pending") and run_state in ("interrupted", records.CRASHED):
        return run_state  # SIGTERM/SIGINT, the sweep interrupted, or a killed trial process: --resume continues it
    return out


def row(sweep_dir: str | Path, metric: str, mode: str, trial: Trial) -> dict[str, Any]:
    """One line of sweep.csv, from the trial's run record (found by its trial id; none for a trial Tune never
    created, which has no id)."""
    run_dir = records.find_trial_run(Path(sweep_dir) / "runs", trial.trial_id) if trial.trial_id else None
    rows, summary, run_state, error = _read(run_dir)
    rows.sort(key=lambda r: r["iteration"])
    final, best = records.final_values(rows), records.best_values(rows, metric, mode)
    key = metric.removeprefix("best_")
    out = {
        "trial_id": trial.trial_id,
        "run_id": run_dir.name if run_dir else "",
        "status": (state := status(trial.state, run_state, trial.cut)),
        **trial.point,
        **({"seed": trial.seed} if trial.seed is not None else {}),
        "iterations": trial.iterations,
        "train_time_s": summary.get(
            "train_wall_time_s", summary.get("wall_time_s", rows[-1].get("time_s", "") if rows else "")
        ),
        f"final/{key}": final.get(key, ""),
        f"best/{key}": best.get(key, ""),
    }
    out.update({f"final/{k}": v for k, v in sorted(final.items())})
    out.update({f"best/{k}": v for k, v in sorted(best.items())})
    if health := summary.get("health"):  # a stopped_unhealthy run: which rule, where, on what
        out["health"] = f"{health.get('rule')} at iteration {health.get('iteration')}: {health.get('message')}"
    out["error"] = trial.cut if state == NOT_RUN else trial.error or error
    return out


def _read(run_dir: Path | None) -> tuple[list[dict], dict, str | None, str]:
    """(metric rows, summary or {}, state or None, why the record could not be read or "")."""
    if run_dir is None:
        return [], {}, None, ""
    try:
        state = records.read_state(run_dir)
    except FileNotFoundError:
        state = None
    try:
        return records.read_metrics(run_dir), records.read_summary(run_dir) or {}, state, ""
    except ValueError as e:  # a corrupt line or summary.json: the row says so, the other trials still count
        return [], {}, state, f"unreadable run record: {e}"


def write_csv(sweep_dir: str | Path, metric: str, mode: str, trials: list[Trial]) -> list[dict[str, Any]]:
    """<sweep_dir>/sweep.csv, one row per trial in the order given (written atomically); returns the rows."""
    sweep_dir = Path(sweep_dir)
    rows = [row(sweep_dir, metric, mode, t) for t in trials]
    cols = list(dict.fromkeys(k for r in rows for k in r if k != "error")) + ["error"]
    text = io.StringIO()
    w = csv.DictWriter(text, fieldnames=cols, restval="")
    w.writeheader()
    w.writerows(rows)
    records.atomic_write(sweep_dir / "sweep.csv", text.getvalue())
    return rows


def write_timing(
    sweep_dir: str | Path,
    name: str,
    rows: list[dict],
    wall: float,
    slots: int,
    *,
    progress: bool = True,
    resumed: bool = False,
    killed_s: float | None = None,
    timeline: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """timing.json (returned): overhead = 1 - (summed trial training time) / (wall time x trial slots); with
    `progress`, a closing line is printed. The training time is summed over every trial's record, whichever
    invocation trained it, so with `resumed` the wall time is too: `wall` is added to the total in timing.json.
    `killed_s`: an earlier invocation killed before it wrote this file (its start to its last heartbeat)."""
    sweep_dir = Path(sweep_dir)
    before = _previous_timing(sweep_dir) if resumed else {}
    earlier, invocations = float(before.get("wall_s", 0.0)), int(before.get("invocations", 1 if before else 0))
    if killed_s is not None:
        earlier, invocations = earlier + killed_s, invocations + 1
    total = earlier + wall
    train = sum(float(r["train_time_s"]) for r in rows if isinstance(r["train_time_s"], (int, float)))
    slots = max(1, min(slots, len(rows)))
    t = {
        "wall_s": round(total, 2),
        "invocations": invocations + 1,
        "last_wall_s": round(wall, 2),
        "trials": len(rows),
        "statuses": dict(sorted(Counter(r["status"] for r in rows).items())),
        "slots": slots,
        "train_s_sum": round(train, 2),
        "overhead_fraction": round(1 - train / (total * slots), 4) if total > 0 else None,
    }
    if timeline is not None:
        t["timeline"] = timeline
    records.atomic_write(sweep_dir / "timing.json", json.dumps(t, indent=1) + "\n")
    if progress:
        n = Counter(r["status"] for r in rows)
        others = "".join(f", {n[s]} {s}" for s in ("interrupted", "crashed", records.UNHEALTHY) if n[s])
        others += f", {n[NOT_RUN]} not run" if n[NOT_RUN] else ""
        overhead = f"{t['overhead_fraction']:.0%}" if t["overhead_fraction"] is not None else "n/a"
        over = f" over {t['invocations']} invocations" if t["invocations"] > 1 else ""
        print(
            f"{name}: {n['finished']} finished, {n['stopped']} stopped early, {n['failed']} failed{others} of "
            f"{len(rows)} trials in {total:.0f}s{over} (training {train:.0f}s over {slots} "
            f"slot(s); orchestration overhead {overhead}{_fixed(timeline)})\n  {sweep_dir / 'sweep.csv'}",
            flush=True,
        )
    return t


def _previous_timing(sweep_dir: Path) -> dict[str, Any]:
    """The timing.json an earlier invocation wrote, or {} (none, or unreadable: its time is then not counted)."""
    try:
        t = json.loads((sweep_dir / "timing.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return t if isinstance(t, dict) and isinstance(t.get("wall_s"), (int, float)) else {}


def _fixed(t: dict[str, Any] | None) -> str:
    """The closing line's fixed costs (`t`: a ``timeline``), or "" without them."""
    if not t or t.get("fixed_s_per_trial") is None:
        return ""
    reused = f", {t['reused_s_per_trial']:.1f}s in a started slot" if t["reused_s_per_trial"] is not None else ""
    return f"; fixed cost {t['fixed_s_per_trial']:.1f}s per trial{reused}, idle tail {t['idle_tail_s']:.0f}s"


# ---------------------------------------------------------------------------- the trials' timeline
# (phase, the stamp that ends it): a trial's slot time in order. A phase starts at the previous stamp the trial has
# (eval0_end is missing in a trial resumed past iteration 0). `started`, `reported` and `ended` are the driver's
# stamps (sweeps.tune), the others the run record's (summary.json["timeline"]).
PHASES = (
    ("schedule", "started"),  # the slot's wait from the previous trial's end until Tune has a worker ready
    ("call", "worker"),  # Tune calls the trial function in the worker
    ("compose", "composed"),  # imports and config composition
    ("restore", "run"),  # Tune's checkpoint put back (a restarted trial), run() entered
    ("record", "record"),  # config validated, run record opened
    ("wandb", "logger"),
    ("model", "model"),  # task and model built (the tiny model's warm start read from its cache)
    ("trainer", "eval0_start"),
    ("eval0", "eval0_end"),  # training time from here to `saved`
    ("train", "train_end"),
    ("save", "saved"),
    ("close", "reported"),  # run record and W&B closed, the last result reported to Tune
    ("end", "ended"),
)
TRAINING = ("eval0", "train", "save")  # the phases summed in a run's train_wall_time_s: the trials' work


def trial_phases(stamps: dict[str, float]) -> dict[str, float]:
    """{phase: seconds} of one trial from its stamps (epoch seconds); "schedule" needs the slot (``timeline``)."""
    present = [(phase, stamps[stamp]) for phase, stamp in PHASES if stamp in stamps]
    return {phase: t - before for (_, before), (phase, t) in zip(present, present[1:])}


def timeline(
    sweep_dir: str | Path,
    rows: list[dict],
    stamps: dict[str, dict[str, float]],
    *,
    start: float,
    end: float,
    slots: int,
) -> dict[str, Any]:
    """Where one invocation's slot time (its wall time x slots, from `start` to `end`) went: timing.json["timeline"].

    `stamps`: the driver's {trial_id: {"started", "reported", "ended"}} (epoch seconds) of this invocation's trials,
    merged with each run record's own. Each trial goes to the slot that freed first before it started; its `schedule`
    phase is its wait there; its fixed cost, its phases outside TRAINING. Returned: per phase the median and total;
    `startup_s_per_slot` (mean fixed cost of each slot's first trial), `reused_s_per_trial` (median fixed cost of the
    others), `idle_tail_s` (the slots' idle time from their last trial to the end of the last trial), `after_s` (after
    the last trial, until Tune returned), `fixed_s_per_trial` ((wall x slots - training - idle tail) / trials), each
    trial's slot (`slots`) and its stamps in seconds from `start`."""
    trials = {}
    for r in rows:
        own = stamps.get(r["trial_id"], {})
        if "started" in own and "ended" in own:
            summary = (records.read_summary(Path(sweep_dir) / "runs" / r["run_id"]) or {}) if r["run_id"] else {}
            trials[r["trial_id"]] = {**(summary.get("timeline") or {}), **own}
    free, first, phases, slot_of = [start] * max(1, slots), [True] * max(1, slots), {}, {}
    for tid, st in sorted(trials.items(), key=lambda kv: kv[1]["started"]):
        slot = slot_of[tid] = min(range(len(free)), key=free.__getitem__)
        phases[tid] = {"schedule": st["started"] - free[slot], **trial_phases(st)}
        phases[tid]["first"], free[slot], first[slot] = first[slot], st["ended"], False
    fixed = {tid: sum(v for k, v in p.items() if k not in (*TRAINING, "first")) for tid, p in phases.items()}
    train = sum(p.get(k, 0.0) for p in phases.values() for k in TRAINING)
    last, n = max(free), len(phases)
    tail = sum(last - f for f in free)
    firsts = [fixed[t] for t, p in phases.items() if p["first"]]
    others = [fixed[t] for t, p in phases.items() if not p["first"]]
    return {
        "trials": n,
        "phases": {name: _stats([p[name] for p in phases.values() if name in p]) for name, _ in PHASES},
        "startup_s_per_slot": round(sum(firsts) / len(firsts), 2) if firsts else None,
        "reused_s_per_trial": _stats(others)["median_s"],
        "idle_tail_s": round(tail, 2),
        "after_s": round(len(free) * (end - last), 2),
        "fixed_s_per_trial": round(((end - start) * len(free) - train - tail) / n, 2) if n else None,
        "slots": slot_of,
        "stamps": {
            tid: {k: round(v - start, 3) for k, v in sorted(st.items(), key=lambda kv: kv[1])}
            for tid, st in trials.items()
        },
    }


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median_s": None, "total_s": 0.0}
    return {"median_s": round(statistics.median(values), 3), "total_s": round(sum(values), 2)}
