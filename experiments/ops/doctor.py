"""emapg doctor: a preflight of one machine (or, with --address, of a Ray cluster) against a run's config.

    emapg doctor experiment=math_deepscaler_ema_pg [hydra overrides ...] [--address HOST:PORT]

It composes the run config as `emapg train` does, works out what the run needs (`Demand`), runs every check of
`CHECKS` and prints one line per result: `FAIL  gpus        what was found  fix: what to do`. PASS: ready; WARN:
it may work, read the line; FAIL: the run cannot work as configured; N/A: the config does not need it here. Exit
status 0 when no check FAILs, 1 otherwise, 2 on bad input. The GPU checks describe this machine: run it on a GPU
node. With --address the GPU count is checked against the cluster's nodes, and the paths and checkpoint checks
also run on every node as Ray tasks (the checkpoint directory must then be shared).

Not checked: Ray's CPU reservations (`emapg train` refuses a cluster too small for them before launch), the
driver, imports and NCCL of nodes other than this one, the environment Ray's workers get (that of `ray start`),
the retriever service, and a staged run's later stages. Each check asks the machine through `Probes`.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.metadata
import netrc
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
import traceback
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from experiments import build
from experiments.backends.verl import VERL_VERSION, attention
from experiments.backends.verl.launch import checkpoint_root, to_verl
from experiments.errors import UserError, classify, is_ray_auth_error, os_reason, ray_auth_line
from experiments.run import agent_loops_path, resolve_run_dir
from experiments.tasks import get_task

STATUSES = ("PASS", "WARN", "FAIL", "N/A")
USAGE = "usage: emapg doctor [experiment=<preset>] [key=value ...] [--address HOST:PORT]"
WANDB_CONNECT_TIMEOUT_S = 3.0  # for the W&B server to accept a TCP connection (logger.mode=online)
PROBE_PREFIX = ".emapg-doctor-"  # of the probe files the checkpoint check writes and deletes
# CUDA major version of torch's build -> the oldest NVIDIA driver branch that runs it (CUDA minor version
# compatibility: https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html)
CUDA_MIN_DRIVER = {11: 450, 12: 525, 13: 580}
TORCH_CUDA_WHEELS = "https://download.pytorch.org/whl/"
# the torch and vLLM that verl 0.9.1's GPU install resolves to (cluster/gpu-install.sh; docs/verl-plugin.md,
# 'Installing on GPUs')
TORCH_VERSION = "2.11.0"
VLLM_VERSION = "0.24.0"
# verl 0.9.1's attn_implementation when the config sets none (verl/workers/config/model.py, HFModelConfig)
VERL_ATTN_DEFAULT = "flash_attention_2"
# the network interfaces NCCL / gloo bind to (a comma list; ^ excludes, = is exact)
SOCKET_IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
VLLM_FIX = f"install verl's vllm stack (vllm=={VLLM_VERSION}): cluster/gpu-install.sh (docs/scaling-out.md)"


# ---------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class Result:
    """One line of the report: PASS/WARN/FAIL/N/A, what was found, and for WARN/FAIL what to do."""

    status: str
    found: str
    fix: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"Result.status={self.status!r}; allowed: {', '.join(STATUSES)}")

    def line(self, check: str) -> str:
        """'FAIL  gpus        found  fix: ...' (the fix only on WARN/FAIL lines)."""
        fix = f"  fix: {self.fix}" if self.fix and self.status in ("WARN", "FAIL") else ""
        return f"{self.status:<4}  {check:<11} {self.found}{fix}"


def exit_code(results: Sequence[Result]) -> int:
    """0 when no result FAILs (WARN and N/A allowed), else 1."""
    return int(any(r.status == "FAIL" for r in results))


# ---------------------------------------------------------------------------------------------- what the run needs
@dataclass(frozen=True)
class Demand:
    """What a composed run config needs from a node (``demand``)."""

    backend: str
    device: str  # trainer.device: cpu | cuda | cuda:N | auto (local); cuda | cpu (verl)
    gpus_per_node: int  # 0: none
    nodes: int = 1
    sizes: str = ""  # the settings behind the GPU demand, e.g. 'trainer.nnodes=1 x trainer.n_gpus_per_node=8'
    rollout: str | None = None  # verl's rollout engine (vllm | sglang | hf); None on the local backend
    gpu_memory_utilization: float | None = None
    attn: str | None = None  # verl's attn_implementation
    attn_why: str = ""  # what chose it
    model: str | None = None  # model.path: a directory, or (verl) an HF id; None = the tiny model, built here
    files: tuple[tuple[str, str], ...] = ()  # (setting, path) of the data and config files the workers read
    checkpoints: str = ""  # the checkpoint directory, absolute
    checkpoint_key: str = "run_dir"  # the setting that moves it
    dtype: str = "float32"  # what the run computes in on its GPUs: float32 | bfloat16 | float64
    dtype_key: str = "trainer.dtype"  # the setting that names it


def demand(cfg) -> Demand:
    """What `cfg` (a composed, validated run config) needs: the local or the verl backend's demand."""
    device = str(cfg.trainer.device)
    if cfg.backend.name != "verl":
        return Demand(
            "local",
            device,
            0 if device in ("cpu", "auto") else int(device.partition(":")[2] or 0) + 1,
            sizes=f"trainer.device={device}",
            model=cfg.model.path,
            checkpoints=os.path.abspath(resolve_run_dir(cfg) / "checkpoints"),
            checkpoint_key="run_dir (checkpoints go to <run_dir>/checkpoints)",
            dtype=str(cfg.trainer.dtype),
        )
    run = OmegaConf.merge(cfg, {"run_dir": str(resolve_run_dir(cfg))}, agent_loops_path(cfg))
    run = OmegaConf.to_container(run, resolve=True)
    # verl's Hydra overrides -> {dotted key: value}, the last one winning
    verl = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(to_verl(run).overrides)}
    # the actor/rollout/ref workers: one placement group of n_gpus_per_node GPUs on each of nnodes nodes
    nodes, per_node = int(verl["trainer.nnodes"]), int(verl["trainer.n_gpus_per_node"])
    vs = run["backend"]["verl"]
    keys = ("train_files", "val_files", "tool_config_path", "agent_loop_config_path")
    attn = str(verl.get("actor_rollout_ref.model.override_config.attn_implementation", VERL_ATTN_DEFAULT))
    chosen, why = attention.choose(vs["attn_implementation"], device)
    return Demand(
        "verl",
        device,
        per_node if device == "cuda" else 0,
        nodes=nodes,
        sizes=f"trainer.nnodes={nodes} x trainer.n_gpus_per_node={per_node}",
        rollout=str(verl.get("actor_rollout_ref.rollout.name")),
        gpu_memory_utilization=verl.get("actor_rollout_ref.rollout.gpu_memory_utilization"),
        attn=attn,
        attn_why=why if attn == chosen else "set by backend.verl.overrides",
        model=run["model"]["path"],
        files=tuple((f"backend.verl.{k}", str(vs[k])) for k in keys if vs.get(k)),
        checkpoints=checkpoint_root(run),  # absolute: launch resolves ~ and a relative path as emapg train will
        checkpoint_key="backend.verl.checkpoint_dir",
        # verl 0.9.1's rollout dtype unless set (verl/trainer/config/rollout/rollout.yaml); its FSDP actor's mixed
        # precision is bf16 too: trainer.dtype is the local backend's only
        dtype=str(verl.get("actor_rollout_ref.rollout.dtype", "bfloat16")),
        dtype_key="verl's actor_rollout_ref.rollout.dtype, bfloat16 unless set",
    )


# ---------------------------------------------------------------------------------------------- the machine
@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    total: int  # bytes
    free: int


def _gpus() -> list[Gpu]:
    """The CUDA devices torch sees, with their memory; [] without any. A CUDA build that cannot use the
    driver raises torch's own reason (e.g. 'The NVIDIA driver on your system is too old')."""
    if not torch.cuda.is_available():
        nvidia = os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")
        if torch.version.cuda is not None and nvidia:
            torch.cuda.init()  # raises the reason is_available() keeps to itself
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        out.append(Gpu(i, torch.cuda.get_device_properties(i).name, int(total), int(free)))
    return out


def matmul(device: str) -> None:
    """Allocate two small tensors on `device`, multiply them there and compare with the CPU's product."""
    a = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    on_device = (a.to(device) @ a.to(device).T).cpu()
    if not torch.equal(on_device, a @ a.T):
        raise RuntimeError(f"a 4x4 matmul on {device} differs from the CPU's")


def all_reduce(world: int, device: str = "cuda", timeout_s: float = 120.0) -> None:
    """Sum a small tensor across `world` spawned processes, one per device (NCCL on cuda, gloo on the cpu, where
    the tests run it); raises unless every rank gets the right sum within `timeout_s` (their start included)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = mp.start_processes(_all_reduce_rank, (world, port, device, timeout_s), world, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not ranks.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer within {timeout_s:g} s")
    except mp.ProcessRaisedException as e:  # its message is the rank's traceback: keep the last line
        raise RuntimeError(str(e).strip().splitlines()[-1]) from None
    finally:
        for p in ranks.processes:
            p.kill()


def _all_reduce_rank(rank: int, world: int, port: int, device: str, timeout_s: float) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        x = torch.full((4,), float(rank + 1), device=f"cuda:{rank}" if device == "cuda" else "cpu")
        dist.all_reduce(x)
        want = world * (world + 1) / 2
        if not bool((x == want).all()):
            raise RuntimeError(f"rank {rank}: the all-reduce summed to {x.tolist()}, not {want:g}")
    finally:
        dist.destroy_process_group()


def _nccl_version() -> str | None:
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))  # (major, minor, patch[, suffix])
    except Exception:  # noqa: BLE001  a CPU build has no NCCL
        return None


def _netrc_has(host: str) -> bool:
    """Whether the netrc file ($NETRC, else ~/.netrc; where `wandb login` writes) has a password for `host`. Only
    its presence is looked at: the key is never returned, printed or sent."""
    try:
        entry = netrc.netrc(os.environ.get("NETRC") or os.path.expanduser("~/.netrc")).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def _param_count(path: str) -> int | None:
    """Parameters of the model at `path` (a directory, or an HF id in this node's cache), counted on the meta
    device from its config.json (no weights read); None where its config is not on this node."""
    import transformers  # heavy: only for this count

    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError):
        return None
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class Probes:
    """Everything the checks ask the machine; tests replace fields (``dataclasses.replace``)."""

    torch_build: Callable[[], tuple[str, str | None]] = lambda: (str(torch.__version__), torch.version.cuda)
    gpus: Callable[[], list[Gpu]] = _gpus
    matmul: Callable[[str], None] = matmul
    all_reduce: Callable[[int], None] = all_reduce  # across this many of this node's GPUs
    # nvidia-smi's stdout; raises FileNotFoundError / CalledProcessError / TimeoutExpired
    nvidia_smi: Callable[[Sequence[str]], str] = lambda args: (
        subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, check=True, timeout=20).stdout
    )
    nccl_version: Callable[[], str | None] = _nccl_version
    import_module: Callable[[str], Any] = importlib.import_module
    dist_version: Callable[[str], str] = importlib.metadata.version  # an installed distribution's version
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ)
    interfaces: Callable[[], list[str]] = lambda: sorted(name for _, name in socket.if_nameindex())
    # bf16 in hardware: torch's emulation on older GPUs is not counted
    bf16_supported: Callable[[], bool] = lambda: torch.cuda.is_bf16_supported(including_emulation=False)
    netrc_has: Callable[[str], bool] = _netrc_has
    # a TCP connection to host:port opened and closed; OSError when nothing accepts it within the timeout (s)
    connect: Callable[[str, int, float], None] = lambda host, port, timeout: socket.create_connection(
        (host, port), timeout=timeout
    ).close()
    disk_free: Callable[[str], int] = lambda path: shutil.disk_usage(path).free  # bytes free where path lies
    param_count: Callable[[str], int | None] = _param_count


# ---------------------------------------------------------------------------------------------- the cluster
@dataclass(frozen=True)
class Node:
    name: str  # its address (with a node id prefix where two share one)
    gpus: float
    id: str = ""  # Ray's node id


@dataclass(frozen=True)
class Context:
    cfg: Any
    demand: Demand
    probes: Probes = field(default_factory=Probes)
    cluster: RayCluster | None = None
    token: str = field(default_factory=lambda: secrets.token_hex(6))  # names this doctor's probe files

    @property
    def gpu_here(self) -> bool:
        """Whether this machine itself must have the GPUs (not so on a Ray head checking a cluster)."""
        return self.demand.gpus_per_node > 0 and self.cluster is None

    @property
    def severity(self) -> str:
        """Of a GPU fault found here: FAIL where this machine runs the GPUs, else WARN."""
        return "FAIL" if self.gpu_here else "WARN"


# ---------------------------------------------------------------------------------------------- checks
def _no_gpu_needed(ctx: Context) -> str:
    d = ctx.demand
    if d.gpus_per_node:
        return "with --address this node need not hold the run's GPUs (the gpus check counts the cluster's)"
    if d.backend == "verl":
        return "trainer.device=cpu: verl's CPU mode, virtual GPUs"
    return f"trainer.device={d.device} needs no GPU"


def check_driver(ctx: Context) -> Result:
    """The NVIDIA driver runs the CUDA version torch was built for (CUDA_MIN_DRIVER)."""
    version, cuda = ctx.probes.torch_build()
    if cuda is None:
        if ctx.gpu_here:
            fix = (
                f"install torch {TORCH_VERSION}'s CUDA build (verl {VERL_VERSION}'s: cluster/gpu-install.sh, or "
                f"{TORCH_CUDA_WHEELS}cu130 for R580+ drivers; docs/scaling-out.md)"
            )
            found = f"torch {version} is a CPU build; the run needs {ctx.demand.gpus_per_node} GPU(s) per node"
            return Result("FAIL", found, fix)
        return Result("N/A", f"torch {version} is a CPU build; {_no_gpu_needed(ctx)}")
    major = int(cuda.split(".")[0])
    need = CUDA_MIN_DRIVER.get(major)
    try:
        drivers = sorted(set(ctx.probes.nvidia_smi(["--query-gpu=driver_version", "--format=csv,noheader"]).split()))
    except (OSError, subprocess.SubprocessError) as e:
        if isinstance(e, FileNotFoundError):
            why = "nvidia-smi not found"
        else:  # nvidia-smi prints its errors on stdout
            said = (getattr(e, "stdout", None) or getattr(e, "stderr", None) or "").strip()
            why = f"nvidia-smi failed: {_first_line(RuntimeError(said) if said else e)}"
        if not ctx.gpu_here:
            return Result("N/A", f"no NVIDIA driver here ({why}); {_no_gpu_needed(ctx)}")
        fix = f"install an NVIDIA driver >= {need or '?'} on this node"
        return Result("FAIL", f"torch {version} (CUDA {cuda}) but no usable NVIDIA driver ({why})", fix)
    if not drivers:
        return Result("FAIL" if ctx.gpu_here else "N/A", "nvidia-smi lists no GPU", "check the GPUs with nvidia-smi")
    if need is None:
        found = f"driver {', '.join(drivers)}; torch {version} is built for CUDA {cuda}, which doctor has no entry for"
        return Result("WARN", found, "check NVIDIA's CUDA compatibility table for that CUDA version")
    found = f"NVIDIA driver {', '.join(drivers)}; torch {version} is built for CUDA {cuda} (needs a driver >= {need})"
    if all(int(d.split(".")[0]) >= need for d in drivers):
        return Result("PASS", found)
    if major == 13:  # torch 2.11.0 has CUDA 12.8 wheels too
        older = f"torch=={TORCH_VERSION} built for an older CUDA ({TORCH_CUDA_WHEELS}cu128)"
    else:
        older = f"a torch built for an older CUDA ({TORCH_CUDA_WHEELS}{'cu118' if major == 12 else ''})"
    return Result(ctx.severity, found, f"upgrade the driver to R{need}+, or install {older}")


def check_cuda(ctx: Context) -> Result:
    """torch.cuda works: a small matmul on every device; bf16 where the run computes in it."""
    version, cuda = ctx.probes.torch_build()
    if cuda is None:
        why = f"torch {version} is a CPU build"
        if ctx.gpu_here:
            return Result("FAIL", f"torch.cuda is unusable: {why}", "see the driver check")
        return Result("N/A", f"{why}; {_no_gpu_needed(ctx)}")
    try:
        gpus = ctx.probes.gpus()
    except Exception as e:  # noqa: BLE001  torch's CUDA initialisation error, in one line
        return Result(ctx.severity, f"torch.cuda fails: {_first_line(e)}", "see the driver check")
    if not gpus:
        if ctx.gpu_here:
            return Result("FAIL", "torch.cuda sees no device", "check CUDA_VISIBLE_DEVICES and nvidia-smi")
        return Result("N/A", f"torch.cuda sees no device; {_no_gpu_needed(ctx)}")
    for g in gpus:
        try:
            ctx.probes.matmul(f"cuda:{g.index}")
        except Exception as e:  # noqa: BLE001  a broken device, an arch torch was not built for, ...
            fix = "check the device with nvidia-smi; a torch build for this GPU's architecture"
            return Result("FAIL", f"cuda:{g.index} ({g.name}): a 4x4 matmul failed: {_first_line(e)}", fix)
    ran = f"a 4x4 matmul ran on each of {len(gpus)} device(s) (cuda:0..{len(gpus) - 1})"
    d = ctx.demand  # dtype: trainer.dtype on the local backend; on verl, its rollout dtype, bf16 unless set
    if d.dtype not in ("bfloat16", "bf16"):
        return Result("PASS", ran)
    if not ctx.probes.bf16_supported():
        found = f"{ran}, but the run computes in {d.dtype} ({d.dtype_key}) and {gpus[0].name} has no bf16"
        fix = "run on a GPU with bf16 (compute capability 8.0+: A100, H100, L40S, RTX 30xx and newer)"
        fix += ", or trainer.dtype=float32" if d.backend == "local" else ""
        return Result(ctx.severity, found, fix)
    return Result("PASS", f"{ran}; bf16 supported (the run computes in {d.dtype}: {d.dtype_key})")


def check_gpus(ctx: Context) -> Result:
    """GPU count (and, for vLLM, free memory) against the run's demand: this node, or every node with --address."""
    d = ctx.demand
    if d.gpus_per_node == 0 and d.device != "auto":
        return Result("N/A", _no_gpu_needed(ctx))
    if ctx.cluster is not None:
        nodes = ctx.cluster.nodes()
        have = ", ".join(f"{n.name}: {n.gpus:g}" for n in nodes) or "no node"
        found = f"GPUs per node: {have}; the run needs {d.nodes} node(s) with {d.gpus_per_node} each [{d.sizes}]"
        if sum(n.gpus >= d.gpus_per_node for n in nodes) >= d.nodes:
            return Result("PASS", found)
        return Result("FAIL", found, "add GPU nodes, or lower backend.verl.nnodes / backend.verl.n_gpus_per_node")
    try:
        gpus = ctx.probes.gpus() if ctx.probes.torch_build()[1] else []
    except Exception as e:  # noqa: BLE001
        return Result("FAIL", f"torch.cuda fails: {_first_line(e)}", "see the driver check")
    if d.device == "auto":
        if not gpus:
            found = "trainer.device=auto and no CUDA device: the run will use the CPU"
            return Result("WARN", found, "trainer.device=cpu to say so, or run on a GPU node")
        return Result("PASS", f"trainer.device=auto runs on cuda:0 ({_describe(gpus[:1])})")
    need = f"the run needs {d.gpus_per_node} per node [{d.sizes}]"
    if len(gpus) < d.gpus_per_node:
        if d.backend == "local":
            fix = "run on a GPU node, or trainer.device=cpu"
        elif gpus:
            fix = f"run on a node with {d.gpus_per_node} GPUs, or backend.verl.n_gpus_per_node={len(gpus)}"
        else:
            fix = "run on a GPU node (verl's loop on CPU: trainer.device=cpu backend.verl.rollout_engine=hf)"
        return Result("FAIL", f"this node has {len(gpus)} CUDA device(s); {need}", fix)
    found = f"{_describe(gpus)}; {need}"
    # vLLM reserves gpu_memory_utilization x total of each GPU at start, and refuses to start with less free
    low = [g for g in gpus[: d.gpus_per_node] if g.free < (d.gpu_memory_utilization or 0) * g.total]
    if d.rollout == "vllm" and low:
        shown = ", ".join(f"cuda:{g.index} {_gib(g.free)} of {_gib(g.total)} GiB free" for g in low)
        found += (
            f"; vLLM reserves gpu_memory_utilization={d.gpu_memory_utilization} of each GPU at start and refuses "
            f"with less free: {shown}"
        )
        fix = "free the GPUs (nvidia-smi lists what holds them), or lower backend.verl.gpu_memory_utilization"
        return Result("WARN", found, fix)
    if d.nodes > 1:
        fix = "pass --address HOST:PORT (the Ray head) to check every node"
        return Result("WARN", f"{found}; checked this node only, the run needs {d.nodes} nodes", fix)
    return Result("PASS", found)


def _describe(gpus: Sequence[Gpu]) -> str:
    names = "/".join(sorted({g.name for g in gpus}))
    total, free = _gib(max(g.total for g in gpus)), _gib(min(g.free for g in gpus))
    return f"{len(gpus)} x {names} ({total} GiB, >= {free} GiB free)"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def check_verl(ctx: Context) -> Result:
    """The verl backend's [verl] extra: verl at the version the plugin is written for."""
    if ctx.demand.backend != "verl":
        return Result("N/A", "backend=local does not use verl")
    try:
        module = ctx.probes.import_module("verl")
    except Exception as e:  # noqa: BLE001  not installed, or broken
        fix = f"cluster/gpu-install.sh on a GPU node, pip install -e '.[verl]' on CPU (verl=={VERL_VERSION}"
        return Result("FAIL", f"verl is not importable: {_first_line(e)}", f"{fix}; docs/scaling-out.md)")
    version = getattr(module, "__version__", "unknown")
    if version != VERL_VERSION:
        found = f"verl {version}; the plugin is written for verl {VERL_VERSION}"
        return Result("FAIL", found, f"pip install verl=={VERL_VERSION}")
    return Result("PASS", f"verl {version}")


def check_rollout(ctx: Context) -> Result:
    """The rollout engine verl uses imports: vLLM at the version verl pins, with its compiled extension, or SGLang."""
    d = ctx.demand
    if d.backend != "verl":
        return Result("N/A", "backend=local generates with Hugging Face")
    if d.rollout not in ("vllm", "sglang"):
        return Result("N/A", f"backend.verl.rollout_engine={d.rollout}: emapg's own engine, nothing to install")
    why = f"backend.verl.rollout_engine={d.rollout}"
    if d.rollout == "sglang":
        return _importable(ctx, "sglang", why, "pip install sglang (the version verl 0.9.1 supports)")
    imported = _importable(ctx, "vllm", why, "install verl's vllm stack: cluster/gpu-install.sh (docs/scaling-out.md)")
    if imported.status == "FAIL":
        return imported
    try:
        version = ctx.probes.dist_version("vllm")
    except Exception as e:  # noqa: BLE001  importable, but not an installed distribution (a stray directory, ...)
        found = f"{why}: vllm imports, but no vllm distribution is installed ({_first_line(e)})"
        return Result("FAIL", found, VLLM_FIX)
    if version.split("+")[0] != VLLM_VERSION:
        found = f"{why}: vllm {version} is installed; verl {VERL_VERSION} needs vllm {VLLM_VERSION}"
        return Result("FAIL", found, VLLM_FIX)
    try:
        ctx.probes.import_module("vllm._C")
    except Exception as e:  # noqa: BLE001  a wheel for another torch or CUDA, or no GPU libraries on this node
        found = f"{why}: vllm {version} imports, but its compiled extension vllm._C does not: {_first_line(e)}"
        return Result(ctx.severity, found, VLLM_FIX)
    return Result("PASS", f"{why}: vllm {version} (verl {VERL_VERSION}'s) imports, and its compiled extension vllm._C")


def check_attention(ctx: Context) -> Result:
    """Which attention verl's actor and reference get, and why; flash-attn or PyTorch's varlen kernel where it needs
    them (verl's default, flash_attention_2, needs flash-attn, which the GPU install leaves out)."""
    d = ctx.demand
    if d.backend != "verl":
        return Result("N/A", "backend=local loads the model with transformers' default attention")
    found = f"attn_implementation={d.attn} ({d.attn_why})"
    if d.attn == "flash_attention_2":
        fix = (
            "a flash-attn built for this torch and CUDA (verl's container image: docs/verl-plugin.md, 'Installing on "
            f"GPUs'), or backend.verl.attn_implementation={attention.NAME} (PyTorch's varlen kernel)"
        )
        return _importable(ctx, "flash_attn", found, fix)
    if d.attn == attention.NAME and d.device == "cuda":
        version, cuda = ctx.probes.torch_build()
        if not cuda:
            return Result("N/A", f"{found}: torch {version} is a CPU build (the driver check)")
        try:
            ctx.probes.import_module("torch.nn.attention.varlen")
        except ImportError:
            slow = f"{found}: torch {version} has no varlen kernel; each sequence runs sdpa on its own (slow)"
            return Result("WARN", slow, f"the GPU install's torch=={TORCH_VERSION} (cluster/gpu-install.sh)")
        return Result("PASS", f"{found}: torch {version}'s varlen kernel on packed batches")
    return Result("N/A", f"{found}: needs no kernel of its own")


def _importable(ctx: Context, module: str, why: str, fix: str) -> Result:
    try:
        m = ctx.probes.import_module(module)
    except Exception as e:  # noqa: BLE001  missing, or built for another torch (undefined symbol, ...)
        return Result("FAIL", f"{why} needs {module}, which does not import: {_first_line(e)}", fix)
    return Result("PASS", f"{why}: {module} {getattr(m, '__version__', '(no version)')} imports")


def check_nccl(ctx: Context) -> Result:
    """NCCL's settings (NCCL_*, the socket interfaces) and, with 2+ GPUs here, an all-reduce across them."""
    d = ctx.demand
    if d.backend != "verl" or d.gpus_per_node == 0:
        return Result("N/A", "no NCCL: " + ("one process" if d.backend == "local" else "verl on CPU talks over gloo"))
    env = ctx.probes.environ
    shown_vars = sorted(k for k in env if k.startswith("NCCL_") or k in SOCKET_IFNAME_VARS)
    settings = ", ".join(f"{k}={env[k]}" for k in shown_vars) or "no NCCL_* variable set (NCCL's defaults)"
    version = ctx.probes.nccl_version()
    if version is None and ctx.gpu_here:
        found = f"this torch has no NCCL, which verl's ranks talk over; {settings}"
        return Result("FAIL", found, "see the driver check")
    found = f"NCCL {version or '(not in this torch)'}; {settings}"
    problems = nccl_problems(env, ctx.probes.interfaces(), d.nodes)
    fixes = [f for _, f in problems]
    try:
        ranks = min(len(ctx.probes.gpus()), d.gpus_per_node) if version else 0
    except Exception:  # noqa: BLE001  torch.cuda does not initialise: the cuda check says why
        ranks = 0
    if ranks > 1:
        across = f"an all-reduce across cuda:0..{ranks - 1}"
        try:
            ctx.probes.all_reduce(ranks)
        except Exception as e:  # noqa: BLE001  a rank's error, or a hang that ran into the timeout
            fix = "; ".join(["NCCL_DEBUG=INFO shows why; check the GPU links (`nvidia-smi topo -m`)", *fixes])
            return Result("FAIL", f"{found}; {across} failed: {_first_line(e)}", fix)
        found += f"; {across} summed right"
    if problems:
        return Result("WARN", f"{found}; {'; '.join(p for p, _ in problems)}", "; ".join(fixes))
    return Result("PASS", found)


def nccl_problems(env: Mapping[str, str], interfaces: Sequence[str], nodes: int) -> list[tuple[str, str]]:
    """(what, fix) for each NCCL setting that is likely a mistake here: an interface list that matches none of
    this node's interfaces; P2P disabled on one node; InfiniBand disabled across nodes."""
    out = []
    for var in (v for v in SOCKET_IFNAME_VARS if env.get(v) and not interface_matches(env[v], interfaces)):
        what = f"{var}={env[var]} matches none of this node's interfaces ({', '.join(interfaces)})"
        out.append((what, f"set {var} to this node's network interface, or unset it"))
    if env.get("NCCL_P2P_DISABLE", "0") not in ("0", "") and nodes == 1:
        what = "NCCL_P2P_DISABLE is set on a one-node run: GPU-to-GPU traffic goes through host memory"
        out.append((what, "unset NCCL_P2P_DISABLE unless it works around a P2P hang on this machine"))
    if env.get("NCCL_IB_DISABLE", "0") not in ("0", "") and nodes > 1:
        what = f"NCCL_IB_DISABLE is set on a {nodes}-node run: traffic between nodes goes over TCP sockets"
        out.append((what, "unset NCCL_IB_DISABLE if the nodes have InfiniBand/RoCE"))
    return out


def interface_matches(spec: str, interfaces: Sequence[str]) -> bool:
    """Whether NCCL's interface list `spec` selects one of `interfaces`: comma-separated prefixes, '=' for exact
    names; a '^' list excludes, so it always leaves some (NCCL's NCCL_SOCKET_IFNAME syntax)."""
    if spec.startswith("^"):
        return True
    exact = spec.startswith("=")
    names = [n.strip() for n in spec.lstrip("=").split(",") if n.strip()]
    return any(i == n if exact else i.startswith(n) for n in names for i in interfaces)


def check_paths(ctx: Context) -> list[Result]:
    """model.path and the data files are readable here (and, with --address, on every node)."""
    d = ctx.demand
    items = ([("model.path", d.model)] if d.model else []) + list(d.files)
    if not items:
        return [Result("N/A", "no model or data files: the tiny model and the task's problems are built here")]
    return [readable(items)] + (_on_each_node(ctx.cluster, readable, items) if ctx.cluster is not None else [])


def _on_each_node(cluster: RayCluster, fn: Callable[..., Result], *args) -> list[Result]:
    """One line per node, sorted by name: what `fn(*args)` found there, or why the node did not answer."""
    out = []
    for node, r in sorted(cluster.on_each_node(fn, *args).items()):
        if isinstance(r, BaseException):
            fix = "install emapg at the same path on every node, and check the node with `ray status`"
            r = Result("FAIL", f"no answer: {_first_line(r)}", fix)
        out.append(Result(r.status, f"node {node}: {r.found}", r.fix))
    return out


HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def readable(items: Sequence[tuple[str, str]]) -> Result:
    """Whether each (setting, path) is readable: FAIL when one is missing or unreadable, WARN for an HF id to
    download. It also runs as a Ray task on each node."""
    ok, bad, remote = 0, [], []
    for key, path in items:
        local = os.path.expanduser(path)
        if key == "model.path" and not os.path.exists(local) and HF_ID.match(path):
            try:
                from huggingface_hub import try_to_load_from_cache

                cached = isinstance(try_to_load_from_cache(path, "config.json"), str)
            except Exception:  # noqa: BLE001  no huggingface_hub, or a bad id
                cached = False
            if cached:
                ok += 1
            elif os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
                bad.append(f"{key}={path} an HF id, not in this node's HF cache, and HF_HUB_OFFLINE is set")
            else:
                where = "not in this node's HF cache: each worker downloads it from the hub"
                remote.append(f"{key}={path} is an HF id, {where}")
            continue
        try:
            if os.path.isdir(local):
                os.listdir(local)
            else:
                with open(local, "rb") as f:
                    f.read(1)
            ok += 1
        except FileNotFoundError:
            bad.append(f"{key}={path} does not exist")
        except OSError as e:
            bad.append(f"{key}={path} {e.strerror or e}")
    found = f"{ok} of {len(items)} readable"
    if bad:
        fix = "fix the paths (`emapg data prepare` writes the data files; model.path is a local directory or an HF id)"
        return Result("FAIL", "; ".join([found, *bad, *remote]), f"{fix}, on storage every node reads")
    if remote:
        fix = "download it once where every node reads it (`hf download <id>` with a shared HF_HOME)"
        return Result("WARN", f"{found}; " + "; ".join(remote), f"{fix}, or set model.path to a local copy")
    return Result("PASS", f"{found}: " + ", ".join(f"{k}={p}" for k, p in items))


def check_task(ctx: Context) -> Result:
    """The task's problems load here as emapg train loads them: its optional dependencies, its data."""
    name = ctx.cfg.task.name
    try:
        module = get_task(name)
        if ctx.demand.backend == "verl":  # verl's workers read the prepared files (the paths check)
            return Result("PASS", f"task={name}: {module.__name__} imports; verl reads its prepared files (paths)")
        build.task(OmegaConf.merge(ctx.cfg, {"task": {"train_size": 1, "test_size": 1}}))
    except Exception as e:  # noqa: BLE001  only what `emapg train` reports as a user error (exit 2) is judged here
        kind = classify(e)
        if kind is None or kind[1] != 2:
            raise
        why = _first_line(e)
        found = f"task={name}: its problems do not load here, so `emapg train` stops (exit 2): {why}"
        missing = isinstance(e, ImportError) and e.name is None  # the task's own hint, e.g. pip install -e '.[tiny]'
        return Result("FAIL", found, why if missing else "fix what it names (task.knobs, the task's data)")
    return Result("PASS", f"task={name}: its problems load here (one per split, as `emapg train` loads them)")


# A verl checkpoint per parameter: the actor's fp32 weights and AdamW's two fp32 moments (verl's FSDP engine trains
# in fp32 unless model_dtype is set), and the EMA anchor's fp32 shards (the reference, fp32 in launch.py) when tau < 1
ACTOR_BYTES, ANCHOR_BYTES = 12, 4


def checkpoint_need(ctx: Context) -> tuple[int, str] | None:
    """Bytes a verl run's checkpoints hold at their peak (a new one is written before the oldest goes), and how
    that was counted; None on the local backend or where the model's config is not on this node."""
    d, cfg = ctx.demand, ctx.cfg
    params = ctx.probes.param_count(d.model) if d.backend == "verl" and d.model else None
    if not params:
        return None
    per = ACTOR_BYTES + (ANCHOR_BYTES if cfg.algo.anchor.tau < 1.0 else 0)
    n = int(cfg.trainer.keep_checkpoints) + 1
    return n * per * params, f"{n} checkpoints x {params / 1e9:.2f}B parameters x {per} bytes"


def check_checkpoint(ctx: Context) -> list[Result]:
    """The checkpoint directory is writable here, with room there for the run's checkpoints (with --address: on
    every node, shared). Writable: a probe file written, read back, deleted; shared: each node sees a file
    written here; room: `checkpoint_need`, a WARN below it."""
    d = ctx.demand
    where = existing_parent(d.checkpoints)
    try:
        found = f"{d.checkpoints}: {writable(d.checkpoints, ctx.token)}"
    except OSError as e:
        return [Result("FAIL", f"{d.checkpoints}: {os_reason(e)}", f"make it writable, or set {d.checkpoint_key}")]
    free, need = ctx.probes.disk_free(where), checkpoint_need(ctx)
    found += f"; {_gib(free)} GiB free there"
    if need is None:
        here = [Result("PASS", found)]
    elif free < need[0]:
        fix = f"free space there, lower trainer.keep_checkpoints, or set {d.checkpoint_key} to a larger disk"
        here = [Result("WARN", f"{found}, under the {_gib(need[0])} GiB its checkpoints take ({need[1]})", fix)]
    else:
        here = [Result("PASS", f"{found}, for {_gib(need[0])} GiB of checkpoints ({need[1]})")]
    if ctx.cluster is None:
        return here
    probe = os.path.join(where, f"{PROBE_PREFIX}{ctx.token}")
    try:
        _write(probe, ctx.token)  # kept until every node has looked
        return here + _on_each_node(ctx.cluster, node_checkpoint, d.checkpoints, probe, ctx.token, d.checkpoint_key)
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)


def existing_parent(path: str) -> str:
    """Absolute `path`, or its nearest ancestor that exists (the directory a run would create it in)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    return p


def writable(path: str, token: str) -> str:
    """Write, read back and delete a probe file in `path` (or its nearest existing ancestor, where the run would
    create it); what was done, or OSError."""
    where = existing_parent(path)
    if not os.path.isdir(where):
        raise NotADirectoryError(errno.ENOTDIR, f"{where} is a file, not a directory", where)
    probe = os.path.join(where, f"{PROBE_PREFIX}{token}-{socket.gethostname()}")
    try:
        _write(probe, token)
        with open(probe, encoding="utf-8") as f:
            if f.read() != token:
                raise OSError(errno.EIO, f"{probe} read back differently")
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)
    made = f" in {where}, its nearest existing directory" if where != os.path.abspath(path) else ""
    return f"writable (a probe file written, read back and deleted{made})"


def node_checkpoint(path: str, probe: str, token: str, key: str) -> Result:
    """On a node (a Ray task): whether it sees `probe` with `token` (the directory is shared) and can write in
    `path`; `key` is the setting that moves it."""
    fix = f"put {key} on storage every node mounts at the same path (every rank writes its shards there)"
    try:
        with open(probe, encoding="utf-8") as f:
            seen = f.read() == token
    except OSError as e:
        return Result("FAIL", f"does not see {probe}, written on the driver's node ({os_reason(e)}): not shared", fix)
    if not seen:
        return Result("FAIL", f"sees {probe} with other content: not the same directory", fix)
    try:
        return Result("PASS", f"sees the probe file written on the driver's node (shared); {writable(path, token)}")
    except OSError as e:
        return Result("FAIL", f"sees the probe file, but cannot write there: {os_reason(e)}", fix)


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def check_wandb(ctx: Context) -> Result:
    """W&B's mode and whether wandb imports; online: an API key present (never read out) and the server answering."""
    cfg, env = ctx.cfg, ctx.probes.environ
    if cfg.logger.name == "none":
        return Result("N/A", "logger=none: no W&B run")
    source = "WANDB_MODE" if env.get("WANDB_MODE") else "logger.mode"  # the variable wins
    raw = env.get("WANDB_MODE") or cfg.logger.mode
    mode = {"dryrun": "offline", "run": "online"}.get(raw, raw)
    if mode not in ("online", "offline", "disabled"):
        return Result("FAIL", f"W&B mode {raw!r} from {source}", "allowed: online, offline, disabled")
    if mode == "disabled":
        return Result("PASS", f"disabled ({source}={raw}): nothing is logged to W&B")
    try:
        module = ctx.probes.import_module("wandb")
    except Exception as e:  # noqa: BLE001
        found = f"{mode} ({source}) but wandb does not import: {_first_line(e)}"
        return Result("FAIL", found, "pip install wandb, or logger=none")
    found = f"{mode} ({source}={raw}), wandb {getattr(module, '__version__', '?')}"
    if mode == "offline":
        return Result("PASS", f"{found}: runs are written under the run directory; `wandb sync` uploads them later")
    url = urllib.parse.urlsplit(env.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    host, port = url.hostname or "", url.port or (80 if url.scheme == "http" else 443)
    key, problems = "", []
    if env.get("WANDB_API_KEY"):
        key = "WANDB_API_KEY is set"
    elif host and ctx.probes.netrc_has(host):
        key = f"a netrc entry for {host}"
    else:
        problems.append(f"no W&B API key here (no WANDB_API_KEY, no netrc entry for {host})")
    try:
        ctx.probes.connect(host, port, WANDB_CONNECT_TIMEOUT_S)
    except OSError as e:
        problems.append(f"{host}:{port} does not answer ({e.strerror or _first_line(e)})")
    logs = "on verl, verl's TaskRunner logs, from its node"
    if not problems:
        return Result("PASS", f"{found}: {key} and {host}:{port} answers; runs are uploaded as the run goes ({logs})")
    fix = (
        f"`wandb login` (or WANDB_API_KEY) and a route to {host}:{port} where the run logs ({logs}), "
        f"or {source}=offline and `wandb sync` the run later"
    )
    return Result("WARN", f"{found}: {'; '.join(problems)}: offline logging works, online will fail", fix)


CHECKS: dict[str, Callable[[Context], Result | list[Result]]] = {
    "driver": check_driver,
    "cuda": check_cuda,
    "gpus": check_gpus,
    "verl": check_verl,
    "rollout": check_rollout,
    "attention": check_attention,
    "nccl": check_nccl,
    "paths": check_paths,
    "task": check_task,
    "checkpoint": check_checkpoint,
    "wandb": check_wandb,
}
"""Every check, in the order of the report; the first line of each one's docstring is its `--help` line."""


def run_checks(ctx: Context, checks: Mapping[str, Callable] = CHECKS) -> list[tuple[str, Result]]:
    """(check name, result) for every check; a check that raises is a FAIL naming the exception (a bug here, or
    an answer of the machine nobody expected), and the other checks still run."""
    out = []
    for name, fn in checks.items():
        try:
            got = fn(ctx)
        except Exception as e:  # noqa: BLE001
            if os.environ.get("EMAPG_DEBUG"):
                traceback.print_exc()
            got = Result("FAIL", f"the check raised {type(e).__name__}: {_first_line(e)}", "EMAPG_DEBUG=1 shows where")
        out += [(name, r) for r in (got if isinstance(got, list) else [got])]
    return out


def _first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type when it has none), at most 300 characters."""
    line = (str(e).strip() or type(e).__name__).splitlines()[0]
    return line if len(line) <= 300 else line[:297] + "..."


# ---------------------------------------------------------------------------------------------- Ray (--address)
class RayCluster:
    """What --address gives the checks (tests fake it): the alive nodes of the Ray cluster this process joined
    (``connect``), and {node name: fn(*args) run on that node, or the exception it raised there}."""

    def __init__(self, timeout_s: float = 60.0):
        import ray  # also loads ray.util.scheduling_strategies

        self.ray, self.timeout_s = ray, timeout_s

    def nodes(self) -> list[Node]:
        nodes = [n for n in self.ray.nodes() if n.get("Alive")]
        ips = [n["NodeManagerAddress"] for n in nodes]
        shown = [ip if ips.count(ip) == 1 else f"{ip} ({n['NodeID'][:8]})" for n, ip in zip(nodes, ips)]
        return [Node(name, float(n["Resources"].get("GPU", 0)), n["NodeID"]) for n, name in zip(nodes, shown)]

    def on_each_node(self, fn: Callable, *args) -> dict[str, Any]:
        task = self.ray.remote(num_cpus=0, max_retries=0)(fn)
        pin = self.ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy
        refs = {n.name: task.options(scheduling_strategy=pin(n.id, soft=False)).remote(*args) for n in self.nodes()}
        ready, _ = self.ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.timeout_s)
        out: dict[str, Any] = {}
        for name, ref in refs.items():
            if ref not in ready:
                self.ray.cancel(ref, force=True)
                out[name] = TimeoutError(f"no answer within {self.timeout_s:g} s")
                continue
            try:
                out[name] = self.ray.get(ref)
            except Exception as e:  # noqa: BLE001  the task failed there (e.g. emapg not importable)
                out[name] = getattr(e, "cause", None) or e
        return out


def parse_address(address: str) -> tuple[str, int]:
    """HOST:PORT -> (host, port), or UserError naming --address."""
    host, sep, port = address.rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise UserError(f"--address={address!r}: expected HOST:PORT, the Ray head's GCS address (e.g. 10.0.0.1:6379)")
    return host.strip("[]"), int(port)


def answers(host: str, port: int, flag: str) -> None:
    """UserError naming `flag` unless something accepts a TCP connection at host:port within 5 s (a Ray head that
    is not there would otherwise be waited for, for minutes)."""
    try:
        socket.create_connection((host, port), timeout=5.0).close()
    except OSError as e:
        raise UserError(
            f"{flag}: nothing answers there ({e.strerror or e}); expected the Ray head's GCS address "
            "(`ray status` on the head shows it)"
        ) from None


def connect(address: str) -> RayCluster:
    """Join the Ray cluster at `address` (HOST:PORT) as a driver; UserError when nothing answers there."""
    answers(*parse_address(address), f"--address={address}")
    cluster = RayCluster()
    try:
        cluster.ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except Exception as e:  # noqa: BLE001  e.g. another Ray version on the head
        if is_ray_auth_error(e):
            raise UserError(ray_auth_line(f"--address={address}", "driver")) from None
        raise UserError(f"--address={address}: cannot join the Ray cluster there: {_first_line(e)}") from None
    return cluster


# ---------------------------------------------------------------------------------------------- the command
def parse_argv(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """(Hydra overrides, --address or None); UserError on anything else."""
    overrides, address, rest = [], None, list(argv)
    while rest:
        a = rest.pop(0)
        if a == "--address" and rest:
            address = rest.pop(0)
        elif a.startswith("--address="):
            address = a.split("=", 1)[1]
        elif a.startswith("-") or "=" not in a:
            raise UserError(
                f"emapg doctor takes Hydra overrides key=value and --address HOST:PORT; got {a!r} ({USAGE})"
            )
        else:
            overrides.append(a)
    if address is not None:
        parse_address(address)
    return overrides, address


def main(argv: Sequence[str], probes: Probes | None = None, cluster: RayCluster | None = None) -> int:
    """`emapg doctor`: compose and validate the config, run every check, print one line each; the exit status."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.split("\n\n")[0])
        print(f"\n{USAGE}\n\nchecks (one line each; --address adds a line per node to paths and checkpoint):")
        for name, fn in CHECKS.items():
            print(f"  {name:<11} {fn.__doc__.splitlines()[0]}")
        print("\nexit status: 0 when no check FAILs, 1 otherwise, 2 for bad input")
        return 0
    overrides, address = parse_argv(argv)
    cfg = build.compose(overrides)
    build.validate(cfg)
    d = demand(cfg)
    if address and cluster is None:
        cluster = connect(address)
    need = f"{d.gpus_per_node} GPU(s) per node [{d.sizes}]" if d.gpus_per_node else "no GPU"
    need += f" x {d.nodes} nodes" if d.nodes > 1 else ""
    where = f"the Ray cluster at {address}" if address else f"this machine ({socket.gethostname()})"
    print(f"emapg doctor: experiment={cfg.experiment} backend={d.backend} needs {need}; checking {where}", flush=True)
    results = run_checks(Context(cfg, d, probes or Probes(), cluster))
    for name, r in results:
        print(r.line(name), flush=True)
    counts = ", ".join(f"{sum(r.status == s for _, r in results)} {s}" for s in STATUSES)
    print(f"{len(results)} lines: {counts}", flush=True)
    return exit_code([r for _, r in results])
