"""The repository's own files as git lists them: what the repository-wide checks (code shape, deferred imports,
docs) read."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def git_files(*patterns: str, untracked: bool = False) -> list[str]:
    """Sorted paths, relative to the root, of the tracked files matching `patterns` (all without any) and, with
    `untracked`, the new ones git does not ignore; only those present in the work tree (a tracked file deleted
    there is left out). Outside a git checkout the calling test is skipped: the files are unknown."""
    others = ["--others", "--exclude-standard"] if untracked else []
    cmd = ["git", "ls-files", "-z", "--cached", *others, "--", *patterns]
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"not a git checkout ({e}): the repository's files are unknown")
    return sorted({p for p in out.split("\0") if p and (ROOT / p).is_file()})
