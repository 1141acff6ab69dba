"""sweeps.results without Ray: sweep.csv and timing.json from the trials' run records."""

from __future__ import annotations

import csv
import json
import socket
from pathlib import Path

import pytest
from sweep_fakes import disk_full_halfway

from experiments import records
from sweeps import results
from sweeps.results import Trial

ACC = "eval/math_tiny/acc"


def record(sweep_dir: Path, trial_id: str, status: str, rows: list[dict], tail: str = "") -> Path:
    """A run record as a trial leaves it (`tail`: a partial last line of metrics.jsonl)."""
    d = sweep_dir / "runs" / f"math_tiny__math_tiny_ema_pg__s0__{trial_id}"
    d.mkdir(parents=True)
    (d / "status").write_text(status + "\n")
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return d


def read_csv(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "sweep.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_csv_reads_the_run_records(tmp_path):
    for tid, st in (("a_0", "finished"), ("a_1", "running")):
        record(
            tmp_path,
            tid,
            st,
            [{"iteration": 0, ACC: 0.5}, {"iteration": 1, "time_s": 2.5, ACC: 0.25}],
            tail='{"iteration": 2, ',
        )  # a crashed run's partial last line
    trials = [
        Trial("a_0", "TERMINATED", {"algo.anchor.tau": 1.0}, 0, iterations=1),
        Trial("a_1", "TERMINATED", {"algo.anchor.tau": 0.9}, 0, iterations=1),
        Trial("a_2", "PENDING", {"algo.anchor.tau": 0.8}, 0),
    ]
    rows = results.write_csv(tmp_path, ACC, "max", trials)
    assert [
        (r["status"], r["algo.anchor.tau"], r[f"final/{ACC}"], r[f"best/{ACC}"], r["train_time_s"]) for r in rows
    ] == [("finished", 1.0, 0.25, 0.5, 2.5), ("stopped", 0.9, 0.25, 0.5, 2.5), ("pending", 0.8, "", "", "")]
    assert rows[0]["run_id"] == "math_tiny__math_tiny_ema_pg__s0__a_0" and rows[2]["run_id"] == ""
    header = (tmp_path / "sweep.csv").read_text().splitlines()[0]
    assert header == f"trial_id,run_id,status,algo.anchor.tau,seed,iterations,train_time_s,final/{ACC},best/{ACC},error"


def test_best_columns_only_where_best_means_something(tmp_path):
    """A loss as the sweep metric, minimised: its best is its min; evaluations keep their max; rewards,
    times and perf/* get no best/ column."""
    rows = [
        {"iteration": 0, "time_s": 0.0, ACC: 0.5},
        {"iteration": 1, "time_s": 9.0, "loss/total": 2.0, "train/reward": 0.1, "perf/iter_s": 9.0},
        {"iteration": 2, "time_s": 10.0, "loss/total": 0.5, "train/reward": 0.3, "perf/iter_s": 1.0, ACC: 0.25},
    ]
    record(tmp_path, "b_0", "finished", rows)
    (tmp_path / "runs" / "math_tiny__math_tiny_ema_pg__s0__b_0" / "summary.json").write_text(
        json.dumps({"status": "finished", "train_wall_time_s": 7.0})
    )
    results.write_csv(tmp_path, "loss/total", "min", [Trial("b_0", "TERMINATED", {"algo.anchor.tau": 1.0}, 0, 2)])
    (row,) = read_csv(tmp_path)
    assert float(row["best/loss/total"]) == 0.5 and float(row["final/loss/total"]) == 0.5
    assert float(row[f"best/{ACC}"]) == 0.5 and float(row[f"final/{ACC}"]) == 0.25
    assert sorted(k for k in row if k.startswith("best/")) == [f"best/{ACC}", "best/loss/total"]
    assert {"final/train/reward", "final/perf/iter_s"} <= set(row) and "final/time_s" not in row
    assert float(row["train_time_s"]) == 7.0  # the run's own training time (summary.json)


@pytest.mark.parametrize(
    "tune_state,run_status,expected",
    [
        ("TERMINATED", "finished", "finished"),
        ("TERMINATED", "running", "stopped"),
        ("ERROR", "failed", "failed"),
        ("ERROR", "interrupted", "interrupted"),
        ("ERROR", "crashed", "crashed"),
        ("RUNNING", None, "interrupted"),
        ("PENDING", "interrupted", "interrupted"),  # put back by Tune when the sweep was interrupted
        ("PENDING", None, "pending"),  # not started yet
        ("PAUSED", "running", "paused"),
    ],
)
def test_status_from_tune_and_the_record(tmp_path, tune_state, run_status, expected):
    """`crashed`: a record left running by a process that is gone (experiments.records.read_state)."""
    if run_status is not None:
        d = record(tmp_path, "c_0", "running" if run_status == "crashed" else run_status, [])
        if run_status == "crashed":
            (d / "status").write_text(f"running\npid=999999999 host={socket.gethostname()}\n")
    (row,) = results.write_csv(tmp_path, ACC, "max", [Trial("c_0", tune_state, error="boom" * (tune_state == "ERROR"))])
    assert row["status"] == expected and row["error"] == ("boom" if tune_state == "ERROR" else "")


def test_a_corrupt_record_is_named_not_fatal(tmp_path):
    record(tmp_path, "d_0", "finished", [], tail='{"iteration": 0}\nnot json\n{"iteration": 1}\n')
    (row,) = results.write_csv(tmp_path, ACC, "max", [Trial("d_0", "TERMINATED")])
    assert row["status"] == "finished" and row["error"].startswith("unreadable run record:")


def test_timing(tmp_path, capsys):
    rows = [{"status": "finished", "train_time_s": 30.0}, {"status": "crashed", "train_time_s": ""}]
    t = results.write_timing(tmp_path, "s", rows, wall=40.0, slots=4)
    assert t == {
        "wall_s": 40.0, "invocations": 1, "last_wall_s": 40.0, "trials": 2, "statuses": {"crashed": 1, "finished": 1},
        "slots": 2, "train_s_sum": 30.0, "overhead_fraction": 0.625,
    }  # fmt: skip
    assert json.loads((tmp_path / "timing.json").read_text()) == t
    assert "s: 1 finished, 0 stopped early, 0 failed, 1 crashed of 2 trials in 40s (" in capsys.readouterr().out


def test_timing_of_a_resumed_sweep_adds_the_invocations_wall_times(tmp_path, capsys):
    """Training time is summed over all trials whichever invocation ran them, so the wall time must be too
    (counting the last invocation only gave a negative overhead)."""
    first = [{"status": "interrupted", "train_time_s": 50.0}, {"status": "interrupted", "train_time_s": 50.0}]
    results.write_timing(tmp_path, "s", first, wall=60.0, slots=2)
    done = [{"status": "finished", "train_time_s": 80.0}, {"status": "finished", "train_time_s": 80.0}]
    t = results.write_timing(tmp_path, "s", done, wall=40.0, slots=2, resumed=True)
    assert (t["wall_s"], t["invocations"], t["last_wall_s"]) == (100.0, 2, 40.0)
    assert t["overhead_fraction"] == 0.2  # 1 - 160 / (100 * 2); the last invocation alone: 1 - 160 / 80 = -1
    assert "of 2 trials in 100s over 2 invocations" in capsys.readouterr().out.splitlines()[-2]
    again = results.write_timing(tmp_path, "s", done, wall=10.0, slots=2)  # a fresh start counts anew
    assert (again["wall_s"], again["invocations"]) == (10.0, 1)


def test_timing_resumed_over_a_record_without_invocations(tmp_path):
    (tmp_path / "timing.json").write_text(json.dumps({"wall_s": 30.0, "trials": 1}))  # written by older code
    t = results.write_timing(
        tmp_path, "s", [{"status": "finished", "train_time_s": 5.0}], wall=5.0, slots=1, resumed=True
    )
    assert (t["wall_s"], t["invocations"]) == (35.0, 2)
    (tmp_path / "timing.json").write_text("{not json")
    t = results.write_timing(
        tmp_path, "s", [{"status": "finished", "train_time_s": 5.0}], wall=5.0, slots=1, resumed=True
    )
    assert (t["wall_s"], t["invocations"]) == (5.0, 1)  # unreadable: only what is known


def test_timing_json_is_written_whole_or_not_at_all(tmp_path):
    """A write of timing.json that fails half way (a full disk; a kill mid-write leaves the same) keeps the earlier
    invocation's file whole, so the next resume still counts its wall time. Before: written in place, half a file
    stayed, and the resumed sweep counted only its own invocation."""
    done = [{"status": "finished", "train_time_s": 5.0}]
    results.write_timing(tmp_path, "s", done, wall=30.0, slots=1, progress=False)
    with disk_full_halfway(), pytest.raises(OSError, match="No space left on device"):
        results.write_timing(tmp_path, "s", done, wall=5.0, slots=1, progress=False, resumed=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timing.json"]
    t = results.write_timing(tmp_path, "s", done, wall=5.0, slots=1, progress=False, resumed=True)
    assert (t["wall_s"], t["invocations"]) == (35.0, 2)


def test_timeline_puts_each_second_of_the_slots_in_one_phase(tmp_path):
    """Three trials on two slots: the first two start together, the third takes the slot that freed first. Each
    slot second lands in one place (a phase of a trial, the idle tail or the time after the last trial), and the
    summary figures follow from the stamps."""

    def own(t, started, reported, ended):  # the run record's stamps, then the driver's
        run = dict(zip(("worker", "composed", "run", "record", "logger", "model"), (1, 2, 2.5, 3, 4, 5)))
        run.update(eval0_start=6, eval0_end=7, train_end=t - 1, saved=t)
        return {k: 100 + started + v for k, v in run.items()}, {
            "started": 100 + started, "reported": 100 + reported, "ended": 100 + ended,
        }  # fmt: skip

    plan = {"a": (0.5, 20, 21, 22), "b": (1.0, 30, 32, 33), "c": (23.0, 10, 34, 35)}  # (started, t, reported, ended)
    rows, driver = [], {}
    for tid, (started, t, reported, ended) in plan.items():
        run_stamps, driver[tid] = own(t, started, reported, ended)
        d = record(tmp_path, tid, "finished", [])
        (d / "summary.json").write_text(json.dumps({"status": "finished", "timeline": run_stamps}))
        rows.append({"trial_id": tid, "run_id": d.name})
    rows.append({"trial_id": "never_started", "run_id": ""})
    tl = results.timeline(tmp_path, rows, driver, start=100.0, end=140.0, slots=2)
    assert tl["trials"] == 3
    assert tl["phases"]["schedule"] == {"median_s": 1.0, "total_s": 2.5}  # 0.5 and 1.0 from the start; c: 23 - 22
    assert tl["phases"]["compose"] == {"median_s": 1.0, "total_s": 3.0}
    assert tl["phases"]["close"] == {"median_s": 1.0, "total_s": 2.5}  # reported - saved: 0.5, 1 and 1
    assert tl["phases"]["end"]["total_s"] == 3.0
    train = sum(tl["phases"][k]["total_s"] for k in results.TRAINING)
    assert train == (20 - 6) + (30 - 6) + (10 - 6)
    assert tl["idle_tail_s"] == 2.0  # b's slot ends at 33, c's (a's) at 35
    assert tl["after_s"] == 2 * (140 - 135)
    fixed = sum(p["total_s"] for k, p in tl["phases"].items() if k not in results.TRAINING)
    assert fixed + train + tl["idle_tail_s"] + tl["after_s"] == pytest.approx(2 * 40)  # every slot second, once
    assert tl["fixed_s_per_trial"] == pytest.approx((2 * 40 - train - 2.0) / 3, abs=0.01)
    firsts = {"a": 0.5 + 6 + 0.5 + 1, "b": 1.0 + 6 + 1 + 1}  # schedule, started to eval0_start, close, end
    assert tl["startup_s_per_slot"] == pytest.approx(sum(firsts.values()) / 2, abs=0.01)
    assert tl["reused_s_per_trial"] == pytest.approx(1.0 + 6 + 1 + 1, abs=0.01)  # c's, the one trial in a started slot
    assert tl["stamps"]["c"]["started"] == 23.0 and list(tl["stamps"]["c"])[-1] == "ended"
    assert tl["slots"] == {"a": 0, "b": 1, "c": 0}


def test_timing_json_holds_the_timeline(tmp_path, capsys):
    tl = {"trials": 2, "fixed_s_per_trial": 1.5, "reused_s_per_trial": 0.5, "idle_tail_s": 3.0}
    t = results.write_timing(tmp_path, "s", [{"status": "finished", "train_time_s": 30.0}], 40.0, 1, timeline=tl)
    assert json.loads((tmp_path / "timing.json").read_text())["timeline"] == t["timeline"] == tl
    assert "fixed cost 1.5s per trial, 0.5s in a started slot, idle tail 3s" in capsys.readouterr().out


def test_a_trial_the_time_budget_ended_is_not_run_unless_its_record_says_it_finished(tmp_path, capsys):
    """Tune ends every live trial when its time budget runs out, the same way as a trial whose function returned
    (TERMINATED): sweeps.tune passes the budget's line as `cut`, and the run record tells the two apart. A trial Tune
    never created has no id and no record. Before: each of these was `finished` (or missing), and the closing line
    counted them so."""
    why = "not run to its end: the time budget (budget.time_budget_s=60) ran out at iteration 2"
    assert results.status("TERMINATED", "running", why) == results.NOT_RUN
    assert results.status("TERMINATED", records.CRASHED, why) == results.NOT_RUN
    assert results.status("TERMINATED", None, why) == results.NOT_RUN
    assert results.status("TERMINATED", "finished", why) == "finished"  # its function returned first
    assert results.status("TERMINATED", records.UNHEALTHY, why) == records.UNHEALTHY
    assert results.status("TERMINATED", "running", "") == "stopped"  # a scheduler's stop: unchanged
    run = tmp_path / "runs" / "math_tiny__grpo__s0__t_00000"
    run.mkdir(parents=True)
    (run / "status").write_text("interrupted\nstopped\n")
    (run / "metrics.jsonl").write_text('{"iteration": 0, "eval/math_tiny/acc": 0.25}\n')
    never = "not run: the time budget (budget.time_budget_s=60) ran out before it started"
    got = results.write_csv(
        tmp_path,
        ACC,
        "max",
        [
            results.Trial("t_00000", "TERMINATED", {"algo.anchor.tau": 1.0}, 0, iterations=2, cut=why),
            results.Trial("", "TERMINATED", {"algo.anchor.tau": 0.9}, 0, cut=never),
        ],
    )
    assert [(r["trial_id"], r["run_id"], r["status"], r["error"]) for r in got] == [
        ("t_00000", run.name, "not_run", why),
        ("", "", "not_run", never),
    ]
    results.write_timing(tmp_path, "s", got, wall=60.0, slots=1)
    assert "s: 0 finished, 0 stopped early, 0 failed, 2 not run of 2 trials in 60s" in capsys.readouterr().out
