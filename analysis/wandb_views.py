"""The W&B objects of a sweep's dashboard, built from its spec (analysis.dashboard.dashboard_spec): the workspace
(saved view) and the report, and the check that W&B knows where they would be saved. Nothing here is saved;
analysis.dashboard.publish saves them. A module of its own so that the dashboard's offline path never loads
wandb_workspaces (it imports wandb)."""

from __future__ import annotations

import hashlib

import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws
from wandb_workspaces import expr
from wandb_workspaces._graphql import execute_graphql

from experiments.errors import UserError


def _stable(obj, *parts: str):
    """Give a panel or runset an id derived from its place (the library draws random ones), so that equal
    specs build equal objects (the --publish round trip)."""
    object.__setattr__(obj, "_id", hashlib.sha256("/".join(parts).encode()).hexdigest()[:12])
    return obj


def _line(spec: dict, section: str, p: dict):
    groupby = wr.Config(p["groupby"]) if p.get("groupby") else None
    kw = dict(groupby_aggfunc="mean", groupby_rangefunc="minmax", smoothing_type="none")
    plot = wr.LinePlot(title=p["title"], x="Step", y=list(p["y"]), groupby=groupby, **kw)
    return _stable(plot, spec["sweep"], section, p["title"])


def _columns(spec: dict) -> list:
    """Parallel-coordinates axes: the varied knobs (config), then the sweep's metric (summary)."""
    kinds = {"config": wr.Config, "summary": wr.SummaryMetric}
    return [
        wr.ParallelCoordinatesPlotColumn(metric=kinds[c.split(":")[0]](c.split(":", 1)[1]))
        for c in spec["parallel_coordinates"]
    ]


def _sweep_panels(spec: dict, report_url: str | None) -> list:
    parallel = wr.ParallelCoordinatesPlot(columns=_columns(spec), title=f"{spec['metric']} vs the swept knobs")
    out = [_stable(parallel, spec["sweep"], "sweep", "parallel")]
    out.append(_stable(wr.RunComparer(diff_only="split"), spec["sweep"], "sweep", "comparer"))
    if report_url:
        text = f"Report with the tables, figures, command and config of sweep {spec['sweep']}: {report_url}"
        out.append(_stable(wr.MarkdownPanel(markdown=text), spec["sweep"], "sweep", "report"))
    return out


def group_filter(spec: dict):
    """Runs of the sweep's W&B group."""
    return [expr.Metric("Group") == spec["group"]]


def workspace(spec: dict, entity: str, report_url: str | None = None):
    """The saved view of the sweep (wandb_workspaces.workspaces.Workspace; not saved here)."""
    sections = [
        ws.Section(name=s["name"], panels=[_line(spec, s["name"], p) for p in s["panels"]], is_open=True)
        for s in spec["sections"]
    ]
    sections.append(ws.Section(name="Sweep", panels=_sweep_panels(spec, report_url), is_open=True))
    return ws.Workspace(
        entity=entity,
        project=spec["project"],
        name=spec["view"],
        sections=sections,
        settings=ws.WorkspaceSettings(x_axis="Step", smoothing_type="none", max_runs=100),
        runset_settings=ws.RunsetSettings(
            filters=group_filter(spec), groupby=[expr.Config(k) for k in spec["grouping"]]
        ),
    )


def wandb_report(spec: dict, entity: str):
    """The sweep's W&B report (wandb_workspaces.reports.v2.Report; not saved here)."""
    r, where = spec["report"], dict(entity=entity, project=spec["project"])
    groupby = [f"config.{k}" for k in spec["grouping"]]
    runset = wr.Runset(**where, name=spec["sweep"], filters=group_filter(spec), groupby=groupby)
    runset = _stable(runset, spec["sweep"], "runset")
    curves = [_line(spec, s["name"], p) for s in spec["sections"][:1] for p in s["panels"]]
    blocks = [wr.P(r["description"]), wr.PanelGrid(runsets=[runset], panels=curves + _sweep_panels(spec, None)[:1])]
    for t in r["tables"]:
        blocks += [wr.H2(t["title"]), wr.MarkdownBlock(text=t["markdown"])]
    if r["figures"]:
        # the sweep-summary run is in the sweep's group; the media browser shows the run that logged them
        summary = wr.Runset(**where, name=f"{spec['sweep']} summary", filters=group_filter(spec))
        summary = _stable(summary, spec["sweep"], "summary")
        media = _stable(wr.MediaBrowser(title="report figures", media_keys=list(r["figures"])), spec["sweep"], "media")
        blocks += [wr.H2("Figures"), wr.PanelGrid(runsets=[summary], panels=[media])]
    blocks += [
        wr.H2("Command"),
        wr.CodeBlock(code=r["command"], language="markdown"),  # a shell line: no shell highlighting offered
        wr.H2("Config (sweep.yaml)"),
        wr.CodeBlock(code=r["config"], language="yaml"),
    ]
    return wr.Report(**where, title=r["title"], description=r["description"], blocks=blocks, width="fluid")


CHECK_QUERY = """
query EmapgDashboardTarget($entity: String!, $project: String!) {
  entity(name: $entity) { id }
  project(name: $project, entityName: $entity) { id }
}
"""


def check_target(api, entity: str, project: str) -> None:
    """Refuse (UserError) an entity or a project W&B does not know, before anything is saved."""
    found = execute_graphql(api, CHECK_QUERY, {"entity": entity, "project": project}) or {}
    if not found.get("entity"):
        raise UserError(f"--entity={entity!r}: no such W&B entity (or no access with the current `wandb login`)")
    if not found.get("project"):
        raise UserError(
            f"--project={project!r}: entity {entity!r} has no such project; upload the runs first "
            "(`wandb sync ...`, printed by `emapg dashboard` offline) or pass the project they are in"
        )
