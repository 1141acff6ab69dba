"""Dependency direction (docs/architecture.md, "Dependency rules"): each package imported alone in a fresh
interpreter."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FORBIDDEN = {
    "ema_pg_core": [
        "hydra",
        "omegaconf",
        "ray",
        "pandas",
        "wandb",
        "matplotlib",
        "experiments",
        "sweeps",
        "analysis",
        "verl",
        "pydantic",
    ],
    "experiments": ["ray", "sweeps", "analysis"],
    "analysis": ["torch", "ema_pg_core", "ray"],
}


VERL_SIDE = ("experiments.backends.verl",)
"""The verl backend (its agent loop included) imports verl (and through it Ray) by design; [verl] extra only."""


def _modules(package: str) -> list[str]:
    """`package` and every module below it, subpackages included (walked with the package prefix:
    unprefixed, pkgutil imports subpackages by their bare names, fails quietly and never recurses)."""
    import importlib
    import pkgutil

    pkg = importlib.import_module(package)
    return [package] + [
        m.name for m in pkgutil.walk_packages(pkg.__path__, f"{package}.") if not m.name.startswith(VERL_SIDE)
    ]


def test_the_walk_reaches_subpackages():
    assert "ema_pg_core.local.trainer" in _modules("ema_pg_core")
    assert "experiments.ops.retrieval.dense" in _modules("experiments") and "analysis.figures.style" in _modules(
        "analysis"
    )


def test_retrieval_does_not_import_the_tasks():
    """Tasks import retrievers, never the reverse: only `emapg retriever serve --task` (retrieval.cli's
    main) looks a task up, at call time."""
    mods = _modules("experiments.ops.retrieval")
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "print(','.join(sorted(n for n in sys.modules if n.startswith('experiments.tasks'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "experiments.ops.retrieval.cli" in mods and out.stdout.strip() == ""


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_nothing_forbidden(package):
    mods = _modules(package)
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        f"bad = sorted({{n.split('.')[0] for n in sys.modules}} & set({FORBIDDEN[package]!r}))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{package} imports forbidden: {out.stdout.strip()}"


LINTED = ("ema_pg_core", "experiments", "sweeps", "analysis", "cluster")


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300)


def test_the_layer_contracts_hold_and_catch_an_upward_import_inside_a_function(tmp_path):
    """`make lint`'s import-linter contracts (pyproject.toml) pass on the tree, and fail once a core module imports
    the app inside a function (what the import-time checks above cannot see)."""
    repo = Path(__file__).resolve().parents[1]
    shutil.copy(repo / "pyproject.toml", tmp_path)
    for package in LINTED:
        shutil.copytree(repo / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    ok = _lint_imports(tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    with open(tmp_path / "ema_pg_core" / "kl.py", "a") as f:
        f.write("\n\ndef _upward():\n    from experiments import records  # noqa: F401\n")
    broken = _lint_imports(tmp_path)
    assert broken.returncode != 0 and "ema_pg_core.kl -> experiments.records" in broken.stdout, broken.stdout
