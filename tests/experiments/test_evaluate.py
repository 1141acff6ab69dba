"""`emapg eval` (experiments.ops.evaluate): per-problem rows for the policy and the EMA anchor of a run,
pass@k that matches a hand computation, a killed evaluation that resumes without scoring a problem
twice (and ends with the rows of an uninterrupted one), `emapg report` picking the rows up, and the
vLLM path up to the engine."""

from __future__ import annotations

import json
import math
import os
import sys
import types

import pytest

from experiments import owner, records
from experiments.cli import main
from experiments.ops import evaluate
from experiments.tasks import get_task
from tests.experiments.small_run import small_run

SMALL = small_run({"trainer.eval_n": 2, "task.test_size": 7, "trainer.iterations": 2})
EVAL = ["--protocol", "in_training", "--n", "4", "--max-tokens", "8", "--batch", "2", "--device", "cpu"]
pytestmark = pytest.mark.filterwarnings("ignore:pretrain .* did not reach target_acc")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("EMAPG_CACHE", str(tmp_path_factory.getbasetemp() / "eval_cache"))
    mp.setenv("EMAPG_PROGRESS", "0")
    out = tmp_path_factory.mktemp("eval") / "run"
    assert main(["train", *SMALL, f"run_dir={out}"]) == 0
    mp.undo()
    return out


@pytest.fixture(autouse=True)
def env(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EMAPG_CACHE", str(tmp_path_factory.getbasetemp() / "eval_cache"))
    monkeypatch.setenv("EMAPG_PROGRESS", "0")


def by_key(rows):
    return {(r["model"], r["benchmark"], r["problem_id"]): r for r in rows}


def test_scoring_and_pass_at_k_by_hand():
    mod = get_task("math_tiny")
    ex = mod.load("test", n=2, seed=0)
    right = [mod.demonstration(e) for e in ex]  # the gold solution text of each problem
    wrong = "no answer"
    greedy = [right[0], wrong]
    sampled = [right[0], wrong, right[0], wrong] + [wrong, wrong, wrong, right[1]]  # c = 2 and c = 1 of n = 4
    st = {"n": 4, "iteration": 7}
    rows = evaluate.score_rows(mod, ex, greedy, sampled, st, model="policy", bench="math_tiny")
    assert [(r["n_correct"], r["greedy_correct"], r["iteration"]) for r in rows] == [(2, 1, 7), (1, 0, 7)]
    s = evaluate.summarize(rows, st)["results"]["policy"]["math_tiny"]
    # pass@1 = c/n; pass@2 = 1 - C(n-c, 2)/C(4, 2): problem 1: 1 - 1/6, problem 2: 1 - 3/6; pass@4 = 1 for both
    assert s["acc"] == 0.5 and s["pass@1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert s["pass@2"] == pytest.approx(((1 - 1 / 6) + (1 - 3 / 6)) / 2) and s["pass@4"] == 1.0


def hand_pass_at_k(rows, k):
    return sum(1 - math.comb(r["n"] - r["n_correct"], k) / math.comb(r["n"], k) for r in rows) / len(rows)


def test_eval_of_a_run_writes_policy_and_anchor_rows_and_the_report_reads_them(run_dir, tmp_path):
    assert main(["eval", str(run_dir), *EVAL]) == 0
    out = run_dir / "evals" / "in_training"
    rows = records.read_evals(out)
    test_ids = {str(e.id) for e in get_task("math_tiny").load("test", n=7, seed=1234)}
    for model in ("policy", "anchor"):
        mine = [r for r in rows if r["model"] == model]
        assert {r["problem_id"] for r in mine} == test_ids and len(mine) == 7
        assert all(r["n"] == 4 and r["iteration"] == 2 and r["benchmark"] == "math_tiny" for r in mine)
        got = json.loads((out / "eval_summary.json").read_text())["results"][model]["math_tiny"]
        for k in (1, 2, 4):
            assert got[f"pass@{k}"] == pytest.approx(hand_pass_at_k(mine, k))
        assert got["acc"] == pytest.approx(sum(r["greedy_correct"] for r in mine) / 7)
    settings = json.loads((out / "eval.json").read_text())
    assert (settings["n"], settings["temperature"], settings["top_p"], settings["max_tokens"]) == (4, 1.0, 0.95, 8)
    assert main(["report", str(run_dir), "--out", str(tmp_path / "rep")]) == 0
    table = (tmp_path / "rep" / "math_tiny_passk_eval.md").read_text()
    assert "eval in_training" in table and "anchor pass@4" in table and "policy pass@4" in table
    assert "eval in_training" not in (tmp_path / "rep" / "math_tiny_passk.md").read_text()  # training rows apart


def test_a_killed_eval_resumes_without_rescoring(run_dir, tmp_path, monkeypatch):
    mod = get_task("math_tiny")
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert main(["eval", str(run_dir), *EVAL, "--out", str(straight)]) == 0
    real_append, writes = records.append_eval_rows, []

    def dies_on_third_write(out, rows):
        if len(writes) == 2:
            raise KeyboardInterrupt  # the process is killed while the third chunk is being scored
        writes.append(len(rows))
        real_append(out, rows)

    monkeypatch.setattr(records, "append_eval_rows", dies_on_third_write)
    assert main(["eval", str(run_dir), *EVAL, "--out", str(killed)]) == 130
    assert len(records.read_evals(killed)) == 4  # two chunks of two problems
    monkeypatch.setattr(records, "append_eval_rows", real_append)
    scored = []
    real_evaluate = mod.evaluate
    monkeypatch.setattr(mod, "evaluate", lambda ex, text: scored.append(str(ex.id)) or real_evaluate(ex, text))
    assert main(["eval", str(run_dir), *EVAL, "--out", str(killed)]) == 0
    assert len(scored) == (2 * 7 - 4) * (4 + 1)  # the 10 problems left, each n samples + greedy
    first = {r["problem_id"] for r in records.read_evals(killed)[:4] if r["model"] == "policy"}
    assert len(first) == 4 and not first & set(scored[: 3 * 5])  # the policy's 3 left, then the anchor's 7
    assert by_key(records.read_evals(killed)) == by_key(records.read_evals(straight))
    assert main(["eval", str(run_dir), *EVAL[:-4], "--n", "3", "--out", str(killed)]) == 2  # other settings: refused


def test_vllm_path_up_to_the_engine(monkeypatch):
    calls = {}

    class Out:
        def __init__(self, texts):
            self.outputs = [types.SimpleNamespace(text=t) for t in texts]

    class LLM:
        def __init__(self, model, seed):
            calls["llm"] = (model, seed)

        def generate(self, prompts, params):
            calls.setdefault("params", []).append(params)
            return [Out([f"{p}#{i}" for i in range(params.n)]) for p in prompts]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=types.SimpleNamespace))
    st = {"n": 3, "temperature": 0.6, "top_p": 0.95, "max_tokens": 32768}
    greedy, sampled = evaluate.vllm_samples("/m", ["p1", "p2"], st, seed=11)
    assert calls["llm"] == ("/m", 11) and greedy == ["p1#0", "p2#0"]
    assert sampled == ["p1#0", "p1#1", "p1#2", "p2#0", "p2#1", "p2#2"]  # prompt-major, as score_rows reads them
    g, s = calls["params"]
    assert (g.n, g.temperature, g.max_tokens) == (1, 0.0, 32768)
    assert (s.n, s.temperature, s.top_p, s.max_tokens, s.seed) == (3, 0.6, 0.95, 32768, 11)


def test_a_second_eval_on_one_out_is_refused_and_nothing_is_written_twice(run_dir, tmp_path, capsys):
    """The audit's case: two `emapg eval` into one --out wrote every row twice (8 problems for --limit 4). While
    one evaluation holds the directory, a second exits 2 in one line naming it; a run record is no --out."""
    out = tmp_path / "ev"
    with owner.held(out, "evaluation"):
        assert main(["eval", str(run_dir), *EVAL, "--limit", "4", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{out} is in use by the evaluation pid {os.getpid()}" in err[0]
    assert not (out / "evals.jsonl").exists()
    assert main(["eval", str(run_dir), *EVAL, "--limit", "4", "--out", str(out)]) == 0
    assert len(records.read_evals(out)) == 2 * 4  # policy and anchor, 4 problems each, once
    assert main(["eval", str(run_dir), *EVAL, "--out", str(run_dir)]) == 2
    assert "holds a run or a sweep record" in capsys.readouterr().err


def test_eval_of_a_tool_task_run_generates_with_the_runs_turn_and_observation_limits(tmp_path, monkeypatch):
    """A tool task evaluates as it trained: the run's rollout.max_turns and max_obs_tokens (not the defaults, 3 and
    160, which every run's evaluation used before)."""
    run = tmp_path / "search_run"
    turns = {"experiment": "search_tiny_ema_pg", "rollout.max_turns": 2, "rollout.max_obs_tokens": 50}
    assert main(["train", *small_run({**turns, "trainer.iterations": 1, "task.test_size": 4}), f"run_dir={run}"]) == 0
    seen = []

    def samples(model, tok, prompts, st, seed, env, rollout_kw):
        seen.append((env is not None, rollout_kw))
        raise KeyboardInterrupt  # what was asked is all this test needs

    monkeypatch.setattr(evaluate, "hf_samples", samples)
    assert main(["eval", str(run), *EVAL, "--out", str(tmp_path / "ev")]) == 130
    assert seen == [(True, {"max_turns": 2, "max_obs_tokens": 50})]
