"""Run config -> verl launch (``experiments.backends.verl.launch.to_verl``).

- golden: the paper's math (8k stage) and search runs (the authors' released scripts) compile to the committed
  command lines in golden/*.cmd.txt (regenerate with EMAPG_UPDATE_GOLDEN=1 and review the diff);
- the shipped presets (experiments/conf/experiment/*deepscaler*, *search_r1*) and the shipped GPU
  sweeps compile to exactly those launches: the golden run configs are hand transcriptions of
  the released scripts' hyperparameters, written independently of the presets;
- those hyperparameters appear in the compiled launch (spot checks, by hand);
- [verl] the compiled overrides compose against verl 0.9.1's ppo_trainer, every section verl turns
  into a dataclass instantiates without unknown-key errors, and verl's validate_config accepts it.

The golden and mapping tests need no verl and run in the default suite.
"""

import os
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from ema_pg_core.overrides import hydra_value
from experiments.backends.verl import attention
from experiments.backends.verl.config import EmaPGSection, split_argv, topk_passes
from experiments.backends.verl.launch import to_verl

GOLDEN = Path(__file__).parent / "golden"
RUNS = sorted(p.name[: -len(".run.yaml")] for p in GOLDEN.glob("*.run.yaml"))


def _job(name):
    return to_verl(yaml.safe_load((GOLDEN / f"{name}.run.yaml").read_text()))


@pytest.mark.parametrize("name", RUNS)
def test_golden_command(name):
    cmd = "\n".join(_job(name).command()) + "\n"
    path = GOLDEN / f"{name}.cmd.txt"
    if os.environ.get("EMAPG_UPDATE_GOLDEN"):
        path.write_text(cmd)
    assert path.exists(), f"{path} missing: run with EMAPG_UPDATE_GOLDEN=1 and review it"
    assert cmd == path.read_text(), (
        f"compiled launch for {name} changed; if intended, EMAPG_UPDATE_GOLDEN=1 and review the diff"
    )


PRESET_GOLDEN = {  # preset -> (golden run, extra overrides that golden run carries)
    "math_deepscaler_ema_pg": ("math_deepscaler_8k", ["run_dir=/shared/emapg/runs/math_deepscaler_8k_ema_pg"]),
    "search_r1_ema_pg": ("search_r1_ema_pg", []),
}


def _composed_job(overrides):
    from omegaconf import OmegaConf

    from experiments import build

    cfg = build.compose(overrides)
    build.validate(cfg)
    return to_verl(OmegaConf.to_container(cfg, resolve=True))


@pytest.mark.parametrize("preset", sorted(PRESET_GOLDEN))
def test_preset_compiles_to_the_golden_launch(preset):
    golden, extra = PRESET_GOLDEN[preset]
    assert _composed_job([f"experiment={preset}", *extra]).command() == _job(golden).command()


@pytest.mark.parametrize(
    "sweep,grpo_delta",
    [
        ("math_deepscaler_ema_pg", {"emapg.anchor.tau": ("0.95", "1.0")}),
        (
            "search_r1_ema_pg",
            {
                "emapg.anchor.tau": ("0.9", "1.0"),
                "emapg.kl.type": ("topk_reverse", "k3"),
                "emapg.kl.use_iw": ("true", "false"),
            },
        ),
    ],
)
def test_shipped_gpu_sweeps_compile_to_the_paper_launch_and_its_baseline(sweep, grpo_delta):
    from sweeps.spec import load, trials

    spec = load(Path(__file__).parents[2] / "sweeps" / f"{sweep}.yaml")
    argv = {
        t["experiment"]: dict(
            a.split("=", 1)
            for a in _composed_job(spec.overrides_for({"experiment": t["experiment"]}, t["seed"])).argv()
        )
        for t in trials(spec)
    }
    ema, grpo = argv[sweep], argv[sweep.replace("ema_pg", "grpo")]
    # the EMA-PG trial is its preset's launch exactly (the sweep's group/tags are W&B-only, not verl's)
    assert ema == dict(a.split("=", 1) for a in _composed_job([f"experiment={sweep}"]).argv())
    changed = {k: (ema.get(k), grpo.get(k)) for k in ema.keys() | grpo.keys() if ema.get(k) != grpo.get(k)}
    name = "trainer.experiment_name"
    assert changed.pop(name) == (ema[name], ema[name].replace("ema_pg", "grpo"))
    assert changed == grpo_delta  # the baseline differs in the anchor / estimator only


def _overrides(job):
    return dict(o.split("=", 1) for o in job.overrides)


def test_math_hyperparameters():
    o, e = _overrides(_job("math_deepscaler_8k")), _job("math_deepscaler_8k").emapg
    assert e["kl"]["type"] == "k3" and e["kl"]["coef"] == 0.001 and not e["kl"]["use_iw"]
    assert e["anchor"] == {"tau": 0.95, "period": 10, "fp32_shadow": False}
    assert (
        e["loss"]["agg"] == "seq-mean-token-mean" and e["loss"]["clip_high"] == 0.28 and e["loss"]["dual_clip_c"] == 3.0
    )
    assert o["data.train_batch_size"] == "128" and o["actor_rollout_ref.rollout.n"] == "8"
    assert o["actor_rollout_ref.actor.ppo_mini_batch_size"] == "64"  # 2 optimizer steps per iteration
    assert o["data.max_response_length"] == "8192" and o["data.max_prompt_length"] == "4096"
    assert (
        o["actor_rollout_ref.actor.optim.lr"] == "1e-06" and o["actor_rollout_ref.actor.optim.betas"] == "[0.9,0.999]"
    )
    assert o["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == "30000" and o["data.seed"] == "6725"
    assert o["actor_rollout_ref.actor.strategy"] == "fsdp2" and o["trainer.v1.trainer_mode"] == "emapg_sync"
    assert o["trainer.total_training_steps"] == "480" and o["trainer.save_freq"] == "20"
    assert e["mask_truncated"] is True and _job("search_r1_ema_pg").emapg["mask_truncated"] is False  # 8k stage only


def test_search_hyperparameters():
    job = _job("search_r1_ema_pg")
    o, e = _overrides(job), job.emapg
    assert e["kl"] | {} == {
        **e["kl"],
        "type": "topk_reverse",
        "k": 32,
        "tail": "paper",
        "coef": 0.001,
        "use_iw": True,
        "iw_clip_low": None,
        "iw_clip_high": None,
    }
    assert e["anchor"]["tau"] == 0.9 and e["anchor"]["period"] == 10 and e["loss"]["dual_clip_c"] is None
    assert "actor_rollout_ref.actor.clip_ratio_c" not in o  # no dual clip in the search recipe
    assert o["data.train_batch_size"] == "512" and o["actor_rollout_ref.rollout.n"] == "5"
    assert o["actor_rollout_ref.rollout.top_p"] == "0.95" and o["actor_rollout_ref.actor.optim.betas"] == "[0.9,0.95]"
    assert o["actor_rollout_ref.actor.optim.lr_warmup_steps"] == "286"
    assert o["actor_rollout_ref.rollout.val_kwargs.do_sample"] == "false"  # greedy evaluation
    assert o["actor_rollout_ref.rollout.multi_turn.max_assistant_turns"] == "5"
    assert o["trainer.total_training_steps"] == "1005" and o["trainer.test_freq"] == "50"


def test_passes_follow_capabilities():
    from ema_pg_core.config import KLConfig

    rev = topk_passes(KLConfig(type="topk_reverse", k=8))
    assert rev["old"] == {"mode": "ids", "k": 8, "prefix": "emapg_old_"}  # pi_old's values are never read
    assert rev["ref"] == {"mode": "gather", "ids_key": "emapg_old_topk_ids", "prefix": "emapg_ref_", "logp": True}
    fwd = topk_passes(KLConfig(type="topk_forward", k=8))
    assert fwd["old"]["mode"] == "off"
    assert fwd["ref"] == {"mode": "self", "k": 8, "prefix": "emapg_ref_", "logp": True}
    assert all(p["mode"] == "off" for p in topk_passes(KLConfig(type="k3")).values())
    assert all(p["mode"] == "off" for p in topk_passes(KLConfig(type="topk_reverse", coef=0.0)).values())


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"algo": {"kl": {"type": "exact_reverse"}}}, "full"),
        ({"algo": {"kl": {"type": "nope"}}}, "not allowed"),
        ({"algo": {"anchor": {"tau": 1.5}}}, "tau"),
        ({"rollout": {"prompts_per_iter": 10}, "trainer": {"mini_batches": 3}}, "divisible"),
        ({"backend": {"verl": {"rollout_engine": "trtllm"}}}, "rollout_engine"),
        (
            {"trainer": {"device": "tpu9"}},
            r"trainer.device='tpu9' is not allowed; allowed values: cpu, cuda, cuda:N, auto",
        ),
        ({"trainer": {"device": "auto"}}, r"device='auto' is not allowed with the verl backend; allowed: cuda, cpu"),
        (
            {"trainer": {"device": "cuda:1"}},
            r"device='cuda:1' is not allowed with the verl backend; allowed: cuda, cpu",
        ),
        ({"trainer": {"device": "cpu"}}, r"trainer.device=cpu needs backend.verl.rollout_engine=hf"),
        (
            {"trainer": {"device": "cuda"}, "backend": {"verl": {"rollout_engine": "hf"}}},
            r"hf runs with trainer.device=cpu",
        ),
        (
            {"trainer": {"device": "cuda"}, "backend": {"verl": {"max_failed_rollouts": -1}}},
            r"max_failed_rollouts must be",
        ),
        ({"trainer": {"device": "cuda"}, "backend": {"verl": {"step_timeout_s": 0}}}, r"step_timeout_s must be > 0"),
        ({"backend": {"verl": {"bogus": 1}}}, "bogus"),
        ({"trainer": {"eval_temperature": -1.0}}, r"trainer.eval_temperature must be >= 0 \(0 = greedy\)"),
        ({"trainer": {"keep_checkpoints": 0}}, r"trainer.keep_checkpoints must be an integer >= 1"),
        ({"backend": {"verl": {"gpu_memory_utilization": 0}}}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"backend": {"verl": {"step_timeout_s": float("inf")}}}, r"step_timeout_s must be a finite number > 0"),
        ({"backend": {"verl": {"n_gpus_per_node": 0}}}, r"backend.verl.n_gpus_per_node must be an integer >= 1"),
        ({"backend": {"verl": {"mask_truncated": "yes"}}}, r"backend.verl.mask_truncated must be true or false"),
        ({"backend": {"verl": {"multi_turn": True, "agent_loop": "search_r1"}}}, r"needs backend\.verl\.retriever_url"),
        (
            {"backend": {"verl": {"attn_implementation": "flash_attention_3"}}},
            r"attn_implementation='flash_attention_3'; allowed: sdpa, flash_attention_2, eager, emapg_varlen, null",
        ),
        (
            {
                "trainer": {"device": "cpu"},
                "backend": {"verl": {"rollout_engine": "hf", "attn_implementation": "flash_attention_2"}},
            },
            r"flash_attention_2 needs CUDA",
        ),
    ],
)
def test_invalid_run_configs_fail_clearly(bad, match):
    run = {"model": {"path": "m"}, **bad}
    with pytest.raises((ValueError, TypeError), match=match):
        to_verl(run)


@pytest.mark.parametrize("temperature,sample", [(0.0, "false"), (0.6, "true")])
def test_eval_temperature_zero_is_greedy_on_verl_too(temperature, sample):
    """trainer.eval_temperature means the same on both backends: 0 = greedy (verl: do_sample=false)."""
    o = _overrides(to_verl({"model": {"path": "m"}, "trainer": {"eval_temperature": temperature, "device": "cuda"}}))
    assert o["actor_rollout_ref.rollout.val_kwargs.temperature"] == hydra_value(temperature)
    assert o["actor_rollout_ref.rollout.val_kwargs.do_sample"] == sample


def test_split_argv_and_formatting():
    args, section = split_argv(
        ["trainer.nnodes=2", "emapg.kl.type=topk_forward", "emapg.anchor.tau=0.95", "emapg.kl.iw_clip_high=null"]
    )
    assert args == ["trainer.nnodes=2"]
    assert section.kl.type == "topk_forward" and section.anchor.tau == 0.95 and section.kl.iw_clip_high is None
    assert split_argv(["emapg.mask_truncated=true"])[1].mask_truncated is True
    scalars = r"emapg.<metrics_path\|mask_truncated\|device\|probe_every\|probe_size\|runner_setup>"
    with pytest.raises(ValueError, match=scalars):
        split_argv(["emapg.bogus=1"])
    with pytest.raises(ValidationError) as err:  # the core's dataclass refuses a key it does not have
        EmaPGSection.model_validate({"kl": {"kk": 1}})
    assert [e["loc"] for e in err.value.errors()] == [("kl", "kk")]
    from omegaconf import OmegaConf  # the trainer's and the workers' emapg node: interpolations resolved

    node = OmegaConf.create({"tau": 0.8, "emapg": {"anchor": {"tau": "${tau}"}, "kl": {"type": "k3"}}}).emapg
    assert EmaPGSection.from_config(node) == EmaPGSection.model_validate({"anchor": {"tau": 0.8}, "kl": {"type": "k3"}})
    assert [hydra_value(v) for v in (None, True, 1e-6, [0.9, 0.95], "a b", "x", "True")] == [
        "null",
        "true",
        "1e-06",
        "[0.9,0.95]",
        "'a b'",
        "x",
        "'True'",
    ]


@pytest.mark.verl
@pytest.mark.parametrize("name", RUNS)
def test_compiled_config_instantiates_verl_dataclasses(name, tiny_path):
    from omegaconf import open_dict
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from experiments.backends.verl.main import compose

    job = _job(name)
    # argv after `python -m experiments.backends.verl.main`; the model path points at the local tiny model
    # because verl's model config reads the HF config (no downloads in tests)
    cfg = compose(job.argv() + [f"actor_rollout_ref.model.path={tiny_path}"])
    assert cfg.emapg.kl.type == job.emapg["kl"]["type"]
    arr = cfg.actor_rollout_ref
    actor = omega_conf_to_dataclass(arr.actor)
    assert actor.strategy == "fsdp2" and actor.engine.strategy == "fsdp2" and actor.use_kl_loss
    ref_cfg = arr.ref.copy()
    with open_dict(ref_cfg):  # what ActorRolloutRefWorker.init_model does before converting the ref section
        ref_cfg.ppo_mini_batch_size = arr.actor.ppo_mini_batch_size
        ref_cfg.ppo_micro_batch_size = ref_cfg.pop("log_prob_micro_batch_size", None)
        ref_cfg.ppo_micro_batch_size_per_gpu = ref_cfg.pop("log_prob_micro_batch_size_per_gpu", None)
        ref_cfg.use_dynamic_bsz = ref_cfg.pop("log_prob_use_dynamic_bsz", False)
        ref_cfg.ppo_max_token_len_per_gpu = ref_cfg.pop("log_prob_max_token_len_per_gpu", None)
    ref = omega_conf_to_dataclass(ref_cfg)
    assert ref.strategy == "fsdp2" and ref.fsdp_config.model_dtype == "fp32"
    rollout = omega_conf_to_dataclass(arr.rollout)
    assert rollout.n == int(_overrides(job)["actor_rollout_ref.rollout.n"])
    omega_conf_to_dataclass(arr.model)
    from verl.trainer.ppo.reward import get_custom_reward_fn

    score = get_custom_reward_fn(cfg)  # verl imports our task's compute_score from the package
    good = "<think>x</think> \\boxed{4}" if "math" in name else "<answer> Paris </answer>"
    assert score(data_source="t", solution_str=good, ground_truth=["4" if "math" in name else "paris"]) == 1.0
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert need_reference_policy(cfg) and not need_critic(cfg)


def test_cpu_device_compiles_to_verls_cpu_mode_and_every_run_gets_the_failure_hook():
    from experiments.backends.verl import cpu, failures

    run = yaml.safe_load((GOLDEN / "math_deepscaler_8k.run.yaml").read_text())
    gpu = _overrides(to_verl(run))
    hook = "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook"
    assert gpu[hook] == failures.SETUP_HOOK and "+ray_kwargs.ray_init.num_gpus" not in gpu
    run["trainer"]["device"] = "cpu"
    run["backend"]["verl"]["rollout_engine"] = "hf"
    job = to_verl(run)
    o = _overrides(job)
    assert o[hook] == cpu.SETUP_HOOK and o["trainer.device"] == "cpu" and o["actor_rollout_ref.rollout.name"] == "hf"
    assert o["+ray_kwargs.ray_init.num_gpus"] == "8"  # one virtual GPU per rank: verl's placement groups unchanged
    assert o["+ray_kwargs.ray_init._node_ip_address"] == "'127.0.0.1'"
    assert o["+actor_rollout_ref.model.override_config.attn_implementation"] == "eager"
    assert job.emapg["device"] == "cpu"


ATTN = "+actor_rollout_ref.model.override_config.attn_implementation"


@pytest.fixture(autouse=True)
def _no_flash_attn(monkeypatch):
    """Compile launches as for the GPU install, which has no flash-attn, on any machine."""
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: False)


@pytest.mark.parametrize(
    "device,setting,flash_attn,composed",
    [
        ("cuda", None, False, "emapg_varlen"),  # the GPU install: PyTorch's varlen kernel on packed batches
        ("cuda", None, True, "flash_attention_2"),  # flash-attn installed (verl's image): verl's default
        ("cuda", "flash_attention_2", False, "flash_attention_2"),
        ("cuda", "sdpa", True, "sdpa"),
        ("cuda", "eager", False, "eager"),
        ("cpu", None, True, "eager"),
        ("cpu", "sdpa", False, "sdpa"),
        ("cpu", "emapg_varlen", False, "emapg_varlen"),
    ],
)
def test_attention_on_gpus_is_flash_attn_or_varlen_unless_set(monkeypatch, device, setting, flash_attn, composed):
    """The actor's and the reference's attention (one verl key, actor_rollout_ref.model, read by both):
    backend.verl.attn_implementation when set, else flash-attn's kernel where it is installed, PyTorch's varlen
    kernel (``attention.NAME``) on GPUs without it, eager on CPU: docs/verl-plugin.md, "Installing on GPUs"."""
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: flash_attn)
    run = yaml.safe_load((GOLDEN / "math_deepscaler_8k.run.yaml").read_text())
    run["trainer"]["device"] = device
    run["backend"]["verl"].update(
        {"attn_implementation": setting, **({"rollout_engine": "hf"} if device == "cpu" else {})}
    )
    job = to_verl(run)
    assert [a for a in job.overrides if "attn_implementation" in a] == [f"{ATTN}={composed}"]
    # verl's own keys stay as the engine needs them: packed batches, no fused kernels
    o = _overrides(job)
    assert o["actor_rollout_ref.model.use_remove_padding"] == "true"
    assert o["actor_rollout_ref.model.use_fused_kernels"] == "false"


@pytest.mark.parametrize("preset", sorted(PRESET_GOLDEN))
def test_shipped_gpu_presets_run_varlen_without_flash_attn(preset):
    golden, extra = PRESET_GOLDEN[preset]
    assert _overrides(_composed_job([f"experiment={preset}", *extra]))[ATTN] == "emapg_varlen"


@pytest.mark.verl
@pytest.mark.parametrize("drop_ours", [False, True])
def test_verl_builds_the_models_with_the_composed_attention(drop_ours, tiny_path):
    """verl 0.9.1 reads the attention from actor_rollout_ref.model.override_config (HFModelConfig, for the actor
    and the reference alike) and defaults to flash_attention_2 without it: the key is what keeps flash-attn out."""
    from verl.utils.config import omega_conf_to_dataclass

    from experiments.backends.verl.main import compose

    argv = [a for a in _job("math_deepscaler_8k").argv() if not (drop_ours and a.startswith(ATTN))]
    cfg = compose(argv + [f"actor_rollout_ref.model.path={tiny_path}"])
    model = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    assert model.hf_config._attn_implementation == ("flash_attention_2" if drop_ours else "emapg_varlen")
    assert model.use_remove_padding and not model.use_fused_kernels
