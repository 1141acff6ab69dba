"""Code shape: no function in product code (every tracked .py file outside tests/) is longer than
MAX_LINES lines, counted as `ast` does (end_lineno - lineno + 1: from `def` to the last line of the
body, decorators excluded, docstring and comments inside included). Split a longer one into helpers."""

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 60


def _product_files() -> list[str]:
    """Tracked .py files outside tests/ (paths relative to the repository root)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
        )
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e}): the tracked files are unknown")
    return sorted(
        p for p in out.stdout.split("\0") if p and not p.startswith("tests/") and (ROOT / p).is_file()
    )  # a tracked file deleted in the work tree is skipped


def _functions(source: str) -> list[tuple[str, int, int]]:
    """(qualified name, line of `def`, length in lines) of every function and method, nested ones included."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def _too_long(source: str) -> list[tuple[str, int, int]]:
    return [f for f in _functions(source) if f[2] > MAX_LINES]


def test_the_walker_finds_functions():
    files = _product_files()
    assert "experiments/run.py" in files and not any(p.startswith("tests/") for p in files)
    assert "sweeps/tune.py" in files and "benchmarks/ema_update.py" in files
    names = {name for name, _, _ in _functions((ROOT / "experiments/run.py").read_text(encoding="utf-8"))}
    assert "run" in names
    methods = {name for name, _, _ in _functions((ROOT / "sweeps/spec.py").read_text(encoding="utf-8"))}
    assert "Spec.overrides_for" in methods  # methods, with their class


def test_lengths_exclude_decorators_and_include_nested_functions():
    nested = "class C:\n    def g(self):\n        def h():\n" + "            pass\n" * 3
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES - 1))
    source = nested + "\n\n@decorator\n@other(1)\ndef f():\n" + body
    assert _functions(source) == [("C.g", 2, 5), ("C.g.h", 3, 4), ("f", 11, MAX_LINES)]
    longer = source.replace("def f():\n", "def f():\n    y = 0\n")
    assert _too_long(source) == [] and _too_long(longer) == [("f", 11, MAX_LINES + 1)]


def test_no_function_is_longer_than_the_limit():
    over = [
        f"{path}:{line} {name} ({n} lines)"
        for path in _product_files()
        for name, line, n in _too_long((ROOT / path).read_text(encoding="utf-8"))
    ]
    assert not over, f"{len(over)} function(s) over {MAX_LINES} lines; split them into helpers:\n" + "\n".join(over)
