"""A failed sweep rehearsal says why: one line naming what failed and where every process's log is kept (the Ray
nodes', the sweep driver's, the trials', the failing check's own output), without running a whole rehearsal.

The first test starts the real two-node cluster and the real `emapg sweep` driver on a spec it refuses (a
``rehearsal_spec`` that gets past the rehearsal's validation), about 30 s; the second fakes the cluster and the
sweep and makes one check fail; the third checks the index of each trial's log files; the fourth, that the
wait for a retried trial's step ignores the steps of the attempt the node loss killed.
"""

import re
from pathlib import Path

import pytest

from experiments.cli import load_sweep_grid

pytestmark = pytest.mark.verl
FAILED_LINE = re.compile(r"^FAILED: (?P<what>.+); logs: (?P<logs>\S+)$", re.MULTILINE)


def _failed_line(text: str) -> tuple[str, Path]:
    lines = FAILED_LINE.findall(text)
    assert len(lines) == 1, f"expected one 'FAILED: ...; logs: <dir>' line, got {lines}:\n{text}"
    what, logs = lines[0]
    return what, Path(logs)


@pytest.fixture()
def rehearse_env(monkeypatch):
    """main() sets WANDB_MODE and drops RAY_ADDRESS & co. in this process: restored after the test."""
    for key in ("WANDB_MODE", "RAY_ADDRESS", "VERL_PLATFORM", "VERL_ENGINE_DEVICE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    from experiments.ops.rehearse import sweep as rehearse

    return rehearse


@pytest.mark.timeout(600)
def test_a_driver_that_fails_leaves_its_output_and_the_ray_logs_behind(rehearse_env, monkeypatch, tmp_path, capsys):
    rehearse = rehearse_env
    # a spec that the rehearsal writes and `emapg sweep` refuses (it has no space): the driver exits 2 at once
    monkeypatch.setattr(rehearse, "rehearsal_spec", lambda *a, **k: {"name": "broken", "backend": "verl"})
    argv = ["sweeps/math_deepscaler_ema_pg.yaml", "--layout", "across", "--out", str(tmp_path)]
    code = rehearse.main(argv, load_sweep_grid)
    text = capsys.readouterr().out
    assert code == 1, text
    what, logs = _failed_line(text)
    assert "emapg sweep` exited with status 2" in what, what
    assert logs.is_dir() and logs.is_relative_to(tmp_path)
    driver = (logs / "sweep.log").read_text()
    assert "emapg sweep:" in driver and "Traceback" not in driver, driver  # the driver's own one-line error
    assert "emapg sweep: " in what  # ... and the line quotes it
    failure = (logs / "failure.txt").read_text()
    assert "exited with status 2" in failure and "emapg sweep:" in failure
    ray_logs = logs / "ray"
    names = {p.name for p in ray_logs.iterdir()}
    assert {"gcs_server.out", "raylet.out", "raylet.1.out"} <= names, sorted(names)  # the head's and the worker's
    assert (logs / "rehearse.log").read_text().count("a local Ray cluster of two nodes") == 1


@pytest.mark.timeout(300)
def test_a_failing_check_is_named_with_its_output(rehearse_env, monkeypatch, tmp_path, capsys):
    rehearse = rehearse_env
    from experiments.ops.rehearse import Check

    class Cluster:
        address, logs_dir = "127.0.0.1:1", None

        def start(self):
            pass

        def shutdown(self):
            pass

    def run(spec_file, out, cluster, say):
        (out / "sweep").mkdir()
        (out / "logs" / "sweep.log").write_text("the driver's output\n")
        return 1.0  # seconds

    def checks(sweep_dir):
        return {
            "run_a": [
                Check("steps recorded", True, "fine"),
                Check("attempts", False, "2 attempt(s) trained [[1], [3]]"),
            ],
            "sweep": [Check("sweep", True, "fine")],
        }

    monkeypatch.setattr(rehearse, "rehearsal_spec", lambda *a, **k: {"name": "x"})
    monkeypatch.setattr(rehearse, "LocalCluster", Cluster)
    monkeypatch.setattr(rehearse, "run", run)
    monkeypatch.setattr(rehearse, "checks", checks)
    code = rehearse.main(["sweeps/math_deepscaler_ema_pg.yaml", "--out", str(tmp_path)], load_sweep_grid)
    text = capsys.readouterr().out
    assert code == 1, text
    what, logs = _failed_line(text)
    assert what.startswith("run_a: attempts: 2 attempt(s) trained [[1], [3]]"), what
    assert (logs / "sweep.log").read_text() == "the driver's output\n"
    failure = (logs / "failure.txt").read_text()
    assert "[FAIL] attempts: 2 attempt(s) trained [[1], [3]]" in failure and "steps recorded" not in failure
    every = (logs / "rehearse.log").read_text()  # all it printed, every check among it
    assert "[ok] steps recorded: fine" in every and "[FAIL] attempts" in every


def test_trials_txt_names_each_trials_files(tmp_path):
    from experiments.ops.rehearse.sweep import _trial_logs

    sweep, ray = tmp_path / "sweep", tmp_path / "logs" / "ray"
    for run in ("run_a__00000", "run_b__00001"):
        (sweep / "runs" / run).mkdir(parents=True)
    (sweep / "runs" / "run_a__00000" / "verl_driver.log").write_text("verl starts\n")
    ray.mkdir(parents=True)
    files = {
        "worker-aa-01000000-1.out": ":actor_name:ImplicitFunc\nrun_a__00000\n",  # Tune's job: a trial actor
        "worker-bb-01000000-2.out": ":actor_name:ImplicitFunc\nrun_b__00001\n",
        "worker-cc-02000000-3.out": ":actor_name:EmaPGTaskRunner\n.../runs/run_a__00000/checkpoints\n",  # a's verl job
        "worker-dd-02000000-4.err": "a rank's stderr, naming no run\n",
        "raylet.out": "run_a__00000 run_b__00001\n",
    }
    for name, text in files.items():
        (ray / name).write_text(text)
    lines = dict(line.split(": ", 1) for line in _trial_logs(sweep, ray).splitlines())
    a, b = lines["run_a__00000"].split(), lines["run_b__00001"].split()
    assert a[0] == str((sweep / "runs" / "run_a__00000" / "verl_driver.log").resolve())
    assert a[1:] == ["ray/worker-aa-01000000-1.out", "ray/worker-cc-02000000-3.out", "ray/worker-dd-02000000-4.err"]
    assert b == ["ray/worker-bb-01000000-2.out"]


def test_a_retry_counts_only_the_steps_of_its_own_attempt(tmp_path):
    """The driver is killed once a retried trial's new attempt has logged a step: the killed attempt's metrics file,
    live until the new verl job renames it, does not count (it did, and the kill came before the retry stepped)."""
    import json
    import os

    from experiments.ops.rehearse.sweep import _progress, _retry_progress

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)

    def step(path, n):
        with open(path, "a") as f:
            f.write(json.dumps({"step": n, "data": {"actor/pg_loss": 0.1}}) + "\n")
        (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(str(n))

    step(run / "verl_metrics.jsonl", 1)  # the attempt the node loss killed
    (run / "resumes.jsonl").write_text('{"after_iteration": 1}\n')  # the retry starts
    os.utime(run / "verl_metrics.jsonl", ns=(1, 1))
    assert _progress(run) == 1 and _retry_progress(run) == 0
    os.replace(run / "verl_metrics.jsonl", run / "verl_metrics.1.jsonl")  # the new TaskRunner's rotate
    assert _retry_progress(run) == 0
    step(run / "verl_metrics.jsonl", 2)  # the retry's first step
    assert _retry_progress(run) == 2
