"""Golden report table of a synthetic paired sweep (conftest.sweep_dir: GRPO and two EMA-PG variants on the
same 3 seeds of math_tiny, plus a failed and a partial run). The gains and P(improvement) are paired over
the seeds; any change of the rendered table fails here. Regenerate with EMAPG_UPDATE_GOLDEN=1 and review
the diff."""

from __future__ import annotations

import os
from pathlib import Path

from analysis import report

GOLDEN = Path(__file__).parent / "golden" / "paired_sweep_math_tiny_main.md"


def test_paired_sweep_main_table_golden(sweep_dir, tmp_path):
    report.report(sweep_dir, tmp_path / "report", reps=500, seed=0)
    got = (tmp_path / "report" / "math_tiny_main.md").read_text(encoding="utf-8")
    if os.environ.get("EMAPG_UPDATE_GOLDEN"):
        GOLDEN.write_text(got, encoding="utf-8")
    assert GOLDEN.exists(), f"{GOLDEN} missing: run with EMAPG_UPDATE_GOLDEN=1 and review it"
    assert "(paired, 3 seeds)" in got and "(unpaired)" not in got
    assert got == GOLDEN.read_text(encoding="utf-8"), "the paired sweep's table changed; if intended, regenerate"
