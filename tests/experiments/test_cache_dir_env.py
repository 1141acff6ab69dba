"""A relative (or ~) EMAPG_CACHE names the directory it names from where emapg started, in every process emapg
starts: a sweep trial's Ray worker runs in the trial's own directory, where a relative path would make each trial
build its own warm start. experiments.cli.main makes it absolute once, at process start."""

from __future__ import annotations

import os
import subprocess
import sys

from experiments import pretrain as P
from experiments.cli import main


def test_a_relative_emapg_cache_is_made_absolute_where_emapg_starts(tmp_path, monkeypatch):
    from experiments import build

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EMAPG_CACHE", "cache")
    assert main(["train", "--help"]) == 0
    assert os.environ["EMAPG_CACHE"] == str(tmp_path / "cache")
    trial = tmp_path / "sweep" / "trial_0"  # a Ray worker runs its trial in the trial's own directory
    trial.mkdir(parents=True)
    monkeypatch.chdir(trial)
    assert build.compose(["smoke=true"]).model.cache_dir == str(tmp_path / "cache")
    assert P.default_cache_dir() == tmp_path / "cache"
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ['EMAPG_CACHE'])"], capture_output=True, text=True
    )
    assert child.stdout.strip() == str(tmp_path / "cache")  # what a worker started from here inherits


def test_a_home_relative_emapg_cache_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("EMAPG_CACHE", "~/c")
    assert main(["train", "--help"]) == 0
    assert os.environ["EMAPG_CACHE"] == str(tmp_path / "c")


def test_an_empty_emapg_cache_is_the_default(tmp_path, monkeypatch):
    """Empty counts as unset (pretrain.default_cache_dir's reading), not as the current directory."""
    from experiments import build

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("EMAPG_CACHE", "")
    assert main(["train", "--help"]) == 0
    assert "EMAPG_CACHE" not in os.environ
    assert build.compose(["smoke=true"]).model.cache_dir == str(tmp_path / ".cache" / "emapg")
