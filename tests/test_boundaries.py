"""Dependency direction (architecture.md): each package imported alone in a fresh interpreter."""

import subprocess
import sys

import pytest

FORBIDDEN = {
    "ema_pg_core": ["hydra", "omegaconf", "ray", "pandas", "wandb", "matplotlib", "experiments", "sweeps", "analysis", "verl"],
    "experiments": ["ray", "sweeps", "analysis"],
    "analysis": ["torch", "ema_pg_core", "ray"],
}


def _core_modules():
    import pkgutil

    import ema_pg_core

    # a prefix, so that walking recurses into ema_pg_core.local (unprefixed, it would import a top-level "verl")
    return ["ema_pg_core"] + [m.name for m in pkgutil.walk_packages(ema_pg_core.__path__, "ema_pg_core.")
                              if not m.name.startswith("ema_pg_core.verl")]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_nothing_forbidden(package):
    if package == "ema_pg_core":
        mods = _core_modules()
    else:
        import importlib
        import pkgutil

        pkg = importlib.import_module(package)
        mods = [package] + [f"{package}.{m.name}" for m in pkgutil.walk_packages(pkg.__path__) if not m.name.startswith(("cli", "verl"))]
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        f"bad = sorted({{n.split('.')[0] for n in sys.modules}} & set({FORBIDDEN[package]!r}))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{package} imports forbidden: {out.stdout.strip()}"
