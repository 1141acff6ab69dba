"""Tiny model + tokenizer round trips, SFT masking, and the cached warm start."""

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ema_pg_core.local.tiny import CHARSET, build_model, build_tokenizer
from experiments import pretrain as P
from experiments.tasks import get_task

TINY = dict(hidden=32, layers=1, heads=2)


def _task_strings(task: str) -> list[str]:
    t = get_task(task)
    rng = random.Random(0)
    return [t.prompt(e) + t.demonstration(e, rng) for e in t.load("train", 30, seed=0)]


def test_tokenizer_is_character_level_and_deterministic():
    tok = build_tokenizer()
    assert len(tok) == 4 + len(CHARSET)
    assert build_tokenizer().get_vocab() == tok.get_vocab()
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|pad|>", "<|bos|>", "<|eos|>")
    assert tok("ab c", add_special_tokens=True).input_ids == tok("ab c", add_special_tokens=False).input_ids
    assert len(tok(CHARSET).input_ids) == len(CHARSET)
    with pytest.raises(ValueError, match="charset"):
        build_tokenizer("")


@pytest.mark.parametrize("task", ["math_tiny", "search_tiny"])
def test_tokenizer_round_trips_task_strings(task, tmp_path):
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    build_model(tok, **TINY).config.save_pretrained(tmp_path)  # AutoTokenizer dispatches on model_type
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in _task_strings(task):
        assert set(text) <= set(CHARSET)
        ids = tok(text).input_ids
        assert len(ids) == len(text)  # one token per character
        assert loaded(text).input_ids == ids
        assert tok.decode(ids) == text and loaded.decode(ids) == text


def test_model_round_trips_through_save_pretrained(tmp_path):
    tok = build_tokenizer()
    model = build_model(tok, seed=0, **TINY).eval()
    assert model.config.vocab_size == len(tok) and model.config.eos_token_id == tok.eos_token_id
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([tok("12+7=19").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert torch.equal(build_model(tok, seed=0, **TINY).lm_head.weight, model.lm_head.weight)  # seeded init
    with pytest.raises(ValueError, match="divisible"):
        build_model(tok, hidden=30, heads=4)


def test_sft_labels_mask_prompt_and_environment_text():
    t, tok = get_task("search_tiny"), build_tokenizer()
    ex = next(e for e in t.load("train", 10, seed=0) if len(e.meta["hops"]) == 2)
    demo = t.demonstration(ex)
    ids, labels = P.encode_example(tok, t, ex, demo, t.make_env())
    assert len(ids) == len(labels) == len(ex.prompt) + len(demo) + 1 and ids[-1] == tok.eos_token_id
    trained = tok.decode([i for i, y in zip(ids, labels) if y != -100])
    assert (
        trained == f"<search>{ex.meta['hops'][0]}</search><search>{ex.meta['hops'][1]}</search>"
        f"<answer>{ex.answer[0]}</answer><|eos|>"
    )
    with pytest.raises(ValueError, match="differs from the environment"):
        P.encode_example(tok, t, ex, demo.replace("born in", "born at", 1), t.make_env())


def test_cache_name_is_canonical_and_covers_the_provenance():
    explicit = P.resolve("math_tiny", knobs=dict(get_task("math_tiny").Knobs().__dict__), model=dict(hidden=128))
    built = P.provenance("math_tiny")
    assert P.cache_name(P.resolve("math_tiny"), built) == P.cache_name(explicit, built)
    assert P.cache_name(P.resolve("math_tiny", seed=1), built) != P.cache_name(P.resolve("math_tiny"), built)
    other_torch = {**built, "numerics": {**built["numerics"], "versions": {"torch": "0.0"}}}
    assert P.cache_name(explicit, other_torch) != P.cache_name(explicit, built)
    assert P.provenance("math_tiny")["builder"] != P.provenance("search_tiny")["builder"]  # the task's module
    with pytest.raises(ValueError, match="unknown pretrain"):
        P.resolve("math_tiny", epochs=3)
    with pytest.raises(ValueError, match="unknown math_tiny knob"):
        P.resolve("math_tiny", knobs={"digit": 2})


def test_pretrain_builds_once_then_reuses_the_cache(tmp_path, monkeypatch):
    kwargs = dict(
        model_cfg=TINY,
        steps=3,
        batch_size=4,
        seed=0,
        cache_dir=tmp_path,
        progress=False,
        pool=32,
        val_size=4,
        target_acc=None,
    )
    path = P.pretrain("math_tiny", **kwargs)
    assert path.parent == tmp_path and path.name.startswith("math_tiny-")
    marker = json.loads((path / P.MARKER).read_text())
    assert marker["steps_done"] == 3 and marker["config"]["model"]["hidden"] == 32
    AutoModelForCausalLM.from_pretrained(path)
    AutoTokenizer.from_pretrained(path)

    def no_training(*args, **kw):
        raise AssertionError("trained again although the warm start is cached")

    monkeypatch.setattr(P, "train", no_training)
    assert P.pretrain("math_tiny", **kwargs) == path
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary directories left


@pytest.mark.parametrize(
    "field, recorded",
    [("numerics.versions.torch", "2.0.0"), ("numerics.versions.transformers", "4.0.0"), ("builder", "0" * 16)],
)
def test_a_warm_start_built_otherwise_is_rebuilt_saying_why(tmp_path, monkeypatch, capsys, field, recorded):
    kwargs = dict(model_cfg=TINY, steps=2, batch_size=2, cache_dir=tmp_path, progress=False, pool=8, val_size=2)
    path = P.pretrain("math_tiny", target_acc=None, **kwargs)
    marker = json.loads((path / P.MARKER).read_text())
    *parents, leaf = field.split(".")
    node = marker["provenance"]
    for key in parents:
        node = node[key]
    now, node[leaf] = node[leaf], recorded  # as if a torch, transformers or builder of another version built it
    (path / P.MARKER).write_text(json.dumps(marker))
    trained, train = [], P.train
    monkeypatch.setattr(P, "train", lambda *a, **kw: trained.append(a) or train(*a, **kw))
    assert P.pretrain("math_tiny", target_acc=None, **kwargs) == path
    assert len(trained) == 1
    assert f"{field}: {recorded!r} -> {now!r}" in capsys.readouterr().err
    assert P.stale(path, P.provenance("math_tiny")) is None  # rebuilt with this provenance
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_pretrain_stops_at_the_target_accuracy(tmp_path, monkeypatch):
    accs = iter([0.1, 0.5, 0.9])
    monkeypatch.setattr(P, "accuracy", lambda *a: next(accs))
    path = P.pretrain(
        "search_tiny",
        model_cfg=TINY,
        steps=10,
        batch_size=2,
        cache_dir=tmp_path,
        progress=False,
        pool=16,
        val_size=4,
        eval_every=2,
        target_acc=0.4,
    )
    marker = json.loads((path / P.MARKER).read_text())
    assert (marker["steps_done"], marker["val_acc"], marker["reached_target"]) == (4, 0.5, True)


def test_main_parses_overrides(tmp_path, capsys):
    args = [
        "task=math_tiny",
        "steps=2",
        "batch_size=2",
        "pool=16",
        "val_size=2",
        "target_acc=null",
        "model.hidden=32",
        "model.layers=1",
        "model.heads=2",
        "knobs.steps=2",
        f"cache_dir={tmp_path}",
    ]
    assert P.main(args) == 0
    path = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert path.parent == tmp_path
    assert json.loads((path / P.MARKER).read_text())["config"]["knobs"]["steps"] == 2
    with pytest.raises(ValueError, match="key=value"):
        P.main(["task"])
