"""Render ``slurm.sbatch`` from a site file (``sites/<site>.yaml``) for ``emapg cluster slurm``."""

from __future__ import annotations

import difflib
import re
import shlex
from pathlib import Path

from experiments.errors import UserError, shown
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
    "stop_before": 300,  # seconds before the time limit the job stops (as on SIGTERM) and requeues itself
}


OPTIONAL = tuple("account qos constraint mem exclude setup env network_interface sbatch_options container".split())
KEYS = REQUIRED + OPTIONAL + tuple(DEFAULTS)
TIME_FORMATS = (
    "minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds"
)
TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}")  # a days- prefix or not, then 1 to 3 numbers: Slurm's six formats
WORD = re.compile(r"[^\s'\"\\]+")  # an #SBATCH value: one word, no quotes
MEM = re.compile(r"\d+[KMGT]?", re.IGNORECASE)
SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SBATCH_OPTION = re.compile(r"--([a-z][a-z0-9-]*)(=[^\s'\"\\]+)?")  # --name or --name=value, one word
# The #SBATCH options the script writes itself, from its own keys or always: not in sbatch_options.
SCRIPT_OPTIONS = tuple(
    "job-name nodes ntasks-per-node gpus-per-node cpus-per-task mem time output open-mode requeue partition account "
    "qos constraint exclude signal".split()
)
INTERFACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,14}")  # a Linux interface name (IFNAMSIZ: 15 characters)
MINIMUM = {"gpus_per_node": 0, "cpus_per_node": 1, "port_base": 1, "port_slots": 1, "ready_timeout": 1, "stop_grace": 1}
MINIMUM["stop_before"] = 1  # and from twice stop_grace to 65535 (Slurm's --signal): checked below
MINIMUM["port_stride"] = 20  # 10 service ports + the workers'


def _matches(pattern: re.Pattern):
    return lambda value: isinstance(value, str) and pattern.fullmatch(value) is not None


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


# (key, is the value valid, what it must be): checked in this order for each key the site file has (or defaults)
CHECKS = (
    ("time", _matches(TIME), f'must be a quoted string in a Slurm time format ({TIME_FORMATS}), e.g. time: '
     '"48:00:00" (YAML reads an unquoted 48:00:00 as the number 172800)'),
    *((key, _matches(WORD), "must be one word (no spaces or quotes)")
      for key in ("partition", "account", "qos", "constraint")),
    ("network_interface", _matches(INTERFACE),
     "must be a network interface name (up to 15 letters, digits, _ . : -), e.g. ib0"),
    *((key, lambda v, low=low: type(v) is int and v >= low, f"must be an integer >= {low}")
      for key, low in MINIMUM.items()),
    ("mem", lambda v: type(v) in (int, str) and MEM.fullmatch(str(v)) is not None,
     "must be megabytes (an integer >= 0, 0 = all of the node's) or a size like 64G"),
    *((key, lambda v: isinstance(v, str) and v != "", "must be a path") for key in ("ray_tmp", "token_dir")),
    ("exclude", lambda v: _strings(v) and all(map(WORD.fullmatch, v)),
     "must be a list of node names (no spaces or quotes)"),
    ("setup", _strings, "must be a list of shell lines"),
    ("container", _strings, "must be a list of command words"),
    ("container", all, "must be a command prefix, one word each, e.g. [apptainer, exec, --nv, emapg.sif]"),
    ("sbatch_options", lambda v: isinstance(v, list) and all(map(_matches(SBATCH_OPTION), v)),
     "must be a list of sbatch options, each --name or --name=value (one word), e.g. [--exclusive]"),
    ("env", lambda v: isinstance(v, dict), "must be a mapping of variable names to values"),
)  # fmt: skip


def load_site(path: str | Path) -> dict:
    """The site file's settings, every key's default filled in; UserError (one line naming the file and the key)
    when it is unreadable, holds a YAML alias (experiments.user_yaml), an unknown key, lacks a required key, or a
    value the script cannot hold as it is meant."""
    site = read(path, "site file") or {}
    if not isinstance(site, dict):
        raise UserError(f"site file {path}: must be a mapping of settings; got {type(site).__name__}")
    for key in site:
        if key not in KEYS:
            near = difflib.get_close_matches(str(key), KEYS, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise UserError(f"site file {path}: unknown key {shown(key)}{hint}; allowed: {', '.join(KEYS)}")
    missing = [k for k in REQUIRED if site.get(k) in (None, "")]
    if missing:
        raise UserError(f"site file {path} lacks {', '.join(missing)}")
    site = {**DEFAULTS, **{k: v for k, v in site.items() if v is not None}}
    for key, valid, what in CHECKS:
        if key in site and not valid(site[key]):
            raise UserError(f"site file {path}: {key} {what}; got {shown(site[key])}")
    if not 2 * site["stop_grace"] <= site["stop_before"] <= 65535:  # the command's grace, then the Ray nodes'
        what = f"must be from 2 * stop_grace ({2 * site['stop_grace']}) to 65535"
        raise UserError(f"site file {path}: stop_before {what}; got {shown(site['stop_before'])}")
    top = site["port_base"] + site["port_slots"] * site["port_stride"]
    if top > 65536:
        raise UserError(f"site file {path}: port_base + port_slots * port_stride = {top} exceeds 65536")
    for option in site.get("sbatch_options", []):
        if SBATCH_OPTION.fullmatch(option).group(1) in SCRIPT_OPTIONS:
            raise UserError(
                f"site file {path}: sbatch_options: {shown(option)} is set by the script (from its own key where it "
                f"has one); allowed: any option but --{', --'.join(SCRIPT_OPTIONS)}"
            )
    for name, value in site.get("env", {}).items():
        if not (isinstance(name, str) and SHELL_NAME.fullmatch(name)):
            raise UserError(f"site file {path}: env: {shown(name)} is not a shell variable name (letters, digits, _)")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            quote = "quote it: YAML reads off, no, yes, on as true/false"
            raise UserError(f"site file {path}: env.{name} must be a string or a number ({quote}); got {shown(value)}")
    return site


def shell_word(value) -> str:
    """`value` as one shell word in double quotes: spaces, `;`, quotes, backquotes and `$(...)` stay literal, while
    `$NAME` and `${NAME}` expand (``HF_HOME: $HOME/.cache/huggingface``)."""
    parts = re.split(r"(\$[A-Za-z_][A-Za-z0-9_]*|\$\{[A-Za-z_][A-Za-z0-9_]*\})", str(value))
    return '"' + "".join(p if i % 2 else re.sub(r'([\\"`$])', r"\\\1", p) for i, p in enumerate(parts)) + '"'


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
        data = read(spec, "sweep spec")  # user YAML: aliases and deep nesting refused (experiments.user_yaml)
    except (UserError, OSError):  # unreadable here: the file stem
        data = None
    name = data.get("name") if isinstance(data, dict) else None
    return f"outputs/sweeps/{name or Path(spec).stem}"


def render_sbatch(
    site_path: str | Path, nodes: int = 1, command: list[str] | None = None, job_name: str = "emapg"
) -> str:
    """The sbatch script: Ray head + workers on the allocation, then `command` on the head."""
    if nodes < 1:
        raise ValueError(f"--nodes must be >= 1; got {nodes}")
    site = load_site(site_path)
    extra = [f"#SBATCH --partition={site['partition']}"]
    extra += [f"#SBATCH --{key}={site[key]}" for key in ("account", "qos", "constraint") if site.get(key)]
    if site.get("exclude"):
        extra.append(f"#SBATCH --exclude={','.join(site['exclude'])}")
    extra += [f"#SBATCH {option}" for option in site.get("sbatch_options", [])]
    # Each node's address for Ray: its first IPv4 address that is not loopback, on the site's interface if it names one.
    if site.get("network_interface"):
        query = f"ip -4 -o addr show dev {site['network_interface']}"
        no_address = f"no IPv4 address on interface {site['network_interface']} (network_interface; {query})"
    else:
        query = "hostname --all-ip-addresses"
        no_address = f"no IPv4 address but 127.* in {query} (name one with network_interface in the site file)"
    cmd = shlex.join(command) if command else "python -m experiments.cli --help  # replace: your command"
    resume = ""
    out = sweep_dir(command or [])
    if out is not None:
        resume = (
            f'resume=""  # `emapg sweep --resume` when a requeued job finds the sweep in {out}\n'
            f"if [[ ${{SLURM_RESTART_COUNT:-0}} -gt 0 && -f {shlex.quote(out)}/sweep.yaml ]]; then\n"
            "  resume=--resume\nfi\n"
        )
        cmd += " $resume"
    site.update(
        mem=site.get("mem", 0),
        ray_tmp=shell_word(site["ray_tmp"]),
        token_dir=shell_word(site["token_dir"]),
        setup="\n".join(site.get("setup", [])),
        container=" ".join(map(shell_word, site.get("container") or ["env"])),
        env="\n".join(f"export {k}={shell_word(v)}" for k, v in site.get("env", {}).items()),
        sbatch_extra="\n".join(extra),
        address_query=query,
        no_address=no_address,
    )
    return TEMPLATE.read_text().format(**site, job_name=job_name, nodes=nodes, resume=resume, command=cmd)
