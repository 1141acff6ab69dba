"""The verl follower's tests 50 times in a row beside a CPU-bound process per core (slow: about 6 minutes on 2
cores). Under load the follower's polls interleave with a new attempt's files differently; the race they once
lost ("iteration 1 <= 3", test_health_verl.py) showed up only on a busy machine."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests/experiments/test_health_verl.py"
ROUNDS = 50


@pytest.mark.slow
def test_the_follower_tests_pass_50_times_under_cpu_load():
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        got = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--keep-duplicates", *[MODULE] * ROUNDS],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    finally:
        for p in busy:
            p.kill()
            p.wait()
    summary = got.stdout.strip().splitlines()[-1]
    assert got.returncode == 0 and "failed" not in summary, got.stdout[-3000:]
    assert summary.startswith(f"{5 * ROUNDS} passed"), summary
