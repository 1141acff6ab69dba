"""Run records (disk or W&B) -> tidy pandas frames.

    runs, metrics = load_runs("outputs/sweeps/quickstart")   # every record below the directory
    evals = load_evals("outputs/sweeps/quickstart")          # per-problem outcomes (pass@k)
    runs, metrics = load_wandb("emapg", group="quickstart")  # the same frames from W&B

`runs` has one row per run: ids, `status` (as recorded, or crashed: left `running` by a process that is gone),
the flags `complete` / `failed` / `unhealthy` / `truncated` / `forced_resume`, `health_*` for a run a health rule
stopped, the knobs (KNOBS; None where a knob has no effect, `mask_inert_knobs`), `method`, `variant`, every scalar
config entry as `cfg.<dotted.key>`, and `final/<metric>` / `best/<metric>`. `metrics` has one row per run x
iteration with CURVE_KEYS repeated, so figures can group by them.

Nothing is dropped: failed, running and truncated runs are rows with flags, and callers decide what to include.
A trailing partial JSON line (a crash while appending) flags the run `truncated`; a corrupt line elsewhere is an
error, and so is a metrics.jsonl whose iterations do not increase (`check_iterations`). W&B history cannot be
rewritten: there, the last line logged for an iteration wins (`n_relogged`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from experiments import records

# column -> dotted config paths tried in order (docs/run-record.md, "Keys used by analysis")
KNOBS: dict[str, tuple[str, ...]] = {
    "experiment": ("experiment", "experiment.name"),
    "task": ("task.name", "task"),
    "seed": ("seed",),
    "backend": ("backend.name", "backend"),
    "kl_type": ("algo.kl.type",),
    "kl_k": ("algo.kl.k",),
    "kl_tail": ("algo.kl.tail",),
    "kl_coef": ("algo.kl.coef",),
    "anchor_tau": ("algo.anchor.tau",),
    "anchor_period": ("algo.anchor.period",),
    "iterations": ("trainer.iterations",),
    "sweep_name": ("sweep.name",),
    "trial_id": ("sweep.trial_id",),
}
# knobs copied onto every metrics row so curves can be grouped without a join
CURVE_KEYS = (
    *"task experiment seed method variant kl_type kl_k kl_tail anchor_tau anchor_period sweep_name".split(),
    "status",
    "complete",
)
# the columns of load_evals' frame
EVAL_COLUMNS = (
    "run_id task variant method seed complete iteration model benchmark problem_id n n_correct greedy_correct eval"
)
RUN_ID_RE = re.compile(r"^(?P<task>.+?)__(?P<experiment>.+?)__s(?P<seed>-?\d+)__(?P<timestamp>\d{8}-\d{6})$")
# W&B run states the run record names otherwise (finished, running, failed and crashed are the same in both)
WANDB_STATES = {"killed": "interrupted", "preempted": "interrupted"}


@dataclass
class RawRun:
    """One run as read from its source, before it becomes frame rows (disk and W&B share it)."""

    run_id: str
    status: str
    config: dict[str, Any]  # flattened, dotted keys
    rows: list[dict[str, Any]]  # one dict per logged iteration, as read
    summary: dict[str, Any] | None = None
    error: str | None = None
    truncated: bool = False
    location: str = ""  # run directory or W&B path
    source: str = "disk"  # "disk" | "wandb"
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- reading one record on disk


def find_run_dirs(root: str | Path) -> list[Path]:
    """Every directory below `root` (or `root` itself) holding `config.yaml` + `status`."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"not a directory: {root}")
    found = [p.parent for p in root.rglob("config.yaml") if (p.parent / "status").is_file()]
    return sorted(d for d in found if "checkpoints" not in d.relative_to(root).parts)


def flatten(d: dict[str, Any]) -> dict[str, Any]:
    """Nested dict -> {"a.b.c": value}; "/" in keys (W&B style) also becomes "."."""
    return {k.replace("/", "."): v for k, v in records.flat(d).items()}


def parse_run_id(run_id: str) -> dict[str, Any]:
    """`{task}__{experiment}__s{seed}__{YYYYmmdd-HHMMSS}` -> its parts ({} if it does not parse)."""
    m = RUN_ID_RE.match(run_id)
    return {**m.groupdict(), "seed": int(m["seed"])} if m else {}


def read_run(run_dir: str | Path) -> RawRun:
    """Read one run directory (docs/run-record.md) into a RawRun."""
    run_dir = Path(run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
    if not isinstance(config, dict):
        raise ValueError(f"{run_dir / 'config.yaml'}: expected a mapping, got {type(config)}")
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text(encoding="utf-8")) if summary_file.is_file() else None
    status, detail = records.read_status(run_dir)
    state = records.read_state(run_dir)  # `crashed`: left running by a process that is gone
    rows, truncated = records.scan_jsonl(run_dir / "metrics.jsonl")
    check_iterations(rows, run_dir / "metrics.jsonl")
    run_id = (summary or {}).get("run_id") or run_dir.name
    forced = bool((summary or {}).get("forced_resume")) or any(r.get("forced") for r in records.read_resumes(run_dir))
    return RawRun(
        run_id=run_id,
        status=state,
        config=flatten(config),
        rows=rows,
        summary=summary,
        error=detail if status in ("failed", "interrupted") else None,
        truncated=truncated,
        location=str(run_dir),
        extra={"forced_resume": forced},
    )


# ---------------------------------------------------------------- RawRun -> frame rows


def method_of(anchor_tau: Any) -> str:
    """ "EMA-PG" when the anchor moves (tau < 1), else "GRPO" (a fixed reference)."""
    return "EMA-PG" if _is_num(anchor_tau) and anchor_tau < 1 else "GRPO"


def variant_of(knobs: dict[str, Any]) -> str:
    """A readable label for one configuration, e.g. "EMA-PG (τ=0.9, P=10; topk k=32, unbiased)"."""
    method = method_of(knobs.get("anchor_tau"))
    kl = str(knobs.get("kl_type") or "?")
    if "topk" in kl.lower():
        kl += f" k={fmt(knobs.get('kl_k'))}" + (f", {knobs['kl_tail']}" if knobs.get("kl_tail") else "")
    if _is_num(knobs.get("kl_coef")) and knobs["kl_coef"] == 0:
        kl = "no KL"
    if method == "EMA-PG":
        return f"EMA-PG (τ={fmt(knobs.get('anchor_tau'))}, P={fmt(knobs.get('anchor_period'))}; {kl})"
    return f"GRPO ({kl})"


def label_coefs(runs: pd.DataFrame) -> dict[str, str]:
    """{run_id: variant with β inside its parentheses, "GRPO (k3, β=0.1)"} for the runs of every task whose runs
    differ in the KL coefficient (a β sweep: else runs at different β would share a label and be pooled).
    Runs without KL ("no KL", β = 0) keep their label."""
    out = {}
    for _, task_runs in runs.groupby("task", dropna=False):
        if task_runs["kl_coef"].dropna().nunique() < 2:
            continue
        for rid, variant, coef in task_runs[["run_id", "variant", "kl_coef"]].itertuples(index=False):
            if _is_num(coef) and coef != 0:
                out[rid] = f"{variant[:-1]}, β={fmt(coef)})" if variant.endswith(")") else f"{variant} (β={fmt(coef)})"
    return out


def mask_inert_knobs(knobs: dict[str, Any]) -> dict[str, Any]:
    """Knobs that cannot affect the run become None, so they neither split nor pool groups:
    kl_k / kl_tail unless the KL type is a Top-k one, anchor_period when the anchor is fixed.
    The configured values stay in the `cfg.*` columns."""
    out = dict(knobs)
    if out.get("kl_type") is not None and "topk" not in str(out["kl_type"]).lower():
        out["kl_k"] = out["kl_tail"] = None
    if method_of(out.get("anchor_tau")) == "GRPO" and out.get("anchor_tau") is not None:
        out["anchor_period"] = None
    return out


def check_iterations(rows: list[dict[str, Any]], path: str | Path) -> None:
    """Refuse (ValueError naming the file, the line and the iteration) rows whose iterations do not strictly
    increase: a run record appends each iteration once and a resume rewinds the file first
    (experiments.records.RunRecord), so two processes wrote such a record and its curves mix both."""
    last, seen = None, set()
    for n, row in enumerate(rows, 1):
        it = row.get("iteration")
        if not _is_num(it):
            continue
        if last is not None and it <= last:
            what = "repeats an iteration already logged" if it in seen else "goes back"
            raise ValueError(
                f"{path}:{n}: iteration {fmt(it)} {what} (the line before it logged iteration {fmt(last)}): "
                "a run record's iterations only increase, so two processes wrote this record; move the run out "
                "of the directory reported on, or keep one writer's lines"
            )
        last = it
        seen.add(it)


def clean_rows(rows: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """(rows, n_relogged): numeric metric rows sorted by iteration, the last line per iteration kept; non-numeric
    values (W&B media, strings), keys starting with "_" and rows without "iteration" dropped."""
    by_iter: dict[int, dict[str, Any]] = {}
    n_seen = 0
    for row in rows:
        if row.get("iteration") is None:
            continue
        n_seen += 1
        clean = {
            k: (float("nan") if v is None else v)
            for k, v in row.items()
            if not k.startswith("_") and (v is None or _is_num(v))
        }
        clean["iteration"] = int(row["iteration"])
        by_iter[clean["iteration"]] = clean
    return [by_iter[i] for i in sorted(by_iter)], n_seen - len(by_iter)


def numerics_label(summary: dict) -> str | None:
    """A run's numerical fingerprint (experiments.records.numerics_key) as one short string, with a digest of every
    field: equal strings = comparable numbers. None for a record without one."""
    key = records.numerics_key(summary)
    if key is None:
        return None
    d = dict(key)
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:6]
    ws = str(d.get("warm_start") or "-")[:8]
    return (
        f"{d.get('mode')} {d.get('aten_capability')}/{d.get('mkl_cbwr')} {d.get('threads')}t "
        f"torch {d.get('versions.torch')} warm start {ws} [{digest}]"
    )


def run_row(raw: RawRun, rows: list[dict[str, Any]], n_relogged: int) -> dict[str, Any]:
    """The `runs` frame row of one run."""
    summary = raw.summary or {}
    from_id = parse_run_id(raw.run_id)
    knobs = {col: _lookup(raw.config, paths) for col, paths in KNOBS.items()}
    for col in ("experiment", "task", "seed"):
        if knobs[col] is None:
            knobs[col] = summary.get(col, from_id.get(col))
    knobs = mask_inert_knobs(knobs)
    final, best = records.final_values(rows), records.best_values(rows)  # summary.json's, by the record's rules
    final.update(summary.get("final") or {})
    best.update(summary.get("best") or {})
    row: dict[str, Any] = {
        "run_id": raw.run_id,
        "status": raw.status,
        "complete": raw.status == "finished",
        "failed": raw.status == "failed",
        "unhealthy": raw.status == records.UNHEALTHY,
        "truncated": raw.truncated,
        "error": _error_line(raw.error),
        **_health_columns(summary.get("health")),
        **knobs,
        "method": method_of(knobs["anchor_tau"]),
        "variant": variant_of(knobs),
        "config_hash": summary.get("config_hash"),
        "config_key": config_key(raw.config),
        "git_sha": summary.get("git_sha"),
        "numerics": numerics_label(summary),
        "wandb_run_id": summary.get("wandb_run_id", raw.extra.get("wandb_run_id")),
        "iterations_done": summary.get("iterations_done", rows[-1]["iteration"] if rows else None),
        "wall_time_s": summary.get("wall_time_s", _last(rows, "time_s")),
        "n_iterations_logged": len(rows),
        "n_relogged": n_relogged,
        "metrics_source": "summary.json" if raw.summary else raw.extra.get("metrics_source", "metrics.jsonl"),
        "source": raw.source,
        "location": raw.location,
        **{k: v for k, v in raw.extra.items() if k not in ("wandb_run_id", "metrics_source")},
    }
    row.update({f"cfg.{k}": (v if _is_scalar(v) else repr(v)) for k, v in raw.config.items()})
    row.update({f"final/{k}": v for k, v in sorted(final.items())})
    row.update({f"best/{k}": v for k, v in sorted(best.items())})
    return row


def config_key(config: dict[str, Any]) -> str | None:
    """Equal for two runs of one configuration and one seed (analysis.report.one_per_config): a digest of the config
    without the keys a run's identity ignores or a resume may change (records.HASH_EXCLUDE, RESUME_MAY_CHANGE), so
    a run and its longer sibling are one seed. From the config: a killed run has no summary.json's config_hash."""
    if not config:
        return None
    free = (*records.HASH_EXCLUDE, *records.RESUME_MAY_CHANGE)
    kept = sorted((k, repr(v)) for k, v in config.items() if not any(k == x or k.startswith(x + ".") for x in free))
    return hashlib.sha256(json.dumps(kept).encode()).hexdigest()[:12]


def frames(raw_runs: Iterable[RawRun]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs_df, metrics_df) from RawRuns; see the module docstring for the columns."""
    run_rows, metric_rows = [], []
    for raw in raw_runs:
        rows, n_relogged = clean_rows(raw.rows)
        rr = run_row(raw, rows, n_relogged)
        run_rows.append(rr)
        ids = {"run_id": raw.run_id, **{k: rr[k] for k in CURVE_KEYS}}
        metric_rows.extend({**ids, **r} for r in rows)
    no_runs = ["run_id", "status", "complete", "failed", "unhealthy", "truncated", *KNOBS, "method", "variant"]
    runs = pd.DataFrame.from_records(run_rows) if run_rows else pd.DataFrame(columns=no_runs)
    lead = ["run_id", *CURVE_KEYS, "iteration", "time_s"]
    metrics = pd.DataFrame.from_records(metric_rows) if metric_rows else pd.DataFrame(columns=lead)
    relabel = label_coefs(runs)
    if relabel:
        runs["variant"] = runs["run_id"].map(relabel).fillna(runs["variant"])
        metrics["variant"] = metrics["run_id"].map(relabel).fillna(metrics["variant"])
    metrics = metrics[[c for c in lead if c in metrics] + sorted(c for c in metrics if c not in lead)]
    return runs, metrics


# ---------------------------------------------------------------- public loaders


def load_runs(root: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs_df, metrics_df) for every run record below `root` (a run, a sweep or a tree)."""
    return frames(read_run(d) for d in find_run_dirs(root))


def load_evals(root: str | Path) -> pd.DataFrame:
    """Per-problem eval outcomes of every run below `root`, one row per (run, iteration, model, benchmark, problem),
    with task/variant/seed; `eval` is the `emapg eval` name (<run>/evals/<name>/), None for training-time rows."""
    parts = []
    for run_dir in find_run_dirs(root):
        rows, _ = records.scan_jsonl(run_dir / "evals.jsonl")
        standalone = [(d.name, records.scan_jsonl(d / records.EVALS)[0]) for d in records.eval_dirs(run_dir)]
        if not rows and not any(r for _, r in standalone):
            continue
        rr = run_row(read_run(run_dir), [], 0)
        ids = {c: rr[c] for c in ("run_id", "task", "variant", "method", "seed", "complete")}
        for name, these in [(None, rows), *standalone]:
            if these:
                df = pd.DataFrame.from_records(these).assign(eval=name)
                df = df.assign(**{c: v for c, v in ids.items() if c not in df})
                parts.append(df[[*ids, *(c for c in df if c not in ids)]])
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=EVAL_COLUMNS.split())


def load_wandb(
    project: str,
    entity: str | None = None,
    group: str | None = None,
    tags: Iterable[str] | None = None,
    *,
    api: Any = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs_df, metrics_df) from W&B, as `load_runs`. Full-resolution history through `run.scan_history()` (never
    the sampled `run.history()`); "final"/"best" recomputed from it (a W&B summary holds only the last value).
    `tags`: keep runs carrying all of them. `api`: a `wandb.Api`-like object; by default `wandb.Api()` (network)."""
    if api is None:
        import wandb

        api = wandb.Api()
    tags = list(tags or [])
    filters = {k: v for k, v in (("group", group), ("tags", {"$in": tags} if tags else None)) if v}
    path = f"{entity}/{project}" if entity else project
    raws = []
    for run in api.runs(path, filters=filters or None):
        if group and getattr(run, "group", None) != group:
            continue
        if tags and not set(tags) <= set(getattr(run, "tags", None) or []):
            continue
        raws.append(wandb_raw_run(run, path))
    return frames(raws)


def wandb_raw_run(run: Any, path: str) -> RawRun:
    """One `wandb.apis.public.Run` -> RawRun (history through scan_history)."""
    config = {k: v for k, v in flatten(dict(run.config or {})).items() if not k.startswith("_")}
    rows = [{"iteration": r.get("_step"), "time_s": r.get("_runtime"), **r} for r in map(dict, run.scan_history())]
    state = str(getattr(run, "state", "unknown"))
    return RawRun(
        run_id=str(config.get("run_id") or getattr(run, "name", None) or run.id),
        status=WANDB_STATES.get(state, state),
        config=config,
        rows=rows,
        source="wandb",
        location=f"{path}/{run.id}",
        extra={
            "wandb_run_id": run.id,
            "wandb_state": state,
            "wandb_group": getattr(run, "group", None),
            "wandb_tags": ",".join(getattr(run, "tags", None) or []),
            "wandb_url": getattr(run, "url", None),
            "metrics_source": "wandb.scan_history",
        },
    )


def _lookup(flat: dict[str, Any], paths: tuple[str, ...]) -> Any:
    return next((flat[p] for p in paths if p in flat and _is_scalar(flat[p])), None)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float))  # bool included: JSON true/false logs as 1/0


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def fmt(v: Any) -> str:
    """A knob or config value as a label shows it: a float in %g, anything else as str."""
    return f"{v:g}" if isinstance(v, float) else str(v)


def _last(rows: list[dict[str, Any]], key: str) -> Any:
    vals = [r[key] for r in rows if _is_num(r.get(key)) and not math.isnan(r[key])]
    return vals[-1] if vals else None


def _health_columns(health: dict | None) -> dict[str, Any]:
    """health_rule, health_iteration, health_message of a stopped_unhealthy run (summary.json["health"]), else {}."""
    return {f"health_{k}": health.get(k) for k in ("rule", "iteration", "message")} if isinstance(health, dict) else {}


def _error_line(text: str | None) -> str | None:
    """The line that names the error: the last line of a traceback, else the first line."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    if not lines:
        return None
    return lines[-1] if lines[0].startswith("Traceback") else lines[0]
