"""analysis.tables against a small golden frame; the writers' formats."""

from __future__ import annotations

import pandas as pd
import pytest

from analysis import audit_schema, paper, tables

EMA = "EMA-PG (τ=0.9, P=10; topk k=32, paper)"
# 2 paired seeds, both +15 points: the smallest p-value of 2 seeds is 2/4, so no decision is possible
NOT_SEPARABLE = "not separable at 2 seeds (a 95% decision needs >= 6); 80% power at this effect: ~6 seeds"


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
            [na, na, na, "+50.0% [-inf, +inf] (paired, 2 seeds)", "+50.0% [-inf, +inf] (paired, 2 seeds)"]
            + [na, na, na],
            [na, na, na, "1.00 (2 of 2 seeds)", "1.00 (2 of 2 seeds)", na, na, na],
            [na, na, na, NOT_SEPARABLE, NOT_SEPARABLE, na, na, na],
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
                f"decision: {EMA} vs GRPO (k3)",
            ],
            name="method",
        ),
    )
    pd.testing.assert_frame_equal(t.cells, expected)
    num = t.numbers.set_index(["row", "column"])
    assert num.loc[("GRPO — paper", "HotpotQA"), "source"] == "[ABS]"
    assert num.loc[("gain: EMA-PG vs GRPO — paper", "Average"), "value"] == pytest.approx(33.3)
    assert num.loc[("GRPO (k3) — ours, 2 seeds", "HotpotQA"), "value"] == pytest.approx(30.0)
    gain = num.loc[(f"gain: {EMA} vs GRPO (k3)", "HotpotQA")]
    assert (gain["n"], gain["source"]) == (2, "ours (paired, 2 seeds)")
    assert tables.PAIRING_NOTE in t.notes


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
    # 1 baseline seed: no CI, and no pairing (pairing needs 2 common seeds)
    assert t.cells.loc[f"gain: {EMA} vs GRPO (k3)", "policy acc"] == "+50.0% [-inf, +inf] (unpaired)"
    assert f"{EMA} vs GRPO (k3): unpaired for policy acc, policy pass@1, anchor acc: 1 seed in common" in t.notes[0]


def paired_runs(y: list[float], x: list[float], seeds_x: list[int] | None = None) -> pd.DataFrame:
    """GRPO runs scoring `y` at seeds 0, 1, ... and EMA-PG runs scoring `x` (at `seeds_x` if given)."""
    base = golden_runs().drop(columns=["final/eval/hotpotqa/acc", "final/eval/2wiki/acc"])
    g = pd.concat([base.iloc[[0]]] * len(y)).assign(seed=list(range(len(y))), **{"final/eval/t/acc": y})
    e = pd.concat([base.iloc[[1]]] * len(x)).assign(seed=seeds_x or list(range(len(x))), **{"final/eval/t/acc": x})
    runs = pd.concat([g, e], ignore_index=True)
    return runs.assign(task="t", run_id=[f"r{i}" for i in range(len(runs))])


def test_gains_are_paired_over_common_seeds():
    # x = y + 0.01 on each of 6 seeds, with a large spread across seeds: paired, every sign flip but the two
    # all-equal ones gives a smaller |sum|, so p = 2/64 <= 5%: clear. Any shift other than 0.01 leaves all six
    # differences of one sign (rejected), so the CI is the point; the gain of the means is 0.01 / 0.5 = +2%.
    y = [0.2, 0.5, 0.8, 0.3, 0.7, 0.5]
    t = tables.tiny_table(paired_runs(y, [v + 0.01 for v in y]), "t", reps=500)
    assert t.cells.loc[f"gain: {EMA} vs GRPO (k3)", "policy acc"] == "+2.0% [+2.0, +2.0] (paired, 6 seeds)"
    assert t.cells.loc[f"P(improvement): {EMA} > GRPO (k3)", "policy acc"] == "1.00 (6 of 6 seeds)"
    assert t.cells.loc[f"decision: {EMA} vs GRPO (k3)", "policy acc"] == "clear, p=0.0312"
    # the same at 3 seeds cannot be decided: the gain is shown, the CI is unbounded, the verdict says why
    t3 = tables.tiny_table(paired_runs(y[:3], [v + 0.01 for v in y[:3]]), "t", reps=500)
    assert t3.cells.loc[f"gain: {EMA} vs GRPO (k3)", "policy acc"] == "+2.0% [-inf, +inf] (paired, 3 seeds)"
    assert t3.cells.loc[f"decision: {EMA} vs GRPO (k3)", "policy acc"].startswith("not separable at 3 seeds")
    # only the common seeds 1 and 2 pair: seed 3 of EMA-PG has no GRPO run
    runs = paired_runs([0.2, 0.5, 0.8], [0.3, 0.6, 0.9], seeds_x=[1, 2, 3])
    x, y, why = tables.pair_by_seed(*_sides(runs), "final/eval/t/acc")
    assert (x.tolist(), y.tolist(), why) == ([0.3, 0.6], [0.5, 0.8], None)


def _sides(runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    return runs[runs["method"] == "EMA-PG"], runs[runs["method"] == "GRPO"]


def test_gains_fall_back_to_unpaired_when_seeds_do_not_match():
    y = [0.2, 0.5, 0.8]
    t = tables.tiny_table(paired_runs(y, [0.21, 0.51, 0.81], seeds_x=[3, 4, 5]), "t", reps=500)
    gain = t.cells.loc[f"gain: {EMA} vs GRPO (k3)", "policy acc"]
    assert gain == "+2.0% [-inf, +inf] (unpaired)"  # 20 relabellings of 3 + 3 runs: p >= 2/20, never clear
    # unpaired P(improvement): 0.21 beats 0.2 only, 0.51 beats 2, 0.81 beats 3 -> 6 / 9
    assert t.cells.loc[f"P(improvement): {EMA} > GRPO (k3)", "policy acc"] == "0.67"
    assert any("unpaired for policy acc: 0 seeds in common" in n for n in t.notes)
    num = t.numbers.set_index(["row", "column"]).loc[(f"gain: {EMA} vs GRPO (k3)", "policy acc")]
    assert (num["n"], num["source"]) == (6, "ours (unpaired)")
    # same seeds but different data settings (data seed, task knobs) do not pair either
    runs = paired_runs(y, [0.21, 0.51, 0.81]).assign(**{"cfg.task.data_seed": 1234, "cfg.task.knobs.digits": 3})
    assert tables.pair_by_seed(*_sides(runs), "final/eval/t/acc")[2] is None
    for col, other in (("cfg.task.data_seed", 99), ("cfg.task.knobs.digits", 4)):
        changed = runs.assign(**{col: runs[col].where(runs["method"] == "GRPO", other)})
        x, _, why = tables.pair_by_seed(*_sides(changed), "final/eval/t/acc")
        assert len(x) == 0 and "0 seeds in common with the same task and data settings" in why
    # two runs of one method at the same seed are ambiguous: that seed does not pair
    dup = pd.concat([runs, runs.iloc[[3]].assign(run_id="dup")], ignore_index=True)
    assert tables.pair_by_seed(*_sides(dup), "final/eval/t/acc")[0].tolist() == [0.51, 0.81]


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


def test_write_table(tmp_path):
    t = tables.paper_table(golden_runs(), "search", reps=50)
    paths = tables.write_table(t, tmp_path)
    assert [p.name for p in paths] == ["search_main.md", "search_main.tex", "search_main.csv"]
    assert "[ABS]: abstract of arXiv 2602.04417" in paths[0].read_text()
    numbers = pd.read_csv(paths[2])
    assert list(numbers.columns) == ["row", "column", "value", "ci_low", "ci_high", "n", "unit", "source"]
    assert numbers.loc[numbers["source"] == "[ABS]", "ci_low"].isna().all()  # no CI: an empty field


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
