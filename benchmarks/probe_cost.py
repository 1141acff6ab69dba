"""The KL probe's cost: its time as a share of the iteration time, at the default cadence, in the same run.

    python benchmarks/probe_cost.py [--iterations 20] [--threads 1] [--presets math_tiny_ema_pg ...]
    python benchmarks/probe_cost.py --runs outputs/sweeps/kl_telemetry   # from existing run records

Runs each preset (W&B off, warm-started tiny model) with the default ``trainer.probe_every`` and
``trainer.probe_size``, then reads ``perf/iter_s`` (rollout to anchor update) and ``perf/probe_s`` (both
models' forward passes on the probe set and the exact KL) from the run record. The share is
sum(probe_s) / (sum(iter_s) + sum(probe_s)) over all training iterations but the first (warm-up): what the
probe adds to training at that cadence (target <= 5%). The probe's per-call time is also given as a ratio
to one iteration. The probe set itself is drawn once per run (one rollout of probe_size prompts) and is
not counted. ``--runs`` computes the same figures from the records under a directory (e.g. a sweep).
Writes its section of docs/benchmarks.md with ``--write``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, machine_line, md_table, write_section  # noqa: E402


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
    from experiments.build import compose  # loads torch, omegaconf
    from experiments.run import run  # loads torch, omegaconf

    with tempfile.TemporaryDirectory() as d:
        overrides = [f"experiment={preset}", f"trainer.iterations={iterations}", f"trainer.eval_every={iterations}"]
        overrides += ["trainer.eval_size=8", "trainer.save_every=0", "logger.name=none", f"run_dir={d}/run"]
        cfg = compose(overrides + [f"trainer.threads={threads}"])
        run(cfg)
        lines = (Path(d) / "run" / "metrics.jsonl").read_text().splitlines()
    out = shares([json.loads(line) for line in lines])
    out["every"], out["size"] = int(cfg.trainer.probe_every), int(cfg.trainer.probe_size)
    return out


def from_runs(root: Path) -> dict[str, dict]:
    """{run directory name: shares} for every finished run record (config.yaml + metrics.jsonl) under ``root``."""
    out = {}
    for metrics in sorted(root.rglob("metrics.jsonl")):
        status = metrics.parent / "status"
        if not status.is_file() or status.read_text().split("\n", 1)[0].strip() != "finished":
            continue  # finished runs only
        cfg = yaml.safe_load((metrics.parent / "config.yaml").read_text())
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        out[metrics.parent.name] = {
            **shares(rows),
            "every": cfg["trainer"]["probe_every"],
            "size": cfg["trainer"]["probe_size"],
        }
    return out


def table(results: dict[str, dict]) -> str:
    rows = [
        [name, f"{r['every']} / {r['size']}", r["iterations"], r["probes"], f"{r['iter_s']:.3f}", f"{r['probe_s']:.3f}",
         f"{r['per_call']:.1%}", f"{r['share']:.2%}"]
        for name, r in results.items()
    ]  # fmt: skip
    header = ["run", "probe_every / probe_size", "iterations", "probes", "iteration (s)", "probe (s)",
              "probe / iteration", "share at this cadence"]  # fmt: skip
    return md_table(header, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--presets", nargs="+", default=["math_tiny_ema_pg", "search_tiny_ema_pg"])
    ap.add_argument("--runs", type=Path, default=None, help="read run records under this directory instead")
    ap.add_argument("--write", action="store_true", help="write the section of docs/benchmarks.md")
    args = ap.parse_args()
    os.environ.setdefault("EMAPG_PROGRESS", "0")
    m = machine()
    if args.runs:
        results, name = from_runs(args.runs), "probe_cost_runs"
    else:
        results, name = {p: measure(p, args.iterations, args.threads) for p in args.presets}, "probe_cost"
    text = machine_line(m, args.threads)
    if args.runs:
        text += " The runs were measured earlier, during their sweep, under the load of that time."
    body = section(results, " ".join(["python benchmarks/probe_cost.py", *sys.argv[1:]]), text)
    print(body)
    if args.write:
        write_section(name, body)


def section(results: dict[str, dict], command: str, machine_text: str) -> str:
    """The docs/benchmarks.md section: heading, how it was measured, the table and the range of the share."""
    share = [r["share"] for r in results.values()]
    per_call = [r["per_call"] for r in results.values()]
    return "\n\n".join(
        [
            "## KL probe cost (`benchmarks/probe_cost.py`)",
            f"Command: `{command}`. {machine_text}".rstrip(),
            "Share = sum(perf/probe_s) / (sum(perf/iter_s) + sum(perf/probe_s)) over the training iterations but "
            "the first, each run against its own iteration time (same run, same load). Target: <= 5%.",
            table(results),
            f"Share at the cadence: {min(share):.2%} to {max(share):.2%} over {len(share)} run(s); one probe costs "
            f"{min(per_call):.1%} to {max(per_call):.1%} of an iteration.",
        ]
    )


if __name__ == "__main__":
    main()
