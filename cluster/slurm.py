"""Render ``slurm.sbatch`` from a site file (``sites/<site>.yaml``) for ``emapg cluster slurm``."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from experiments.user_yaml import read

TEMPLATE = Path(__file__).with_name("slurm.sbatch")
REQUIRED = ("partition", "time", "gpus_per_node", "cpus_per_node")
# Site keys with a default: the per-job port block, where the Ray temp dirs and the auth token live.
DEFAULTS = {
    "port_base": 20000,  # first port of block 0
    "port_stride": 400,  # ports per job: 10 for Ray's services, the rest for its workers (per node)
    "port_slots": 100,  # blocks: job id % port_slots picks one
    "ray_tmp": "/tmp",  # node-local root of the per-job Ray temp dirs (short: Unix socket paths)
    "token_dir": "$SLURM_SUBMIT_DIR",  # where the job's Ray auth token is written: storage every node reads
    "ready_timeout": 300,  # seconds for every node to join Ray
    "stop_grace": 25,  # seconds the command has, after SIGTERM, to stop before the Ray nodes do (< SLURM's KillWait)
}


def load_site(path: str | Path) -> dict:
    """The site file's settings; ValueError naming the file when it is unreadable, holds a YAML alias
    (experiments.user_yaml) or lacks a required key."""
    site = read(path, "site file") or {}
    if not isinstance(site, dict):
        raise ValueError(f"site file {path}: must be a mapping of settings; got {type(site).__name__}")
    missing = [k for k in REQUIRED if site.get(k) in (None, "")]
    if missing:
        raise ValueError(f"site file {path} lacks {', '.join(missing)}")
    for key in [k for k, v in DEFAULTS.items() if isinstance(v, int)]:
        if not isinstance(site.get(key, DEFAULTS[key]), int) or site.get(key, DEFAULTS[key]) < 1:
            raise ValueError(f"site file {path}: {key} must be a positive integer")
    if site.get("port_stride", DEFAULTS["port_stride"]) < 20:
        raise ValueError(f"site file {path}: port_stride must be >= 20 (10 service ports + the workers')")
    top = site.get("port_base", DEFAULTS["port_base"]) + site.get("port_slots", DEFAULTS["port_slots"]) * site.get(
        "port_stride", DEFAULTS["port_stride"]
    )
    if top > 65536:
        raise ValueError(f"site file {path}: port_base + port_slots * port_stride = {top} exceeds 65536")
    return site


def sweep_dir(command: list[str]) -> str | None:
    """The sweep directory of an `emapg sweep <spec> ...` command (its --out, else outputs/sweeps/<name>
    with the spec's name when the spec is readable here, else its file stem); None for other commands."""
    words = list(command)
    for i, w in enumerate(words[:-1]):
        if w == "sweep" and (i == 0 or words[i - 1] in ("emapg", "experiments.cli") or words[i - 1].endswith("/emapg")):
            rest = words[i + 1 :]
            break
    else:
        return None
    for j, w in enumerate(rest):
        if w == "--out" and j + 1 < len(rest):
            return rest[j + 1]
        if w.startswith("--out="):
            return w.split("=", 1)[1]
    spec = next((w for w in rest if not w.startswith("-")), None)
    if spec is None:
        return None
    try:
        name = (yaml.safe_load(Path(spec).read_text(encoding="utf-8")) or {}).get("name")
    except (OSError, yaml.YAMLError, AttributeError):
        name = None
    return f"outputs/sweeps/{name or Path(spec).stem}"


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
    resume = ""
    out = sweep_dir(command or [])
    if out is not None:
        resume = (
            f'resume=""  # `emapg sweep --resume` when a requeued job finds the sweep in {out}\n'
            f"if [[ ${{SLURM_RESTART_COUNT:-0}} -gt 0 && -f {shlex.quote(out)}/sweep.yaml ]]; then\n"
            "  resume=--resume\nfi\n"
        )
        cmd += " $resume"
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
        resume=resume,
        command=cmd,
        **{k: site.get(k, v) for k, v in DEFAULTS.items()},
    )
