"""Wall time of `emapg rehearse` on the two GPU sweeps, as `make rehearse-verl` runs them (budget: 10 minutes each
on 2 cores), split into its phases, each over the whole of the same run.

    python benchmarks/rehearsals.py            # writes the "rehearsals" section of docs/benchmarks.md
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, machine_line, md_table, write_section  # noqa: E402

SWEEPS = (("sweeps/math_deepscaler_ema_pg.yaml", "across"), ("sweeps/search_r1_ema_pg.yaml", "within"))
PHASES = (
    ("prepare: tiny model, data, retriever, two-node cluster", "  waiting for a trial's first step"),
    ("the sweep to its first checkpoint; the node lost", "  node lost"),
    ("the retried trials to a new step; the driver killed", "  driver (`emapg sweep`) SIGKILLed"),
    ("emapg sweep --resume to the end, the checks", None),
)
"""(phase, the line of the rehearsal's output that ends it; None: the end of the run)."""


def rehearse(sweep: str, layout: str, out: Path) -> tuple[float, dict[str, float], str, int]:
    """(wall seconds, the time at which each line of output appeared, stdout, exit status)."""
    t0, seen, lines = time.time(), {}, []
    cmd = [sys.executable, "-u", "-m", "experiments.cli", "rehearse", sweep, "--layout", layout, "--out", str(out)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        for line in proc.stdout:
            lines.append(line)
            for _, marker in PHASES:
                if marker and line.startswith(marker) and marker not in seen:
                    seen[marker] = time.time() - t0
    return time.time() - t0, seen, "".join(lines), proc.returncode


def phase_row(sweep: str, layout: str, seconds: float, seen: dict[str, float], code: int) -> list:
    """One rehearsal's table row: seconds (share of the whole) per phase, the whole and the exit status."""
    cells, start = [], 0.0
    for _, marker in PHASES:
        end = seen.get(marker, seconds) if marker else seconds
        cells.append(f"{end - start:.0f} ({(end - start) / seconds:.2f})")
        start = end
    return [f"`{Path(sweep).stem} --layout {layout}`", *cells, f"{seconds / 60:.1f} min", code]


def main() -> int:
    m = machine()  # load average before the rehearsals start
    rows, ok = [], True
    for sweep, layout in SWEEPS:
        with tempfile.TemporaryDirectory() as tmp:
            seconds, seen, stdout, code = rehearse(sweep, layout, Path(tmp))
        print(stdout, flush=True)
        ok &= code == 0
        rows.append(phase_row(sweep, layout, seconds, seen, code))
    header = ["sweep", *(f"{phase}: s (/ whole)" for phase, _ in PHASES), "in all", "exit status"]
    body = "\n".join(
        [
            "## verl sweep rehearsals on CPU (`benchmarks/rehearsals.py`)",
            "",
            "Command: `python benchmarks/rehearsals.py`  ",
            machine_line(m, 2),
            "",
            "`emapg rehearse` of each sweep: its two trials at once through Ray Tune on a two-node local Ray cluster, "
            "world size 2, 4 steps each; every verl job pays verl's start-up (about a minute on 2 cores) at its first "
            "attempt, after the node loss and after the driver kill.",
            "",
            md_table(header, rows),
        ]
    )
    write_section("rehearsals", body)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
