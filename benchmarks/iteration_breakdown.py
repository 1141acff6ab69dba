"""Where an iteration of the local trainer spends its time, and tokens/s, for the tiny presets.

    python benchmarks/iteration_breakdown.py [--iterations 10] [--presets math_tiny_ema_pg search_tiny_ema_pg]

Runs each preset for a few iterations (W&B disabled, warm-started model from the cache), reads
perf/* from the run record and prints a markdown table: mean seconds per phase (rollout /
log-probs of pi_old and the anchor / PPO update / anchor EMA), each phase's share of the
iteration, and processed tokens per second. Ratios are against the iteration time measured in
the same run. The first iteration is dropped as warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

PHASES = ("rollout", "logprob", "update", "anchor")


def measure(preset: str, iterations: int, threads: int) -> dict:
    from experiments.build import compose
    from experiments.run import run

    with tempfile.TemporaryDirectory() as d:
        cfg = compose(
            [
                f"experiment={preset}",
                f"trainer.iterations={iterations}",
                f"trainer.eval_every={iterations}",
                "trainer.eval_size=8",
                "trainer.save_every=0",
                "logger.name=none",
                f"run_dir={d}/run",
                f"trainer.threads={threads}",
            ]
        )
        run(cfg)
        rows = [json.loads(line) for line in (Path(d) / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["iteration"] >= 2]  # drop eval-only row 0 and warm-up iteration 1
    mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    out = {p: mean(f"perf/{p}_s") for p in PHASES}
    out["iter"] = mean("perf/iter_s")
    out["tokens_per_s"] = mean("perf/tokens_per_s")
    out["response_len"] = mean("train/response_len")
    return out


def table(results: dict[str, dict]) -> str:
    lines = [
        "| preset | iteration (s) | "
        + " | ".join(f"{p} (s, share)" for p in PHASES)
        + " | tokens/s | mean response len |",
        "|---|---|" + "---|" * len(PHASES) + "---|---|",
    ]
    for preset, r in results.items():
        cells = " | ".join(f"{r[p]:.3f} ({r[p] / r['iter']:.0%})" for p in PHASES)
        lines.append(f"| {preset} | {r['iter']:.3f} | {cells} | {r['tokens_per_s']:.0f} | {r['response_len']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--presets", nargs="+", default=["math_tiny_grpo", "math_tiny_ema_pg", "search_tiny_grpo", "search_tiny_ema_pg"]
    )
    args = ap.parse_args()
    os.environ.setdefault("EMAPG_PROGRESS", "0")
    print(table({p: measure(p, args.iterations, args.threads) for p in args.presets}))


if __name__ == "__main__":
    main()
