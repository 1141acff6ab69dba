"""analysis.report on a synthetic sweep directory and on synthetic audit records."""

from __future__ import annotations

import json

import pytest

from analysis import report


def test_report_on_sweep(sweep_dir, tmp_path):
    out = tmp_path / "report"
    paths = report.report(sweep_dir, out, reps=100)
    names = {p.name for p in paths}
    for stem in ("runs", "math_tiny_main", "math_tiny_passk"):
        assert {f"{stem}.md", f"{stem}.tex", f"{stem}.csv"} <= names
    for stem in ("math_tiny_curve_math_tiny", "math_tiny_dynamics", "math_tiny_ablation_anchor_tau"):
        assert {f"{stem}.png", f"{stem}.pdf"} <= names
    assert {"index.md", "index.html", "provenance.json"} <= names
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)

    index = (out / "index.md").read_text()
    assert "11 runs found (1 failed, 9 finished, 1 running)" in index
    assert "(running, truncated)" in index and "(failed)" in index  # listed, not dropped
    assert "kl_type never varies with the other knobs held fixed" in index  # skipped, with reason
    assert "[png](math_tiny_curve_math_tiny.png)" in index
    assert "math_tiny: eval/math_tiny/acc (and the anchor's) vs iteration" in index  # task == benchmark:
    assert "math_tiny · math_tiny" not in index  # named once
    html = (out / "index.html").read_text()
    assert '<img src="math_tiny_dynamics.png"' in html and "<table" in html
    # the front page: results first, the main table inline, provenance once per section and collapsed
    assert index.index("## math_tiny") < index.index("## All runs") < index.index("## Skipped")
    main_md = (out / "math_tiny_main.md").read_text().split("\n\n", 1)[1]  # the table below the caption
    assert main_md.splitlines()[0] in index and "| GRPO (k3) — ours, 3 seeds |" in index
    assert index.count("[^1]") == 2 and index.count("[^2]") == 2 and "[^3]" not in index  # reference + footnote
    assert index.count("runs (9): math_tiny__") == 1 and index.count("runs (11): math_tiny__") == 1
    assert html.count("<details") == 2 and html.count("runs (9): math_tiny__") == 1
    assert html.index("<h2>math_tiny</h2>") < html.index("<h2>All runs</h2>")
    assert "<td>GRPO (k3) — ours, 3 seeds</td>" in html or "<th>GRPO (k3) — ours, 3 seeds</th>" in html

    prov = {o["title"]: o for o in json.loads((out / "provenance.json").read_text())["outputs"]}
    main = prov["math_tiny: policy acc, pass@1 and anchor acc per method"]
    assert len(main["run_ids"]) == 9 and len(main["config_hashes"]) == 9 and len(main["wandb_run_ids"]) == 9
    assert not any("s7__" in r or "s8__" in r for r in main["run_ids"])  # unfinished excluded
    assert len(prov["All runs with status"]["run_ids"]) == 11


def test_report_include_incomplete(sweep_dir, tmp_path):
    report.report(sweep_dir, tmp_path / "r", reps=50, include_incomplete=True)
    main = (tmp_path / "r" / "math_tiny_main.md").read_text()
    assert "— ours, 5 seeds" in main  # 3 + failed + partial


def test_report_errors(tmp_path):
    with pytest.raises(ValueError, match="no run records"):
        report.report(tmp_path, tmp_path / "out")


def test_figures(audit_records, tmp_path):
    paths = report.figures(audit_records, tmp_path)
    names = {p.name for p in paths}
    assert {
        "kl_estimators.md",
        "kl_estimators.tex",
        "kl_estimators.csv",
        "kl_estimators_bias.png",
        "topk_variance.pdf",
        "anchor_horizon.png",
        "stability_region.png",
        "index.html",
    } <= names
    index = (tmp_path / "index.md").read_text()
    assert index.count("vocab_size: 12") == 1 and "| topk | reverse | paper | 4 |" in index  # one footnote, inline
    assert (tmp_path / "index.html").read_text().count("<details") == 1


def test_figures_skips_missing_and_rejects_bad_records(audit_records, tmp_path):
    partial = {"anchor_horizon": audit_records["anchor_horizon"]}
    report.figures(partial, tmp_path)
    assert "stability_grid: not in the audit records" in (tmp_path / "index.md").read_text()
    bad = {"topk_sweep": [{"direction": "reverse", "k": 3}]}
    with pytest.raises(ValueError, match=r"'topk_sweep'\[0\]: missing fields \['tail'"):
        report.figures(bad, tmp_path)
    with pytest.raises(ValueError, match="direction"):
        report.figures({"topk_sweep": [dict(audit_records["topk_sweep"][0], direction="sideways")]}, tmp_path)


def test_cli_entry_points(sweep_dir, audit_records, tmp_path, capsys):
    assert report.main_report([str(sweep_dir), "--out", str(tmp_path / "r"), "--reps", "50"]) == 0
    assert (tmp_path / "r" / "index.html").is_file() and "index.html" in capsys.readouterr().out
    horizon = {"anchor_horizon": audit_records["anchor_horizon"]}
    calls = []
    assert report.main_figures(["--out", str(tmp_path / "f")], lambda: calls.append(1) or horizon) == 0
    assert calls == [1] and (tmp_path / "f" / "anchor_horizon.pdf").is_file()  # a callable ...
    assert report.main_figures(["--out", str(tmp_path / "g")], horizon) == 0  # ... or the records
    with pytest.raises(SystemExit):
        report.main_report(["--out", str(tmp_path)])  # neither dir nor W&B


def test_figures_from_the_core_audit(tmp_path):
    """Integration with ema_pg_core.audit (the test may import the core; analysis may not): the
    rendered estimator table states the verdicts of docs/algorithm.md and the core's tests."""
    from ema_pg_core import audit

    paths = report.figures(audit.records(V=8, k=3, seeds=range(3)), tmp_path)
    assert {
        "kl_estimators_bias.png",
        "topk_variance.png",
        "anchor_horizon.png",
        "stability_region.png",
        "index.md",
    } <= {p.name for p in paths}
    import pandas as pd

    cells = pd.read_csv(tmp_path / "kl_estimators.csv")
    verdict = {
        (r.estimator, r.tail if isinstance(r.tail, str) else None): (r.value_unbiased, r.grad_unbiased)
        for r in cells.itertuples()
    }
    assert verdict[("k1", None)] == (True, False) and verdict[("k2", None)] == (False, True)
    assert verdict[("k3", None)] == (True, False)
    for name in ("k3++", "k4", "k5"):
        assert verdict[(name, None)] == (True, True)
    for direction in ("reverse", "forward"):
        assert verdict[(f"topk_{direction}", "paper")] == (True, False)  # the paper tail's gradient bias
        assert verdict[(f"topk_{direction}", "unbiased")] == (True, True)
        assert verdict[(f"topk_{direction}", "none")][0] is False  # truncated: value biased
    table = (tmp_path / "kl_estimators.md").read_text()
    assert "| topk_reverse | reverse | paper | 3 |" in table


def test_bootstrap_reps_have_one_default(sweep_dir, tmp_path, monkeypatch):
    import inspect

    for fn in (report.report, report.report_frames):
        assert inspect.signature(fn).parameters["reps"].default == report.REPS
    seen = []
    monkeypatch.setattr(report, "report", lambda runs_dir, out, **kw: seen.append(kw["reps"]) or [])
    assert report.main_report([str(sweep_dir), "--out", str(tmp_path)]) == 0 and seen == [report.REPS]


def test_a_config_and_seed_run_twice_counts_once(sweep_dir, tmp_path, synth, capsys):
    """Two sweeps into one directory: the same (config, seed) under two run ids (another trial id and run
    directory) is one seed, not two; the report says which run it counted."""
    for seed in (0, 1):
        cfg = synth.config("math_tiny", seed, 1.0, "k3", None, None, experiment="grpo_tiny")
        cfg["sweep"]["trial_id"], cfg["run_dir"] = f"again{seed}", f"/elsewhere/{seed}"
        rows = synth.metric_rows("math_tiny", seed, 1.0)
        synth.write_run(sweep_dir / "runs", synth.rid("math_tiny", "grpo_tiny", seed, 50 + seed), cfg, rows)
    report.report(sweep_dir, tmp_path / "r", reps=50)
    main = (tmp_path / "r" / "math_tiny_main.md").read_text()
    assert "| GRPO (k3) — ours, 3 seeds |" in main and "4 seeds" not in main and "5 seeds" not in main
    notes = [n for n in capsys.readouterr().err.splitlines() if "repeats the configuration and seed of" in n]
    assert len(notes) == 2 and all("(the same settings): not counted;" in n for n in notes), notes
    index = (tmp_path / "r" / "index.md").read_text().splitlines()
    assert sum("repeats the configuration and seed of" in line for line in index) == 2


def test_the_report_shows_the_numerics_and_flags_a_comparison_that_mixes_them(sweep_dir, tmp_path):
    """summary.json's "numerics" (experiments.numerics.fingerprint): one fingerprint is named on the front page;
    a GRPO run computed on another code path makes the front page warn and the gain rows' notes say so."""
    fp = {
        "mode": "reproducible",
        "cpu": "AMD EPYC",
        "aten_capability": "AVX2",
        "mkl_cbwr": "COMPATIBLE",
        "onednn_max_cpu_isa": "AVX2",
        "threads": 1,
        "deterministic_algorithms": False,
        "versions": {"torch": "2.13.0", "transformers": "5.10.4", "mkl": "2025.0"},
        "warm_start": "0123456789abcdef",
    }
    summaries = sorted((sweep_dir / "runs").glob("*/summary.json"))
    for path in summaries:
        s = json.loads(path.read_text())
        path.write_text(json.dumps(s | {"numerics": fp | {"cpu": f"CPU of {path.parent.name}"}}))  # cpu: not compared
    report.report(sweep_dir, tmp_path / "same", reps=50)
    index = (tmp_path / "same" / "index.md").read_text()
    assert "Numerics: every run with a fingerprint computed under one: reproducible AVX2/COMPATIBLE 1t" in index
    assert "numerical fingerprints" not in (tmp_path / "same" / "math_tiny_main.md").read_text()
    grpo = next(p for p in summaries if "grpo" in p.parent.name)
    s = json.loads(grpo.read_text())
    grpo.write_text(json.dumps(s | {"numerics": fp | {"mode": "native", "aten_capability": "AVX512"}}))
    report.report(sweep_dir, tmp_path / "mixed", reps=50)
    index = (tmp_path / "mixed" / "index.md").read_text()
    assert "**Warning: the runs computed under 2 numerical fingerprints** (8 run(s): reproducible" in index
    assert "1 run(s): native AVX512/COMPATIBLE" in index
    main = (tmp_path / "mixed" / "math_tiny_main.md").read_text()
    assert "vs GRPO (k3): the runs compared computed under 2 numerical fingerprints" in main
