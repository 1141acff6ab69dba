"""Deferred imports: an import inside a function only where it defers an optional or heavy dependency, and no
import cycle among the packages (docs/architecture.md, "Dependency rules").

Static, with `ast` only: nothing of the product is imported. For every tracked .py file outside tests/:

- An import inside a function must load, at least one HEAVY module that its own module does not load when it
  is imported. What a module loads is the transitive closure of its module-level imports (module body, if/try/
  with/class bodies; `if TYPE_CHECKING:` blocks and functions excluded), the parent packages of each imported
  module included; an own module is as heavy as what it loads. Standard-library modules are never heavy.
  Anything else goes to the module's import block. ALLOWED lists the few exceptions, each with its reason; an
  entry that is no longer needed fails the test.
- A deferred import of one of the PACKAGES names its reason in a trailing comment on the import line (what it
  defers, or why it cannot be at the top): that it is heavy is not visible from the name. A deferred
  `import torch` or `from verl ...` needs none.
- The module-level import graph of the PACKAGES has no cycle.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.repo import git_files

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ema_pg_core", "experiments", "sweeps", "analysis", "cluster")

_VERL = "the [verl] extra only (a GPU install, or .venv-verl)"
HEAVY = {
    "torch": "over a second to import",
    "torch.distributed.fsdp": "over half a second more than torch; FSDP training only",
    "torch.nn.attention.varlen": "newer torch only (a feature check), and over a second more than torch",
    "transformers": "most of a second, and it imports torch",
    "ray": "about half a second (Ray Tune over a second); the layers below sweeps use it only to join a cluster",
    "hydra": "over 100 ms; only experiments.build composes configs",
    "omegaconf": "tens of ms; configs are composed in experiments.build",
    "pandas": "about 400 ms",
    "pyarrow": "about 100 ms",
    "scipy": "scipy.stats is about 300 ms; only planning seeds for power (analysis.stats.seeds_for_power) needs it",
    "matplotlib": "over 200 ms",
    "wandb": "about half a second",
    "wandb_workspaces": "its reports and workspaces import wandb",
    "optuna": "about 200 ms",
    "ray.tune.search.optuna": "imports optuna",
    "numpy": "60 to 140 ms, several times `emapg --help`'s whole import",
    "tqdm": "tqdm.auto is about 60 ms; experiments.progress, which `emapg --help` loads, needs it for a bar only",
    "pydantic": "its models take about 70 ms; only the sweep YAML and the verl section are models",
    "huggingface_hub": "not a declared dependency (transformers brings it); `emapg doctor` copes without it",
    "httpx": "over 100 ms; the retriever's client",
    "fastapi": "about half a second; the retriever's server",
    "uvicorn": "the retriever's server",
    "bm25s": "over 100 ms; the BM25 retriever",
    "math_verify": "about 300 ms; math answer checking",
    "faiss": "the [retrieval] extra only",
    "reasoning_gym": "the [tiny] extra only (math_tiny's generator), about a second",
    "jsonschema": "the [dev] extra only",
    "verl": _VERL,
    "verl.trainer.ppo.v1.trainer_sync": "most of a second more than verl's entry point, and it detects the "
    "accelerator, which experiments.backends.verl.cpu.install must precede on CPU",
    "tensordict": _VERL,
    "transfer_queue": _VERL,
    "datasets": _VERL,
    "vllm": "a GPU install only",
    "sglang": "a GPU install only",
    "flash_attn": "a GPU install only",
}

DISCOVERED = {"experiments.tasks": "TASKS: importing the package imports each of its task modules (pkgutil)"}
"""Packages that import their modules at import time by discovery rather than by an import statement."""

ALLOWED = {
    ("experiments/ops/retrieval/cli.py", "experiments.tasks"): (
        "tasks import retrievers, never the reverse: only `emapg retriever serve --task` looks a task up, at call "
        "time (an import-linter contract in pyproject.toml)"
    ),
}
"""(file, imported module) -> why this import stays inside its function although it loads nothing heavy."""


class Deferred(NamedTuple):
    path: str
    line: int
    module: str  # as written, made absolute: `from .x import y` in a.b -> "a.x"
    targets: tuple[str, ...]  # what it imports: `from a import b` -> ("a", "a.b") when a.b is a module
    comment: str  # the trailing comment on the import's lines, "" if none
    statement: str  # as written (for messages)


def _tracked() -> list[str]:
    """Tracked .py files (tests/ included: tests/run_gpu.py imports benchmarks._common), relative to the root."""
    return git_files("*.py")


def _module_name(path: str) -> str:
    name = path[: -len(".py")].replace("/", ".")
    return name.removesuffix(".__init__")


def _parents(name: str) -> list[str]:
    """`a.b.c` -> [a, a.b, a.b.c]: importing a module runs its packages first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


class Source(NamedTuple):
    path: str
    name: str
    tree: ast.Module
    lines: list[str]

    @property
    def is_package(self) -> bool:
        return self.path.endswith("__init__.py")


def _module_of(node: ast.Import | ast.ImportFrom, src: Source) -> list[str]:
    """The modules an import statement names, absolute: one per alias of `import a, b`, the base of a from-import."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = src.name.split(".")
        parts = parts[: len(parts) - node.level + (1 if src.is_package else 0)]
        base = ".".join(parts + ([base] if base else []))
    return [base]


def _targets(node: ast.Import | ast.ImportFrom, src: Source, modules: set[str]) -> list[str]:
    """What the statement imports: its modules, and for `from a import b` also a.b when that is a module."""
    names = _module_of(node, src)
    if isinstance(node, ast.ImportFrom):
        names += [f"{names[0]}.{a.name}" for a in node.names if f"{names[0]}.{a.name}" in modules]
    return names


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _module_level(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported (not those in functions or `if TYPE_CHECKING:`)."""
    found = []

    def walk(body: list[ast.stmt]) -> None:
        for s in body:
            if isinstance(s, (ast.Import, ast.ImportFrom)):
                found.append(s)
            elif isinstance(s, ast.If):
                walk(s.orelse if _is_type_checking(s) else s.body + s.orelse)
            elif isinstance(s, ast.Try):
                walk(s.body + s.orelse + s.finalbody + [x for h in s.handlers for x in h.body])
            elif isinstance(s, (ast.With, ast.ClassDef, ast.For, ast.While)):
                walk(s.body + getattr(s, "orelse", []))

    walk(tree.body)
    return found


def _in_functions(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import inside a function or method, at any depth."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                found.append(child)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def _comment(node: ast.stmt, lines: list[str]) -> str:
    """The trailing comment on the lines of an import statement (imports hold no strings), pragmas dropped."""
    text = " ".join(line.split("#", 1)[1] for line in lines[node.lineno - 1 : node.end_lineno] if "#" in line)
    text = re.sub(r"noqa(:\s*[A-Z]+[0-9]+(,\s*[A-Z]+[0-9]+)*)?|type:\s*ignore(\[[^\]]*\])?|fmt:\s*\w+", "", text)
    return text.strip(" #")


class Tree:
    """The tracked sources, the module-level import graph, and what each module loads when imported."""

    def __init__(self, sources: dict[str, Source]):
        self.sources = sources
        names = set(sources)
        self.statements: dict[str, set[str]] = {}  # module -> the modules its module-level import statements name
        for name, src in sources.items():
            self.statements[name] = {t for n in _module_level(src.tree) for t in _targets(n, src, names)}
        self.imports = {name: set(targets) for name, targets in self.statements.items()}  # discovery added
        for package, why in DISCOVERED.items():
            assert why and package in sources, f"DISCOVERED names {package}, which is not a tracked package"
            self.imports[package] |= {
                m for m in names if m.rpartition(".")[0] == package and not m.rpartition(".")[2].startswith("_")
            }
        self._heavy: dict[str, frozenset[str]] = {}

    def heavy(self, name: str) -> frozenset[str]:
        """The HEAVY modules importing `name` loads (its packages first, then what it imports, transitively)."""
        found: set[str] = set()
        seen: set[str] = set()
        todo = _parents(name)
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            if m.split(".")[0] in HEAVY:  # a third-party module: HEAVY may name a submodule (ray.tune)
                found |= {k for k in HEAVY if m == k or m.startswith(k + ".")}
            elif m in self.imports:
                todo += [p for t in self.imports[m] for p in _parents(t)]
        return frozenset(found)

    def loaded(self, name: str) -> frozenset[str]:
        """What module `name` already holds at run time: what importing it loads (memoised)."""
        if name not in self._heavy:
            self._heavy[name] = self.heavy(name)
        return self._heavy[name]

    def deferred(self, product: list[str]) -> list[Deferred]:
        """Every import inside a function of the `product` files."""
        out = []
        for path in product:
            src = self.sources[_module_name(path)]
            for node in _in_functions(src.tree):
                for module in _module_of(node, src):
                    targets = [module] if isinstance(node, ast.Import) else _targets(node, src, set(self.sources))
                    comment = _comment(node, src.lines)
                    out.append(Deferred(path, node.lineno, module, tuple(targets), comment, ast.unparse(node)))
        return out

    def needless(self, d: Deferred) -> bool:
        """True when the import loads no HEAVY module that its own module does not load already."""
        new = set().union(*(self.heavy(t) for t in d.targets))
        return not new - self.loaded(_module_name(d.path))


def _parse(path: str, text: str) -> Source:
    return Source(path, _module_name(path), ast.parse(text), text.splitlines())


def _tree() -> tuple[Tree, list[str]]:
    files = _tracked()
    sources = {_module_name(p): _parse(p, (ROOT / p).read_text(encoding="utf-8")) for p in files}
    return Tree(sources), [p for p in files if not p.startswith("tests/")]


@pytest.fixture(scope="module")
def tree() -> tuple[Tree, list[str]]:
    return _tree()


def _own(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def _cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a module importing itself), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(v: str) -> None:  # Tarjan; the graph has a few hundred modules, well within the recursion limit
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(imports.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in imports.get(v, ()):
                found.append(sorted(component))

    for v in sorted(imports):
        if v not in index:
            connect(v)
    return sorted(found)


# ------------------------------------------------------------------------------------------------ the walker
SAMPLE = {
    "pkg/__init__.py": "",
    "pkg/light.py": "import os\n",
    "pkg/big.py": "import json\nimport torch\n",
    "pkg/via.py": "from pkg import big\n",
    "pkg/tasks/__init__.py": "",
    "pkg/tasks/one.py": "import numpy\n",
    "pkg/tasks/_helper.py": "import pandas\n",
    "pkg/user.py": """
from typing import TYPE_CHECKING
import yaml
if TYPE_CHECKING:
    import pandas
try:
    import tomllib
except ImportError:
    from pip._vendor import tomli as tomllib

def f():
    import os, torch
    from . import light  # nothing heavy
    from .via import big  # torch: loads it
    from pkg.tasks import x
    import pandas

class C:
    import json
    def m(self):
        def inner():
            import yaml
""",
}


def _sample_tree() -> Tree:
    sources = {_module_name(p): _parse(p, text) for p, text in SAMPLE.items()}
    sources["experiments.tasks"] = _parse("experiments/tasks/__init__.py", "")  # DISCOVERED names it
    return Tree(sources)


def test_the_walker_sees_what_runs_at_import_time():
    src = _sample_tree().sources["pkg.user"]
    level = [ast.unparse(n) for n in _module_level(src.tree)]
    assert level == [
        "from typing import TYPE_CHECKING",
        "import yaml",
        "import tomllib",
        "from pip._vendor import tomli as tomllib",
        "import json",
    ]
    assert [n.lineno for n in _in_functions(src.tree)] == [12, 13, 14, 15, 16, 22]


def test_the_rule_flags_imports_that_defer_nothing_heavy():
    tree = _sample_tree()
    deferred = tree.deferred(["pkg/user.py"])
    flagged = {(d.line, d.module) for d in deferred if tree.needless(d)}
    assert flagged == {(12, "os"), (13, "pkg"), (15, "pkg.tasks"), (22, "yaml")}  # torch, pkg.via, pandas stay
    assert tree.heavy("pkg.via") == {"torch"} and tree.heavy("pkg.light") == frozenset()
    comments = {d.module: d.comment for d in deferred if d.line in (13, 14, 15)}
    assert comments == {"pkg": "nothing heavy", "pkg.via": "torch: loads it", "pkg.tasks": ""}
    assert tree.heavy("pkg.tasks") == frozenset()  # DISCOVERED names experiments.tasks only


def test_discovery_counts_as_an_import(tree):
    t, _ = tree
    assert "experiments.tasks.math_tiny" in t.imports["experiments.tasks"]
    assert "experiments.tasks._common" not in t.imports["experiments.tasks"]


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}, "b": set()}) == [["a"]] and _cycles({"a": {"b"}}) == []


def test_heavy_holds_no_standard_library_module():
    assert not set(HEAVY) & set(sys.stdlib_module_names) and all(HEAVY.values())


# ------------------------------------------------------------------------------------------------ the product
def test_every_deferred_import_defers_something_heavy(tree):
    t, product = tree
    deferred = t.deferred(product)
    assert any(d.path == "experiments/cli.py" and d.module == "experiments.build" for d in deferred)
    bad = [f"{d.path}:{d.line}: {d.statement}" for d in deferred if t.needless(d) and (d.path, d.module) not in ALLOWED]
    assert not bad, (
        f"{len(bad)} import(s) inside a function load nothing heavy that the module does not load already; "
        "move them to the module's import block (or, for a real reason, list them in ALLOWED):\n" + "\n".join(bad)
    )


def test_every_allowed_import_still_needs_it(tree):
    t, product = tree
    needless = {(d.path, d.module) for d in t.deferred(product) if t.needless(d)}
    stale = [f"{path} {module}" for path, module in ALLOWED if (path, module) not in needless]
    assert not stale, "no longer a deferred import that loads nothing heavy: remove from ALLOWED:\n" + "\n".join(stale)
    assert all(ALLOWED.values())


def test_a_deferred_own_import_says_why(tree):
    t, product = tree
    bare = [f"{d.path}:{d.line}: {d.statement}" for d in t.deferred(product) if _own(d.module) and not d.comment]
    assert not bare, (
        f"{len(bare)} import(s) of the project inside a function without a trailing comment saying what they "
        "defer (e.g. `# torch: keeps emapg --help fast`) or why they cannot be at the top:\n" + "\n".join(bare)
    )


def test_the_packages_import_each_other_without_cycles(tree):
    t, _ = tree
    # import statements only: a task module imports its package, which discovers it by name
    graph = {m: {x for x in targets if _own(x) and x in t.sources} for m, targets in t.statements.items() if _own(m)}
    cycles = _cycles(graph)
    assert not cycles, "module-level import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)
