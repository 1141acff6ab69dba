"""`emapg report` and `emapg figures`: write every table and figure the data supports.

    emapg report outputs/sweeps/quickstart --out outputs/report      # from run records
    emapg figures --out outputs/figures                              # no training: audit records

    paths = report("outputs/sweeps/quickstart", "outputs/report")    # -> list[Path]
    paths = figures(ema_pg_core.audit.<fn>(), "outputs/figures")     # records are plain data

What `report` writes per task, as far as the logged metrics support it (the rest is listed under "Skipped"):
    <task>_main.{md,tex,csv}             the task's REPORTING table (paper-format, with the paper's numbers, for a
                                         task with benchmarks; else policy acc, pass@1 and anchor acc)
    <task>_passk.{md,tex,csv}            unbiased pass@k from evals.jsonl
    <task>_curve_<benchmark>, <task>_dynamics, <task>_ablation_<knob>, <task>_beta_tau_map, <task>_kl_probe,
    <task>_topk_coverage .{png,pdf}      the figures (analysis.figures)
and runs.{md,tex,csv}, unhealthy.{md,tex,csv}, index.{md,html}, provenance.json (analysis.index) and
emapg_output.json (analysis.outdir: which `out_dir` may be written, and how it is replaced whole).

A (configuration, seed) counts once (`one_per_config`). Numbers use finished runs only unless
`include_incomplete`, and never runs stopped by a health rule: those get their own table. This module never
imports the core: `main_figures` receives the audit records from its caller.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from analysis import audit_schema, load, outdir, tables
from analysis.figures import ablation, audit, beta_tau_map, curves, style, topk_coverage
from analysis.index import Output, run_provenance, write_index
from experiments import records as run_records
from experiments.tasks import reporting

Frame = pd.DataFrame
Evals = Frame | None  # the rows of evals.jsonl (analysis.load.load_evals); None: not loaded
Built = tuple[list[Output], list[str]]  # (outputs written, notes on what was skipped and why)
REPORT, FIGURES = "emapg report", "emapg figures"  # what analysis.outdir.MARKER says wrote a directory
REPS = 2000  # bootstrap resamples behind every CI of a report (`emapg report --reps`)
ABLATION_KNOBS = ("anchor_tau", "anchor_period", "kl_k", "kl_type", "kl_tail", "kl_coef")
# audit record key -> (figure, its file stem being the function's name, index title)
FIGURE_RENDERERS = (
    ("estimator_table", audit.kl_estimators_bias, "KL estimators: |bias| and variance (log scale)"),
    ("topk_sweep", audit.topk_variance, "Top-k KL: variance and bias vs k (k=0 sampled to k=|V| exact)"),
    ("anchor_horizon", audit.anchor_horizon, "EMA anchor half-life and time constant vs τ, period [ours]"),
    ("stability_grid", audit.stability_region, f"EMA-PG stability region {style.OURS_TOY}"),
)


# ---------------------------------------------------------------- emapg report


def _table(t: tables.Table, out: Path, title: str, prov: dict[str, Any], **kw: Any) -> Output:
    """Write table `t` into `out`; its front-page entry."""
    return Output("table", title, tables.write_table(t, out), prov, t.cells, notes=t.notes, **kw)


def _figure(fig: Any, out: Path, name: str, title: str, runs: Frame) -> Output:
    """Save `fig` as <out>/<name>.{png,pdf}; its front-page entry."""
    stem = re.sub(r"[^A-Za-z0-9_.@-]+", "_", name)
    return Output("figure", title, style.save(fig, out / stem), run_provenance(runs))


def report(
    runs_dir: str | Path, out_dir: str | Path, *, reps: int = REPS, seed: int = 0, include_incomplete: bool = False
) -> list[Path]:
    """Load every run record below `runs_dir` and write the report into `out_dir` (checked before any work)."""
    outdir.check(out_dir, REPORT)
    runs, metrics = load.load_runs(runs_dir)
    if runs.empty:
        raise ValueError(f"no run records (config.yaml + status) found below {runs_dir}")
    kw = dict(reps=reps, seed=seed, include_incomplete=include_incomplete)
    evals, metric = load.load_evals(runs_dir), _sweep_metric(Path(runs_dir))
    return report_frames(runs, metrics, out_dir, evals=evals, source=str(runs_dir), sweep_metric=metric, **kw)


def report_frames(
    runs: pd.DataFrame,
    metrics: pd.DataFrame,
    out_dir: str | Path,
    *,
    evals: pd.DataFrame | None = None,
    source: str = "",
    sweep_metric: str | None = None,
    reps: int = REPS,
    seed: int = 0,
    include_incomplete: bool = False,
) -> list[Path]:
    """The report from already loaded frames (analysis.load.load_runs or load_wandb)."""
    with outdir.replacing(out_dir, REPORT, {"source": source or "frames"}) as out:
        outputs: list[Output] = []
        prov = run_provenance(runs)
        all_runs = _table(tables.runs_table(runs), out, "All runs with status", prov, section="All runs")
        unhealthy = runs["unhealthy"].astype(bool)  # stopped by a health rule: listed apart, never in a number
        keep = runs[(runs["complete"].astype(bool) | include_incomplete) & ~unhealthy]
        skipped = _left_out_notes(runs[~unhealthy], keep)
        keep, repeats = one_per_config(keep)
        skipped += repeats
        for note in repeats:  # also on the front page and in its notes
            print(f"warning: {note}", file=sys.stderr, flush=True)
        for task in sorted(keep["task"].dropna().unique()):
            # columns logged only by other tasks are all-NaN here: drop them
            t_runs = keep[keep["task"] == task].dropna(axis=1, how="all")
            t_metrics = metrics[metrics["run_id"].isin(t_runs["run_id"])].dropna(axis=1, how="all")
            t_evals = evals[evals["run_id"].isin(t_runs["run_id"])] if evals is not None and not evals.empty else None
            for build in (_task_tables, _task_curves, _task_ablations, _task_beta_tau_map, _task_telemetry):
                o, s = build(task, t_runs, t_metrics, t_evals, out, reps=reps, seed=seed, sweep_metric=sweep_metric)
                outputs += [replace(x, section=task) for x in o]
                skipped += s
        if unhealthy.any():
            stopped = runs[unhealthy]
            title = "Stopped by a health rule (in no number)"
            table = tables.unhealthy_table(stopped)
            outputs.append(_table(table, out, title, run_provenance(stopped), section="Stopped unhealthy"))
        outputs.append(all_runs)  # last on the page
        header = _report_header(runs, source, reps, seed, include_incomplete) + _repeats_line(repeats)
        paths = write_index(out, REPORT, header, outputs, skipped)
    return outdir.moved(paths, out, out_dir)


def one_per_config(runs: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """Each (configuration, seed) once (docs/reports.md, "What a report counts"): of the runs with one
    ``config_key`` (analysis.load), the finished one with the most iterations is kept (then the first run id).
    Returns the kept runs and one note per run left out, naming its directory, the kept one's and how they differ."""
    if "config_key" not in runs or runs.empty:
        return runs, []
    order = runs.assign(_done=runs["complete"].astype(bool), _its=runs["iterations_done"].fillna(-1))
    order = order.sort_values(["_done", "_its", "run_id"], ascending=[False, False, True])
    keyed = order[order["config_key"].notna()]
    repeated = keyed[keyed.duplicated("config_key", keep="first")]
    kept = keyed.drop_duplicates("config_key", keep="first").set_index("config_key")
    notes = []
    for _, dup in repeated.iterrows():
        first = kept.loc[dup["config_key"]]
        diff = _differing(dup, first)
        notes.append(
            f"{_where(dup)} repeats the configuration and seed of {_where(first)} "
            f"({'differing in ' + diff if diff else 'the same settings'}): not counted; {first['run_id']} is "
            f"(of such runs, the finished one with the most iterations done is counted: "
            f"{load.fmt(dup['iterations_done'])} vs {load.fmt(first['iterations_done'])})"
        )
    return runs[~runs["run_id"].isin(repeated["run_id"])], notes


def _where(run: pd.Series) -> str:
    """A run's directory (its W&B path for W&B runs), else its id."""
    loc = run.get("location")
    return str(loc) if isinstance(loc, str) and loc else str(run["run_id"])


def _differing(a: pd.Series, b: pd.Series) -> str:
    """ "trainer.iterations: 6 vs 12; ..." for the config entries (cfg.* columns) two runs set differently, less
    the run-local ones (experiments.records.HASH_EXCLUDE: where and how a run is logged)."""
    out = []
    for col in sorted(c for c in a.index if c.startswith("cfg.")):
        key = col[4:]
        if any(key == x or key.startswith(x + ".") for x in run_records.HASH_EXCLUDE):
            continue
        x, y = a.get(col), b.get(col)
        if not tables.same(x, y):
            out.append(f"{key}: {load.fmt(x)} vs {load.fmt(y)}")
    return "; ".join(out)


def _repeats_line(repeats: list[str]) -> list[str]:
    """The front page's warning when runs were left out as repeats of a (configuration, seed) counted once."""
    if not repeats:
        return []
    return [
        f"**Warning: {len(repeats)} run(s) repeat the configuration and seed of another run and are not counted** "
        "(counting them would count one seed twice and narrow every CI): each is named under Skipped with the run "
        "counted instead and the settings in which they differ; move the runs you do not mean out of the "
        "directory reported on."
    ]


def _left_out_notes(runs: pd.DataFrame, keep: pd.DataFrame) -> list[str]:
    """Index notes on the runs outside the numbers (unfinished) or outside every task (no task name), and
    on the kept runs resumed with resume=force."""
    excluded = runs[~runs["run_id"].isin(keep["run_id"])]
    forced = keep[keep["forced_resume"].fillna(False).astype(bool)] if "forced_resume" in keep else keep[:0]
    no_task = keep[keep["task"].isna()]
    listed = {  # what the runs are -> their ids
        "not finished, left out of every number": [
            f"{r.run_id} ({r.status}{', truncated' if r.truncated else ''})" for r in excluded.itertuples()
        ],
        "resumed with resume=force: their settings changed mid-run (each change is in the run's resumes.jsonl); "
        "their numbers are in the tables": forced["run_id"],
        "without task.name in config.yaml or summary.json, in no per-task output": no_task["run_id"],
    }
    return [f"{len(ids)} run(s) {what}: " + ", ".join(ids) for what, ids in listed.items() if len(ids)]


def _report_header(runs: pd.DataFrame, source: str, reps: int, seed: int, include_incomplete: bool) -> list[str]:
    """The front page's opening lines: where the runs came from, their statuses, which runs count."""
    found = ", ".join(f"{v} {k}" for k, v in sorted(runs["status"].value_counts().items()))
    used = "all runs, including unfinished ones" if include_incomplete else "finished runs only"
    return [
        f"Source: {source or 'frames'}; {len(runs)} runs found ({found}).",
        f"Numbers use {used} (never runs stopped by a health rule: they are listed apart). "
        f"Bootstrap: {reps} resamples, seed {seed}.",
        "Gains, P(improvement) and decisions are paired where the two methods ran the same seeds on the same "
        'task and data settings (same warm start, data order and sampling streams; marked "paired, n seeds"), '
        'and unpaired otherwise (marked "unpaired"). A decision is an exact permutation test at 5% (at most 5% '
        "false 'clear' at any n); with fewer than 6 paired seeds no comparison can be clear at 95%.",
        _numerics_line(runs),
    ]


def _numerics_line(runs: pd.DataFrame) -> str:
    """Which numerical fingerprints (analysis.load.numerics_label) the runs computed under; a warning when several."""
    labels = runs["numerics"].dropna() if "numerics" in runs else pd.Series([], dtype=object)
    missing = len(runs) - len(labels)
    unknown = f"; {missing} run(s) recorded none (older records, verl runs)" if missing else ""
    counts = labels.value_counts()
    if len(counts) == 0:
        return "Numerics: no run recorded its numerical fingerprint."
    if len(counts) == 1:
        return f"Numerics: every run with a fingerprint computed under one: {counts.index[0]}{unknown}."
    listed = "; ".join(f"{n} run(s): {label}" for label, n in counts.items())
    return (
        f"**Warning: the runs computed under {len(counts)} numerical fingerprints** ({listed}{unknown}): runs of "
        "different fingerprints differ by their machine or library versions as well as their settings, and a table "
        "row that mixes them says so in its notes (docs/run-record.md, numerics)."
    )


def _task_tables(
    task: str, runs: Frame, metrics: Frame, evals: Evals, out: Path, *, reps: int, seed: int, **_: Any
) -> Built:
    spec = reporting(task)
    if not any(tables.find_benchmarks(runs.columns, "final/eval/", m) for m in ("acc", "pass@1")):
        return [], [f"{task}: no eval metric logged; no result table"]
    if spec.benchmarks:
        weights = _problem_counts(evals, spec.benchmarks, spec.names) if evals is not None else None
        t = tables.paper_table(runs, task, weights=weights, reps=reps, seed=seed)
        title = f"{task}: paper-format table, reproduced vs reported"
    else:
        t = tables.tiny_table(runs, task, reps=reps, seed=seed)
        title = f"{task}: policy acc, pass@1 and anchor acc per method"
    prov = run_provenance(runs)
    outputs = [_table(t, out, title, prov)]
    if evals is not None and "eval" in evals and evals["eval"].notna().any():  # one row per variant and `emapg eval`
        ev = evals[evals["eval"].notna()]
        ev = ev.assign(run_id=ev["run_id"] + "/" + ev["eval"], variant=ev["variant"] + " · eval " + ev["eval"])
        pk = tables.passk_table(ev, task, reps=reps, seed=seed, name=f"{task}_passk_eval", when="by `emapg eval`")
        outputs.append(_table(pk, out, f"{task}: unbiased pass@k of `emapg eval` (policy and anchor)", prov))
    evals = evals[evals["eval"].isna()] if evals is not None and "eval" in evals else evals
    if evals is None or evals.empty:
        return outputs, [f"{task}: no evals.jsonl; no pass@k table"]
    pk = tables.passk_table(evals, task, reps=reps, seed=seed)
    return [*outputs, _table(pk, out, f"{task}: unbiased pass@k (policy and anchor)", prov)], []


def _task_curves(
    task: str, runs: Frame, metrics: Frame, evals: Evals, out: Path, *, reps: int, seed: int, **_: Any
) -> Built:
    outputs, skipped = [], []
    for bench, metric in _curve_metrics(task, metrics.columns).items():
        anchor = metric.replace("eval/", "eval_anchor/", 1)
        label = task if bench == task else f"{task} · {bench}"  # a tiny task is its own benchmark
        fig = curves.learning_curves(metrics, metric, anchor, reps=reps, seed=seed, title=f"{label}: learning curves")
        title = f"{label}: {metric} (and the anchor's) vs iteration"
        outputs.append(_figure(fig, out, f"{task}_curve_{bench}", title, runs))
    if not outputs:
        skipped.append(f"{task}: no eval metric logged; no learning curves")
    try:
        fig = curves.training_dynamics(metrics, reps=reps, seed=seed, title=f"{task}: training dynamics")
        outputs.append(_figure(fig, out, f"{task}_dynamics", f"{task}: KL value and anchor drift vs iteration", runs))
    except ValueError as err:
        skipped.append(f"{task}: dynamics figure: {err}")
    return outputs, skipped


def _task_ablations(
    task: str, runs: Frame, metrics: Frame, evals: Evals, out: Path, *, reps: int, seed: int, sweep_metric: str | None
) -> Built:
    outputs, skipped = [], []
    runs, score = _with_score(task, runs, sweep_metric)
    if score is None:
        return [], [f"{task}: no final eval metric; no ablation figures"]
    varying = [k for k in ABLATION_KNOBS if k in runs and runs[k].dropna().nunique() > 1]
    for knob in varying:
        others = [k for k in varying if k != knob]
        sub, hue = runs, "other knobs" if others else None
        if others:
            held = runs[others].apply(lambda r: ", ".join(f"{k}={load.fmt(v)}" for k, v in r.items()), axis=1)
            sub = runs.assign(**{hue: held})
            if sub.groupby(hue)[knob].nunique().max() < 2:
                skipped.append(
                    f"{task}: {knob} never varies with the other knobs held fixed "
                    f"({', '.join(others)} change with it); no ablation figure"
                )
                continue
        title = f"{task}: ablation over the {style.knob_name(knob)}"
        fig = ablation.make(sub, knob, score, hue=hue, reps=reps, seed=seed, title=title)
        outputs.append(_figure(fig, out, f"{task}_ablation_{knob}", f"{task}: {score} vs {knob}", runs))
    if not varying:
        skipped.append(f"{task}: no knob varies across runs; no ablation figures")
    return outputs, skipped


def _task_telemetry(
    task: str, runs: Frame, metrics: Frame, evals: Evals, out: Path, *, reps: int, seed: int, **_: Any
) -> Built:
    """KL telemetry: kl/exact vs kl/estimate_on_probe per method, and Top-k coverage vs k when k varies."""
    outputs, skipped = [], []
    try:
        fig = curves.kl_probe(metrics, reps=reps, seed=seed, title=f"{task}: exact KL vs its estimate on the probe")
        outputs.append(_figure(fig, out, f"{task}_kl_probe", f"{task}: kl/exact vs kl/estimate_on_probe", runs))
    except ValueError as err:
        skipped.append(f"{task}: KL probe figure: {err}")
    if "kl_k" in runs and runs["kl_k"].dropna().nunique() > 1:
        try:
            fig = topk_coverage.make(metrics, runs, reps=reps, seed=seed, title=f"{task}: Top-k coverage vs k")
            title = f"{task}: Top-k head mass and coverage vs k"
            outputs.append(_figure(fig, out, f"{task}_topk_coverage", title, runs))
        except ValueError as err:
            skipped.append(f"{task}: Top-k coverage figure: {err}")
    return outputs, skipped


def _task_beta_tau_map(
    task: str, runs: Frame, metrics: Frame, evals: Evals, out: Path, *, sweep_metric: str | None, **_: Any
) -> Built:
    """The β × τ heatmaps (figures/beta_tau_map) when both the KL coefficient and τ vary, τ = 1 among them."""
    runs, score = _with_score(task, runs, sweep_metric)
    knobs = ("kl_coef", "anchor_tau")
    if score is None or not all(k in runs and runs[k].dropna().nunique() > 1 for k in knobs):
        return [], []
    if not (runs["anchor_tau"] == beta_tau_map.BASELINE_TAU).any():
        return [], [f"{task}: β and τ vary but no run has τ = 1; no β × τ map (its gains are over τ = 1)"]
    anchor = score.replace("final/eval/", "final/eval_anchor/", 1)
    anchor = anchor if anchor in runs else None
    fig = beta_tau_map.make(runs, score, anchor, title=f"{task}: the β × τ map")
    return [_figure(fig, out, f"{task}_beta_tau_map", f"{task}: β × τ map ({score})", runs)], []


# ---------------------------------------------------------------- emapg figures


def figures(records: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """Render the no-training outputs from audit records (analysis.audit_schema) into `out_dir` (analysis.outdir: a
    new or empty directory, or a previous output of `figures`, which is replaced whole)."""
    frames = audit_schema.check_records(records)
    meta = dict(records.get("meta") or {})
    prov = {"computed by": "ema_pg_core.audit", **meta}
    outputs, skipped = [], []
    with outdir.replacing(out_dir, FIGURES, {"source": "ema_pg_core.audit"}) as out:
        if "estimator_table" in frames:
            t = tables.estimator_table(frames["estimator_table"], meta)
            outputs.append(_table(t, out, "KL estimators: bias, variance, memory", prov, section="Audit records"))
        for key, make, title in FIGURE_RENDERERS:
            if key not in frames:
                skipped.append(f"{key}: not in the audit records")
                continue
            files = style.save(make(frames[key]), out / make.__name__)
            outputs.append(Output("figure", title, files, prov, section="Audit records"))
        about = "Computed by ema_pg_core.audit (exact enumeration / Monte Carlo); rendered by analysis."
        paths = write_index(out, f"{FIGURES} (no training)", [about], outputs, skipped)
    return outdir.moved(paths, out, out_dir)


# ---------------------------------------------------------------- CLI entry points


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def main_report(argv: Sequence[str] | None = None) -> int:
    """`emapg report <runs-or-sweep-dir> --out <dir>`, or `emapg report --wandb-project P ...`."""
    p = argparse.ArgumentParser(prog="emapg report", description=main_report.__doc__)
    p.add_argument("runs_dir", nargs="?", help="a run, sweep or tree of run records")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--reps", type=_positive, default=REPS, help=f"bootstrap resamples (default {REPS})")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    p.add_argument("--include-incomplete", action="store_true", help="use unfinished runs in numbers")
    p.add_argument("--wandb-project", help="read runs from W&B instead of a directory (needs network)")
    p.add_argument("--wandb-entity")
    p.add_argument("--wandb-group")
    p.add_argument("--wandb-tag", action="append", default=[])
    a = p.parse_args(argv)
    if bool(a.runs_dir) == bool(a.wandb_project):
        p.error("give exactly one of RUNS_DIR or --wandb-project")
    kw = dict(reps=a.reps, seed=a.seed, include_incomplete=a.include_incomplete)
    # no records, a corrupt record, an --out that is not the report's: ValueError / OSError, one line and exit 2
    # through the CLI's one error path (experiments.errors.handle)
    if a.runs_dir:
        paths = report(a.runs_dir, a.out, **kw)
    else:
        outdir.check(a.out, REPORT)
        runs, metrics = load.load_wandb(a.wandb_project, a.wandb_entity, a.wandb_group, a.wandb_tag)
        if runs.empty:
            raise ValueError(f"no W&B runs matched project={a.wandb_project} group={a.wandb_group} tags={a.wandb_tag}")
        paths = report_frames(runs, metrics, a.out, source=f"W&B {a.wandb_project}", **kw)
    print(f"wrote {len(paths)} files; open {Path(a.out) / 'index.html'}")
    return 0


def main_figures(argv: Sequence[str] | None, audit_fn: Callable[[], Mapping[str, Any]] | Mapping[str, Any]) -> int:
    """`emapg figures --out <dir>`. `audit_fn`: the core's audit function, called with no
    arguments (bind options with functools.partial), or the records themselves."""
    p = argparse.ArgumentParser(prog="emapg figures", description="Figures that need no training.")
    p.add_argument("--out", required=True, help="output directory")
    a = p.parse_args(argv)
    outdir.check(a.out, FIGURES)  # before the audit's work: a refused --out is one line, exit 2
    records = audit_fn() if callable(audit_fn) else audit_fn
    paths = figures(records, a.out)
    print(f"wrote {len(paths)} files; open {Path(a.out) / 'index.html'}")
    return 0


def _curve_metrics(task: str, columns: Sequence[str]) -> dict[str, str]:
    """benchmark -> the eval metric to plot: the first of the task's REPORTING.metrics that it logs."""
    found: dict[str, str] = {}
    for metric in reversed(reporting(task).metrics):
        found.update(tables.find_benchmarks(columns, "eval/", metric))
    return dict(sorted(found.items()))


def _with_score(task: str, runs: pd.DataFrame, sweep_metric: str | None) -> tuple[pd.DataFrame, str | None]:
    """The per-run score for ablations: the sweep's metric when logged, else the final eval
    metric (mean over benchmarks when there are several)."""
    if sweep_metric and f"final/{sweep_metric}" in runs:
        return runs, f"final/{sweep_metric}"
    cols = [c for c in runs.columns if c.startswith("final/")]
    bench = {b: f"final/{c}" for b, c in _curve_metrics(task, [c[6:] for c in cols]).items()}
    if not bench:
        return runs, None
    if len(bench) == 1:
        return runs, next(iter(bench.values()))
    metric = next(iter(bench.values())).rsplit("/", 1)[1]
    name = f"final/eval/mean of {len(bench)} benchmarks/{metric}"
    return runs.assign(**{name: runs[list(bench.values())].mean(axis=1, skipna=False)}), name


def _problem_counts(evals: pd.DataFrame, benchmarks: Sequence[str], names: Mapping[str, str]) -> dict | None:
    """Problems per benchmark (display names, via the task's `names`) when evals cover every benchmark, else None."""
    per_benchmark = evals.groupby("benchmark")["problem_id"].nunique()
    counts = {names.get(tables.normalise(b), b): n for b, n in per_benchmark.items()}
    return {b: float(counts[b]) for b in benchmarks} if all(b in counts for b in benchmarks) else None


def _sweep_metric(root: Path) -> str | None:
    """The `metric` of a sweep directory's sweep.yaml, if any."""
    spec = root / "sweep.yaml"
    data = yaml.safe_load(spec.read_text(encoding="utf-8")) if spec.is_file() else None
    metric = data.get("metric") if isinstance(data, dict) else None
    return metric if isinstance(metric, str) else None
