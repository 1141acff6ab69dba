"""`emapg eval --engine vllm` where vLLM is not installed is refused before any work: one line naming the engine and
how to install it, exit 2 (not vLLM's ImportError traceback once the model is loaded)."""

from __future__ import annotations

import importlib.util

import pytest

from experiments.cli import main


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A finished math_tiny run with a final policy (nothing is loaded before the refusal)."""
    from omegaconf import OmegaConf

    from experiments import build

    run = tmp_path / "run"
    (run / "final" / "policy").mkdir(parents=True)
    OmegaConf.save(build.compose(["smoke=true", "logger.name=none"]), run / "config.yaml", resolve=True)
    (run / "status").write_text("finished\n")
    monkeypatch.chdir(tmp_path)
    return run


def _without_vllm(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))


def test_engine_vllm_without_vllm_is_one_line_exit_2(run_dir, monkeypatch, capsys):
    _without_vllm(monkeypatch)
    assert main(["eval", str(run_dir), "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for word in ("--engine vllm", "not installed", "cluster/gpu-install.sh", "--engine hf"):
        assert word in err, err
    assert not (run_dir / "evals").exists()  # refused before any work


def test_engine_auto_without_vllm_still_picks_hf(monkeypatch):
    from experiments.ops.evaluate import pick_engine
    from experiments.tasks import TASKS

    _without_vllm(monkeypatch)
    assert pick_engine("auto", TASKS["math_tiny"]) == "hf"
    assert pick_engine("hf", TASKS["math_tiny"]) == "hf"
