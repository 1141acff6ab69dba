"""Golden numbers: a short quickstart (the shipped sweeps/quickstart.yaml at 10 iterations and 2 seeds, both presets,
its real warm start built here) run as a user runs it, `emapg sweep` in a subprocess on a local Ray, must give the
committed sweep.csv values to the last digit. With the default numerics (EMAPG_NUMERICS=reproducible: the same code
paths on every x86-64 CPU, docs/usage.md "Numbers across CPUs") this holds on any Intel or AMD machine with the
pinned library versions; a change to the arithmetic of training fails here. Regenerate with EMAPG_UPDATE_GOLDEN=1
after a change meant to alter the numbers, and say why in the commit."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from experiments import numerics

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden" / "quickstart_short.csv"
SHORT = {"trainer.iterations": 10, "trainer.eval_every": 10, "trainer.save_every": 10, "logger": "none"}
TIMING = ("time", "wall", "perf/", "_s")  # columns that measure the machine, not the computation


def kept(column: str) -> bool:
    return not any(t in column for t in TIMING) and column not in ("trial_id", "run_id", "run_dir", "error")


@pytest.mark.skipif(numerics.DEFAULT != "reproducible", reason="golden numbers are for x86-64 (reproducible mode)")
@pytest.mark.timeout(1800)  # the sweep's own limit below, not pytest's 600 s: beside other jobs it took longer
def test_short_quickstart_gives_the_committed_numbers(tmp_path):
    spec = yaml.safe_load((ROOT / "sweeps" / "quickstart.yaml").read_text())
    spec["base"]["overrides"].update(SHORT)
    spec["seeds"] = [0, 1]
    (tmp_path / "short.yaml").write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMAPG_", "ATEN_", "MKL_", "ONEDNN_"))}
    env.update(EMAPG_CACHE=str(tmp_path / "cache"), WANDB_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    out = tmp_path / "sweep"
    cmd = [str(Path(sys.executable).parent / "emapg"), "sweep", str(tmp_path / "short.yaml"), "--out", str(out)]
    done = subprocess.run([*cmd, "--num-cpus", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(out / "sweep.csv", newline="") as f:
        rows = [{k: v for k, v in r.items() if kept(k)} for r in csv.DictReader(f)]
    rows.sort(key=lambda r: (r["experiment"], int(r["seed"])))
    assert len(rows) == 4 and {r["status"] for r in rows} == {"finished"}, rows
    if os.environ.get("EMAPG_UPDATE_GOLDEN"):
        with open(GOLDEN, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
            w.writeheader()
            w.writerows(rows)
    with open(GOLDEN, newline="") as f:
        golden = list(csv.DictReader(f))
    assert [list(r) for r in rows] == [list(g) for g in golden], "sweep.csv's columns changed"
    diff = [(g["experiment"], g["seed"], k, g[k], r[k]) for r, g in zip(rows, golden) for k in g if r[k] != g[k]]
    assert not diff, f"{len(diff)} values differ from {GOLDEN.name} (preset, seed, column, golden, got): {diff[:10]}"
