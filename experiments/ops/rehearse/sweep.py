"""``emapg rehearse sweeps/<name>.yaml``: a verl sweep through Ray Tune, as ``emapg sweep`` runs it, on a local
two-node Ray cluster, at world size 2, two trials at once, with a node lost and the driver killed.

    emapg rehearse sweeps/math_deepscaler_ema_pg.yaml --layout across   # nnodes=2, one rank on each node
    emapg rehearse sweeps/search_r1_ema_pg.yaml                         # --layout within: 1 node x 2 ranks

The phases: ``rehearsal_spec``, ``LocalCluster``, ``run`` (the node loss, the driver kill, ``--resume``), ``checks``.
What this proves, what only GPUs can show, where every process's output is kept and why no wait has a wall-clock
limit: docs/scaling-out.md ("Rehearse the sweep itself").
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import OmegaConf

from experiments import build
from experiments.backends.verl import require_verl
from experiments.ops.rehearse import (
    CHECKS,
    NOT_INHERITED,
    Check,
    Shared,
    anchor_updates,
    attempt_steps,
    check_resume,
    child_env,
    expect,
    failed_line,
    kill_group,
    last_error,
    latest_checkpoint,
    logged_step,
    rehearsal_settings,
)
from experiments.records import RESUMES
from experiments.verl_metrics import FILE

GROUP_SIZE = 4  # samples per prompt: with 2, ``check_sharded`` at times saw no gradient (docs/scaling-out.md)
LAYOUTS = {  # world size 2: one rank on each of two nodes, or two ranks on one node
    "across": {"backend.verl.nnodes": 2, "backend.verl.n_gpus_per_node": 1},
    "within": {"backend.verl.nnodes": 1, "backend.verl.n_gpus_per_node": 2},
}
NODE_CPUS, NODE_GPUS = 16, 2  # per node: Ray CPUs (reservations, not cores) and virtual GPUs (verl's CPU platform)
STEPS = 4  # per trial: the anchor updates after steps 2 and 4 (period 2), checkpoints 3 and 4 are kept
STALL_S = 1800.0  # a phase fails after this long with no move (``_moves``); a trial that never steps: STEP_TIMEOUT_S
# For a node to join (Ray's own wait: 30 s) and a Ray worker to register (Ray's 60 s; verl starts ten per trial at once)
NODE_START_S = 600.0
WORKER_REGISTER_S = 600
LoadGrid = Callable[[str], tuple[Any, list[dict]]]  # a sweep spec's path -> (its sweeps.spec.Spec, its grid points)
LOGS = "logs"  # every process's output, kept after a pass too (docs/scaling-out.md, "Rehearse the sweep itself")


# ---------------------------------------------------------------------------- the rehearsal spec
def rehearsal_spec(spec_path: str, shared, layout: str, *, load_grid: LoadGrid, steps: int = STEPS) -> dict:
    """The sweep YAML (a mapping) that rehearses `spec_path`: its grid points at its first seed with their rehearsal
    overrides; those all points share go to ``base.overrides``, the others join the point in one joint grid entry."""
    s, grid = load_grid(spec_path)
    if s.backend != "verl" or s.search != "grid":
        raise ValueError(
            f"{spec_path}: emapg rehearse takes verl sweeps with search: grid (got {s.backend}, {s.search})"
        )
    points = []
    for point in grid:
        cfg = build.compose([o for o in s.overrides_for(point, s.seeds[0]) if not o.startswith(("sweep.", "logger."))])
        model, data, url = shared.prepare(cfg)
        o = rehearsal_settings(cfg, model, data, steps, retriever_url=url)
        points.append((point, _world_size_2(o, layout), cfg))
    common = {k: v for k, v in points[0][1].items() if all(p[1].get(k) == v for p in points)}
    keys = list(
        dict.fromkeys([k for p, *_ in points for k in p] + [k for _, o, _ in points for k in o if k not in common])
    )
    raw = {k: v for k, v in s.raw.items() if k not in ("space", "seeds", "max_concurrent")}
    raw["base"] = {**s.raw["base"], "overrides": {**(s.raw["base"].get("overrides") or {}), **common}}
    grid = [[{**p, **o}[k] if k in {**p, **o} else OmegaConf.select(cfg, k) for k in keys] for p, o, cfg in points]
    raw["space"] = {",".join(keys): {"grid": grid}}
    raw["seeds"] = [s.seeds[0]]
    return raw


def _world_size_2(o: dict, layout: str) -> dict:
    """The overrides at world size 2: the layout, and each rank's micro-batch its half of a mini-batch."""
    o = {**o, **LAYOUTS[layout], "rollout.group_size": GROUP_SIZE}
    per_rank = o["rollout.prompts_per_iter"] * o["rollout.group_size"] // o["trainer.mini_batches"] // 2
    return {**o, "backend.verl.micro_batch_size_per_gpu": per_rank}


# ---------------------------------------------------------------------------- the cluster
class LocalCluster:
    """Two raylets on this machine (``ray.cluster_utils.Cluster``); the second can be lost and replaced. After
    ``start``, ``address`` is the head's (kept when a node is lost) and ``logs_dir`` the Ray session's log folder,
    which every node writes to."""

    def __init__(self):
        self.cluster, self.worker, self.added = None, None, 0
        self.logs_dir: Path | None = None

    def start(self) -> None:
        import ray.cluster_utils

        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(int(NODE_START_S)))
        os.environ.setdefault("RAY_worker_niceness", "0")  # as sweeps.tune.WORKER_NICENESS: trials not starved by load
        self.cluster = ray.cluster_utils.Cluster(shutdown_at_exit=True)
        head = self._add("head", _system_config={"worker_register_timeout_seconds": WORKER_REGISTER_S})
        self.address, self.logs_dir = self.cluster.address, Path(head.get_logs_dir_path())
        self.worker = self._add("node1")
        self.added = 1

    def _add(self, name: str, **extra):
        node = self.cluster.add_node(
            wait=False,
            num_cpus=NODE_CPUS,
            num_gpus=NODE_GPUS,
            node_ip_address="127.0.0.1",
            object_store_memory=200 * 1024**2,
            include_dashboard=False,
            resources={f"rehearsal_{name}": 1.0},
            **extra,
        )
        self.cluster._wait_for_node(node, timeout=NODE_START_S)
        return node

    def lose_node(self) -> None:
        """Kill the second node's raylet and every process on it, without warning; then a fresh node joins."""
        self.cluster.remove_node(self.worker, allow_graceful=False)
        self.added += 1
        self.worker = self._add(f"node{self.added}")

    def shutdown(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None


# ---------------------------------------------------------------------------- the driver, as a user runs it
def _sweep(spec_file: Path, address: str, out: Path, log: Path, resume: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "experiments.cli", "sweep", str(spec_file), "--address", address, "--out", str(out)]
    cmd += ["--resume"] if resume else []
    with open(log, "a") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)


def _runs(out: Path) -> list[Path]:
    return sorted(p for p in (out / "runs").glob("*") if p.is_dir())


def _wait(what: str, ready: Callable[[], bool], proc: subprocess.Popen | None, sweep_dir: Path, log: Path) -> None:
    """Until `ready()`; RuntimeError when the driver `proc` exits first (with its error line from `log`) or when the
    sweep makes no progress (``_moves``) for ``STALL_S``: however slow the machine, a sweep that moves is waited for."""
    seen, since = None, time.time()
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"{what}: `emapg sweep` exited with status {proc.returncode} first: {last_error(log, 'emapg sweep:')}"
            )
        now = _moves(sweep_dir)
        if now != seen:
            seen, since = now, time.time()
        elif time.time() - since > STALL_S:
            at = "; ".join(f"{n}: attempt {a}, step {s}, checkpoint {c}" for n, a, s, c, _ in now) or "no trial started"
            raise RuntimeError(
                f"{what}: no trial started, retried, stepped, checkpointed or printed for {STALL_S:.0f} s ({at})"
            )
        time.sleep(1.0)


DRIVER_LOG = "verl_driver.log"  # a trial's verl job's output, in its run directory (backends.verl.main's, loads verl)


def _moves(sweep_dir: Path) -> tuple:
    """The sweep's progress: per trial run, its attempts, last step logged, last checkpoint and how much its verl job
    has printed (verl starting up, which on busy cores takes minutes before the first step)."""

    def printed(r: Path) -> int:
        return (r / DRIVER_LOG).stat().st_size if (r / DRIVER_LOG).is_file() else 0

    return tuple((r.name, _attempts(r), logged_step(r), latest_checkpoint(r), printed(r)) for r in _runs(sweep_dir))


def _progress(run_dir: Path) -> int:
    """The last step the run's current verl attempt logged with its checkpoint written (0: none yet)."""
    return min(latest_checkpoint(run_dir), logged_step(run_dir))


def _retry_progress(run_dir: Path) -> int:
    """``_progress`` of the attempt the trial's last retry started: 0 until that attempt's verl job has written its
    own metrics file (the earlier attempt's stays the live one until the new job renames it, minutes later)."""
    live, resumes = run_dir / FILE, run_dir / RESUMES
    if not (live.is_file() and resumes.is_file()) or live.stat().st_mtime_ns <= resumes.stat().st_mtime_ns:
        return 0
    return _progress(run_dir)


def _attempts(run_dir: Path) -> int:
    """How many times the trial has started its run: once, plus one line of resumes.jsonl per resume (verl's
    metrics files do not count them: an attempt that logged nothing leaves no file of its own)."""
    path = run_dir / RESUMES
    return 1 + (len(path.read_text().splitlines()) if path.is_file() else 0)


def run(spec_file: Path, out: Path, cluster: LocalCluster, say: Callable[[str], None]) -> float:
    """The sweep through the node loss and the driver kill to its end (``emapg sweep --resume``); its seconds."""
    log, sweep_dir, t0 = out / LOGS / "sweep.log", out / "sweep", time.time()
    proc = _sweep(spec_file, cluster.address, sweep_dir, log)
    try:
        say("  waiting for a trial's first step and checkpoint ...")
        _wait("a first checkpoint", lambda: any(_progress(r) >= 1 for r in _runs(sweep_dir)), proc, sweep_dir, log)
        lost_at = {r.name: _progress(r) for r in _runs(sweep_dir)}
        say(f"  node lost (its processes killed) at steps {lost_at}; a fresh node joins")
        cluster.lose_node()
        retry_stepped = lambda: any(_retry_progress(r) >= 1 for r in _runs(sweep_dir))  # noqa: E731
        _wait("a retry after the node loss", retry_stepped, proc, sweep_dir, log)
        killed_at = {r.name: _progress(r) for r in _runs(sweep_dir)}
        say(f"  driver (`emapg sweep`) SIGKILLed at steps {killed_at}")
    finally:
        kill_group(proc)
    say("  emapg sweep --resume ...")
    proc = _sweep(spec_file, cluster.address, sweep_dir, log, resume=True)
    try:
        _wait("the resumed sweep's end", lambda: proc.poll() is not None, None, sweep_dir, log)
    finally:
        kill_group(proc)
    if proc.returncode != 0:
        raise RuntimeError(
            f"emapg sweep --resume exited with status {proc.returncode}: {last_error(log, 'emapg sweep:')}"
        )
    return time.time() - t0


# ---------------------------------------------------------------------------- the checks
def checks(sweep_dir: Path) -> dict[str, list]:
    """Per trial: the single-config rehearsal's checks (``CHECKS`` of ``experiments.ops.rehearse``, the resume check as
    ``check_attempts``) and the world-size-2 checks; plus one line for the sweep (sweep.csv, the report)."""
    out = {}
    for run_dir in _runs(sweep_dir):
        e = expect(run_dir, attempts=1)
        got = [c(run_dir, e) for c in CHECKS if c is not check_resume]
        got += [check_attempts(run_dir, e), check_sharded(run_dir, e)]
        out[run_dir.name] = got
    table = sweep_dir / "sweep.csv"
    rows = list(csv.DictReader(table.read_text().splitlines(keepends=True))) if table.is_file() else []
    finished = [r["status"] for r in rows]
    report = (sweep_dir / "report" / "index.md").is_file()
    ok = bool(rows) and all(s == "finished" for s in finished) and report and len(rows) == len(out)
    hit = sorted(n for n in out if _attempts(sweep_dir / "runs" / n) > 1)
    detail = f"sweep.csv: {finished}; report/index.md written: {report}"
    out["sweep"] = [Check("sweep", ok, f"{detail}; trials with more than one attempt (node loss, driver kill): {hit}")]
    return out


def check_attempts(run_dir: Path, e):
    """No step lost or trained twice across attempts: each attempt of verl starts right after the last step the
    earlier ones logged; the anchor's update count at the end is the schedule's, counted across attempts."""
    steps = attempt_steps(run_dir)
    done, ok = 0, bool(steps)
    for s in steps:
        ok = ok and (not s or (s[0] == done + 1 and s == list(range(s[0], s[-1] + 1))))
        done = max([done, *s])
    ok = ok and done == e.steps
    detail = f"{len(steps)} attempt(s) trained steps {steps}"
    if e.tau < 1.0:
        updates = anchor_updates(run_dir, e.steps)
        ok = ok and updates == e.steps // e.period
        detail += f"; anchor updates at step {e.steps}: {updates} (scheduled {e.steps // e.period})"
    return Check("attempts", ok, detail)


def check_sharded(run_dir: Path, e, world: int = 2):
    """The kept checkpoints were written by `world` ranks; for tau < 1 the last step's anchor, gathered from the
    shards, is tau * anchor + (1 - tau) * policy of the step before after an update step, else unchanged, to
    ``ULPS`` float32 units in the last place (a tau off by 0.01 misses by about 1e5 of them)."""
    root = run_dir / "checkpoints"
    last, prev = root / f"global_step_{e.steps}", root / f"global_step_{e.steps - 1}"
    parts = [d / "actor" for d in (prev, last)] + ([d / "anchor" for d in (prev, last)] if e.tau < 1 else [])
    missing = [
        str(p.relative_to(root)) for p in parts if len(list(p.glob(f"model_world_size_{world}_rank_*.pt"))) != world
    ]
    if missing:
        return Check("world size 2", False, f"not written by {world} ranks: {missing}")
    if e.tau >= 1:
        return Check("world size 2", True, f"steps {e.steps - 1} and {e.steps}: policy shards of {world} ranks")
    policy, anchor, before = (_gathered(p, world) for p in (last / "actor", last / "anchor", prev / "anchor"))
    update = e.steps % e.period == 0
    want = {k: e.tau * before[k] + (1 - e.tau) * policy[k] if update else before[k] for k in anchor}
    err = max(_ulps(anchor[k], want[k], before[k], policy[k]) for k in anchor)
    moved = max(_ulps(anchor[k], before[k], policy[k]) for k in anchor)
    what = "tau * anchor + (1 - tau) * policy" if update else "the anchor before"
    if update and max(_ulps(policy[k], before[k]) for k in anchor) <= ULPS:
        what += " (the policy never left the anchor: no step had a gradient)"
    return Check(
        "world size 2",
        err <= ULPS and (moved > ULPS) == update,
        f"steps {e.steps - 1} and {e.steps}: {world} ranks' shards; anchor at {e.steps} vs {what}, gathered: "
        f"{err:.2g} ulp at most (the update moved it by up to {moved:.3g} ulp)",
    )


ULPS = 4.0  # float32 rounding the anchor's EMA may differ by from the same EMA in float64 (units in the last place)


def _ulps(got, want, *operands) -> float:
    """max |got - want| in float32 units in the last place of the largest of |want| and the |operands|, element by
    element: float32 rounding of tau * a + (1 - tau) * p is within a few of them, also where the terms cancel."""
    scale = want.abs()
    for t in operands:
        scale = torch.maximum(scale, t.abs())
    tiny = torch.finfo(torch.float32).tiny
    return float(((got - want).abs() / (torch.finfo(torch.float32).eps * scale.clamp_min(tiny))).max())


def _gathered(path: Path, world: int) -> dict:
    """The full tensors of an FSDP2 checkpoint: each rank's Shard(0) pieces concatenated in rank order."""
    shards = [
        torch.load(path / f"model_world_size_{world}_rank_{r}.pt", map_location="cpu", weights_only=False)
        for r in range(world)
    ]
    local = [{k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in s.items()} for s in shards]
    return {k: torch.cat([s[k].double() for s in local]) for k in local[0]}


# ---------------------------------------------------------------------------- the command
def main(argv: list[str] | None, load_grid: LoadGrid) -> int:
    """`emapg rehearse <spec>.yaml`; `load_grid` reads the spec and its grid points (``sweeps.spec``, a layer above:
    the command line hands it over)."""
    p = argparse.ArgumentParser(
        prog="emapg rehearse",
        description="Rehearse a verl sweep through Ray Tune on a local two-node Ray cluster (CPU): world size 2, "
        "two trials at once, a node lost, the driver killed and resumed. See docs/scaling-out.md.",
    )
    p.add_argument("spec", help="a verl sweep spec (sweeps/*.yaml)")
    p.add_argument(
        "--layout", choices=sorted(LAYOUTS), default="within", help="world size 2 across two nodes or within one"
    )
    p.add_argument("--out", default="outputs/rehearsals", help="where the sweep, its logs and the shared files go")
    p.add_argument("--device", choices=("cpu",), default="cpu", help="CPU only (--device cuda: one configuration)")
    args = p.parse_args(argv)

    require_verl()
    # the cluster's raylets, and so every trial, inherit this environment: W&B offline whatever WANDB_MODE says (the
    # W&B check reads the offline runs), and no Ray address or verl platform of the caller's
    os.environ["WANDB_MODE"] = "offline"
    for key in NOT_INHERITED:
        os.environ.pop(key, None)
    out = Path(args.out) / (Path(args.spec).stem + f"__{args.layout}")
    if out.exists():
        shutil.rmtree(out)
    logs = out / LOGS
    logs.mkdir(parents=True)
    say = _say_to(logs / "rehearse.log")
    shared = Shared(Path(args.out) / "_shared")
    cluster, stage, failure = LocalCluster(), "the rehearsal spec", None
    try:
        say(f"{args.spec}: the rehearsal spec (CPU platform, tiny model, world size 2: {args.layout}) ...")
        raw = rehearsal_spec(args.spec, shared, args.layout, load_grid=load_grid)
        spec_file = out / "rehearsal.yaml"
        spec_file.write_text(yaml.safe_dump(raw, sort_keys=False))
        stage = "the local Ray cluster"
        say(f"  a local Ray cluster of two nodes, {NODE_CPUS} CPUs and {NODE_GPUS} virtual GPUs each")
        cluster.start()
        stage = "the sweep"
        say(f"  emapg sweep {spec_file} --address {cluster.address} --out {out / 'sweep'}")
        seconds = run(spec_file, out, cluster, say)
        stage = "the checks"
        results = checks(out / "sweep")
    except Exception as e:
        if stage == "the rehearsal spec" and isinstance(e, ValueError):
            raise  # a spec the rehearsal cannot take: one line naming it, exit 2 (experiments.errors)
        what = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
        failure = (f"{stage}: {what}", "".join(traceback.format_exception(e)))
    except KeyboardInterrupt:
        say(f"interrupted during {stage}; logs: {logs.resolve()}")  # kept below, as after a failure
        raise
    finally:
        shared.close()
        cluster.shutdown()
        _keep_logs(logs, cluster, shared, out / "sweep")
    if failure is None:
        for name, cs in results.items():
            say(f"{name}: {'passed' if all(c.ok for c in cs) else 'FAILED'}")
            for c in cs:
                say(c.line())
        bad = [(name, c) for name, cs in results.items() for c in cs if not c.ok]
        say(f"{args.spec} ({seconds:.0f} s): {'passed' if not bad else 'FAILED'}")
        if not bad:
            return 0
        name, c = bad[0]
        more = f" (and {len(bad) - 1} more failed checks)" if len(bad) > 1 else ""
        failure = (f"{name}: {c.name}: {c.detail}{more}", "\n".join(f"{n}:{c.line()}" for n, c in bad))
    (logs / "failure.txt").write_text(failure[0] + "\n\n" + failure[1].rstrip() + "\n")

    say(failed_line(failure[0], logs))
    return 1


def _say_to(path: Path) -> Callable[[str], None]:
    """A function that prints a line (flushed) and appends it to the rehearsal's own log, `path`."""

    def say(msg: str) -> None:
        print(msg, flush=True)
        with open(path, "a") as f:
            f.write(msg + "\n")

    return say


def _keep_logs(logs: Path, cluster: LocalCluster, shared, sweep_dir: Path) -> None:
    """Into `logs`: the Ray session's logs, the index of each trial's files among them (trials.txt) and the
    retriever's log. Best effort: what could not be copied is named in NOT_COPIED.txt."""
    try:
        if cluster.logs_dir is not None and cluster.logs_dir.is_dir():
            try:
                shutil.copytree(cluster.logs_dir, logs / "ray", symlinks=True, dirs_exist_ok=True)
            except shutil.Error as e:  # files that vanished or could not be read: the rest is copied
                (logs / "NOT_COPIED.txt").write_text("\n".join(str(x) for x in e.args[0]) + "\n")
            (logs / "trials.txt").write_text(_trial_logs(sweep_dir, logs / "ray"))
        if shared.retriever_url is not None:  # this rehearsal started one
            shutil.copyfile(shared.root / "retriever.log", logs / "retriever.log")
    except OSError as e:  # a full disk, say
        with open(logs / "NOT_COPIED.txt", "a") as f:
            f.write(f"{type(e).__name__}: {e}\n")


# a Ray worker's stdout/stderr file: worker-<worker id>-<job id>-<pid>.out|err
WORKER_LOG = re.compile(r"^worker-[0-9a-f]+-(?P<job>[0-9a-f]+)-\d+\.(out|err)$")


def _trial_logs(sweep_dir: Path, ray_logs: Path) -> str:
    """Per trial run: its verl job's driver log, the Ray worker logs that name its run directory, and every worker
    log of a Ray job whose logs name that run only (the verl job the trial starts)."""
    files = sorted(p for p in ray_logs.glob("worker-*") if WORKER_LOG.match(p.name))
    runs = [r.name for r in _runs(sweep_dir)]
    named = {p: {r for r in runs if r in p.read_text(errors="replace")} for p in files}
    jobs: dict[str, set[str]] = {}
    for p, rs in named.items():
        jobs.setdefault(WORKER_LOG.match(p.name)["job"], set()).update(rs)
    lines = []
    for r in runs:
        mine = [f"ray/{p.name}" for p in files if r in named[p] or jobs[WORKER_LOG.match(p.name)["job"]] == {r}]
        driver = sweep_dir / "runs" / r / DRIVER_LOG
        lines.append(f"{r}: " + " ".join([str(driver.resolve())] * driver.is_file() + (mine or ["(no Ray log)"])))
    return "\n".join(lines or ["no trial started"]) + "\n"
