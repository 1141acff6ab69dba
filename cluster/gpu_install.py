"""The GPU install (``cluster/gpu-install.sh``, its one source; docs/scaling-out.md) and the check that it resolves.

    python -m cluster.gpu_install            # `make check-gpu-install`, in CI: resolve it, wheels only

Each ``pip install`` between the script's README markers (the block docs/scaling-out.md quotes verbatim) is
resolved with ``pip install --dry-run --ignore-installed --report`` (pip reads the wheels' metadata files, PEP 658,
and downloads no CUDA wheel) for the machine the install is written for, not this one:

- Linux x86_64 with glibc 2.31 or newer: ``--platform manylinux_2_31_x86_64`` and every older manylinux tag
  (pip does not expand ``manylinux_2_X`` tags itself). 2.31, not lower: llguidance (vLLM's) has no x86_64
  wheel below manylinux_2_31, so a glibc 2.28 machine (RHEL 8) would build it with Rust.
- wheels only (``--only-binary=:all:``): the proof that the install compiles nothing, but for ``SDIST_ONLY``:
  antlr4-python3-runtime 4.9.3 (hydra-core 1.3 pins ``==4.9.*``) is an sdist only; pure Python, its wheel is
  built here first (it must be ``py3-none-any``) and offered from a local folder. Without it pip would
  backtrack verl's unpinned hydra-core to 0.11.
- the Pythons of ``PYTHONS`` that are available: this interpreter, and each ``python3.X`` on PATH that runs (a
  throwaway venv without pip, running this pip). ``--python 3.X`` asks for others; one without an interpreter is
  resolved by this one with ``--python-version`` (its tags and Requires-Python, but this interpreter's
  environment markers: said so in the output).

This checkout (``-e ".[verl]"``) is resolved as the requirements pyproject.toml lists for it. A target fails (exit
1, with pip's last lines) when pip cannot resolve within ``TIMEOUT_S``, when flash-attn is in the set, when
anything would be built from an sdist, when a local wheel other than ``SDIST_ONLY``'s is used, or when a package
of the install is not pinned by the lock.

The lock, ``cluster/gpu-lock.txt``: every version the install resolves to, per target Python where they differ;
the script and the verl CI venv (``--ci-constraints``) install with it (docs/scaling-out.md).

    python -m cluster.gpu_install --write-lock     # resolve afresh without the lock and rewrite it
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pip
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

try:
    import tomllib  # novermin: Python 3.10 takes the fallback below
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "cluster" / "gpu-install.sh"
BEGIN, END = "# BEGIN README", "# END README"
PYTHONS = ("3.10", "3.11", "3.12")
GLIBC = 31
PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(GLIBC, 16, -1)] + ["manylinux2014_x86_64"]
SDIST_ONLY = {"antlr4-python3-runtime": "4.9.3"}  # pure Python, published as sdists only: name -> version
HEADLINE = ("verl", "torch", "vllm", "transformers", "ray", "hydra-core", "cupy-cuda13x")
NEVER = ("flash-attn",)  # what the install must not contain (docs/verl-plugin.md, "Installing on GPUs")
LOCK = ROOT / "cluster" / "gpu-lock.txt"
CONSTRAINTS = ROOT / "constraints.txt"
# left out of the CI venv's pins: a test tool pins it to another version than the GPU stack's (name -> why)
CI_OWN = {"tabulate": "reasoning-gym, the tests' puzzle generator, pins 0.9.0"}
TIMEOUT_S = 240  # per target Python: a resolve backtracking longer fails (47-71 s here when it resolves)
MINE = f"{sys.version_info[0]}.{sys.version_info[1]}"  # this interpreter's version
NOISE = "is ignored: it is neither a file nor a directory"  # a pip.conf's missing local index folders


def readme_lines(script: Path = SCRIPT) -> list[str]:
    """The lines between the markers, as written (the block docs/scaling-out.md quotes)."""
    lines = script.read_text().splitlines()
    return lines[lines.index(BEGIN) + 1 : lines.index(END)]


def pip_installs(lines: list[str]) -> list[list[str]]:
    """The arguments of each ``pip install`` command in `lines` (continuations joined, comments and the venv
    line, which upgrades pip itself, left out)."""
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#")).replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        for part in line.split("&&"):
            argv = shlex.split(part)
            if argv[:2] == ["pip", "install"] and argv[2:] != ["-U", "pip"]:
                out.append(argv[2:])
    return out


def _project_requirements(extras: list[str]) -> list[str]:
    """What ``pip install -e ".[extras]"`` asks for besides emapg itself: pyproject.toml's dependencies and
    those of the extras (read, not built: no egg-info in the checkout, no build environment)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"]) + [r for e in extras for r in project["optional-dependencies"][e]]


def expand_checkout(args: list[str]) -> list[str]:
    """`args` with ``-e .[extras]`` / ``.[extras]`` (this checkout) replaced by its requirements."""
    out, i = [], 0
    while i < len(args):
        editable = args[i] == "-e"
        arg = args[i + 1] if editable else args[i]
        i += 2 if editable else 1
        if arg == "." or arg.startswith(".["):
            extras = arg[2:-1].split(",") if arg.startswith(".[") else []
            out += _project_requirements([e.strip() for e in extras if e.strip()])
        else:
            out += (["-e"] if editable else []) + [arg]
    return out


def without_lock(args: list[str]) -> list[str]:
    """`args` without the lock's ``-c cluster/gpu-lock.txt`` (a fresh resolve, for ``--write-lock``)."""
    out = list(args)
    while "-c" in out:
        i = out.index("-c")
        del out[i : i + 2]
    return out


def read_lock(python: str, lock: Path = LOCK) -> dict[str, str]:
    """{package: version} the lock pins for a target Python."""
    reqs = [Requirement(line) for line in lock.read_text().splitlines() if line.split("#")[0].strip()]
    return {
        canonicalize_name(r.name): next(iter(r.specifier)).version
        for r in reqs
        if r.marker is None or r.marker.evaluate({"python_version": python})
    }


def unpinned(versions: dict[str, str], pins: dict[str, str]) -> list[str]:
    """``name version`` of each resolved package that the lock does not pin at that version."""
    return sorted(f"{n} {v}" for n, v in versions.items() if pins.get(n) != v)


def lock_text(resolved: dict[str, dict[str, str]]) -> str:
    """The lock of {python: {package: version}}: one ``name==version`` line per package that every target resolves
    alike, one line per target with a ``python_version`` marker for the others."""
    lines = []
    for name in sorted(set().union(*resolved.values())):
        versions = {py: v[name] for py, v in resolved.items() if name in v}
        if len(versions) == len(resolved) and len(set(versions.values())) == 1:
            lines.append(f"{name}=={next(iter(versions.values()))}")
        else:
            lines += [f'{name}=={v} ; python_version == "{py}"' for py, v in versions.items()]
    head = [
        "# The GPU install's versions (cluster/gpu-install.sh installs with this file as constraints), resolved for",
        "# Linux x86_64 CUDA 13 with wheels only, per target Python where they differ. Written by",
        "# `python -m cluster.gpu_install --write-lock`; `make check-gpu-install` fails on a package it does not pin.",
    ]
    return "\n".join(head + lines) + "\n"


def ci_constraints(python: str = MINE) -> str:
    """The verl CI venv's constraints: the lock's versions for this Python (the GPU users' stack), then
    constraints.txt's pins of what the lock does not hold (the test tools); ``CI_OWN`` left unpinned."""
    pins = {n: v for n, v in read_lock(python).items() if n not in CI_OWN}
    lines = [line for line in CONSTRAINTS.read_text().splitlines() if line.split("#")[0].strip()]
    rest = [line for line in lines if canonicalize_name(Requirement(line.split("#")[0]).name) not in pins]
    return "\n".join([f"{n}=={v}" for n, v in sorted(pins.items())] + rest) + "\n"


def _sdist_wheels(folder: Path) -> None:
    """Build the wheels of ``SDIST_ONLY`` into `folder`; each must be pure Python (py3-none-any)."""
    for name, version in SDIST_ONLY.items():
        wheel = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", f"--no-binary={name}", "-w", str(folder)]
        subprocess.run(wheel + [f"{name}=={version}"], check=True, capture_output=True, text=True)
    built = sorted(p.name for p in folder.glob("*.whl"))
    impure = [w for w in built if not w.endswith("-py3-none-any.whl")]
    if len(built) != len(SDIST_ONLY) or impure:
        raise RuntimeError(f"the sdist-only dependencies must build to pure-Python wheels; got {built}")


def _python(version: str) -> str | None:
    """A working ``pythonX.Y`` on PATH (a pyenv shim of an inactive version is on PATH but does not run)."""
    exe = shutil.which(f"python{version}")
    if not exe:
        return None
    try:
        probe = "import sys, venv; print('%d.%d' % sys.version_info[:2])"
        out = subprocess.run([exe, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return exe if out.returncode == 0 and out.stdout.strip() == version else None


def _interpreter(version: str, tmp: Path) -> tuple[list[str], dict[str, str], str]:
    """(argv prefix running this pip, environment, how) for a target Python."""
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    if version == MINE:
        return [sys.executable, "-m", "pip"], env, f"Python {MINE} (this interpreter)"
    exe = _python(version)
    if exe:
        venv = tmp / f"venv{version}"
        subprocess.run([exe, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
        pip_home = tmp / "pip-package"
        if not pip_home.exists():
            pip_home.mkdir()
            (pip_home / "pip").symlink_to(Path(pip.__file__).parent)
        return [str(venv / "bin" / "python"), "-m", "pip"], {**env, "PYTHONPATH": str(pip_home)}, f"Python {version}"
    how = f"Python {version} tags, Python {MINE}'s markers (no python{version} here)"
    return [sys.executable, "-m", "pip"], env, how


def resolve(version: str, installs: list[list[str]], wheels: Path, tmp: Path, lock: Path | None = LOCK) -> dict:
    """Resolve every command for one target Python: {"python", "how", "seconds", "ok", "versions", "error"}."""
    prefix, env, how = _interpreter(version, tmp)
    flags = ["install", "--dry-run", "--ignore-installed", "--quiet", "--only-binary=:all:", "--find-links"]
    flags += [str(wheels)] + [f"--platform={p}" for p in PLATFORMS] + ["--python-version", version]
    row = {"python": version, "how": how, "versions": {}, "error": None}
    t = time.perf_counter()
    for i, args in enumerate(installs):
        report = tmp / f"report{version}-{i}.json"
        argv = prefix + flags + ["--report", str(report)] + expand_checkout(args)
        try:
            out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            row["error"] = f"pip install {shlex.join(args)}: no resolution within {TIMEOUT_S} s (pip backtracking)"
            break
        if out.returncode != 0:
            tail = [line for line in (out.stdout + out.stderr).splitlines() if NOISE not in line][-25:]
            row["error"] = f"pip install {shlex.join(args)}: exit {out.returncode}\n" + "\n".join(tail)
            break
        row["error"] = _check_report(json.loads(report.read_text()), wheels, row["versions"])
        if row["error"]:
            break
    loose = unpinned(row["versions"], read_lock(version, lock)) if lock and row["error"] is None else []
    if loose:
        row["error"] = f"not pinned by {lock.name} (python -m cluster.gpu_install --write-lock): {', '.join(loose)}"
    row["seconds"], row["ok"] = round(time.perf_counter() - t, 1), row["error"] is None
    return row


def _check_report(report: dict, wheels: Path, versions: dict[str, str]) -> str | None:
    local = wheels.resolve().as_uri()
    for item in report["install"]:
        name, url = canonicalize_name(item["metadata"]["name"]), item["download_info"]["url"]
        versions[name] = item["metadata"]["version"]
        if name in NEVER:
            return f"{name} {versions[name]} is in the install (docs/verl-plugin.md, 'Installing on GPUs')"
        if not url.endswith(".whl"):
            return f"{name} {versions[name]} would be built from {url}"
        if url.startswith(local) and name not in SDIST_ONLY:
            return f"{name} {versions[name]} came from the local wheels, which only SDIST_ONLY's may"
    return None


def available_pythons() -> list[str]:
    """This interpreter's version and those of ``PYTHONS`` with a working ``python3.X`` on PATH."""
    return [v for v in PYTHONS if v == MINE or _python(v)] or [MINE]


def check(pythons: list[str] | None = None, script: Path = SCRIPT, write_lock: bool = False) -> int:
    """Resolve the script's install for each target Python; with `write_lock`, for every one of ``PYTHONS``
    without the lock, and write the lock from what resolved."""
    if sys.platform != "linux" or platform.machine() != "x86_64":  # pip evaluates markers for this host
        print(
            f"check-gpu-install runs on Linux x86_64 (pip reads environment markers from the host); not on "
            f"{sys.platform} {platform.machine()}"
        )
        return 2
    pythons = list(PYTHONS) if write_lock else pythons or available_pythons()
    installs = [without_lock(a) if write_lock else a for a in pip_installs(readme_lines(script))]
    if not installs:
        print(f"no `pip install` line between the markers of {script}")
        return 1
    t0 = time.perf_counter()
    print(f"Resolving {script.name} for Linux x86_64 (glibc >= 2.{GLIBC}), wheels only:")
    for args in installs:
        print(f"  pip install {shlex.join(args)}")
    with tempfile.TemporaryDirectory(prefix="emapg-gpu-install-") as d:
        tmp = Path(d)
        wheels = tmp / "wheels"
        wheels.mkdir()
        try:
            _sdist_wheels(wheels)
        except subprocess.CalledProcessError as e:
            print(f"building {', '.join(SDIST_ONLY)} failed (exit {e.returncode}):\n{(e.stderr or '')[-2000:]}")
            return 1
        print(f"  pure-Python wheels built from sdists: {', '.join(sorted(p.name for p in wheels.glob('*.whl')))}")
        lock = None if write_lock else LOCK
        rows = [resolve(v, installs, wheels, tmp, lock) for v in pythons]  # one at a time: pip's cache helps the next
    for r in rows:
        head = ", ".join(f"{n} {r['versions'][n]}" for n in HEADLINE if n in r["versions"])
        status = f"{len(r['versions'])} packages: {head}" if r["ok"] else "FAILED"
        print(f"  {r['how']}: {status} ({r['seconds']} s)")
        if r["error"]:
            print("    " + r["error"].replace("\n", "\n    "))
    bad = [r["python"] for r in rows if not r["ok"]]
    took = time.perf_counter() - t0
    print(f"check-gpu-install: {'FAILED for Python ' + ', '.join(bad) if bad else 'resolves'} ({took:.0f} s)")
    if write_lock and not bad:
        LOCK.write_text(lock_text({r["python"]: r["versions"] for r in rows}))
        print(f"wrote {LOCK}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--script", type=Path, default=SCRIPT, help="the install script (default: %(default)s)")
    p.add_argument(
        "--python",
        action="append",
        choices=PYTHONS,
        help="a target Python (repeatable); default: the available ones (this one and python3.X on PATH)",
    )
    p.add_argument("--write-lock", action="store_true", help=f"resolve afresh and rewrite {LOCK.name}")
    p.add_argument("--ci-constraints", action="store_true", help="print the verl CI venv's constraints")
    args = p.parse_args(argv)
    if args.ci_constraints:
        print(ci_constraints(), end="")
        return 0
    return check(args.python, args.script, args.write_lock)


if __name__ == "__main__":
    sys.exit(main())
