"""What `emapg report` / `emapg figures` refuse or flag so that a number is never quietly wrong: a seed counted
twice, a record two processes wrote, an output directory that is not theirs (docs/reports.md, "What a report
counts" and "Where a report is written")."""

from __future__ import annotations

import json
import shutil

import pytest

from analysis import load, report
from experiments.cli import main

MARKER = "emapg_output.json"  # analysis.MARKER: which command wrote a directory


def _cli(argv, capsys) -> tuple[int, str]:
    """(exit code, stderr) of `emapg <argv>` through the CLI's one error path."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own exits
        code = e.code
    return code, capsys.readouterr().err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _files(d) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- one seed is counted once


def _sibling(synth, root, seed: int, iterations: int, n: int, sweep: str | None = "quickstart"):
    """A GRPO run of `seed` that differs from the sweep's only in trainer.iterations (and where it is written)."""
    cfg = synth.config("math_tiny", seed, 1.0, "k3", None, None, sweep=sweep, experiment="grpo_tiny")
    cfg["trainer"]["iterations"] = iterations
    rows = synth.metric_rows("math_tiny", seed, 1.0, iterations)
    return synth.write_run(root, synth.rid("math_tiny", "grpo_tiny", seed, n), cfg, rows)


def test_a_longer_sibling_of_a_seed_is_not_a_second_seed(sweep_dir, synth, tmp_path, capsys):
    """Seed 0 of GRPO again with trainer.iterations=12 (its longer sibling): still 3 GRPO seeds, not 4, and the
    report says loudly which run it counted, naming both run directories and the setting that differs."""
    longer = _sibling(synth, sweep_dir / "runs", 0, 12, 60)
    runs, _ = load.load_runs(sweep_dir)
    assert runs.groupby("seed")["config_key"].nunique().max() == 3  # 3 variants per seed, the sibling inside one
    report.report(sweep_dir, tmp_path / "r", reps=50)
    main_md = (tmp_path / "r" / "math_tiny_main.md").read_text()
    assert "| GRPO (k3) — ours, 3 seeds |" in main_md and "4 seeds" not in main_md
    index = (tmp_path / "r" / "index.md").read_text()
    assert "**Warning: 1 run(s) repeat the configuration and seed of another run" in index
    first = sweep_dir / "runs" / synth.rid("math_tiny", "grpo_tiny", 0, 1)
    note = next(line for line in index.splitlines() if "not counted;" in line)
    assert note.startswith(f"- {first} repeats the configuration and seed of {longer} ("), note  # both directories
    assert "differing in trainer.iterations: 6 vs 12)" in note, note  # ... and the one setting that differs
    err = capsys.readouterr().err
    assert f"warning: {first} repeats" in err and "trainer.iterations" in err


def test_a_stray_train_in_the_sweep_root_is_not_a_second_seed(sweep_dir, synth, tmp_path):
    """`emapg train run_dir=<sweep>/...` of seed 1 with fewer iterations, outside any sweep: one seed."""
    stray = _sibling(synth, sweep_dir, 1, 2, 70, sweep=None)
    report.report(sweep_dir, tmp_path / "r", reps=50)
    assert "| GRPO (k3) — ours, 3 seeds |" in (tmp_path / "r" / "math_tiny_main.md").read_text()
    index = (tmp_path / "r" / "index.md").read_text()
    assert f"{stray} repeats the configuration and seed of" in index


# ---------------------------------------------------------------- a record two processes wrote


@pytest.mark.parametrize(
    "order,line,it",
    [
        ([0, 1, 2, 1, 3], 4, 1),  # two writers interleaved: an iteration logged twice
        ([0, 1, 3, 2, 4], 4, 2),  # out of order
    ],
)
def test_a_record_whose_iterations_repeat_or_go_back_is_refused(tmp_path, synth, capsys, order, line, it):
    rows = [{"iteration": i, "time_s": float(n), "train/reward": float(n)} for n, i in enumerate(order)]
    d = synth.write_run(tmp_path / "runs", "r", synth.config("math_tiny", 0, 0.9), rows)
    with pytest.raises(ValueError, match=rf"metrics.jsonl:{line}: iteration {it} "):
        load.load_runs(tmp_path / "runs")
    code, err = _cli(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--reps", "10"], capsys)
    message = _one_line(err)
    assert code == 2 and f"{d / 'metrics.jsonl'}:{line}: iteration {it} " in message, message
    assert not (tmp_path / "out").exists()


def test_rows_read_from_w_and_b_keep_the_last_line_per_iteration():
    """W&B history cannot be rewritten: there (only) the last line logged for an iteration wins."""
    rows = [{"iteration": i, "x": float(i)} for i in range(4)] + [{"iteration": i, "x": 10.0 + i} for i in (2, 3, 4)]
    clean, n_relogged = load.clean_rows(rows)
    assert [r["x"] for r in clean] == [0.0, 1.0, 12.0, 13.0, 14.0] and n_relogged == 2


# ---------------------------------------------------------------- where a report is written


def test_report_refuses_an_out_that_holds_a_run_record_a_sweep_or_other_files(sweep_dir, tmp_path, capsys):
    run_dir = next((sweep_dir / "runs").iterdir())
    other = tmp_path / "notes"
    other.mkdir()
    (other / "draft.txt").write_text("mine\n")
    before = _files(tmp_path)
    for out, words in (
        (other / "draft.txt", ["is a file"]),
        (run_dir, ["is a run record"]),
        (run_dir / "report", ["inside the run record", str(run_dir)]),
        (sweep_dir, ["is a sweep directory"]),
        (other, ["not empty", "draft.txt", "emapg report"]),
    ):
        code, err = _cli(["report", str(sweep_dir), "--out", str(out), "--reps", "10"], capsys)
        message = _one_line(err)
        assert code == 2 and message.startswith(f"emapg report: error: --out {out}"), message
        assert all(w in message for w in words), message
    assert _files(tmp_path) == before and not (run_dir / "report").exists()


def test_a_report_again_replaces_the_previous_one_whole(sweep_dir, tmp_path, capsys):
    """The second report (of one run: no ablation) leaves no figure of the first beside its index."""
    out = tmp_path / "r"
    assert _cli(["report", str(sweep_dir), "--out", str(out), "--reps", "10"], capsys)[0] == 0
    assert (out / "math_tiny_ablation_anchor_tau.png").is_file()
    one = next(d for d in (sweep_dir / "runs").iterdir() if "grpo" in d.name)
    assert _cli(["report", str(one), "--out", str(out), "--reps", "10"], capsys)[0] == 0
    assert not list(out.glob("*ablation*")), sorted(p.name for p in out.iterdir())
    assert "1 runs found" in (out / "index.md").read_text()
    assert json.loads((out / MARKER).read_text())["command"] == "emapg report"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no build directory left behind


def test_a_failed_report_leaves_the_previous_one_as_it_was(sweep_dir, tmp_path, monkeypatch):
    out = tmp_path / "r"
    report.report(sweep_dir, out, reps=10)
    before = _files(out)

    def broken(*a, **k):
        raise RuntimeError("disk gone")

    monkeypatch.setattr(report, "write_index", broken)
    with pytest.raises(RuntimeError, match="disk gone"):
        report.report(sweep_dir, out, reps=10)
    assert _files(out) == before and not [p for p in out.iterdir() if p.name.startswith(".")]


def test_figures_never_overwrites_a_report_nor_a_report_a_figures_output(sweep_dir, audit_records, tmp_path, capsys):
    rep, figs = tmp_path / "report", tmp_path / "figs"
    report.report(sweep_dir, rep, reps=10)
    report.figures(audit_records, figs)
    before = _files(tmp_path)
    calls = []
    with pytest.raises(ValueError, match=r"holds the output of emapg report") as e:
        report.main_figures(["--out", str(rep)], lambda: calls.append(1) or audit_records)
    assert calls == [] and str(rep) in str(e.value)  # refused before the audit runs
    code, err = _cli(["report", str(sweep_dir), "--out", str(figs), "--reps", "10"], capsys)
    message = _one_line(err)
    assert code == 2 and "holds the output of emapg figures" in message and str(figs) in message, message
    assert _files(tmp_path) == before
    report.figures({"anchor_horizon": audit_records["anchor_horizon"]}, figs)  # its own output: replaced whole
    assert not list(figs.glob("stability_region*")) and (figs / "anchor_horizon.png").is_file()


def test_a_report_written_before_markers_is_still_replaced(sweep_dir, tmp_path):
    """A report directory from before the marker file (its index.md says `# emapg report`) is its own output."""
    out = tmp_path / "r"
    report.report(sweep_dir, out, reps=10)
    (out / MARKER).unlink()
    (out / "old_figure.png").write_bytes(b"stale")
    report.report(sweep_dir, out, reps=10)
    assert not (out / "old_figure.png").exists() and (out / MARKER).is_file()


def test_an_empty_or_new_out_is_fine_and_a_sweep_report_goes_into_the_sweep(sweep_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    report.report(sweep_dir, tmp_path / "empty", reps=10)
    report.report(sweep_dir, tmp_path / "new" / "deeper", reps=10)
    report.report(sweep_dir, sweep_dir / "report", reps=10)  # what `emapg sweep` does at its end
    report.report(sweep_dir, sweep_dir / "report", reps=10)  # ... and again after a resumed sweep
    assert len(load.find_run_dirs(sweep_dir)) == 11
    shutil.rmtree(sweep_dir / "report")
