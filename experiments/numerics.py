"""The CPU's numerical code path, pinned before torch loads, and the fingerprint a run record keeps of it.

    numerics.pin()                    # first thing in a process that computes: the emapg CLI does it
    numerics.fingerprint(warm_start)  # what is in effect (loads torch): summary.json["numerics"]

The same float32 computation takes other code paths on other x86-64 CPUs (ATen's and MKL's kernels), and MKL's
results can change from run to run on one machine. `EMAPG_NUMERICS` chooses (MODES): reproducible (the default on
x86-64) pins PINS before torch loads, for the same numbers on any x86-64 CPU with the same library versions and
thread count; native (the default elsewhere) keeps the CPU's own, faster paths. docs/usage.md, "Numbers across
CPUs", has the reasons and the measurements. Worker processes inherit the pins through their environment or get
them passed (`env()`, a Ray cluster's runtime_env); `pin()` where torch is already loaded only checks them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import sys
from importlib.metadata import version
from pathlib import Path

from experiments.errors import UserError

ENV = "EMAPG_NUMERICS"
MODES = ("reproducible", "native")
DEFAULT = "reproducible" if platform.machine().lower() in ("x86_64", "amd64") else "native"
PINS = {
    "ATEN_CPU_CAPABILITY": "avx2",  # ATen's kernels (torch.backends.cpu.get_cpu_capability() says AVX2)
    "MKL_CBWR": "COMPATIBLE",  # MKL's CNR branch identical on Intel and AMD (SSE2, no approximate rcp/rsqrt)
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN (bf16 and convolution kernels): not wider than ATen's
    "MKL_DYNAMIC": "FALSE",  # MKL uses the threads torch.set_num_threads gives it, not fewer (a CNR condition)
}
EXPECTED = {"aten_capability": "AVX2", "mkl_cbwr": "COMPATIBLE"}  # what `fingerprint` must read back, reproducible
MKL_BRANCHES = {0: "OFF", 1: "BRANCH_OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1"}
MKL_BRANCHES.update({8: "SSE4_2", 9: "AVX", 10: "AVX2", 12: "AVX512", 14: "AVX512_E1", 15: "AVX512_E2"})
MKL_STRICT = 0x10000


def mode() -> str:
    """`EMAPG_NUMERICS` (DEFAULT when unset); a value outside MODES is a UserError (exit 2)."""
    value = os.environ.get(ENV, "").strip() or DEFAULT
    if value not in MODES:
        raise UserError(f"{ENV}={value!r} is not a numerics mode; allowed: {', '.join(MODES)}")
    if value == "reproducible" and DEFAULT != "reproducible":
        raise UserError(f"{ENV}=reproducible pins x86-64 code paths; this CPU is {platform.machine()}: use native")
    return value


def pin() -> str:
    """Set this process's pins (PINS in reproducible mode, none in native) in os.environ, for it and its children;
    return the mode. Torch reads them when it loads: once it is loaded, this only checks that they are set and
    raises RuntimeError when one is not (too late to take effect)."""
    chosen = mode()
    want = {ENV: chosen, **(PINS if chosen == "reproducible" else {})}
    late = sorted(f"{k}={v}" for k, v in want.items() if os.environ.get(k) != v and k != ENV)
    if late and "torch" in sys.modules:
        raise RuntimeError(
            f"{ENV}={chosen} needs {' '.join(late)} before torch loads, and torch is loaded: start through the "
            f"emapg command, set them in the environment, or set {ENV}=native"
        )
    os.environ.update(want)
    return chosen


def env() -> dict[str, str]:
    """The numerics variables of this process's environment, for a worker that does not inherit it (a Ray
    cluster's runtime_env): {name: value}."""
    return {k: os.environ[k] for k in (ENV, *PINS) if k in os.environ}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform knows (macOS, Windows)."""
    info = Path("/proc/cpuinfo")
    m = re.search(r"^model name\s*:\s*(.+)$", info.read_text(), re.M) if info.is_file() else None
    return m.group(1).strip() if m else platform.processor() or platform.machine()


def mkl_branch(library: Path) -> str | None:
    """The CNR branch MKL runs, asked from the MKL in `library` (torch's libtorch_cpu.so) itself (e.g. "COMPATIBLE",
    "AUTO,STRICT", "BRANCH_OFF" = CNR off); None where torch has no MKL to ask."""
    try:
        get = ctypes.CDLL(str(library)).mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    value = get(-1)  # MKL_CBWR_ALL: the branch and the STRICT flag
    name = MKL_BRANCHES.get(value & ~MKL_STRICT, str(value & ~MKL_STRICT))
    return name + (",STRICT" if value & MKL_STRICT else "")


def weights_hash(model_dir: str | os.PathLike) -> str:
    """16 hex digits of the sha256 over a Hugging Face directory's *.safetensors files, in name order."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def fingerprint(warm_start: str | os.PathLike | None = None) -> dict:
    """What decides this process's CPU numbers, as in effect now (loads torch), with the weights hash of the
    `warm_start` directory (None: not a warm-started run). In reproducible mode a code path that does not read
    back as pinned raises RuntimeError: the pin did not take effect. docs/run-record.md lists the fields."""
    import torch

    mkl = re.search(r"Math Kernel Library Version ([\w.]+)", torch.__config__.show())
    out = {
        "mode": mode(),
        "cpu": cpu_model(),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": mkl_branch(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
        "threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "versions": {"torch": str(torch.__version__), "transformers": version("transformers"), "mkl": mkl and mkl[1]},
        "warm_start": weights_hash(warm_start) if warm_start else None,
    }
    wrong = {k: out[k] for k, v in EXPECTED.items() if out["mode"] == "reproducible" and out[k] not in (v, None)}
    if wrong:
        raise RuntimeError(f"{ENV}=reproducible, but {wrong} are in effect: torch was loaded before numerics.pin()")
    return out
