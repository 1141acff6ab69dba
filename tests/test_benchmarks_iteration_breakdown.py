"""benchmarks/iteration_breakdown.py: the per-iteration spread and the model.generate baseline (no timings asserted)."""

from types import SimpleNamespace

import pytest
import torch

from benchmarks import iteration_breakdown as ib
from ema_pg_core.local.tiny import build_model, build_tokenizer


def _rows(iters, probe=0.0):
    return [{"iter": t, "cpu": t / 2, "faults": i, "probe": probe} for i, t in enumerate(iters)]


def test_spread_finds_a_level_switch_at_the_first_evaluation():
    rows = _rows([1.0] * 9 + [1.5] * 20)  # iterations 2..10 at one level, 11..30 at another
    sp = ib.spread(rows, eval_every=10)
    assert sp["after_vs_before_eval"] == pytest.approx(1.5)
    assert sp["iter_max_min"] == pytest.approx(0.5 / 1.5) and sp["cpu_max_min"] == pytest.approx(0.5 / 1.5)
    assert sp["faults_max"] == 28
    few = ib.spread(_rows([1.0, 1.2]), eval_every=0)  # two iterations: the deciles stay within the data
    assert few["iter_p90_p10"] <= few["iter_max_min"] == pytest.approx(0.2 / 1.1)
    assert ib.spread(_rows([1.0]), eval_every=0)["iter_max_min"] == 0  # one iteration: no spread, no error


def test_spread_leaves_the_probe_out_and_a_flat_run_has_none():
    sp = ib.spread(_rows([2.0] * 12, probe=0.5), eval_every=5)
    assert sp["iter_p90_p10"] == sp["iter_max_min"] == 0 and sp["after_vs_before_eval"] == 1
    assert "after_vs_before_eval" not in ib.spread(_rows([1.0] * 4), eval_every=0)


def test_too_few_iterations_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["iteration_breakdown.py", "--iterations", "1"])
    with pytest.raises(SystemExit) as e:
        ib.main()
    assert e.value.code == 2
    assert capsys.readouterr().err == "--iterations must be >= 2 (the first is warm-up); got 1\n"


def test_cells_are_formatted_by_kind():
    x = {"faults_max": 1234.0, "iter_p90_p10": 0.0312, "after_vs_before_eval": 1.234, "rollout": 0.04567}
    assert [ib._cell(k, x) for k in x] == ["1234", "3.1%", "1.23x", "0.046"]
    assert ib._cell("missing", x) == "—"


def test_generate_baseline_samples_with_the_rollout_settings_and_decodes():
    tok = build_tokenizer()
    model = build_model(tok, hidden=32, layers=1, heads=2, seed=0).eval()
    rc = SimpleNamespace(temperature=0.7, top_p=0.9, max_new_tokens=5)
    state = torch.get_rng_state()
    steps = ib.hf_generate(model, tok, ["1>", "23>", "456>"], rc)
    assert 1 <= steps <= 5
    assert not torch.equal(torch.get_rng_state(), state)  # it draws from the global generator (replay forks it)


def test_work_fit_separates_the_work_from_the_runtime():
    """Time that is exactly linear in the work is all explained (R^2 = 1, nothing left); a level switch that does not
    follow the work stays in the spread after the fit."""
    steps, lens = [10, 14, 12, 16, 11, 15, 13, 9], [20.0, 30.0, 22.0, 35.0, 21.0, 29.0, 26.0, 18.0]
    work = [{"iter": 0.1 + 0.02 * s + 0.005 * n, "steps": s, "response_len": n, "probe": 0.0, "cpu": 1.0, "faults": 0}
            for s, n in zip(steps, lens)]  # fmt: skip
    fit = ib.work_fit(work)
    assert fit["fit_r2"] == pytest.approx(1.0) and fit["fit_p90_p10"] == pytest.approx(0.0, abs=1e-9)
    assert ib.spread(work, eval_every=0)["iter_p90_p10"] > 0.2  # the raw spread is the work's
    levels = [{**r, "iter": r["iter"] * (1.3 if i % 2 else 1.0)} for i, r in enumerate(work)]
    assert ib.work_fit(levels)["fit_p90_p10"] > 0.15
    assert "fit_r2" not in ib.spread([{k: v for k, v in r.items() if k != "steps"} for r in work], eval_every=0)


def test_the_fixed_work_control_gets_its_own_spread_column():
    """A flat iteration beside a control spread evenly over 0.50..0.59 s: deciles 0.509 and 0.581 (inclusive)."""
    rows = [{**r, "fixed": 0.5 + i / 100} for i, r in enumerate(_rows([1.0] * 10))]
    sp = ib.spread(rows, eval_every=0)
    assert sp["iter_p90_p10"] == 0 and sp["fixed_p90_p10"] == pytest.approx((0.581 - 0.509) / 0.545)
    assert "fixed_p90_p10" not in ib.spread(_rows([1.0] * 4), eval_every=0)  # the commit-before path has none
    assert ib._cell("fixed_p90_p10", sp) == "13.2%"
