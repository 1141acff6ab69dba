"""`emapg data prepare TASK --out DIR [--from SRC]`: write a task's verl parquet files (its `prepare`)
from the Hugging Face hub, or from a local copy of its source data sets, with one progress bar per
source and a summary of the rows written.

    emapg data prepare math --out ~/data/emapg/math                  # from the hub (needs `datasets`)
    emapg data prepare search --out ~/data/emapg/search --from ~/src  # offline, from files you downloaded

The `--from` layout (`LAYOUT`; `emapg data prepare --help` lists every file each task needs and the columns it
reads) and how to write one such file: docs/scaling-out.md, "Data".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
from types import ModuleType

import pyarrow.parquet as pq

from experiments import progress
from experiments.errors import UserError
from experiments.tasks import TASKS

LAYOUT = 'SRC/<dataset id, "/" replaced by "__">/[<config>/]<split>.parquet (or .jsonl)'
EXTENSIONS = (".parquet", ".jsonl")
# packages whose exceptions, raised while loading from the hub, mean the hub could not serve the data set
HUB_MODULES = ("huggingface_hub", "datasets", "httpx", "requests", "urllib3", "fsspec", "aiohttp")
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def prepare_tasks() -> dict[str, ModuleType]:
    """The tasks with data to prepare: a `prepare` function and the `sources()` it loads."""
    return {name: m for name, m in sorted(TASKS.items()) if hasattr(m, "prepare") and hasattr(m, "sources")}


def _task(name: str) -> ModuleType:
    tasks = prepare_tasks()
    if name in tasks:
        return tasks[name]
    why = "has no data to prepare (it is generated)" if name in TASKS else "is not a task"
    raise UserError(f"task {name!r} {why}; tasks with a prepare function: {', '.join(tasks)}")


def label(source) -> str:
    """'amc (opencompass/LiveMathBench v202412_AMC_en)': the loader's arguments and the data set."""
    return f"{' '.join(source.args)} ({source.dataset}{f' {source.config}' if source.config else ''})"


def source_stem(root: str, source, split: str) -> str:
    """The file of one split of `source` under `root`, without its extension (the --from layout)."""
    parts = [source.dataset.replace("/", "__"), *([source.config] if source.config else []), split]
    return os.path.join(root, *parts)


def local_files(root: str, sources) -> dict[tuple, str]:
    """The file each source is read from under `root`; a UserError naming every missing one."""
    found, missing = {}, []
    for s in sources:
        candidates = [source_stem(root, s, split) + ext for split in s.splits for ext in EXTENSIONS]
        path = next((p for p in candidates if os.path.isfile(p)), None)
        if path:
            found[s.args] = path
        else:
            missing.append(os.path.relpath(_pattern(root, s), root))
    if missing:
        raise UserError(
            f"--from {root}: missing {', '.join(missing)} (layout: {LAYOUT}; `emapg data prepare --help` lists "
            "the files each task needs)"
        )
    return found


def _pattern(root: str, source) -> str:
    """'<root>/RUC-NLPIR__FlashRAG_datasets/popqa/{test,dev,train}.{parquet,jsonl}'."""
    splits = source.splits[0] if len(source.splits) == 1 else "{" + ",".join(source.splits) + "}"
    return source_stem(root, source, splits) + ".{" + ",".join(e[1:] for e in EXTENSIONS) + "}"


def read_rows(path: str, fields: tuple[str, ...]) -> list[dict]:
    """The rows of one --from file (parquet or JSONL); a UserError naming the file if it cannot be read
    or a row lacks a column the task reads."""
    if path.endswith(".parquet"):
        try:
            rows = pq.read_table(path).to_pylist()
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    else:
        rows = _read_jsonl(path)
    for i, row in enumerate(rows, 1):
        lacking = [f for f in fields if f not in row]
        if lacking:
            raise UserError(f"{path}: row {i} has no column {', '.join(lacking)} (the task reads {', '.join(fields)})")
    return rows


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{n}: not JSON ({e.msg}); a .jsonl file holds one JSON object a line") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{n}: a JSON {type(row).__name__}, not an object (one row a line)")
            rows.append(row)
    return rows


# ---------------------------------------------------------------- the hub
def _require_datasets() -> None:
    if importlib.util.find_spec("datasets") is None:
        raise UserError(
            "loading from the Hugging Face hub needs the `datasets` package, which is not installed: "
            "pip install 'datasets>=3' (the [verl] extra brings it), or give --from SRC with the sources downloaded "
            "(`emapg data prepare --help` shows the layout)"
        )


def _hub_failure(exc: Exception) -> bool:
    """True for what the hub loaders raise when a data set cannot be fetched (offline, no network, not
    found, a bad config); False for anything else (a bug: its traceback is kept)."""
    return isinstance(exc, (OSError, ValueError)) or type(exc).__module__.split(".")[0] in HUB_MODULES


def hub_message(source, exc: BaseException) -> str:
    """One line: the data set that could not be loaded, why, and the two ways out."""
    where = source.dataset + (f" (config {source.config})" if source.config else "")
    offline = [v for v in OFFLINE_VARS if os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")]
    note = f" with {'/'.join(offline)} set" if offline else ""
    text = (str(exc).strip().splitlines() or [""])[0][:200]
    return (
        f"cannot load {where} from the Hugging Face hub{note} ({type(exc).__name__}: {text}); check the network, "
        "or download the sources and give --from SRC (`emapg data prepare --help` shows the layout)"
    )


# ---------------------------------------------------------------- running a task's prepare
def _tracked(module: ModuleType, load, hub: bool):
    """`load` as the task's loader, with one progress bar per source and the hub's errors in one line.
    From the hub the bar appears while the data set downloads; from --from files, once they are read."""
    by_args = {s.args: s for s in module.sources()}

    def loader(*args):
        if args not in by_args:
            raise RuntimeError(f"{module.__name__}.prepare loads {args}, which its sources() does not list")
        source = by_args[args]
        bar = progress.bar(None, label(source), unit="rows") if hub else None
        try:
            data = load(*args)
        except Exception as e:
            _close(bar)
            if hub and _hub_failure(e):
                raise UserError(hub_message(source, e)) from e
            raise
        if data is None:  # the data set has none of the splits: the task skips it
            _close(bar)
            return None
        if bar is None:
            bar = progress.bar(len(data), label(source), unit="rows")
        else:
            bar.reset(total=len(data))
        return _counted(data, bar)

    return loader


def _close(bar) -> None:
    if bar is not None:
        bar.close()


def _counted(data, bar):
    try:
        for row in data:
            yield row
            bar.update()
    finally:
        bar.close()


def run(task: str, out: str, src: str | None = None) -> dict[str, str]:
    """Check the arguments, then write the task's parquet files to `out` ({file stem: path})."""
    module = _task(task)
    out = os.path.abspath(os.path.expanduser(out))
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out}: is a file, not a directory")
    if src is None:
        _require_datasets()
        load, hub = module.hf_loader, True
    else:
        root = os.path.abspath(os.path.expanduser(src))
        if not os.path.isdir(root):
            raise UserError(f"--from {src}: no such directory (layout: {LAYOUT})")
        fields = {s.args: s.fields for s in module.sources()}
        tables = {args: read_rows(path, fields[args]) for args, path in local_files(root, module.sources()).items()}

        def load(*args):  # every file was read and checked above: nothing is written from a bad copy
            return tables[args]

        hub = False
    return module.prepare(out, loader=_tracked(module, load, hub))


def summary(task: str, out: str, written: dict[str, str]) -> list[str]:
    """Rows per file (read back from the parquet files), where they are, and the overrides that use them."""
    out = os.path.abspath(os.path.expanduser(out))
    counts = [(os.path.basename(path), pq.read_metadata(path).num_rows) for path in written.values()]
    width = max(len(name) for name, _ in counts)
    lines = [f"{task}: {len(counts)} files in {out}", f"  {'file':<{width}}  {'rows':>9}"]
    lines += [f"  {name:<{width}}  {n:>9,}" for name, n in counts]
    train, val = written["train"], written.get("val", written.get("test"))
    default = getattr(prepare_tasks()[task].Knobs(), "data_dir", None)
    if default and os.path.abspath(os.path.expanduser(default)) == out:
        lines.append(f"the {task} presets read these files ({default}): no override needed")
    else:
        q = shlex.quote
        lines.append(f"verl runs: backend.verl.train_files={q(train)} backend.verl.val_files={q(val)}")
        lines.append(f"task.load (Python, local backend): +task.knobs.data_dir={q(out)}")
    return lines


# ---------------------------------------------------------------- the command line
def layout_help() -> str:
    """Every file `--from` needs, per task, with the columns read."""
    tasks = {name: [(_pattern("SRC", s), s.fields) for s in m.sources()] for name, m in prepare_tasks().items()}
    width = max(len(path) for files in tasks.values() for path, _ in files)
    lines = [
        f"--from SRC layout: {LAYOUT}",
        "per task (of several splits, {test,dev,train}, the first file found is read):",
    ]
    for name, files in tasks.items():
        lines += [f"  {name}:", *(f"    {path:<{width}}  columns: {', '.join(fields)}" for path, fields in files)]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="emapg data", description="Prepare a task's data for the verl backend.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "prepare",
        help="write a task's verl parquet files (from the HF hub, or --from a local copy)",
        description=__doc__.split("\n\n")[0],
        epilog=layout_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("task", help=f"one of: {', '.join(prepare_tasks())}")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write (created if missing)")
    p.add_argument("--from", dest="src", metavar="SRC", help="read the sources from this directory, not the hub")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    written = run(args.task, args.out, args.src)
    print("\n".join(summary(args.task, args.out, written)))
    return 0
