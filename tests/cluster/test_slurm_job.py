"""The rendered sbatch script (cluster/slurm.sbatch) run under stub `srun`, `scontrol` and `hostname` that start
real Ray nodes on this machine: two fake hosts per job (each node its own ports and <ray_tmp>), a tiny `emapg sweep`
through the cluster beside a second job, two jobs whose heads differ sharing a worker node, the same job signalled
near its time limit (it stops, requeues itself and resumes), a worker node that dies, and (fast) what the renderer
writes for a requeued sweep and how a job picks and holds its port block.

Every job script runs in its own process group (`start_new_session`); the teardown SIGKILLs that group and
any process whose command line names the test's directory (the Ray temp dirs live there), never `ray stop`.
"""

import contextlib
import csv
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cluster.slurm import render_sbatch, sweep_dir
from experiments import pretrain

VENV_BIN = os.path.dirname(sys.executable)
HOSTS = "fakenode1 fakenode2"  # a job's hosts (the head first) unless a test names others
STUBS = {
    # `scontrol requeue <job>` is recorded in $FAKE_PIDS/requeued: Slurm's would also end the job (SIGTERM, then
    # SIGKILL, to every step), which the script does itself just before and then exits.
    "scontrol": (
        'case "$1 $2" in "show hostnames") printf "%s\\n" $FAKE_NODES;; "requeue $SLURM_JOB_ID")\n'
        '  echo "$2" >> "$FAKE_PIDS/requeued";; *) exit 1;; esac\n'
    ),
    # srun [options] -w NODE cmd...: runs cmd here, as on NODE. The hosts share this machine, so fakenode<k> gets
    # what a host of its own has: its node-local ports (--*-port=N) move up by (k - 1) * 5000 (not the head's GCS
    # port, --port: the jobs reach it as RAY_ADDRESS), Python's port checks there bind those (FAKE_OFFSET, see
    # SITECUSTOMIZE), and its <ray_tmp> is $FAKE_ROOT/<k> (paths under the batch host's, $FAKE_TMP, move there). A
    # Ray node's step (`--block`) runs in a session of its own (a step of its own, as Slurm's: a signal to the batch
    # step's process group does not reach it) and records its pid under $FAKE_PIDS/<node> (and on node $FAKE_HANG
    # sleeps instead; on node $FAKE_FAIL_ONCE the first fails). As Slurm's srun, the stub passes the signals it gets
    # on to every process of its step (all that carry its FAKE_STEP), not to the first alone.
    "srun": (
        "node= cpus= all=\n"
        "while [[ $# -gt 0 && $1 == -* ]]; do\n"
        "  case $1 in -w) node=$2; shift;; --cpus-per-task=*) cpus=1;; --export=ALL) all=1;; esac; shift\n"
        "done\n"
        # What the stub cannot honour it refuses: a step that would lose the job's environment on a site with
        # --export=NONE, a Ray node that would get one CPU on Slurm 22.05 to 23.02.
        '[[ -n $all ]] || { echo "srun stub: a step without --export=ALL" >&2; exit 1; }\n'
        "k=${node#fakenode} && export FAKE_OFFSET=$(((k - 1) * 5000))\n"
        'args=(); for a in "$@"; do\n'
        '  a=${a//"$FAKE_TMP"/"$FAKE_ROOT/$k"}\n'
        '  [[ $a =~ ^(--[a-z-]+-port)=([0-9]+)$ ]] && a="${BASH_REMATCH[1]}=$((BASH_REMATCH[2] + FAKE_OFFSET))"\n'
        '  args+=("$a"); done; set -- "${args[@]}"\n'
        'if [[ " $* " == *" --block "* ]]; then\n'
        '  [[ -n $cpus ]] || { echo "srun stub: a Ray node without --cpus-per-task" >&2; exit 1; }\n'
        '  [[ $node == "${FAKE_HANG:-}" ]] && { echo $$ > "$FAKE_PIDS/$node"; exec sleep 600; }\n'  # Ray never joins
        # a node whose first `ray start` fails at once
        '  if [[ $node == "${FAKE_FAIL_ONCE:-}" && ! -e $FAKE_PIDS/$node.failed ]]; then\n'
        '    : > "$FAKE_PIDS/$node.failed"; echo "srun stub: ray start: the GCS is not reachable" >&2; exit 1\n'
        "  fi\n"
        "  export FAKE_STEP=$node.$$\n"
        '  FAKE_OFFSET= setsid "$@" &\n'  # Ray's own Python binds the ports it is given, moved above
        '  step=$! && echo $step > "$FAKE_PIDS/$node"\n'
        "  forward() { for p in /proc/[0-9]*; do\n"
        '    grep -qzxF "FAKE_STEP=$FAKE_STEP" $p/environ 2>/dev/null && kill -$1 ${p#/proc/} 2>/dev/null; done; }\n'
        '  for s in TERM INT USR1 USR2 HUP; do trap "forward $s" $s; done\n'
        "  while kill -0 $step 2>/dev/null; do wait $step; done\n"
        "  wait $step\n"
        "  exit\n"
        "fi\n"
        'exec "$@"\n'
    ),
    # Ray's `ray start` on Linux maps 127.0.0.1 to this host's address: every fake host has that one, after
    # Debian's 127.0.1.1 and an IPv6 address ($FAKE_ALL_IPS); `--ip-address` answers 127.0.1.1 alone, as there.
    "hostname": (
        'case $1 in --all-ip-addresses|-I) exec echo "$FAKE_ALL_IPS";; --ip-address|-i) exec echo 127.0.1.1;; esac\n'
        'exec /bin/hostname "$@"\n'
    ),
    # `ctr exec <image> <command>`: a container runtime as Apptainer's `exec` is called (same host, network and
    # processes); records the program it runs in $FAKE_PIDS/container, and what runs inside sees FAKE_IMAGE.
    "ctr": '[[ $1 == exec ]] || exit 2\necho "$3" >> "$FAKE_PIDS/container"\nFAKE_IMAGE=$2 exec "${@:3}"\n',
    # `ip -4 -o addr show dev fake0`: the one interface the fake hosts have, with that address.
    "ip": (
        '[[ "$*" == "-4 -o addr show dev fake0" ]] || { echo "Device \\"${*: -1}\\" does not exist." >&2; exit 1; }\n'
        'echo "2: fake0    inet $FAKE_IP/24 brd 10.255.255.255 scope global fake0\\       valid_lft forever"\n'
    ),
}
# Python on fakenode<k> (the batch shell's on its head, a step's on its node): a port of the jobs' range binds the
# node's own, as the srun stub moves Ray's (on PYTHONPATH; FAKE_OFFSET unset or 0: nothing changes).
SITECUSTOMIZE = """import os, socket
offset = int(os.environ.get("FAKE_OFFSET") or 0)
if offset:
    bind = socket.socket.bind
    socket.socket.bind = lambda s, a: bind(
        s, (a[0], a[1] + offset) if isinstance(a, tuple) and 21000 <= a[1] < 31000 else a)
"""
# Connects through RAY_ADDRESS (this job's head) and runs one task on every node it finds; prints the image each task
# and the command ran in (the fake container runtime's FAKE_IMAGE; None: none).
ON_EVERY_NODE = """
import os, sys, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On
ray.init(log_to_driver=False)
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
where = ray.get([ray.remote(lambda: (ray.get_runtime_context().get_node_id(), os.environ.get("FAKE_IMAGE"))).options(
    scheduling_strategy=On(n, soft=False)).remote() for n in nodes])
assert sorted(node for node, _ in where) == sorted(nodes), (where, nodes)
images = sorted(str(image) for _, image in where)
print(f"ran a task on each of {len(nodes)} nodes; images: {os.environ.get('FAKE_IMAGE')}, {images}")
sys.exit(int(sys.argv[1]))
"""
# Two trials of one CPU each on nodes of one CPU each: they run at once only if the sweep uses both nodes.
TINY_SWEEP = """name: slurm_tiny
base:
  experiment: math_tiny_grpo
  overrides: {trainer.iterations: %d, trainer.save_every: 2, trainer.eval_every: %d}
space:
  algo.anchor.tau: {grid: [1.0, 0.9]}
resources: {cpu: 1, gpu: 0}
metric: eval/math_tiny/acc
"""


def _host_ip() -> str:
    """What `ray start --node-ip-address=127.0.0.1` turns into, asked in the jobs' environment: with
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (as .ci/run sets it) this process's Ray would answer 127.0.0.1."""
    code = "import ray.util; print(ray.util.get_node_ip_address())"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def _fake_hosts(root: Path, head: str) -> dict:
    """The stubs (in <root>/bin) and the environment of a batch shell on fake host `head`: fakenode1 to fakenode3,
    each with its <ray_tmp> in <root>/<k> (the site's `ray_tmp: $FAKE_TMP`)."""
    bin_dir = root / "bin"
    (bin_dir / "site").mkdir(parents=True, exist_ok=True)
    for name, body in STUBS.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    (bin_dir / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    for k in "123":
        (root / k).mkdir(exist_ok=True)
    k = int(head.removeprefix("fakenode"))
    return {
        "PATH": f"{bin_dir}:{VENV_BIN}:{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(bin_dir / "site"), os.environ.get("PYTHONPATH")])),
        "FAKE_ROOT": str(root),
        "FAKE_TMP": f"{root}/{k}",
        "FAKE_OFFSET": str((k - 1) * 5000),
    }


@pytest.fixture
def jobs():
    """start(job_id, command) -> (Popen, log path, pids dir); every process of every job killed at the end."""
    root = tempfile.mkdtemp(prefix="emapg_sl_", dir="/tmp")  # short: Ray's Unix sockets live below
    procs = []

    def start(
        job_id, command, restart=0, ready_timeout=100, hang="", fail_once="", site_extra="", all_ips=None, nodes=HOSTS
    ):
        """Run the job's script; `restart` > 0 runs it again as SLURM does after a requeue (same id, same dir);
        `hang` names a node whose `ray start` never runs, `fail_once` one whose first fails; `site_extra`: more
        site file lines; `all_ips`: what `hostname --all-ip-addresses` answers (default 127.0.1.1, an IPv6 address,
        then this host's address); `nodes`: the job's hosts, its head first."""
        job_dir = Path(root, str(job_id))
        (job_dir / "pids").mkdir(parents=True, exist_ok=True)
        (job_dir / "home").mkdir(exist_ok=True)
        site = job_dir / "site.yaml"
        site.write_text(
            "partition: test\ntime: '0:10:00'\ngpus_per_node: 0\ncpus_per_node: 1\nray_tmp: $FAKE_TMP\n"
            f"token_dir: {root}\nport_base: 21000\nport_stride: 100\nport_slots: 100\n"
            f"ready_timeout: {ready_timeout}\nenv:\n  RAY_USAGE_STATS_ENABLED: '0'\n{site_extra}"
        )
        ip = _host_ip()
        script = job_dir / "job.sbatch"
        script.write_text(render_sbatch(site, nodes=2, command=command))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_"))}
        env.update(
            _fake_hosts(Path(root), nodes.split()[0]),
            HOME=str(job_dir / "home"),  # no token in ~/.ray: every node reads the job's token file
            EMAPG_CACHE=str(pretrain.default_cache_dir()),  # the warm-started tiny model, built once per machine
            SLURM_RESTART_COUNT=str(restart),
            SLURM_JOB_ID=str(job_id),
            SLURM_JOB_NODELIST=nodes.replace(" ", ","),
            SLURM_SUBMIT_DIR=str(job_dir),
            FAKE_NODES=nodes,
            FAKE_PIDS=str(job_dir / "pids"),
            FAKE_IP=ip,
            FAKE_ALL_IPS=f"127.0.1.1 fe80::1 {ip}" if all_ips is None else all_ips,
            FAKE_HANG=hang,
            FAKE_FAIL_ONCE=fail_once,
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1",  # two Ray nodes on 127.0.0.1
        )
        log = job_dir / "job.out"
        with open(log, "a") as f:  # as sbatch --open-mode=append: a requeued job's output follows the first
            proc = subprocess.Popen(
                ["bash", str(script)], cwd=job_dir, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        procs.append(proc)
        return proc, log, job_dir / "pids"

    start.root = root
    try:
        yield start
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
            with contextlib.suppress(OSError):
                if root.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(int(pid), signal.SIGKILL)
        for proc in procs:
            proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


def _finish(proc, log, timeout=300):
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job did not end in {timeout} s; its log:\n{log.read_text()}")
    return rc, log.read_text()


def _sweep(job_dir: Path, iterations: int, eval_every: int) -> list[str]:
    """`emapg sweep` of TINY_SWEEP into the job's directory, joining the job's Ray (RAY_ADDRESS)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "tiny.yaml").write_text(TINY_SWEEP % (iterations, eval_every))
    return ["emapg", "sweep", str(job_dir / "tiny.yaml"), "--address", "auto", "--out", str(job_dir / "sw")]


def _rows(sweep: Path) -> list[dict]:
    with open(sweep / "sweep.csv") as f:
        return list(csv.DictReader(f))


def _iterations(run: Path) -> list[int]:
    return [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_jobs_at_once_a_sweep_and_a_command_each_on_its_own_two_node_cluster(jobs):
    """Two jobs on the same two hosts: each forms its own 2-node Ray (its ports, temp dirs, token). One runs a tiny
    `emapg sweep` whose two one-CPU trials run at once, one per node; the other a task on each of its nodes. Each job
    ends with its command's exit status. The second job's worker fails its first `ray start` (as when the head's GCS
    is not reachable yet): it is tried again. The second job runs in the site's `container` (a stub runtime, `ctr exec
    <image>`): its own Python (token, port choice and probes, readiness check), each node's Ray, so every task, and
    the command run through it; host tools (srun, flock, hostname) do not."""
    a = jobs(4242001, _sweep(Path(jobs.root, "4242001"), iterations=4, eval_every=2))
    container = "container: [ctr, exec, emapg.sif]\n"
    b = jobs(4242002, ["python", "-c", ON_EVERY_NODE, "3"], fail_once="fakenode2", site_extra=container)
    (rc_a, out_a), (rc_b, out_b) = _finish(*a[:2]), _finish(*b[:2])
    for rc, out, want in ((rc_a, out_a, 0), (rc_b, out_b, 3)):
        assert "emapg: Ray is up: 2 node(s)" in out, out
        assert f"the command exited with status {want}" in out and rc == want, out
    assert "ran a task on each of 2 nodes; images: emapg.sif, ['emapg.sif', 'emapg.sif']" in out_b, out_b  # 4: joined
    # the token, the port blocks, a port probe and a Ray node on each node, the readiness check, the command
    assert Path(jobs.root, "4242002", "pids", "container").read_text().split() == ["python"] * 8, out_b
    again = "emapg: job 4242002: 'ray start' on fakenode2 failed (status 1); trying again in 5 s (1 of 3)"
    assert again in out_b and "trying again" not in out_a, out_b
    heads = [re.search(r"Ray head fakenode1 \(([\d.]+:\d+)\)", out).group(1) for out in (out_a, out_b)]
    assert heads[0] != heads[1]
    # the sweep: both trials started before either finished (1 CPU per node: one trial on each), both finished
    events = re.findall(r"\] (start|done) ", out_a)
    assert events[:2] == ["start", "start"] and events.count("done") == 2, out_a
    sweep = Path(jobs.root, "4242001", "sw")
    assert [(r["status"], r["iterations"]) for r in _rows(sweep)] == [("finished", "4")] * 2
    token = Path(jobs.root, ".ray-auth-4242001")
    assert not token.exists()  # removed when the job ended, as every node's Ray temp dir
    assert not list(Path(jobs.root).glob("[123]/ray-42420*")), list(Path(jobs.root).glob("[123]/*"))


@pytest.mark.slow
def test_two_jobs_sharing_a_worker_node_never_take_the_same_port_block(jobs):
    """Job A (head fakenode1, worker fakenode2) and then job B (head fakenode3, worker fakenode2), whose ids pick the
    same block: B's head finds it free, but A's worker holds it on fakenode2 (its lock, its ports), so B takes the
    next block free on both of B's nodes. Each job forms its own 2-node Ray and runs its command. (The script before
    this checked and locked the head alone: B took A's block.)"""
    stop = Path(jobs.root, "stop")  # A's command runs a task on each node, then lasts until B has run
    wait = f'python -c "$0" 0 && until [[ -e {stop} ]]; do sleep 1; done'
    proc_a, log_a, _ = jobs(4242007, ["bash", "-c", wait, ON_EVERY_NODE])
    deadline = time.time() + 240
    while "ran a task on each of 2 nodes" not in log_a.read_text():
        assert proc_a.poll() is None and time.time() < deadline, log_a.read_text()
        time.sleep(1)
    b = jobs(4242107, ["python", "-c", ON_EVERY_NODE, "0"], nodes="fakenode3 fakenode2")
    rc_b, out_b = _finish(*b[:2])
    stop.touch()
    rc_a, out_a = _finish(proc_a, log_a)
    blocks = [re.search(r"Ray head fakenode[13] \([\d.]+:(\d+)\)", out).group(1) for out in (out_a, out_b)]
    assert blocks == ["21700", "21800"], (out_a, out_b)  # 4242107 % 100 == 4242007 % 100: block 21700 first
    for rc, out in ((rc_a, out_a), (rc_b, out_b)):
        assert "ran a task on each of 2 nodes" in out and "the command exited with status 0" in out and rc == 0, out


def _checkpointed(runs: Path, after: dict[str, int], proc, log, timeout=240) -> dict[str, int]:
    """Each run's latest checkpoint iteration, once both runs have one past `after`'s."""
    deadline = time.time() + timeout
    while True:
        latest = {}
        for ckpt in runs.glob("*/checkpoints/iter_*"):
            run, it = ckpt.parent.parent.name, int(ckpt.name.split("_")[1])
            latest[run] = max(latest.get(run, -1), it)
        if len(latest) == 2 and all(it > after.get(run, -1) for run, it in latest.items()):
            return latest
        assert proc.poll() is None and time.time() < deadline, log.read_text()
        time.sleep(0.5)


def _statuses(sweep: Path) -> list[str]:
    return [r["status"] for r in _rows(sweep)]


@pytest.mark.slow
def test_a_sweep_job_at_its_time_limit_stops_requeues_itself_and_resumes_its_trials(jobs):
    """The time limit: SIGUSR1 to the batch shell alone (--signal=B:USR1@stop_before), mid-sweep: the job stops the
    sweep (its records say interrupted), then the Ray nodes, and requeues itself (`scontrol requeue <job>`); Slurm
    starts it again with the same id and SLURM_RESTART_COUNT=1: the rendered script adds `--resume`, each trial
    continues from its checkpoint, and every run's record holds each iteration once."""
    job_dir = Path(jobs.root, "4242004")
    command = _sweep(job_dir, iterations=40, eval_every=20)
    proc, log, pids = jobs(4242004, command)
    runs, sweep = job_dir / "sw" / "runs", job_dir / "sw"
    saved = _checkpointed(runs, {}, proc, log)
    proc.send_signal(signal.SIGUSR1)  # the batch shell alone
    rc, first = _finish(proc, log, timeout=120)
    assert rc == 0 and "emapg: job 4242004: 300 s to the time limit (SIGUSR1): stopping, then requeueing" in first
    assert "emapg sweep: SIGTERM: stopping the trials" in first and "2 trial(s) not finished" in first, first
    assert "resume  tau=" not in first  # the first run started its trials
    assert _statuses(sweep) == ["interrupted"] * 2 and (pids / "requeued").read_text() == "4242004\n", first

    proc, log, _ = jobs(4242004, command, restart=1)
    rc, out = _finish(proc, log)
    out = out[len(first) :]  # the requeued run's output (appended)
    assert rc == 0 and "the command exited with status 0" in out, out
    resumed = re.findall(
        r"resume  tau=\S+ seed=0  \[\w+\] from its (?:checkpoint at iteration |"
        r"run's checkpoint iter_)0*(\d+)",
        out,
    )
    assert len(resumed) == 2 and all(int(it) >= min(saved.values()) for it in resumed), out
    assert [(r["status"], r["iterations"]) for r in _rows(sweep)] == [("finished", "40")] * 2
    for run in runs.iterdir():
        assert _iterations(run) == list(range(41)), run  # 0 is the first evaluation; no row twice, none lost


def _job_processes(job_id: int) -> list[int]:
    """Every process of the job as Slurm's process tracking sees it: all that carry its SLURM_JOB_ID (the batch
    shell and its command, every step and what runs below it: Ray's head, raylets, GCS and workers, the trials)."""
    mark = f"SLURM_JOB_ID={job_id}".encode()
    found = []
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
        with contextlib.suppress(OSError):
            if mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(int(pid))
    return found


@pytest.mark.slow
def test_a_preempted_sweep_job_stops_its_sweep_before_its_ray_nodes_and_resumes_when_requeued(jobs):
    """Preemption or scancel: Slurm signals SIGTERM to every process of every step at once (not to the batch shell
    alone), then SIGKILLs what is left after its grace time, and requeues a preempted job itself. Ray's nodes must
    outlive the sweep's stop: the sweep stops its trials (their records say interrupted) and saves its state, then
    the job stops the nodes; the requeued job resumes each trial from its checkpoint."""
    job_dir = Path(jobs.root, "4242008")
    command = _sweep(job_dir, iterations=40, eval_every=20)
    proc, log, pids = jobs(4242008, command)
    runs, sweep = job_dir / "sw" / "runs", job_dir / "sw"
    saved = _checkpointed(runs, {}, proc, log)
    everything = _job_processes(4242008)
    assert len(everything) > 10, everything  # the batch shell, the driver, two Ray nodes and their workers
    for pid in everything:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    rc, first = _finish(proc, log, timeout=120)
    for pid in _job_processes(4242008):  # the grace time is over
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert rc == 143 and "emapg: job 4242008: signalled, stopping" in first, first
    assert "2 trial(s) not finished" in first, first
    assert _statuses(sweep) == ["interrupted"] * 2 and not (pids / "requeued").exists(), first

    proc, log, _ = jobs(4242008, command, restart=1)
    rc, out = _finish(proc, log)
    out = out[len(first) :]  # the requeued run's output (appended)
    assert rc == 0 and "the command exited with status 0" in out, out
    resumed = re.findall(
        r"resume  tau=\S+ seed=0  \[\w+\] from its (?:checkpoint at iteration |run's checkpoint iter_)0*(\d+)", out
    )
    assert len(resumed) == 2 and all(int(it) >= min(saved.values()) for it in resumed), out
    assert [(r["status"], r["iterations"]) for r in _rows(sweep)] == [("finished", "40")] * 2
    for run in runs.iterdir():
        assert _iterations(run) == list(range(41)), run


@pytest.mark.slow
def test_a_dead_worker_node_ends_the_job(jobs):
    """(Each node's address taken from the site's network_interface: `ip -4 -o addr show dev fake0`.)"""
    proc, log, pids = jobs(4242003, ["sleep", "600"], site_extra="network_interface: fake0\n")
    deadline = time.time() + 240
    while "Ray is up" not in log.read_text():
        assert proc.poll() is None and time.time() < deadline, log.read_text()
        time.sleep(1)
    token = log.parent.parent / ".ray-auth-4242003"
    assert token.stat().st_mode & 0o777 == 0o600
    os.kill(int((pids / "fakenode2").read_text()), signal.SIGKILL)  # the worker's `ray start --block`
    rc, out = _finish(proc, log, timeout=60)
    assert rc == 1 and "emapg: job 4242003: the Ray worker on fakenode2 exited (status 137); ending the job" in out


@pytest.mark.slow
def test_a_node_that_never_joins_fails_the_job_after_the_readiness_timeout_naming_it(jobs):
    proc, log, _ = jobs(4242005, ["true"], ready_timeout=12, hang="fakenode2")
    rc, out = _finish(proc, log, timeout=90)
    assert rc == 1 and "emapg: Ray did not come up (after 12 s); not joined: fakenode2" in out, out
    assert "Ray is up" not in out and "the command exited" not in out
    assert "trying again" not in out, out  # the job's stop ends the hung node's step; it is not tried again


@pytest.mark.parametrize(
    ("site_extra", "all_ips", "why"),
    [
        ("", "127.0.1.1 fe80::1", "no IPv4 address but 127.* in hostname --all-ip-addresses"),
        ("network_interface: ib0\n", None, "no IPv4 address on interface ib0 (network_interface; ip -4 -o addr"),
    ],
)
def test_a_node_without_an_address_fails_the_job_naming_it(jobs, site_extra, all_ips, why):
    """Only loopback and IPv6 addresses, or no such interface: the job ends before any Ray node starts."""
    proc, log, pids = jobs(4242006, ["true"], site_extra=site_extra, all_ips=all_ips)
    rc, out = _finish(proc, log, timeout=60)
    assert rc == 1 and f"emapg: job 4242006: node fakenode1: {why}" in out, out
    assert "Ray head" not in out and not list(pids.iterdir()), out


def test_requeued_sweep_resumes(tmp_path):
    """The renderer adds `--resume` to a sweep when SLURM_RESTART_COUNT > 0 and the sweep directory holds it."""
    site = tmp_path / "site.yaml"
    site.write_text("partition: p\ntime: '1:00:00'\ngpus_per_node: 8\ncpus_per_node: 64\n")
    out = render_sbatch(site, 2, ["emapg", "sweep", "s.yaml", "--address", "auto", "--out", "/shared/sw"])
    assert "#SBATCH --requeue" in out
    assert "${SLURM_RESTART_COUNT:-0} -gt 0 && -f /shared/sw/sweep.yaml" in out
    assert "emapg sweep s.yaml --address auto --out /shared/sw $resume &" in out
    assert "--resume" not in render_sbatch(site, 2, ["python", "train.py"])
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: my_sweep\n")
    assert sweep_dir(["python", "-m", "experiments.cli", "sweep", str(spec)]) == "outputs/sweeps/my_sweep"
    assert sweep_dir(["emapg", "sweep", "x.yaml", "--out=/o"]) == "/o"
    assert sweep_dir(["emapg", "train", "experiment=x"]) is None
    site.write_text("partition: p\ntime: '1:00:00'\ngpus_per_node: 8\ncpus_per_node: 64\nport_base: 60000\n")
    with pytest.raises(ValueError, match="exceeds 65536"):
        render_sbatch(site, 2)


def _chooser(tmp_path: Path, nodes: str = "fakenode1") -> tuple[str, dict]:
    """The rendered port choice as a bash script (`job id`, then seconds to hold the lock) for a job on `nodes` (the
    fake hosts of the slow tests, the batch shell on the first), under the job's `set -euo pipefail`; and the
    environment to run it in. fakenode<k>'s lock files are in tmp_path/<k>."""
    site = tmp_path / "site.yaml"
    site.write_text(
        "partition: p\ntime: '1:00:00'\ngpus_per_node: 0\ncpus_per_node: 1\nray_tmp: $FAKE_TMP\n"
        "port_base: 23000\nport_stride: 20\nport_slots: 50\n"
    )
    script = render_sbatch(site, 1, ["true"])
    choose = script[script.index("\nhold() {") : script.index('export RAY_ADDRESS="$head_ip:$port"')]
    bash = f"set -euo pipefail\njob=$1\nnodes=({nodes})\n{choose}\necho $port\nsleep ${{2:-0}}\n"
    return bash, {**os.environ, **_fake_hosts(tmp_path, nodes.split()[0])}


def test_two_jobs_on_one_head_never_take_the_same_port_block(tmp_path):
    """The rendered port choice run twice on one host for jobs whose ids pick the same block: the first holds the
    block's lock while its job lives, the second takes the next block (the ports alone look free to both until a
    Ray head binds them: a race seen with two jobs starting at once)."""
    bash, env = _chooser(tmp_path)
    first = subprocess.Popen(["bash", "-c", bash, "-", "7", "5"], stdout=subprocess.PIPE, text=True, env=env)
    port_1 = first.stdout.readline().strip()  # printed once its lock is held; it keeps it for 5 s
    port_2 = subprocess.run(["bash", "-c", bash, "-", "7"], capture_output=True, text=True, env=env).stdout.strip()
    first.kill()
    first.wait()
    assert (port_1, port_2) == ("23140", "23160")
    port_3 = subprocess.run(["bash", "-c", bash, "-", "7"], capture_output=True, text=True, env=env).stdout.strip()
    assert port_3 == "23140"  # released with the job that held it


def test_a_block_held_or_in_use_on_a_worker_node_is_skipped(tmp_path):
    """A job on fakenode1 (head) and fakenode2: its block (23140) is locked on fakenode2 by another job and a port
    of the next (23160) is in use there; both are free on the head. It takes 23180, free on both nodes."""
    bash, env = _chooser(tmp_path, "fakenode1 fakenode2")
    lock = tmp_path / "2" / ".emapg-ports-23140"
    holder = subprocess.Popen(["flock", "-o", str(lock), "sleep", "30"])  # another job's worker on fakenode2
    with socket.socket() as busy:
        busy.bind(("", 23165 + 5000))  # fakenode2's port 23165 (the srun stub's offset)
        for _ in range(100):
            if subprocess.run(["flock", "-n", str(lock), "true"]).returncode:
                break
            time.sleep(0.1)
        done = subprocess.run(["bash", "-c", bash, "-", "7"], capture_output=True, text=True, env=env)
    holder.kill()
    holder.wait()
    assert (done.stdout.strip(), done.stderr) == ("23180", ""), done.stderr


def test_a_worker_whose_block_another_job_holds_on_its_node_fails_with_one_line(tmp_path):
    """A worker's `ray start` step holds its node's lock of the block (`held`): while another job holds it (both
    picked the block at once), the step prints the line it is given and exits 75 (not retried) without running its
    command; else its command runs holding the lock, and the node's Ray temp dir is removed after it."""
    bash, env = _chooser(tmp_path)
    held = bash[: bash.index("probe='")] + (  # as a worker's step: the lock, then its temp dir removed after it
        'bash -c "$held" - "$2" "emapg: job 7: node fakenode2: busy" bash -c "$cleaned" - "${@:3}"\n'
    )
    lock, temp = tmp_path / ".emapg-ports-23140", tmp_path / "ray-7-1"
    temp.mkdir()
    step = ["bash", "-c", held, "-", "7", str(lock), str(temp), "flock", "-n", str(lock), "echo", "lock free"]
    holder = subprocess.Popen(["flock", "-o", str(lock), "sleep", "30"])  # the other job's step (-o: it alone)
    while not lock.exists() or not subprocess.run(["flock", "-n", str(lock), "true"]).returncode:
        time.sleep(0.1)
    busy = subprocess.run(step, capture_output=True, text=True)
    holder.kill()
    holder.wait()
    assert (busy.returncode, busy.stdout, busy.stderr) == (75, "", "emapg: job 7: node fakenode2: busy\n")
    ran = subprocess.run(step, capture_output=True, text=True)
    assert (ran.returncode, ran.stdout, ran.stderr) == (1, "", "")  # the command ran, and found the lock held
    assert not temp.exists()


def test_lock_files_another_user_left_neither_end_the_job_nor_keep_their_block(tmp_path):
    """Lock files stay on the node, and another user's are not writable here (mode 644 to us; 444 as our own file
    stands for it): the job still locks such a block, and skips one whose file it cannot even read. Run without
    the permission overrides root has, so that the modes bind as they do for any user."""
    bash, env = _chooser(tmp_path)
    (tmp_path / "1" / ".emapg-ports-23140").touch(mode=0o444)
    (tmp_path / "1" / ".emapg-ports-23160").touch(mode=0o000)
    as_a_user = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    run = [*as_a_user, "bash", "-c", bash, "-", "7"]
    first = subprocess.Popen([*run, "5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    port_1 = first.stdout.readline().strip()
    second = subprocess.run(run, capture_output=True, text=True, env=env)
    first.kill()
    _, err_1 = first.communicate()
    assert (port_1, second.stdout.strip(), second.returncode) == ("23140", "23180", 0), err_1 + second.stderr
    assert second.stderr == "", second.stderr
