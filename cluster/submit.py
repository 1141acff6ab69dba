"""``emapg cluster``: run sweeps on a Ray cluster through the Ray Jobs API, and render SLURM scripts.

    emapg cluster submit sweeps/quickstart.yaml --address http://HEAD:8265        # -> prints the job id
    emapg cluster submit --address http://HEAD:8265 -- python -c "print('ok')"     # any command
    emapg cluster status <job-id> --address http://HEAD:8265
    emapg cluster logs   <job-id> --address http://HEAD:8265 [--follow]
    emapg cluster stop   <job-id> --address http://HEAD:8265
    emapg cluster list   --address http://HEAD:8265
    emapg cluster slurm  --site cluster/sites/example.yaml --nodes 2 > job.sbatch   # then: sbatch job.sbatch

``--address`` defaults to $RAY_ADDRESS (the dashboard URL, port 8265). ``submit`` uploads the
working directory (default: this checkout, without outputs/ and .venv/) as the job's
``working_dir`` runtime env, so the cluster runs exactly this code; the nodes must already have
the dependencies installed (docs/scaling-out.md). A sweep runs as
``python -m experiments.cli sweep <spec> --address auto --out <--out>``: the job's driver joins the
cluster and Ray Tune schedules the trials on it. Against a cluster with Ray's token authentication, give the
client the cluster's token: RAY_AUTH_MODE=token plus RAY_AUTH_TOKEN_PATH (or RAY_AUTH_TOKEN); a refused
token is one line naming that fix.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from cluster.slurm import render_sbatch
from experiments.errors import is_ray_auth_error, ray_auth_line

REPO = Path(__file__).resolve().parent.parent
EXCLUDES = [".git", ".venv", "outputs", "**/__pycache__", "*.parquet", "checkpoints", "wandb"]
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def _client(address: str | None):
    from ray.job_submission import JobSubmissionClient

    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ValueError("no Ray address: pass --address http://HEAD:8265 or set RAY_ADDRESS")
    return JobSubmissionClient(address)


def runtime_env(working_dir: str | None, env: list[str], pip: list[str]) -> dict:
    """Ray runtime env: the uploaded code, environment variables, optional extra pip packages."""
    renv: dict = {"env_vars": {"WANDB_MODE": os.environ.get("WANDB_MODE", "offline"), "RAY_USAGE_STATS_ENABLED": "0"}}
    for kv in env:
        key, sep, value = kv.partition("=")
        if not sep:
            raise ValueError(f"--env takes KEY=VALUE; got {kv!r}")
        renv["env_vars"][key] = value
    if working_dir:
        renv.update(working_dir=working_dir, excludes=EXCLUDES)
    if pip:
        renv["pip"] = pip
    return renv


def submit(args) -> int:
    if args.command:
        if args.spec:
            raise ValueError("give either a sweep spec or -- and a command, not both")
        entry = args.command
    elif args.spec:
        if args.working_dir and not Path(args.spec).is_absolute() and not (Path(args.working_dir) / args.spec).exists():
            raise ValueError(f"{args.spec} is not inside the working dir {args.working_dir} that is uploaded")
        entry = ["python", "-m", "experiments.cli", "sweep", args.spec, "--address", "auto"]
        entry += ["--out", args.out] if args.out else []
    else:
        raise ValueError("give a sweep spec, or -- and a command")
    entrypoint = shlex.join(entry)
    renv = runtime_env(args.working_dir or None, args.env, args.pip)
    if args.dry_run:
        print(f"entrypoint: {entrypoint}\nruntime_env: {renv}")
        return 0
    client = _client(args.address)
    job_id = client.submit_job(
        entrypoint=entrypoint,
        runtime_env=renv,
        submission_id=args.job_id,
        metadata={"tool": "emapg", "spec": args.spec or ""},
    )
    print(job_id)
    return _follow(client, job_id) if args.wait else 0


def _follow(client, job_id: str) -> int:
    shown = 0
    while True:
        st = client.get_job_status(job_id)
        status = getattr(st, "value", st)
        logs = client.get_job_logs(job_id)
        print(logs[shown:], end="", flush=True)
        shown = len(logs)
        if status in TERMINAL:
            print(f"job {job_id}: {status}", file=sys.stderr)
            return 0 if status == "SUCCEEDED" else 1
        time.sleep(1.0)


def status(args) -> int:
    info = _client(args.address).get_job_info(args.job_id)
    print(f"{args.job_id}\t{getattr(info.status, 'value', info.status)}\t{info.message or ''}")
    return 0


def logs(args) -> int:
    client = _client(args.address)
    if args.follow:
        return _follow(client, args.job_id)
    sys.stdout.write(client.get_job_logs(args.job_id))
    return 0


def stop(args) -> int:
    stopped = _client(args.address).stop_job(args.job_id)
    print(f"{args.job_id}\t{'stop requested' if stopped else 'not running'}")
    return 0


def list_jobs(args) -> int:
    for job in _client(args.address).list_jobs():
        print(f"{job.submission_id}\t{getattr(job.status, 'value', job.status)}\t{job.entrypoint}")
    return 0


def slurm(args) -> int:
    sys.stdout.write(render_sbatch(args.site, nodes=args.nodes, command=args.command, job_name=args.job_name))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="emapg cluster",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("submit", help="submit a sweep (or any command) as a Ray job")
    s.add_argument("spec", nargs="?", help="sweep YAML, relative to the working dir (e.g. sweeps/quickstart.yaml)")
    s.add_argument("--address", default=None, help="Ray dashboard URL, e.g. http://HEAD:8265 (default $RAY_ADDRESS)")
    s.add_argument("--working-dir", default=str(REPO), help="directory uploaded as the job's working_dir ('' = none)")
    s.add_argument("--out", default=None, help="sweep directory on shared storage (passed to emapg sweep --out)")
    s.add_argument(
        "--env", action="append", default=[], help="KEY=VALUE for the job (repeatable), e.g. WANDB_MODE=online"
    )
    s.add_argument("--pip", action="append", default=[], help="extra pip requirement for the job's runtime env")
    s.add_argument("--job-id", default=None, help="submission id (default: generated)")
    s.add_argument("--wait", action="store_true", help="stream the logs until the job ends; exit 0 iff it SUCCEEDED")
    s.add_argument("--dry-run", action="store_true", help="print the entrypoint and runtime env; submit nothing")
    s.set_defaults(fn=submit)
    jobs = (("status", status, "job status"), ("logs", logs, "job logs"), ("stop", stop, "stop a job"))
    for name, fn, hlp in (*jobs, ("list", list_jobs, "jobs on the cluster")):
        q = sub.add_parser(name, help=hlp)
        if name != "list":
            q.add_argument("job_id")
        q.add_argument("--address", default=None)
        if name == "logs":
            q.add_argument("--follow", action="store_true", help="stream until the job ends")
        q.set_defaults(fn=fn)
    q = sub.add_parser(
        "slurm",
        help="print an sbatch script that starts Ray on the allocation and runs a command",
        usage="emapg cluster slurm --site SITE [--nodes N] [--job-name NAME] -- COMMAND [ARG ...] > job.sbatch",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Print an sbatch script: one Ray node per allocated node, then COMMAND on the head (the job's\n"
        "exit status is its). A requeued job resumes an `emapg sweep` COMMAND.",
        epilog="example:\n"
        "  emapg cluster slurm --site cluster/sites/mysite.yaml --nodes 2 -- \\\n"
        "      emapg sweep sweeps/math_deepscaler_ema_pg.yaml --out /shared/sweeps/math > job.sbatch\n"
        "  sbatch job.sbatch\n\n"
        'The site file\'s keys: cluster/sites/example.yaml. The job: docs/scaling-out.md, "SLURM".',
    )
    q.add_argument("--site", required=True, help="site file, e.g. cluster/sites/example.yaml")
    q.add_argument("--nodes", type=int, default=1, help="nodes to allocate, one Ray node each (default 1)")
    q.add_argument("--job-name", default="emapg", help="the job's name in the queue (default emapg)")
    q.set_defaults(fn=slurm)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1 :] if "--" in argv else []  # `-- cmd ...`: everything after is the command
    argv = argv[: argv.index("--")] if "--" in argv else argv
    args = _parser().parse_args(argv)
    args.command = command
    try:
        return args.fn(args)
    except (ValueError, ConnectionError) as e:  # a bad spec or address, an unreachable cluster: one line
        print(f"emapg cluster: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if not is_ray_auth_error(e):
            raise
        where = f"--address {args.address or os.environ.get('RAY_ADDRESS')}"
        print(f"emapg cluster: error: {ray_auth_line(where, 'client')}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
