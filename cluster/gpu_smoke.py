"""``make gpu-smoke``: the first thing to run on a new GPU cluster, on one of its GPUs (docs/scaling-out.md).

    python -m cluster.gpu_smoke [--out outputs/gpu-smoke]

Three stages, each a process of its own whose output goes to a log under --out, each run whatever the ones before
it gave: ``make test-gpu`` (tests/run_gpu.py), ``emapg doctor`` of the rehearsal's own config (its tiny model and
data, made here first; one GPU, vLLM) and ``emapg rehearse --device cuda experiment=math_deepscaler_ema_pg`` (verl's
loop on the GPU, killed after step 2, resumed, checked). Then a verdict, one line per stage: passed or FAILED, its
seconds, its log. Exit status 0 when every stage passed, 1 otherwise; 2, in one line and before anything runs,
without a CUDA device.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

from experiments.ops.rehearse import Shared, no_cuda, rehearsal_target, run_name

ROOT = Path(__file__).resolve().parents[1]
TARGET = ["experiment=math_deepscaler_ema_pg"]
STEPS = 3  # emapg rehearse's default


def stages(out: Path) -> list[tuple[str, str, list[str]]]:
    """(log name, what runs, its command) of each stage. The doctor checks what the rehearsal will run: the same
    overrides, and the tiny model and data in the `_shared` folder the rehearsal then reuses."""
    rehearsals = out / "rehearsals"
    shared = Shared(rehearsals / "_shared", "cuda")
    try:
        config = rehearsal_target(TARGET, rehearsals / run_name(TARGET), shared, STEPS, device="cuda")
    finally:
        shared.close()
    emapg = [sys.executable, "-m", "experiments.cli"]
    rehearse = ["rehearse", "--device", "cuda", *TARGET]
    return [
        ("test-gpu", "make test-gpu", [sys.executable, str(ROOT / "tests" / "run_gpu.py")]),
        ("doctor", "emapg doctor (the rehearsal's config)", [*emapg, "doctor", *config]),
        ("rehearse", f"emapg {' '.join(rehearse)}", [*emapg, *rehearse, "--out", str(rehearsals)]),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.gpu_smoke", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("outputs/gpu-smoke"), help="where the logs and the run go")
    args = p.parse_args(argv)
    if why := no_cuda():
        print(
            f"gpu-smoke: error: needs a CUDA device: {why}; on CPU run `make test-verl` and "
            f"`emapg rehearse {' '.join(TARGET)}` instead",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    print("gpu-smoke: the rehearsal's tiny model and data (seconds of SFT on the CPU) ...", flush=True)
    results = []  # (passed, seconds, what, log)
    for name, what, cmd in stages(args.out):
        log = args.out / f"{name}.log"
        print(f"gpu-smoke: {what} ... (log: {log})", flush=True)
        t0 = time.time()
        with open(log, "w") as f:
            ok = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode == 0
        results.append((ok, time.time() - t0, what, log))
    width = max(len(what) for _, _, what, _ in results)
    print(f"\ngpu-smoke on {torch.cuda.get_device_name(0)}:")
    for ok, seconds, what, log in results:
        print(f"  {'passed' if ok else 'FAILED'} {seconds:>5.0f} s  {what:<{width}}  log: {log}")
    failed = sum(not ok for ok, *_ in results)
    print(f"gpu-smoke: {f'FAILED ({failed} of {len(results)} stages)' if failed else 'passed'}")
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main())
