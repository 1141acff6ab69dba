"""A sweep with one deliberately diverging trial (an absurd learning rate) on the real trainer: the sweep's
`health:` rule stops that trial only, as stopped_unhealthy; the other trial finishes; sweep.csv says which rule
fired where; `emapg report` lists the stopped run apart and keeps it out of every number."""

from __future__ import annotations

import csv
import json

import pytest
from test_tune import local_ray, rows  # noqa: F401  (the module-scoped 2-CPU Ray of the sweep tests)

from experiments import records
from sweeps import tune as T
from sweeps.spec import parse

ACC = "eval/math_tiny/acc"


@pytest.mark.slow  # two real trials, about 100 s on 2 shared cores
@pytest.mark.filterwarnings("ignore:pretrain .* did not reach target_acc")  # smoke: 2 warm-start steps
def test_a_diverging_trial_stops_unhealthy_and_the_other_finishes(local_ray, tmp_path):  # noqa: F811
    spec = parse(
        {
            "name": "health",
            "base": {
                "experiment": "math_tiny_grpo",
                "overrides": {"smoke": True, "logger": "none", "trainer.iterations": 3},
            },
            # optim.lr=1.0: one update makes the tiny policy deterministic (train/entropy ~1e-6 at iteration 2,
            # measured); 1e-4 is the preset's rate (entropy ~4.5 nats)
            "space": {"optim.lr": {"grid": [1e-4, 1.0]}},
            "metric": ACC,
            "max_concurrent": 2,
            "health": {"entropy_floor": {"floor": 0.01, "patience": 1}},
        }
    )
    out = T.run_sweep(spec, tmp_path / "health")
    got = {float(r["optim.lr"]): r for r in rows(out)}
    healthy, bad = got[1e-4], got[1.0]
    assert healthy["status"] == "finished" and healthy["iterations"] == "3" and healthy["health"] == ""
    assert bad["status"] == "stopped_unhealthy" and bad["health"].startswith("entropy_floor at iteration ")
    stop = records.read_summary(out / "runs" / bad["run_id"])["health"]
    assert stop["rule"] == "entropy_floor" and stop["iteration"] < 3 and stop["values"]["train/entropy"][0] < 0.01
    assert int(bad["iterations"]) == stop["iteration"]  # the stopped iteration was reported to Tune, none after
    assert records.read_status(out / "runs" / healthy["run_id"])[0] == "finished"

    report = out / "report"
    with open(report / "unhealthy.csv", newline="") as f:
        (listed,) = list(csv.DictReader(f))
    assert listed["run_id"] == bad["run_id"] and listed["health_rule"] == "entropy_floor"
    assert "## Stopped unhealthy" in (report / "index.md").read_text()
    # every table and figure names the runs behind it (provenance.json): the stopped run only in its own table
    # and in the list of all runs; the per-task results come from the finished run alone
    outputs = json.loads((report / "provenance.json").read_text())["outputs"]
    with_bad = {o["title"] for o in outputs if bad["run_id"] in o.get("run_ids", [])}
    assert with_bad == {"Stopped by a health rule (in no number)", "All runs with status"}
    results = [o for o in outputs if o["title"] not in with_bad]
    assert results and all(o.get("run_ids", [healthy["run_id"]]) == [healthy["run_id"]] for o in results)


def test_the_health_section_is_set_for_every_trial_and_a_point_may_not_hide_it():
    raw = {
        "name": "h",
        "base": {"experiment": "math_tiny_grpo"},
        "space": {"algo.anchor.tau": {"grid": [1.0, 0.9]}},
        "seeds": [0, 1],
        "metric": ACC,
        "health": {"kl_spike": {"factor": 10, "window": 8}, "length_cap": {"frac": 0.9}},
    }
    spec = parse(raw, check_config=False)
    want = {"health.kl_spike.factor=10", "health.kl_spike.window=8", "health.length_cap.frac=0.9"}
    for point in ({"algo.anchor.tau": 1.0}, {"algo.anchor.tau": 0.9}):
        for seed in (0, 1):
            assert want <= set(spec.overrides_for(point, seed))
    assert parse({**raw, "health": None}, check_config=False).health == {}  # no section: the run defaults


def test_sweep_csv_status_of_a_trial_a_health_rule_ended():
    from sweeps.results import status

    assert status("TERMINATED", "stopped_unhealthy") == "stopped_unhealthy"  # the trial function returned
    assert status("TERMINATED", "interrupted") == "stopped" and status("TERMINATED", "finished") == "finished"
