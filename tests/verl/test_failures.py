"""A verl run that cannot work ends with its cause, never hangs: too few CPUs is refused before Ray
starts; an exception in the rollout server, the reward function or the retriever client ends the run
within 60 s of the fault, with the cause in the message and the run record (status failed).

Each run is the rehearsal configuration (tiny model, CPU platform, hf rollout) with one fault.
"""

import os
import re
import time
from datetime import datetime
from pathlib import Path

import pytest

pytestmark = pytest.mark.verl
HERE = Path(__file__).parent
FAULT_LINE = re.compile(r"ERROR:(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+:Error in _run_prompt")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    from experiments.ops.rehearse import Shared

    s = Shared(tmp_path_factory.mktemp("faults") / "_shared")
    yield s
    s.close()


def _run(shared, name: str, preset: str, extra: list[str], verl_extra: list[str] = (), retriever_url=None):
    """One attempt of the rehearsal config of `preset` + `extra`; (attempt, run_dir, log text)."""
    from experiments import build
    from experiments.ops.rehearse import rehearsal_overrides, run_attempt

    cfg = build.compose([f"experiment={preset}"])
    task = str(cfg.task.name)
    run_dir = shared.root.parent / name
    overrides = [f"experiment={preset}"] + rehearsal_overrides(
        cfg, shared.model(task), shared.data(task), run_dir, 3, retriever_url=retriever_url
    )
    if verl_extra:  # appended to the rehearsal's own backend.verl.overrides list
        last = overrides.pop()
        overrides.append(last[:-1] + "," + ",".join(f"'{o}'" for o in verl_extra) + "]")
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{HERE}{os.pathsep}{env_path}" if env_path else str(HERE)  # Ray workers import faults
    try:
        attempt = run_attempt(
            overrides + extra, run_dir, run_dir.parent / f"{name}.log", kill_after=None, timeout_s=600
        )
    finally:
        os.environ["PYTHONPATH"] = env_path
    return attempt, run_dir, attempt.log.read_text(errors="replace")


def _assert_failed_fast(attempt, run_dir: Path, log: str, cause: str):
    from experiments.records import read_summary

    assert attempt.returncode == 1, f"expected exit status 1 (run failed), got {attempt.returncode}:\n{log[-3000:]}"
    assert "run failed:" in log and cause in log, log[-3000:]
    assert read_summary(run_dir)["status"] == "failed"
    assert cause in (run_dir / "status").read_text()
    faults = [datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() for m in FAULT_LINE.finditer(log)]
    assert faults, "no failed rollout was logged"
    ended = attempt.log.stat().st_mtime  # the attempt's last line
    assert ended - min(faults) < 60, f"the run ended {ended - min(faults):.0f} s after the first failed rollout"


@pytest.mark.timeout(900)
def test_an_exception_in_the_rollout_server_ends_the_run(shared):
    # a context window too small for any prompt: the hf rollout server raises in every generate
    attempt, run_dir, log = _run(
        shared, "rollout_fault", "math_deepscaler_ema_pg", [], ["actor_rollout_ref.rollout.max_model_len=8"]
    )
    _assert_failed_fast(attempt, run_dir, log, "leaves no room to generate")


@pytest.mark.timeout(900)
def test_an_exception_in_the_reward_ends_the_run(shared):
    attempt, run_dir, log = _run(
        shared, "reward_fault", "math_deepscaler_ema_pg", ["backend.verl.reward_fn=faults:raising_reward"]
    )
    _assert_failed_fast(attempt, run_dir, log, "injected reward failure")


@pytest.mark.timeout(900)
def test_an_unreachable_retriever_ends_the_run(shared):
    from experiments.ops.rehearse import _free_port

    closed = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    attempt, run_dir, log = _run(shared, "retriever_fault", "search_r1_ema_pg", [], retriever_url=closed)
    _assert_failed_fast(attempt, run_dir, log, "ConnectError")


def test_too_few_cpus_is_refused_before_ray_starts(shared, tmp_path):
    t0 = time.time()
    attempt, run_dir, log = _run(
        shared, "too_few_cpus", "math_deepscaler_ema_pg", [], ["+ray_kwargs.ray_init.num_cpus=2"]
    )
    assert attempt.returncode == 2, log[-3000:]
    assert "Traceback" not in log and "transfer_queue.backend.SimpleStorage.num_data_storage_units" in log
    assert "but the Ray cluster has 2 CPUs" in log, log[-2000:]
    assert "ray init kwargs" not in log  # refused before verl starts Ray
    assert time.time() - t0 < 120
