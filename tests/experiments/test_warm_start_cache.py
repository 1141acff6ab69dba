"""The cached warm start (experiments.pretrain) as found on disk: a damaged entry (a truncated, changed or missing
file, an unreadable marker) is rebuilt, saying so in one line naming it, never loaded as it is."""

from __future__ import annotations

import json
import os

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from experiments import pretrain as P
from experiments.cli import main

KWARGS = dict(model_cfg=dict(hidden=32, layers=1, heads=2), steps=2, batch_size=2, progress=False, pool=8, val_size=2)


def _build(tmp_path, monkeypatch):
    """The tiny warm start built into a fresh EMAPG_CACHE: (its path, the list each further training appends to)."""
    monkeypatch.setenv("EMAPG_CACHE", str(tmp_path / "cache"))
    path = P.pretrain("math_tiny", target_acc=None, **KWARGS)
    assert path.parent == tmp_path / "cache"
    trained, train = [], P.train
    monkeypatch.setattr(P, "train", lambda *a, **kw: trained.append(a) or train(*a, **kw))
    return path, trained


def _truncate(file) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _flip_a_byte(file) -> None:
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, file, words",
    [
        (_truncate, "model.safetensors", ["model.safetensors", "bytes"]),
        (_flip_a_byte, "model.safetensors", ["model.safetensors", "changed"]),
        (lambda f: f.unlink(), "model.safetensors", ["model.safetensors", "missing"]),
        (_truncate, "tokenizer_config.json", ["tokenizer_config.json"]),
        (_truncate, P.MARKER, [P.MARKER, "unreadable"]),
    ],
    ids=["truncated", "changed", "missing", "tokenizer", "marker"],
)
def test_a_damaged_warm_start_is_rebuilt_saying_so(damage, file, words, tmp_path, monkeypatch, capsys):
    path, trained = _build(tmp_path, monkeypatch)
    capsys.readouterr()
    damage(path / file)
    assert P.pretrain("math_tiny", target_acc=None, **KWARGS) == path
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "warm start" in ln]  # not transformers' bars
    AutoModelForCausalLM.from_pretrained(path)  # SafetensorError before: the damaged file was reused
    AutoTokenizer.from_pretrained(path)
    assert len(trained) == 1
    assert len(lines) == 1 and str(path) in lines[0] and "rebuilding it" in lines[0], lines
    for word in words:
        assert word in lines[0], lines[0]
    assert P.pretrain("math_tiny", target_acc=None, **KWARGS) == path and len(trained) == 1  # intact again
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]  # no temporary directories left


def test_an_intact_warm_start_is_reused_silently(tmp_path, monkeypatch, capsys):
    path, trained = _build(tmp_path, monkeypatch)
    capsys.readouterr()
    assert P.pretrain("math_tiny", target_acc=None, **KWARGS) == path
    assert trained == [] and "warm start" not in capsys.readouterr().err
    assert set(json.loads((path / P.MARKER).read_text())["files"]) >= {"model.safetensors", "config.json"}


def test_emapg_pretrain_rebuilds_a_truncated_warm_start(tmp_path, monkeypatch, capsys):
    """The command line's view: exit 0 and the one line, no SafetensorError traceback."""
    monkeypatch.setenv("EMAPG_CACHE", str(tmp_path / "cache"))
    argv = ["pretrain", "task=math_tiny", "steps=2", "batch_size=2", "pool=8", "val_size=2", "target_acc=null"]
    argv += ["model.hidden=32", "model.layers=1", "model.heads=2"]
    assert main(argv) == 0
    path = capsys.readouterr().out.strip().splitlines()[-1]
    _truncate(tmp_path / "cache" / os.path.basename(path) / "model.safetensors")
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.strip().splitlines()[-1] == path and "Traceback" not in err
    assert [ln for ln in err.splitlines() if "rebuilding it" in ln] and path in err
    AutoModelForCausalLM.from_pretrained(path)
