"""benchmarks/verl_loss_pass.py on verl's real engines: both variants run their loss pass, the Top-k one with the
passes' fields in the batch and the KL hook on, and the table reads them (no time is asserted)."""

import pytest

pytestmark = pytest.mark.verl


def test_the_loss_pass_benchmark_runs_both_variants_and_reports_them(verl_cpu):
    from benchmarks import verl_loss_pass as lp

    times = lp.measure(2)
    assert list(times) == ["K3", "reverse Top-k, k = 32"]
    assert all(len(ts) == 2 and min(ts) > 0 for ts in times.values())
    text = lp.report(times, 2)
    assert "`python benchmarks/verl_loss_pass.py --repeats 2 --write`" in text
    assert "| K3 |" in text and "| 1.00x | +0.0 |" in text


def test_the_topk_variant_reads_both_passes_fields(verl_cpu, tmp_path):
    from benchmarks import verl_loss_pass as lp
    from ema_pg_core.config import KLConfig

    actor, ref = lp.engines_pair(str(tmp_path))
    fields = lp.topk_fields(actor, ref, KLConfig(type="topk_reverse", k=lp.K, coef=0.5))
    assert sorted(fields) == ["emapg_old_topk_ids", "emapg_ref_logp_k"]
    assert fields["emapg_old_topk_ids"].values().shape[-1] == lp.K


def test_too_few_repeats_is_one_line_and_exit_2(capsys, monkeypatch):
    from benchmarks import verl_loss_pass as lp

    monkeypatch.setattr("sys.argv", ["verl_loss_pass.py", "--repeats", "1"])
    with pytest.raises(SystemExit) as e:
        lp.main()
    assert e.value.code == 2 and capsys.readouterr().err == "--repeats must be >= 2; got 1\n"
