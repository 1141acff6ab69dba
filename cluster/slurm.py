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


def load_site(path: str | Path) -> dict:
    """The site file's settings, every key's default filled in; UserError (one line naming the file and the key)
    when it is unreadable, holds a YAML alias (experiments.user_yaml), an unknown key, lacks a required key, or a
    value the script cannot hold as it is meant."""
    site = read(path, "site file") or {}
    if not isinstance(site, dict):
        raise UserError(f"site file {path}: must be a mapping of settings; got {type(site).__name__}")

    def bad(key: str, what: str, value) -> UserError:
        return UserError(f"site file {path}: {key} {what}; got {shown(value)}")

    for key in site:
        if key not in KEYS:
            near = difflib.get_close_matches(str(key), KEYS, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise UserError(f"site file {path}: unknown key {shown(key)}{hint}; allowed: {', '.join(KEYS)}")
    missing = [k for k in REQUIRED if site.get(k) in (None, "")]
    if missing:
        raise UserError(f"site file {path} lacks {', '.join(missing)}")
    site = {**DEFAULTS, **{k: v for k, v in site.items() if v is not None}}
    if not isinstance(site["time"], str) or not TIME.fullmatch(site["time"]):
        raise bad(
            "time",
            f'must be a quoted string in a Slurm time format ({TIME_FORMATS}), e.g. time: "48:00:00" (YAML reads an '
            "unquoted 48:00:00 as the number 172800)",
            site["time"],
        )
    for key in ("partition", "account", "qos", "constraint"):
        if key in site and not (isinstance(site[key], str) and WORD.fullmatch(site[key])):
            raise bad(key, "must be one word (no spaces or quotes)", site[key])
    if "network_interface" in site and not (
        isinstance(site["network_interface"], str) and INTERFACE.fullmatch(site["network_interface"])
    ):
        what = "must be a network interface name (up to 15 letters, digits, _ . : -), e.g. ib0"
        raise bad("network_interface", what, site["network_interface"])
    for key, low in MINIMUM.items():
        if type(site[key]) is not int or site[key] < low:
            raise bad(key, f"must be an integer >= {low}", site[key])
    if not 2 * site["stop_grace"] <= site["stop_before"] <= 65535:  # the command's grace, then the Ray nodes'
        raise bad(
            "stop_before", f"must be from 2 * stop_grace ({2 * site['stop_grace']}) to 65535", site["stop_before"]
        )
    top = site["port_base"] + site["port_slots"] * site["port_stride"]
    if top > 65536:
        raise UserError(f"site file {path}: port_base + port_slots * port_stride = {top} exceeds 65536")
    if "mem" in site and not (type(site["mem"]) in (int, str) and MEM.fullmatch(str(site["mem"]))):
        raise bad("mem", "must be megabytes (an integer >= 0, 0 = all of the node's) or a size like 64G", site["mem"])
    for key in ("ray_tmp", "token_dir"):
        if not isinstance(site[key], str) or not site[key]:
            raise bad(key, "must be a path", site[key])
    for key, what in (("exclude", "node names"), ("setup", "shell lines"), ("container", "command words")):
        if not isinstance(site.get(key, []), list) or not all(isinstance(v, str) for v in site.get(key, [])):
            raise bad(key, f"must be a list of {what}", site[key])
    if not all(site.get("container", [])):
        what = "must be a command prefix, one word each, e.g. [apptainer, exec, --nv, emapg.sif]"
        raise bad("container", what, site["container"])
    if not all(WORD.fullmatch(node) for node in site.get("exclude", [])):
        raise bad("exclude", "must be a list of node names (no spaces or quotes)", site["exclude"])
    options = site.get("sbatch_options", [])
    if not isinstance(options, list) or not all(isinstance(o, str) and SBATCH_OPTION.fullmatch(o) for o in options):
        what = "must be a list of sbatch options, each --name or --name=value (one word), e.g. [--exclusive]"
        raise bad("sbatch_options", what, options)
    for option in options:
        if SBATCH_OPTION.fullmatch(option).group(1) in SCRIPT_OPTIONS:
            raise UserError(
                f"site file {path}: sbatch_options: {shown(option)} is set by the script (from its own key where it "
                f"has one); allowed: any option but --{', --'.join(SCRIPT_OPTIONS)}"
            )
    if not isinstance(site.get("env", {}), dict):
        raise bad("env", "must be a mapping of variable names to values", site["env"])
    for name, value in site.get("env", {}).items():
        if not (isinstance(name, str) and SHELL_NAME.fullmatch(name)):
            raise UserError(f"site file {path}: env: {shown(name)} is not a shell variable name (letters, digits, _)")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            quote = "quote it: YAML reads off, no, yes, on as true/false"
            raise bad(f"env.{name}", f"must be a string or a number ({quote})", value)
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
