"""benchmarks/iteration_breakdown.py: the per-iteration spread and the model.generate baseline (no timings asserted)."""

from types import SimpleNamespace

import pytest
import torch

from benchmarks import iteration_breakdown as ib
from ema_pg_core.local.tiny import build_model, build_tokenizer


def _rows(iters, probe=0.0):
    return [{"iter": t, "probe": probe, "fixed": 1.0} for t in iters]


def test_spread_leaves_the_probe_out_and_stays_within_the_data():
    assert ib.spread(_rows([2.0] * 12, probe=0.5))["iter_p90_p10"] == 0  # a flat run has none
    assert ib.spread(_rows([1.0] * 9 + [1.5] * 20))["iter_p90_p10"] == pytest.approx(0.5 / 1.5)
    few = ib.spread(_rows([1.0, 1.2]))  # two iterations: the deciles stay within the data
    assert few["iter_p90_p10"] == pytest.approx((1.18 - 1.02) / 1.1)
    assert ib.spread(_rows([1.0]))["iter_p90_p10"] == 0  # one iteration: no spread, no error


def test_too_few_iterations_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["iteration_breakdown.py", "--iterations", "1"])
    with pytest.raises(SystemExit) as e:
        ib.main()
    assert e.value.code == 2
    assert capsys.readouterr().err == "--iterations must be >= 2 (the first is warm-up); got 1\n"


def test_cells_are_formatted_by_kind():
    x = {"generate_steps": 35.0, "iter_p90_p10": 0.0312, "rollout": 0.04567}
    assert [ib._cell(k, x) for k in x] == ["35", "3.1%", "0.046"]


def test_generate_baseline_samples_with_the_rollout_settings_and_decodes():
    tok = build_tokenizer()
    model = build_model(tok, hidden=32, layers=1, heads=2, seed=0).eval()
    rc = SimpleNamespace(temperature=0.7, top_p=0.9, max_new_tokens=5)
    state = torch.get_rng_state()
    steps = ib.hf_generate(model, tok, ["1>", "23>", "456>"], rc)
    assert 1 <= steps <= 5
    assert not torch.equal(torch.get_rng_state(), state)  # it draws from the global generator (replay forks it)


def test_the_fixed_work_control_gets_its_own_spread_column():
    """A flat iteration beside a control spread evenly over 0.50..0.59 s: deciles 0.509 and 0.581 (inclusive)."""
    rows = [{**r, "fixed": 0.5 + i / 100} for i, r in enumerate(_rows([1.0] * 10))]
    sp = ib.spread(rows)
    assert sp["iter_p90_p10"] == 0 and sp["fixed_p90_p10"] == pytest.approx((0.581 - 0.509) / 0.545)
    assert ib._cell("fixed_p90_p10", sp) == "13.2%"
