"""Render ``slurm.sbatch`` from a site file (``sites/<site>.yaml``) for ``emapg cluster slurm``."""

from __future__ import annotations

import shlex
from pathlib import Path

from experiments.user_yaml import read

TEMPLATE = Path(__file__).with_name("slurm.sbatch")
REQUIRED = ("partition", "time", "gpus_per_node", "cpus_per_node")


def load_site(path: str | Path) -> dict:
    """The site file's settings; ValueError naming the file when it is unreadable, holds a YAML alias
    (experiments.user_yaml) or lacks a required key."""
    site = read(path, "site file") or {}
    if not isinstance(site, dict):
        raise ValueError(f"site file {path}: must be a mapping of settings; got {type(site).__name__}")
    missing = [k for k in REQUIRED if site.get(k) in (None, "")]
    if missing:
        raise ValueError(f"site file {path} lacks {', '.join(missing)}")
    return site


def render_sbatch(
    site_path: str | Path, nodes: int = 1, command: list[str] | None = None, job_name: str = "emapg"
) -> str:
    """The sbatch script: Ray head + workers on the allocation, then `command` on the head."""
    if nodes < 1:
        raise ValueError(f"--nodes must be >= 1; got {nodes}")
    site = load_site(site_path)
    extra = [f"#SBATCH --partition={site['partition']}"]
    for key, flag in (("account", "account"), ("qos", "qos"), ("constraint", "constraint")):
        if site.get(key):
            extra.append(f"#SBATCH --{flag}={site[key]}")
    if site.get("exclude"):
        extra.append(f"#SBATCH --exclude={','.join(site['exclude'])}")
    env = "\n".join(f"export {k}={v}" for k, v in (site.get("env") or {}).items())
    cmd = (
        " ".join(shlex.quote(c) for c in command)
        if command
        else "python -m experiments.cli --help  # replace: your command"
    )
    return TEMPLATE.read_text().format(
        job_name=job_name,
        nodes=nodes,
        gpus_per_node=site["gpus_per_node"],
        cpus_per_node=site["cpus_per_node"],
        mem=site.get("mem", 0),
        time=site["time"],
        sbatch_extra="\n".join(extra),
        setup="\n".join(site.get("setup") or []),
        env=env,
        ray_port=site.get("ray_port", 6379),
        dashboard_port=site.get("dashboard_port", 8265),
        command=cmd,
    )
