"""Adaptive seeds (sweeps.adaptive, `seeds: {adaptive: ...}`): the spec's checks, the decisions on hand-made
rows, and sweeps of the fast stand-in trainable (sweep_fakes: the score is tau + a seed-alternating `noise`
for tau < 1) on a 2-CPU local Ray: a clear comparison stops at `start` seeds, an unclear one grows to `max`,
and a sweep stopped mid-round continues that round on --resume, with the same recorded decisions."""

from __future__ import annotations

import copy
import json
import math

import pytest
from test_tune import fake_spec, fakes, local_ray, rows  # noqa: F401  (fixtures)

from analysis import stats
from sweeps import adaptive as A
from sweeps import tune as T
from sweeps.spec import SPEC_DEFAULTS, SpecError, parse, table

ACC = "eval/math_tiny/acc"
# looks at 6, 7 and 8 seeds, each at 0.1 / 3: an exact paired test of 6 seeds reaches p = 2/64 < 0.0333 when all six
# agree in sign, so a clear comparison can stop at `start`
ADAPTIVE = {
    "compare": {"key": "algo.anchor.tau", "baseline": 1.0},
    "start": 6,
    "step": 1,
    "max": 8,
    "confidence": 0.9,
}


def spec_dict(name: str = "adapt", noise: float = 0.3, **knobs) -> dict:
    """tau 1.0 (baseline), 0.5 (clear: below 1 on every seed) and 0.95 (unclear: +-0.3 around 0.95)."""
    d = fake_spec(name, iterations=3, sleep=0.0, max_failures=0, seeds={"adaptive": copy.deepcopy(ADAPTIVE)})
    d["space"] = {"algo.anchor.tau": {"grid": [1.0, 0.5, 0.95]}}
    d["base"]["overrides"]["task.knobs"].update(noise=noise, **knobs)
    return d


# ------------------------------------------------------------------ the spec
def test_adaptive_spec_defaults_and_worst_case():
    raw = spec_dict()
    raw["seeds"]["adaptive"] = {"compare": ADAPTIVE["compare"]}
    spec = parse(raw)
    a, d = spec.adaptive, SPEC_DEFAULTS["seeds.adaptive"]
    assert (a.start, a.step, a.max, a.first, a.stop_when) == (d["start"], d["step"], d["max"], 0, d["stop_when"])
    assert spec.seeds == tuple(range(d["max"])) and spec.num_trials == 3 * d["max"] == A.worst_case(spec)
    text = table(spec)
    assert f"sweep adapt: {3 * d['max']} trials at most" in text
    assert f"trials: {3 * d['start']} in round 0, at most {3 * d['max']} in all" in text
    assert len([ln for ln in text.splitlines() if ln[:1].isdigit()]) == 3 * d["start"]


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"compare": {"key": "algo.anchor.period", "baseline": 1}}, "compare.key='algo.anchor.period' is not a"),
        ({"compare": {"key": "algo.anchor.tau", "baseline": 0.7}}, "compare.baseline=0.7 must be one of"),
        ({"compare": None}, "seeds.adaptive.compare must be a mapping"),
        ({"start": 1}, "seeds.adaptive.start must be an integer >= 2"),
        ({"max": 1}, "seeds.adaptive.max must be an integer >= 2"),
        ({"step": 0}, "seeds.adaptive.step must be an integer >= 1"),
        ({"stop_when": "ci_small"}, "stop_when='ci_small' is not allowed; allowed values: ci_excludes_zero"),
        ({"stop_when": [{"ci_width_below": -1}]}, "ci_width_below must be a number > 0"),
        ({"confidence": 1.5}, "confidence must be in (0, 1)"),
        ({"metric": "eval/nope"}, "metric='eval/nope' is not a metric the runs log"),
        ({"strat": 3}, "unknown key seeds.adaptive.strat (did you mean seeds.adaptive.start?)"),
    ],
)
def test_bad_adaptive_spec_is_one_line(change, fragment):
    raw = spec_dict()
    raw["seeds"]["adaptive"].update(change)
    if change.get("compare", 0) is None:
        raw["seeds"]["adaptive"]["compare"] = "tau"
    with pytest.raises(SpecError) as e:
        parse(raw)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_adaptive_needs_a_plain_grid():
    with pytest.raises(SpecError, match="seeds.adaptive needs search: grid and scheduler: none"):
        parse({**spec_dict(), "scheduler": {"type": "asha", "grace_period": 1}})


# ------------------------------------------------------------------ decisions on hand-made rows
def hand_rows(values: dict[float, list[float]]) -> list[dict]:
    return [
        {"algo.anchor.tau": tau, "seed": s, "status": "finished", f"final/{ACC}": v}
        for tau, vs in values.items()
        for s, v in enumerate(vs)
    ]


def test_decide_uses_the_reports_comparison_and_plans_only_unclear_comparisons():
    spec = parse(spec_dict())
    assert A.looks(spec) == [6, 7, 8] and list(A.levels(spec).values()) == pytest.approx([0.1 / 3] * 3)
    base = [0.5, 0.6, 0.4, 0.55, 0.45, 0.5]
    values = {
        1.0: base,
        0.5: [v - 0.2 for v in base],
        0.95: [v + (0.05 if i % 2 else -0.04) for i, v in enumerate(base)],
    }
    seeds_of = {A.point_key({"algo.anchor.tau": t}): 6 for t in values}
    clear, unclear = A.decide(spec, hand_rows(values), seeds_of)
    assert clear["decision"] == "stop" and clear["why"] == "CI excludes 0" and clear["next_seeds"] == 6
    assert clear["gain"] == pytest.approx(-0.2 / 0.5) and clear["p"] == 2 / 64 and clear["ci"][1] < 0
    assert unclear["decision"] == "more" and unclear["next_seeds"] == 7 and unclear["paired"] == 6
    c = stats.compare(values[0.95], base, alpha=0.1 / 3)
    assert (unclear["gain"], *unclear["ci"], unclear["p"]) == (c.gain, *c.ci, c.p)
    nxt = A.next_round(spec, [clear, unclear], seeds_of)  # seed 6 for tau 0.95 and for its baseline
    assert nxt == [{"point": {"algo.anchor.tau": 0.95}, "seed": 6}, {"point": {"algo.anchor.tau": 1.0}, "seed": 6}]
    seeds_of = {k: 8 for k in seeds_of}  # at max: no more seeds
    assert [d["decision"] for d in A.decide(spec, hand_rows(values), seeds_of)] == ["stop", "max"]


def test_a_look_that_cannot_decide_only_adds_seeds():
    raw = spec_dict()
    raw["seeds"]["adaptive"].update(start=3, step=2, max=7, confidence=0.95)  # looks 3, 5, 7 at 0, 0, 0.05
    spec = parse(raw)
    assert A.levels(spec) == {3: 0.0, 5: 0.0, 7: pytest.approx(0.05)}
    values = {1.0: [0.5, 0.6, 0.7], 0.5: [0.1, 0.2, 0.3], 0.95: [0.5, 0.6, 0.7]}  # 0.5: lower on every seed
    seeds_of = {A.point_key({"algo.anchor.tau": t}): 3 for t in values}
    lower, _ = A.decide(spec, hand_rows(values), seeds_of)
    assert lower["decision"] == "more" and lower["ci"] == [-math.inf, math.inf]
    assert lower["why"] == "rule not met (no 3-seed result can be clear at alpha 0)"
    assert "level per look (seeds: alpha; 0.05 in all, 0 = cannot decide): 3: 0, 5: 0, 7: 0.05" in table(spec)
    raw["seeds"]["adaptive"].update(start=3, step=1, max=5)
    with pytest.raises(SpecError, match="max=5 is too few seeds to decide anything at confidence 0.95: the exact"):
        parse(raw)


def test_ci_width_rule_and_failed_trials():
    raw = spec_dict()
    raw["seeds"]["adaptive"]["stop_when"] = [{"ci_width_below": 0.01}]
    spec = parse(raw)
    base = [0.5, 0.6, 0.7, 0.4, 0.55, 0.65]
    values = {1.0: base, 0.5: list(base), 0.95: [*base[:5], 0.9]}
    got = hand_rows(values)
    got[-1]["status"] = "failed"  # tau 0.95 seed 5: not paired
    seeds_of = {A.point_key({"algo.anchor.tau": t}): 6 for t in values}
    same, other = A.decide(spec, got, seeds_of)
    assert same["decision"] == "stop" and same["ci"] == [0.0, 0.0] and same["why"].startswith("CI width 0 < 0.01")
    assert other["paired"] == 5 and other["decision"] == "more"  # identical on its 5 paired seeds, but 5 can't bound
    assert other["ci"] == [-math.inf, math.inf]
    for r in got[-5:]:
        r["status"] = "failed"  # now one paired seed: no test
    _, other = A.decide(spec, got, seeds_of)
    assert other["decision"] == "more" and "no test" in other["why"]


# ------------------------------------------------------------------ sweeps of the stand-in
def decisions(sweep_dir) -> list[tuple[int, dict[float, tuple[str, int, int]]]]:
    """Per decide event: (round, {tau: (decision, paired seeds, next seeds)})."""
    return [
        (
            e["round"],
            {c["point"]["algo.anchor.tau"]: (c["decision"], c["paired"], c["next_seeds"]) for c in e["comparisons"]},
        )
        for e in A.read_events(sweep_dir)
        if e["event"] == "decide"
    ]


EXPECTED = [  # tau 0.5 is clear at start=6 seeds; tau 0.95 grows by step=1 to max=8
    (0, {0.5: ("stop", 6, 6), 0.95: ("more", 6, 7)}),
    (1, {0.5: ("stop", 6, 6), 0.95: ("more", 7, 8)}),
    (2, {0.5: ("stop", 6, 6), 0.95: ("max", 8, 8)}),
]
SEEDS_RUN = {1.0: list(range(8)), 0.5: list(range(6)), 0.95: list(range(8))}


def seeds_run(sweep_dir) -> dict[float, list[int]]:
    out: dict[float, list[int]] = {}
    for r in rows(sweep_dir):
        assert r["status"] == "finished", r
        out.setdefault(float(r["algo.anchor.tau"]), []).append(int(r["seed"]))
    return {t: sorted(s) for t, s in out.items()}


@pytest.mark.usefixtures("fakes")
def test_clear_stops_at_start_unclear_grows_to_max(tmp_path, capsys):
    out = T.run_sweep(parse(spec_dict()), tmp_path / "adapt", report=False)
    assert decisions(out) == EXPECTED
    assert seeds_run(out) == SEEDS_RUN
    plans = [e for e in A.read_events(out) if e["event"] == "plan"]
    assert [len(p["trials"]) for p in plans] == [18, 2, 2]
    printed = capsys.readouterr().out
    assert "adaptive seeds, round 0:" in printed and "tau=0.95: 6 paired seeds" in printed
    assert "every comparison is decided" in printed
    # the recorded gain is the report's comparison on the sweep's own values, at the last look's level
    final = {(float(r["algo.anchor.tau"]), int(r["seed"])): float(r[f"final/{ACC}"]) for r in rows(out)}
    last = [e for e in A.read_events(out) if e["event"] == "decide"][-1]["comparisons"][1]
    x, y = [final[(0.95, s)] for s in range(8)], [final[(1.0, s)] for s in range(8)]
    c = stats.compare(x, y, alpha=last["alpha"])
    assert [last["gain"], *last["ci"], last["p"]] == [c.gain, *c.ci, c.p] and last["alpha"] == pytest.approx(0.1 / 3)
    with pytest.raises(ValueError, match="already holds sweep 'adapt'"):
        T.run_sweep(parse(spec_dict()), out)


@pytest.mark.slow  # four sweep invocations, 10 trials (a minute or more on 2 cores)
@pytest.mark.usefixtures("fakes")
def test_resumed_sweep_continues_the_round_it_was_in(tmp_path, capsys):
    """Every trial is SIGTERM'd once at iteration 2 (after its checkpoint at 1): each invocation stops in the
    middle of a round, and --resume finishes that round from the trials' checkpoints before planning the next."""
    spec = parse(spec_dict("stopped", interrupt_at=2))
    out = T.run_sweep(spec, tmp_path / "stopped", report=False)
    for rnd in range(3):
        events = A.read_events(out)
        assert events[-1] == {**events[-1], "event": "plan", "round": rnd}  # stopped inside round rnd
        assert [e["round"] for e in events if e["event"] == "decide"] == list(range(rnd))
        printed = capsys.readouterr().out
        assert f"did not finish; continue with: emapg sweep {out}/sweep.yaml --resume --out {out}\n" in printed
        T.run_sweep(spec, out, resume=True, report=False)
    assert decisions(out) == EXPECTED
    assert seeds_run(out) == SEEDS_RUN
    runs = {}
    for line in (out / "calls.jsonl").read_text().splitlines():
        c = json.loads(line)
        runs.setdefault(c["trial"], []).append(c["iteration"])
    assert len(runs) == 22  # no trial re-planned or duplicated; each continued from its checkpoint at 1
    assert all(its[:2] == [0, 1] and its[-1] == 3 and its.count(0) == 1 for its in runs.values()), runs
