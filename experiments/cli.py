"""``emapg`` — the command line. Subcommands import their packages lazily, so `emapg train` never
imports ray and `emapg report` never imports torch.

    emapg train experiment=math_tiny_ema_pg [hydra overrides ...]
    emapg pretrain task=math_tiny
    emapg data prepare math --out ~/data/emapg/math [--from <dir with the source data sets>]
    emapg eval <run dir | checkpoint | HF model dir> [--benchmarks ...] [--protocol readme|benchmark|in_training]
    emapg retriever serve --task search_tiny --port 8000
    emapg retriever serve --corpus wiki-18.jsonl --retriever e5 [--index e5_Flat.index]
    emapg retriever index --corpus wiki-18.jsonl --out e5_Flat.index
    emapg sweep sweeps/quickstart.yaml [--dry-run] [--resume] [--address ...]
    emapg rehearse experiment=math_deepscaler_ema_pg                (verl's loop on CPU, killed and resumed)
    emapg rehearse sweeps/search_r1_ema_pg.yaml [--layout across]   (the sweep through Tune, two nodes)
    emapg report <runs-or-sweep-dir> --out <dir>
    emapg dashboard <sweep-dir> [--entity E] [--project P] [--publish]   (W&B workspace + report)
    emapg figures --out <dir>
    emapg doctor experiment=math_deepscaler_ema_pg [--address HOST:PORT]  (preflight of a node or a Ray cluster)
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading

from experiments import errors, numerics, progress
from experiments.errors import RunInterrupted, UserError, raise_terminated


def _train(argv: list[str]) -> int:
    from experiments import build  # loads torch, omegaconf: keeps `emapg --help` fast

    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.split("\n\n")[0])
        print("usage: emapg train [experiment=<preset>] [key=value ...]   (Hydra overrides)\n")
        print("experiment presets:\n  " + "\n  ".join(build.presets()))
        print(
            "\ncommon overrides: seed=1 smoke=true algo.anchor.tau=0.95 algo.anchor.period=10 algo.kl.type=k3 "
            "algo.kl.k=32 algo.kl.tail=paper trainer.iterations=100 logger.mode=online run_dir=... resume=true"
        )
        print(
            "staged runs (experiments/stages.py): stages=[8k,16k] | stage=16k (a task's stages) | "
            "'stages=[{name: a, set: {trainer.iterations: 40}}, ...]' (any preset)"
        )
        return 0
    bad = [a for a in argv if "=" not in a]
    if bad:
        raise UserError(f"emapg train takes Hydra overrides key=value; got {' '.join(bad)} (see emapg train --help)")
    from experiments.run import run  # loads torch, omegaconf: keeps `emapg --help` fast

    cfg = build.compose(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, raise_terminated) if main_thread else None  # unwinds like Ctrl-C
    try:
        summary = run(cfg)
    except RunInterrupted as e:  # one line + how to continue
        raise RunInterrupted(f"{e}\nresume with: {resume_command(argv, e)}", e.signame, e.run_dir) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    keys = sorted(k for k in summary if k.startswith(("eval/", "eval_anchor/")) and not k.startswith("best_"))
    for k in keys:
        print(f"{k:40s} {summary[k]:.4f}")
    return 0


def resume_command(argv: list[str], stop: RunInterrupted) -> str:
    """The same `emapg train` command with resume=true and the run directory the stopped run used, quoted twice:
    for Hydra (a path with spaces or special characters) and for the shell."""
    keep = [a for a in argv if not a.startswith(("resume=", "run_dir="))]
    run_dir = getattr(stop, "run_dir", None)
    where = [_run_dir_override(str(run_dir))] if run_dir else []
    return shlex.join(["emapg", "train", *keep, *where, "resume=true"])


def _run_dir_override(path: str) -> str:
    """run_dir=<path>, quoted for Hydra only where Hydra would not read the path back as it is."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from ema_pg_core.overrides import hydra_value  # keeps `emapg --help` off the core package

    plain = f"run_dir={path}"
    try:
        (parsed,) = OverridesParser.create().parse_overrides([plain])
        if parsed.value() == path:
            return plain
    except Exception:  # noqa: BLE001  Hydra's lexer refuses it: quote it
        pass
    return f"run_dir={hydra_value(path, quote=chr(34))}"


def _pretrain(argv: list[str]) -> int:
    from experiments.pretrain import main  # loads transformers, torch: keeps `emapg --help` fast

    return main(argv) or 0


def _eval(argv: list[str]) -> int:
    from experiments.ops.evaluate import main  # loads omegaconf: keeps `emapg --help` fast

    return main(argv)


def _data(argv: list[str]) -> int:
    from experiments.ops.data import main  # a subcommand: keeps `emapg --help` fast

    return main(argv)


def _retriever(argv: list[str]) -> int:
    from experiments.ops.retrieval.cli import main  # loads pydantic, numpy: keeps `emapg --help` fast

    return main(argv) or 0


def _rehearse(argv: list[str]) -> int:
    if any(a.endswith((".yaml", ".yml")) for a in argv):  # a sweep: through Ray Tune on a two-node cluster
        from sweeps.rehearse import main as sweep_main  # a layer above experiments: only in its subcommand

        return sweep_main(argv)
    from experiments.ops.rehearse import main  # loads numpy: keeps `emapg --help` fast

    return main(argv)


def _sweep(argv: list[str]) -> int:
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, raise_terminated) if main_thread else None  # the imports too: exit 143
    try:
        from sweeps.cli import main  # loads torch, pydantic: keeps `emapg --help` fast

        return main(argv) or 0
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _report(argv: list[str]) -> int:
    from analysis.report import main_report  # loads pandas, matplotlib: keeps `emapg --help` fast

    if not any(a.startswith("--wandb-p") for a in argv):  # --wandb-project, as argparse reads it abbreviated too
        return main_report(argv) or 0
    from experiments.wandb_logger import reaching  # W&B's errors in one line: no key (exit 2), unreachable (1)

    with reaching("emapg report --wandb-project", instead="report from a directory of run records"):
        return main_report(argv) or 0


def _dashboard(argv: list[str]) -> int:
    from analysis.dashboard import main  # loads omegaconf: keeps `emapg --help` fast

    return main(argv, load_sweep_info)


def load_sweep_info(path):
    """A sweep directory's sweep.yaml -> analysis.dashboard.SweepInfo (its own checks ran when the sweep started)."""
    from analysis.dashboard import SweepInfo  # loads omegaconf: keeps `emapg --help` fast
    from sweeps.spec import load  # loads torch, pydantic: keeps `emapg --help` fast

    return SweepInfo.from_spec(load(path, check_config=False))


def _figures(argv: list[str]) -> int:
    from analysis.report import main_figures  # loads pandas, matplotlib: keeps `emapg --help` fast
    from ema_pg_core import audit  # loads torch, numpy: keeps `emapg --help` fast

    return main_figures(argv, audit.records) or 0


def _doctor(argv: list[str]) -> int:
    from experiments.ops.doctor import main  # a subcommand: keeps `emapg --help` fast

    return main(argv)


def _cluster(argv: list[str]) -> int:
    from cluster.submit import main  # a layer above experiments: only in its subcommand

    return main(argv) or 0


COMMANDS = {
    "train": _train,
    "pretrain": _pretrain,
    "data": _data,
    "eval": _eval,
    "retriever": _retriever,
    "sweep": _sweep,
    "report": _report,
    "dashboard": _dashboard,
    "figures": _figures,
    "cluster": _cluster,
    "rehearse": _rehearse,
    "doctor": _doctor,
}


def absolute_cache_env() -> None:
    """EMAPG_CACHE (the warm-start cache, model.cache_dir) made absolute in this process's environment, which every
    process it starts inherits: a sweep trial's Ray worker runs in the trial's own directory, where a relative path
    would give each trial its own cache. An empty EMAPG_CACHE is unset: the default cache."""
    cache = os.environ.get("EMAPG_CACHE")
    if cache == "":
        del os.environ["EMAPG_CACHE"]
    elif cache is not None:
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
    args, rest = parser.parse_known_args(argv[:1])
    try:
        progress.quiet_libraries()  # EMAPG_PROGRESS=0: no Hugging Face bars either
        return COMMANDS[args.command](argv[1:])
    except BaseException as e:  # noqa: BLE001  the one error path: experiments.errors
        if isinstance(e, SystemExit):  # argparse's usage errors (exit 2) and --help
            raise
        return errors.handle(f"emapg {args.command}", e)


if __name__ == "__main__":
    sys.exit(main())
