"""The numerics pins (experiments/numerics.py): one switch, refused when misspelt or too late, recorded in the run
record, and the same numbers under every code path this CPU offers, shown by training under each of them."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import cli, numerics, records
from experiments.errors import UserError
from tests.experiments.small_run import small_run

NATIVE = {  # the code paths an x86-64 CPU with AVX-512 offers (ATen's default = no vector instructions)
    "aten_default": {"ATEN_CPU_CAPABILITY": "default"},
    "aten_avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "avx512_mkl_avx512": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "AVX512"},
    "as_found": {},
}


def test_a_misspelt_mode_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setenv(numerics.ENV, "fast")
    with pytest.raises(UserError, match="allowed: reproducible, native"):
        numerics.mode()
    assert cli.main(["report", "--help"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "emapg: error: EMAPG_NUMERICS='fast' is not a numerics mode; allowed: reproducible, native"
    ]


def test_pinning_after_torch_loaded_fails_loudly(monkeypatch):
    import torch  # noqa: F401  loaded, as in any test

    assert numerics.pin() == "reproducible"  # this process was pinned before torch loaded (tests/conftest.py)
    monkeypatch.delenv("MKL_CBWR")
    with pytest.raises(RuntimeError, match="MKL_CBWR=COMPATIBLE before torch loads"):
        numerics.pin()
    monkeypatch.setenv(numerics.ENV, "native")
    assert numerics.pin() == "native"  # nothing to set


def test_the_fingerprint_reads_back_the_pinned_paths():
    fp = numerics.fingerprint()
    assert (fp["mode"], fp["aten_capability"], fp["warm_start"]) == ("reproducible", "AVX2", None)
    assert fp["mkl_cbwr"] in ("COMPATIBLE", None)  # None: a torch without MKL
    assert fp["versions"]["torch"] and fp["threads"] >= 1 and fp["cpu"]


def test_numerics_key_ignores_the_cpu_only_when_pinned(tmp_path):
    fp = {"mode": "reproducible", "cpu": "Intel Xeon", "aten_capability": "AVX2", "threads": 2, "versions": {"t": 1}}
    amd = {**fp, "cpu": "AMD EPYC"}
    assert records.numerics_key({"numerics": fp}) == records.numerics_key({"numerics": amd})
    assert ("versions.t", 1) in records.numerics_key({"numerics": fp})
    assert records.numerics_key({"numerics": {**fp, "threads": 1}}) != records.numerics_key({"numerics": fp})
    native = {**fp, "mode": "native"}
    assert records.numerics_key({"numerics": native}) != records.numerics_key({"numerics": {**native, "cpu": "AMD"}})
    (tmp_path / records.SUMMARY).write_text(json.dumps({"numerics": fp}))
    assert records.numerics_key(tmp_path) == records.numerics_key({"numerics": fp})
    assert records.numerics_key({"run_id": "before numerics were recorded"}) is None


def _train(root: Path, name: str, env: dict[str, str]) -> dict:
    """A small `emapg train` (warm start included, in its own cache) under `env` -> its numbers: every logged value
    but times, the weights of the warm start and of the final policy and anchor, and its summary's numerics."""
    clean = {k: v for k, v in os.environ.items() if k not in (numerics.ENV, *numerics.PINS)}
    run_dir = root / name
    overrides = small_run({"experiment": "math_tiny_grpo", "trainer.iterations": 2, "model.pretrain_steps": 8})
    subprocess.run(
        [sys.executable, "-m", "experiments.cli", "train", *overrides, f"run_dir={run_dir}"],
        env={**clean, "EMAPG_CACHE": str(root / f"cache-{name}"), "EMAPG_PROGRESS": "0", **env},
        check=True,
        capture_output=True,
    )
    summary = records.read_summary(run_dir)
    values = [
        {k: v for k, v in r.items() if k != "time_s" and not k.startswith("perf/")}
        for r in records.read_metrics(run_dir)
    ]
    weights = {m: _sha(run_dir / "final" / m / "model.safetensors") for m in ("policy", "anchor")}
    return {
        "values": values,
        "weights": weights,
        "warm_start": summary["numerics"]["warm_start"],
        "numerics": summary["numerics"],
    }


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_pins_give_the_same_numbers_under_every_code_path_and_native_does_not(tmp_path):
    if "avx512f" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("the native code paths compared here include AVX-512, which this CPU lacks")
    pinned = {name: _train(tmp_path, f"pinned-{name}", env) for name, env in NATIVE.items()}
    first = next(iter(pinned.values()))
    for name, got in pinned.items():
        assert got["numerics"]["aten_capability"] == "AVX2" and got["numerics"]["mode"] == "reproducible", name
        assert (got["values"], got["weights"], got["warm_start"]) == (
            first["values"],
            first["weights"],
            first["warm_start"],
        ), name
    native = {
        name: _train(tmp_path, f"native-{name}", {**env, numerics.ENV: "native"})
        for name, env in list(NATIVE.items())[::2]
    }
    assert native["aten_default"]["numerics"]["aten_capability"] == "DEFAULT"
    assert native["aten_default"]["values"] != native["avx512_mkl_avx512"]["values"]
    assert native["aten_default"]["weights"] != native["avx512_mkl_avx512"]["weights"]
