"""The KL probe's cost: its time as a share of the iteration time, at the default cadence, in the same run.

    python benchmarks/probe_cost.py [--iterations 20] [--threads 1] [--presets math_tiny_ema_pg ...] [--write]
    python benchmarks/probe_cost.py --runs outputs/sweeps/kl_telemetry --write   # from finished run records

Runs each preset (W&B off, warm-started tiny model) at the default ``trainer.probe_every`` and ``probe_size``, or
reads the records under ``--runs``; the section defines the share (target <= 5%).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

C.numerics.pin()  # before torch loads, as the emapg command does: run() checks its numerics pins

from ema_pg_core.config import probe_prompts  # noqa: E402
from experiments import records  # noqa: E402
from experiments.build import compose, validate  # noqa: E402
from experiments.run import run  # noqa: E402


def shares(rows: list[dict]) -> dict:
    """{iter_s, probe_s (per call), per_call (probe_s / iter_s), share, probes, iterations} from metric lines."""
    rows = [r for r in rows if r["iteration"] >= 2 and "perf/iter_s" in r]  # no eval-only row 0, no warm-up
    probes = [r["perf/probe_s"] for r in rows if r.get("perf/probe_s") is not None]
    it = sum(r["perf/iter_s"] for r in rows)
    mean_it, mean_probe = it / len(rows), (sum(probes) / len(probes) if probes else 0.0)
    return {
        "iter_s": mean_it,
        "probe_s": mean_probe,
        "per_call": mean_probe / mean_it,
        "share": sum(probes) / (it + sum(probes)),
        "probes": len(probes),
        "iterations": len(rows),
    }


def measure(preset: str, iterations: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        overrides = [f"experiment={preset}", f"trainer.iterations={iterations}", f"trainer.eval_every={iterations}"]
        overrides += ["trainer.eval_size=8", "trainer.save_every=0", "logger.name=none", f"run_dir={d}/run"]
        cfg = compose(overrides + [f"trainer.threads={threads}"])
        run(cfg)
        out = shares(records.read_metrics(Path(d) / "run"))
    trainer = validate(cfg).trainer  # a null cadence resolved as the run resolves it
    out["every"], out["size"] = trainer.resolved_probe_every, probe_prompts(trainer, int(cfg.task.test_size))
    return out


def from_runs(root: Path) -> dict[str, dict]:
    """{run directory name: shares} for every finished run record (config.yaml + metrics.jsonl) under ``root``."""
    out = {}
    for run_dir in sorted(m.parent for m in root.rglob("metrics.jsonl")):
        if not (run_dir / "status").is_file() or records.read_status(run_dir)[0] != "finished":
            continue
        trainer = yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]
        out[run_dir.name] = {**shares(records.read_metrics(run_dir)), "every": trainer["probe_every"],
                             "size": trainer["probe_size"]}  # fmt: skip
    return out


def main() -> None:
    ap = C.cli(__doc__)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--presets", nargs="+", default=["math_tiny_ema_pg", "search_tiny_ema_pg"])
    ap.add_argument("--runs", type=Path, default=None, help="read run records under this directory instead")
    args = ap.parse_args()
    os.environ.setdefault("EMAPG_PROGRESS", "0")
    text = C.machine_line(C.machine(), args.threads)
    if args.runs:
        results, name = from_runs(args.runs), "probe_cost_runs"
        text += " The runs were measured earlier, during their sweep, under the load of that time."
    else:
        results, name = {p: measure(p, args.iterations, args.threads) for p in args.presets}, "probe_cost"
    C.publish(name, section(results, C.command("probe_cost.py", sys.argv[1:]), text), args.write)


def section(results: dict[str, dict], command: str, machine_text: str) -> str:
    """The docs/benchmarks.md section: heading, how it was measured and the range of the share over the runs."""
    share = [r["share"] for r in results.values()]
    per_call = [r["per_call"] for r in results.values()]
    cadence = sorted({f"every {r['every']} iterations on {r['size']} prompts" for r in results.values()})
    its = sorted({r["iterations"] for r in results.values()})
    timed = f"{its[0]}" if len(its) == 1 else f"{its[0]}-{its[-1]}"
    return "\n\n".join(
        [
            "## KL probe cost (`benchmarks/probe_cost.py`)",
            f"Command: `{command}`. {machine_text}".rstrip(),
            "Share = sum(perf/probe_s) / (sum(perf/iter_s) + sum(perf/probe_s)) over the training iterations but "
            "the first, each run against its own iteration time (same run, same load). Target: <= 5%.",
            f"Share at the cadence ({', '.join(cadence)}): {min(share):.2%} to {max(share):.2%} over {len(share)} "
            f"run(s) ({timed} timed iterations each); one probe costs {min(per_call):.1%} to {max(per_call):.1%} "
            "of an iteration.",
        ]
    )


if __name__ == "__main__":
    main()
