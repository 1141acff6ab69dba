"""analysis.tables against a small golden frame; the writers' formats."""

from __future__ import annotations

import pandas as pd
import pytest

from analysis import audit_schema, paper, tables

EMA = "EMA-PG (τ=0.9, P=10; topk k=32, paper)"


def golden_runs() -> pd.DataFrame:
    """Two seeds per method with identical scores, so every CI is degenerate and the cells exact."""
    base = dict(task="search", kl_coef=0.001, complete=True)
    rows = []
    for seed in (0, 1):
        rows.append(
            dict(
                base,
                run_id=f"g{seed}",
                method="GRPO",
                variant="GRPO (k3)",
                kl_type="k3",
                kl_k=None,
                kl_tail=None,
                seed=seed,
                **{"final/eval/hotpotqa/acc": 0.30, "final/eval/2wiki/acc": 0.25},
            )
        )
        rows.append(
            dict(
                base,
                run_id=f"e{seed}",
                method="EMA-PG",
                variant=EMA,
                kl_type="topk",
                kl_k=32,
                kl_tail="paper",
                seed=seed,
                **{"final/eval/hotpotqa/acc": 0.45, "final/eval/2wiki/acc": 0.375},
            )
        )
    return pd.DataFrame(rows)


def test_search_table_golden():
    t = tables.paper_table(golden_runs(), "search", reps=200, seed=0)
    na = tables.NA
    cols = ["NQ", "TriviaQA", "PopQA", "HotpotQA", "2WikiMultiHopQA", "Musique", "Bamboogle", "Average"]
    expected = pd.DataFrame(
        [
            [na, na, na, "29.7 [ABS]", "27.4 [ABS]", na, na, na],
            [na, na, na, "44.1 [ABS]", "40.1 [ABS]", na, na, na],
            [na, na, na, "+48.5%", "+46.4%", na, na, "+33.3% [ABS]"],
            [na, na, na, "30.0 ± 0.0", "25.0 ± 0.0", na, na, na],
            [na, na, na, "45.0 ± 0.0", "37.5 ± 0.0", na, na, na],
            [na, na, na, "+50.0% [+50.0, +50.0]", "+50.0% [+50.0, +50.0]", na, na, na],
            [na, na, na, "1.00 [1.00, 1.00]", "1.00 [1.00, 1.00]", na, na, na],
        ],
        columns=cols,
        index=pd.Index(
            [
                "GRPO — paper",
                "EMA-PG — paper",
                "gain: EMA-PG vs GRPO — paper",
                "GRPO (k3) — ours, 2 seeds",
                f"{EMA} — ours, 2 seeds",
                f"gain: {EMA} vs GRPO (k3)",
                f"P(improvement): {EMA} > GRPO (k3)",
            ],
            name="method",
        ),
    )
    pd.testing.assert_frame_equal(t.cells, expected)
    assert t.run_ids == ["e0", "e1", "g0", "g1"]
    num = t.numbers.set_index(["row", "column"])
    assert num.loc[("GRPO — paper", "HotpotQA"), "source"] == "[ABS]"
    assert num.loc[("gain: EMA-PG vs GRPO — paper", "Average"), "value"] == pytest.approx(33.3)
    assert num.loc[("GRPO (k3) — ours, 2 seeds", "HotpotQA"), "value"] == pytest.approx(30.0)


def test_math_table_average_only_when_every_benchmark_is_there():
    runs = golden_runs().drop(columns=["final/eval/hotpotqa/acc", "final/eval/2wiki/acc"])
    names = ["aime24", "amc", "math500", "minerva", "olympiadbench"]
    for i, b in enumerate(names):
        runs[f"final/eval/{b}/pass@1"] = [0.1 * (i + 1), 0.2 * (i + 1)] * 2
    t = tables.paper_table(runs, "math", reps=100)
    assert t.cells.loc["GRPO (k3) — ours, 2 seeds", "Average"] == "30.0 ± 0.0"  # mean of 10..50
    assert t.cells.loc["GRPO — paper", "OlympiadBench"] == "50.8 [ABS]"
    assert t.cells.loc["GRPO — paper", "AIME24"] == tables.NA  # not invented
    w = tables.paper_table(
        runs, "math", weights={"AIME24": 30, "AMC": 0, "MATH-500": 0, "Minerva": 0, "OlympiadBench": 0}, reps=100
    )
    assert w.cells.loc["GRPO (k3) — ours, 2 seeds", "Average"] == "10.0 ± 0.0"
    runs.loc[0, "final/eval/amc/pass@1"] = float("nan")  # one seed lacks AMC
    t2 = tables.paper_table(runs, "math", reps=100)
    assert t2.cells.loc["GRPO (k3) — ours, 2 seeds", "AMC"] == "20.0 (n=1)"


def test_tiny_table_layout():
    runs = (
        golden_runs()
        .iloc[[0, 1, 3]]
        .assign(task="math_tiny")
        .drop(columns=["final/eval/hotpotqa/acc", "final/eval/2wiki/acc"])
    )
    runs["final/eval/math_tiny/acc"] = [0.5, 0.7, 0.8]
    runs["final/eval/math_tiny/pass@1"] = [0.4, 0.6, 0.6]
    runs["final/eval_anchor/math_tiny/acc"] = [0.5, 0.65, 0.7]
    t = tables.tiny_table(runs, "math_tiny", reps=200)
    assert list(t.cells.columns) == ["policy acc", "policy pass@1", "anchor acc"]
    assert t.cells.loc["GRPO (k3) — ours, 1 seed"].tolist() == ["50.0", "40.0", "50.0"]  # no CI from 1 seed
    assert t.cells.loc[f"{EMA} — ours, 2 seeds", "policy acc"] == "75.0 ± 5.0"  # CI [70, 80]
    assert t.cells.loc[f"gain: {EMA} vs GRPO (k3)", "policy acc"] == "+50.0%"  # no CI: 1 baseline seed


def test_gain_pairs_need_an_unambiguous_baseline():
    runs = golden_runs()
    extra = runs.iloc[[0]].assign(run_id="g9", variant="GRPO (k1)", kl_type="k1")
    pairs, notes = tables.gain_pairs(pd.concat([runs, extra]))
    assert pairs == [] and "no unambiguous GRPO baseline" in notes[0]
    extra2 = runs.iloc[[0]].assign(run_id="g8", variant="GRPO (topk)", kl_type="topk", kl_k=32, kl_tail="paper")
    pairs, _ = tables.gain_pairs(pd.concat([runs, extra, extra2]))
    assert pairs == [(EMA, "GRPO (topk)")]  # same KL config


def test_markdown_and_latex_writers(tmp_path):
    df = pd.DataFrame({"a_b": ["50% | x", None], "τ": [1.5, 2.0]}, index=pd.Index(["r1", "r2"], name="row"))
    assert tables.to_markdown(df) == ("| row | a_b | τ |\n|---|---|---|\n| r1 | 50% \\| x | 1.5 |\n| r2 | — | 2 |\n")
    tex = tables.to_latex(df, caption="A & B", label="tab:x")
    for piece in (
        r"\toprule",
        r"\midrule",
        r"\bottomrule",
        r"\begin{tabular}{lrr}",
        r"a\_b & $\tau$",
        r"50\% $|$ x",
        r"\caption{A \& B}",
        r"r2 & --- & 2 \\",
    ):
        assert piece in tex
    path = tables.to_csv(df.reset_index(), tmp_path / "t.csv")
    back = pd.read_csv(path)
    assert back["τ"].tolist() == [1.5, 2.0] and back["a_b"].isna().tolist() == [False, True]


def test_write_table(tmp_path):
    t = tables.paper_table(golden_runs(), "search", reps=50)
    paths = tables.write_table(t, tmp_path)
    assert [p.name for p in paths] == ["search_main.md", "search_main.tex", "search_main.csv"]
    assert "[ABS]: abstract of arXiv 2602.04417" in paths[0].read_text()
    assert list(pd.read_csv(paths[2]).columns) == ["row", "column", "value", "ci_low", "ci_high", "n", "unit", "source"]


def test_estimator_table(audit_records):
    rows = audit_schema.check_rows("estimator_table", audit_records["estimator_table"])
    t = tables.estimator_table(rows, audit_records["meta"])
    paper_tail = t.cells.reset_index().iloc[7]
    assert (paper_tail["estimator"], paper_tail["tail"], paper_tail["k"]) == ("topk", "paper", "4")
    assert (paper_tail["value unbiased"], paper_tail["gradient unbiased"]) == ("✓", "✗")
    assert paper_tail["gradient bias"] == "1.20e-01" and t.cells.iloc[0]["bytes / token"] == "607,744"
    assert t.cells.iloc[0]["tail"] == tables.NA and "vocab_size=12" in t.caption


def test_paper_numbers_are_only_the_verified_ones():
    assert len(paper.NUMBERS) == 6 and all(p.source == "[ABS]" for p in paper.NUMBERS)
    assert paper.number("search", "NQ", "GRPO") is None
    assert paper.number("math", "OlympiadBench", "EMA-PG").value == 53.9
