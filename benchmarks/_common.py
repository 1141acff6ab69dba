"""Shared plumbing for the benchmarks: fresh-subprocess workers, peak RSS, machine facts, the doc.

Peak memory on CPU: a worker resets the kernel's peak-RSS counter (``echo 5 > /proc/self/clear_refs``) once its
inputs are allocated, then reads VmHWM - VmRSS; without clear_refs, ``ru_maxrss`` also counts the input setup.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

from experiments import numerics

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
GB, GiB = 1e9, 2**30


# ------------------------------------------------------------------ memory (Linux /proc)
def proc_bytes(field: str, path: str = "/proc/self/status") -> int:
    """The ``field: N kB`` line of /proc/self/status (or of `path`) in bytes; 0 without one."""
    m = re.search(rf"^{field}:\s+(\d+) kB", Path(path).read_text(), re.M)
    return 1024 * int(m.group(1)) if m else 0


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; False if the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """VmHWM (peak RSS since the last reset) in bytes; ru_maxrss if /proc lacks it."""
    return proc_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------ workers
def run_worker(script: Path, args: list[str], timeout: float = 1800) -> dict:
    """Run ``python script --worker args...`` in a fresh interpreter; it prints one JSON line last."""
    cmd = [sys.executable, str(script), "--worker", *args]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    if out.returncode != 0:
        raise RuntimeError(f"worker {args} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ machine and doc
def machine() -> dict:
    """CPU model, cores, RAM, torch version (without loading it: a benchmark may pin its numerics later), load
    average, UTC date."""
    return {
        "cpu": numerics.cpu_model(),
        "cores": os.cpu_count(),
        "ram_gib": round(proc_bytes("MemTotal", "/proc/meminfo") / GiB, 1) or None,
        "torch": version("torch"),
        "python": platform.python_version(),
        "loadavg": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _driver() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown (no nvidia-smi)"
    out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"


def describe(torch) -> dict[str, str]:
    """The card and the software the figures were measured with."""
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": f"{props.name} ({props.total_memory / 2**30:.0f} GiB, compute capability {props.major}.{props.minor})",
        "devices": str(torch.cuda.device_count()),
        "driver": _driver(),
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "transformers": version("transformers"),
        "python": platform.python_version(),
    }


def machine_line(m: dict, threads: int) -> str:
    return (
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, no GPU; torch {m['torch']}, "
        f"Python {m['python']}, `torch.set_num_threads({threads})`; load average at start {m['loadavg']} "
        f"(1/5/15 min, shared machine). Date: {m['date']}."
    )


def write_section(name: str, body: str) -> None:
    """Replace the text between <!-- BEGIN name --> and <!-- END name --> in docs/benchmarks.md (or append it)."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    text = DOC.read_text()
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)


def publish(section: str, text: str, write: bool) -> None:
    """Print the section; with `write`, also replace it in docs/benchmarks.md."""
    print(text)
    if write:
        write_section(section, text)


def command(script: str, argv: list[str]) -> str:
    """The command line that ran `script` (a file name in benchmarks/) with `argv`."""
    return " ".join(["python", f"benchmarks/{script}", *argv])


def cli(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser: the docstring's first paragraph, and ``--write`` (without it: printed only)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="write the section of docs/benchmarks.md")
    return p


def saved_main(doc: str, name: str, argv: list[str] | None, *, options, worker, measure, render) -> int:
    """The command line of a benchmark that runs its variants in fresh interpreters (``worker(*args)``, called
    with ``--worker args``) and writes its section unless ``--print``. ``measure(args, command)`` returns the raw
    measurements, kept in ``--json`` (``--from-json``: rendered again without measuring) for ``render(raw)``;
    ``options(parser)`` adds the benchmark's own."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--print", dest="print_only", action="store_true", help="print the section, do not write it")
    p.add_argument("--json", default=f"/tmp/{name}.json", help="where the raw measurements are saved")
    p.add_argument("--from-json", action="store_true", help="re-render the section from --json without measuring")
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    options(p)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(*a.worker)))
        return 0
    if a.from_json:
        raw = json.loads(Path(a.json).read_text())
    else:
        raw = measure(a, [x for x in (sys.argv[1:] if argv is None else argv) if x != "--print"])
        Path(a.json).write_text(json.dumps(raw))
    publish(name, render(raw), not a.print_only)
    return 0


def timed_peak(fn, reps: int = 3) -> tuple[float, float]:
    """(median ms, peak GiB above the start) of fn() on the GPU, after a warm-up call, CUDA-synchronised."""
    import torch

    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def gpu_main(section: str, description: str, render, measure) -> int:
    """The command line of the GPU benchmarks: ``--json F`` measures on this machine's GPU (``measure(data, save)``
    adds to the card's description; ``save(data)`` keeps what is measured so far) and prints the section,
    ``--from-json F`` writes the docs/benchmarks.md section from earlier measurements (``--print``: prints it)."""
    import torch

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", help="measure on this machine's GPU and save the measurements here")
    p.add_argument("--from-json", help="write the docs/benchmarks.md section from these measurements")
    p.add_argument("--print", dest="print_only", action="store_true", help="print the section, do not write it")
    args = p.parse_args()
    if args.from_json:
        text = render(json.loads(Path(args.from_json).read_text()))
        print(text) if args.print_only else write_section(section, text)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures the GPU path; --from-json F renders earlier measurements")
        return 1

    def save(data: dict) -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(data, indent=1) + "\n")

    data = {"machine": describe(torch), "date": time.strftime("%Y-%m-%d")}
    measure(data, save)
    print(render(data))
    save(data)
    return 0
