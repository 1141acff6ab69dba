"""`emapg doctor` (experiments/ops/doctor.py): every check's PASS and FAIL (and WARN / N/A) paths, each against
fakes of what it asks the machine (``Probes``: nvidia-smi, torch.cuda, imports, environment, interfaces) or
of the cluster (a fake ``RayCluster`` whose nodes run the real node functions, one with a disk of its own); one
test joins a real local Ray on 127.0.0.1; the command end to end on this (CPU-only) machine.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.metadata
import os
import shutil
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

from experiments import build, errors
from experiments.backends.verl import attention
from experiments.cli import main as cli_main
from experiments.ops import doctor
from experiments.ops.doctor import Context, Demand, Gpu, Node, Probes, Result

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(scope="module")
def cfgs():
    """Composed configs: the default local run, and the paper's math preset on verl (8 GPUs, vLLM)."""
    flash = ["experiment=math_deepscaler_ema_pg", "backend.verl.attn_implementation=flash_attention_2"]
    return {
        "local": build.compose([]),
        "verl": build.compose(["experiment=math_deepscaler_ema_pg"]),
        "verl_flash": build.compose(flash),  # the presets compose emapg_varlen here; flash-attn when asked for
    }


@pytest.fixture(autouse=True)
def _no_flash_attn(monkeypatch):
    """Demands as the GPU install (no flash-attn) computes them, on any machine."""
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: False)


def gpus(n: int, free: float = 79.0, total: float = 80.0) -> list[Gpu]:
    return [Gpu(i, H100, int(total * GIB), int(free * GIB)) for i in range(n)]


def fake_probes(
    cuda: str | None = "13.0",
    drivers: str | Exception = "580.159.04\n",
    devices: list[Gpu] | Exception = (),
    matmul=None,
    modules: dict | None = None,
    env: dict | None = None,
    interfaces=("lo", "eth0"),
    nccl: str | None = "2.27.3",
    dists: dict | None = None,
    disk_free=lambda path: 100 * GIB,
    bf16: bool = True,
    netrc=(),
    connect=None,
    all_reduce=None,
    params: int | None = None,
) -> Probes:
    """Probes answering as a machine with these properties (nothing real is asked). `modules`: {name: version or
    the exception its import raises}; a submodule (vllm._C) imports when its package does, unless named there.
    `dists`: {distribution: version} (default: the versions of `modules`)."""
    modules = modules or {}

    def nvidia_smi(args):
        if isinstance(drivers, Exception):
            raise drivers
        return drivers

    def gpu_list():
        if isinstance(devices, Exception):
            raise devices
        return list(devices)

    def import_module(name):
        package = name.rpartition(".")[0]
        if name not in modules and isinstance(modules.get(package), str):
            return types.SimpleNamespace()
        found = modules.get(name)
        if found is None or isinstance(found, Exception):
            raise found or ModuleNotFoundError(f"No module named {name!r}")
        return types.SimpleNamespace(__version__=found)

    versions = {k: v for k, v in modules.items() if isinstance(v, str)} if dists is None else dists

    def dist_version(name):
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    return Probes(
        torch_build=lambda: ("2.11.0" + (f"+cu{cuda.replace('.', '')}" if cuda else "+cpu"), cuda),
        gpus=gpu_list,
        matmul=matmul or (lambda device: None),
        nvidia_smi=nvidia_smi,
        nccl_version=lambda: nccl,
        import_module=import_module,
        dist_version=dist_version,
        environ=env or {},
        interfaces=lambda: list(interfaces),
        disk_free=disk_free,
        bf16_supported=lambda: bf16,
        netrc_has=lambda host: host in netrc,
        connect=connect or (lambda host, port, timeout: None),  # everything answers, nothing is asked
        all_reduce=all_reduce or (lambda ranks: None),  # sums right
        param_count=lambda path: params,  # None: the model's config is not on this node
    )


def ctx(cfg, d: Demand | None = None, cluster=None, **probe_kwargs) -> Context:
    return Context(cfg, d or doctor.demand(cfg), fake_probes(**probe_kwargs), cluster)


# ---------------------------------------------------------------------------------------------- demand
def test_demand_of_the_local_and_verl_configs(cfgs):
    local = doctor.demand(cfgs["local"])
    assert (local.backend, local.device, local.gpus_per_node, local.model, local.files) == ("local", "cpu", 0, None, ())
    assert local.checkpoints.endswith("/checkpoints") and os.path.isabs(local.checkpoints)
    assert doctor.demand(build.compose(["trainer.device=cuda:1"])).gpus_per_node == 2  # cuda:1 needs two devices
    v = doctor.demand(cfgs["verl"])
    assert (v.gpus_per_node, v.nodes, v.rollout, v.attn) == (8, 1, "vllm", "emapg_varlen")
    assert doctor.demand(cfgs["verl_flash"]).attn == "flash_attention_2"
    assert v.sizes == "trainer.nnodes=1 x trainer.n_gpus_per_node=8"  # verl's actor/rollout/ref worker pool
    assert v.gpu_memory_utilization == 0.85 and v.model == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    assert dict(v.files) == {
        "backend.verl.train_files": "~/data/emapg/math/train.parquet",
        "backend.verl.val_files": "~/data/emapg/math/val.parquet",
    }
    # launch.checkpoint_root's answer (verl's checkpoints/<project>/<name>, or <run_dir>/checkpoints), made absolute
    assert os.path.isabs(v.checkpoints) and "/math__math_deepscaler_ema_pg__s0__" in v.checkpoints
    assert v.checkpoint_key == "backend.verl.checkpoint_dir"
    two = doctor.demand(
        build.compose(["experiment=math_deepscaler_ema_pg", "backend.verl.nnodes=2", "backend.verl.n_gpus_per_node=4"])
    )
    assert (two.nodes, two.gpus_per_node) == (2, 4)
    cpu = doctor.demand(
        build.compose(["experiment=math_deepscaler_ema_pg", "trainer.device=cpu", "backend.verl.rollout_engine=hf"])
    )
    assert (cpu.gpus_per_node, cpu.rollout, cpu.attn) == (0, "hf", "eager")  # verl's CPU mode: virtual GPUs
    search = doctor.demand(build.compose(["experiment=search_r1_ema_pg"]))
    loops = dict(search.files)["backend.verl.agent_loop_config_path"]
    assert os.path.isabs(loops) and os.path.isfile(loops)  # made absolute, as `emapg train` does


def test_raw_verl_overrides_win(cfgs):
    cfg = build.compose(
        [
            "experiment=math_deepscaler_ema_pg",
            "backend.verl.overrides=['+actor_rollout_ref.model.override_config.attn_implementation=sdpa']",
        ]
    )
    assert doctor.demand(cfg).attn == "sdpa"
    line = doctor.check_attention(ctx(cfg))
    assert (line.status, line.found) == (
        "N/A",
        "attn_implementation=sdpa (set by backend.verl.overrides): needs no kernel of its own",
    )


# ---------------------------------------------------------------------------------------------- driver
@pytest.mark.parametrize(
    "cuda, drivers, status, words",
    [
        ("13.0", "580.159.04\n580.159.04\n", "PASS", ["driver 580.159.04", "CUDA 13.0", ">= 580"]),
        ("13.0", "570.124.06\n", "FAIL", ["570.124.06", ">= 580"]),
        ("12.8", "570.124.06\n", "PASS", ["CUDA 12.8", ">= 525"]),
        ("12.8", "470.82.01\n", "FAIL", ["470.82.01", ">= 525"]),
        ("14.0", "600.1\n", "WARN", ["CUDA 14.0", "no entry"]),
        ("13.0", FileNotFoundError(2, "No such file", "nvidia-smi"), "FAIL", ["nvidia-smi not found"]),
        (
            "13.0",
            subprocess.CalledProcessError(9, "nvidia-smi", output="NVIDIA-SMI has failed because it couldn't talk\n"),
            "FAIL",
            ["nvidia-smi failed: NVIDIA-SMI has failed because it couldn't talk"],
        ),
        (None, "580.159.04\n", "FAIL", ["CPU build", "8 GPU(s) per node"]),
    ],
)
def test_driver_against_the_torch_build(cfgs, cuda, drivers, status, words):
    r = doctor.check_driver(ctx(cfgs["verl"], cuda=cuda, drivers=drivers))
    assert r.status == status and all(w in r.found for w in words), r
    if status == "FAIL":
        assert r.fix


def test_driver_fix_names_the_driver_branch(cfgs):
    r = doctor.check_driver(ctx(cfgs["verl"], cuda="13.0", drivers="570.124.06\n"))
    assert "R580+" in r.fix and "cu128" in r.fix and f"torch=={doctor.TORCH_VERSION}" in r.fix
    cpu = doctor.check_driver(ctx(cfgs["verl"], cuda=None))  # verl's pinned torch, not whatever pip picks
    assert cpu.status == "FAIL" and "torch 2.11.0's CUDA build" in cpu.fix and "cluster/gpu-install.sh" in cpu.fix
    assert doctor.TORCH_VERSION == "2.11.0"  # verl 0.9.1's (docs/verl-plugin.md, 'Installing on GPUs')


def test_driver_is_na_where_no_gpu_is_needed(cfgs):
    assert doctor.check_driver(ctx(cfgs["local"], cuda=None)).status == "N/A"  # this machine: CPU torch, no GPU
    missing = FileNotFoundError(2, "No such file", "nvidia-smi")
    assert doctor.check_driver(ctx(cfgs["local"], cuda="13.0", drivers=missing)).status == "N/A"
    # an old driver on a node that does not itself need the GPUs (a Ray head, --address): a warning only
    old = doctor.check_driver(ctx(cfgs["verl"], cluster=FakeCluster({}), cuda="13.0", drivers="570.1\n"))
    assert old.status == "WARN"


# ---------------------------------------------------------------------------------------------- cuda
def test_cuda_passes_when_every_device_multiplies(cfgs):
    seen = []
    r = doctor.check_cuda(ctx(cfgs["verl"], devices=gpus(2), matmul=seen.append))
    assert r.status == "PASS" and seen == ["cuda:0", "cuda:1"] and "2 device(s)" in r.found


def test_cuda_fails_on_a_broken_device_or_initialisation(cfgs):
    def broken(device):
        if device == "cuda:1":
            raise RuntimeError("CUDA error: no kernel image is available for execution on the device\nmore")

    r = doctor.check_cuda(ctx(cfgs["verl"], devices=gpus(2), matmul=broken))
    assert r.status == "FAIL" and "cuda:1" in r.found and "no kernel image" in r.found and "more" not in r.found
    too_old = RuntimeError("The NVIDIA driver on your system is too old (found version 12020).")
    r = doctor.check_cuda(ctx(cfgs["verl"], devices=too_old))
    assert r.status == "FAIL" and "too old" in r.found
    assert doctor.check_cuda(ctx(cfgs["verl"], devices=[])).status == "FAIL"  # needs 8, sees none
    assert doctor.check_cuda(ctx(cfgs["verl"], cuda=None)).status == "FAIL"
    assert doctor.check_cuda(ctx(cfgs["local"], cuda=None)).status == "N/A"
    assert doctor.check_cuda(ctx(cfgs["local"], devices=[])).status == "N/A"


def test_cuda_in_bf16_where_the_run_trains_in_it(cfgs):
    """The GPU presets compute in bf16 (verl's rollout dtype unless set; trainer.dtype on the local backend): a
    GPU without it (a V100, a T4) runs the fp32 matmul and fails the run."""
    assert doctor.demand(cfgs["verl"]).dtype == "bfloat16" and doctor.demand(cfgs["local"]).dtype == "float32"
    ok = doctor.check_cuda(ctx(cfgs["verl"], devices=gpus(2)))
    assert ok.status == "PASS" and "bf16 supported" in ok.found and "rollout.dtype" in ok.found
    v100 = [Gpu(i, "Tesla V100-SXM2-32GB", 32 * GIB, 31 * GIB) for i in range(8)]
    old = doctor.check_cuda(ctx(cfgs["verl"], devices=v100, bf16=False))
    assert old.status == "FAIL" and "computes in bfloat16" in old.found and "Tesla V100" in old.found, old
    assert "compute capability 8.0+" in old.fix and "trainer.dtype" not in old.fix  # verl ignores trainer.dtype
    fp32 = build.compose(
        ["experiment=math_deepscaler_ema_pg", "backend.verl.overrides=['actor_rollout_ref.rollout.dtype=float32']"]
    )
    assert doctor.demand(fp32).dtype == "float32"
    r = doctor.check_cuda(ctx(fp32, devices=v100, bf16=False))
    assert r.status == "PASS" and "bf16" not in r.found  # fp32 only: today's line
    local = build.compose(["trainer.device=cuda", "trainer.dtype=bfloat16"])
    r = doctor.check_cuda(ctx(local, devices=v100[:1], bf16=False))
    assert r.status == "FAIL" and "trainer.dtype" in r.found and "trainer.dtype=float32" in r.fix
    assert doctor.check_cuda(ctx(build.compose(["trainer.device=cuda"]), devices=v100[:1], bf16=False)).status == "PASS"
    head = doctor.check_cuda(ctx(cfgs["verl"], cluster=FakeCluster({}), devices=v100[:1], bf16=False))
    assert head.status == "WARN"  # a Ray head checking a cluster does not train here


def test_the_real_matmul_runs_on_the_cpu():
    doctor.matmul("cpu")  # the code the cuda check runs on each device, here on the one device this machine has
    with pytest.raises(Exception):  # noqa: B017  a device that is not there (CPU torch: AssertionError)
        doctor.matmul("cuda:99")


# ---------------------------------------------------------------------------------------------- gpus
def test_gpu_count_against_the_verl_demand(cfgs):
    ok = doctor.check_gpus(ctx(cfgs["verl"], devices=gpus(8)))
    assert ok.status == "PASS" and f"8 x {H100}" in ok.found and "trainer.n_gpus_per_node=8" in ok.found
    few = doctor.check_gpus(ctx(cfgs["verl"], devices=gpus(4)))
    assert few.status == "FAIL" and "4 CUDA device(s)" in few.found and "backend.verl.n_gpus_per_node=4" in few.fix
    none = doctor.check_gpus(ctx(cfgs["verl"], cuda=None))
    assert none.status == "FAIL" and "trainer.device=cpu" in none.fix and "0 CUDA device(s)" in none.found


def test_gpu_memory_against_vllm_utilization(cfgs):
    busy = gpus(8)
    busy[3] = Gpu(3, H100, 80 * GIB, 40 * GIB)  # 0.85 x 80 GiB = 68 GiB must be free
    r = doctor.check_gpus(ctx(cfgs["verl"], devices=busy))
    assert r.status == "WARN" and "cuda:3 40.0 of 80.0 GiB free" in r.found and "gpu_memory_utilization" in r.fix
    hf = dataclasses.replace(doctor.demand(cfgs["verl"]), rollout="sglang")  # only vLLM's rule is known here
    assert doctor.check_gpus(ctx(cfgs["verl"], hf, devices=busy)).status == "PASS"


def test_gpus_of_several_nodes(cfgs):
    two = dataclasses.replace(doctor.demand(cfgs["verl"]), nodes=2)
    alone = doctor.check_gpus(ctx(cfgs["verl"], two, devices=gpus(8)))
    assert alone.status == "WARN" and "--address" in alone.fix  # this node is fine; the others are unknown
    fits = FakeCluster({"10.0.0.1": None, "10.0.0.2": None}, gpus={"10.0.0.1": 8, "10.0.0.2": 8})
    assert doctor.check_gpus(ctx(cfgs["verl"], two, cluster=fits, cuda=None)).status == "PASS"
    short = FakeCluster({"10.0.0.1": None, "10.0.0.2": None}, gpus={"10.0.0.1": 8, "10.0.0.2": 4})
    r = doctor.check_gpus(ctx(cfgs["verl"], two, cluster=short, cuda=None))
    assert r.status == "FAIL" and "10.0.0.2: 4" in r.found and "backend.verl.nnodes" in r.fix


def test_gpus_of_the_local_backend():
    cuda1 = build.compose(["trainer.device=cuda:1"])
    assert doctor.check_gpus(ctx(cuda1, devices=gpus(2))).status == "PASS"
    r = doctor.check_gpus(ctx(cuda1, devices=gpus(1)))
    assert r.status == "FAIL" and "trainer.device=cpu" in r.fix
    auto = build.compose(["trainer.device=auto"])
    assert doctor.check_gpus(ctx(auto, cuda=None)).status == "WARN"  # auto, and it will be the CPU
    assert doctor.check_gpus(ctx(auto, devices=gpus(1))).status == "PASS"
    assert doctor.check_gpus(ctx(build.compose([]), cuda=None)).status == "N/A"


# ---------------------------------------------------------------------------------------------- imports
def test_verl_rollout_engine_and_attention_imports(cfgs):
    good = {"verl": "0.9.1", "vllm": "0.24.0", "flash_attn": "2.8.3"}
    c = ctx(cfgs["verl_flash"], modules=good)
    assert [f(c).status for f in (doctor.check_verl, doctor.check_rollout, doctor.check_attention)] == ["PASS"] * 3
    c = ctx(cfgs["verl_flash"], modules={"verl": "0.8.0", "vllm": ImportError("undefined symbol: _ZN3c10")})
    verl, vllm, flash = doctor.check_verl(c), doctor.check_rollout(c), doctor.check_attention(c)
    assert verl.status == "FAIL" and "verl 0.8.0" in verl.found and "verl==0.9.1" in verl.fix
    assert vllm.status == "FAIL" and "undefined symbol" in vllm.found and "vllm" in vllm.fix
    assert flash.status == "FAIL" and "flash_attention_2 (set by" in flash.found and "flash-attn" in flash.fix
    assert doctor.check_verl(ctx(cfgs["verl"])).status == "FAIL"  # not installed
    local = ctx(cfgs["local"])
    assert {f(local).status for f in (doctor.check_verl, doctor.check_rollout, doctor.check_attention)} == {"N/A"}
    cpu = build.compose(["experiment=math_deepscaler_ema_pg", "trainer.device=cpu", "backend.verl.rollout_engine=hf"])
    eager = doctor.check_attention(ctx(cpu))
    assert doctor.check_rollout(ctx(cpu)).status == "N/A" and eager.status == "N/A"
    assert (
        eager.found
        == "attn_implementation=eager (backend.verl.attn_implementation=null on CPU): needs no kernel of its own"
    )


def test_the_attention_a_gpu_preset_gets_without_flash_attn(cfgs):
    """The presets (attn_implementation null) on the GPU install: PyTorch's varlen kernel, or a WARN (correct but
    slow) on a torch without it."""
    why = "attn_implementation=emapg_varlen (backend.verl.attn_implementation=null on CUDA without flash-attn)"
    ok = doctor.check_attention(ctx(cfgs["verl"], modules={"torch.nn.attention.varlen": "x"}))
    assert ok.status == "PASS" and ok.found.startswith(why) and "varlen kernel on packed batches" in ok.found
    old = doctor.check_attention(ctx(cfgs["verl"]))
    assert old.status == "WARN" and "has no varlen kernel" in old.found and "torch==2.11.0" in old.fix
    cpu_build = doctor.check_attention(ctx(cfgs["verl"], cuda=None))  # the driver check FAILs it
    assert cpu_build.status == "N/A" and cpu_build.found.endswith("torch 2.11.0+cpu is a CPU build (the driver check)")


def test_vllm_at_verl_s_version_with_its_compiled_extension(cfgs):
    """`import vllm` loads no compiled code: a stub or another release imports; verl 0.9.1 needs vllm 0.24.0."""
    ok = doctor.check_rollout(ctx(cfgs["verl"], modules={"vllm": "0.24.0"}))
    assert ok.status == "PASS" and "vllm 0.24.0 (verl 0.9.1's)" in ok.found and "vllm._C" in ok.found
    assert doctor.VLLM_VERSION == "0.24.0"  # cluster/gpu-install.sh, docs/verl-plugin.md
    local = doctor.check_rollout(ctx(cfgs["verl"], modules={"vllm": "0.24.0"}, dists={"vllm": "0.24.0+cu130"}))
    assert local.status == "PASS"  # a local version label is the same release
    for version in ("0.1.0-wrong", "0.12.0", "0.24.1"):
        wrong = doctor.check_rollout(ctx(cfgs["verl"], modules={"vllm": version}))
        assert wrong.status == "FAIL" and f"vllm {version} is installed" in wrong.found, wrong
        assert "verl 0.9.1 needs vllm 0.24.0" in wrong.found and "cluster/gpu-install.sh" in wrong.fix
        assert "vllm==0.24.0" in wrong.fix
    stray = doctor.check_rollout(ctx(cfgs["verl"], modules={"vllm": "0.24.0"}, dists={}))
    assert stray.status == "FAIL" and "no vllm distribution" in stray.found
    no_ext = {"vllm": "0.24.0", "vllm._C": ImportError("libcudart.so.13: cannot open shared object file")}
    broken = doctor.check_rollout(ctx(cfgs["verl"], modules=no_ext))
    assert broken.status == "FAIL" and "vllm._C does not" in broken.found and "libcudart" in broken.found
    assert "cluster/gpu-install.sh" in broken.fix and "docs/scaling-out.md" in broken.fix
    head = doctor.check_rollout(ctx(cfgs["verl"], cluster=FakeCluster({}), modules=no_ext))
    assert head.status == "WARN"  # a Ray head checking a cluster need not run vLLM's kernels itself
    sglang = dataclasses.replace(doctor.demand(cfgs["verl"]), rollout="sglang")
    assert doctor.check_rollout(ctx(cfgs["verl"], sglang, modules={"sglang": "0.5.0"})).status == "PASS"


# ---------------------------------------------------------------------------------------------- nccl
def test_nccl_environment(cfgs):
    plain = doctor.check_nccl(ctx(cfgs["verl"]))
    assert plain.status == "PASS" and "NCCL 2.27.3" in plain.found and "no NCCL_* variable" in plain.found
    env = {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "PATH": "/bin"}
    set_ok = doctor.check_nccl(ctx(cfgs["verl"], env=env))
    assert set_ok.status == "PASS" and "NCCL_DEBUG=INFO" in set_ok.found and "PATH" not in set_ok.found
    wrong = doctor.check_nccl(ctx(cfgs["verl"], env={"NCCL_SOCKET_IFNAME": "ib9", "NCCL_P2P_DISABLE": "1"}))
    assert wrong.status == "WARN" and "ib9 matches none" in wrong.found and "lo, eth0" in wrong.found
    assert "NCCL_P2P_DISABLE" in wrong.found and "unset NCCL_P2P_DISABLE" in wrong.fix
    assert doctor.check_nccl(ctx(cfgs["verl"], nccl=None)).status == "FAIL"  # a CPU torch on a GPU run
    assert doctor.check_nccl(ctx(cfgs["local"])).status == "N/A"


def test_nccl_all_reduce_across_the_gpus_here(cfgs):
    """With 2+ GPUs here the nccl check runs one all-reduce across them (verl's ranks talk over NCCL): PASS only if
    it sums right; a failed or hung all-reduce is a FAIL with a fix."""
    calls = []
    ok = doctor.check_nccl(ctx(cfgs["verl"], devices=gpus(8), all_reduce=calls.append))
    assert ok.status == "PASS" and calls == [8] and "an all-reduce across cuda:0..7 summed right" in ok.found

    def hangs(ranks):
        raise TimeoutError("no answer within 120 s")

    bad = doctor.check_nccl(ctx(cfgs["verl"], devices=gpus(8), all_reduce=hangs))
    assert bad.status == "FAIL" and "all-reduce across cuda:0..7 failed: no answer within 120 s" in bad.found
    assert "NCCL_DEBUG=INFO" in bad.fix
    env = {"NCCL_SOCKET_IFNAME": "ib9"}  # the settings' fixes come with it
    assert (
        "set NCCL_SOCKET_IFNAME" in doctor.check_nccl(ctx(cfgs["verl"], devices=gpus(8), all_reduce=hangs, env=env)).fix
    )
    calls.clear()
    one = build.compose(["experiment=math_deepscaler_ema_pg", "backend.verl.n_gpus_per_node=1"])
    assert doctor.check_nccl(ctx(one, devices=gpus(8), all_reduce=calls.append)).status == "PASS" and calls == []
    assert doctor.check_nccl(ctx(cfgs["verl"], devices=gpus(1), all_reduce=calls.append)).status == "PASS"
    assert (
        doctor.check_nccl(ctx(cfgs["verl"], cuda=None, nccl=None, devices=gpus(8), all_reduce=hangs)).status == "FAIL"
    )
    assert calls == [] and doctor.check_nccl(ctx(cfgs["local"], devices=gpus(8), all_reduce=hangs)).status == "N/A"


def test_the_real_all_reduce_on_the_cpu():
    """The code the nccl check runs across the GPUs (spawned ranks, a sum), here over gloo on the CPU."""
    doctor.all_reduce(2, "cpu", timeout_s=120)
    beyond = __import__("torch").cuda.device_count() + 1  # one rank more than this machine has CUDA devices
    with pytest.raises(RuntimeError) as failed:  # a rank that raises: its error, in one line
        doctor.all_reduce(max(beyond, 2), "cuda", timeout_s=120)
    assert "\n" not in str(failed.value) and "Traceback" not in str(failed.value)


def test_nccl_problems_and_interface_syntax():
    assert doctor.nccl_problems({"NCCL_IB_DISABLE": "1"}, ["eth0"], nodes=2)[0][0].startswith("NCCL_IB_DISABLE")
    assert doctor.nccl_problems({"NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "0"}, ["eth0"], nodes=1) == []
    assert doctor.nccl_problems({"GLOO_SOCKET_IFNAME": "enp"}, ["lo", "enp5s0"], nodes=1) == []
    assert doctor.interface_matches("eth", ["eth0"]) and doctor.interface_matches("ib0,eth1", ["eth1"])
    assert doctor.interface_matches("=eth0", ["eth0"]) and not doctor.interface_matches("=eth", ["eth0"])
    assert doctor.interface_matches("^docker,lo", ["lo"]) and not doctor.interface_matches("ib", ["lo", "eth0"])


# ---------------------------------------------------------------------------------------------- paths
@pytest.fixture
def data(tmp_path):
    """A model directory and two data files under tmp_path/shared."""
    shared = tmp_path / "shared"
    (shared / "model").mkdir(parents=True)
    (shared / "model" / "config.json").write_text("{}")
    for name in ("train", "val"):
        (shared / f"{name}.parquet").write_bytes(b"PAR1")
    return shared


def with_files(cfg, shared: Path, **changes) -> Demand:
    return dataclasses.replace(
        doctor.demand(cfg),
        model=str(shared / "model"),
        files=(
            ("backend.verl.train_files", str(shared / "train.parquet")),
            ("backend.verl.val_files", str(shared / "val.parquet")),
        ),
        **changes,
    )


def test_paths_readable_or_not(cfgs, data, monkeypatch):
    d = with_files(cfgs["verl"], data)
    (ok,) = doctor.check_paths(ctx(cfgs["verl"], d))
    assert ok.status == "PASS" and "3 of 3 readable" in ok.found
    (data / "val.parquet").unlink()
    real_open = open

    def deny(path, *a, **k):
        if str(path).endswith("train.parquet"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(doctor, "open", deny, raising=False)  # root reads everything: deny one file here
    (bad,) = doctor.check_paths(ctx(cfgs["verl"], d))
    assert bad.status == "FAIL" and "1 of 3 readable" in bad.found
    assert "val.parquet does not exist" in bad.found and "train.parquet Permission denied" in bad.found
    assert "emapg data prepare" in bad.fix
    assert doctor.check_paths(ctx(cfgs["local"]))[0].status == "N/A"  # the tiny model, generated problems


def test_an_hf_id_is_looked_up_in_the_cache(cfgs, monkeypatch):
    import huggingface_hub

    d = dataclasses.replace(doctor.demand(cfgs["verl"]), files=())
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: None)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    (remote,) = doctor.check_paths(ctx(cfgs["verl"], d))
    assert remote.status == "WARN" and "each worker downloads it" in remote.found and "hf download" in remote.fix
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert doctor.check_paths(ctx(cfgs["verl"], d))[0].status == "FAIL"
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: f"/cache/{repo}/config.json")
    assert doctor.check_paths(ctx(cfgs["verl"], d))[0].status == "PASS"


class FakeCluster:
    """Nodes that run the real node functions in this process: `nodes` maps a name to None (same disk as the
    driver), a directory (its own disk: every path under the driver's `root` is read there instead), or an
    exception (the node does not answer)."""

    def __init__(self, nodes: dict, gpus: dict | None = None, root: Path | None = None):
        self.nodes_, self.gpus, self.root = nodes, gpus or {}, root

    def nodes(self) -> list[Node]:
        return [Node(name, self.gpus.get(name, 0)) for name in self.nodes_]

    def on_each_node(self, fn, *args):
        out = {}
        for name, how in self.nodes_.items():
            if isinstance(how, BaseException):
                out[name] = how
            else:
                out[name] = fn(*(self._moved(a, how) for a in args))
        return out

    def _moved(self, value, disk):
        if disk is None:
            return value
        if isinstance(value, str):
            return value.replace(str(self.root), str(disk))
        if isinstance(value, (list, tuple)):
            return type(value)(self._moved(v, disk) for v in value)
        return value


def test_paths_on_every_node(cfgs, data, tmp_path):
    other = tmp_path / "node_b_disk"
    other.mkdir()
    cluster = FakeCluster(
        {"10.0.0.1": None, "10.0.0.2": other, "10.0.0.3": ModuleNotFoundError("No module named 'experiments'")},
        root=data,
    )
    results = doctor.check_paths(ctx(cfgs["verl"], with_files(cfgs["verl"], data), cluster=cluster))
    assert [r.status for r in results] == ["PASS", "PASS", "FAIL", "FAIL"]  # here, then one line per node
    assert results[1].found.startswith("node 10.0.0.1: 3 of 3 readable")
    assert results[2].found.startswith("node 10.0.0.2: 0 of 3 readable") and "does not exist" in results[2].found
    assert "no answer" in results[3].found and "experiments" in results[3].found and "every node" in results[3].fix


# ---------------------------------------------------------------------------------------------- task
def test_a_task_dependency_missing_fails_as_train_stops(cfgs, monkeypatch):
    """math_tiny without reasoning-gym: `emapg train` stops with exit 2 on the task's own hint; doctor FAILs on it,
    with that hint as the fix (the same build.task call, one problem per split)."""
    ok = doctor.check_task(ctx(cfgs["local"]))
    assert ok.status == "PASS" and "task=math_tiny: its problems load here" in ok.found
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` fails, as when not installed
    with pytest.raises(ImportError) as train:
        build.task(cfgs["local"])
    assert errors.classify(train.value) == (f"error: {train.value}", 2)  # what `emapg train` prints, exit 2
    r = doctor.check_task(ctx(cfgs["local"]))
    assert r.status == "FAIL" and "exit 2" in r.found and "reasoning-gym" in r.found
    assert r.fix == str(train.value) and "pip install -e '.[tiny]'" in r.fix
    assert doctor.check_task(ctx(cfgs["verl"])).status == "PASS"  # verl reads the prepared files (the paths check)


def test_a_task_without_its_data_fails(tmp_path):
    cfg = build.compose(["task=math", f"+task.knobs.data_dir={tmp_path}"])
    r = doctor.check_task(ctx(cfg))
    assert r.status == "FAIL" and "train.parquet not found" in r.found and "emapg data prepare" in r.found
    assert "task's data" in r.fix


# ---------------------------------------------------------------------------------------------- checkpoint
def leftovers(path: Path) -> list[str]:
    return [p.name for p in path.rglob(f"{doctor.PROBE_PREFIX}*")]


def test_checkpoint_dir_writable(cfgs, tmp_path):
    d = dataclasses.replace(doctor.demand(cfgs["local"]), checkpoints=str(tmp_path / "runs" / "x" / "checkpoints"))
    (r,) = doctor.check_checkpoint(ctx(cfgs["local"], d))
    assert (
        r.status == "PASS" and f"in {tmp_path}, its nearest existing directory" in r.found and leftovers(tmp_path) == []
    )
    assert not (tmp_path / "runs").exists()  # nothing created
    asked = []
    (r,) = doctor.check_checkpoint(ctx(cfgs["local"], d, disk_free=lambda p: asked.append(p) or int(12.5 * GIB)))
    assert r.status == "PASS" and r.found.endswith("; 12.5 GiB free there") and asked == [str(tmp_path)]
    real = doctor.Probes().disk_free(str(tmp_path))  # the real probe (others write to this disk meanwhile)
    assert abs(real - shutil.disk_usage(tmp_path).free) < GIB
    (tmp_path / "file").write_text("x")
    under_file = dataclasses.replace(d, checkpoints=str(tmp_path / "file" / "checkpoints"))
    (r,) = doctor.check_checkpoint(ctx(cfgs["local"], under_file))
    assert r.status == "FAIL" and "is a file, not a directory" in r.found and "run_dir" in r.fix


def test_a_relative_checkpoint_dir_is_the_driver_s_working_directory(tmp_path, monkeypatch):
    """verl's ranks join a relative backend.verl.checkpoint_dir to their working directory, the driver's (a local
    Ray's workers inherit it): the line names that absolute path, where the free space is measured."""
    monkeypatch.chdir(tmp_path)
    cfg = build.compose(["experiment=math_deepscaler_ema_pg", "backend.verl.checkpoint_dir=ckpt/run1"])
    d = doctor.demand(cfg)
    assert d.checkpoints == str(tmp_path / "ckpt" / "run1")
    asked = []
    (r,) = doctor.check_checkpoint(ctx(cfg, d, disk_free=lambda p: asked.append(p) or 7 * GIB))
    assert r.status == "PASS" and r.found.startswith(f"{tmp_path}/ckpt/run1: writable") and asked == [str(tmp_path)]
    assert r.found.endswith("; 7.0 GiB free there")


def test_checkpoint_room_against_the_run_s_checkpoints(cfgs, tmp_path):
    """verl: (keep_checkpoints + 1) x parameters x (12 bytes for the fp32 actor and AdamW, + 4 for the EMA
    anchor): WARN with less free; the GRPO baseline saves no anchor; no estimate without the model's config."""
    d = dataclasses.replace(doctor.demand(cfgs["verl"]), checkpoints=str(tmp_path))
    assert cfgs["verl"].trainer.keep_checkpoints == 2 and cfgs["verl"].algo.anchor.tau < 1
    need = 3 * 16 * 10**9  # 44.7 GiB for 1B parameters
    (r,) = doctor.check_checkpoint(ctx(cfgs["verl"], d, params=10**9, disk_free=lambda p: need - 1))
    assert (
        r.status == "WARN"
        and "under the 44.7 GiB its checkpoints take (3 checkpoints x 1.00B parameters x 16" in r.found
    )
    assert "trainer.keep_checkpoints" in r.fix and "backend.verl.checkpoint_dir" in r.fix
    (r,) = doctor.check_checkpoint(ctx(cfgs["verl"], d, params=10**9, disk_free=lambda p: need))
    assert r.status == "PASS" and r.found.endswith(
        "44.7 GiB free there, for 44.7 GiB of checkpoints (3 checkpoints x 1.00B parameters x 16 bytes)"
    )
    grpo = build.compose(["experiment=math_deepscaler_grpo"])
    (r,) = doctor.check_checkpoint(ctx(grpo, d, params=10**9, disk_free=lambda p: need))
    assert r.status == "PASS" and "x 12 bytes" in r.found
    (r,) = doctor.check_checkpoint(ctx(cfgs["verl"], d, params=None, disk_free=lambda p: 1))
    assert r.status == "PASS" and r.found.endswith("0.0 GiB free there")
    local = dataclasses.replace(doctor.demand(cfgs["local"]), checkpoints=str(tmp_path))
    (r,) = doctor.check_checkpoint(ctx(cfgs["local"], local, params=10**9, disk_free=lambda p: 1))
    assert r.status == "PASS"  # the local backend is not estimated


def test_param_count_reads_a_config_on_the_meta_device(tmp_path):
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    config.save_pretrained(tmp_path)  # config.json only: no weights
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert doctor._param_count(str(tmp_path)) == sum(p.numel() for p in model.parameters())
    assert doctor._param_count(str(tmp_path / "nope")) is None
    assert doctor._param_count("no-such-org/no-such-model-for-emapg") is None


def test_a_read_only_checkpoint_dir_fails(cfgs, tmp_path, monkeypatch):
    def read_only(path, text):
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(doctor, "_write", read_only)  # root writes everywhere: the file system says no here
    d = dataclasses.replace(doctor.demand(cfgs["verl"]), checkpoints=str(tmp_path))
    (r,) = doctor.check_checkpoint(ctx(cfgs["verl"], d))
    assert r.status == "FAIL" and "Read-only file system" in r.found and "backend.verl.checkpoint_dir" in r.fix


def test_checkpoint_dir_shared_by_every_node(cfgs, tmp_path):
    shared, other = tmp_path / "ckpt", tmp_path / "node_b_disk"
    shared.mkdir()
    other.mkdir()
    cluster = FakeCluster(
        {"10.0.0.1": None, "10.0.0.2": other, "10.0.0.3": TimeoutError("no answer within 60 s")}, root=shared
    )
    d = dataclasses.replace(doctor.demand(cfgs["verl"]), checkpoints=str(shared))
    results = doctor.check_checkpoint(ctx(cfgs["verl"], d, cluster=cluster))
    assert [r.status for r in results] == ["PASS", "PASS", "FAIL", "FAIL"]
    assert "node 10.0.0.1: sees the probe file" in results[1].found and "(shared)" in results[1].found
    assert "not shared" in results[2].found and "every node mounts" in results[2].fix
    assert "no answer within 60 s" in results[3].found
    assert leftovers(tmp_path) == []  # the driver's probe is removed after the nodes looked


def test_node_checkpoint_reads_the_token(tmp_path):
    probe = tmp_path / f"{doctor.PROBE_PREFIX}abc"
    probe.write_text("abc")
    r = doctor.node_checkpoint(str(tmp_path), str(probe), "abc", "run_dir")
    assert r.status == "PASS" and "(shared)" in r.found and "writable" in r.found
    probe.write_text("another doctor's")  # same name, another file: not the directory the driver wrote in
    r = doctor.node_checkpoint(str(tmp_path), str(probe), "abc", "run_dir")
    assert r.status == "FAIL" and "other content" in r.found and "put run_dir on storage" in r.fix


# ---------------------------------------------------------------------------------------------- wandb
def test_wandb_mode(cfgs):
    r = doctor.check_wandb(ctx(cfgs["local"], modules={"wandb": "0.31.0"}, env={"WANDB_API_KEY": "s3cret-key"}))
    assert r.status == "PASS" and r.found.startswith("offline (logger.mode=offline)") and "s3cret" not in r.found
    online = doctor.check_wandb(ctx(cfgs["local"], modules={"wandb": "0.31.0"}, env={"WANDB_MODE": "online"}))
    assert online.status == "WARN" and "online (WANDB_MODE=online)" in online.found and "wandb login" in online.fix
    bad = doctor.check_wandb(ctx(cfgs["local"], modules={"wandb": "0.31.0"}, env={"WANDB_MODE": "loud"}))
    assert bad.status == "FAIL" and "'loud' from WANDB_MODE" in bad.found and "offline" in bad.fix
    missing = doctor.check_wandb(ctx(cfgs["local"]))
    assert missing.status == "FAIL" and "wandb does not import" in missing.found
    assert doctor.check_wandb(ctx(cfgs["local"], env={"WANDB_MODE": "disabled"})).status == "PASS"  # no import
    assert doctor.check_wandb(ctx(build.compose(["logger=none"]))).status == "N/A"


def test_wandb_online_needs_a_key_and_the_server(cfgs):
    """Online: PASS only with an API key present (WANDB_API_KEY or a netrc entry; never shown) and W&B's server
    accepting a TCP connection; else WARN, offline being the way that works."""
    online = build.compose(["logger.mode=online"])
    calls = []

    def answers(host, port, timeout):
        calls.append((host, port, timeout))

    def refused(host, port, timeout):
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")

    def check(env=None, **kw):
        return doctor.check_wandb(ctx(online, env=env or {}, **{"modules": {"wandb": "0.31.0"}, **kw}))

    key = {"WANDB_API_KEY": "s3cret-key"}
    ok = check(key, connect=answers)
    assert ok.status == "PASS" and "online (logger.mode=online)" in ok.found and "WANDB_API_KEY is set" in ok.found
    assert "api.wandb.ai:443 answers" in ok.found and "s3cret" not in ok.found + ok.fix
    assert calls == [("api.wandb.ai", 443, doctor.WANDB_CONNECT_TIMEOUT_S)]
    via_netrc = check(connect=answers, netrc={"api.wandb.ai"})
    assert via_netrc.status == "PASS" and "a netrc entry for api.wandb.ai" in via_netrc.found
    no_key = check(connect=answers)
    assert no_key.status == "WARN" and "no W&B API key here" in no_key.found and "online will fail" in no_key.found
    assert "wandb login" in no_key.fix and "logger.mode=offline" in no_key.fix
    down = check(key, connect=refused)
    assert down.status == "WARN" and "api.wandb.ai:443 does not answer (Connection refused)" in down.found
    assert "no W&B API key" not in down.found
    both = check({"WANDB_MODE": "online"}, connect=refused)
    assert both.status == "WARN" and "no W&B API key" in both.found and "does not answer" in both.found
    assert "WANDB_MODE=offline" in both.fix  # the variable wins over logger.mode
    calls.clear()
    own = check({**key, "WANDB_BASE_URL": "http://wandb.internal:8080"}, connect=answers)
    assert own.status == "PASS" and calls == [("wandb.internal", 8080, doctor.WANDB_CONNECT_TIMEOUT_S)]
    assert check(key, connect=refused, modules={}).status == "FAIL"  # wandb does not import: as before


def test_the_real_netrc_and_connect_probes(tmp_path, monkeypatch):
    rc = tmp_path / "netrc"
    rc.write_text("machine api.wandb.ai\n  login user\n  password s3cret\n")
    rc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(rc))
    assert doctor.Probes().netrc_has("api.wandb.ai") and not doctor.Probes().netrc_has("wandb.internal")
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    assert not doctor.Probes().netrc_has("api.wandb.ai")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    doctor.Probes().connect("127.0.0.1", port, 2.0)
    server.close()
    with pytest.raises(OSError):
        doctor.Probes().connect("127.0.0.1", port, 2.0)


# ---------------------------------------------------------------------------------------------- the report
def test_a_check_that_raises_is_one_fail_and_the_rest_still_run(cfgs):
    def broken(ctx):
        raise KeyError("surprise")

    checks = {"first": broken, "second": lambda ctx: Result("PASS", "fine")}
    out = doctor.run_checks(ctx(cfgs["local"]), checks)
    assert [(n, r.status) for n, r in out] == [("first", "FAIL"), ("second", "PASS")]
    assert "KeyError" in out[0][1].found
    assert doctor.exit_code([r for _, r in out]) == 1
    assert doctor.exit_code([Result("PASS", ""), Result("WARN", ""), Result("N/A", "")]) == 0
    with pytest.raises(ValueError, match="allowed: PASS, WARN, FAIL, N/A"):
        Result("OK", "")
    assert Result("PASS", "x", "never shown").line("gpus") == "PASS  gpus        x"
    assert Result("WARN", "x", "do y").line("gpus") == "WARN  gpus        x  fix: do y"


def test_the_command_with_fakes_and_a_fake_cluster(cfgs, data, tmp_path, capsys):
    argv = [
        "experiment=math_deepscaler_ema_pg",
        "backend.verl.attn_implementation=flash_attention_2",
        f"model.path={data / 'model'}",
        f"backend.verl.train_files={data / 'train.parquet'}",
        f"backend.verl.val_files={data / 'val.parquet'}",
        f"backend.verl.checkpoint_dir={data / 'ckpt'}",
        "--address",
        "10.0.0.1:6379",
    ]
    good = {"verl": "0.9.1", "vllm": "0.24.0", "flash_attn": "2.8.3", "wandb": "0.31.0"}
    cluster = FakeCluster({"10.0.0.1": None}, gpus={"10.0.0.1": 8})
    code = doctor.main(argv, fake_probes(devices=gpus(8), modules=good), cluster)
    out = capsys.readouterr().out.splitlines()
    assert code == 0, "\n".join(out)
    assert out[0].startswith("emapg doctor: experiment=math_deepscaler_ema_pg backend=verl needs 8 GPU(s)")
    assert "the Ray cluster at 10.0.0.1:6379" in out[0]
    names = [line.split()[1] for line in out[1:-1]]
    assert names == [*doctor.CHECKS][:8] + ["paths", "task", "checkpoint", "checkpoint", "wandb"]
    assert out[-1] == f"{len(out) - 2} lines: {len(out) - 2} PASS, 0 WARN, 0 FAIL, 0 N/A"


# ---------------------------------------------------------------------------------------------- the CLI
@pytest.mark.parametrize(
    "argv, words",
    [
        (["doctor", "oops"], ["key=value", "'oops'"]),
        (["doctor", "--verbose"], ["--address HOST:PORT", "'--verbose'"]),
        (["doctor", "--address", "nohost"], ["--address='nohost'", "HOST:PORT"]),
        (["doctor", "--address=h:99999"], ["--address='h:99999'"]),
        (["doctor", "trainer.iteratons=5"], ["did you mean trainer.iterations"]),
        (["doctor", "backend.verl.rollout_engine=hf", "experiment=math_deepscaler_ema_pg"], ["trainer.device=cpu"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    assert cli_main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("emapg doctor: error:"), captured.err
    assert all(w in lines[0] for w in words), lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


def test_an_address_where_nothing_answers(capsys):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # a port nobody listens on
    assert cli_main(["doctor", "--address", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--address=127.0.0.1:{port}: nothing answers there" in err[0]


def test_help_lists_every_check(capsys):
    assert cli_main(["doctor", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: emapg doctor" in out and all(f"  {name} " in out for name in doctor.CHECKS)
    assert cli_main(["--help"]) == 0 and "doctor" in capsys.readouterr().out


def test_end_to_end_on_this_machine():
    """The command as a user runs it, here (CPU torch, no GPU): the default local run passes with the GPU checks
    N/A; the paper's verl preset fails its GPU demand, as it must on this machine."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env["WANDB_MODE"] = ""
    env.pop("RAY_ADDRESS", None)
    run = subprocess.run(
        [sys.executable, "-m", "experiments.cli", "doctor", "logger=none"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(lines) == len(doctor.CHECKS) + 2 and lines[0].startswith("emapg doctor: experiment=custom")
    status = {line.split()[1]: line.split()[0] for line in lines[1:-1]}
    if "+cpu" in __import__("torch").__version__:
        assert {status[c] for c in ("driver", "cuda", "gpus", "nccl")} == {"N/A"}
    assert status["checkpoint"] == "PASS" and "FAIL" not in status.values()


def test_a_verl_gpu_preset_fails_here_when_there_is_no_gpu(capsys, data):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code = cli_main(["doctor", "experiment=math_deepscaler_ema_pg", f"backend.verl.checkpoint_dir={data / 'c'}"])
    lines = capsys.readouterr().out.splitlines()
    status = {line.split()[1]: line.split()[0] for line in lines[1:-1]}
    assert code == 1 and status["gpus"] == "FAIL" and status["checkpoint"] == "PASS"
    assert "this node has 0 CUDA device(s); the run needs 8 per node" in "\n".join(lines)


# ---------------------------------------------------------------------------------------------- a real Ray
def test_a_real_local_ray_runs_the_node_checks(cfgs, data, tmp_path, monkeypatch):
    """RayCluster against a one-node Ray on 127.0.0.1 (2 CPUs, no dashboard, no auth): the node lists its
    GPUs (none), and the paths and checkpoint functions run there as Ray tasks."""
    ray = pytest.importorskip("ray")
    for key, value in {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    temp = tempfile_dir()
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        _temp_dir=temp,
    )
    try:
        cluster = doctor.RayCluster(timeout_s=120)
        (node,) = cluster.nodes()
        assert node.gpus == 0
        d = with_files(cfgs["verl"], data, checkpoints=str(data / "ckpt"))
        paths = doctor.check_paths(ctx(cfgs["verl"], d, cluster=cluster))
        ckpt = doctor.check_checkpoint(ctx(cfgs["verl"], d, cluster=cluster))
        gpus_line = doctor.check_gpus(ctx(cfgs["verl"], d, cluster=cluster, cuda=None))
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    assert [r.status for r in paths] == ["PASS", "PASS"] and paths[1].found.startswith(f"node {node.name}: 3 of 3")
    assert [r.status for r in ckpt] == ["PASS", "PASS"] and "(shared)" in ckpt[1].found
    assert gpus_line.status == "FAIL" and f"{node.name}: 0" in gpus_line.found
    assert leftovers(data) == []


def tempfile_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="emapg_ray_", dir="/tmp")  # short: Ray's unix sockets live here
