"""``emapg sweep``: run a sweep spec (sweeps/*.yaml) with Ray Tune.

    emapg sweep sweeps/quickstart.yaml                  # -> outputs/sweeps/quickstart/ (sweep.csv, report/)
    emapg sweep sweeps/ablate_tau.yaml --dry-run        # validate and print the trial table; starts nothing
    emapg sweep sweeps/quickstart.yaml --resume         # finish an interrupted sweep (same --out, same spec)
    emapg sweep sweeps/tune_optuna.yaml --address auto --out /shared/sweeps/opt   # on a running Ray cluster

Without --address a local Ray is started on 127.0.0.1 with every core. On a multi-node cluster,
--out must be on storage every node can write (the trials write their run records there).
Exit status: 0 when every trial finished (or was stopped early by the scheduler), 1 when a
trial failed or the sweep did not finish, 2 for an invalid spec.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from experiments.errors import bounded, is_path_error
from sweeps.spec import load, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="emapg sweep",
        description="Run a sweep spec (sweeps/*.yaml) with Ray Tune.",
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("spec", help="a sweep YAML, e.g. sweeps/quickstart.yaml")
    parser.add_argument("--dry-run", action="store_true", help="validate the spec and print the trials; run nothing")
    parser.add_argument(
        "--resume", action="store_true", help="continue the sweep in --out without re-running finished trials"
    )
    parser.add_argument("--out", default=None, help="the sweep directory (default: outputs/sweeps/<name>)")
    parser.add_argument("--address", default=None, help="Ray cluster address (e.g. auto); default: start a local Ray")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    args = parser.parse_args(argv)
    try:
        spec = load(args.spec)
        if args.dry_run:
            print(table(spec))
            return 0
        from sweeps.tune import run_sweep

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
    return 0 if all(s in ("finished", "stopped") for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
