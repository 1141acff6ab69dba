"""User input nested deeper than ``experiments.user_yaml.MAX_DEPTH`` (a sweep YAML, a site file, a ``key=value``
override) is refused in one line naming the file or override and the maximum depth, exit 2: never Python's
RecursionError from the YAML composer, Hydra's override parser or OmegaConf."""

from __future__ import annotations

import pytest

from experiments import user_yaml
from experiments.cli import main
from experiments.user_yaml import MAX_DEPTH

DEEP = 1000


def _run(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def _one_clear_line(code: int, err: str, *words: str) -> None:
    assert code == 2, err[-2000:]
    assert "Traceback" not in err and "RecursionError" not in err, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-2000:]
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0][:500]!r}"


@pytest.mark.parametrize(
    "text",
    [
        "[" * DEEP + "]" * DEEP,  # flow style
        "".join("  " * i + "k:\n" for i in range(DEEP)) + "  " * DEEP + "v\n",  # block style
        "? " + "[" * DEEP + "]" * DEEP + "\n: 1\n",  # a key
    ],
    ids=["flow", "block", "key"],
)
def test_loads_refuses_yaml_deeper_than_max_depth(text):
    with pytest.raises(user_yaml.UserError, match=f"maximum depth is {MAX_DEPTH}"):
        user_yaml.loads(text)


def test_loads_keeps_yaml_as_deep_as_max_depth():
    value = user_yaml.loads("[" * MAX_DEPTH + "1" + "]" * MAX_DEPTH)
    for _ in range(MAX_DEPTH):
        (value,) = value
    assert value == 1


def test_a_sweep_spec_nested_1000_deep_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "deep.yaml"
    spec.write_text("name: deep\nmetric: train/reward\nspace: " + "[" * DEEP + "]" * DEEP + "\n")
    code, err = _run(["sweep", str(spec), "--dry-run"], capsys)
    _one_clear_line(code, err, "deep.yaml", "line 3", f"maximum depth is {MAX_DEPTH}")


def test_a_site_file_nested_1000_deep_is_one_line(tmp_path, capsys):
    site = tmp_path / "site.yaml"
    site.write_text("partition: " + "{a: " * DEEP + "1" + "}" * DEEP + "\n")
    code, err = _run(["cluster", "slurm", "--site", str(site)], capsys)
    _one_clear_line(code, err, "site.yaml", f"maximum depth is {MAX_DEPTH}")


def test_the_sweep_dir_of_a_deep_spec_falls_back_to_its_stem(tmp_path):
    from cluster.slurm import sweep_dir

    spec = tmp_path / "deep.yaml"
    spec.write_text("name: " + "[" * DEEP + "]" * DEEP + "\n")
    assert sweep_dir(["emapg", "sweep", str(spec)]) == "outputs/sweeps/deep"


TRAIN = ["logger.name=none", "smoke=true"]


@pytest.mark.parametrize(
    "override",
    [
        "+task.knobs.x=" + "[" * DEEP + "]" * DEEP,
        "+task.knobs.x=" + "{a:" * DEEP + "1" + "}" * DEEP,
        "+task.knobs." + ".".join(["a"] * DEEP) + "=1",
        "+task.knobs." + ".".join(["a"] * 100) + "=1",  # RecursionError in OmegaConf too
        "+task.knobs.x=" + "[" * 100 + "]" * 100,
    ],
    ids=["list", "dict", "key", "key-100", "list-100"],
)
def test_a_train_override_nested_deep_is_one_line(override, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = _run(["train", *TRAIN, override], capsys)
    _one_clear_line(code, err, "+task.knobs.", f"maximum depth is {MAX_DEPTH}")
    assert not (tmp_path / "outputs").exists()


def test_an_override_at_max_depth_still_composes():
    from experiments import build

    nested = "[" * (MAX_DEPTH - 3) + "1" + "]" * (MAX_DEPTH - 3)  # task.knobs.x: 3 levels of keys
    cfg = build.compose([*TRAIN, f"+task.knobs.x={nested}", "+task.knobs.y='[[[[ a quoted string'"])
    value = cfg.task.knobs.x
    for _ in range(MAX_DEPTH - 3):
        (value,) = value
    assert value == 1 and cfg.task.knobs.y == "[[[[ a quoted string"


def test_a_pretrain_override_nested_1000_deep_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EMAPG_CACHE", str(tmp_path / "cache"))
    code, err = _run(["pretrain", "task=math_tiny", "knobs.x=" + "[" * DEEP + "]" * DEEP], capsys)
    _one_clear_line(code, err, "knobs.x", f"maximum depth is {MAX_DEPTH}")
    assert not (tmp_path / "cache").exists()
