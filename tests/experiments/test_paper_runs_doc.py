"""docs/paper-runs.md's commands agree on where verl's checkpoints are: the math run's `run_dir` puts them in
`<run_dir>/checkpoints` (what verl is told, `trainer.default_local_dir`), which is where the doc's merge step reads
the actor from (and where `emapg eval <run_dir>` and a resume look). Before, a plain `emapg train` left them in
verl's default, `checkpoints/<project>/<run id>` under whatever directory verl's processes started in."""

from __future__ import annotations

import os
import re
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from experiments import build
from experiments.backends.verl.launch import checkpoint_root, to_verl

DOC = Path(__file__).resolve().parents[2] / "docs" / "paper-runs.md"


def test_the_merge_step_reads_the_checkpoints_the_train_step_writes(tmp_path, monkeypatch):
    text = DOC.read_text()
    train = re.search(r"`emapg train (experiment=math_deepscaler_ema_pg [^`]*run_dir=(\S+?))`", text)
    merge = re.search(r"--local_dir\s+(\S+)/global_step_(\d+)/actor", text)
    assert train and merge, "the math pipeline's train or merge step is no longer in docs/paper-runs.md"
    monkeypatch.chdir(tmp_path)  # the doc's paths are relative to where the user runs the commands
    overrides = [o for o in train.group(1).split() if not o.startswith("stages=")]
    run = OmegaConf.to_container(build.compose(overrides), resolve=True)
    args = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(to_verl(run).overrides)}
    assert args["trainer.default_local_dir"] == checkpoint_root(run) == str(tmp_path / train.group(2) / "checkpoints")
    assert os.path.abspath(merge.group(1)) == checkpoint_root(run)
    with_dir = dict(run, backend={**run["backend"], "verl": {**run["backend"]["verl"], "checkpoint_dir": "/big/c"}})
    assert checkpoint_root(with_dir) == "/big/c"  # backend.verl.checkpoint_dir, when set, wins
