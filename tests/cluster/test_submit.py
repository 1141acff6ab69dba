"""`emapg cluster` against a real Ray head started on 127.0.0.1 (dashboard / Jobs API on 127.0.0.1,
auth disabled, usage stats off): submit a command, poll its status to SUCCEEDED, read its logs,
upload a working dir, stop a running job, and (slow) run a two-trial smoke sweep as a job.

The head is started by this module with `ray start --head --block` in its own process group and
a private temp dir, and torn down by killing that process group only (never `ray stop`, which
would stop every Ray on the machine).
"""

import contextlib
import csv
import io
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cluster.submit import main
from tests.experiments.small_run import one_point_spec

REPO = Path(__file__).resolve().parents[2]


def _ports(n):
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _env():
    env = dict(
        os.environ,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        WANDB_MODE="disabled",
        HF_HUB_OFFLINE="1",
    )
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("RAY_ADDRESS", None)
    return env


def _start_head(env: dict, worker_ports: int) -> tuple[subprocess.Popen, str, str, str]:
    """(process, dashboard URL, GCS address, temp dir) of a `ray start --head` that answers HTTP; RuntimeError with
    the tail of its output if it exits first or takes 120 s (its process group is killed, its temp dir removed)."""
    gcs, dash, client, agent, agent_grpc, renv, metrics, nm, om = _ports(9)
    tmp = tempfile.mkdtemp(prefix="emapg_ray_", dir="/tmp")  # short: Ray's unix sockets live here
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [
        ray,
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash}",
        "--include-dashboard=true",
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={renv}",
        f"--metrics-export-port={metrics}",
        f"--node-manager-port={nm}",
        f"--object-manager-port={om}",
        f"--min-worker-port={worker_ports}",
        f"--max-worker-port={worker_ports + 99}",
        "--num-cpus=2",
        "--num-gpus=0",
        f"--temp-dir={tmp}",
        "--disable-usage-stats",
    ]
    log = os.path.join(tmp, "ray_start.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{dash}", time.time() + 120
    import httpx

    while True:
        with contextlib.suppress(httpx.HTTPError):  # not up yet: try again below, once a second
            httpx.get(f"{url}/api/version", timeout=2)  # any HTTP answer: with token authentication, a 401
            return proc, url, f"127.0.0.1:{gcs}", tmp
        if proc.poll() is not None or time.time() > deadline:
            tail = " | ".join(open(log).read().strip().splitlines()[-5:])
            _stop_head(proc, tmp)
            raise RuntimeError(f"Ray head did not come up (exit {proc.poll()}): {tail}")
        time.sleep(1)


def _stop_head(proc: subprocess.Popen, tmp: str) -> None:
    # Every process `ray start` spawned is in its process group (checked: none escape), so one
    # SIGKILL to the group ends exactly this head; a SIGTERM shutdown takes ~30 s on 2 cores.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _ray_head(env: dict, worker_ports: int):
    """(dashboard URL, GCS address) of a private Ray head on 127.0.0.1 started with `env`; torn down by process
    group. Its workers use ports worker_ports..+99. A second try, on fresh ports, when the first head exits before
    it answers: seen under load beside another Ray on the machine, where a port picked free was taken before
    Ray bound it (the error keeps both tries' output)."""
    pytest.importorskip("ray.job_submission")
    try:
        proc, url, gcs, tmp = _start_head(env, worker_ports)
    except RuntimeError as first:
        try:
            proc, url, gcs, tmp = _start_head(env, worker_ports)
        except RuntimeError as second:
            raise RuntimeError(f"{second}; first try: {first}") from None
    try:
        yield url, gcs
    finally:
        _stop_head(proc, tmp)


@pytest.fixture(scope="module")
def head():
    """(dashboard URL) of a private Ray head on 127.0.0.1 without token authentication."""
    with _ray_head(_env(), 20000 + (os.getpid() % 100) * 100) as (url, _):
        yield url


@pytest.fixture(scope="module")
def token_head(tmp_path_factory):
    """(dashboard URL, GCS address, token file) of a private Ray head with Ray's token authentication on."""
    token = tmp_path_factory.mktemp("token") / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {**_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    with _ray_head(env, 30000 + (os.getpid() % 20) * 100) as (url, gcs):
        yield url, gcs, token


def _run(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(argv))
    return rc, out.getvalue()


def _wait_status(url, job_id, want, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        rc, out = _run("status", job_id, "--address", url)
        assert rc == 0
        status = out.split("\t")[1]
        if status == want:
            return status
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            break
        time.sleep(1)
    raise AssertionError(
        f"job {job_id} ended {status}, wanted {want}; logs:\n{_run('logs', job_id, '--address', url)[1]}"
    )


def test_submit_status_logs(head):
    rc, out = _run("submit", "--address", head, "--working-dir", "", "--", "python", "-c", "print('ok from emapg')")
    assert rc == 0
    job_id = out.strip()
    _wait_status(head, job_id, "SUCCEEDED")
    rc, logs = _run("logs", job_id, "--address", head)
    assert rc == 0 and "ok from emapg" in logs
    rc, listing = _run("list", "--address", head)
    assert job_id in listing


def test_working_dir_is_uploaded(head, tmp_path):
    (tmp_path / "hello.py").write_text("import os; print('cwd has', sorted(os.listdir('.')))\n")
    rc, out = _run(
        "submit", "--address", head, "--working-dir", str(tmp_path), "--env", "EMAPG_X=1", "--", "python", "hello.py"
    )
    job_id = out.strip()
    _wait_status(head, job_id, "SUCCEEDED")
    assert "cwd has ['hello.py']" in _run("logs", job_id, "--address", head)[1]


def test_stop(head):
    rc, out = _run(
        "submit", "--address", head, "--working-dir", "", "--", "python", "-c", "import time; time.sleep(120)"
    )
    job_id = out.strip()
    time.sleep(3)
    rc, msg = _run("stop", job_id, "--address", head)
    assert rc == 0 and job_id in msg
    _wait_status(head, job_id, "STOPPED")


def test_sweep_entrypoint_dry_run():
    rc, out = _run("submit", "sweeps/quickstart.yaml", "--out", "/shared/sw", "--dry-run", "--working-dir", str(REPO))
    assert rc == 0
    assert "entrypoint: python -m experiments.cli sweep sweeps/quickstart.yaml --address auto --out /shared/sw" in out
    assert "'working_dir'" in out and ".venv" in out  # the checkout is uploaded, the venv excluded
    assert _run("submit", "--address", "http://x", "sweeps/q.yaml", "--", "echo")[0] == 2  # not both


def test_slurm_render(tmp_path):
    rc, out = _run(
        "slurm",
        "--site",
        str(REPO / "cluster/sites/example.yaml"),
        "--nodes",
        "3",
        "--",
        "emapg",
        "sweep",
        "sweeps/math_deepscaler_ema_pg.yaml",
        "--address",
        "auto",
    )
    assert rc == 0
    assert "#SBATCH --nodes=3" in out and "#SBATCH --partition=gpu" in out and "#SBATCH --gpus-per-node=8" in out
    assert "ray start --block" in out and '--head --port="$port"' in out and 'role=(--address="$RAY_ADDRESS")' in out
    assert "#SBATCH --requeue" in out and "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=" in out
    assert "export RAY_worker_niceness=0" in out  # the trials at the job's priority, not Ray's nice 15
    assert "emapg sweep sweeps/math_deepscaler_ema_pg.yaml --address auto $resume &" in out
    assert "base, stride, slots = 20000, 400, 100" in out and "{port_base}" not in out  # site values filled
    bad = tmp_path / "bad.yaml"
    bad.write_text("partition: gpu\n")
    assert _run("slurm", "--site", str(bad))[0] == 2


def test_slurm_help_shows_the_whole_command_form(capsys):
    with pytest.raises(SystemExit) as e:
        main(["slurm", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert out.startswith("usage: emapg cluster slurm --site SITE [--nodes N] [--job-name NAME] -- COMMAND [ARG ...]")
    assert "--nodes 2 -- \\\n      emapg sweep sweeps/math_deepscaler_ema_pg.yaml --out" in out
    assert "  sbatch job.sbatch\n" in out


def test_small_local_sweep_as_a_job(head, tmp_path):
    """A two-trial smoke sweep of the local backend, submitted with the checkout as working dir (its own
    model cache: the warm start is built inside the job, as on a fresh cluster)."""
    spec = tmp_path / "cluster_smoke.yaml"
    spec.write_text(
        "name: cluster_smoke\n"
        "base:\n  experiment: math_tiny_ema_pg\n  overrides: {smoke: true, logger: none}\n"
        "space:\n  algo.anchor.tau: {grid: [1.0, 0.9]}\n"
        "seeds: [0]\nmetric: eval/math_tiny/acc\nmode: max\nresources: {cpu: 1, gpu: 0}\nmax_concurrent: 1\n"
    )
    out_dir = tmp_path / "sweep_out"
    rc, out = _run(
        "submit",
        str(spec),
        "--address",
        head,
        "--out",
        str(out_dir),
        "--working-dir",
        str(REPO),
        "--env",
        "WANDB_MODE=disabled",
        "--env",
        "EMAPG_PROGRESS=0",
        "--env",
        f"EMAPG_CACHE={tmp_path / 'cache'}",
    )
    assert rc == 0, out
    job_id = out.strip()
    _wait_status(head, job_id, "SUCCEEDED", timeout=900)
    with open(out_dir / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted(float(r["algo.anchor.tau"]) for r in rows) == [0.9, 1.0]
    assert {r["status"] for r in rows} == {"finished"}
    rc, logs = _run("logs", job_id, "--address", head)
    assert rc == 0 and "cluster_smoke" in logs


def _emapg(*argv, env: dict) -> subprocess.CompletedProcess:
    """`emapg ...` in a fresh process (Ray reads its token once per process), HOME without ~/.ray."""
    return subprocess.run(
        [sys.executable, "-m", "experiments.cli", *argv], env=env, capture_output=True, text=True, timeout=300
    )


def test_a_token_auth_cluster_refuses_a_client_without_its_token_in_one_line(token_head, tmp_path):
    """`emapg cluster` and `emapg sweep --address` against a head with Ray's token authentication: without the
    cluster's token, one line naming the fix and exit 2 (before: a traceback); with it (RAY_AUTH_MODE=token,
    RAY_AUTH_TOKEN_PATH), the Jobs API answers."""
    url, gcs, token = token_head
    bare = {**_env(), "HOME": str(tmp_path)}  # RAY_AUTH_MODE=disabled, no token anywhere
    r = _emapg("cluster", "list", "--address", url, env=bare)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr
    assert err[0].startswith(f"emapg cluster: error: --address {url}: the Ray cluster refused this client's")
    assert "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH=" in err[0]
    given = {**bare, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    r = _emapg("cluster", "list", "--address", url, env=given)
    assert r.returncode == 0, r.stderr
    spec = one_point_spec(tmp_path / "s.yaml")
    r = _emapg("sweep", spec, "--address", gcs, "--out", str(tmp_path / "sw"), env=bare)  # Ray retries ~20 s
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert last.startswith(f"emapg sweep: error: --address {gcs}: the Ray cluster refused this driver's"), last
