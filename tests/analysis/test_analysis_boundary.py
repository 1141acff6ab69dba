"""analysis never imports torch or the core (docs/architecture.md, "Dependency rules"): each module is imported
in a fresh interpreter and sys.modules is checked."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import analysis

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("torch", "ema_pg_core", "ray", "hydra", "wandb")  # wandb: only inside load_wandb


def analysis_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(analysis.__path__, "analysis."))


def test_modules_are_found():
    mods = analysis_modules()
    assert {"analysis.load", "analysis.report", "analysis.figures.style"} <= set(mods)


def test_no_forbidden_imports():
    code = (
        "import importlib, json, sys\n"
        f"for m in {analysis_modules()!r}: importlib.import_module(m)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(json.dumps(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
