"""The line counts in docs/architecture.md are generated (tests/line_counts.py), not hand-kept: the doc's block
is the one the script renders from the tracked files now, the shell command it prints gives the table's total,
and the counting itself is checked on a tiny git repository. No size target is asserted here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests import line_counts

ROOT = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"`(git ls-files [^`]+)`")
TOTAL = re.compile(r"^\| \*\*" + re.escape(line_counts.PRODUCT) + r"\*\* \| [\d,]+ \| \*\*([\d,]+)\*\* \|$", re.M)


def git(cwd: Path, *args: str) -> str:
    """Run git in `cwd`; skip the test where git is not there."""
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "commit.gpgsign=false", *args]
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"git does not run here ({e})")


def shell_total(cwd: Path, command: str) -> int:
    """What `command` (a pipeline ending in `wc -l`) prints, run by the shell in `cwd`."""
    out = subprocess.run(command, shell=True, cwd=cwd, capture_output=True, text=True, check=True, timeout=30)
    return int(out.stdout.strip())


def doc_block() -> str:
    return line_counts.current_block(line_counts.DOC.read_text(encoding="utf-8"))


def table_total(block: str) -> int:
    found = TOTAL.findall(block)
    assert len(found) == 1, f"one '{line_counts.PRODUCT}' row expected in the block, found {len(found)}"
    return int(found[0].replace(",", ""))


def test_doc_block_is_the_generated_one():
    git(ROOT, "rev-parse", "--git-dir")
    rendered = line_counts.render(line_counts.count(ROOT))
    assert doc_block() == rendered, (
        "the line counts in docs/architecture.md are stale: run `python tests/line_counts.py --write`"
    )


def test_printed_command_gives_the_table_total():
    git(ROOT, "rev-parse", "--git-dir")
    block = doc_block()
    commands = COMMAND.findall(block)
    assert len(commands) == 1, f"one `git ls-files ...` command expected in the block, found {commands}"
    assert shell_total(ROOT, commands[0]) == table_total(block)


def test_counting_on_a_tiny_repository(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "ema_pg_core" / "local").mkdir(parents=True)
    (tmp_path / "ema_pg_core" / "kl.py").write_text("a = 1\nb = 2\n\n")  # 3 lines
    (tmp_path / "ema_pg_core" / "local" / "trainer.py").write_text("x\ny")  # 1 line: the last has no newline
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_kl.py").write_text("t\n" * 5)  # tracked, but not product
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "two product files")
    (tmp_path / "sweeps").mkdir()
    (tmp_path / "sweeps" / "new.py").write_text("u\n" * 7)  # not tracked: not counted

    totals = line_counts.count(tmp_path)
    assert totals["ema_pg_core/"] == (1, 3)
    assert totals["ema_pg_core/local/"] == (1, 1)
    assert totals["ema_pg_core"] == (2, 4)
    assert totals[line_counts.PRODUCT] == (2, 4)
    assert "sweeps" not in totals and "tests" not in totals

    block = line_counts.render(totals)
    assert table_total(block) == 4
    assert shell_total(tmp_path, COMMAND.findall(block)[0]) == 4
    assert (
        line_counts.current_block(line_counts.replace_block(f"a\n{line_counts.BEGIN}\nold\n{line_counts.END}\n", block))
        == block
    )
