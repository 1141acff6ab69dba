"""The JSON Schema of a sweep YAML (`emapg sweep --schema`, sweeps/schema.json): a standard validator (jsonschema,
the draft pydantic emits) accepts every shipped sweep YAML and refuses what `emapg sweep` refuses on the YAML's
own terms (an unknown key, a wrong type, a value out of range); the committed file is what the command writes; an
invalid spec is one line naming the field and what is allowed (experiments.errors.validation_line). Fast: no Ray,
no config composed."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from experiments import errors
from sweeps import cli
from sweeps.spec import SpecError, parse, schema

SWEEPS = sorted((Path(__file__).resolve().parents[2] / "sweeps").glob("*.yaml"))
SCHEMA_FILE = SWEEPS[0].parent / "schema.json"
EDITOR_LINE = "# yaml-language-server: $schema=schema.json"
GOOD = {
    "name": "t",
    "base": {"experiment": "math_tiny_ema_pg"},
    "space": {"algo.anchor.tau": {"grid": [1.0, 0.9]}},
    "metric": "eval/math_tiny/acc",
}


def validator() -> jsonschema.Draft202012Validator:
    jsonschema.Draft202012Validator.check_schema(schema())
    return jsonschema.Draft202012Validator(schema())


def test_the_schema_is_draft_2020_12_and_the_committed_file_is_current():
    assert schema()["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert json.loads(SCHEMA_FILE.read_text(encoding="utf-8")) == json.loads(json.dumps(schema())), (
        "sweeps/schema.json is stale: run `emapg sweep --schema sweeps/schema.json`"
    )


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_every_shipped_sweep_validates_and_names_the_schema_for_editors(path):
    text = path.read_text(encoding="utf-8")
    assert text.splitlines()[0] == EDITOR_LINE  # the YAML language server's modeline, relative to the YAML
    errs = [e.message for e in validator().iter_errors(yaml.safe_load(text))]
    assert not errs, errs


@pytest.mark.parametrize(
    "change, where",
    [
        ({"metrc": "x"}, "metrc"),  # a typo'd top-level key
        ({"scheduler": {"type": "asha", "grace": 2}}, "grace"),  # a typo'd nested key
        ({"space": {"algo.anchor.tau": {"grid": [1.0], "choice": [1.0]}}}, "algo.anchor.tau"),
        ({"seeds": "0"}, "seeds"),  # a wrong type
        ({"max_concurrent": True}, "max_concurrent"),  # a YAML boolean is not an integer
        ({"max_concurrent": 0}, "max_concurrent"),  # out of range
        ({"seeds": [0, 0]}, "seeds"),
        ({"search": "bayes"}, "search"),
        ({"name": "a b"}, "name"),
        ({"seeds": {"adaptive": {"compare": {"key": "algo.anchor.tau", "baseline": 1.0}, "confidence": 1}}}, "seeds"),
    ],
)
def test_the_schema_refuses_what_the_spec_refuses(change, where):
    bad = {**copy.deepcopy(GOOD), **change}
    errs = list(validator().iter_errors(bad))
    assert errs and any(where in json.dumps(list(e.absolute_path) + [e.message]) for e in errs), errs
    with pytest.raises(SpecError):  # and the spec itself, before any config is composed
        parse(bad, check_config=False)
    assert not list(validator().iter_errors(GOOD))


def test_emapg_sweep_schema_writes_the_schema(tmp_path, capsys):
    assert cli.main(["--schema"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(schema()))
    out = tmp_path / "sweep.schema.json"
    assert cli.main(["--schema", str(out)]) == 0
    assert json.loads(out.read_text(encoding="utf-8")) == json.loads(json.dumps(schema()))
    assert cli.main(["--schema", str(tmp_path / "no" / "dir.json")]) == 2
    assert "emapg sweep: error:" in capsys.readouterr().err
    spec = tmp_path / "mine.yaml"
    spec.write_text("name: mine\n", encoding="utf-8")
    assert cli.main(["--schema", str(spec)]) == 2  # a sweep YAML is never overwritten
    assert "would overwrite that YAML" in capsys.readouterr().err and spec.read_text() == "name: mine\n"


@pytest.mark.parametrize(
    "yaml_text, line",
    [
        (
            "name: t\nbase: {experiment: math_tiny_ema_pg}\nspace: {algo.anchor.tau: {grid: [1.0]}}\nmetric: m\n"
            "schedular: asha\n",
            "unknown key schedular (did you mean scheduler?); allowed: name, base, space, seeds, search, scheduler, "
            "metric, mode, budget, resources, max_concurrent, backend, max_failures, max_trials, health",
        ),
        (
            "name: t\nbase: {experiment: math_tiny_ema_pg}\nspace: {algo.anchor.tau: {grid: [1.0]}}\nmetric: m\n"
            "budget: {num_samples: '4'}\n",
            "budget.num_samples must be an integer >= 1; got '4'",
        ),
        (
            "name: t\nbase: {experiment: math_tiny_ema_pg}\nspace: {algo.anchor.tau: {grid: [1.0]}}\nmetric: m\n"
            "search: {type: optuna, seed: -1}\n",
            "search.seed must be an integer in [0, 4294967295] or null; got -1",
        ),
        (
            "name: t\nbase: {experiment: math_tiny_ema_pg}\nspace: {algo.anchor.tau: {grid: [1.0]}}\nmetric: m\n"
            "mode: maximise\n",
            "mode='maximise' is not allowed; allowed values: max, min",
        ),
        (
            "name: t\nbase: {experiment: math_tiny_ema_pg}\nspace: {algo.anchor.tau: {grid: [1.0]}}\nmetric: m\n"
            "health: {kl_spike: {factor: 0.5}}\n",
            "health.kl_spike.factor must be > 1 or null; got 0.5",  # the run config's own check,
        ),
    ],
    ids=["typo", "wrong-type", "out-of-range", "not-allowed", "health-rule"],
)
def test_an_invalid_spec_is_one_line_naming_the_field_and_what_is_allowed(tmp_path, capsys, yaml_text, line):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text, encoding="utf-8")
    assert cli.main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err == f"emapg sweep: error: {path}: {line}\n", err


def test_any_pydantic_validation_error_is_one_line_and_exit_2():
    """The CLI's one error path words a pydantic error from elsewhere too (no schema: the error's own bounds)."""
    from typing import Literal

    from pydantic import BaseModel, ConfigDict, Field, ValidationError

    class Inner(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        port: int = Field(8000, ge=1, le=65535)
        kind: Literal["a", "b"] = "a"

    class Outer(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        inner: Inner

    for data, want in [
        ({"inner": {"port": 0}}, "error: inner.port must be an integer >= 1; got 0"),
        ({"inner": {"kind": "c"}}, "error: inner.kind='c' is not allowed; allowed values: 'a' or 'b'"),
        ({"inner": {"prot": 1}}, "error: unknown key inner.prot"),
        ({}, "error: `inner` is required"),
    ]:
        with pytest.raises(ValidationError) as e:
            Outer.model_validate(data)
        assert errors.classify(e.value) == (want, 2)
    with pytest.raises(ValidationError) as e:
        Outer.model_validate({"inner": {"port": 0}})
    line = errors.validation_line(e.value, Outer.model_json_schema())
    assert line == "inner.port must be an integer in [1, 65535]; got 0"
