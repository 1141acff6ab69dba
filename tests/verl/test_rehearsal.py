"""verl's real training loop on CPU, end to end: `emapg rehearse` of the paper's GPU presets.

Each rehearsal builds a tiny model and data in the real schema, runs verl 0.9.1's V1 trainer with our
plugin (CPU platform, hf rollout engine) for 3 steps, kills the run after the checkpoint of step 2,
resumes it to step 3 and checks the run directory (steps, anchor schedule, Top-k statistics,
checkpoint retention, resume, per-problem evaluation rows of the policy and the anchor, one offline
W&B run per attempt under the run's one id and group; for the
math preset, the report's pass@k table from them). About 2.5 minutes each on 2 cores.
"""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.verl

TARGETS = {
    "math_deepscaler_ema_pg": ["experiment=math_deepscaler_ema_pg"],  # its own estimator: K3, tau 0.95
    "math_topk_reverse_iw": ["experiment=math_deepscaler_ema_pg", "algo.kl.type=topk_reverse", "algo.kl.use_iw=true"],
    "search_r1_ema_pg": ["experiment=search_r1_ema_pg"],  # Top-k reverse k=32, paper tail, IW, Search-R1 loop
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    from experiments.ops.rehearse import Shared

    s = Shared(tmp_path_factory.mktemp("rehearsal") / "_shared")
    yield s
    s.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_rehearsal_passes_every_check(name, shared):
    from experiments.ops.rehearse import rehearse_config

    result = rehearse_config(name, TARGETS[name], shared.root.parent, shared, steps=3)
    report = "\n".join(c.line() for c in result.checks)
    assert result.ok, f"rehearsal of {name} failed:\n{report}"
    assert [c.name for c in result.checks] == [
        "steps recorded",
        "anchor schedule",
        "Top-k statistics",
        "KL probe",
        "checkpoints",
        "resume",
        "evaluation rows",
        "W&B",
    ]
    if name == "math_deepscaler_ema_pg":  # the report's pass@k table from the per-problem rows, anchor included
        from analysis.report import report

        report(shared.root.parent / name, shared.root.parent / f"{name}_report", reps=10)
        table = (shared.root.parent / f"{name}_report" / "math_passk.md").read_text()
        assert "policy pass@1" in table and "anchor pass@1" in table


def test_rehearse_refuses_a_local_preset_and_a_bad_step_count():
    out = subprocess.run(
        [sys.executable, "-m", "experiments.cli", "rehearse", "experiment=math_tiny_ema_pg"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "backend=local" in out.stderr and "emapg train experiment=math_tiny_ema_pg" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "experiments.cli", "rehearse", "experiment=math_deepscaler_ema_pg", "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "--steps=2" in out.stderr


def test_a_target_is_one_configuration_with_a_run_dir_safe_name():
    from experiments.ops.rehearse import run_name

    with pytest.raises(ValueError, match="a sweep spec is rehearsed with `emapg rehearse <spec.yaml>`"):
        run_name(["sweeps/search_r1_ema_pg.yaml"])  # the CLI sends a spec to rehearse.sweep
    name = run_name(["experiment=math_deepscaler_ema_pg", "algo.kl.type=topk_reverse"])
    assert name == "math_deepscaler_ema_pg__type-topk_reverse"


def test_the_cuda_rehearsal_config_is_one_gpu_with_vllm_to_verl(tmp_path, monkeypatch):
    """`emapg rehearse --device cuda`'s config, compiled as `emapg train` compiles it, composes against verl 0.9.1's
    ppo_trainer and passes its checks; verl's rollout config is vLLM on one GPU with the rehearsal's memory share."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from experiments import build
    from experiments.backends.verl.launch import to_verl
    from experiments.backends.verl.main import compose
    from experiments.ops import rehearse

    tiny = rehearse.build_model  # verl reads the tiny model's HF config only: no SFT needed
    monkeypatch.setattr(rehearse, "build_model", lambda out, sft, **kw: tiny(out, sft, steps=0, **kw))
    shared = rehearse.Shared(tmp_path / "_shared")
    overrides = rehearse.rehearsal_target(
        ["experiment=math_deepscaler_ema_pg"], tmp_path / "run", shared, 3, device="cuda"
    )
    job = to_verl(OmegaConf.to_container(build.compose(overrides), resolve=True))
    cfg = compose(job.argv())
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    memory = rehearse.VLLM_MEMORY
    assert (rollout.name, rollout.tensor_model_parallel_size, rollout.gpu_memory_utilization) == ("vllm", 1, memory)
    assert (cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes, job.emapg["device"]) == (1, 1, "cuda")
    assert cfg.trainer.device == "cuda" and cfg.actor_rollout_ref.actor.fsdp_config.param_offload  # the preset's
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
