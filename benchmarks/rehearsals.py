"""Wall time of `emapg rehearse` on the two GPU sweeps, as `make rehearse-verl` runs them (the budget: 10 minutes
each on 2 cores).

    python benchmarks/rehearsals.py            # writes the "rehearsals" section of docs/benchmarks.md

Each sweep is rehearsed in a fresh output directory (the tiny model and data are built inside the measured
time), through Ray Tune on a two-node local cluster (sweeps/rehearse.py). The table splits the wall time into
its phases: preparing (tiny model, data, retriever, the cluster), the sweep up to the node loss, up to the
driver kill, and the resumed sweep to its end; the ratio column is each phase over the whole, same run.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, machine_line, write_section  # noqa: E402

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


def main() -> int:
    m = machine()  # load average before the rehearsals start
    lines, ok = [], True
    for sweep, layout in SWEEPS:
        with tempfile.TemporaryDirectory() as tmp:
            seconds, seen, stdout, code = rehearse(sweep, layout, Path(tmp))
        print(stdout, flush=True)
        ok &= code == 0
        lines += [
            f"### `emapg rehearse {sweep} --layout {layout}`: {seconds / 60:.1f} min in all, exit status {code}",
            "",
            "| phase | seconds | / whole |",
            "|---|---|---|",
        ]
        start = 0.0
        for phase, marker in PHASES:
            end = seen.get(marker, seconds) if marker else seconds
            lines.append(f"| {phase} | {end - start:.0f} | {(end - start) / seconds:.2f} |")
            start = end
        lines.append("")
    body = "\n".join(
        [
            "## verl sweep rehearsals on CPU (`benchmarks/rehearsals.py`)",
            "",
            "Command: `python benchmarks/rehearsals.py`  ",
            machine_line(m, 2),
            "",
            "Each rehearsal runs the sweep's two trials at once through Ray Tune on a two-node local Ray cluster, at",
            "world size 2, 4 steps each; every verl job pays verl's start-up (Ray job, TransferQueue, two workers, the",
            "hf rollout server: about a minute on 2 cores) at its first attempt and again after the node loss and",
            "after the driver kill.",
            "",
            *lines,
        ]
    )
    write_section("rehearsals", body)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
