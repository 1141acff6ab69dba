"""Dependency direction (docs/architecture.md, "Dependency rules"): import-linter's contracts in pyproject.toml are
the one checker of which package may import which; this test runs them, as `make lint` does, and shows that they
see an import inside a function."""

import shutil
import subprocess
import sys
from pathlib import Path

LINTED = ("ema_pg_core", "experiments", "sweeps", "analysis", "cluster")


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300)


def test_the_contracts_hold_and_catch_forbidden_imports_inside_functions(tmp_path):
    """The contracts pass on the tree, and fail once a core module imports the app inside a function, or a
    retriever imports a task (tasks import retrievers)."""
    repo = Path(__file__).resolve().parents[1]
    shutil.copy(repo / "pyproject.toml", tmp_path)
    for package in LINTED:
        shutil.copytree(repo / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    ok = _lint_imports(tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    upward = {
        "ema_pg_core/kl.py": "from experiments import records",
        "experiments/ops/retrieval/dense.py": "from experiments.tasks import math",
    }
    for path, line in upward.items():
        with open(tmp_path / path, "a") as f:
            f.write(f"\n\ndef _upward():\n    {line}  # noqa: F401\n")
    broken = _lint_imports(tmp_path)
    assert broken.returncode != 0, broken.stdout
    assert "ema_pg_core.kl -> experiments.records" in broken.stdout, broken.stdout
    assert "experiments.ops.retrieval.dense -> experiments.tasks.math" in broken.stdout, broken.stdout
