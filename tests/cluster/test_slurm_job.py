"""The rendered sbatch script (cluster/slurm.sbatch) run under stub `srun`, `scontrol` and `hostname` that start
real Ray nodes on this machine: two fake hosts per job (each node its own temp dir), a command through the
cluster, two jobs at once, a worker node that dies, and (fast) what the renderer writes for a requeued sweep.

Every job script runs in its own process group (`start_new_session`); the teardown SIGKILLs that group and
any process whose command line names the test's directory (the Ray temp dirs live there), never `ray stop`.
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cluster.slurm import render_sbatch, sweep_dir

VENV_BIN = os.path.dirname(sys.executable)
STUBS = {
    "scontrol": 'case "$1 $2" in "show hostnames") printf "%s\\n" $FAKE_NODES;; *) exit 1;; esac\n',
    # srun [options] -w NODE cmd...: runs cmd here; a `ray` step records its pid under $FAKE_PIDS/<node>. The
    # hosts share this machine, so the second one's node-local ports (--*-port=N) move up by 5000: what a
    # second real host gets for free.
    "srun": (
        "node=\n"
        "while [[ $# -gt 0 && $1 == -* ]]; do [[ $1 == -w ]] && { node=$2; shift; }; shift; done\n"
        "if [[ $1 == ray ]]; then\n"
        '  echo $$ > "$FAKE_PIDS/$node"\n'
        '  if [[ $node != "${FAKE_NODES%% *}" ]]; then\n'
        '    args=(); for a in "$@"; do\n'
        '      [[ $a =~ ^(--[a-z-]+-port)=([0-9]+)$ ]] && a="${BASH_REMATCH[1]}=$((BASH_REMATCH[2] + 5000))"\n'
        '      args+=("$a"); done; set -- "${args[@]}"\n'
        "  fi\n"
        "fi\n"
        'exec "$@"\n'
    ),
    # Ray's `ray start` on Linux maps 127.0.0.1 to this host's address: every fake host answers with that one.
    "hostname": '[[ $1 == --ip-address ]] && exec echo "$FAKE_IP"\nexec /bin/hostname "$@"\n',
}
# Connects through RAY_ADDRESS (this job's head) and runs one task on every node it finds.
ON_EVERY_NODE = """
import sys, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On
ray.init(log_to_driver=False)
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
where = ray.get([ray.remote(lambda: ray.get_runtime_context().get_node_id()).options(
    scheduling_strategy=On(n, soft=False)).remote() for n in nodes])
assert sorted(where) == sorted(nodes), (where, nodes)
print(f"ran a task on each of {len(nodes)} nodes", flush=True)
sys.exit(int(sys.argv[1]))
"""


def _host_ip() -> str:
    """What `ray start --node-ip-address=127.0.0.1` turns into, asked in the jobs' environment: with
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (as .ci/run sets it) this process's Ray would answer 127.0.0.1."""
    code = "import ray.util; print(ray.util.get_node_ip_address())"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture
def jobs():
    """start(job_id, command) -> (Popen, log path, pids dir); every process of every job killed at the end."""
    root = tempfile.mkdtemp(prefix="emapg_sl_", dir="/tmp")  # short: Ray's Unix sockets live below
    bin_dir = Path(root, "bin")
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    site = Path(root, "site.yaml")
    site.write_text(
        f"partition: test\ntime: '0:10:00'\ngpus_per_node: 0\ncpus_per_node: 1\nray_tmp: {root}\n"
        f"token_dir: {root}\nport_base: 21000\nport_stride: 100\nport_slots: 100\nready_timeout: 100\n"
        "env:\n  RAY_USAGE_STATS_ENABLED: '0'\n"
    )
    procs = []

    def start(job_id, command):
        job_dir = Path(root, str(job_id))
        (job_dir / "pids").mkdir(parents=True)
        (job_dir / "home").mkdir()
        script = job_dir / "job.sbatch"
        script.write_text(render_sbatch(site, nodes=2, command=command))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_"))}
        env.update(
            PATH=f"{bin_dir}:{VENV_BIN}:{env.get('PATH', '')}",
            HOME=str(job_dir / "home"),  # no token in ~/.ray: every node reads the job's token file
            SLURM_JOB_ID=str(job_id),
            SLURM_JOB_NODELIST="fakenode[1-2]",
            SLURM_SUBMIT_DIR=str(job_dir),
            FAKE_NODES="fakenode1 fakenode2",
            FAKE_PIDS=str(job_dir / "pids"),
            FAKE_IP=_host_ip(),
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1",  # two Ray nodes on 127.0.0.1
        )
        log = job_dir / "job.out"
        with open(log, "w") as f:
            proc = subprocess.Popen(
                ["bash", str(script)], cwd=job_dir, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        procs.append(proc)
        return proc, log, job_dir / "pids"

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


@pytest.mark.slow
def test_two_jobs_at_once_each_its_own_two_node_cluster(jobs):
    """Two jobs on the same two hosts: each forms its own 2-node Ray (its ports, temp dirs, token), runs a task on
    both of its nodes, and ends with its command's exit status."""
    a = jobs(4242001, ["python", "-c", ON_EVERY_NODE, "0"])
    b = jobs(4242002, ["python", "-c", ON_EVERY_NODE, "3"])
    (rc_a, out_a), (rc_b, out_b) = _finish(*a[:2]), _finish(*b[:2])
    for rc, out, want in ((rc_a, out_a, 0), (rc_b, out_b, 3)):
        assert "emapg: Ray is up: 2 node(s)" in out, out
        assert "ran a task on each of 2 nodes" in out, out  # 4 would mean the jobs joined each other
        assert f"the command exited with status {want}" in out and rc == want, out
    heads = [re.search(r"Ray head fakenode1 \(([\d.]+:\d+)\)", out).group(1) for out in (out_a, out_b)]
    assert heads[0] != heads[1]
    token = Path(a[1].parent.parent, ".ray-auth-4242001")
    assert not token.exists()  # removed when the job ended


@pytest.mark.slow
def test_a_dead_worker_node_ends_the_job(jobs):
    proc, log, pids = jobs(4242003, ["sleep", "600"])
    deadline = time.time() + 240
    while "Ray is up" not in log.read_text():
        assert proc.poll() is None and time.time() < deadline, log.read_text()
        time.sleep(1)
    token = log.parent.parent / ".ray-auth-4242003"
    assert token.stat().st_mode & 0o777 == 0o600
    os.kill(int((pids / "fakenode2").read_text()), signal.SIGKILL)  # the worker's `ray start --block`
    rc, out = _finish(proc, log, timeout=60)
    assert rc == 1 and "emapg: job 4242003: the Ray worker on fakenode2 exited (status 137); ending the job" in out


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
