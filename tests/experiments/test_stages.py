"""Staged runs (experiments.stages): two tiny stages in one command continue one record and one
trainer state (the EMA anchor's update count goes on), the record links the stages, a stage split
over two commands or interrupted mid-stage ends exactly where the one-command run does; and the
verl path compiles a later stage into a launch that resumes from the previous stage's global_step_N."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from experiments import build, records, stages
from experiments.cli import main
from experiments.errors import UserError
from tests.experiments.small_run import small_run

SMALL = small_run({"trainer.eval_n": 2, "trainer.save_every": 1, "algo.anchor.period": 1})
TWO = (
    "stages=[{name: a, set: {trainer.iterations: 2}},"
    " {name: b, set: {trainer.iterations: 4, rollout.max_new_tokens: 16}}]"
)
pytestmark = pytest.mark.filterwarnings("ignore:pretrain .* did not reach target_acc")


@pytest.fixture(autouse=True)
def env(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EMAPG_CACHE", str(tmp_path_factory.getbasetemp() / "stages_cache"))
    monkeypatch.setenv("EMAPG_PROGRESS", "0")


def comparable(run_dir) -> dict[int, dict]:
    return {
        r["iteration"]: {k: v for k, v in r.items() if k != "time_s" and not k.startswith("perf/")}
        for r in records.read_metrics(run_dir)
    }


@pytest.fixture(scope="module")
def one_command(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("EMAPG_CACHE", str(tmp_path_factory.getbasetemp() / "stages_cache"))
    mp.setenv("EMAPG_PROGRESS", "0")
    run_dir = tmp_path_factory.mktemp("staged") / "run"
    assert main(["train", *SMALL, TWO, f"run_dir={run_dir}"]) == 0
    mp.undo()
    return run_dir


def test_two_stages_continue_one_record_and_the_anchor(one_command):
    run_dir = one_command
    a, b = records.read_stages(run_dir)
    assert (a["stage"], a["index"], a["after_iteration"], a["checkpoint"]) == ("a", 0, None, None)
    assert (b["stage"], b["index"], b["after_iteration"], b["checkpoint"]) == ("b", 1, 2, "iter_000002")
    assert b["changes"] == {"rollout.max_new_tokens": [12, 16], "stage": ["a", "b"], "trainer.iterations": [2, 4]}
    assert records.read_resumes(run_dir) == []  # a stage start is not a resume
    rows = comparable(run_dir)
    assert sorted(rows) == [0, 1, 2, 3, 4]
    # period 1: one anchor update per iteration, counted on across the stage boundary
    assert [rows[i]["anchor/num_updates"] for i in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, 4.0]
    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert (cfg.stage, cfg.trainer.iterations, cfg.rollout.max_new_tokens) == ("b", 4, 16)
    assert records.read_state(run_dir) == "finished" and records.stage_progress(run_dir) == (["a", "b"], None)
    assert {r["iteration"] for r in records.read_evals(run_dir)} == {0, 2, 4}


def test_stages_over_two_commands_equal_one_command(one_command, tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", *SMALL, TWO, "stage=a", f"run_dir={run_dir}"]) == 0
    assert records.stage_progress(run_dir) == (["a"], None)
    assert main(["train", *SMALL, TWO, "stage=b", f"run_dir={run_dir}", "resume=true"]) == 0
    assert comparable(run_dir) == comparable(one_command)
    assert [s["stage"] for s in records.read_stages(run_dir)] == ["a", "b"]


def test_a_stage_starts_from_a_checkpoint_trained_elsewhere(one_command, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["train", *SMALL, TWO, "stage=a", f"run_dir={first}"]) == 0
    ckpt = first / "checkpoints" / "iter_000002"
    assert main(["train", *SMALL, TWO, "stage=b", f"resume_from={ckpt}", f"run_dir={second}"]) == 0
    (entry,) = records.read_stages(second)
    assert (entry["stage"], entry["index"], entry["checkpoint"]) == ("b", 1, "iter_000002")
    want = {i: r for i, r in comparable(one_command).items() if i > 2}
    assert comparable(second) == want  # iterations 3 and 4, as in the one-command run


def test_an_interrupted_stage_resumes_mid_stage(one_command, tmp_path):
    from experiments.run import run

    run_dir = tmp_path / "run"
    cfg = build.compose([*SMALL, TWO, f"run_dir={run_dir}"])

    def stop_at_3(it, row, ckpt):
        if it == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(cfg, stop_at_3)
    assert records.read_state(run_dir) == "interrupted" and records.stage_progress(run_dir) == (["a"], "b")
    assert main(["train", *SMALL, TWO, f"run_dir={run_dir}", "resume=true"]) == 0
    (resume,) = records.read_resumes(run_dir)
    assert resume["checkpoint"] == "iter_000003" and resume["changes"] == {}
    assert [s["stage"] for s in records.read_stages(run_dir)] == ["a", "b"]
    assert comparable(run_dir) == comparable(one_command)


def test_task_stages_and_their_checks():
    cfg = build.compose(["experiment=math_deepscaler_ema_pg", "stage=16k"])
    assert [s.name for s in stages.plan(cfg)] == ["8k", "16k"]
    with pytest.raises(UserError, match="stage='32k' is not one of the stages; allowed: 8k, 16k, 24k"):
        stages.plan(build.compose(["experiment=math_deepscaler_ema_pg", "stage=32k"]))
    with pytest.raises(UserError, match="stage '24k' ends at trainer.iterations=480, not after the previous stage"):
        stages.stage_configs(
            build.compose(["experiment=math_deepscaler_ema_pg", "stages=[8k,16k,24k]"]), build.validate
        )
    with pytest.raises(UserError, match="is not a stage of task math_tiny; its stages: none"):
        stages.plan(build.compose(["experiment=math_tiny_ema_pg", "stages=[8k]"]))
    with pytest.raises(UserError, match="cannot set trainer.iteratons"):
        stages.apply(build.compose([]), stages.Stage("x", {"trainer.iteratons": 3}))


def test_a_verl_stage_starts_from_the_previous_global_step_with_the_anchor(tmp_path):
    from experiments.backends.verl.launch import to_verl
    from experiments.run import stage_job_config

    ckpt = tmp_path / "ckpt"
    cfg = build.compose(["experiment=math_deepscaler_ema_pg", "stages=[8k,16k]", f"backend.verl.checkpoint_dir={ckpt}"])
    (s8, c8), (s16, c16) = stages.stage_configs(cfg, build.validate)
    c16 = OmegaConf.merge(c16, {"run_dir": str(tmp_path / "run")})
    first = to_verl(stage_job_config(c16, stages.start_info(s16, 1, c8, cfg))).overrides
    assert "trainer.resume_mode=resume_path" in first
    assert f"trainer.resume_from_path={ckpt}/global_step_480" in first
    assert "data.max_response_length=16384" in first and "trainer.total_training_steps=800" in first
    assert [o for o in first if o.startswith("data.seed=")] == ["data.seed=986"]  # the 8k stage's seed replaced
    assert "actor_rollout_ref.rollout.val_kwargs.top_p=0.95" in first  # the preset's own overrides kept
    job = to_verl(stage_job_config(c16, None))  # the same stage resumed mid-way: verl's newest checkpoint
    assert not [o for o in job.overrides if o.startswith("trainer.resume")]
    assert job.emapg["mask_truncated"] is False and to_verl(stage_job_config(c8, None)).emapg["mask_truncated"]


def test_a_sweep_spec_gives_its_trials_stages(tmp_path):
    from sweeps import spec as sweep_spec

    path = tmp_path / "staged.yaml"
    path.write_text(
        "name: staged\nmetric: eval/math_tiny/acc\nbase:\n  experiment: math_tiny_ema_pg\n  overrides:\n"
        "    stages:\n      - {name: short, set: {trainer.iterations: 2}}\n"
        "      - {name: long, set: {trainer.iterations: 4, rollout.max_new_tokens: 16}}\n"
        "space:\n  algo.anchor.tau: {grid: [0.9, 1.0]}\n"
    )
    spec = sweep_spec.load(path)
    point = sweep_spec.trials(spec)[0]
    cfg = build.compose(spec.overrides_for({k: v for k, v in point.items() if k != "seed"}, point.get("seed", 0)))
    planned = stages.stage_configs(cfg, build.validate)
    assert [(s.name, c.trainer.iterations, c.rollout.max_new_tokens) for s, c in planned] == [
        ("short", 2, 48),  # the preset's length
        ("long", 4, 16),
    ]


def _verl_attempt(run_dir, steps):
    """A verl metrics file of one attempt: validation at step 0, training metrics at `steps`."""
    import json

    lines = [{"step": 0, "data": {"val-core/math/acc/mean@1": 0.0}}]
    lines += [{"step": s, "data": {"actor/pg_loss": 0.1, "timing_s/step": 1.0}} for s in steps]
    (run_dir / "verl_metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.mark.parametrize(
    "kept, newest, logged, want",
    [
        ([1, 2], 2, [1, 2], []),  # the newest checkpoint's step is in the record: verl's resume_mode=auto
        ([1, 2], 2, [1], ["trainer.resume_mode=resume_path", "global_step_1"]),  # killed between save and log
        ([1], 1, [], ["trainer.resume_mode=disable"]),  # not one step logged: train from the start again
        ([3, 4], 4, [2], []),  # the checkpoint needed was pruned: nothing better than verl's own choice
    ],
)
def test_a_resumed_verl_run_continues_from_the_newest_checkpoint_of_a_logged_step(tmp_path, kept, newest, logged, want):
    root = tmp_path / "ckpt"
    for s in kept:
        (root / f"global_step_{s}" / "actor").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(newest))
    _verl_attempt(tmp_path, logged)
    got = stages.verl_logged_resume({"backend": {"verl": {"checkpoint_dir": str(root)}}}, tmp_path)
    assert got[:1] == want[:1] and all(w in " ".join(got) for w in want)
    if len(want) > 1:
        assert got[1] == f"trainer.resume_from_path={(root / 'global_step_1').resolve()}"
