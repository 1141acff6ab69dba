"""The SLURM site file (cluster/sites/<site>.yaml) as `emapg cluster slurm` reads it: every value checked where the
file is loaded (a bad one is one line naming the key, exit 2), every value quoted where the script holds it."""

import subprocess
from pathlib import Path

import pytest

from cluster.slurm import render_sbatch
from cluster.submit import main

EXAMPLE = Path(__file__).resolve().parents[2] / "cluster/sites/example.yaml"
BASE = "partition: gpu\ntime: '1:00:00'\ngpus_per_node: 8\ncpus_per_node: 64\n"


def _slurm(tmp_path, capsys, text):
    """(exit code, stdout, stderr) of `emapg cluster slurm` on a site file holding `text`."""
    site = tmp_path / "site.yaml"
    site.write_text(text)
    rc = main(["slurm", "--site", str(site), "--", "true"])
    out, err = capsys.readouterr()
    return rc, out, err


def _refused(tmp_path, capsys, text) -> str:
    rc, out, err = _slurm(tmp_path, capsys, text)
    assert (rc, out) == (2, ""), (rc, out)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("time", ["48:00:00", "2880", "90:00"])
def test_an_unquoted_time_is_refused_not_read_as_a_number(tmp_path, capsys, time):
    """YAML 1.1 reads `time: 48:00:00` as the integer 172800 (base 60), which Slurm would take as 120 days."""
    err = _refused(tmp_path, capsys, BASE.replace("'1:00:00'", time))
    assert "time must be a quoted string" in err and 'e.g. time: "48:00:00"' in err, err


@pytest.mark.parametrize("time", ["48h", "1:00:00:00", "1-", "-1:00", "2 days"])
def test_a_time_in_no_slurm_format_is_refused(tmp_path, capsys, time):
    err = _refused(tmp_path, capsys, BASE.replace("1:00:00", time))
    assert "time" in err and "days-hours:minutes:seconds" in err, err


@pytest.mark.parametrize("time", ["30", "30:00", "48:00:00", "2-0", "2-12:00", "2-12:00:00"])
def test_each_slurm_time_format_is_accepted(tmp_path, capsys, time):
    rc, out, err = _slurm(tmp_path, capsys, BASE.replace("1:00:00", time))
    assert rc == 0 and f"#SBATCH --time={time}\n" in out, err


def test_a_setup_string_is_refused_not_printed_one_character_a_line(tmp_path, capsys):
    err = _refused(tmp_path, capsys, BASE + "setup: module load cuda\n")
    assert "setup must be a list" in err, err


def test_an_unknown_key_is_refused_naming_the_allowed_keys(tmp_path, capsys):
    err = _refused(tmp_path, capsys, BASE + "acount: proj1\n")
    assert "unknown key 'acount' (did you mean account?)" in err and "allowed: partition, time," in err, err


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("env: {BAD-NAME: x}\n", "env: 'BAD-NAME' is not a shell variable name"),
        ("env: {WANDB_MODE: off}\n", "env.WANDB_MODE must be a string"),  # YAML 1.1: off is false
        ("env: [A, B]\n", "env must be a mapping"),
        ("exclude: node017\n", "exclude must be a list"),
        ("partition: gpu a\n", "partition must be one word"),
        ("gpus_per_node: h100:8\n", "gpus_per_node must be an integer >= 0"),
        ("mem: 64 GB\n", "mem must be"),
        ("container: apptainer exec emapg.sif\n", "container must be a list of command words"),
        ("container: [apptainer, '', emapg.sif]\n", "container must be a command prefix, one word each"),
    ],
)
def test_a_bad_value_is_refused_naming_its_key(tmp_path, capsys, line, words):
    err = _refused(tmp_path, capsys, BASE + line)
    assert words in err, err


def test_env_values_are_quoted_and_variables_in_them_expand(tmp_path):
    """A value with spaces, `;`, quotes or `$(...)` is one literal value; `$NAME` and `${NAME}` expand (the example
    site's `HF_HOME: $HOME/.cache/huggingface`). The paths ray_tmp and token_dir, and the container's words, are quoted
    the same way."""
    site = tmp_path / "site.yaml"
    site.write_text(
        BASE
        + "ray_tmp: /tmp/my dir\ntoken_dir: $HOME/tok en\n"
        + 'env:\n  MSG: "a b; touch pwned `touch pwned2` $(touch pwned3) \'q\' \\"dq\\" \\\\ $ 5$"\n'
        + "  HF_HOME: $HOME/.cache/hf\n  BRACED: ${HOME}x\n  THREADS: 4\n"
        + "container: [apptainer, exec, --bind, '$HOME/a b;c', $HOME/emapg.sif]\n"
    )
    script = render_sbatch(site, 1, ["true"])
    exports = [line for line in script.splitlines() if line.startswith("export ") and "RAY_" not in line]
    lines = [line for line in script.splitlines() if line.startswith(("tmp=", "export RAY_AUTH_MODE", "in_container="))]
    show = 'printf "%s\\n" "$MSG" "$HF_HOME" "$BRACED" "$THREADS" "$tmp" "$RAY_AUTH_TOKEN_PATH" "${in_container[@]}"'
    run = subprocess.run(
        ["bash", "-c", "\n".join(["set -eu", "job=7", *exports, *lines, show])],
        cwd=tmp_path,
        env={"HOME": "/users/u", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "a b; touch pwned `touch pwned2` $(touch pwned3) 'q' \"dq\" \\ $ 5$",
        "/users/u/.cache/hf",
        "/users/ux",
        "4",
        "/tmp/my dir/ray-7",
        "/users/u/tok en/.ray-auth-7",
        *("apptainer", "exec", "--bind", "/users/u/a b;c", "/users/u/emapg.sif"),
    ]
    assert not list(tmp_path.glob("pwned*"))


def test_the_example_site_file_renders(capsys):
    assert main(["slurm", "--site", str(EXAMPLE), "--", "true"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --time=48:00:00\n" in out and 'export HF_HOME="$HOME/.cache/huggingface"\n' in out


@pytest.mark.parametrize("value", ["ib 0", "eth0;reboot", "a_very_long_interface0", "[ib0]", "1"])
def test_a_network_interface_that_is_not_an_interface_name_is_refused(tmp_path, capsys, value):
    err = _refused(tmp_path, capsys, BASE + f"network_interface: {value}\n")
    assert "network_interface must be a network interface name" in err and "e.g. ib0" in err, err


def test_the_nodes_address_comes_from_the_named_interface_else_the_first_non_loopback_ipv4(tmp_path, capsys):
    rc, out, err = _slurm(tmp_path, capsys, BASE + "network_interface: ib0\n")
    assert rc == 0 and '-w "$node" ip -4 -o addr show dev ib0 |' in out, err
    rc, out, err = _slurm(tmp_path, capsys, BASE)
    assert rc == 0 and '-w "$node" hostname --all-ip-addresses |' in out and "--ip-address" not in out, err


def test_sbatch_options_become_sbatch_lines(tmp_path, capsys):
    text = BASE + "sbatch_options: [--exclusive, --gres=nvme:1]\n"
    rc, out, err = _slurm(tmp_path, capsys, text)
    assert rc == 0 and "#SBATCH --exclusive\n#SBATCH --gres=nvme:1\n" in out, err


@pytest.mark.parametrize("value", ["--exclusive", "[exclusive]", "[--signal=B:TERM @300]", "['--gres=a;b c']", "[1]"])
def test_an_sbatch_option_that_is_not_one_option_is_refused(tmp_path, capsys, value):
    err = _refused(tmp_path, capsys, BASE + f"sbatch_options: {value}\n")
    assert "sbatch_options must be a list of sbatch options, each --name or --name=value" in err, err


@pytest.mark.parametrize(
    "option", ["--time=2:00:00", "--nodes=4", "--requeue", "--partition=debug", "--signal=B:TERM@60"]
)
def test_an_sbatch_option_the_script_sets_is_refused(tmp_path, capsys, option):
    err = _refused(tmp_path, capsys, BASE + f"sbatch_options: [{option}]\n")
    assert f"sbatch_options: '{option}' is set by the script" in err and "allowed: any option but" in err, err


def test_the_job_stops_and_requeues_itself_stop_before_the_time_limit(tmp_path, capsys):
    """--signal=B:USR1@<stop_before>: Slurm signals the batch shell alone; its trap stops the command, then Ray, then
    `scontrol requeue`s the job. stop_before leaves room for the command's stop_grace and then the Ray nodes'."""
    rc, out, err = _slurm(tmp_path, capsys, BASE + "stop_before: 600\n")
    assert rc == 0 and "#SBATCH --signal=B:USR1@600\n" in out and 'scontrol requeue "$job"; exit 0\' USR1' in out, err
    for value in (49, 65536, "5m"):  # 2 * stop_grace (25) = 50
        err = _refused(tmp_path, capsys, BASE + f"stop_before: {value}\n")
        assert "stop_before must be" in err, err
