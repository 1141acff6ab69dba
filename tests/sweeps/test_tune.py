"""Sweeps on a 2-CPU local Ray bound to 127.0.0.1: scheduling, restore and resume semantics with a
fast stand-in for experiments.run.run (sweep_fakes.fake_run, selected per trial by task.knobs.fake in the
Ray workers, see sweep_fakes.install), and the real
trainer end to end with smoke-sized runs."""

from __future__ import annotations

import collections
import contextlib
import copy
import csv
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sweep_fakes
import yaml

from experiments import run as run_module
from sweeps import tune as T
from sweeps.spec import load, parse

HERE = Path(__file__).resolve().parent
ACC = "eval/math_tiny/acc"


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    """One Ray for the module: 2 CPUs, loopback only, no token auth, no dashboard, no usage stats."""
    import ray

    env = {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(HERE), os.environ.get("PYTHONPATH")])
        ),  # workers import sweep_fakes
        "WANDB_MODE": "disabled",
        "EMAPG_CACHE": str(tmp_path_factory.mktemp("emapg_cache")),
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
    )  # each worker: experiments.run.run -> sweep_fakes.dispatch
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture
def fakes(local_ray, monkeypatch):
    """Sweeps whose trials run sweep_fakes.fake_run: the driver warm-starts no model (the stand-in loads none)."""
    monkeypatch.setattr(T, "_warm_start", lambda spec: None)
    return local_ray


def fake_spec(name: str, iterations: int = 6, sleep: float = 0.1, **top) -> dict:
    """A spec for sweep_fakes.fake_run: `sleep` s per iteration, eval every 2, a checkpoint every iteration."""
    overrides = {"trainer.iterations": iterations, "trainer.eval_every": 2, "trainer.save_every": 1, "logger": "none"}
    if "task.knobs" not in top.get("space", {}):
        overrides["task.knobs"] = {"fake": "run", "sleep": sleep}
    for knobs in top.get("space", {}).get("task.knobs", {}).get("grid", []):
        knobs.setdefault("fake", "run")  # a point's task.knobs replaces the base's
    return {
        "name": name,
        "base": {"experiment": "math_tiny_grpo", "overrides": overrides},
        "space": {"algo.anchor.tau": {"grid": [1.0, 0.5]}},
        "metric": ACC,
        "max_concurrent": 2,
        **top,
    }


def rows(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "sweep.csv", newline="") as f:
        return list(csv.DictReader(f))


def executed(sweep_dir: Path) -> dict[str, list[int]]:
    """trial id -> the iterations the stand-in executed, in order (across attempts)."""
    out = collections.defaultdict(list)
    for c in sweep_fakes.calls(sweep_dir):
        out[c["trial"]].append(c["iteration"])
    return out


def attempts(sweep_dir: Path, trial_id: str) -> list[list[int]]:
    """The iterations each attempt of the trial executed (an attempt = one trial process)."""
    out: list[list[int]] = []
    last_pid = None
    for c in sweep_fakes.calls(sweep_dir):
        if c["trial"] == trial_id:
            if c["pid"] != last_pid:
                out.append([])
            out[-1].append(c["iteration"])
            last_pid = c["pid"]
    return out


def record_iterations(sweep_dir: Path, trial_id: str) -> list[int]:
    (run_dir,) = (sweep_dir / "runs").glob(f"*__{trial_id}")
    return [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grid_runs_every_point_and_seed_once(fakes, tmp_path):
    spec = parse(
        fake_spec(
            "grid",
            iterations=4,
            sleep=0.0,
            seeds=[0, 1],
            space={"algo.anchor.tau": {"grid": [1.0, 0.5]}, "algo.anchor.period": {"grid": [2, 3]}},
        )
    )
    out = T.run_sweep(spec, tmp_path / "grid", report=False)
    got = rows(out)
    assert len(got) == 8 and {r["status"] for r in got} == {"finished"}
    assert sorted((float(r["algo.anchor.tau"]), int(r["algo.anchor.period"]), int(r["seed"])) for r in got) == sorted(
        (t, p, s) for t in (1.0, 0.5) for p in (2, 3) for s in (0, 1)
    )
    runs = executed(out)
    assert len(runs) == 8 and all(its == [0, 1, 2, 3, 4] for its in runs.values())  # each exactly once
    # the configs the trials ran with: point, seed and the sweep's bookkeeping keys
    configs = [yaml.safe_load((out / "runs" / r["run_id"] / "config.yaml").read_text()) for r in got]
    for r, c in zip(got, configs):
        assert (c["algo"]["anchor"]["tau"], c["algo"]["anchor"]["period"], c["seed"]) == (
            float(r["algo.anchor.tau"]),
            int(r["algo.anchor.period"]),
            int(r["seed"]),
        )
        assert (c["sweep"]["name"], c["sweep"]["trial_id"], c["logger"]["group"]) == ("grid", r["trial_id"], "grid")
        assert c["trainer"]["threads"] == 1 and "sweep:grid" in c["logger"]["tags"]
    # trials launch in the dry-run table's order
    from sweeps.spec import trials

    launched = got  # sweep.csv lists trials in launch order
    assert [(float(r["algo.anchor.tau"]), int(r["algo.anchor.period"]), int(r["seed"])) for r in launched] == [
        (t["algo.anchor.tau"], t["algo.anchor.period"], t["seed"]) for t in trials(spec)
    ]
    assert [float(r[f"final/{ACC}"]) for r in launched[:2]] == [1.0, 1.0]
    # the sweep directory is not reused by accident, and --resume insists on the same spec
    with pytest.raises(ValueError, match="already holds sweep 'grid'; finish it with --resume"):
        T.run_sweep(spec, out)
    changed = parse(
        fake_spec(
            "grid",
            iterations=5,
            sleep=0.0,
            seeds=[0, 1],
            space={"algo.anchor.tau": {"grid": [1.0, 0.5]}, "algo.anchor.period": {"grid": [2, 3]}},
        )
    )
    with pytest.raises(ValueError, match=r"spec differs .* \(keys: base\)"):
        T.run_sweep(changed, out, resume=True)
    with pytest.raises(ValueError, match="holds no sweep"):
        T.run_sweep(spec, tmp_path / "nothing_here", resume=True)


OPTUNA_SPACE = {"algo.anchor.tau": {"uniform": [0.5, 1.0]}, "algo.anchor.period": {"int": [1, 20]}}


def test_optuna_honours_its_sampler_seed(fakes, tmp_path):
    def suggestions(seed: int, out: str) -> list[tuple]:
        spec = parse(
            fake_spec(
                "opt",
                iterations=1,
                sleep=0.0,
                search={"type": "optuna", "seed": seed},
                budget={"num_samples": 2},
                seeds=[0, 1],
                space=OPTUNA_SPACE,
            )
        )
        d = T.run_sweep(spec, tmp_path / out, report=False, progress=False)
        got = rows(d)  # in launch order
        assert len(got) == 4 and {r["status"] for r in got} == {"finished"}
        # each suggestion runs once per seed (Repeater)
        assert [int(r["seed"]) for r in got] == [0, 1] * 2 and got[0]["algo.anchor.tau"] == got[1]["algo.anchor.tau"]
        return [(float(r["algo.anchor.tau"]), int(r["algo.anchor.period"])) for r in got]

    first, again = suggestions(7, "a"), suggestions(7, "b")
    assert first == again
    assert all(0.5 <= t <= 1.0 and 1 <= p <= 20 for t, p in first)


def test_optuna_sampler_seed_changes_the_suggestions():
    """The searcher alone (no Ray cluster needed): same seed, same proposals; another seed, others."""

    def proposals(seed: int) -> list[dict]:
        spec = parse(
            fake_spec("opt", search={"type": "optuna", "seed": seed}, budget={"num_samples": 4}, space=OPTUNA_SPACE),
            check_config=False,
        )
        searcher = T._search_alg(spec)
        searcher.set_search_properties(ACC, "max", T.param_space(spec))
        return [searcher.suggest(f"t{i}") for i in range(4)]

    assert proposals(1) == proposals(1) != proposals(2)


def test_asha_stops_weak_trials(fakes, tmp_path):
    spec = parse(
        fake_spec(
            "asha",
            iterations=8,
            sleep=0.15,
            space={"algo.anchor.tau": {"grid": [1.0, 0.9, 0.3, 0.2]}},
            scheduler={"type": "asha", "grace_period": 2, "reduction_factor": 2},
        )
    )
    assert spec.scheduler.max_t == 8  # trainer.iterations
    out = T.run_sweep(spec, tmp_path / "asha", report=False)
    by_tau = {float(r["algo.anchor.tau"]): r for r in rows(out)}
    assert by_tau[1.0]["status"] == "finished" and int(by_tau[1.0]["iterations"]) == 8
    for weak in (0.3, 0.2):
        assert by_tau[weak]["status"] == "stopped" and int(by_tau[weak]["iterations"]) < 8
        assert max(executed(out)[by_tau[weak]["trial_id"]]) < 8


def test_paused_trial_resumes_from_its_checkpoint(fakes, tmp_path, monkeypatch):
    """A scheduler pauses the trial at iteration 3; it resumes from checkpoint 3 (iteration 4 next), not from 0."""
    spec = parse(fake_spec("pause", iterations=6, sleep=0.2, space={"algo.anchor.tau": {"grid": [1.0]}}))
    monkeypatch.setattr(T, "_scheduler", lambda spec: sweep_fakes.pause_once_scheduler(3))
    out = T.run_sweep(spec, tmp_path / "pause", report=False)
    (row,) = rows(out)
    assert row["status"] == "finished" and int(row["iterations"]) == 6
    first, again = attempts(out, row["trial_id"])
    assert first[:4] == [0, 1, 2, 3] and again[0] == 4 and again[-1] == 6  # continued after checkpoint 3
    assert record_iterations(out, row["trial_id"]) == list(range(7))  # the record was rewound, not duplicated


def test_failing_trial_is_retried_from_its_last_checkpoint(fakes, tmp_path):
    """One trial fails once (retried from its checkpoint, finishes); one fails every time (failed); the sweep ends."""
    spec = parse(
        fake_spec(
            "fail",
            iterations=5,
            max_failures=1,
            space={
                "task.knobs": {
                    "grid": [
                        {"sleep": 0.1, "fail_at": 3, "fail_times": 1},
                        {"sleep": 0.1, "fail_at": 3, "fail_times": 9},
                    ]
                }
            },
        )
    )
    out = T.run_sweep(spec, tmp_path / "fail", report=False)
    ok, bad = rows(out)
    assert ok["status"] == "finished" and int(ok["iterations"]) == 5
    # attempt 1 ran 0..2 and reported checkpoint 2 with iteration 2; attempt 2 continued at iteration 3
    assert executed(out)[ok["trial_id"]] == [0, 1, 2, 3, 4, 5]
    assert record_iterations(out, ok["trial_id"]) == [0, 1, 2, 3, 4, 5]
    assert bad["status"] == "failed" and "injected failure at iteration 3" in bad["error"]


def test_an_interrupted_trial_is_listed_as_such_and_resume_continues_it(fakes, tmp_path):
    """A trial whose run was SIGTERM'd (status interrupted, no retries left) is `interrupted` in sweep.csv,
    not `failed`; --resume continues it from its checkpoint."""
    spec = parse(
        fake_spec(
            "stop", iterations=5, max_failures=0, space={"task.knobs": {"grid": [{"sleep": 0.05, "interrupt_at": 3}]}}
        )
    )
    out = T.run_sweep(spec, tmp_path / "stop", report=False)
    (row,) = rows(out)
    assert row["status"] == "interrupted" and "interrupted by SIGTERM after iteration 2" in row["error"]
    T.run_sweep(spec, out, resume=True, report=False)
    (row,) = rows(out)
    assert row["status"] == "finished" and record_iterations(out, row["trial_id"]) == list(range(6))
    its = executed(out)[row["trial_id"]]
    assert its[:3] == [0, 1, 2] and its[3] >= 2 and its[-1] == 5  # continued from a checkpoint


def test_killed_driver_resumes_without_rerunning_finished_trials(fakes, tmp_path):
    """SIGKILL the sweep driver while trial 3 of 4 runs; `--resume` finishes the sweep."""
    spec_path = tmp_path / "kill.yaml"
    spec_path.write_text(
        yaml.safe_dump(
            fake_spec(
                "kill",
                iterations=6,
                sleep=0.3,
                max_concurrent=1,
                space={"algo.anchor.tau": {"grid": [1.0, 0.9, 0.8, 0.7]}},
            )
        )
    )
    out = tmp_path / "kill"
    code = f"import sweep_fakes; sweep_fakes.drive({str(spec_path)!r}, {str(out)!r}, {fakes!r})"
    # Tune's state as the sweep saves it (every 2 s): killed once the third trial is in it (a trial that is not
    # runs again under a new id: test_orphaned_runs_are_set_aside); its newest checkpoints may be missing from it
    driver = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )

    def in_state(trial_id: str) -> bool:
        return any(trial_id in p.read_text() for p in (out / "tune" / "kill").glob("experiment_state-*.json"))

    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            runs = executed(out)
            if len(runs) >= 3 and max(runs[list(runs)[2]]) >= 3 and in_state(list(runs)[2]):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the sweep did not reach its third trial")
    finally:
        driver.kill()
        driver.wait()
    done_before = {t: its for t, its in executed(out).items() if its and its[-1] == 6}
    assert len(done_before) == 2
    # the worst moment to be killed: while Tune rewrote its experiment state in place (seen in CI: a
    # truncated file made Tune start over with a trial that had no config)
    (state,) = sorted((out / "tune" / "kill").glob("experiment_state-*.json"))
    assert (state.parent / (state.name + T.COMPLETE)).is_file()
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    _wait_for_free_cpus(2)  # Ray ends the dead driver's trial actors
    T.run_sweep(load(spec_path), out, resume=True, report=False)
    got = rows(out)
    assert len(got) == 4 and {r["status"] for r in got} == {"finished"}
    after = executed(out)
    for t, its in done_before.items():
        assert after[t] == its == [0, 1, 2, 3, 4, 5, 6]  # not re-run
    interrupted = list(after)[2]  # first-seen order = launch order (one trial at a time)
    first, again = attempts(out, interrupted)
    assert again[0] > 1 and again[-1] == 6  # continued from a checkpoint, not from scratch
    assert record_iterations(out, interrupted) == list(range(7))


def test_a_trial_in_flight_when_the_driver_is_killed_resumes_from_its_own_checkpoint(fakes, tmp_path):
    """Tune saves its experiment state every few seconds (and after every 2 checkpoints of a trial): a driver
    SIGKILLed between two saves leaves a state that knows the trial but not its newest checkpoint. --resume
    continues the trial from the checkpoint in its run directory: the rows recorded up to that checkpoint are
    kept as they were, nothing before it is trained again, and timing.json counts the killed invocation."""
    spec_path = tmp_path / "inflight.yaml"
    spec = fake_spec("inflight", iterations=12, sleep=0.3, max_concurrent=1, space={"algo.anchor.tau": {"grid": [0.9]}})
    spec["base"]["overrides"]["trainer.save_every"] = 3
    spec_path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "inflight"
    code = f"import sweep_fakes; sweep_fakes.drive({str(spec_path)!r}, {str(out)!r}, {fakes!r})"
    env = {**os.environ, "TUNE_GLOBAL_CHECKPOINT_S": "600"}  # a state saved long before the kill
    driver = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and max(sum(executed(out).values(), [-1])) < 5:
            time.sleep(0.1)
        assert max(sum(executed(out).values(), [-1])) >= 5, "the trial did not reach iteration 5"
    finally:
        os.killpg(driver.pid, 9)
        driver.wait()
    (trial,) = executed(out)
    (run_dir,) = (out / "runs").glob(f"*__{trial}")
    before = (run_dir / "metrics.jsonl").read_text().splitlines()
    saved = int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[-1])
    assert saved >= 3 and len(before) >= 6
    _wait_for_free_cpus(2)
    T.run_sweep(load(spec_path), out, resume=True, report=False)
    (first, again) = attempts(out, trial)
    assert again[0] == saved + 1 and again[-1] == 12  # from the run's checkpoint, not from iteration 0
    after = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert after[: saved + 1] == before[: saved + 1] and record_iterations(out, trial) == list(range(13))
    timing = json.loads((out / "timing.json").read_text())
    assert timing["invocations"] == 2 and timing["wall_s"] - timing["last_wall_s"] >= 1.0


def test_orphaned_runs_are_set_aside(tmp_path, capsys):
    """A run directory of a trial the resumed Tune does not know moves to orphaned/, the others stay."""
    for name in ("math_tiny_grpo__s0__aaaaa_00000", "math_tiny_grpo__s0__aaaaa_00001", "math_tiny__s1__bbbbb_00000"):
        (tmp_path / "runs" / name).mkdir(parents=True)
    moved = T._set_aside_orphans(tmp_path, {"aaaaa_00000", "bbbbb_00000"})
    assert moved == [tmp_path / "orphaned" / "math_tiny_grpo__s0__aaaaa_00001"] and moved[0].is_dir()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [
        "math_tiny__s1__bbbbb_00000",
        "math_tiny_grpo__s0__aaaaa_00000",
    ]
    assert "started by the killed driver after Tune last saved its state" in capsys.readouterr().out


def test_state_backup_keeps_the_last_complete_copy_and_repair_restores_it(tmp_path, capsys):
    import pickle

    exp = tmp_path / "tune" / "s"
    exp.mkdir(parents=True)
    state, searcher = exp / "experiment_state-1.json", exp / "basic-variant-state-1.json"
    state.write_text(json.dumps({"trial_data": [1, 2]}))
    searcher.write_bytes(pickle.dumps({"_iterators": [1, 2, 3]}))
    backup = T._StateBackup(str(exp))
    backup.on_step_end(iteration=1, trials=[])
    good_state, good_searcher = state.read_bytes(), searcher.read_bytes()
    state.write_text(json.dumps({"trial_data": [1, 2, 3]})[:-5])  # a later write, cut short by a kill
    os.utime(state, ns=(time.time_ns(), time.time_ns() + 10**9))
    backup.on_step_end(iteration=2, trials=[])
    assert (exp / ("experiment_state-1.json" + T.COMPLETE)).read_bytes() == good_state  # not overwritten by a partial
    searcher.write_bytes(good_searcher[:-3])
    assert T._repair_state(exp) == ["basic-variant-state-1.json", "experiment_state-1.json"]
    assert state.read_bytes() == good_state and searcher.read_bytes() == good_searcher
    assert "was cut short" in capsys.readouterr().out
    assert T._repair_state(exp) == []  # whole files are left alone
    assert not T._is_complete(b"") and T._is_complete(b" {}")


def _wait_for_free_cpus(n: int, timeout: float = 60) -> None:
    import ray

    deadline = time.time() + timeout
    while ray.available_resources().get("CPU", 0) < n and time.time() < deadline:
        time.sleep(0.5)


# ------------------------------------------------------------------ the real trainer
@pytest.mark.filterwarnings("ignore:pretrain .* did not reach target_acc")  # smoke: 2 warm-start steps
def test_real_runs_end_to_end(local_ray, tmp_path):
    """Two smoke-sized trials through experiments.run.run: run records under the sweep, sweep.csv, report."""
    spec = parse(
        {
            "name": "e2e",
            "base": {"overrides": {"smoke": True, "logger": "none"}},
            "space": {"experiment": {"grid": ["math_tiny_grpo", "math_tiny_ema_pg"]}},
            "metric": ACC,
            "max_concurrent": 2,
        }
    )
    out = T.run_sweep(spec, tmp_path / "e2e")
    got = rows(out)
    assert {r["experiment"] for r in got} == {"math_tiny_grpo", "math_tiny_ema_pg"}
    assert {r["status"] for r in got} == {"finished"} and {r["iterations"] for r in got} == {"2"}
    for r in got:
        run_dir = out / "runs" / r["run_id"]
        assert (run_dir / "status").read_text().startswith("finished")
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert (cfg["sweep"]["name"], cfg["sweep"]["trial_id"], cfg["experiment"]) == (
            "e2e",
            r["trial_id"],
            r["experiment"],
        )
        assert r[f"final/{ACC}"] != "" and r[f"best/{ACC}"] != ""
    timing = json.loads((out / "timing.json").read_text())
    assert (out / "sweep.yaml").is_file() and timing["trials"] == 2
    assert (out / "report" / "index.md").is_file()
    # the timeline: every stamp of both trials (the driver's, the trial function's, run()'s), the slot time whole
    tl = timing["timeline"]
    stamps = ("started", "worker", "composed", *run_module.STAMPS, "reported", "ended")
    assert {tid: sorted(s) for tid, s in tl["stamps"].items()} == {r["trial_id"]: sorted(stamps) for r in got}
    spent = sum(p["total_s"] for p in tl["phases"].values()) + tl["idle_tail_s"] + tl["after_s"]
    assert spent == pytest.approx(timing["wall_s"] * timing["slots"], abs=0.1)


@pytest.mark.filterwarnings("ignore:pretrain .* did not reach target_acc")
def test_sigterm_stops_the_sweep_as_ctrl_c_does_and_the_printed_command_resumes_it(local_ray, tmp_path):
    """SIGTERM is what SLURM (preemption, scancel), Kubernetes and `kill` send to `emapg sweep`. It stops the
    trials (each run's record says interrupted: none is left `running`), saves Tune's state and exits 143 with the
    interrupted line and the command that resumes, as every command does (experiments/errors.py); that command
    finishes every trial from its checkpoint. Before: Ray's driver exited on the signal at once (status -15, a C++
    stack dump, every record `running`, no resume line); then exit 1, not the interrupted exit."""
    spec_path = tmp_path / "term.yaml"
    overrides = {"smoke": True, "logger": "none", "trainer.iterations": 40, "trainer.save_every": 2}
    spec = {"name": "term", "base": {"experiment": "math_tiny_grpo", "overrides": overrides}, "metric": ACC}
    spec_path.write_text(yaml.safe_dump({**spec, "space": {"algo.anchor.tau": {"grid": [1.0, 0.9]}}}))
    out = tmp_path / "term"
    emapg = [sys.executable, "-m", "experiments.cli", "sweep"]
    driver = subprocess.Popen(
        [*emapg, str(spec_path), "--address", local_ray, "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 180
        while len(list(out.glob("runs/*/checkpoints/iter_*"))) < 2:  # each trial has a checkpoint
            assert driver.poll() is None and time.time() < deadline, driver.communicate()[0]
            time.sleep(0.2)
        driver.send_signal(signal.SIGTERM)
        printed, _ = driver.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, 9)
    command = f"emapg sweep {out}/sweep.yaml --resume --out {out}"
    assert printed.endswith(f"emapg sweep: interrupted (SIGTERM): 2 trial(s) not finished\nresume with: {command}\n")
    assert "emapg sweep: SIGTERM: stopping the trials and saving the sweep's state" in printed, printed
    assert "SIGTERM received at time" not in printed and driver.returncode == 143, printed  # not Ray's own exit
    assert "term: 0 running, 0 done, 2 interrupted, 0 failed" in printed and "Tuner.restore(" not in printed
    assert [r["status"] for r in rows(out)] == ["interrupted"] * 2
    for run in (out / "runs").iterdir():
        assert (run / "status").read_text().startswith("interrupted"), run
    _wait_for_free_cpus(2)
    again = subprocess.run([*command.replace("emapg sweep", " ".join(emapg)).split(), "--address", local_ray],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    assert re.findall(r"resume  tau=\S+ seed=0  \[\w+\] from its (?:run's )?checkpoint", again.stdout), again.stdout
    assert [(r["status"], r["iterations"]) for r in rows(out)] == [("finished", "40")] * 2
    for run in (out / "runs").iterdir():
        assert [json.loads(x)["iteration"] for x in (run / "metrics.jsonl").read_text().splitlines()] == list(range(41))


def _pids(sweep_dir: Path, name: str) -> list[int]:
    """The process each trial ran in (Tune's `pid` in its first result), in trial order."""
    files = sorted((sweep_dir / "tune" / name).glob("*/result.json"), key=lambda f: f.parent.name.split("_")[3])
    return [json.loads(f.read_text().splitlines()[0])["pid"] for f in files]


def _records(sweep_dir: Path) -> dict[str, list[dict]]:
    """trial index -> its run's metrics rows without the wall-clock keys (time_s, perf/*)."""
    out = {}
    for f in (sweep_dir / "runs").glob("*/metrics.jsonl"):
        rows = [json.loads(line) for line in f.read_text().splitlines()]
        timing = lambda k: k == "time_s" or k.startswith("perf/")  # noqa: E731
        out[f.parent.name.rsplit("_", 1)[-1]] = [{k: v for k, v in r.items() if not timing(k)} for r in rows]
    return out


@pytest.mark.filterwarnings("ignore:pretrain .* did not reach target_acc")
def test_trials_share_their_slots_worker_and_record_what_a_fresh_worker_records(local_ray, tmp_path, monkeypatch):
    """A local sweep runs trial after trial in the same Ray worker (Tune's reuse_actors: Python, torch and the
    project are imported once per slot, not once per trial), and a trial in a reused worker records exactly the
    rows it records in a fresh one (its seeds, threads and state are its own)."""
    overrides = {"smoke": True, "logger": "none", "trainer.iterations": 4, "trainer.eval_every": 2}
    spec = parse(
        {
            "name": "reuse",
            "base": {"experiment": "math_tiny_ema_pg", "overrides": overrides},
            "space": {"algo.anchor.tau": {"grid": [1.0, 0.9, 0.8]}},
            "metric": ACC,
            "resources": {"cpu": 1, "gpu": 0},
            "max_concurrent": 1,
        }
    )
    shared = T.run_sweep(spec, tmp_path / "shared", report=False)
    assert len(set(_pids(shared, "reuse"))) == 1  # one worker ran the three trials
    fresh_config = T._tune_config
    monkeypatch.setattr(T, "_tune_config", lambda s: dataclasses.replace(fresh_config(s), reuse_actors=False))
    fresh = T.run_sweep(spec, tmp_path / "fresh", report=False)
    assert len(set(_pids(fresh, "reuse"))) == 3
    a, b = _records(shared), _records(fresh)
    assert sorted(a) == sorted(b) == ["00000", "00001", "00002"] and a == b
    assert {r["status"] for r in rows(shared)} == {"finished"}


@pytest.mark.slow
def test_real_trial_retried_from_its_checkpoint(local_ray, tmp_path, monkeypatch):
    """A real run that dies after iteration 2's metrics is retried from its reported checkpoint (iteration 1):
    the trainer resumes exactly (iteration 2 next) and the run record holds every iteration once."""
    overrides = {"smoke": True, "logger": "none", "task.knobs": {"fake": "fail_once"}}  # sweep_fakes.dispatch
    spec = parse(
        {
            "name": "e2e_retry",
            "base": {"experiment": "math_tiny_ema_pg", "overrides": overrides},
            "space": {"seed": {"grid": [3]}},
            "metric": ACC,
            "max_failures": 1,
        }
    )
    monkeypatch.setattr(T, "_warm_start", lambda spec: None)  # the trial builds it (the knob is not the task's)
    out = T.run_sweep(spec, tmp_path / "retry")
    (row,) = rows(out)
    assert row["status"] == "finished" and row["iterations"] == "2"
    assert record_iterations(out, row["trial_id"]) == [0, 1, 2]
    tries = [json.loads(x) for x in (out / "attempts.jsonl").read_text().splitlines()]
    # the last iteration is reported only once run() returned: this attempt's never was
    assert tries == [{"resume": False, "iterations": [1, 2]}, {"resume": True, "iterations": [2]}]


def smoke_variant(raw: dict) -> dict:
    """A shipped spec cut to 2 smoke-sized trials: the first two values of its first entry (or 2 samples)."""
    d = copy.deepcopy(raw)
    d["base"].setdefault("overrides", {}).update({"smoke": True, "logger": "none"})
    d["seeds"] = d.get("seeds", [0])[:1]
    d["max_concurrent"], d["budget"] = 2, {"num_samples": 2 if d.get("search", "grid") != "grid" else 1}
    for i, (key, entry) in enumerate(d["space"].items()):
        kind, values = next(iter(entry.items()))
        if kind in ("grid", "choice"):
            d["space"][key] = {kind: values[:2] if i == 0 else values[:1]}
    if isinstance(d.get("scheduler"), dict):
        d["scheduler"]["grace_period"] = 1
    return d


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["quickstart", "ablate_tau", "ablate_period", "ablate_k", "ablate_kl_type", "tune_optuna"]
)
def test_shipped_spec_smoke_runs(local_ray, tmp_path, name):
    """Every local-backend spec in sweeps/ runs end to end with 2 smoke-sized trials."""
    raw = yaml.safe_load((HERE.parents[1] / "sweeps" / f"{name}.yaml").read_text())
    out = T.run_sweep(parse(smoke_variant(raw)), tmp_path / name, report=False)
    got = rows(out)
    assert len(got) == 2 and {r["status"] for r in got} <= {"finished", "stopped"}, got


def test_settle_waits_for_stopped_trials_to_close_their_records(tmp_path):
    """After an interruption the driver reads sweep.csv only once the stopped trials' records say how they ended
    (or after SETTLE_S): a record still `running` in a live process is waited for; a finished trial is not."""
    import socket
    import threading

    from sweeps.results import Trial

    def run(name, state):
        d = tmp_path / "runs" / f"x__{name}"
        d.mkdir(parents=True)
        (d / "status").write_text(state)
        return d

    live = f"running\npid={os.getpid()} host={socket.gethostname()}\n"
    closing, done = run("t_0", live), run("t_1", "finished\n")
    timer = threading.Timer(0.5, lambda: (closing / "status").write_text("interrupted\nstopped by the sweep\n"))
    timer.start()
    t0 = time.monotonic()
    T._settle(tmp_path, [Trial("t_0", "PENDING"), Trial("t_1", "TERMINATED"), Trial("t_2", "PENDING")], 10.0)
    assert 0.4 < time.monotonic() - t0 < 5.0  # waited for t_0 only (t_2 never started a run)
    assert (closing / "status").read_text().startswith("interrupted") and done.exists()
    run("t_3", live)
    t0 = time.monotonic()
    T._settle(tmp_path, [Trial("t_3", "RUNNING")], 0.6)  # never closes: bounded by the timeout
    assert 0.5 < time.monotonic() - t0 < 3.0


def test_every_status_line_says_what_waiting_trials_reserve_and_what_each_node_has_free(monkeypatch, capsys):
    from types import SimpleNamespace

    import experiments.backends.verl.resources as resources
    from sweeps import spec as sweep_spec
    from sweeps import tune as sweep_tune

    s = sweep_spec.load("sweeps/quickstart.yaml")
    monkeypatch.setattr(resources, "free_per_node", lambda: {"127.0.0.1": {"CPU": 0.0, "GPU": 0.0}})
    progress = sweep_tune._Progress(s, every=0.0)  # a status line at every controller step
    trials = [SimpleNamespace(status=st, config={}, last_result=None) for st in ("RUNNING", "PENDING", "PENDING")]
    progress.on_step_end(iteration=1, trials=trials)
    out = capsys.readouterr().out
    assert f"{s.name}: 1 running, 0 done, 0 failed, 2 waiting" in out
    need = f"each reserves {s.cpu:g} CPUs and {s.gpu:g} GPUs"
    assert f"2 trial(s) wait for room: {need}. Free now: 127.0.0.1: 0 CPUs, 0 GPUs" in out


def test_the_best_so_far_names_the_same_configuration_whatever_order_tied_results_arrive_in():
    from sweeps import spec as sweep_spec
    from sweeps import tune as sweep_tune

    s = sweep_spec.load("sweeps/quickstart.yaml")
    seen = []
    for order in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        progress = sweep_tune._Progress(s, every=0.0)
        configs = [{"experiment": "math_tiny_grpo", "seed": k} for k in order]
        for config, acc in zip(configs, [0.5 if c["seed"] else 0.25 for c in configs]):
            progress._consider(acc, config)
        seen.append(progress.best)
    assert len(set(seen)) == 1 and seen[0][0] == 0.5  # seeds 1 and 2 tie at 0.5: the first in describe order


def test_trials_the_time_budget_stopped_or_never_started_are_listed_as_not_run(fakes, tmp_path, capsys):
    """A time budget that runs out during the first of three trials (one at a time): that trial is cut short and the
    other two never start. Each is a `not_run` row of sweep.csv naming the budget, the closing line and timing.json
    count them, and `emapg sweep` exits 1. Before: "1 finished ... of 1 trials", exit 0, two trials missing."""
    from sweeps.cli import main

    spec_path = tmp_path / "budget.yaml"
    raw = fake_spec("budget", iterations=40, sleep=0.25, max_concurrent=1, budget={"time_budget_s": 1})
    spec_path.write_text(yaml.safe_dump({**raw, "space": {"algo.anchor.tau": {"grid": [1.0, 0.9, 0.8]}}}))
    out = tmp_path / "budget"
    assert main([str(spec_path), "--out", str(out)]) == 1
    got = rows(out)
    assert [(float(r["algo.anchor.tau"]), r["status"]) for r in got] == [(1.0, "not_run"), (0.9, "not_run"),
                                                                         (0.8, "not_run")]  # fmt: skip
    # the first trial started and was cut short, or (a slow worker start) never started; the others never did
    assert re.search(r"budget.time_budget_s=1\) ran out (at iteration \d+|before it started)", got[0]["error"])
    assert int(got[0]["iterations"]) < 40 and got[0]["trial_id"]
    assert all("not run: the time budget (budget.time_budget_s=1) ran out before it started" == r["error"]
               for r in got[1:])  # fmt: skip
    assert all(r["trial_id"] == r["run_id"] == "" for r in got[1:])  # Tune never created them
    printed = capsys.readouterr().out
    assert "budget: 0 finished, 0 stopped early, 0 failed, 3 not run of 3 trials" in printed, printed
    assert "budget: 3 of 3 trial(s) not run: the time budget (budget.time_budget_s=1) ran out" in printed
    assert json.loads((out / "timing.json").read_text())["statuses"] == {"not_run": 3}
    assert main([str(spec_path), "--resume", "--out", str(out)]) == 1  # nothing more runs, still not run
    assert [r["status"] for r in rows(out)] == ["not_run"] * 3


def test_sigterm_in_the_warm_start_exits_143_and_resume_starts_the_sweep(fakes, tmp_path):
    """SIGTERM while the driver builds the warm start (Ray connected, Tune not started: what a SLURM requeue or
    preemption hits first): the interrupted line with the command that resumes, exit 143; that --resume runs the
    whole sweep, since nothing ran. Before: Ray's own SIGTERM exit (no line, exit 15 or a native dump), and every
    --resume was refused for want of Tune's state, so a requeued job failed on every requeue."""
    spec_path, out = tmp_path / "warm.yaml", tmp_path / "warm"
    spec_path.write_text(yaml.safe_dump(fake_spec("warm", iterations=2, sleep=0.0)))
    code = (
        "import sys, time; from sweeps import tune as T; from experiments.cli import main\n"
        "T._warm_start = lambda spec: (print('warm start', flush=True), time.sleep(300))\n"
        f"sys.exit(main(['sweep', {str(spec_path)!r}, '--out', {str(out)!r}, '--address', {fakes!r}]))"
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        for line in driver.stdout:
            lines.append(line)
            if line == "warm start\n":
                driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=60)  # a guard against a hang only
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, 9)
    printed = "".join(lines)
    assert driver.returncode == 143, printed
    assert printed.endswith(
        "emapg sweep: interrupted (SIGTERM) before Tune started the trials\n"
        f"resume with: emapg sweep {out}/sweep.yaml --resume --out {out}\n"
    ), printed
    assert "SIGTERM received" not in printed and "Traceback" not in printed, printed  # no dump of Ray's
    T.run_sweep(load(out / "sweep.yaml"), out, resume=True, report=False)
    assert [r["status"] for r in rows(out)] == ["finished", "finished"]


def test_which_trials_the_time_budget_ended_and_which_it_left_uncreated():
    """Tune's view after its time budget ran out (no Ray here): a scheduler's stop is marked done, a returned
    function is not (its record decides, sweeps.results.status), a trial cut running or not yet started carries the
    budget's line, and each grid point and seed Tune never created comes back as a not-run trial, in launch order.
    Without a budget nothing is cut."""
    from types import SimpleNamespace

    raw = fake_spec("cut", budget={"time_budget_s": 30}, seeds=[0, 1])
    spec = parse(raw)

    def trial(i, tau, seed, last):
        return SimpleNamespace(
            trial_id=f"t_{i:05d}", status="TERMINATED", config={"algo.anchor.tau": tau, "seed": seed},
            last_result=last, experiment_tag=f"{i}_tau", error_file=None,
        )  # fmt: skip

    tune_trials = [
        trial(0, 1.0, 0, {"training_iteration": 6, "done": True}),  # a scheduler stopped it
        trial(1, 0.5, 0, {"training_iteration": 6, "done": False}),  # returned (or cut at its last iteration)
        trial(2, 1.0, 1, {"training_iteration": 3, "done": False}),  # cut running
    ]
    known = T._known(spec, tune_trials)
    assert [t.cut for t in known] == [
        "",
        "not run to its end: the time budget (budget.time_budget_s=30) ran out at iteration 6",
        "not run to its end: the time budget (budget.time_budget_s=30) ran out at iteration 3",
    ]
    (missing,) = T._never_created(spec, known)
    assert (missing.trial_id, missing.point, missing.seed) == ("", {"algo.anchor.tau": 0.5}, 1)
    assert missing.cut == "not run: the time budget (budget.time_budget_s=30) ran out before it started"
    unbudgeted = parse({**raw, "budget": {}})
    assert [t.cut for t in T._known(unbudgeted, tune_trials)] == ["", "", ""]
    assert T._never_created(unbudgeted, known) == []
