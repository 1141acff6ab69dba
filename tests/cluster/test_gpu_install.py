"""The GPU install has one source, cluster/gpu-install.sh: docs/scaling-out.md quotes its lines, the Ray cluster
launcher runs the file, CI resolves its lines (`make check-gpu-install`, cluster/gpu_install.py). Offline: the
resolution itself is CI's step; here, that the three read the same lines and that the check's verdicts hold."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster import gpu_install as G

ROOT = Path(__file__).resolve().parents[2]


def _fenced_blocks(text: str) -> list[list[str]]:
    return [b.splitlines() for b in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)]


DOC = ROOT / "docs" / "scaling-out.md"  # the GPU install's section, "Install on GPU nodes"


def test_the_doc_quotes_the_install_script_verbatim():
    lines = G.readme_lines()
    assert lines and any(a[:2] == ["-e", ".[verl]"] for a in G.pip_installs(lines))
    doc = DOC.read_text()
    blocks = [b for b in _fenced_blocks(doc) if any("verl" in x for x in b)]
    assert lines in blocks, "docs/scaling-out.md's GPU install block differs from cluster/gpu-install.sh (BEGIN..END)"
    assert "vllm,fsdp]" not in doc and "cluster/gpu-install.sh" in doc
    assert "docs/scaling-out.md" in (ROOT / "README.md").read_text()  # where the README sends GPU users


def test_the_script_runs_exactly_its_readme_lines():
    text = G.SCRIPT.read_text().splitlines()
    body = text[text.index(G.BEGIN) + 1 : text.index(G.END)]
    assert body == G.readme_lines()
    code = [x for x in text if x.strip() and not x.startswith("#")]
    assert code[:2] == ["set -euo pipefail", 'cd "$(dirname "$0")/.."'] and code[2:] == [
        x for x in body if not x.startswith("#")
    ]
    subprocess.run(["bash", "-n", str(G.SCRIPT)], check=True)


def test_ray_cluster_setup_runs_the_script_and_nothing_else_installs():
    cfg = yaml.safe_load((ROOT / "cluster" / "ray-cluster.yaml").read_text())
    setup = cfg["setup_commands"]
    assert "import ensurepip" in setup[0] and "python3-venv" in setup[0]  # stock Ubuntu lacks it: venv fails
    assert setup[1] == "bash ~/emapg/cluster/gpu-install.sh"
    assert not [c for c in setup if re.search(r"\bpip\b", c)], "Python installs belong in cluster/gpu-install.sh"
    assert any("source ~/emapg/.venv/bin/activate" in c for c in setup)  # the venv the script makes
    assert cfg["file_mounts"]["~/emapg"] == "." and ".gitignore" in cfg["rsync_filter"]  # no local .venv up


def test_ray_cluster_nodes_start_with_the_token_every_node_gets():
    """Ray 2.60's `ray start` turns token authentication on only where a token exists (else it runs open, with a
    warning); RAY_AUTH_MODE=token makes a node without the shipped token fail instead of joining open."""
    cfg = yaml.safe_load((ROOT / "cluster" / "ray-cluster.yaml").read_text())
    assert cfg["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    starts = [c for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2 and all(c.startswith("RAY_AUTH_MODE=token ") for c in starts)


def test_ci_resolves_the_same_lines():
    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^check-gpu-install:.*\n((?:\t.*\n)+)", make, re.M).group(1).split()
    assert recipe == ["$(BIN)/python", "-m", "cluster.gpu_install"]  # which reads G.SCRIPT
    steps = [x for x in (ROOT / ".ci" / "run").read_text().splitlines() if x.startswith("make ")]
    assert steps[:2] == ["make lint", "make check-gpu-install"]


def test_pip_lines_parse_and_the_checkout_expands_to_its_requirements():
    assert G.pip_installs(["python3 -m venv v && . v/bin/activate && pip install -U pip", "# pip install x"]) == []
    assert G.pip_installs(['pip install -e ".[verl]" "a==1" \\', '    "b>=2"']) == [["-e", ".[verl]", "a==1", "b>=2"]]
    reqs = G.expand_checkout(["-e", ".[verl]", "a==1"])
    assert reqs[-1] == "a==1" and "verl[verl-core]==0.9.1" in reqs and "-e" not in reqs
    assert any(r.startswith("torch") for r in reqs)  # the core dependencies come along with the extra
    assert G.expand_checkout(["x"]) == ["x"]


def test_no_core_or_verl_dependency_needs_a_compiler():
    """reasoning-gym pins pycosat 0.6.6 (C, an sdist only): it is the [tiny] extra, not pulled by the GPU install."""
    reqs = G.expand_checkout(["-e", ".[verl]"])
    assert not [r for r in reqs if r.startswith("reasoning-gym")]
    assert "reasoning-gym>=0.1.19" in G._project_requirements(["tiny"])


def _report(*items):
    return {"install": [{"metadata": {"name": n, "version": v}, "download_info": {"url": u}} for n, v, u in items]}


def test_the_report_verdicts(tmp_path):
    pypi = "https://files.pythonhosted.org/packages/x/"
    local = tmp_path.resolve().as_uri() + "/"
    ok = _report(("torch", "2.11.0", pypi + "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl"))
    versions = {}
    assert G._check_report(ok, tmp_path, versions) is None and versions == {"torch": "2.11.0"}
    antlr = ("antlr4-python3-runtime", "4.9.3", local + "antlr4_python3_runtime-4.9.3-py3-none-any.whl")
    assert G._check_report(_report(antlr), tmp_path, {}) is None
    fa = _report(("flash_attn", "2.8.3", pypi + "flash_attn-2.8.3-cp312-cp312-linux_x86_64.whl"))
    assert "flash-attn 2.8.3 is in the install" in G._check_report(fa, tmp_path, {})
    sdist = _report(("pycosat", "0.6.6", pypi + "pycosat-0.6.6.tar.gz"))
    assert "pycosat 0.6.6 would be built from" in G._check_report(sdist, tmp_path, {})
    other = _report(("zss", "1.2.0", local + "zss-1.2.0-py3-none-any.whl"))
    assert "came from the local wheels, which only SDIST_ONLY's may" in G._check_report(other, tmp_path, {})


def test_the_target_platform_tags_cover_glibc_2_31_and_older():
    assert G.PLATFORMS[0] == "manylinux_2_31_x86_64" and G.PLATFORMS[-1] == "manylinux2014_x86_64"
    assert len(G.PLATFORMS) == 31 - 17 + 2  # manylinux_2_31 .. _2_17, and the legacy name (2014 -> 2010, 1)


@pytest.mark.parametrize("site", sorted((ROOT / "cluster" / "sites").glob("*.yaml")), ids=lambda p: p.name)
def test_site_files_load_no_cuda_12_module(site):
    lines = yaml.safe_load(site.read_text())["setup"]
    modules = [m for x in lines for m in re.findall(r"module load (cuda/\S+)", x)]
    assert all(m.startswith("cuda/13") for m in modules), modules  # torch 2.11 + cu130: CUDA 13, R580+ driver


def test_check_cli_offers_the_projects_pythons():
    assert G.PYTHONS == ("3.10", "3.11", "3.12")
    req = re.search(r'requires-python = "(.*)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert req == ">=3.10,<3.13"
    with pytest.raises(SystemExit):
        G.main(["--python", "3.9"])


def _pip_lines_of(path: Path) -> list[list[str]]:
    """The arguments of each `pip install -e ".[verl]" ...` in a file (continuations joined; a line that ends in
    a quote closing a `bash -c '...'` is cut there)."""
    text = path.read_text().replace("\\\n", " ")
    return [shlex.split(m) for m in re.findall(r'pip install (-e "\.\[verl\]"[^\'\n]*)', text)]


@pytest.mark.parametrize(
    "path", ["cluster/emapg.def", "docs/containers.md", "docs/verl-plugin.md"], ids=lambda p: p.split("/")[-1]
)
def test_every_container_route_installs_the_scripts_pip_line(path):
    (script_line,) = G.pip_installs(G.readme_lines())
    found = _pip_lines_of(ROOT / path)
    assert found and all(argv == script_line for argv in found), (path, found)


def test_the_lock_round_trips_per_python(tmp_path):
    resolved = {"3.10": {"a": "1", "b": "2", "t": "1"}, "3.11": {"a": "1", "b": "3"}}
    lock = tmp_path / "lock.txt"
    lock.write_text(G.lock_text(resolved))
    assert 'b==2 ; python_version == "3.10"' in lock.read_text().splitlines()
    assert G.read_lock("3.10", lock) == resolved["3.10"] and G.read_lock("3.11", lock) == resolved["3.11"]
    assert G.unpinned({"a": "1", "b": "3", "c": "0.1"}, G.read_lock("3.10", lock)) == ["b 3", "c 0.1"]


def test_the_install_and_the_verl_ci_venv_take_the_lock():
    """The script, every container route (above) and the verl CI venv install the lock's versions: CI's
    `make test-verl` and rehearsals run on the torch and transformers GPU users get."""
    (script_line,) = G.pip_installs(G.readme_lines())
    assert script_line[-2:] == ["-c", "cluster/gpu-lock.txt"] and G.without_lock(script_line) == script_line[:-2]
    for python in G.PYTHONS:
        pins = G.read_lock(python)
        assert pins["torch"] == "2.11.0" and pins["verl"] == "0.9.1" and "flash-attn" not in pins
    ci = {G.canonicalize_name(G.Requirement(x).name): x for x in G.ci_constraints("3.11").splitlines()}
    lock = G.read_lock("3.11")
    assert ci["torch"] == "torch==2.11.0" and ci["transformers"] == f"transformers=={lock['transformers']}"
    assert "tabulate" in lock and "tabulate" not in ci  # CI_OWN: reasoning-gym's own pin decides
    assert "pytest-timeout" in ci and len(ci) == len(G.ci_constraints("3.11").splitlines())  # each name once
    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^\$\(VERL_STAMP\):.*\n((?:\t.*\n)+)", make, re.M).group(1)
    assert "-m cluster.gpu_install --ci-constraints > $(VERL_VENV)/constraints.txt" in recipe
    assert '-c $(VERL_VENV)/constraints.txt -e ".[dev,verl]"' in recipe
