"""`emapg dashboard`: a sweep's review in Weights & Biases, a workspace (saved view) and a report; what they
show is in docs/reports.md ("Reviewing a sweep in W&B").

    spec = dashboard_spec(sweep_dir, SweepInfo.from_spec(spec))   # plain JSON data, from the run records
    urls = publish(spec, entity)    # saves the report, then the workspace (built by analysis.wandb_views)

The spec (SPEC_FILE) is the one description of both, so the sweep's end and a later ``--publish`` build the same
objects. No API key is read or written here: ``wandb login`` (W&B's own) provides it.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from experiments import records
from experiments.errors import UserError
from experiments.wandb_logger import new_run_id, reaching, resolve_mode, settings

SPEC_FILE = "wandb_dashboard.json"  # the dashboard spec in the sweep directory (written offline; read by --publish)
SUMMARY_DIR = "wandb_summary"  # where the sweep-summary run keeps its W&B files and id
SUMMARY_JOB = "sweep-summary"
SPEC_VERSION = 1
# section -> (panel title, metric names or prefixes ending in "/"); eval panels are per benchmark (below)
SECTIONS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "KL": (
        ("KL estimate (kl/value)", ("kl/value",)),
        ("approx KL of the PPO ratio", ("loss/approx_kl",)),
        ("exact KL", ("kl/exact",)),
        ("Top-k statistics", ("topk/",)),
        ("other KL metrics", ("kl/",)),
    ),
    "Anchor": (
        ("anchor drift ||θ - θ_ema|| / ||θ||", ("anchor/drift",)),
        ("anchor distance", ("anchor/dist",)),
        ("anchor updates", ("anchor/num_updates", "anchor/updated")),
        ("other anchor metrics", ("anchor/",)),
    ),
    "Training health": (
        ("reward", ("train/reward",)),
        ("reward std", ("train/reward_std",)),
        ("entropy", ("train/entropy",)),
        ("response length", ("train/response_len",)),
        ("clip and dual-clip fractions", ("loss/clip_frac", "loss/dual_clip_frac")),
        ("grad norm", ("train/grad_norm",)),
        ("health checks", ("health/",)),
    ),
    "Throughput": (("tokens per second", ("perf/tokens_per_s",)), ("seconds per phase", ("perf/",))),
}


class NotLoggedIn(UserError):
    """W&B has no API key on this machine (`wandb login` sets one): publishing is not possible here."""


@dataclass(frozen=True)
class SweepInfo:
    """What the dashboard needs of a sweep spec (sweeps.spec.Spec): name, metric, mode, varied knobs."""

    name: str
    metric: str
    mode: str
    varied: tuple[str, ...]
    raw: dict

    @classmethod
    def from_spec(cls, spec: Any) -> SweepInfo:
        """The varied knobs are the space's keys with more than one value (ranges always vary), never `seed`."""
        varied = [
            key
            for p in spec.space
            if p.kind not in ("grid", "choice") or len(set(map(repr, p.values))) > 1
            for key in p.keys
            if key != "seed"
        ]
        return cls(spec.name, spec.metric, spec.mode, tuple(dict.fromkeys(varied)), dict(spec.raw))


# ---------------------------------------------------------------- the spec (plain data)


def sweep_runs(sweep_dir: Path) -> list[Path]:
    """The sweep's run directories (records.find_trial_run's layout: <sweep_dir>/runs/<run_id>/)."""
    root = Path(sweep_dir) / "runs"
    return sorted(p for p in root.iterdir() if (p / "config.yaml").is_file()) if root.is_dir() else []


def run_logger(run_dirs: Sequence[Path]) -> dict[str, Any]:
    """The runs' logger settings (name, project, mode) from the first run; name "none" when there is no run."""
    if not run_dirs:
        return {"name": "none"}
    cfg = yaml.safe_load((run_dirs[0] / "config.yaml").read_text(encoding="utf-8")) or {}
    lg = cfg.get("logger") or {}
    return {"name": lg.get("name", "wandb"), "project": lg.get("project", "emapg"), "mode": lg.get("mode")}


def check_sweep(sweep_dir: Path) -> list[Path]:
    """The finished runs of a sweep directory; a UserError for a directory that is not a sweep or has none."""
    if not (sweep_dir / "sweep.yaml").is_file():
        raise UserError(f"SWEEP_DIR={sweep_dir}: not a sweep directory (no sweep.yaml; `emapg sweep` writes one)")
    runs = sweep_runs(sweep_dir)
    finished = [d for d in runs if _state(d) == "finished"]
    if not finished:
        raise UserError(
            f"SWEEP_DIR={sweep_dir}: no finished run among its {len(runs)} run record(s); "
            "finish the sweep first (emapg sweep <spec> --resume)"
        )
    return finished


def _state(run_dir: Path) -> str | None:
    try:
        return records.read_state(run_dir)
    except FileNotFoundError:
        return None


def panels(logged: Sequence[str], varied: Sequence[str]) -> list[dict[str, Any]]:
    """Sections of line panels [{"name", "panels": [{"title", "y": [...], "groupby"?}]}], each panel
    naming only logged metrics; a section with none is left out."""
    out = [{"name": "Evaluation", "panels": _eval_panels(logged)}]
    for name, families in SECTIONS.items():
        taken: set[str] = set()
        section = []
        for title, names in families:
            y = [m for m in _match(logged, names) if m not in taken]
            taken.update(y)
            if y:
                section.append({"title": title, "y": y})
        if name == "KL" and "algo.kl.type" in varied and "kl/value" in logged:
            section.append({"title": "kl/value per estimator", "y": ["kl/value"], "groupby": "algo.kl.type"})
        out.append({"name": name, "panels": section})
    return [s for s in out if s["panels"]]


def _match(logged: Sequence[str], names: Sequence[str]) -> list[str]:
    """The logged keys equal to a name, or under a prefix name ending in "/"."""
    return [m for m in logged if any(m == n or (n.endswith("/") and m.startswith(n)) for n in names)]


def _eval_panels(logged: Sequence[str]) -> list[dict[str, Any]]:
    """Per benchmark and measure (acc, pass@1): the policy's and the EMA anchor's curve in one panel."""
    found = [m.groups() for m in map(re.compile(r"^eval/(.+)/([^/]+)$").match, logged) if m]
    out = []
    for bench, measure in sorted(found):
        y = [f"eval/{bench}/{measure}"] + [a for a in [f"eval_anchor/{bench}/{measure}"] if a in logged]
        out.append({"title": f"{bench}: {measure} (policy and EMA anchor)", "y": y})
    return out


def dashboard_spec(sweep_dir: str | Path, info: SweepInfo, project: str | None = None) -> dict[str, Any]:
    """The dashboard of a sweep as plain data; UserError for a directory that is not a sweep or holds no finished
    run."""
    sweep_dir = Path(sweep_dir).resolve()
    finished = check_sweep(sweep_dir)
    logged = sorted({k for d in finished for row in records.read_metrics(d) for k in row} - set(records.RESERVED))
    key = info.metric.removeprefix("best_")
    return {
        "version": SPEC_VERSION,
        "sweep": info.name,
        "sweep_dir": str(sweep_dir),
        "project": project or run_logger(finished)["project"],
        "group": info.name,
        "grouping": list(info.varied),
        "metric": key,
        "mode": info.mode,
        "logged": logged,
        "sections": panels(logged, info.varied),
        "parallel_coordinates": [*(f"config:{k}" for k in info.varied), f"summary:{key}"],
        "view": info.name,
        "report": report_content(sweep_dir, info),
    }


def report_content(sweep_dir: Path, info: SweepInfo) -> dict[str, Any]:
    """The report's text: `emapg report`'s Markdown tables (written into <sweep_dir>/report if absent),
    its figures (the media keys the sweep-summary run logs them under), the command and sweep.yaml."""
    out = sweep_dir / "report"
    if not (out / "index.md").is_file():
        from analysis.report import report  # loads pandas, matplotlib

        report(sweep_dir, out)
    tables = [
        {"title": p.stem, "markdown": p.read_text(encoding="utf-8")}
        for p in sorted(out.glob("*.md"))
        if p.name != "index.md"
    ]
    return {
        "title": f"Sweep {info.name}"[:128],
        "description": f"{info.metric} ({info.mode}) over {', '.join(info.varied) or 'seeds only'}",
        "tables": tables,
        "figures": list(report_figures(sweep_dir)),
        "command": f"emapg sweep {sweep_dir / 'sweep.yaml'} --out <new dir>",
        "config": yaml.safe_dump(info.raw, sort_keys=False),
    }


def report_figures(sweep_dir: Path) -> dict[str, Path]:
    """The report's figures (PNG in <sweep_dir>/report) by the media key the sweep-summary run logs them under."""
    return {f"figures/{p.stem}": p for p in sorted((Path(sweep_dir) / "report").glob("*.png"))}


def write_spec(sweep_dir: str | Path, spec: dict[str, Any]) -> Path:
    """<sweep_dir>/wandb_dashboard.json (atomic); returns its path."""
    path = Path(sweep_dir) / SPEC_FILE
    records.atomic_write(path, json.dumps(spec, indent=1, sort_keys=True) + "\n")
    return path


def read_spec(sweep_dir: str | Path) -> dict[str, Any]:
    """The spec written by `emapg dashboard` (offline); UserError when there is none."""
    path = Path(sweep_dir) / SPEC_FILE
    if not path.is_file():
        raise UserError(
            f"--publish: {path} does not exist; run `emapg dashboard {sweep_dir}` first (it writes the spec)"
        )
    return json.loads(path.read_text(encoding="utf-8"))


# ---------------------------------------------------------------- publishing (network: W&B's API)


def publish(spec: dict, entity: str | None = None, project: str | None = None) -> dict[str, str]:
    """Save the report, then the workspace linking to it; returns their URLs. Needs `wandb login`."""
    import wandb

    from analysis.wandb_views import check_target, wandb_report, workspace  # wandb_workspaces

    try:
        api = wandb.Api()
    except wandb.errors.UsageError as err:  # no API key: W&B's own login is the fix
        raise NotLoggedIn(f"W&B is not logged in ({err}); run `wandb login`, then publish again") from None
    entity = entity or api.default_entity
    if not entity:
        raise UserError("--entity: none given and W&B has no default entity for this login; pass --entity")
    spec = {**spec, "project": project or spec["project"]}
    check_target(api, entity, spec["project"])
    rep = wandb_report(spec, entity)
    rep.save()
    view = workspace(spec, entity, report_url=rep.url)
    view.save()
    return {"report": rep.url, "workspace": view.url}


def publish_hint(sweep_dir: Path, entity: str | None = None, project: str | None = None) -> str:
    """The commands that publish an offline sweep later (from a machine with internet access)."""
    opts = "".join(f" --{k} {v}" for k, v in (("entity", entity), ("project", project)) if v)
    return (
        "publish later (where W&B is reachable, e.g. a cluster's login node):\n"
        f"  wandb sync {sweep_dir}/runs/*/wandb/offline-run-* {sweep_dir}/{SUMMARY_DIR}/wandb/offline-run-*\n"
        f"  emapg dashboard {sweep_dir} --publish{opts}"
    )


# ---------------------------------------------------------------- the sweep-summary run


def trials_table(sweep_dir: Path, info: SweepInfo) -> tuple[list[str], list[list[Any]]]:
    """(columns, rows) of the trials: status, varied knobs, seed, final and best sweep metric, run ids
    (sweep.csv, written by sweeps.results from the run records; the W&B id from each run's wandb_run.json)."""
    key = info.metric.removeprefix("best_")
    path = Path(sweep_dir) / "sweep.csv"
    rows = list(csv.DictReader(path.open(encoding="utf-8"))) if path.is_file() else []
    cols = ["trial_id", "status", *info.varied, "seed", f"final/{key}", f"best/{key}", "run_id", "wandb_run_id"]
    out = []
    for r in rows:
        run_dir = Path(sweep_dir) / "runs" / r.get("run_id", "")
        wid = records.read_wandb_state(run_dir).get("id") if r.get("run_id") else None
        out.append([_cell(r.get(c)) for c in cols[:-1]] + [wid])
    return cols, out


def _cell(v: str | None) -> Any:
    """A CSV cell as a number where it reads as one (W&B tables type their columns)."""
    if v in (None, ""):
        return None
    try:
        return float(v)
    except ValueError:
        return v


def log_summary_run(sweep_dir: str | Path, info: SweepInfo) -> str | None:
    """The sweep-summary W&B run (job_type sweep-summary, the sweep's group): a table of the trials and the
    report's figures. Same project and mode as the runs (offline unless set online); resumed under the
    id kept in <sweep_dir>/wandb_summary/. Returns the W&B run id, or None when the runs log no W&B."""
    sweep_dir = Path(sweep_dir)
    lg = run_logger(sweep_runs(sweep_dir))
    mode = resolve_mode(lg.get("mode")) if lg["name"] != "none" else "disabled"
    if mode == "disabled":
        return None
    import wandb

    where = sweep_dir / SUMMARY_DIR
    where.mkdir(parents=True, exist_ok=True)
    run_id = records.read_wandb_state(where).get("id") or new_run_id()
    state = {"id": run_id, "last_step": None, "project": lg["project"], "mode": mode}
    records.atomic_write(where / records.WANDB_STATE, json.dumps(state) + "\n")
    cols, rows = trials_table(sweep_dir, info)
    with reaching("the sweep's W&B summary run (logger.mode=online)", "set WANDB_MODE=offline"):
        run = wandb.init(
            project=lg["project"], group=info.name, job_type=SUMMARY_JOB, name=f"{info.name}__summary", id=run_id,
            resume="allow", dir=str(where), mode=mode, config={"sweep": info.raw}, tags=[f"sweep:{info.name}"],
            reinit="create_new", settings=settings(),
        )  # fmt: skip
    try:
        figures = {key: wandb.Image(str(p)) for key, p in report_figures(sweep_dir).items()}
        run.log({"trials": wandb.Table(columns=cols, data=rows), **figures})
    finally:
        run.finish()
    return run_id


# ---------------------------------------------------------------- entry points


def after_sweep(sweep_dir: str | Path, info: SweepInfo, say: Callable[[str], None] = print) -> None:
    """The end of `emapg sweep`: the sweep-summary run, then the dashboard, published when W&B is online,
    else its spec written with the commands that publish it later. Nothing with logger=none."""
    sweep_dir = Path(sweep_dir)
    if log_summary_run(sweep_dir, info) is None:  # the runs log no W&B
        return
    spec = dashboard_spec(sweep_dir, info)
    path = write_spec(sweep_dir, spec)
    if resolve_mode(run_logger(sweep_runs(sweep_dir))["mode"]) != "online":
        say(f"  W&B dashboard spec: {path}\n  {publish_hint(sweep_dir)}")
        return
    try:
        urls = publish(spec)
    except Exception as err:  # noqa: BLE001  the sweep's results stand; say how to publish later
        say(f"  W&B dashboard not published ({type(err).__name__}: {err}); spec: {path}\n  {publish_hint(sweep_dir)}")
        return
    say(f"  W&B report: {urls['report']}\n  W&B workspace: {urls['workspace']}")


def main(argv: Sequence[str] | None, load_sweep: Callable[[Path], SweepInfo]) -> int:
    """`emapg dashboard SWEEP_DIR [--entity E] [--project P] [--publish]`. `load_sweep` reads a sweep.yaml
    into a SweepInfo (the caller passes the sweep package's reader: analysis does not import it)."""
    p = argparse.ArgumentParser(prog="emapg dashboard", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep_dir", help="a sweep directory (emapg sweep --out)")
    p.add_argument("--entity", help="W&B entity (default: your login's default entity)")
    p.add_argument("--project", help="W&B project (default: the runs' logger.project)")
    p.add_argument("--publish", action="store_true", help=f"save the workspace and report from {SPEC_FILE}")
    a = p.parse_args(argv)
    sweep_dir = Path(a.sweep_dir).resolve()
    if a.publish:
        urls = publish(read_spec(sweep_dir), a.entity, a.project)
        print(f"W&B report: {urls['report']}\nW&B workspace: {urls['workspace']}")
        return 0
    finished = check_sweep(sweep_dir)
    spec = dashboard_spec(sweep_dir, load_sweep(sweep_dir / "sweep.yaml"), a.project)
    path = write_spec(sweep_dir, spec)
    print(f"wrote {path}: {sum(len(s['panels']) for s in spec['sections'])} panels in {len(spec['sections'])} sections")
    if resolve_mode(run_logger(finished)["mode"]) != "online":
        print(publish_hint(sweep_dir, a.entity, a.project))
        return 0
    try:
        urls = publish(spec, a.entity, a.project)
    except NotLoggedIn as err:  # online but no credentials here: publish from where there are
        print(f"{err}\n{publish_hint(sweep_dir, a.entity, a.project)}")
        return 0
    print(f"W&B report: {urls['report']}\nW&B workspace: {urls['workspace']}")
    return 0
