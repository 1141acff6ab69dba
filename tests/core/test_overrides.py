"""ema_pg_core.overrides.hydra_value: Hydra's own override parser reads back exactly the value written,
and it is the one formatter of the sweep trials and of the verl launch."""

import math
import random
from pathlib import Path

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser

from ema_pg_core.overrides import hydra_value

PARSER = OverridesParser.create()
GOLDEN = Path(__file__).parents[1] / "verl" / "golden"

VALUES = [
    None,
    True,
    False,
    0,
    -3,
    10**30,
    1e-6,
    0.1,
    -0.0,
    1e300,
    math.inf,
    -math.inf,
    math.nan,
    "",
    " ",
    "plain",
    "k3++",
    "topk_reverse",
    "a.b/c-d@e+f",
    "seq-mean-token-mean",
    "True",
    "TRUE",
    "false",
    "null",
    "NULL",
    "None",
    "inf",
    "-inf",
    "NaN",
    "Infinity",  # look like bools/null/floats
    "1",
    "-1",
    "1.5",
    "1e5",
    "1_000",
    ".5",
    "0x10",
    "1a",  # look like numbers
    "a b",
    " lead",
    "trail ",
    "a=b",
    "a,b",
    "a:b",
    "sweep:t",
    "tau=0.9",
    "[1,2]",
    "{a:1}",
    "f(x)",
    "#c",
    "a\tb",
    "a\nb",
    'quo"te',
    "it's",
    "both ' and \"",
    "back\\slash",
    "end\\",
    "end\\\\",
    "\\",
    '\\"',
    "\\'",
    "x\\'y\"",
    "/path with spaces/run 1/metrics.jsonl",
    "~/data/emapg/math/train.parquet",
    "pkg://experiments.tasks.math",
    "http://127.0.0.1:8000",
    "${oc.env:HOME}",
    "ünïcode",
    "%",
    "$x",
    [],
    {},
    [1, "a b", None, [True, {"x": "y z"}]],
    {"a": 1},
    {"a": "True", "b": {"c": [1.5, "x,y"]}},
    {1: "a", "b.c": None, "d-e": [], "f": {}},
    (0.9, 0.95),
]


def _same(a, b) -> bool:
    """Equal with the same types all the way down (True is not 1, "1" is not 1, nan is nan)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, tuple):
        a = list(a)  # a tuple is written as a list
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(k, j) and _same(a[k], b[j]) for k, j in zip(a, b))
    return a == b


def _read(text: str):
    return PARSER.parse_override(f"key={text}").value()


@pytest.mark.parametrize("quote", ["'", '"'])
@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_hydras_parser_reads_back_the_value(value, quote):
    text = hydra_value(value, quote=quote)
    assert _same(value, _read(text)), f"{value!r} written as {text!r} reads back as {_read(text)!r}"


def test_random_strings_of_the_awkward_characters_read_back():
    rng = random.Random(0)
    alphabet = "aZ_09.-+/@:=,; \t\\'\"${}[]()%*?|#!~e"
    for _ in range(2000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
        for quote in ("'", '"'):
            assert _read(hydra_value(s, quote=quote)) == s, (s, hydra_value(s, quote=quote))


def test_plain_strings_stay_unquoted_and_quotes_follow_the_preference():
    assert [hydra_value(s) for s in ("k3++", "a.b/c", "x", "True", "a b")] == ["k3++", "a.b/c", "x", "'True'", "'a b'"]
    assert hydra_value("a b", quote='"') == '"a b"' and hydra_value("it's", quote="'") == '"it\'s"'
    assert hydra_value({"digits": 2, "ops": ["+", "*"]}) == "{digits:2,ops:['+','*']}"


def test_dict_keys_hydra_cannot_read_back_are_refused():
    for key in ("a b", "true", "1", "x:y", ("t",)):
        with pytest.raises(ValueError, match="dict key"):
            hydra_value({key: 1})
    with pytest.raises(ValueError, match="quote"):
        hydra_value("x", quote="`")


def test_the_sweeps_and_the_verl_launch_share_the_formatter():
    """Regression: the verl launch had its own formatter, which wrote the string "True" unquoted (read back
    as a bool) and a dict as the string "{'a': 1}"; its emapg section was read back as YAML (1e-05: a string)."""
    from experiments.backends.verl import launch
    from experiments.backends.verl.config import split_argv
    from experiments.backends.verl.launch import to_verl
    from sweeps import spec

    assert spec.hydra_value is hydra_value and launch.hydra_value is hydra_value
    run = yaml.safe_load((GOLDEN / "math_deepscaler_8k.run.yaml").read_text())
    run.setdefault("logger", {})["project"] = "True"
    run["algo"]["kl"]["coef"] = 1e-5
    job = to_verl(run)
    args = dict(a.split("=", 1) for a in job.argv())
    assert _read(args["trainer.project_name"]) == "True"
    assert split_argv(job.argv())[1].model_dump() == job.emapg and job.emapg["kl"]["coef"] == 1e-5


def test_an_explicit_checkpoint_dir_reaches_verl_expanded_and_absolute(tmp_path, monkeypatch):
    """verl expands no `~` (`checkpoint_dir=~/ckpt` after `key=` is not expanded by the shell either) and its ranks
    resolve a relative path in their own working directory: both were written somewhere else than meant."""
    from experiments.backends.verl.launch import checkpoint_root

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = lambda path: checkpoint_root({"backend": {"verl": {"checkpoint_dir": path}}})  # noqa: E731
    assert root("~/ckpt") == str(tmp_path / "home" / "ckpt")
    assert root("ckpt/run1") == str(tmp_path / "ckpt" / "run1")
    assert root("/abs/ckpt") == "/abs/ckpt"
