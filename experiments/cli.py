"""``emapg`` — the command line. Subcommands import their packages lazily, so `emapg train` never
imports ray and `emapg report` never imports torch.

Each command's usage: `emapg <command> --help`, and docs/usage.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from typing import NamedTuple

from experiments import errors, numerics, progress
from experiments.errors import raise_terminated


class Command(NamedTuple):
    """A subcommand: `function`(argv) -> exit code of `module`, which is imported only when the command runs (pip's
    command table), so `emapg --help` loads the command line alone."""

    module: str
    function: str
    unwinds: bool = False  # SIGTERM unwinds it like Ctrl-C (exit 143), from before its module is imported


COMMANDS = {
    "train": Command("experiments.run", "main", unwinds=True),
    "pretrain": Command("experiments.pretrain", "main"),
    "data": Command("experiments.ops.data", "main"),
    "eval": Command("experiments.ops.evaluate", "main"),
    "retriever": Command("experiments.ops.retrieval.cli", "main"),
    "sweep": Command("sweeps.cli", "main", unwinds=True),
    "report": Command("analysis.report", "main_report"),
    "dashboard": Command("analysis.dashboard", "main"),
    "figures": Command("analysis.report", "main_figures"),
    "cluster": Command("cluster.submit", "main"),
    "rehearse": Command("experiments.ops.rehearse", "main"),
    "doctor": Command("experiments.ops.doctor", "main"),
}
REHEARSE_SWEEP = Command("experiments.ops.rehearse.sweep", "main")  # `emapg rehearse <sweep>.yaml`: Ray Tune, two nodes


def run_command(name: str, argv: list[str]) -> int:
    """Import the command's module and run it; this is the one composition root (docs/architecture.md), so here the
    command gets what its package may not import itself."""
    command = COMMANDS[name]
    if name == "rehearse" and any(a.endswith((".yaml", ".yml")) for a in argv):
        command = REHEARSE_SWEEP
    main_thread = command.unwinds and threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, raise_terminated) if main_thread else None
    try:
        function = getattr(importlib.import_module(command.module), command.function)
        if name == "figures":
            from ema_pg_core import audit  # loads torch, numpy; analysis never imports the core

            return function(argv, audit.records) or 0
        if name == "dashboard":
            return function(argv, load_sweep_info)
        if command is REHEARSE_SWEEP:
            return function(argv, load_sweep_grid)
        if name == "report" and any(a.startswith("--wandb-p") for a in argv):  # --wandb-project, abbreviated too
            from experiments.wandb_logger import reaching  # loads omegaconf; W&B's errors in one line

            with reaching("emapg report --wandb-project", instead="report from a directory of run records"):
                return function(argv) or 0
        return function(argv) or 0
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def load_sweep_grid(path: str) -> tuple:
    """A sweep spec (validated) and its grid points, for the sweep rehearsal (experiments.ops.rehearse.sweep)."""
    from sweeps.spec import grid_points, load  # loads torch, pydantic: keeps `emapg --help` fast

    spec = load(path)
    return spec, list(grid_points(spec))


def load_sweep_info(path):
    """A sweep directory's sweep.yaml -> analysis.dashboard.SweepInfo (its own checks ran when the sweep started)."""
    from analysis.dashboard import SweepInfo  # loads omegaconf: keeps `emapg --help` fast
    from sweeps.spec import load  # loads torch, pydantic: keeps `emapg --help` fast

    return SweepInfo.from_spec(load(path, check_config=False))


def absolute_cache_env() -> None:
    """EMAPG_CACHE (the warm-start cache, model.cache_dir) made absolute in this process's environment, which every
    process it starts inherits: a sweep trial's Ray worker runs in the trial's own directory, where a relative path
    would give each trial its own cache. An empty EMAPG_CACHE is unset: the default cache."""
    cache = os.environ.pop("EMAPG_CACHE", "")
    if cache:
        os.environ["EMAPG_CACHE"] = os.path.abspath(os.path.expanduser(cache))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    absolute_cache_env()  # before any command reads it or starts a process
    try:
        numerics.pin()  # before any command loads torch: it and every process it starts compute on the pinned path
    except errors.UserError as e:  # EMAPG_NUMERICS misspelt: one line, exit 2
        return errors.handle("emapg", e)
    parser = argparse.ArgumentParser(
        prog="emapg",
        description="EMA-PG: train, sweep, report.",
        epilog="Run `emapg <command> --help` for a command's options.",
    )
    parser.add_argument("command", choices=sorted(COMMANDS))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        from experiments.build import presets  # loads torch, omegaconf: keeps `emapg --help` fast

        print("\nexperiment presets: " + ", ".join(presets()))
        return 0
    args = parser.parse_args(argv[:1])
    try:
        progress.quiet_libraries()  # EMAPG_PROGRESS=0: no Hugging Face bars either
        return run_command(args.command, argv[1:])
    except BaseException as e:  # noqa: BLE001  the one error path: experiments.errors
        if isinstance(e, SystemExit):  # argparse's usage errors (exit 2) and --help
            raise
        return errors.handle(f"emapg {args.command}", e)


if __name__ == "__main__":
    sys.exit(main())
