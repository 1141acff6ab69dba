"""What the verl plugin costs per step over stock verl GRPO, on the rehearsal-sized verl run (CPU).

    python benchmarks/verl_overhead.py                 # 4 rounds x 6 variants x 12 steps (25-35 min on 2 cores)
    python benchmarks/verl_overhead.py --write         # ... and write the section of docs/benchmarks.md
    python benchmarks/verl_overhead.py --rounds 1 --steps 4 --variants a d    # a quick look

The run is `emapg rehearse`'s (experiments/rehearse.py): verl 0.9.1's real V1 loop on the CPU platform with the
hf rollout engine, a tiny Qwen2 built from a config (char tokenizer, a few seconds of SFT) and generated math data
in the real schema, the math preset's settings at rehearsal sizes (4 prompts x 2 samples, responses of at most 24
tokens, one virtual GPU), fixed seeds. Six variants of it:

    (a) stock verl GRPO: verl's own PPOTrainerSync, ActorRolloutRefWorker, FSDP engine and ppo_loss with its
        reference model and kl_loss_type=low_var_kl; the plugin's launcher supplies only the CPU platform, the hf
        rollout engine and the metrics file (``launch``: the compiled launch of (b) with verl's trainer mode
        "sync" and low_var_kl; everything else is (b)'s, the plugin's fixed settings included: an fp32 reference
        and no fused kernels, verl 0.9.1's defaults too)
    (b0) the plugin, tau = 1, K3, without the recipe's mask_truncated (length-capped responses left out of the
        update: the worker's engine masks them from a cap the trainer sends as a flag, and all-reduces the kept
        count once per mini-batch; stock verl has no such setting): the plugin's bare cost over (a)
    (b) the plugin, tau = 1, K3 (experiment=math_deepscaler_grpo)
    (c) the plugin, tau = 0.95, K3: the released math recipe (experiment=math_deepscaler_ema_pg; the rehearsal's
        anchor period of 2)
    (d) (c) with the search recipe's KL: reverse Top-k, k = 32, the paper's tail, importance weights
    (e) (d) with the KL probe every step on 2 prompts (the rehearsal's probe)

Each variant runs ``--steps`` steps in a fresh verl job, in rounds (a b0 b c d e, a b0 b ...), so that the other
load of the shared machine falls on every variant alike; the first ``--warmup`` steps of every job are dropped.
No checkpoints, no validation (verl's save_freq and test_freq -1): a step is rollout to weight sync. One thread
per process (``THREADS``). verl's
replay buffer looks for finished rollouts every 2 s (no config key), which on CPU makes ``timing_s/gen`` a multiple
of 2 s; every variant's runs poll every ``POLL_S`` instead (``poll_replay_buffer``).

Measured, per step (means over the kept steps of every round):

- verl's own ``timing_s/*`` keys from the run's verl_metrics.jsonl: step, gen, old_log_prob (the pi_old pass: the
  Top-k ids in (d)/(e)), ref (the anchor pass: its log-probs at those ids), adv, update_actor (with the plugin's
  ``timing_s/emapg_ema`` and ``timing_s/emapg_probe`` inside it), update_weights;
- TransferQueue: every Ray process of the run (``setup_worker``, the runs' worker setup hook) times and sizes each
  TransferQueue get and put of its client (``AsyncTransferQueueClient.async_get_data`` / ``async_put``) into
  ``tq.jsonl``. A step's records are those up to its actor update's fetch (the get of the worker that holds both
  ``input_ids`` and ``advantages``). Bytes per token of a field = ``values().nbytes / values().shape[0]`` of the
  nested (nnz, ...) tensor that travelled (the jagged offsets, per sequence, are not counted): the Top-k fields
  (``emapg_*``) the update received, the passes put, and all that moved (puts + gets); the worker's time in
  TransferQueue gets and puts (the transfer inside old_log_prob, ref and update_actor);
- CPU seconds per step (``time.process_time`` stamped on those records) of the worker (actor and reference: the
  passes, the update, the EMA, the probe) and of the trainer, less sensitive than wall time to the other jobs.

Besides the means, "fastest quarter" figures average the fastest quarter of the steps (``fast_mean``): another
job's load only adds time, so they are the least disturbed estimate (as benchmarks/ema_update.py keeps its fastest
round).

verl-only timings; no assertion on wall-clock time anywhere (tests/test_benchmarks_verl_overhead.py checks the
variant launches and the parsing only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.backends.verl import require_verl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, machine, md_table, write_section  # noqa: E402

SECTION = "verl_overhead"
TQ_LOG_ENV = "EMAPG_BENCH_TQ_LOG"
"""Where every process of a run appends its TransferQueue records (one JSON line per get or put)."""
POLL_ENV = "EMAPG_BENCH_POLL_S"
"""The replay buffer's poll interval in the benchmark's runs (``poll_replay_buffer``)."""
POLL_S = 0.02
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""Every process of a run computes on one thread (torch would take both cores in each Ray worker): on 2 shared
cores, a descheduled thread of a 2-thread pool makes the other spin at the pool's barriers, so another job's load
inflated both the wall and the CPU time of whichever variant it hit."""
HOOK_KEY = "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook"
HOOK = "benchmarks.verl_overhead.setup_worker"
TOPK_PREFIX = "emapg_"
TIMERS = ("gen", "old_log_prob", "ref", "adv", "update_actor", "emapg_ema", "emapg_probe", "update_weights")
"""verl's timers in a step, in order (timing_s/<name>); emapg_ema and emapg_probe run inside update_actor."""
TARGETS = {"c": 1.02, "d": 1.05}
"""Step time / (a)'s, per step (the issue's targets for this benchmark)."""
JOB_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    target: tuple[str, ...]
    """Hydra overrides of the experiments config (before the rehearsal's)."""
    stock: bool = False
    """Run verl's own trainer, worker and loss (trainer mode "sync", low_var_kl) instead of the plugin's."""


NO_PROBE = "trainer.probe_every=0"
SEARCH_KL = ("algo.kl.type=topk_reverse", "algo.kl.k=32", "algo.kl.tail=paper", "algo.kl.use_iw=true")
VARIANTS = (
    Variant(
        "a", "stock verl GRPO, reference + low_var_kl (no plugin)", ("experiment=math_deepscaler_grpo", NO_PROBE), True
    ),
    Variant(
        "b0",
        "plugin, tau = 1, K3, without mask_truncated",
        ("experiment=math_deepscaler_grpo", "backend.verl.mask_truncated=false", NO_PROBE),
    ),
    Variant(
        "b", "plugin, tau = 1, K3 (with the recipe's mask_truncated)", ("experiment=math_deepscaler_grpo", NO_PROBE)
    ),
    Variant("c", "plugin, tau = 0.95, K3 (math recipe)", ("experiment=math_deepscaler_ema_pg", NO_PROBE)),
    Variant(
        "d", "plugin, tau = 0.95, reverse Top-k k = 32", ("experiment=math_deepscaler_ema_pg", *SEARCH_KL, NO_PROBE)
    ),
    Variant("e", "(d) + KL probe every step", ("experiment=math_deepscaler_ema_pg", *SEARCH_KL)),
)
BY_NAME = {v.name: v for v in VARIANTS}
COMMON_EDITS = {"trainer.save_freq": "-1", "trainer.test_freq": "-1", "trainer.val_before_train": "false"}
"""verl keys every variant's launch sets: no checkpoints, no validation (a step is rollout to weight sync)."""
STOCK_EDITS = {"trainer.v1.trainer_mode": "sync", "actor_rollout_ref.actor.kl_loss_type": "low_var_kl"}
"""(a): verl's own trainer (its worker, engine and ppo_loss come with it) and its K3 KL loss."""


# --------------------------------------------------------------------------------------
# The launches
# --------------------------------------------------------------------------------------
def edit_argv(argv: list[str], edits: dict[str, str]) -> list[str]:
    """`argv` (verl overrides ``key=value``) with the values of `edits` replaced; every key must be there once (a
    compiled launch that stopped emitting one would otherwise be benchmarked unedited)."""
    keys = [a.split("=", 1)[0] for a in argv]
    missing = sorted(k for k in edits if keys.count(k) != 1)
    if missing:
        raise ValueError(f"the compiled verl launch has not exactly one of {missing}: cannot edit it")
    return [f"{k}={edits[k]}" if k in edits else a for k, a in zip(keys, argv, strict=True)]


def variant_argv(variant: Variant, model: str, data, run_dir: Path, steps: int) -> list[str]:
    """The verl launch (``python -m experiments.backends.verl.main`` arguments) of `variant`'s rehearsal-sized run: the
    overrides ``emapg rehearse`` uses, compiled by ``to_verl`` as ``emapg train`` does (W&B off), then
    ``COMMON_EDITS``, this script's worker setup hook, and for (a) ``STOCK_EDITS``."""
    from omegaconf import OmegaConf

    from experiments import build  # loads torch, omegaconf
    from experiments.backends.verl.launch import to_verl  # loads torch
    from experiments.rehearse import rehearsal_overrides  # loads numpy

    target = list(variant.target)
    overrides = target + rehearsal_overrides(build.compose(target), model, data, run_dir, steps)
    job = OmegaConf.to_container(build.compose(overrides), resolve=True)
    argv = to_verl(job, wandb={}).argv()
    edits = {**COMMON_EDITS, HOOK_KEY: HOOK, **(STOCK_EDITS if variant.stock else {})}
    return edit_argv(argv, edits)


def launch(run_dir: Path) -> int:
    """In the child process of one job: verl's run as ``emapg train`` starts it
    (``experiments.backends.verl.main.main``), from ``<run_dir>/launch.json``. For (a) the plugin's check of its
    own requirements (trainer mode emapg_sync) is skipped: verl's TaskRunner then builds verl's own trainer, whose
    worker, engine and loss are verl's."""
    spec = json.loads((run_dir / "launch.json").read_text())
    from experiments.backends.verl import main as entry  # loads verl, torch

    if spec["stock"]:
        from experiments.backends.verl import trainer  # loads verl's trainer, verl

        trainer.check_verl = lambda config, section: None
    return entry.main(spec["argv"])


def run_job(variant: Variant, argv: list[str], run_dir: Path, timeout_s: float = JOB_TIMEOUT_S) -> dict:
    """One verl job in its own session (killed as a group afterwards: Ray's processes of this job only)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "launch.json").write_text(json.dumps({"argv": argv, "stock": variant.stock}, indent=1))
    inherited = ("RAY_ADDRESS", "VERL_PLATFORM", "VERL_ENGINE_DEVICE")
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "PYTHONUNBUFFERED": "1",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            "WANDB_MODE": "disabled",
            "HF_HUB_OFFLINE": "1",
            **THREADS,
            TQ_LOG_ENV: str(run_dir / "tq.jsonl"),
            POLL_ENV: str(POLL_S),
        }
    )
    cmd = [sys.executable, str(Path(__file__).resolve()), "--launch", str(run_dir)]
    load, loads = os.getloadavg(), []
    t0 = time.time()
    with open(run_dir / "job.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            code = _wait(proc, timeout_s, loads)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the job's process group has already exited
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {
        "variant": variant.name,
        "run_dir": str(run_dir),
        "code": code,
        "seconds": time.time() - t0,
        "load": load,
        "load_mean": _mean(loads),
    }


def _wait(proc: subprocess.Popen, timeout_s: float, loads: list[float], every_s: float = 2.0) -> int | None:
    """`proc`'s exit status (None after `timeout_s`), sampling the 1-min load average into `loads` meanwhile."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        try:
            return proc.wait(timeout=every_s)
        except subprocess.TimeoutExpired:
            loads.append(os.getloadavg()[0])
    return None


# --------------------------------------------------------------------------------------
# TransferQueue records (in every Ray process of a run: the worker setup hook)
# --------------------------------------------------------------------------------------
def setup_worker() -> None:
    """Ray ``worker_process_setup_hook`` of the benchmark's runs: the CPU run's own (``experiments.backends.verl.cpu``),
    then, with ``TQ_LOG_ENV`` set, the TransferQueue client's gets and puts timed and sized into that file."""
    from experiments.backends.verl import cpu  # loads torch

    cpu.setup_worker()
    path = os.environ.get(TQ_LOG_ENV)
    if path:
        instrument_transfer_queue(path)
    if os.environ.get(POLL_ENV):
        poll_replay_buffer(float(os.environ[POLL_ENV]))


def poll_replay_buffer(seconds: float) -> None:
    """verl 0.9.1's replay buffer looks for finished rollouts every ``poll_interval`` = 2 s (a constructor
    default no config key reaches), so on CPU, where a rollout takes well under 2 s, ``timing_s/gen`` is 2.0 s
    flat, or 4.0 s when the rollout is a little slower. The benchmark's runs (every variant) poll every `seconds`."""
    from verl.trainer.ppo.v1 import replay_buffer

    cls = replay_buffer.ReplayBuffer
    if getattr(cls.__init__, "_emapg_bench", False):
        return
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.poll_interval = seconds

    __init__._emapg_bench = True
    cls.__init__ = __init__


def field_sizes(td) -> dict[str, dict]:
    """{field: {"bytes", "tokens"}} of a TensorDict as it travels: nested (jagged) fields by their values
    (tokens = rows of the packed values), dense tensors whole (tokens None), non-tensors not counted."""
    import torch

    out = {}
    for name in td.keys():
        v = td.get(name)
        if isinstance(v, torch.Tensor) and v.is_nested:
            values = v.values()
            out[name] = {"bytes": values.nbytes, "tokens": int(values.shape[0])}
        elif isinstance(v, torch.Tensor):
            out[name] = {"bytes": v.nbytes, "tokens": None}
        else:
            out[name] = {"bytes": None, "tokens": None}
    return out


def instrument_transfer_queue(path: str) -> None:
    """Wrap ``AsyncTransferQueueClient.async_get_data`` and ``async_put`` (every TransferQueue transfer of this
    process goes through them) to append ``{"op", "pid", "t" (end, epoch s), "cpu" (this process's CPU seconds
    then, all threads), "s" (seconds), "fields"}``."""
    from transfer_queue.client import AsyncTransferQueueClient as Client

    if getattr(Client.async_get_data, "_emapg_bench", False):
        return
    get, put = Client.async_get_data, Client.async_put

    def record(op: str, td, seconds: float) -> None:
        line = {"op": op, "pid": os.getpid(), "t": time.time(), "cpu": time.process_time(), "s": seconds}
        try:
            line["fields"] = field_sizes(td)
        except Exception as e:  # noqa: BLE001  a record must never break the run
            line["error"] = repr(e)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())
        finally:
            os.close(fd)

    async def async_get_data(self, metadata):
        t0 = time.perf_counter()
        out = await get(self, metadata)
        record("get", out, time.perf_counter() - t0)
        return out

    async def async_put(self, data, metadata=None, partition_id=None, data_parser=None):
        t0 = time.perf_counter()
        out = await put(self, data, metadata=metadata, partition_id=partition_id, data_parser=data_parser)
        record("put", data, time.perf_counter() - t0)
        return out

    async_get_data._emapg_bench = async_put._emapg_bench = True
    Client.async_get_data, Client.async_put = async_get_data, async_put


# --------------------------------------------------------------------------------------
# Parsing a job
# --------------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by the end of the job
    return rows


def is_update_fetch(r: dict) -> bool:
    """The actor update's fetch: the worker's get of the whole batch (prompt ids and advantages both)."""
    return r["op"] == "get" and {"input_ids", "advantages"} <= set(r.get("fields") or {})


def _bytes(r: dict, topk_only: bool) -> int:
    return sum(
        f["bytes"] or 0 for name, f in (r.get("fields") or {}).items() if not topk_only or name.startswith(TOPK_PREFIX)
    )


def _cpu_at(records: list[dict], pid: int | None, t: float) -> float | None:
    """Process `pid`'s CPU seconds at its last record that ended by `t` (None: no such record)."""
    stamps = [r["cpu"] for r in records if r["pid"] == pid and r["t"] <= t and "cpu" in r]
    return stamps[-1] if stamps else None


def tq_steps(records: list[dict]) -> dict[int, dict]:
    """{step: TransferQueue figures of that step}: a step's records are those that ended after the previous
    step's update fetch and up to its own (step 1: from the start). Per token = per packed token of the update
    fetch (``input_ids``). CPU seconds per step, from one update fetch to the next (step 1: none), of the worker
    (the process of the update fetch: the passes, the update, the EMA, the probe) and of the trainer (the process
    that puts ``advantages``: verl's driver loop in the TaskRunner)."""
    records = sorted(records, key=lambda r: r["t"])
    updates = [r for r in records if is_update_fetch(r)]
    trainer = next((r["pid"] for r in records if r["op"] == "put" and "advantages" in (r.get("fields") or {})), None)
    out, start = {}, float("-inf")
    for step, u in enumerate(updates, 1):
        bucket = [r for r in records if start < r["t"] <= u["t"]]
        worker = [r for r in bucket if r["pid"] == u["pid"]]
        tokens = u["fields"]["input_ids"]["tokens"]
        out[step] = {
            "tokens": tokens,
            "topk_update_bpt": _bytes(u, True) / tokens,
            "topk_put_bpt": sum(_bytes(r, True) for r in bucket if r["op"] == "put") / tokens,
            "topk_moved_bpt": sum(_bytes(r, True) for r in bucket) / tokens,
            "update_bpt": _bytes(u, False) / tokens,
            "topk_fields": sorted(n for n in u["fields"] if n.startswith(TOPK_PREFIX)),
            "worker_tq_s": sum(r["s"] for r in worker),
            "update_get_s": u["s"],
        }
        for who, pid in (("worker", u["pid"]), ("trainer", trainer)):
            now, then = _cpu_at(records, pid, u["t"]), _cpu_at(records, pid, start)
            out[step][f"{who}_cpu_s"] = now - then if now is not None and then is not None else None
        start = u["t"]
    return out


def job_steps(run_dir: Path, warmup: int) -> list[dict]:
    """The kept steps of one job: verl's timers (0 where a timer did not run that step), tokens, and the
    TransferQueue figures, one dict per step after the first `warmup`."""
    from experiments.verl_metrics import attempt_files, read_attempts, trained_step  # loads torch

    metrics = {s: d for s, d in read_attempts(attempt_files(run_dir)).items() if trained_step(d)}
    tq = tq_steps(read_jsonl(run_dir / "tq.jsonl"))
    rows = []
    for step in sorted(metrics):
        if step <= warmup:
            continue
        d = metrics[step]
        row = {"step": step, "step_s": d["timing_s/step"], "num_tokens": d.get("perf/total_num_tokens")}
        row.update({t: d.get(f"timing_s/{t}", 0.0) for t in TIMERS})
        row.update(tq.get(step, {}))
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------
# Summary and the doc
# --------------------------------------------------------------------------------------
def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


FAST = 0.25
"""The fastest share of steps that the "least disturbed" estimates average (``fast_mean``)."""


def fast_mean(xs: list[float], share: float = FAST) -> float:
    """Mean of the smallest ceil(share * n) values: another job's load only ever adds time, so the fastest steps
    are the least disturbed (as benchmarks/ema_update.py takes its fastest round)."""
    xs = sorted(xs)
    return _mean(xs[: max(1, math.ceil(len(xs) * share))]) if xs else float("nan")


def fast_timer(steps: list[dict], key: str) -> float:
    """A timer's least-disturbed cost per step: ``fast_mean`` over the steps that ran it, times their share (the
    EMA runs every `period` steps, the probe every `probe_every`)."""
    ran = [s[key] for s in steps if s.get(key)]
    return fast_mean(ran) * len(ran) / len(steps) if ran else 0.0


def summarise(jobs: list[dict]) -> dict[str, dict]:
    """Per variant, over the kept steps of all its jobs: mean (and median, standard error, fastest-quarter mean)
    step time, mean and fastest-quarter cost of each timer, the TransferQueue figures and CPU seconds, and the
    step-time mean of each round (for the per-round ratios)."""
    out = {}
    for name in dict.fromkeys(j["variant"] for j in jobs):
        mine = [j for j in jobs if j["variant"] == name]
        steps = [s for j in mine for s in j["steps"]]
        times = [s["step_s"] for s in steps]
        sem = statistics.stdev(times) / len(times) ** 0.5 if len(times) > 1 else float("nan")
        keys = (*TIMERS, "num_tokens", "topk_update_bpt", "topk_put_bpt", "topk_moved_bpt", "update_bpt")
        keys += ("worker_tq_s", "update_get_s", "worker_cpu_s", "trainer_cpu_s")
        out[name] = {
            "steps": len(steps),
            "step_s": _mean(times),
            "median_s": statistics.median(times) if times else float("nan"),
            "sem_s": sem,
            "fast_step_s": fast_mean(times),
            **{f"fast_{t}": fast_timer(steps, t) for t in TIMERS},
            "fast_worker_cpu_s": fast_mean([s["worker_cpu_s"] for s in steps if s.get("worker_cpu_s") is not None]),
            **{k: _mean([s[k] for s in steps if s.get(k) is not None]) for k in keys},
            "topk_fields": sorted({f for s in steps for f in s.get("topk_fields", [])}),
            "ema_steps": sum(1 for s in steps if s["emapg_ema"] > 0),
            "probe_steps": sum(1 for s in steps if s["emapg_probe"] > 0),
            "rounds": {j["round"]: _mean([s["step_s"] for s in j["steps"]]) for j in mine},
            "rounds_fast": {j["round"]: fast_mean([s["step_s"] for s in j["steps"]]) for j in mine},
            "rounds_load": {j["round"]: j.get("load_mean", j["load"][0]) for j in mine},
        }
    return out


def ratios(summary: dict[str, dict], base: str = "a") -> dict[str, dict]:
    """Per variant, to the base's: mean step time ("ratio"; and per round, the rounds both ran), fastest-quarter
    step time ("fast"; and per round, "rounds_fast", with their median "median_fast": a round whose jobs another
    job's load hit unevenly moves it least), the worker's mean CPU seconds per step ("cpu")."""
    b = summary[base]
    out = {}
    for name, s in summary.items():
        both = [r for r in s["rounds"] if r in b["rounds"]]
        fast = [s["rounds_fast"][r] / b["rounds_fast"][r] for r in both]
        out[name] = {
            "ratio": s["step_s"] / b["step_s"],
            "rounds": [s["rounds"][r] / b["rounds"][r] for r in both],
            "fast": s["fast_step_s"] / b["fast_step_s"],
            "rounds_fast": fast,
            "median_fast": statistics.median(fast) if fast else float("nan"),
            "cpu": s["worker_cpu_s"] / b["worker_cpu_s"] if b["worker_cpu_s"] else float("nan"),
        }
    return out


def _f(x, digits=3) -> str:
    return "—" if x is None or x != x else f"{x:.{digits}f}"


def preset_sizes() -> dict[str, dict]:
    """The math and search recipes' batch and length settings, read from their composed presets."""
    from experiments import build  # loads torch, omegaconf

    out = {}
    for name in ("math_deepscaler_ema_pg", "search_r1_ema_pg"):
        cfg = build.compose([f"experiment={name}"])
        vs = cfg.backend.verl
        out[name] = {
            "prompts": int(cfg.rollout.prompts_per_iter),
            "samples": int(cfg.rollout.group_size),
            "max_prompt": int(vs.max_prompt_length),
            "max_response": int(vs.max_response_length or cfg.rollout.max_new_tokens),
            "gpus": int(vs.nnodes) * int(vs.n_gpus_per_node),
            "storage_units": 8,  # verl 0.9.1's transfer_queue.backend.SimpleStorage.num_data_storage_units
            "kl": str(cfg.algo.kl.type),
        }
    return out


BANDWIDTHS_GBPS = (1.0, 10.0)
"""Assumed TransferQueue throughput per rank (GB/s): one ZMQ stream with serialisation, and memcpy class."""
H200_UPDATE_S_PER_TOKEN = 1.149 / 16384
"""For scale: a 1.5B model's forward + backward per packed token on one H200 (docs/benchmarks.md, "sdpa for packed
batches on a GPU": 1149 ms at 16,384 tokens, the math preset's model shape, sdpa as the GPU install runs it)."""


def extrapolation(moved_bpt: float, stored_bpt: float, update_bpt: float, sizes: dict[str, dict]) -> str:
    """Bytes per step and transfer time at the recipes' sizes, from the per-token figures measured in (d)."""
    rows = []
    for name, z in sizes.items():
        seqs = z["prompts"] * z["samples"]
        for case, tokens in (
            ("cap: prompt + response at their maxima", z["max_prompt"] + z["max_response"]),
            ("half the response cap, prompt 1/8 of its cap", z["max_prompt"] // 8 + z["max_response"] // 2),
        ):
            n = seqs * tokens
            moved, stored, upd = n * moved_bpt, n * stored_bpt, n * update_bpt
            per_rank = moved / z["gpus"]
            times = [f"{per_rank / (bw * 1e9):.2f}" for bw in BANDWIDTHS_GBPS]
            update_s = n / z["gpus"] * H200_UPDATE_S_PER_TOKEN
            rows.append(
                [
                    name,
                    f"{z['prompts']} x {z['samples']} = {seqs}",
                    case,
                    f"{tokens:,}",
                    f"{n / 1e6:.1f}M",
                    f"{stored / 1e9:.1f}",
                    f"{moved / 1e9:.1f}",
                    f"{upd / 1e9:.1f}",
                    f"{per_rank / 1e9:.2f}",
                    " / ".join(times),
                    f"{update_s:.0f}",
                    f"{per_rank / (BANDWIDTHS_GBPS[0] * 1e9) / update_s:.2%}",
                ]
            )
    header = [
        "recipe",
        "sequences / step",
        "case",
        "tokens / sequence",
        "packed tokens / step",
        "Top-k stored (GB)",
        "Top-k moved (GB)",
        "whole update fetch (GB)",
        "Top-k moved / rank (GB)",
        "Top-k transfer / rank (s) at " + " / ".join(f"{b:g}" for b in BANDWIDTHS_GBPS) + " GB/s",
        "for scale: the update's forward + backward / rank (s, H200 figure)",
        f"transfer at {BANDWIDTHS_GBPS[0]:g} GB/s / that",
    ]
    return md_table(header, rows)


def render(jobs: list[dict], args, m: dict, wall_s: float, loads: list[tuple]) -> str:
    """The docs/benchmarks.md section of these jobs."""
    summary = summarise(jobs)
    rat = ratios(summary) if "a" in summary else {}
    names = [v.name for v in VARIANTS if v.name in summary]
    lines = _preamble(args, m, wall_s, loads, names)
    lines += _step_table(summary, rat, names)
    lines += _timer_tables(summary, names)
    lines += _payload_table(summary, names)
    lines += _verdicts(summary, rat)
    if "d" in summary and summary["d"]["topk_moved_bpt"] == summary["d"]["topk_moved_bpt"]:
        lines += _extrapolation_text(summary["d"], summary.get("a"))
    return "\n".join(lines)


def _preamble(args, m: dict, wall_s: float, loads: list[tuple], names: list[str]) -> list[str]:
    cmd = "python benchmarks/verl_overhead.py" + "".join(
        f" --{k} {getattr(args, k)}" for k in ("rounds", "steps", "warmup") if getattr(args, k) != DEFAULTS[k]
    )
    if args.variants != list(BY_NAME):
        cmd += " --variants " + " ".join(args.variants)
    lo = min(x[0] for x in loads) if loads else float("nan")
    hi = max(x[0] for x in loads) if loads else float("nan")
    lines = [
        "## verl plugin overhead per step, rehearsal-sized run on CPU (`benchmarks/verl_overhead.py`)",
        "",
        f"Command: `{cmd} --write` (total {wall_s / 60:.1f} min).  ",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, no GPU; torch {m['torch']}, Python "
        f"{m['python']}; verl 0.9.1 on its CPU platform (experiments.backends.verl.cpu), one torch thread per process "
        "(`OMP_NUM_THREADS=1`). "
        f"Load average at start {m['loadavg']} (1/5/15 min); 1-min load at the start of each job {lo:.2f} to "
        f"{hi:.2f} (the machine is shared: other jobs ran alongside). Date: {m['date']}.",
        "",
        f"Each variant ran {args.rounds} jobs of {args.steps} steps, in rounds ({' '.join(names)}, ...); the first "
        f"{args.warmup} steps of every job are dropped. The run is `emapg rehearse`'s math run (tiny Qwen2, 2 layers, "
        "hidden 64, 100-token vocabulary; 4 prompts x 2 samples, responses <= 24 tokens, one virtual GPU, hf "
        "rollout, fixed seeds), with no checkpoints and no validation. Variants:",
        "",
    ]
    lines += [f"- ({v.name}) {v.label}: `{' '.join(v.target)}`" for v in VARIANTS if v.name in names]
    return lines + [
        "",
        "(a) is verl's own GRPO (`PPOTrainerSync`, `ActorRolloutRefWorker`, `ppo_loss`, the reference with "
        "`kl_loss_type=low_var_kl`), launched with (b)'s other settings so that (a) and (b) compute the same model "
        "passes.",
        "",
    ]


def _step_table(summary: dict, rat: dict, names: list[str]) -> list[str]:
    lines = [
        "### Step time (verl's `timing_s/step`, seconds) and CPU time",
        "",
        "Fastest quarter: the mean of the fastest quarter of the steps (another job's load only adds time; the "
        "least disturbed steps). Worker CPU: CPU seconds (all threads) of the process holding the actor and the "
        "reference, from one actor-update fetch to the next (both passes, the update, the EMA, the probe, the "
        "weight sync); trainer CPU: verl's driver loop (the TaskRunner).",
        "",
    ]
    rows = [
        [
            f"({n})",
            summary[n]["steps"],
            *[_f(summary[n][k]) for k in ("step_s", "median_s", "sem_s", "fast_step_s", "worker_cpu_s")],
            _f(summary[n]["trainer_cpu_s"]),
            _f(summary[n]["num_tokens"], 1),
        ]
        for n in names
    ]
    header = ["variant", "steps", "mean", "median", "std. error", "fastest quarter", "worker CPU", "trainer CPU"]
    lines += [md_table([*header, "tokens / step"], rows), ""]
    if not rat:
        return lines
    lines += [
        "Ratios to (a). Per round: the fastest-quarter step time of the round's job over (a)'s in the same round, "
        "with the mean 1-min load average during the job in brackets (the machine's 2 cores were shared):",
        "",
    ]
    rows = []
    for n in names:
        r, s = rat[n], summary[n]
        loads = [s["rounds_load"][k] for k in sorted(s["rounds_load"])]
        per_round = ", ".join(f"{x:.2f} ({load:.1f})" for x, load in zip(r["rounds_fast"], loads, strict=False))
        rows.append([f"({n})", _f(r["ratio"]), _f(r["fast"]), per_round, _f(r["median_fast"]), _f(r["cpu"])])
    header = ["variant", "mean", "fastest quarter", "per round", "median of the rounds", "worker CPU"]
    return lines + [md_table(header, rows), ""]


def _timer_tables(summary: dict, names: list[str]) -> list[str]:
    if "a" not in summary:
        return []
    a, rows = summary["a"], []
    for n in names:
        s = summary[n]
        rows.append([f"({n})", *[f"{s[f'fast_{t}']:.3f} ({s[f'fast_{t}'] - a[f'fast_{t}']:+.3f})" for t in TIMERS]])
    return [
        "### Where the time goes (verl's timers, seconds per step; EMA and probe are inside update_actor)",
        "",
        "Per timer, the mean of its fastest quarter of the steps that ran it, times the share of steps that ran it "
        "(the EMA every `period` = 2 steps here), and in brackets the difference to (a):",
        "",
        md_table(["variant (fastest quarter)", *TIMERS], rows),
        "",
    ]


def _payload_table(summary: dict, names: list[str]) -> list[str]:
    lines = ["### What the Top-k passes put through TransferQueue (measured from the payload)", ""]
    rows = []
    for n in names:
        s = summary[n]
        rows.append(
            [
                f"({n})",
                ", ".join(f"`{f}`" for f in s["topk_fields"]) or "none",
                _f(s["topk_update_bpt"], 1),
                _f(s["topk_put_bpt"], 1),
                _f(s["topk_moved_bpt"], 1),
                _f(s["update_bpt"], 1),
                _f(s["update_get_s"], 4),
            ]
        )
    header = [
        "variant",
        "Top-k fields in the update's fetch",
        "Top-k B / token the update received",
        "Top-k B / token put by the passes",
        "Top-k B / token moved (puts + gets)",
        "whole update fetch, B / token",
        "update fetch (s)",
    ]
    lines += [md_table(header, rows), ""]
    return lines


def _verdicts(summary: dict, rat: dict) -> list[str]:
    """One line per target: each ratio against it, the median of the rounds first (the least disturbed)."""
    if "a" not in summary:
        return []
    out = ["### Against the targets ((c) <= 1.02x and (d) <= 1.05x of (a) per step)", ""]
    noise = 2 * summary["a"]["sem_s"] / summary["a"]["step_s"]
    for n, target in TARGETS.items():
        if n not in rat:
            continue
        r = rat[n]
        verdict = lambda x, t=target: "met" if x <= t else "**missed**"  # noqa: E731
        out.append(
            f"- ({n}), target {target:.2f}x: median of the rounds {r['median_fast']:.3f}x ({verdict(r['median_fast'])}"
            f"), pooled fastest quarter {r['fast']:.3f}x ({verdict(r['fast'])}), mean step {r['ratio']:.3f}x "
            f"({verdict(r['ratio'])}), worker CPU {r['cpu']:.3f}x ({verdict(r['cpu'])})."
        )
    out += ["", f"Two standard errors of (a)'s mean step time: {noise:.1%} of it.", ""]
    return out


def _extrapolation_text(d: dict, a: dict | None) -> list[str]:
    sizes = preset_sizes()
    lines = [
        "### On paper: the Top-k payload at the recipes' sizes on 8xH100",
        "",
        f"Per packed token, measured in (d) above: {d['topk_update_bpt']:.0f} B of Top-k fields reach the actor "
        f"update, {d['topk_put_bpt']:.0f} B are put by the two passes, {d['topk_moved_bpt']:.0f} B move in all "
        "(puts + gets: the anchor pass fetches the whole batch, pi_old's ids included, and the update fetches it "
        "again)"
        + (
            f"; the whole update fetch is {d['update_bpt']:.0f} B / token against (a)'s {a['update_bpt']:.0f}."
            if a
            else "."
        ),
        "",
        extrapolation(d["topk_moved_bpt"], d["topk_put_bpt"], d["update_bpt"], sizes),
        "",
        "Assumptions, each a choice of this estimate:",
        "",
    ]
    for name, z in sizes.items():
        lines.append(
            f"- {name} (read from the preset): {z['prompts']} prompts x {z['samples']} samples, max_prompt_length "
            f"{z['max_prompt']}, max_response_length {z['max_response']}, {z['gpus']} GPUs, KL {z['kl']}."
        )
    lines += [
        "- Every packed token (prompt and response) carries a Top-k row; the cap row is an upper bound, the other an "
        "assumed typical length. Bytes per token and their multiplicity are (d)'s; each of the 8 ranks moves 1/8 of "
        "the batch through host RAM at an assumed 1 or 10 GB/s (not measured here); the update time is the H200 "
        "figure of a 1.5B model (1149 ms per 16,384 packed tokens), so the last column is an upper bound.",
        "",
    ]
    return lines


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------
DEFAULTS = {"rounds": 4, "steps": 12, "warmup": 2}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=DEFAULTS["rounds"], help="jobs per variant, interleaved")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="training steps per job")
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="first steps of each job dropped")
    p.add_argument("--variants", nargs="+", default=list(BY_NAME), choices=list(BY_NAME))
    p.add_argument("--out", help="work directory (default: a temporary one, removed at the end)")
    p.add_argument("--write", action="store_true", help="write the section of docs/benchmarks.md")
    p.add_argument("--from-jobs", help="render (and with --write, write) the section from an earlier run's jobs.json")
    p.add_argument("--launch", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.launch:
        return launch(Path(args.launch))
    if args.from_jobs:
        return _render_saved(Path(args.from_jobs), args.write)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")

    try:
        require_verl()
    except ImportError as e:  # one line, no traceback: run it in the venv that has the [verl] extra
        p.exit(2, f"{e}\n")
    with tempfile.TemporaryDirectory() as tmp:  # with --out, the runs and jobs.json stay there
        return _measure(args, Path(args.out) if args.out else Path(tmp))


def _measure(args, out: Path) -> int:
    from experiments.rehearse import Shared  # loads numpy

    m, t0 = machine(), time.time()
    shared = Shared(out / "_shared")
    data, model = shared.data("math"), shared.model("math")
    variants = [BY_NAME[n] for n in args.variants]
    jobs, loads = [], []
    saved = {"args": {k: getattr(args, k) for k in ("rounds", "steps", "warmup", "variants")}, "machine": m}
    for rnd in range(args.rounds):
        for v in variants:
            run_dir = out / f"r{rnd}_{v.name}"
            argv = variant_argv(v, model, data, run_dir, args.steps)
            job = run_job(v, argv, run_dir)
            loads.append(job["load"])
            job.update(round=rnd, steps=job_steps(run_dir, args.warmup) if job["code"] == 0 else [])
            print(
                f"round {rnd} ({v.name}): exit {job['code']}, {job['seconds']:.0f} s, {len(job['steps'])} kept steps, "
                f"load {job['load'][0]:.2f}",
                flush=True,
            )
            if job["code"] != 0 or not job["steps"]:
                print(f"  failed: see {run_dir / 'job.log'}", flush=True)
            jobs.append(job)
            saved.update(jobs=jobs, loads=loads, wall_s=time.time() - t0)
            (out / "jobs.json").write_text(json.dumps(saved, indent=1))
    print(f"measurements: {out / 'jobs.json'} (render again with --from-jobs)", flush=True)
    return _render_saved(out / "jobs.json", args.write)


def _render_saved(path: Path, write: bool) -> int:
    """Print (and write) the section from a jobs.json; refuses to write when a job failed."""
    saved = json.loads(path.read_text())
    jobs, failed = [j for j in saved["jobs"] if j["steps"]], [j for j in saved["jobs"] if not j["steps"]]
    if not jobs:
        return 1
    args = argparse.Namespace(**saved["args"])
    text = render(jobs, args, saved["machine"], saved["wall_s"], [tuple(x) for x in saved["loads"]])
    print(text)
    if write and not failed:
        write_section(SECTION, text)
    elif write:
        print(f"not written: {len(failed)} job(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
