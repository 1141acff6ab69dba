def test_scoring_prints_no_math_verify_timeout_notice():
    """Timeouts are off on purpose; math-verify's once-per-process notice about it is filtered,
    and only that one (a parse error would still be logged)."""
    import subprocess
    import sys

    code = (
        "import logging; logging.basicConfig();"
        "from experiments.tasks import math, math_tiny;"
        "ex = math_tiny.load('test', n=1, seed=0)[0];"
        "assert math_tiny.evaluate(ex, math_tiny.demonstration(ex, __import__('random').Random(0))) == 1;"
        "assert math.is_equiv('1/2', ['0.5']);"
        "logging.getLogger('math_verify.parser').warning('Timeout during parsing: x')"
    )
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stderr
    assert "Timeout is disabled" not in err and "Timeout during parsing: x" in err


def test_without_reasoning_gym_math_tiny_names_the_extra(monkeypatch):
    """reasoning-gym is the [tiny] extra (it pins pycosat, a C extension with no wheel, which the GPU install
    must not compile): without it, math_tiny says which extra to install."""
    import sys

    import pytest

    from experiments.tasks import math_tiny

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    with pytest.raises(ImportError, match=r"reasoning-gym, an optional dependency: pip install -e '\.\[tiny\]'"):
        math_tiny.load("test", n=1)
