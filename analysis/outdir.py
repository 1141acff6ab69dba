"""The output directory of `emapg report` and `emapg figures`: whose it is, and how a new output replaces the old.

    with replacing(out, "emapg report", {"source": runs_dir}) as build:   # refused unless `out` may be written
        ...write every file into `build`...                              # swapped into `out` whole at the end

A command writes only into a directory that is missing, empty, or a previous output of the same command (MARKER,
written last, names the command); anything else is a UserError (exit 2) before any work. Built in a hidden
directory and swapped in once complete, no file of an earlier output stays and a failed one leaves the previous
output as it was. What is refused, and why: docs/reports.md, "Where a report is written".
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from experiments import records
from experiments.errors import UserError

MARKER = "emapg_output.json"  # {"command": "emapg report" | "emapg figures", ...}: which command wrote the directory
BUILD, OLD = ".emapg-build-", ".emapg-old-"  # hidden work directories inside the output (left over: removed)
LISTED = 5  # entries named in a refusal


def producer(out: Path) -> str | None:
    """The command whose output `out` is ("emapg report", "emapg figures"), or None."""
    marker = out / MARKER
    if marker.is_file():
        try:
            command = json.loads(marker.read_text(encoding="utf-8")).get("command")
        except (ValueError, AttributeError, UnicodeDecodeError):
            return None
        return command if isinstance(command, str) else None
    index = out / "index.md"
    if index.is_file() and (out / "provenance.json").is_file():  # written before MARKER existed
        with index.open(encoding="utf-8", errors="replace") as f:
            first = f.readline().strip()
        for command in ("emapg report", "emapg figures"):
            if first == f"# {command}" or first.startswith(f"# {command} ("):
                return command
    return None


def is_run_record(d: Path) -> bool:
    return (d / records.CONFIG).is_file() and (d / records.STATUS).is_file()


def check(out: str | Path, command: str) -> Path:
    """`out` as a Path when `command` may write its output there; else a UserError naming `out`, what it holds and
    what is allowed."""
    out = Path(out)
    allowed = f"allowed: a new or empty directory, or a previous output of {command} (it is replaced whole)"

    def refuse(why: str) -> UserError:
        return UserError(f"--out {out} {why}; {allowed}")

    if out.exists() and not out.is_dir():
        raise refuse("is a file, not a directory")
    here = out.resolve()
    if here.is_dir() and is_run_record(here):
        raise refuse("is a run record (config.yaml + status): writing there would mix the output into the record")
    for parent in here.parents:
        if is_run_record(parent):
            raise refuse(f"is inside the run record {parent}")
    if not out.exists():
        return out
    entries = sorted(e.name for e in out.iterdir() if not e.name.startswith((BUILD, OLD)))
    if not entries:
        return out
    if (out / "sweep.yaml").is_file():
        raise refuse("is a sweep directory (sweep.yaml); a sweep's report goes into <sweep>/report")
    made_by = producer(out)
    if made_by is None:
        shown = ", ".join(entries[:LISTED]) + (f", … {len(entries) - LISTED} more" if len(entries) > LISTED else "")
        raise refuse(f"is not empty ({shown}) and is no output of {command} (no {MARKER})")
    if made_by != command:
        raise refuse(f"holds the output of {made_by}; {command} would replace its index.md: give another --out")
    inside = next((p.parent for p in out.rglob(records.CONFIG) if is_run_record(p.parent)), None)
    if inside is not None:
        raise refuse(f"holds the run record {inside}")
    return out


@contextmanager
def replacing(out: str | Path, command: str, about: Mapping[str, Any] | None = None) -> Iterator[Path]:
    """Check `out` (`check`), yield an empty directory to build the output in, then make it `out`'s whole content
    (with MARKER: {"command": command, **about}). On an error the build is removed and `out` is as it was."""
    out = check(out, command)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=BUILD, dir=out))
    try:
        yield build
        (build / MARKER).write_text(json.dumps({"command": command, **(about or {})}, indent=1) + "\n")
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    old = Path(tempfile.mkdtemp(prefix=OLD, dir=out))
    for entry in list(out.iterdir()):
        if entry not in (build, old):
            os.replace(entry, old / entry.name)
    for entry in list(build.iterdir()):
        os.replace(entry, out / entry.name)
    build.rmdir()
    shutil.rmtree(old)


def moved(paths: list[Path], build: Path, out: str | Path) -> list[Path]:
    """`paths` written under `build`, as they lie under `out` once it is swapped in."""
    return [Path(out) / Path(p).relative_to(build) for p in paths]
