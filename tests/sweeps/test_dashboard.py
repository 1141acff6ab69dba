"""`emapg dashboard` and the sweep-summary run, from a real sweep directory: a local Ray (127.0.0.1) runs
a 2-knob (varied together) x 2-seed grid whose trials are sweep_fakes.fake_run (real Tune, real run
records, a fast trainer stand-in that logs train/reward and eval/math_tiny/acc). W&B runs offline;
publishing goes to a recorder that replaces W&B's GraphQL transport (no network, no account)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import sweep_fakes
import yaml

from analysis import dashboard as D
from analysis import wandb_views as V
from experiments import cli, records
from sweeps import tune as T
from sweeps.spec import parse

HERE = Path(__file__).resolve().parent
ACC = "eval/math_tiny/acc"
KNOBS = ["algo.anchor.tau", "algo.anchor.period"]


def spec_dict() -> dict:
    overrides = {
        "trainer.iterations": 4,
        "trainer.eval_every": 2,
        "trainer.save_every": 1,
        "algo.kl.coef": 0.02,  # fixed: not a grouping key
        "task.knobs": {"fake": "run", "sleep": 0.0},
    }
    return {
        "name": "dash",
        "base": {"experiment": "math_tiny_grpo", "overrides": overrides},
        "space": {"algo.anchor.tau,algo.anchor.period": {"grid": [[1.0, 1], [0.5, 2]]}},  # 2 knobs, varied together
        "seeds": [0, 1],
        "metric": ACC,
        "max_concurrent": 2,
    }


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    """One real sweep (4 fake trials) ending with the report, the sweep-summary run and the dashboard spec."""
    import ray

    env = {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        runtime_env=sweep_fakes.RUNTIME_ENV,
    )
    T._warm_start, warm = (lambda spec: None), T._warm_start
    try:
        out = T.run_sweep(parse(spec_dict()), tmp_path_factory.mktemp("sweep") / "dash", progress=False)
    finally:
        T._warm_start = warm
        ray.shutdown()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return out


def logged_by_records(sweep_dir: Path) -> set[str]:
    return {k for d in (sweep_dir / "runs").iterdir() for row in records.read_metrics(d) for k in row} - {
        "iteration",
        "time_s",
    }


def test_spec_groups_by_exactly_the_varied_knobs(sweep_dir):
    spec = D.read_spec(sweep_dir)  # written at the end of the sweep (W&B offline)
    assert spec["group"] == "dash" and spec["view"] == "dash"
    assert spec["grouping"] == KNOBS  # seeds fold into the group; algo.kl.coef is fixed
    assert "algo.kl.coef" not in spec["grouping"] and "seed" not in spec["grouping"]
    logged = logged_by_records(sweep_dir)
    assert logged == {"train/reward", ACC} and set(spec["logged"]) == logged
    for section in spec["sections"]:
        for panel in section["panels"]:
            assert set(panel["y"]) <= logged, (section["name"], panel)
    assert [s["name"] for s in spec["sections"]] == ["Evaluation", "Training health"]  # nothing else was logged
    assert spec["parallel_coordinates"] == [f"config:{k}" for k in KNOBS] + [f"summary:{ACC}"]


def test_workspace_filter_grouping_sections(sweep_dir):
    from wandb_workspaces import expr
    from wandb_workspaces.reports import v2 as wr

    ws = V.workspace(D.read_spec(sweep_dir), "ent")
    assert ws.name == "dash" and ws.project == "emapg"
    assert ws.runset_settings.filters == expr.filterexpr_list_to_string([expr.Metric("Group") == "dash"])
    assert [(type(g), g.name) for g in ws.runset_settings.groupby] == [(expr.Config, k) for k in KNOBS]
    assert [s.name for s in ws.sections] == ["Evaluation", "Training health", "Sweep"]
    evaluation = ws.sections[0].panels[0]
    assert evaluation.y == [ACC] and (evaluation.groupby_aggfunc, evaluation.groupby_rangefunc) == ("mean", "minmax")
    parallel, comparer = ws.sections[-1].panels
    assert isinstance(parallel, wr.ParallelCoordinatesPlot) and isinstance(comparer, wr.RunComparer)
    assert [c.metric for c in parallel.columns] == [wr.Config(k) for k in KNOBS] + [wr.SummaryMetric(ACC)]
    view = ws._to_model()  # what would be saved
    assert view.display_name == "dash"


def test_offline_spec_round_trips(sweep_dir):
    """--publish builds from the JSON; the same objects as building from the sweep directory."""
    from_dir = D.dashboard_spec(sweep_dir, cli.load_sweep_info(sweep_dir / "sweep.yaml"))
    from_json = D.read_spec(sweep_dir)
    assert from_json == json.loads(json.dumps(from_dir))
    assert V.workspace(from_json, "e")._to_model() == V.workspace(from_dir, "e")._to_model()
    assert V.wandb_report(from_json, "e") == V.wandb_report(from_dir, "e")  # its model needs the API: test_publish_...


def test_report_holds_tables_figures_command_config(sweep_dir):
    from wandb_workspaces.reports import v2 as wr

    rep = V.wandb_report(D.read_spec(sweep_dir), "ent")
    markdown = [b.text for b in rep.blocks if isinstance(b, wr.MarkdownBlock)]
    main = (sweep_dir / "report" / "math_tiny_main.md").read_text()
    assert main in markdown and (sweep_dir / "report" / "runs.md").read_text() in markdown
    code = [b.code for b in rep.blocks if isinstance(b, wr.CodeBlock)]
    assert yaml.safe_load(code[-1]) == yaml.safe_load((sweep_dir / "sweep.yaml").read_text())
    assert code[0].startswith("emapg sweep ") and "sweep.yaml" in code[0]
    media = [p for b in rep.blocks if isinstance(b, wr.PanelGrid) for p in b.panels if isinstance(p, wr.MediaBrowser)]
    figures = sorted(p.stem for p in (sweep_dir / "report").glob("*.png"))
    assert figures and media[0].media_keys == [f"figures/{f}" for f in figures]


def test_summary_run_offline(sweep_dir):
    """One row per trial with its knobs, seed, status and metric (the fake's score is tau + 0.001 * seed);
    an offline W&B run under the id kept in the sweep directory."""
    info = cli.load_sweep_info(sweep_dir / "sweep.yaml")
    cols, rows = D.trials_table(sweep_dir, info)
    assert cols[:5] == ["trial_id", "status", *KNOBS, "seed"]
    got = sorted((r[2], r[3], r[4], r[1], r[5], r[6]) for r in rows)
    want = sorted(
        (tau, p, s, "finished", tau + 0.001 * s, tau + 0.001 * s) for tau, p in ((1.0, 1), (0.5, 2)) for s in (0, 1)
    )
    assert [g[:4] for g in got] == [w[:4] for w in want]
    assert [v for g in got for v in g[4:]] == pytest.approx([v for w in want for v in w[4:]])
    state = records.read_wandb_state(sweep_dir / D.SUMMARY_DIR)
    assert state["mode"] == "offline"
    runs = list((sweep_dir / D.SUMMARY_DIR / "wandb").glob(f"offline-run-*-{state['id']}/run-{state['id']}.wandb"))
    assert len(runs) == 1
    data = runs[0].read_bytes()  # wandb 0.31 has no reader for it; its run record names these in plain bytes
    assert b"dash" in data and D.SUMMARY_JOB.encode() in data


# ---------------------------------------------------------------- publishing, recorded


class Recorder:
    """Stands in for W&B's GraphQL transport (what wandb.Api sends to the server): records every query and
    answers like a server that knows `entities` -> their projects."""

    app_url = "http://127.0.0.1:9/"

    def __init__(self, entities: dict[str, list[str]]):
        self.entities, self.calls = entities, []

    def execute_graphql(self, query: str, variables: dict | None = None) -> dict:
        variables = dict(variables or {})
        self.calls.append((query, variables))
        if "EmapgDashboardTarget" in query:
            e, p = variables["entity"], variables["project"]
            return {"entity": {"id": e} if e in self.entities else None,
                    "project": {"id": p} if p in self.entities.get(e, []) else None}  # fmt: skip
        if "ProjectInternalId" in query:
            return {"project": {"id": "p1", "internalId": "internal-p1"}}
        if "upsertView" in query:
            view = {"id": f"view{len(self.calls)}", "name": variables.get("name") or "generated"}
            if variables["type"] == "runs":  # a report: the server echoes the saved view
                view.update(displayName=variables["displayName"], description=variables["description"],
                            project={"name": variables["projectName"], "entityName": variables["entityName"]},
                            spec=json.loads(variables["spec"]))  # fmt: skip
            return {"upsertView": {"view": view, "inserted": True}}
        raise AssertionError(f"unexpected query: {query[:80]}")

    def saved(self, kind: str) -> list[dict]:
        return [v for q, v in self.calls if "upsertView" in q and v["type"] == kind]


class RecordingApi:
    """wandb.Api with its transport replaced by a Recorder (the library calls only these members)."""

    recorder: Recorder

    def __init__(self, *args, **kwargs):
        self._service_api = self.recorder
        self.default_entity = "ent"

    def projects(self, entity):
        return [type("P", (), {"name": p})() for p in self.recorder.entities.get(entity, [])]

    def create_project(self, project, entity):
        raise AssertionError("the project must exist: it is checked before anything is saved")


@pytest.fixture
def recorder(monkeypatch):
    import wandb

    rec = Recorder({"ent": ["emapg"]})
    monkeypatch.setattr(RecordingApi, "recorder", rec, raising=False)
    monkeypatch.setattr(wandb, "Api", RecordingApi)
    return rec


def test_publish_saves_the_report_then_the_view(sweep_dir, recorder, capsys):
    from wandb_workspaces.reports import v2 as wr

    assert cli.main(["dashboard", str(sweep_dir), "--publish"]) == 0
    (report,), (view,) = recorder.saved("runs"), recorder.saved("project-view")
    assert (view["entityName"], view["projectName"], view["displayName"]) == ("ent", "emapg", "dash")
    saved = json.loads(view["spec"])  # the workspace as the server receives it
    runset = saved["section"]["runSets"][0]
    # W&B keeps a nested config under its top key: {"algo": {"value": {"anchor": {"tau": ...}}}}
    assert runset["grouping"] == [{"section": "config", "name": k.replace(".", ".value.", 1)} for k in KNOBS]
    assert runset["filters"]["filters"] == [
        {"key": {"section": "run", "name": "group"}, "op": "=", "value": "dash", "disabled": False}
    ]
    sections = saved["section"]["panelBankConfig"]["sections"]
    assert [(s["name"], [p["viewType"] for p in s["panels"]]) for s in sections][-1] == (
        "Sweep",
        ["Parallel Coordinates Plot", "Run Comparer", "Markdown Panel"],
    )
    out = capsys.readouterr().out
    report_url = out.split("W&B report: ")[1].split()[0]
    assert report_url in sections[-1]["panels"][-1]["config"]["value"]  # the workspace links the report
    assert report["displayName"] == "Sweep dash"
    blocks = json.loads(report["spec"])["blocks"]  # the report as the server receives it
    assert (sweep_dir / "report" / "math_tiny_main.md").read_text() in [b.get("content") for b in blocks]
    assert [b["type"] for b in blocks].count("panel-grid") == 2  # curves + parallel coordinates; figures
    # the JSON spec builds the same report the sweep directory does
    from_dir = D.dashboard_spec(sweep_dir, cli.load_sweep_info(sweep_dir / "sweep.yaml"))
    assert V.wandb_report(D.read_spec(sweep_dir), "ent")._to_model() == V.wandb_report(from_dir, "ent")._to_model()
    assert isinstance(V.wandb_report(from_dir, "ent").blocks[1], wr.PanelGrid)
    assert "W&B workspace: http://127.0.0.1:9/ent/emapg?nw=" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--publish", "--entity", "nobody"], "--entity='nobody': no such W&B entity"),
        (["--publish", "--project", "nothere"], "--project='nothere': entity 'ent' has no such project"),
    ],
)
def test_publish_refuses_unknown_entity_or_project(sweep_dir, recorder, capsys, argv, message):
    assert cli.main(["dashboard", str(sweep_dir), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not recorder.saved("runs") and not recorder.saved("project-view")  # refused before saving


# ---------------------------------------------------------------- bad input


def test_bad_input_is_one_line_exit_2(sweep_dir, tmp_path, capsys):
    not_sweep = tmp_path / "plain"
    not_sweep.mkdir()
    assert cli.main(["dashboard", str(not_sweep)]) == 2
    assert "not a sweep directory (no sweep.yaml" in capsys.readouterr().err
    unfinished = tmp_path / "unfinished"
    (unfinished / "runs").mkdir(parents=True)
    (unfinished / "sweep.yaml").write_text((sweep_dir / "sweep.yaml").read_text())
    run = next((sweep_dir / "runs").iterdir())
    (unfinished / "runs" / run.name).mkdir()
    for f in ("config.yaml", "metrics.jsonl"):
        (unfinished / "runs" / run.name / f).write_text((run / f).read_text())
    (unfinished / "runs" / run.name / "status").write_text("failed\nRuntimeError: boom\n")
    assert cli.main(["dashboard", str(unfinished)]) == 2
    assert "no finished run among its 1 run record(s)" in capsys.readouterr().err
    assert cli.main(["dashboard", str(unfinished), "--publish"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--publish: {unfinished.resolve() / D.SPEC_FILE} does not exist" in err and len(err.splitlines()) == 1


def test_logger_none_means_no_wandb_at_all(sweep_dir, tmp_path):
    """A sweep whose runs log with logger=none gets no sweep-summary run and no dashboard spec."""
    import shutil

    copy = tmp_path / "quiet"
    shutil.copytree(sweep_dir, copy, ignore=shutil.ignore_patterns(D.SPEC_FILE, D.SUMMARY_DIR, "tune"))
    for cfg in (copy / "runs").glob("*/config.yaml"):
        data = yaml.safe_load(cfg.read_text())
        data["logger"]["name"] = "none"
        cfg.write_text(yaml.safe_dump(data))
    said = []
    D.after_sweep(copy, cli.load_sweep_info(copy / "sweep.yaml"), say=said.append)
    assert said == [] and not (copy / D.SPEC_FILE).exists() and not (copy / D.SUMMARY_DIR).exists()
    assert D.log_summary_run(copy, cli.load_sweep_info(copy / "sweep.yaml")) is None


def test_an_online_summary_run_without_a_key_is_one_line(sweep_dir, tmp_path, monkeypatch):
    """W&B online with no API key to find: the sweep-summary run ends in one line (exit 2 in the CLI), not W&B's
    traceback after its login wait. No network: W&B points at a closed local port."""
    import shutil

    import wandb

    from experiments.errors import UserError

    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_MODE", "online")
    copy = tmp_path / "sweep"
    shutil.copytree(sweep_dir, copy)
    wandb.teardown()
    try:
        with pytest.raises(UserError, match=r"^the sweep's W&B summary run \(logger.mode=online\): W&B cannot start"):
            D.log_summary_run(copy, cli.load_sweep_info(copy / "sweep.yaml"))
    finally:
        wandb.teardown()
