"""`emapg rehearse --device cuda`: refused in one line where torch sees no CUDA device, and its config is the CPU
rehearsal's with only what one GPU changes (vLLM, the target's offloading), compiled for cuda. No verl needed: the
config is compiled as `emapg train` compiles it; tests/verl/test_rehearsal.py composes it against verl's own."""

import importlib.util
import subprocess
import sys

import pytest
import torch

from experiments import build
from experiments.backends.verl.launch import to_verl
from experiments.cli import main
from experiments.ops import rehearse
from experiments.ops.rehearse import VLLM_MEMORY, rehearsal_overrides, rehearsal_settings
from experiments.tasks import RehearsalData

TARGET = ["experiment=math_deepscaler_ema_pg", "algo.kl.type=topk_reverse"]
DATA = RehearsalData(files={"train": "/d/train.parquet", "test": "/d/test.parquet"}, sft=[])
CPU = {  # what the CPU rehearsal sets for the device (verl's CPU mode), as before --device existed
    "trainer.device": "cpu",
    "backend.verl.rollout_engine": "hf",
    "backend.verl.param_offload": False,
    "backend.verl.optimizer_offload": False,
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line_exit_2_and_writes_nothing(tmp_path):
    cmd = [sys.executable, "-m", "experiments.cli", "rehearse", "--device", "cuda", *TARGET, "--out", "out"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stdout == "" and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith("emapg rehearse: error: --device cuda needs a CUDA device: torch ")
    assert "on CPU: `emapg rehearse experiment=math_deepscaler_ema_pg algo.kl.type=topk_reverse`" in out.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory, no tiny model, no data


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="the refusal is of a machine without vLLM")
def test_device_cuda_without_vllm_names_the_install_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rehearse, "no_cuda", lambda: None)  # as on a GPU machine
    monkeypatch.chdir(tmp_path)
    assert main(["rehearse", "--device", "cuda", *TARGET]) == 2
    err = capsys.readouterr().err
    assert err.startswith("emapg rehearse: error: --device cuda rolls out with vLLM") and len(err.splitlines()) == 1
    assert "No module named 'vllm'" in err and "cluster/gpu-install.sh" in err
    assert list(tmp_path.iterdir()) == []


def test_cuda_settings_differ_from_the_cpu_ones_only_in_what_one_gpu_changes():
    cfg = build.compose(TARGET)
    cpu = rehearsal_settings(cfg, "/m", DATA, 3)
    cuda = rehearsal_settings(cfg, "/m", DATA, 3, device="cuda")
    assert {k: cpu[k] for k in CPU} == CPU and rehearsal_settings(cfg, "/m", DATA, 3, device="cpu") == cpu
    assert {k: v for k, v in cpu.items() if cuda.get(k) != v} == CPU  # the rest is the CPU rehearsal's
    assert {k: v for k, v in cuda.items() if cpu.get(k) != v} == {
        "trainer.device": "cuda",
        "backend.verl.rollout_engine": "vllm",
        "backend.verl.tensor_parallel_size": 1,
        "backend.verl.gpu_memory_utilization": VLLM_MEMORY,
    }


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_rehearsal_compiles_for_its_device(device, tmp_path):
    from omegaconf import OmegaConf

    cfg = build.compose(TARGET + rehearsal_overrides(build.compose(TARGET), "/m", DATA, tmp_path, 3, device=device))
    o = dict(a.split("=", 1) for a in to_verl(OmegaConf.to_container(cfg, resolve=True)).overrides)
    rollout = "actor_rollout_ref.rollout."
    assert (o[f"{rollout}name"], o["trainer.n_gpus_per_node"], o["trainer.nnodes"]) == (
        "hf" if device == "cpu" else "vllm",
        "1",
        "1",
    )
    assert o.get("trainer.device") == ("cpu" if device == "cpu" else None)  # verl's CPU mode only on cpu
    offload = "actor_rollout_ref.actor.fsdp_config.param_offload"
    if device == "cuda":  # one rank of vLLM with a small share of the GPU; the preset's offloading, as on 8 GPUs
        assert (o[f"{rollout}tensor_model_parallel_size"], o[f"{rollout}gpu_memory_utilization"]) == (
            "1",
            str(VLLM_MEMORY),
        )
        assert o[offload] == "true" and o["actor_rollout_ref.actor.fsdp_config.optimizer_offload"] == "true"
    else:
        assert o[offload] == "false" and o["+ray_kwargs.ray_init.num_gpus"] == "1"


def test_device_cuda_of_a_sweep_spec_names_the_field_and_its_one_choice(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the sweep rehearsal runs on CPU only: before, "cuda" was read as the spec
    with pytest.raises(SystemExit) as exited:  # argparse's usage error
        main(["rehearse", "--device", "cuda", "sweeps/math_deepscaler_ema_pg.yaml"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "emapg rehearse: error: argument --device: invalid choice: 'cuda' (choose from 'cpu')"
    assert list(tmp_path.iterdir()) == []
