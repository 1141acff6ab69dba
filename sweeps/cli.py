"""``emapg sweep``: run a sweep spec (sweeps/*.yaml) with Ray Tune.

    emapg sweep sweeps/quickstart.yaml                  # -> outputs/sweeps/quickstart/ (sweep.csv, report/)
    emapg sweep sweeps/ablate_tau.yaml --dry-run        # validate and print the trial table; starts nothing
    emapg sweep sweeps/quickstart.yaml --resume         # finish an interrupted sweep (same --out, same spec)
    emapg sweep sweeps/tune_optuna.yaml --address auto --out /nfs/sweeps/opt   # on a running Ray cluster
    emapg sweep --schema sweeps/schema.json             # the JSON Schema of a sweep YAML (no file: stdout)

An editor with the YAML language server validates and completes a sweep YAML against that schema when its
first line is `# yaml-language-server: $schema=schema.json` (a path relative to the YAML, or a URL), as in
the shipped sweeps/*.yaml.

Without --address a local Ray is started on 127.0.0.1 with every core; with it, something must answer at the
address within seconds (else exit 2, naming it). On a multi-node cluster, --out must be on storage every node
can write (the trials write their run records there). --out holds one sweep: a new sweep needs a new or empty
directory (one holding another sweep, this sweep already, a run record or other files is refused, exit 2:
continue this sweep with --resume, or pass another --out; nothing is ever deleted for you).

Exit status (experiments/errors.py): 0 when every trial finished (or was stopped early by the scheduler);
1 when a trial failed, stopped unhealthy, or was not run (the time budget, budget.time_budget_s, ran out:
sweep.csv lists it as not_run), or the sweep did not finish; 2 for an invalid spec, --out or --address;
143 / 130 when SIGTERM / SIGINT stopped the driver, at any point, with the command that resumes (a sweep
stopped before any trial ran starts from the beginning on --resume).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from experiments.errors import bounded, is_path_error
from sweeps.spec import load, schema, table

SUCCESS = ("finished", "stopped")  # sweep.csv statuses of a sweep that exits 0; any other exits 1


def main(argv: list[str] | None = None) -> int:
    """`emapg sweep` (SIGTERM unwinds it as Ctrl-C does: experiments.cli sets that before it imports this module)."""
    parser = argparse.ArgumentParser(
        prog="emapg sweep",
        description="Run a sweep spec (sweeps/*.yaml) with Ray Tune.",
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("spec", nargs="?", help="a sweep YAML, e.g. sweeps/quickstart.yaml")
    parser.add_argument(
        "--schema",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write the JSON Schema of a sweep YAML to PATH (default: stdout) and exit",
    )
    parser.add_argument("--dry-run", action="store_true", help="validate the spec and print the trials; run nothing")
    parser.add_argument(
        "--resume", action="store_true", help="continue the sweep in --out without re-running finished trials"
    )
    parser.add_argument("--out", default=None, help="the sweep directory (default: outputs/sweeps/<name>)")
    parser.add_argument("--address", default=None, help="Ray cluster address (e.g. auto); default: start a local Ray")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    args = parser.parse_args(argv)
    if args.schema is None and args.spec is None:
        parser.error("the following arguments are required: spec (or --schema)")
    try:
        if args.schema is not None:
            return write_schema(args.schema)
        spec = load(args.spec)
        if args.dry_run:
            print(table(spec))
            return 0
        from sweeps.tune import run_sweep  # loads ray, omegaconf

        sweep_dir = run_sweep(spec, args.out, resume=args.resume, address=args.address, num_cpus=args.num_cpus)
    except ValueError as e:  # an invalid spec or sweep directory: one clear line
        print(bounded(f"emapg sweep: error: {e}"), file=sys.stderr)
        return 2
    except OSError as e:
        if not is_path_error(e):
            raise
        print(bounded(f"emapg sweep: error: {e.filename or args.out}: {e.strerror or e}"), file=sys.stderr)
        return 2
    with open(Path(sweep_dir) / "sweep.csv", newline="", encoding="utf-8") as f:
        statuses = [row["status"] for row in csv.DictReader(f)]
    return 0 if all(s in SUCCESS for s in statuses) else 1


def write_schema(path: str) -> int:
    """The JSON Schema of a sweep YAML, to `path` ("-": stdout); never over a YAML (`--schema sweep.yaml`)."""
    if path.endswith((".yaml", ".yml")):
        raise ValueError(f"--schema {path}: the schema is JSON and would overwrite that YAML; give a .json path")
    text = json.dumps(schema(), indent=2) + "\n"
    if path == "-":
        sys.stdout.write(text)
    else:
        Path(path).write_text(text, encoding="utf-8")
    return 0
