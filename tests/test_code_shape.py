"""Code shape: product code (every tracked .py file outside tests/) reads without scrolling or counting.

- One screen: no function is longer than MAX_LINES lines, counted as `ast` does (end_lineno - lineno + 1:
  from `def` to the last line of the body, decorators excluded, docstring and comments inside included).
  80 lines at <= 120 columns is one screen. The bound was 60: that cap was met by splitting functions into
  helpers that passed their settings on as packed config tuples and took a dozen positional arguments,
  which read worse than the function they came from. Split a function when it does two things, not to pass
  a count.
- No function or method takes more than MAX_POSITIONAL positional parameters (positional-only + regular,
  not counting a leading self/cls). Parameters after `*` or `*args` are keyword-only and not counted: make
  trailing parameters keyword-only (`def f(a, b, *, c, d)`) or group what belongs together in a small
  dataclass, so that a call site names what it passes.

EXEMPT lists the only signatures allowed over the bound, each fixed by someone else's API, with the reason.
"""

import ast
from pathlib import Path
from typing import NamedTuple

from tests.repo import git_files

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80
MAX_POSITIONAL = 5

_AUTOGRAD_FORWARD = "torch.autograd.Function.forward: Function.apply(*inputs) passes ctx and the inputs positionally"
_AUTOGRAD_BACKWARD = "torch.autograd.Function.backward: autograd passes ctx and one gradient per output positionally"
EXEMPT = {
    ("ema_pg_core/topk.py", "_FromLogits.forward"): _AUTOGRAD_FORWARD,
    ("ema_pg_core/topk.py", "_FromLogits.backward"): _AUTOGRAD_BACKWARD,
    ("ema_pg_core/topk.py", "_FromHidden.forward"): _AUTOGRAD_FORWARD,
    ("ema_pg_core/topk.py", "_FromHidden.backward"): _AUTOGRAD_BACKWARD,
}


class Fn(NamedTuple):
    name: str  # qualified: Class.method, outer.inner
    line: int  # of `def`
    lines: int  # length
    positional: int  # positional-only + regular parameters, a leading self/cls not counted


def _product_files() -> list[str]:
    """Tracked .py files outside tests/ (paths relative to the repository root)."""
    return [p for p in git_files("*.py") if not p.startswith("tests/")]


def _positional(args: ast.arguments) -> int:
    names = [a.arg for a in args.posonlyargs + args.args]
    return len(names) - (1 if names[:1] in (["self"], ["cls"]) else 0)


def _functions(source: str) -> list[Fn]:
    """Every function and method, nested ones included."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found.append(Fn(name, child.lineno, child.end_lineno - child.lineno + 1, _positional(child.args)))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def _too_long(source: str) -> list[Fn]:
    return [f for f in _functions(source) if f.lines > MAX_LINES]


def _too_many_positional(source: str) -> list[Fn]:
    return [f for f in _functions(source) if f.positional > MAX_POSITIONAL]


def test_the_walker_finds_functions():
    files = _product_files()
    assert "experiments/run.py" in files and not any(p.startswith("tests/") for p in files)
    assert "sweeps/tune.py" in files and "benchmarks/ema_update.py" in files
    names = {f.name for f in _functions((ROOT / "experiments/run.py").read_text(encoding="utf-8"))}
    assert "run" in names
    methods = {f.name for f in _functions((ROOT / "sweeps/model.py").read_text(encoding="utf-8"))}
    assert "Spec.overrides_for" in methods  # methods, with their class


def test_lengths_exclude_decorators_and_include_nested_functions():
    nested = "class C:\n    def g(self):\n        def h():\n" + "            pass\n" * 3
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES - 1))
    source = nested + "\n\n@decorator\n@other(1)\ndef f():\n" + body
    assert [f[:3] for f in _functions(source)] == [("C.g", 2, 5), ("C.g.h", 3, 4), ("f", 11, MAX_LINES)]
    longer = source.replace("def f():\n", "def f():\n    y = 0\n")
    assert _too_long(source) == [] and [f[:3] for f in _too_long(longer)] == [("f", 11, MAX_LINES + 1)]


def test_positional_parameters_are_counted_as_a_call_site_sees_them():
    source = """
def six(a, b, c, d, e, f): pass
def five_then_keywords(a, b, c, d, e, *, f, g, h): pass
def varargs(a, b, *args, c, d, e, f, g): pass
def positional_only(a, b, /, c, d, e, f): pass
def defaults_count(a, b, c, d, e, f=1): pass
class C:
    def method(self, a, b, c, d, e): pass
    def method_six(self, a, b, c, d, e, f): pass
    @classmethod
    def make(cls, a, b, c, d, e): pass
    @staticmethod
    def static(ctx, a, b, c, d, e): pass
    async def later(self, a, b, c, d, e, f, *, g): pass
def outer():
    def inner(a, b, c, d, e, f): pass
"""
    counts = {f.name: f.positional for f in _functions(source)}
    assert counts == {
        "six": 6, "five_then_keywords": 5, "varargs": 2, "positional_only": 6, "defaults_count": 6,
        "C.method": 5, "C.method_six": 6, "C.make": 5, "C.static": 6, "C.later": 6, "outer": 0, "outer.inner": 6,
    }  # fmt: skip
    over = [f.name for f in _too_many_positional(source)]
    assert over == ["six", "positional_only", "defaults_count", "C.method_six", "C.static", "C.later", "outer.inner"]


def test_no_function_is_longer_than_one_screen():
    over = [
        f"{path}:{f.line} {f.name} ({f.lines} lines)"
        for path in _product_files()
        for f in _too_long((ROOT / path).read_text(encoding="utf-8"))
    ]
    assert not over, f"{len(over)} function(s) over {MAX_LINES} lines (one screen):\n" + "\n".join(over)


def _over_positional() -> dict[tuple[str, str], Fn]:
    return {
        (path, f.name): f
        for path in _product_files()
        for f in _too_many_positional((ROOT / path).read_text(encoding="utf-8"))
    }


def test_no_function_takes_more_than_five_positional_parameters():
    over = [
        f"{path}:{f.line} {name} ({f.positional} positional)"
        for (path, name), f in _over_positional().items()
        if (path, name) not in EXEMPT
    ]
    assert not over, (
        f"{len(over)} function(s) with more than {MAX_POSITIONAL} positional parameters; make the trailing ones "
        "keyword-only (def f(a, b, *, c, d)) or group what belongs together in a dataclass:\n" + "\n".join(over)
    )


def test_every_allowed_signature_still_needs_it():
    over = _over_positional()
    stale = [f"{path} {name}" for (path, name) in EXEMPT if (path, name) not in over]
    assert not stale, "no longer over the bound (or gone): remove from EXEMPT:\n" + "\n".join(stale)
    assert all(EXEMPT.values())
