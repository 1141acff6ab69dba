"""What a local sweep spends outside its trials' training, with and without reusing the slot's Ray worker.

    python benchmarks/sweep_overhead.py [--spec sweeps/quickstart.yaml] [--rounds 1] [--fresh] [--write]

Runs the sweep through ``sweeps.tune.run_sweep`` on a local Ray of 2 CPUs as emapg runs it (Tune's
``reuse_actors``) and, with ``--fresh``, alternately with a fresh worker per trial (the baseline), `--rounds` times
each; the warm start is built once before and not measured. Figures per run: from its ``timing.json`` and timeline
(``sweeps.results.timeline``), and the runs' bookkeeping per iteration inside the training loop.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _common as C  # noqa: E402

C.numerics.pin()  # before torch loads, as the emapg command does: the measured runs need its numerics pins

import ray  # noqa: E402

from experiments import records  # noqa: E402
from sweeps import tune as T  # noqa: E402
from sweeps.spec import load  # noqa: E402

FRESH, REUSED = "fresh worker per trial", "reused worker (emapg)"
FIGURES = ("fixed_s_per_trial", "startup_s_per_slot", "reused_s_per_trial", "idle_tail_s", "after_s")


def run_once(spec_path: str, out: Path, reuse: bool) -> dict:
    """One sweep in `out`: its timing.json, with the timeline's figures and the runs' in-loop bookkeeping lifted to
    the top."""
    config = T._tune_config
    T._tune_config = lambda s: dataclasses.replace(config(s), reuse_actors=reuse)
    try:
        T.run_sweep(load(spec_path), out, report=False, progress=False)
    finally:
        T._tune_config = config
    t = json.loads((out / "timing.json").read_text())
    tl = t.pop("timeline")
    t.update({k: tl[k] for k in FIGURES})
    t["loop_s_per_iter"] = loop_bookkeeping(out / "runs")
    return t


def loop_bookkeeping(runs: Path) -> float:
    """Median over the runs' iterations without an evaluation of the time between two metrics lines beyond the
    trainer's own step (perf/iter_s): the record's line, W&B's log, the health rules, Tune's report. It is inside
    the training loop, so the overhead counts it as training."""
    gaps = []
    for run_dir in runs.iterdir():
        rows = records.read_metrics(run_dir)
        for a, b in zip(rows, rows[1:]):
            if "perf/iter_s" in b and not any(k.startswith("eval") for k in b):
                gaps.append(b["time_s"] - a["time_s"] - b["perf/iter_s"])
    return statistics.median(gaps) if gaps else float("nan")


def measure(spec_path: str, rounds: int, variants: tuple[str, ...]) -> list[tuple[str, dict]]:
    """(variant, timing) per run, alternating the variants, after building the warm start."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    T._warm_start(load(spec_path))
    runs = []
    with tempfile.TemporaryDirectory(prefix="emapg_overhead_") as tmp:
        for r in range(rounds):
            for i, name in enumerate(variants):
                t0, load_1min = time.time(), os.getloadavg()[0]
                t = run_once(spec_path, Path(tmp) / f"{r}_{i}", reuse=name != FRESH)
                t["load_1min"] = load_1min
                print(
                    f"round {r + 1}, {name}: {time.time() - t0:.0f} s, overhead {t['overhead_fraction']:.1%}, "
                    f"fixed cost {t['fixed_s_per_trial']:.1f} s per trial (1-min load at its start {load_1min:.1f})",
                    flush=True,
                )
                runs.append((name, t))
    ray.shutdown()
    return runs


def _medians(runs: list[tuple[str, dict]]) -> dict[str, dict[str, float]]:
    """{variant: {figure: median over its runs}}, variants in their first run's order."""
    out: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(n for n, _ in runs):
        mine = [t for n, t in runs if n == name]
        keys = {k for t in mine for k, v in t.items() if isinstance(v, (int, float))}
        out[name] = {k: statistics.median(t[k] for t in mine if t.get(k) is not None) for k in keys}
    return out


def table(runs: list[tuple[str, dict]]) -> str:
    """Medians per variant, the wall time also to the first variant's of the same invocation."""
    med = _medians(runs)
    base = next(iter(med.values()))
    cols = (
        "variant", "sweep wall (s)", "training, summed (s)", "overhead", "fixed cost per trial (s)",
        "slot start-up (s)", "per trial in a started slot (s)", "idle tail (s)", "after the last trial (s)",
        "bookkeeping per iteration, in training (s)", "wall / first variant", "1-min load at start",
    )  # fmt: skip
    rows = [
        [name, f"{m['wall_s']:.1f}", f"{m['train_s_sum']:.1f}", f"{m['overhead_fraction']:.1%}",
         f"{m['fixed_s_per_trial']:.1f}", _num(m.get("startup_s_per_slot")), _num(m.get("reused_s_per_trial")),
         f"{m['idle_tail_s']:.1f}", f"{m['after_s']:.1f}", _num(m.get("loop_s_per_iter"), 3),
         f"{m['wall_s'] / base['wall_s']:.2f}", f"{m['load_1min']:.1f}"]
        for name, m in med.items()
    ]  # fmt: skip
    return C.md_table(list(cols), rows)


def _num(v, digits: int = 1) -> str:
    return "n/a" if v is None or v != v else f"{v:.{digits}f}"


EXPLAIN = """\
Overhead = 1 - summed training (each run's `train_wall_time_s`, its evaluation at iteration 0 to its final save) /
(sweep wall x slots), as `timing.json` reports it. Fixed cost per trial = (wall x slots - training - idle tail) /
trials: a slot's first trial (start-up, mean) and the others (median); idle tail = the slots' idle time after their
last trial until the sweep's last trial ended; all from `timing.json["timeline"]`.
"""


def main() -> None:
    p = C.cli(__doc__)
    p.add_argument("--spec", default="sweeps/quickstart.yaml")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--fresh", action="store_true", help="also run the baseline: a fresh worker per trial")
    args = p.parse_args()
    m = C.machine()
    runs = measure(args.spec, args.rounds, (FRESH, REUSED) if args.fresh else (REUSED,))
    cmd = f"python benchmarks/sweep_overhead.py --spec {args.spec} --rounds {args.rounds}{' --fresh' * args.fresh}"
    body = (
        f"## Sweep orchestration overhead (`benchmarks/sweep_overhead.py`)\n\n"
        f"`{cmd}`: the sweep run {args.rounds}x per variant, alternating, on a local Ray of 2 CPUs (medians; warm "
        f"start cached, W&B as the spec sets it). {C.machine_line(m, 1)}\n\n{table(runs)}\n\n"
        f"{EXPLAIN}"
    )
    C.publish("sweep-overhead", body, args.write)


if __name__ == "__main__":
    main()
