"""docs/run-record.md's "Metric keys" table and the code agree: the keys marked local are exactly those a tiny
local run logs (forward Top-k and K3, probe on, one evaluation); the keys marked verl are exactly those the verl
metric mapping (experiments.verl_metrics.convert) makes of the plugin's metric names, which are read from its
code (verl's own names in TRAIN_KEYS, the loss's topk/* from ema_pg_core.telemetry, the anchor/* literals of
the worker, the EMA and the trainer) plus one validation line per eval mode."""

import ast
import re
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(
    r"^\| `(?P<key>[^`]+)` \| (?P<meaning>[^|]*(?:\\\|[^|]*)*) \| (?P<unit>[^|]+) \| (?P<backend>[^|]+) \|$"
)


def table() -> dict[str, set[str]]:
    """{key: {backends}} from the table, with the task name in place of <benchmark>."""
    text = (ROOT / "docs" / "run-record.md").read_text()
    section = text.split("## Metric keys", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if (m := ROW.match(line)) and m["key"] != "key":
            rows[m["key"].replace("<benchmark>", "toy")] = {b.strip() for b in m["backend"].split(",")}
    assert len(rows) >= 30, "the table was not found or not parsed"
    return rows


def local_keys() -> set[str]:
    from ema_pg_core.local.tiny import build_model
    from ema_pg_core.local.trainer import LocalTrainer
    from tests.core.test_local import TOK, Toy, make_cfg

    keys: set[str] = set()
    for kl in ("topk_forward", "k3"):
        cfg = make_cfg(kl, iterations=1)
        cfg = replace(cfg, trainer=replace(cfg.trainer, probe_every=1, probe_size=2))
        model = build_model(TOK, hidden=16, layers=1, heads=2, seed=0)
        trainer = LocalTrainer(model, TOK, Toy(), cfg, tempfile.mkdtemp())
        keys |= set(trainer.step()) | set(trainer.evaluate()[0])
    return keys


def _anchor_literals() -> set[str]:
    """Every "anchor/..." string constant in the verl plugin's worker, EMA and trainer modules."""
    found = set()
    for name in ("worker.py", "ema.py", "trainer.py"):
        tree = ast.parse((ROOT / "experiments" / "backends" / "verl" / name).read_text())
        found |= {
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and re.fullmatch(r"anchor/\w+", n.value)
        }
    return found


def verl_keys() -> set[str]:
    from ema_pg_core.telemetry import TOPK_FORWARD_KEYS, TOPK_KEYS
    from experiments.verl_metrics import SAME_KEYS, TRAIN_KEYS, convert

    topk = [f"actor/{k}" for k in TOPK_KEYS + TOPK_FORWARD_KEYS]
    data = dict.fromkeys([*TRAIN_KEYS, *_anchor_literals(), *topk, *SAME_KEYS], 0.0)
    data.update({f"val-{who}/toy/acc/mean@1": 0.0 for who in ("core", "anchor-core")})  # policy, anchor validation
    return set(convert(data, "toy", greedy=True)) | set(convert(data, "toy", greedy=False))


@pytest.mark.parametrize("backend", ["local", "verl"])
def test_the_table_lists_exactly_the_logged_keys(backend):
    documented = {k for k, b in table().items() if backend in b}
    logged = local_keys() if backend == "local" else verl_keys()
    assert documented == logged, f"only in the table: {documented - logged}; only logged: {logged - documented}"


def test_every_row_names_a_known_backend_and_a_unit():
    for key, backends in table().items():
        assert backends and backends <= {"local", "verl"}, key
