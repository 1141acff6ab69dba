"""The W&B mirror: offline files, one W&B run across resumes, mode resolution, disabled = nothing."""

import json
import warnings

import pytest

from experiments.records import RunRecord, read_summary
from experiments.wandb_logger import NullLogger, WandbLogger, resolve_mode

SECRET = "not-a-real-key-0123456789abcdef0123456789abcdef"


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Everything W&B touches goes under tmp_path; nothing to $HOME, nothing to the network."""
    home = tmp_path / "home"
    for var, sub in (
        ("HOME", "home"),
        ("WANDB_DIR", "wandb_dir"),
        ("WANDB_CACHE_DIR", "wandb_cache"),
        ("WANDB_CONFIG_DIR", "wandb_config"),
        ("WANDB_DATA_DIR", "wandb_data"),
        ("WANDB_ARTIFACT_DIR", "wandb_artifacts"),
    ):
        (tmp_path / sub).mkdir(exist_ok=True)
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", SECRET)  # must never be written anywhere
    return home


def make(run_dir, mode="online"):
    return WandbLogger(
        run_dir,
        project="emapg-test",
        group="quickstart",
        tags=["tiny", "s1"],
        config={"experiment": "math_tiny_ema_pg", "algo": {"anchor": {"tau": 0.9}}},
        name=run_dir.name,
        mode=mode,
    )


def spy(logger):
    steps = []
    log = logger._run.log

    def wrapped(data, step=None, **kw):
        steps.append(step)
        return log(data, step=step, **kw)

    logger._run.log = wrapped
    return steps


def test_mode_resolution(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert resolve_mode(None) == "offline"
    assert resolve_mode("online") == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert resolve_mode("online") == "offline"  # the environment wins
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert resolve_mode("online") == "offline"
    monkeypatch.setenv("WANDB_MODE", "")
    assert resolve_mode("disabled") == "disabled"
    with pytest.raises(ValueError, match="allowed values: online, offline, disabled"):
        resolve_mode("cloud")


def test_offline_run_files_and_resume_continue_the_same_run(tmp_path, wandb_env):
    run_dir = tmp_path / "math_tiny__math_tiny_ema_pg__s1__20260101-000000"
    rec = RunRecord.create(run_dir, {"experiment": "math_tiny_ema_pg", "seed": 1, "task": {"name": "math_tiny"}})
    logger = make(run_dir)  # configured online, WANDB_MODE=offline wins
    assert logger.mode == "offline"
    steps = spy(logger)
    for it in range(4):
        logger.log(it, rec.log(it, {"train/reward": 0.1 * it}))
    logger.finish(0)
    logger.finish(0)  # idempotent
    assert steps == [0, 1, 2, 3]
    first = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(first) == 1 and first[0].stat().st_size > 0
    assert logger.wandb_run_id in first[0].name
    assert json.loads((run_dir / "wandb_run.json").read_text())["last_step"] == 3

    # the process dies (the kernel lets go of run_dir); the checkpoint was at iteration 1; resume
    rec.release()
    rec = RunRecord.create(
        run_dir, {"experiment": "math_tiny_ema_pg", "seed": 1, "task": {"name": "math_tiny"}}, resume=True
    )
    rec.rewind(1)
    with make(run_dir) as resumed:
        assert resumed.wandb_run_id == logger.wandb_run_id
        steps = spy(resumed)
        logged = [resumed.log(it, rec.log(it, {"train/reward": 1.0 + it})) for it in (2, 3, 4)]
    assert logged == [False, False, True] and steps == [4]  # W&B already holds steps 2 and 3
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*/run-{logger.wandb_run_id}.wandb"))
    assert len(runs) == 2  # one offline directory per attempt, one W&B run id
    assert read_summary(run_dir) is None
    assert rec.finish()["wandb_run_id"] == logger.wandb_run_id

    for path in [*run_dir.rglob("*"), *tmp_path.glob("wandb_*/**/*")]:
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    assert not any(wandb_env.iterdir())  # nothing under $HOME


def test_disabled_writes_nothing(tmp_path, wandb_env, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with make(run_dir, mode="offline") as logger:
        assert (logger.mode, logger.wandb_run_id) == ("disabled", None)
        assert logger.log(0, {"train/reward": 1.0}) is False
    assert list(run_dir.iterdir()) == []
    monkeypatch.delenv("WANDB_MODE")
    assert make(run_dir, mode="disabled").wandb_run_id is None and list(run_dir.iterdir()) == []


def test_a_failing_wandb_call_does_not_end_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    logger = make(tmp_path)

    class Broken:
        finished = None

        def log(self, data, step=None):
            raise ConnectionError("wandb-core went away")

        def finish(self, exit_code=0):
            Broken.finished = exit_code

    logger._run = Broken()
    with pytest.warns(UserWarning, match="continuing without W&B"):
        assert logger.log(1, {"a": 1.0}) is False
    assert Broken.finished == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert logger.log(2, {"a": 1.0}) is False  # off for good, no second warning


def test_null_logger_has_the_same_interface():
    public = {n for n in vars(WandbLogger) if not n.startswith("_")} | {"mode", "wandb_run_id", "last_step"}
    null = NullLogger()
    assert all(hasattr(null, n) for n in public)
    with null as lg:
        assert lg.log(0, {"a": 1}) is False and lg.wandb_run_id is None
        lg.finish(0)
