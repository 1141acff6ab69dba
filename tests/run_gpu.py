"""``make test-gpu``: every ``gpu``-marked test on this machine's CUDA device, and what each one measured.

    python tests/run_gpu.py [--allow-skip] [--json FILE] [pytest args...]

Needs one CUDA device, torch and transformers; no verl, no internet, no install of emapg (it runs from the
repository). Prints the card, the driver and the versions, then each test's outcome and figures (what the
tests record with ``record_property``). Exit status: pytest's; 1 when there is no CUDA device (0 with
``--allow-skip``, for scripts that run it on every machine), when no test was collected, or when a test was
skipped on a GPU machine (a skipped check is not a passed one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from the repository, without an install of emapg
from benchmarks._common import describe  # noqa: E402  the card and versions, as the GPU benchmarks print them

MARKER = re.compile(r"pytest\.mark\.gpu\b")


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """Test files that mark a test (or the module) ``gpu``: only they are imported, so a machine without the
    rest of emapg's dependencies (Hydra, Ray, verl) collects them."""
    files = sorted(p for p in (root / "tests").rglob("test_*.py") if MARKER.search(p.read_text()))
    return [str(p.relative_to(root)) for p in files]


class Figures:
    """A pytest plugin: each test's outcome, duration and recorded figures."""

    def __init__(self):
        self.rows: list[dict] = []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.rows.append(
                {
                    "test": report.nodeid,
                    "outcome": report.outcome,
                    "seconds": round(report.duration, 2),
                    "figures": dict(report.user_properties),
                }
            )


def no_cuda_line(torch) -> str:
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return (
        f"no CUDA device: torch {torch.__version__} ({build}) sees none. Run `make test-gpu` on a GPU machine, "
        "with the Python that has the CUDA build of torch: make test-gpu PYTHON=/path/to/python"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--allow-skip", action="store_true", help="exit 0 when there is no CUDA device")
    ap.add_argument("--json", type=Path, help="also write the machine and every test's figures to this file")
    args, pytest_args = ap.parse_known_args(argv)
    try:
        import pytest
        import torch
    except ImportError as e:
        print(
            f"{sys.executable} cannot import {e.name}: run with the Python that has torch (CUDA build) and pytest: "
            "make test-gpu PYTHON=/path/to/python"
        )
        return 0 if args.allow_skip else 1
    if not torch.cuda.is_available():
        print(no_cuda_line(torch) + (" (--allow-skip: exit 0)" if args.allow_skip else ""))
        return 0 if args.allow_skip else 1
    machine = describe(torch)
    for k, v in machine.items():
        print(f"{k:>12}: {v}")
    files = gpu_test_files()
    print(f"{'tests':>12}: the gpu-marked tests in {', '.join(files)}", flush=True)
    os.chdir(ROOT)
    figures = Figures()
    code = pytest.main(["-m", "gpu", "-v", "-p", "no:cacheprovider", *pytest_args, *files], plugins=[figures])
    print("\nfigures:")
    for row in figures.rows:
        shown = "; ".join(f"{k}: {v}" for k, v in row["figures"].items())
        print(f"  {row['outcome']:<7} {row['seconds']:>6.1f}s  {row['test']}" + (f"\n{'':>18}{shown}" if shown else ""))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "tests": figures.rows}, indent=1) + "\n")
    skipped = [r["test"] for r in figures.rows if r["outcome"] == "skipped"]
    if code == 0 and skipped:
        print(f"{len(skipped)} gpu test(s) skipped on a GPU machine: {', '.join(skipped)}")
        return 1
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        print("no gpu-marked test was collected")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
