"""Every local-backend experiment preset trains end to end through `experiments.run.run` at smoke
size (2 iterations, tiny batch, a 2-step warm start in a per-session cache) and leaves a finished
run record whose metrics include the policy's and the anchor's evaluation. The verl-backend presets
(GPU scale) are compiled against golden launches in tests/verl/test_config.py; here, that without
the [verl] extra they stop before any work with the install hint."""

import json
import sys

import pytest

from experiments import build
from experiments.cli import main
from experiments.run import run

LOCAL = [p for p in build.presets() if build.compose([f"experiment={p}"]).backend.name == "local"]
VERL = [p for p in build.presets() if p not in LOCAL]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("emapg_cache")


@pytest.mark.filterwarnings("ignore:pretrain .* did not reach target_acc")  # 2 warm-start steps, on purpose
@pytest.mark.parametrize("preset", LOCAL)
def test_preset_smoke_run(preset, cache, tmp_path, monkeypatch):
    monkeypatch.setenv("EMAPG_CACHE", str(cache))
    monkeypatch.setenv("EMAPG_PROGRESS", "0")
    cfg = build.compose(
        [f"experiment={preset}", "smoke=true", "logger=none", f"run_dir={tmp_path / 'run'}", "trainer.threads=1"]
    )
    final = run(cfg)

    task = cfg.task.name
    assert (tmp_path / "run" / "status").read_text().startswith("finished")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["experiment"], summary["iterations_done"]) == (preset, 2)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for key in (f"eval/{task}/acc", f"eval/{task}/pass@1", f"eval_anchor/{task}/acc"):
        assert key in rows[-1] and 0.0 <= final[key] <= 1.0
    assert "kl/value" in rows[-1] and "loss/pg" in rows[-1]


def test_the_presets_cover_both_backends():
    assert {"math_tiny_ema_pg", "search_tiny_grpo"} <= set(LOCAL)
    assert {"math_deepscaler_grpo", "math_deepscaler_ema_pg", "search_r1_grpo", "search_r1_ema_pg"} <= set(VERL)


@pytest.mark.parametrize("preset", VERL)
def test_verl_preset_without_the_extra_stops_with_the_install_hint(preset, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "verl", None)  # `import verl` raises, extra or not
    assert main(["train", f"experiment={preset}", f"run_dir={tmp_path / 'run'}"]) == 2
    assert "needs the [verl] extra: pip install -c constraints.txt -e '.[verl]'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing started
