"""Wall time of `emapg rehearse` on the two GPU sweeps (the budget: 10 minutes each on 2 cores).

    python benchmarks/rehearsals.py            # writes the "rehearsals" section of docs/benchmarks.md

Each sweep is rehearsed in a fresh output directory (the tiny model and data are built inside the
measured time). The ratio column is each configuration's time over the slowest one's, measured in
the same run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, machine_line, write_section  # noqa: E402

SWEEPS = ("sweeps/math_deepscaler_ema_pg.yaml", "sweeps/search_r1_ema_pg.yaml")
ROW = re.compile(r"^(?P<name>\S+) \((?P<s>\d+) s\): (?P<result>passed|FAILED)$", re.M)


def rehearse(sweep: str, out: Path) -> tuple[float, str, int]:
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.cli", "rehearse", sweep, "--out", str(out)], capture_output=True, text=True
    )
    return time.time() - t0, proc.stdout, proc.returncode


def main() -> int:
    m = machine()  # load average before the rehearsals start
    lines, ok = [], True
    for sweep in SWEEPS:
        with tempfile.TemporaryDirectory() as tmp:
            seconds, stdout, code = rehearse(sweep, Path(tmp))
        print(stdout, flush=True)
        ok &= code == 0
        rows = [(m["name"], float(m["s"]), m["result"]) for m in ROW.finditer(stdout)]
        slowest = max((s for _, s, _ in rows), default=1.0)
        lines += [
            f"### `emapg rehearse {sweep}`: {seconds / 60:.1f} min in all, exit status {code}",
            "",
            "| configuration | seconds | / slowest | result |",
            "|---|---|---|---|",
        ]
        lines += [f"| {n} | {s:.0f} | {s / slowest:.2f} | {r} |" for n, s, r in rows]
        lines += [
            "",
            f"The rest ({seconds - sum(s for _, s, _ in rows):.0f} s) is building the tiny model and "
            "data and starting the retriever.",
            "",
        ]
    body = "\n".join(
        [
            "## verl rehearsals on CPU (`benchmarks/rehearsals.py`)",
            "",
            "Command: `python benchmarks/rehearsals.py`  ",
            machine_line(m, 2),
            "",
            "Each configuration is two `emapg train` processes: 3 steps, killed after the checkpoint of step 2,",
            "then resumed to step 3; each process pays verl's start-up (Ray, TransferQueue, workers, the hf",
            "rollout server: about a minute on 2 cores) before its first step (a few seconds each).",
            "",
            *lines,
        ]
    )
    write_section("rehearsals", body)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
