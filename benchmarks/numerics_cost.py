"""What the reproducible numerics cost: training iterations and warm-start steps, pinned vs native, in the same run.

    python benchmarks/numerics_cost.py [--iterations 20] [--repeats 2] [--experiment math_tiny_grpo] [--write]

Each repeat trains once per mode (EMAPG_NUMERICS=native, reproducible: experiments/numerics.py), each an `emapg
train` process (the pins set before torch loads), the modes alternating; each builds its warm start in the first
repeat, in a temporary EMAPG_CACHE. Figures: mean perf/iter_s over the training iterations but the first, and the
warm start's SFT seconds per step, each as a ratio to native's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

MODES = ("native", "reproducible")


def train(mode: str, experiment: str, iterations: int, root: Path, run: str) -> dict:
    """One `emapg train` in `mode` -> {"iter_s": [perf/iter_s of iterations 2..], "sft_step_s", "numerics"}."""
    run_dir, cache = root / run, root / f"cache-{mode}"
    overrides = [f"experiment={experiment}", f"trainer.iterations={iterations}", f"trainer.eval_every={iterations}"]
    overrides += ["trainer.save_every=0", "logger.name=none", f"run_dir={run_dir}"]
    env = {**os.environ, "EMAPG_NUMERICS": mode, "EMAPG_CACHE": str(cache), "EMAPG_PROGRESS": "0"}
    subprocess.run(["emapg", "train", *overrides], env=env, check=True, capture_output=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    warm = json.loads(next(cache.glob("*/pretrain.json")).read_text())
    return {
        "iter_s": [r["perf/iter_s"] for r in rows if r["iteration"] >= 2],
        "sft_step_s": warm["train_s"] / warm["steps_done"],
        "numerics": json.loads((run_dir / "summary.json").read_text())["numerics"],
    }


def measure(experiment: str, iterations: int, repeats: int) -> dict[str, dict]:
    """{mode: {"iter_s": every timed iteration of every repeat, "sft_step_s", "numerics"}}."""
    out: dict[str, dict] = {m: {"iter_s": []} for m in MODES}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(repeats):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                got = train(mode, experiment, iterations, Path(d), f"{mode}-{rep}")
                out[mode]["iter_s"] += got["iter_s"]
                out[mode].setdefault("sft_step_s", got["sft_step_s"])  # built in the first repeat only
                out[mode]["numerics"] = got["numerics"]
    return out


def section(results: dict[str, dict], command: str, machine_text: str, iterations: int) -> str:
    """The docs/benchmarks.md section: how it was measured, the table, the ratios."""
    mean = {m: sum(r["iter_s"]) / len(r["iter_s"]) for m, r in results.items()}
    rows = [
        [m, f"{r['numerics']['aten_capability']} / {r['numerics']['mkl_cbwr']}", len(r["iter_s"]),
         f"{mean[m]:.3f}", f"{mean[m] / mean['native']:.2f}", f"{r['sft_step_s']:.3f}",
         f"{r['sft_step_s'] / results['native']['sft_step_s']:.2f}"]
        for m, r in results.items()
    ]  # fmt: skip
    header = ["EMAPG_NUMERICS", "ATen / MKL branch", "iterations timed", "iteration (s)", "ratio",
              "warm-start step (s)", "ratio"]  # fmt: skip
    return "\n\n".join(
        [
            "## The reproducible numerics' cost (`benchmarks/numerics_cost.py`)",
            f"Command: `{command}`. {machine_text}".rstrip(),
            f"Each mode's `emapg train` processes ({iterations} iterations each, the modes alternating), iteration = "
            "mean perf/iter_s over the training iterations but the first; warm-start step = the SFT's seconds per "
            "step. Ratios are to native, measured in the same run.",
            C.md_table(header, rows),
        ]
    )


def main() -> None:
    ap = C.cli(__doc__)
    ap.add_argument("--experiment", default="math_tiny_grpo")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    m = C.machine()
    results = measure(args.experiment, args.iterations, args.repeats)
    command = C.command("numerics_cost.py", sys.argv[1:])
    body = section(results, command, C.machine_line(m, results["native"]["numerics"]["threads"]), args.iterations)
    C.publish("numerics_cost", body, args.write)


if __name__ == "__main__":
    main()
