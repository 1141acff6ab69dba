"""A run stopped by a health rule (status stopped_unhealthy) in the analysis: loaded with its rule, listed in its
own table, and in no mean, even with include_incomplete (synthetic records; no training)."""

from __future__ import annotations

import json

from analysis import load, report

HEALTH = {"rule": "kl_spike", "iteration": 3, "message": "kl/value 9 > 10 x its running median 0.5", "values": {}}


def add_unhealthy_run(sweep_dir, synth) -> str:
    """An EMA-PG tau=0.9 run of seed 9 stopped at iteration 3, with an accuracy no real run reaches (1.0)."""
    run_id = synth.rid("math_tiny", "ema_pg_tiny_tau0.9", 9, 92)
    rows = synth.metric_rows("math_tiny", 9, 0.9)[:4]
    rows[2].update({"eval/math_tiny/acc": 1.0, "eval/math_tiny/pass@1": 1.0})
    d = synth.write_run(sweep_dir / "runs", run_id, synth.config("math_tiny", 9, 0.9), rows, status="stopped_unhealthy")
    summary = json.loads((d / "summary.json").read_text())
    (d / "summary.json").write_text(json.dumps({**summary, "health": HEALTH}))
    return run_id


def test_load_flags_the_run_and_its_rule(sweep_dir, synth):
    run_id = add_unhealthy_run(sweep_dir, synth)
    runs, _ = load.load_runs(sweep_dir)
    row = runs.set_index("run_id").loc[run_id]
    assert row["status"] == "stopped_unhealthy" and bool(row["unhealthy"]) and not bool(row["complete"])
    assert (row["health_rule"], row["health_iteration"], row["health_message"]) == ("kl_spike", 3, HEALTH["message"])
    assert not runs.drop(index=runs.index[runs["run_id"] == run_id])["unhealthy"].any()


def test_the_report_lists_it_apart_and_never_averages_it(sweep_dir, synth, tmp_path):
    run_id = add_unhealthy_run(sweep_dir, synth)
    for include in (False, True):
        out = tmp_path / f"report_{include}"
        report.report(sweep_dir, out, reps=50, include_incomplete=include)
        main = (out / "math_tiny_main.md").read_text()
        # tau=0.9: 3 finished seeds (+ the failed and the partial one with include_incomplete), never the stopped one
        assert f"— ours, {5 if include else 3} seeds" in main and "— ours, 6 seeds" not in main
        prov = {o["title"]: o["run_ids"] for o in json.loads((out / "provenance.json").read_text())["outputs"]}
        assert prov["Stopped by a health rule (in no number)"] == [run_id]
        assert [t for t, ids in prov.items() if run_id in ids] == [
            "Stopped by a health rule (in no number)",
            "All runs with status",
        ]
        index = (out / "index.md").read_text()
        assert "1 stopped_unhealthy" in index and "never runs stopped by a health rule" in index
        assert index.index("## Stopped unhealthy") < index.index("## All runs")
        unhealthy = (out / "unhealthy.md").read_text()
        assert run_id in unhealthy and "kl_spike" in unhealthy and HEALTH["message"] in unhealthy
