"""`make gpu-smoke` (cluster/gpu_smoke.py) here, without a GPU: the one-line refusal, and that its doctor stage
checks the config its rehearsal stage runs (doctor run on it here: what needs no GPU passes)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster import gpu_smoke
from experiments.ops import doctor, rehearse

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of a machine without CUDA")
def test_without_cuda_it_says_so_in_one_line_exits_2_and_runs_nothing(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "cluster.gpu_smoke", "--out", str(tmp_path / "smoke")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and out.stdout == "" and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith("gpu-smoke: error: needs a CUDA device: torch ")
    assert "`emapg rehearse experiment=math_deepscaler_ema_pg`" in out.stderr
    assert not (tmp_path / "smoke").exists()


@pytest.fixture
def untrained(monkeypatch):
    """The rehearsal's tiny model without its SFT (seconds here, a minute on a busy machine): the doctor reads its
    config only."""
    tiny = rehearse.build_model
    monkeypatch.setattr(rehearse, "build_model", lambda out, sft, **kw: tiny(out, sft, steps=0, **kw))


def test_the_doctor_checks_the_config_the_rehearsal_runs(untrained, tmp_path, capsys):
    (test_gpu, doctor_stage, rehearse_stage) = gpu_smoke.stages(tmp_path)
    assert test_gpu[2] == [sys.executable, str(ROOT / "tests" / "run_gpu.py")]  # what `make test-gpu` runs
    assert "$(PYTHON) tests/run_gpu.py" in (ROOT / "Makefile").read_text()
    rehearsals = tmp_path / "rehearsals"
    cli = [sys.executable, "-m", "experiments.cli"]
    assert rehearse_stage[2] == [*cli, "rehearse", "--device", "cuda", *gpu_smoke.TARGET, "--out", str(rehearsals)]
    argv = doctor_stage[2][len(cli) + 1 :]
    assert doctor_stage[2][: len(cli) + 1] == [*cli, "doctor"]
    assert argv == rehearse.rehearsal_target(
        gpu_smoke.TARGET,
        rehearsals / "math_deepscaler_ema_pg",
        rehearse.Shared(rehearsals / "_shared", "cuda"),
        3,
        device="cuda",
    )  # the run directory, tiny model and data of `emapg rehearse --out <rehearsals>`
    path = next(a for a in argv if a.startswith("model.path=")).split("=", 1)[1].strip("'")
    model = json.loads((Path(path) / "config.json").read_text())
    assert model["hidden_size"] // model["num_attention_heads"] == 64  # a head size every vLLM attention backend has
    doctor.main(argv)
    lines = capsys.readouterr().out.splitlines()
    assert "backend=verl needs 1 GPU(s) per node [trainer.nnodes=1 x trainer.n_gpus_per_node=1]" in lines[0]
    status = {line.split()[1]: line.split()[0] for line in lines[1:-1]}
    assert [status[c] for c in ("paths", "task", "checkpoint", "wandb")] == ["PASS"] * 4, "\n".join(lines)
    assert "rollout_engine=vllm" in next(line for line in lines if line.split()[1] == "rollout")


@pytest.mark.parametrize("codes,verdict", [((0, 0, 0), "gpu-smoke: passed"), ((0, 1, 0), "FAILED (1 of 3 stages)")])
def test_the_verdict_is_a_line_per_stage_and_exit_1_on_a_failure(
    codes, verdict, untrained, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(gpu_smoke, "no_cuda", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100")
    ran = iter(codes)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, next(ran)))
    assert gpu_smoke.main(["--out", str(tmp_path)]) == int(any(codes))
    lines = capsys.readouterr().out.splitlines()
    assert lines[-5] == "gpu-smoke on NVIDIA H100:" and lines[-1].endswith(verdict)
    shown = [(line.split()[0], line.rsplit("log: ", 1)[1]) for line in lines[-4:-1]]
    logs = [str(tmp_path / f"{name}.log") for name in ("test-gpu", "doctor", "rehearse")]
    assert shown == [("FAILED" if code else "passed", log) for code, log in zip(codes, logs)]
