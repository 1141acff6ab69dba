"""Importing experiments.backends.verl (and its pure modules) never imports verl; the rest is lazy."""

import subprocess
import sys

import pytest

PURE = [
    "experiments.backends.verl",
    "experiments.backends.verl.config",
    "experiments.backends.verl.ema",
    "experiments.backends.verl.layout",
]


def test_pure_modules_import_without_verl():
    code = (
        "import importlib, sys\n"
        f"for m in {PURE!r}: importlib.import_module(m)\n"
        "bad = sorted({n.split('.')[0] for n in sys.modules} & {'verl', 'ray', 'hydra', 'tensordict', 'pandas'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"pure verl-backend modules import: {out.stdout.strip()}"


def test_require_verl_message(monkeypatch):
    import builtins

    import pytest

    from experiments.backends.verl import require_verl

    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "verl":
            raise ImportError("no verl")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ImportError, match=r"\[verl\] extra"):
        require_verl()


@pytest.mark.verl
def test_verl_platform_cpu_in_the_environment_is_a_known_platform():
    """A process that inherits VERL_PLATFORM=cpu (a rehearsal's children, a shell where it was exported)
    imports the launcher: our "cpu" platform is registered before verl's modules detect the platform."""
    import os

    env = {**os.environ, "VERL_PLATFORM": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", "import experiments.backends.verl.main"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
