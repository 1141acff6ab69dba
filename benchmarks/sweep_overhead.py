"""What a local sweep spends outside its trials' training, with and without reusing the slot's Ray worker.

    python benchmarks/sweep_overhead.py [--spec sweeps/quickstart.yaml] [--rounds 1] [--write]

Runs the sweep (default: the quickstart, 6 trials over 2 slots) through ``sweeps.tune.run_sweep`` on a local Ray
of 2 CPUs, alternately as emapg runs it (trial after trial in its slot's Ray worker: Tune's ``reuse_actors``)
and with a fresh worker per trial (the baseline, what emapg did before), `--rounds` times each, in one process.
The tiny model's warm start is built once before the first run and is not measured.

Per run: the sweep's wall time, the summed training time of its trials (each run's ``train_wall_time_s``: from
the start of its training loop, the evaluation at iteration 0 included, to its final save), the orchestration
overhead 1 - training / (wall x slots) that ``timing.json`` reports, and the fixed cost per trial,
(wall x slots - training) / trials. ``--write`` replaces the "sweep-overhead" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import machine, machine_line, write_section  # noqa: E402

VARIANTS = ("fresh worker per trial", "reused worker (emapg)")


def run_once(spec_path: str, out: Path, reuse: bool) -> dict:
    """One sweep in `out`; its timing.json plus the fixed cost per trial."""
    from sweeps import tune as T
    from sweeps.spec import load

    config = T._tune_config
    T._tune_config = lambda s: dataclasses.replace(config(s), reuse_actors=reuse)
    try:
        T.run_sweep(load(spec_path), out, report=False, progress=False)
    finally:
        T._tune_config = config
    t = json.loads((out / "timing.json").read_text())
    t["fixed_s_per_trial"] = (t["wall_s"] * t["slots"] - t["train_s_sum"]) / t["trials"]
    return t


def measure(spec_path: str, rounds: int) -> list[tuple[str, dict]]:
    """(variant, timing) per run, alternating the variants, after building the warm start."""
    import ray

    from sweeps import tune as T
    from sweeps.spec import load

    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    T._warm_start(load(spec_path))
    runs = []
    with tempfile.TemporaryDirectory(prefix="emapg_overhead_") as tmp:
        for r in range(rounds):
            for i, name in enumerate(VARIANTS):
                t0 = time.time()
                t = run_once(spec_path, Path(tmp) / f"{r}_{i}", reuse=bool(i))
                print(f"round {r + 1}, {name}: {time.time() - t0:.0f} s, overhead {t['overhead_fraction']:.1%}")
                runs.append((name, t))
    ray.shutdown()
    return runs


def table(runs: list[tuple[str, dict]]) -> str:
    """Medians per variant, and each to the fresh-worker baseline of the same invocation."""
    med = {
        name: {k: statistics.median(t[k] for n, t in runs if n == name) for k in runs[0][1] if k != "invocations"}
        for name in VARIANTS
    }
    base = med[VARIANTS[0]]
    lines = [
        "| variant | sweep wall (s) | training, summed (s) | overhead | fixed cost per trial (s) | wall / baseline |",
        "|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        m = med[name]
        lines.append(
            f"| {name} | {m['wall_s']:.1f} | {m['train_s_sum']:.1f} | {m['overhead_fraction']:.1%} | "
            f"{m['fixed_s_per_trial']:.1f} | {m['wall_s'] / base['wall_s']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="sweeps/quickstart.yaml")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--write", action="store_true", help="replace the sweep-overhead section of docs/benchmarks.md")
    args = p.parse_args()
    m = machine()
    runs = measure(args.spec, args.rounds)
    body = (
        f"## Sweep orchestration overhead (`benchmarks/sweep_overhead.py`)\n\n"
        f"`python benchmarks/sweep_overhead.py --spec {args.spec} --rounds {args.rounds}`: the sweep run "
        f"{args.rounds}x per variant, alternating, on a local Ray of 2 CPUs (medians; warm start cached, W&B as the "
        f"spec sets it). {machine_line(m, 1)}\n\n{table(runs)}\n\n"
        "Overhead = 1 - summed training / (sweep wall x slots), as `timing.json` reports it; training starts with "
        "the evaluation at iteration 0. The fixed cost per trial is everything else a trial's slot spends: Ray "
        "starting or reusing the worker, imports, config composition, the run record, W&B, the model load, the "
        "final save, Tune's bookkeeping, and a slot's idle time while the last trials finish.\n"
    )
    print(body)
    if args.write:
        write_section("sweep-overhead", body)


if __name__ == "__main__":
    main()
