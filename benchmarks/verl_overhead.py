"""What the verl plugin costs per step over stock verl GRPO, on the rehearsal-sized verl run (CPU).

    python benchmarks/verl_overhead.py [--rounds 4] [--steps 12] [--variants a b c d e] [--write]
    python benchmarks/verl_overhead.py --from-jobs OUT/jobs.json [--write]   # render an earlier run again

`emapg rehearse`'s math run in each of the ``VARIANTS``, a fresh verl job of ``--steps`` steps each, in rounds
(a b c d e, a ...) so that the shared machine's load falls on all alike; the section says what is measured. The
TransferQueue figures come from the client's gets and puts, logged by every Ray process (``setup_worker``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from experiments.backends.verl import cpu, require_verl
from experiments.backends.verl.launch import to_verl
from experiments.records import read_jsonl
from experiments.verl_metrics import attempt_files, read_attempts, trained_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, cli, machine, md_table, publish  # noqa: E402

SECTION = "verl_overhead"
TQ_LOG_ENV = "EMAPG_BENCH_TQ_LOG"  # the file every process of a run appends its TransferQueue records to
POLL_S = 0.02  # the replay buffer's poll interval in every variant's runs (poll_replay_buffer)
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""One thread per process: on 2 shared cores, a descheduled thread of a 2-thread pool makes the other spin at the
pool's barriers, so another job's load inflated both the wall and the CPU time of whichever variant it hit."""
HOOK_KEY = "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook"
HOOK = "benchmarks.verl_overhead.setup_worker"
"""Every Ray process of a run imports this module: what only the parent needs (composing the launches) is imported
where it is used."""
TOPK_PREFIX = "emapg_"
TIMERS = ("gen", "old_log_prob", "ref", "adv", "update_actor", "emapg_ema", "emapg_probe", "update_weights")
TARGETS = {"c": 1.02, "d": 1.05}  # step time / (a)'s: the issue's targets
JOB_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    target: tuple[str, ...]  # overrides of the experiments config (before the rehearsal's)
    stock: bool = False  # verl's own trainer, worker and loss (STOCK_EDITS) instead of the plugin's


GRPO, EMA, NO_PROBE = "experiment=math_deepscaler_grpo", "experiment=math_deepscaler_ema_pg", "trainer.probe_every=0"
SEARCH_KL = ("algo.kl.type=topk_reverse", "algo.kl.k=32", "algo.kl.tail=paper", "algo.kl.use_iw=true")
VARIANTS = (
    Variant("a", "stock verl GRPO, reference + low_var_kl (no plugin)", (GRPO, NO_PROBE), stock=True),
    Variant("b", "plugin, tau = 1, K3 (with the recipe's mask_truncated)", (GRPO, NO_PROBE)),
    Variant("c", "plugin, tau = 0.95, K3 (math recipe)", (EMA, NO_PROBE)),
    Variant("d", "plugin, tau = 0.95, reverse Top-k k = 32", (EMA, *SEARCH_KL, NO_PROBE)),
    Variant("e", "(d) + KL probe every step", (EMA, *SEARCH_KL)),
)
BY_NAME = {v.name: v for v in VARIANTS}
# every variant: no checkpoints, no validation (a step is rollout to weight sync)
COMMON_EDITS = {"trainer.save_freq": "-1", "trainer.test_freq": "-1", "trainer.val_before_train": "false"}
STOCK_EDITS = {"trainer.v1.trainer_mode": "sync", "actor_rollout_ref.actor.kl_loss_type": "low_var_kl"}


# ------------------------------------------------------------------ The launches
def edit_argv(argv: list[str], edits: dict[str, str]) -> list[str]:
    """`argv` (verl overrides ``key=value``) with the values of `edits` replaced; every key must be there once (a
    compiled launch that stopped emitting one would otherwise be benchmarked unedited)."""
    keys = [a.split("=", 1)[0] for a in argv]
    missing = sorted(k for k in edits if keys.count(k) != 1)
    if missing:
        raise ValueError(f"the compiled verl launch has not exactly one of {missing}: cannot edit it")
    return [f"{k}={edits[k]}" if k in edits else a for k, a in zip(keys, argv, strict=True)]


def variant_argv(variant: Variant, model: str, data, run_dir: Path, steps: int) -> list[str]:
    """`variant`'s verl launch: ``emapg rehearse``'s overrides compiled as ``emapg train`` does (W&B off), edited."""
    from experiments import build  # loads omegaconf, hydra: the parent only (HOOK)
    from experiments.ops.rehearse import rehearsal_overrides  # loads httpx, yaml: the parent only (HOOK)

    target = list(variant.target)
    overrides = target + rehearsal_overrides(build.compose(target), model, data, run_dir, steps)
    job = OmegaConf.to_container(build.compose(overrides), resolve=True)
    argv = to_verl(job, wandb={}).argv()
    edits = {**COMMON_EDITS, HOOK_KEY: HOOK, **(STOCK_EDITS if variant.stock else {})}
    return edit_argv(argv, edits)


def launch(run_dir: Path) -> int:
    """The child process of one job: verl's run as ``emapg train`` starts it. For (a) the plugin's check of its own
    requirements (trainer mode emapg_sync) is skipped, so verl's TaskRunner builds verl's own trainer."""
    spec = json.loads((run_dir / "launch.json").read_text())
    from experiments.backends.verl import main as entry  # loads verl, torch

    if spec["stock"]:
        from experiments.backends.verl import trainer  # loads verl's trainer, verl

        trainer.check_verl = lambda *args: None
    return entry.main(spec["argv"])


def run_job(variant: Variant, argv: list[str], run_dir: Path) -> dict:
    """One verl job in its own session (killed as a group afterwards: Ray's processes of this job only)."""
    from experiments.ops.rehearse import child_env, kill_group  # loads httpx, yaml: the parent only (HOOK)

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "launch.json").write_text(json.dumps({"argv": argv, "stock": variant.stock}, indent=1))
    env = child_env(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", **THREADS)
    env.update(WANDB_MODE="disabled", PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])]))
    env[TQ_LOG_ENV] = str(run_dir / "tq.jsonl")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--launch", str(run_dir)]
    load, loads, code = os.getloadavg(), [], None
    t0 = time.time()
    with open(run_dir / "job.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            while code is None and time.time() - t0 < JOB_TIMEOUT_S:  # the 1-min load sampled every 2 s
                try:
                    code = proc.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    loads.append(os.getloadavg()[0])
        finally:
            kill_group(proc)
    return {"variant": variant.name, "run_dir": str(run_dir), "code": code, "seconds": time.time() - t0,
            "load": load, "load_mean": _mean(loads)}  # fmt: skip


# ---------------------------------- TransferQueue records (in every Ray process of a run: the worker setup hook)
def setup_worker() -> None:
    """Ray ``worker_process_setup_hook`` of the benchmark's runs: the CPU run's own, then the instruments."""
    cpu.setup_worker()
    path = os.environ.get(TQ_LOG_ENV)
    if path:
        instrument_transfer_queue(path)
    poll_replay_buffer(POLL_S)


def poll_replay_buffer(seconds: float) -> None:
    """verl 0.9.1's replay buffer looks for finished rollouts every ``poll_interval`` = 2 s (a constructor
    default no config key reaches), so on CPU, where a rollout takes well under 2 s, ``timing_s/gen`` is 2.0 s
    flat, or 4.0 s when the rollout is a little slower. The benchmark's runs (every variant) poll every `seconds`."""
    from verl.trainer.ppo.v1 import replay_buffer

    cls = replay_buffer.ReplayBuffer
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.poll_interval = seconds

    cls.__init__ = __init__


def field_sizes(td) -> dict[str, dict]:
    """{field: {"bytes", "tokens"}} of a TensorDict as it travels: nested (jagged) fields by their packed values,
    dense tensors whole (tokens None), non-tensors not counted."""
    out = {}
    for name in td.keys():
        v = td.get(name)
        if not isinstance(v, torch.Tensor):
            out[name] = {"bytes": None, "tokens": None}
        elif v.is_nested:
            out[name] = {"bytes": v.values().nbytes, "tokens": int(v.values().shape[0])}
        else:
            out[name] = {"bytes": v.nbytes, "tokens": None}
    return out


def instrument_transfer_queue(path: str) -> None:
    """Wrap ``AsyncTransferQueueClient.async_get_data`` and ``async_put`` (every TransferQueue transfer of this
    process goes through them) to append ``{"op", "pid", "t" (end, epoch s), "cpu" (this process's CPU seconds
    then), "fields"}``."""
    from transfer_queue.client import AsyncTransferQueueClient as Client

    get, put = Client.async_get_data, Client.async_put

    def record(op: str, td) -> None:
        line = {"op": op, "pid": os.getpid(), "t": time.time(), "cpu": time.process_time()}
        try:
            line["fields"] = field_sizes(td)
        except Exception as e:  # noqa: BLE001  a record must never break the run
            line["error"] = repr(e)
        with open(path, "a") as f:  # one write of one line (O_APPEND): the processes' lines do not interleave
            f.write(json.dumps(line) + "\n")

    async def async_get_data(self, metadata):
        out = await get(self, metadata)
        record("get", out)
        return out

    async def async_put(self, data, metadata=None, partition_id=None, data_parser=None):
        out = await put(self, data, metadata=metadata, partition_id=partition_id, data_parser=data_parser)
        record("put", data)
        return out

    Client.async_get_data, Client.async_put = async_get_data, async_put


# ------------------------------------------------------------------ Parsing a job
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
    """{step: TransferQueue figures}: a step's records ended after the previous update fetch and up to its own.
    Per packed token of the update fetch (``input_ids``); CPU seconds from one update fetch to the next (step 1:
    none) of the worker (the process of the update fetch) and of the trainer (the one that puts ``advantages``)."""
    records = sorted(records, key=lambda r: r["t"])
    updates = [r for r in records if is_update_fetch(r)]
    trainer = next((r["pid"] for r in records if r["op"] == "put" and "advantages" in (r.get("fields") or {})), None)
    out, start = {}, float("-inf")
    for step, u in enumerate(updates, 1):
        bucket = [r for r in records if start < r["t"] <= u["t"]]
        tokens = u["fields"]["input_ids"]["tokens"]
        out[step] = {
            "tokens": tokens,
            "topk_update_bpt": _bytes(u, True) / tokens,
            "topk_put_bpt": sum(_bytes(r, True) for r in bucket if r["op"] == "put") / tokens,
            "topk_moved_bpt": sum(_bytes(r, True) for r in bucket) / tokens,
            "update_bpt": _bytes(u, False) / tokens,
            "topk_fields": sorted(n for n in u["fields"] if n.startswith(TOPK_PREFIX)),
        }
        for who, pid in (("worker", u["pid"]), ("trainer", trainer)):
            now, then = _cpu_at(records, pid, u["t"]), _cpu_at(records, pid, start)
            out[step][f"{who}_cpu_s"] = now - then if now is not None and then is not None else None
        start = u["t"]
    return out


def job_steps(run_dir: Path, warmup: int) -> list[dict]:
    """One dict per step after the first `warmup`: verl's timers (0 where one did not run), tokens, TransferQueue."""
    metrics = {s: d for s, d in read_attempts(attempt_files(run_dir)).items() if trained_step(d)}
    tq = tq_steps(read_jsonl(run_dir / "tq.jsonl"))
    rows = []
    for step in sorted(s for s in metrics if s > warmup):
        d = metrics[step]
        row = {"step": step, "step_s": d["timing_s/step"], "num_tokens": d.get("perf/total_num_tokens")}
        row.update({t: d.get(f"timing_s/{t}", 0.0) for t in TIMERS})
        row.update(tq.get(step, {}))
        rows.append(row)
    return rows


# ------------------------------------------------------------------ Summary and the doc
def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def fast_mean(xs: list[float]) -> float:
    """Mean of the fastest quarter (ceil(n / 4) values): another job's load only ever adds time."""
    return _mean(sorted(xs)[: math.ceil(len(xs) / 4)])


def summarise(jobs: list[dict]) -> dict[str, dict]:
    """Per variant, over the kept steps of all its jobs: step-time statistics, TransferQueue figures, CPU seconds,
    and each round's fastest quarter and load."""
    out = {}
    for name in dict.fromkeys(j["variant"] for j in jobs):
        mine = [j for j in jobs if j["variant"] == name]
        steps = [s for j in mine for s in j["steps"]]
        times = [s["step_s"] for s in steps]
        sem = statistics.stdev(times) / len(times) ** 0.5 if len(times) > 1 else float("nan")
        keys = ("num_tokens", "topk_update_bpt", "topk_put_bpt", "topk_moved_bpt", "update_bpt", "worker_cpu_s",
                "trainer_cpu_s")  # fmt: skip
        out[name] = {
            "steps": len(steps),
            "step_s": _mean(times),
            "median_s": statistics.median(times) if times else float("nan"),
            "sem_s": sem,
            "fast_step_s": fast_mean(times),
            **{k: _mean([s[k] for s in steps if s.get(k) is not None]) for k in keys},
            "topk_fields": sorted({f for s in steps for f in s.get("topk_fields", [])}),
            "rounds_fast": {j["round"]: fast_mean([s["step_s"] for s in j["steps"]]) for j in mine},
            "rounds_load": {j["round"]: j.get("load_mean", j["load"][0]) for j in mine},
        }
    return out


def ratios(summary: dict[str, dict]) -> dict[str, dict]:
    """Per variant, to (a)'s: mean step time, fastest quarter (pooled, and per round the both ran, with their
    median: a round whose jobs another job's load hit unevenly moves it least), the worker's CPU seconds."""
    b = summary["a"]
    out = {}
    for name, s in summary.items():
        fast = [s["rounds_fast"][r] / b["rounds_fast"][r] for r in s["rounds_fast"] if r in b["rounds_fast"]]
        out[name] = {
            "ratio": s["step_s"] / b["step_s"],
            "fast": s["fast_step_s"] / b["fast_step_s"],
            "rounds_fast": fast,
            "median_fast": statistics.median(fast) if fast else float("nan"),
            "cpu": s["worker_cpu_s"] / b["worker_cpu_s"] if b["worker_cpu_s"] else float("nan"),
        }
    return out


def _f(x, digits=3) -> str:
    return "—" if x is None or x != x else f"{x:.{digits}f}"


def render(jobs: list[dict], args, m: dict, wall_s: float, loads: list[tuple]) -> str:
    summary = summarise(jobs)
    rat = ratios(summary) if "a" in summary else {}
    names = [v.name for v in VARIANTS if v.name in summary]
    lines = _preamble(args, m, wall_s, loads, names) + _step_table(summary, rat, names)
    return "\n".join([*lines, _payload_line(summary, names), "", *_verdicts(summary, rat)])


def _preamble(args, m: dict, wall_s: float, loads: list[tuple], names: list[str]) -> list[str]:
    cmd = "python benchmarks/verl_overhead.py" + "".join(
        f" --{k} {getattr(args, k)}" for k in ("rounds", "steps", "warmup") if getattr(args, k) != DEFAULTS[k]
    )
    if args.variants != list(BY_NAME):
        cmd += " --variants " + " ".join(args.variants)
    lo, hi = (min(x[0] for x in loads), max(x[0] for x in loads)) if loads else (float("nan"), float("nan"))
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
        "rollout, fixed seeds), with no checkpoints and no validation. (a) is verl's own GRPO (`PPOTrainerSync`, "
        "`ActorRolloutRefWorker`, `ppo_loss`, the reference with `kl_loss_type=low_var_kl`), launched with (b)'s "
        "other settings so that (a) and (b) compute the same model passes. Variants:",
        "",
    ]
    lines += [f"- ({v.name}) {v.label}: `{' '.join(v.target)}`" for v in VARIANTS if v.name in names]
    return lines + [""]


def _step_table(summary: dict, rat: dict, names: list[str]) -> list[str]:
    lines = [
        "Step time (verl's `timing_s/step`, s). Fastest quarter: the mean of the fastest quarter of the steps (the "
        "least disturbed). Worker CPU: CPU seconds of the process holding the actor and the reference, from one "
        "actor-update fetch to the next; trainer CPU: verl's driver loop. Ratios to (a); per round: the round's "
        "fastest quarter over (a)'s, with the mean 1-min load average during the job in brackets:",
        "",
    ]
    header = ["variant", "steps", "mean", "median", "std. error", "fastest quarter", "worker CPU", "trainer CPU"]
    header += ["tokens / step"] + (["/ (a): mean", "fastest quarter", "per round", "median of the rounds",
                                   "worker CPU"] if rat else [])  # fmt: skip
    rows = []
    for n in names:
        s = summary[n]
        row = [f"({n})", s["steps"], *[_f(s[k]) for k in ("step_s", "median_s", "sem_s", "fast_step_s")]]
        row += [_f(s["worker_cpu_s"]), _f(s["trainer_cpu_s"]), _f(s["num_tokens"], 1)]
        if rat:
            r, loads = rat[n], [s["rounds_load"][k] for k in sorted(s["rounds_load"])]
            per_round = ", ".join(f"{x:.2f} ({load:.1f})" for x, load in zip(r["rounds_fast"], loads, strict=False))
            row += [_f(r["ratio"]), _f(r["fast"]), per_round, _f(r["median_fast"]), _f(r["cpu"])]
        rows.append(row)
    return lines + [md_table(header, rows), ""]


def _payload_line(summary: dict, names: list[str]) -> str:
    """What went through TransferQueue per packed token, variants with the same payload together."""
    groups: dict[tuple, list[str]] = {}
    for n in names:
        s = summary[n]
        bpt = (s[k] for k in ("update_bpt", "topk_update_bpt", "topk_put_bpt", "topk_moved_bpt"))
        groups.setdefault((tuple(s["topk_fields"]), *bpt), []).append(f"({n})")
    parts = []
    for (fields, update, received, put, moved), who in groups.items():
        topk = (
            f" with {', '.join(f'`{f}`' for f in fields)}: {_f(received, 1)} B of Top-k received, {_f(put, 1)} B put "
            f"by the passes, {_f(moved, 1)} B moved in all (puts + gets)"
            if fields
            else ", no Top-k fields"
        )
        parts.append(f"{', '.join(who)}: update fetch {_f(update, 1)} B{topk}")
    return "TransferQueue per packed token, measured from the payload: " + "; ".join(parts) + "."


def _verdicts(summary: dict, rat: dict) -> list[str]:
    if "a" not in summary:
        return []
    out = ["Against the targets ((c) <= 1.02x and (d) <= 1.05x of (a) per step):", ""]
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


# ------------------------------------------------------------------ The command
DEFAULTS = {"rounds": 4, "steps": 12, "warmup": 2}


def main(argv: list[str] | None = None) -> int:
    p = cli(__doc__)
    p.add_argument("--rounds", type=int, default=DEFAULTS["rounds"], help="jobs per variant, interleaved")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="training steps per job")
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="first steps of each job dropped")
    p.add_argument("--variants", nargs="+", default=list(BY_NAME), choices=list(BY_NAME))
    p.add_argument("--out", help="work directory (default: a temporary one, removed at the end)")
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
    from experiments.ops.rehearse import Shared  # loads httpx, yaml: the parent only (HOOK)

    m, t0 = machine(), time.time()
    shared = Shared(out / "_shared")
    data, model = shared.data("math"), shared.model("math")
    saved = {"args": {k: getattr(args, k) for k in ("rounds", "steps", "warmup", "variants")}, "machine": m, "jobs": []}
    for rnd in range(args.rounds):
        for v in (BY_NAME[n] for n in args.variants):
            run_dir = out / f"r{rnd}_{v.name}"
            job = run_job(v, variant_argv(v, model, data, run_dir, args.steps), run_dir)
            job.update(round=rnd, steps=job_steps(run_dir, args.warmup) if job["code"] == 0 else [])
            print(
                f"round {rnd} ({v.name}): exit {job['code']}, {job['seconds']:.0f} s, {len(job['steps'])} kept steps, "
                f"load {job['load'][0]:.2f}",
                flush=True,
            )
            if job["code"] != 0 or not job["steps"]:
                print(f"  failed: see {run_dir / 'job.log'}", flush=True)
            saved["jobs"].append(job)
            saved["wall_s"] = time.time() - t0
            (out / "jobs.json").write_text(json.dumps(saved, indent=1))
    print(f"measurements: {out / 'jobs.json'} (render again with --from-jobs)", flush=True)
    return _render_saved(out / "jobs.json", args.write)


def _render_saved(path: Path, write: bool) -> int:
    """Print (and write, unless a job failed) the section from a jobs.json."""
    saved = json.loads(path.read_text())
    jobs, failed = [j for j in saved["jobs"] if j["steps"]], [j for j in saved["jobs"] if not j["steps"]]
    if not jobs:
        return 1
    args = argparse.Namespace(**saved["args"])
    text = render(jobs, args, saved["machine"], saved["wall_s"], [tuple(j["load"]) for j in saved["jobs"]])
    publish(SECTION, text, write and not failed)
    if write and failed:
        print(f"not written: {len(failed)} job(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
