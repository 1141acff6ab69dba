"""Lines of Python in the product, counted from the files git tracks: the table in docs/architecture.md.

    python tests/line_counts.py           # print the block
    python tests/line_counts.py --write   # put it between the markers in docs/architecture.md

A file's lines are counted as `wc -l` counts them (its newline characters), read from the work tree. The files
are the tracked .py files (`git ls-files`, run at the repository root) under the product's top-level packages;
tests/ and docs/ are not product. tests/test_line_counts.py checks that the doc's block is the one this renders
and that the shell command the block prints gives the table's total. Standard library only.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- BEGIN line-counts -->"
END = "<!-- END line-counts -->"

PACKAGES = ("ema_pg_core", "experiments", "sweeps", "analysis", "cluster", "benchmarks")
"""The product's top-level packages, in the table's order."""
PARTS = {
    "ema_pg_core/": "`ema_pg_core/*.py` outside `local/`: the method",
    "ema_pg_core/local/": "`ema_pg_core/local/`: the reference trainer",
    "experiments/backends/verl/": "`experiments/backends/verl/`: the verl backend",
    "experiments/ops/": "`experiments/ops/`: doctor, data, eval, rehearsal, retriever",
    "experiments/": "`experiments/`, the rest: config, tasks, runs and records",
}
"""The packages shown in parts: a file belongs to the longest prefix it starts with."""
PRODUCT = "product Python"


def pathspecs(packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """The `git ls-files` pathspecs of the product's Python: '*' matches across directories, so
    'ema_pg_core/*.py' takes ema_pg_core/local/ too."""
    return [f"{p}/*.py" for p in packages]


def tracked_python(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Sorted paths, relative to `root`, of the tracked .py files under `packages`."""
    cmd = ["git", "ls-files", "-z", "--", *pathspecs(packages)]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=True, timeout=60).stdout
    return sorted(p for p in out.split("\0") if p)


def wc_lines(data: bytes) -> int:
    """Lines as `wc -l` counts them: newline characters (a last line without one is not counted)."""
    return data.count(b"\n")


def part_of(path: str) -> str:
    """The table row a file counts in: its longest prefix in PARTS, else its top-level package."""
    prefixes = [p for p in PARTS if path.startswith(p)]
    return max(prefixes, key=len) if prefixes else path.split("/", 1)[0]


def count(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, tuple[int, int]]:
    """(files, lines) per row key: each part, each package and PRODUCT. A tracked file missing from the
    work tree counts 0 lines."""
    totals: dict[str, tuple[int, int]] = {}

    def add(key: str, lines: int) -> None:
        files, n = totals.get(key, (0, 0))
        totals[key] = (files + 1, n + lines)

    for path in tracked_python(root, packages):
        file = root / path
        lines = wc_lines(file.read_bytes()) if file.is_file() else 0
        package = path.split("/", 1)[0]
        for key in dict.fromkeys([part_of(path), package, PRODUCT]):
            add(key, lines)
    return totals


def shell_command(packages: tuple[str, ...] = PACKAGES) -> str:
    """The shell command that prints the product total."""
    return "git ls-files " + " ".join(f"'{s}'" for s in pathspecs(packages)) + " | xargs cat | wc -l"


def row(label: str, counts: tuple[int, int], bold: bool = False) -> str:
    """One markdown table row: label, files, lines (thousands separated)."""
    files, lines = counts
    if bold:
        return f"| **{label}** | {files:,} | **{lines:,}** |"
    return f"| {label} | {files:,} | {lines:,} |"


def render(totals: dict[str, tuple[int, int]], packages: tuple[str, ...] = PACKAGES) -> str:
    """The block: the table (parts, then their package's subtotal) and the command that gives the total."""
    lines = ["| Python (tracked files) | files | lines |", "|:--|--:|--:|"]
    for package in packages:
        parts = [p for p in PARTS if p.split("/", 1)[0] == package]
        for part in parts:
            lines.append(row(PARTS[part], totals.get(part, (0, 0))))
        lines.append(row(f"`{package}`", totals.get(package, (0, 0)), bold=bool(parts)))
    lines.append(row(PRODUCT, totals.get(PRODUCT, (0, 0)), bold=True))
    return "\n".join(lines) + f"\n\nThe total, at the repository root: `{shell_command(packages)}`"


def replace_block(text: str, block: str) -> str:
    """`text` with what lies between the BEGIN and END markers replaced by `block`."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN} ... {END} in the text")
    return text[: start + len(BEGIN)] + "\n" + block + "\n" + text[end:]


def current_block(text: str) -> str:
    """What lies between the markers in `text`, without the newlines next to them."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN} ... {END} in the text")
    return text[start + len(BEGIN) : end].strip("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the block in {DOC.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    block = render(count(ROOT))
    if args.write:
        DOC.write_text(replace_block(DOC.read_text(encoding="utf-8"), block), encoding="utf-8")
    else:
        print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
