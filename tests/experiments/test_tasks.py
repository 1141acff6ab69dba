"""Tasks: docstring examples, adversarial answers, answer extraction, seeded disjoint loaders."""

import random

import pytest

from experiments.tasks import TASKS, Example, get_task
from experiments.tasks import math as math_task
from experiments.tasks import math_tiny as M
from experiments.tasks import search_tiny as S

TINY = sorted(n for n in TASKS if n.endswith("_tiny"))  # synthetic, offline; the others need prepared data


def test_registry_lists_valid_names_on_error():
    assert set(TASKS) >= {"math_tiny", "search_tiny"}
    assert get_task("math_tiny") is M
    with pytest.raises(ValueError, match="valid tasks: .*math_tiny.*search_tiny"):
        get_task("gsm8k_tiny")


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_task_implements_the_interface(task):
    t = get_task(task)
    for name in (
        "load",
        "prompt",
        "evaluate",
        "reward",
        "demonstration",
        "make_env",
        "tool_response",
        "Knobs",
        "STOP_STRINGS",
        "MAX_TURNS",
        "MAX_NEW_TOKENS",
        "PRETRAIN",
    ):
        assert hasattr(t, name), f"{task} lacks {name}"
    assert (t.MAX_TURNS > 0) == bool(t.STOP_STRINGS)


def test_a_task_is_one_module_the_rest_has_defaults():
    """Discovery registers every module of experiments/tasks; a module with only the required members
    gets the single-turn defaults, and one that lacks a required member is refused by name."""
    import types
    from dataclasses import dataclass

    from experiments import tasks

    assert set(TASKS) == {"math", "math_tiny", "search", "search_tiny"}
    assert TINY == ["math_tiny", "search_tiny"]

    @dataclass(frozen=True)
    class Knobs:
        size: int = 1

    mod = types.ModuleType("experiments.tasks.echo")
    mod.NAME, mod.Knobs, mod.MAX_NEW_TOKENS = "echo", Knobs, 8
    mod.load = lambda split, n, seed=0, **knobs: [Example(f"echo/{i}", str(i), str(i)) for i in range(n)]
    mod.prompt = lambda ex: ex.prompt
    mod.evaluate = lambda ex, response: int(response == ex.answer)
    tasks.register(mod)
    ex = mod.load("test", 1)[0]
    assert (mod.STOP_STRINGS, mod.MAX_TURNS, mod.PRETRAIN) == ((), 0, {})
    assert mod.reward(ex, "0") == 1.0 and mod.reward(ex, "1") == 0.0
    assert mod.make_env(size=2) is None and mod.tool_response("0", None) is None
    with pytest.raises(ValueError, match="unknown echo knob"):
        mod.make_env(colour=1)
    with pytest.raises(NotImplementedError, match="echo has no demonstrations"):
        mod.demonstration(ex)
    bad = types.ModuleType("experiments.tasks.bad")
    bad.NAME, bad.STOP_STRINGS = "bad", ("</x>",)
    with pytest.raises(TypeError, match="lacks Knobs, MAX_NEW_TOKENS, load, prompt, evaluate, MAX_TURNS, make_env"):
        tasks.register(bad)


@pytest.mark.parametrize("task", TINY)
def test_loader_is_seeded_and_splits_are_disjoint(task):
    t = get_task(task)
    a, b = t.load("train", 200, seed=3), t.load("train", 200, seed=3)
    assert a == b and len(a) == 200
    assert [e.id for e in t.load("train", 200, seed=4)] != [e.id for e in a]
    test = t.load("test", 100, seed=0)
    assert len({e.id for e in test}) == 100  # test problems are distinct
    train_ids = {e.id for s in range(3) for e in t.load("train", 300, seed=s)}
    assert train_ids.isdisjoint({e.id for e in test})


@pytest.mark.parametrize("task", TINY)
def test_demonstrations_are_correct(task):
    t = get_task(task)
    rng = random.Random(0)
    for ex in t.load("test", 50, seed=1):
        assert t.evaluate(ex, t.demonstration(ex, rng)) == 1
        assert t.reward(ex, t.demonstration(ex, rng)) == 1.0


@pytest.mark.parametrize("task", TINY)
def test_bad_arguments_name_the_allowed_values(task):
    t = get_task(task)
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        t.load("validation", 3)
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        t.load("train", 0)
    with pytest.raises(ValueError, match="allowed: "):
        t.load("train", 3, difficulty=9)


# ---------------------------------------------------------------- math_tiny


def test_math_docstring_example():
    ex = M.load("test", n=1, seed=0)[0]
    assert ex.prompt == M.prompt(ex) == "2+3+2="
    assert M.demonstration(ex) == r"2+3=5,5+2=7 \boxed{7}"
    assert ex.answer == "7" and M.evaluate(ex, M.demonstration(ex)) == 1


def _math(answer: str) -> Example:
    return Example(id="t", prompt="12+7-5=", answer=answer, meta={"terms": [12, 7, 5], "ops": ["+", "-"]})


@pytest.mark.parametrize(
    "response, expected",
    [
        (r"12+7=19,19-5=14 \boxed{14}", 1),
        (r"\boxed{14}", 1),  # no working is fine
        (r"blah \boxed{14} and then more text", 1),  # extra text
        (r"\boxed{ 14 }", 1),
        (r"\boxed{014}", 1),
        (r"\boxed{+14}", 1),  # integer spellings math-verify accepts
        ("14", 0),  # wrong format: no box
        (r"\boxed{15}", 0),
        (r"\boxed{-14}", 0),
        (r"\boxed{15} \boxed{14}", 1),  # several boxes: the last one counts
        (r"\boxed{14} \boxed{15}", 0),
        (r"\boxed{14,15}", 0),  # several answers in one box
        (r"\boxed{12+7-5}", 0),  # copying the expression is not an answer
        (r"\boxed{7+7}", 0),
        (r"\boxed{14.0}", 0),
        (r"\boxed{}", 0),
        ("", 0),
        (r"\boxed{14", 0),
        (r"\boxed{14} \boxed{1", 0),  # unclosed last box
    ],
)
def test_math_evaluate_adversarial(response, expected):
    assert M.evaluate(_math("14"), response) == expected
    assert M.reward(_math("14"), response) == float(expected)


def test_math_negative_answers():
    assert M.evaluate(_math("-10"), r"\boxed{-10}") == 1
    assert M.evaluate(_math("-10"), r"\boxed{10}") == 0


@pytest.mark.parametrize(
    "response, expected",
    [
        (r"a \boxed{1} b \boxed{ 14 }", "14"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{1} \boxed{14", None),
        ("no box", None),
        (r"\boxed{}", ""),
    ],
)
def test_math_extract_answer(response, expected):
    assert M.extract_answer(response) == expected


def test_math_knobs_control_difficulty():
    hard = M.load("train", 50, seed=0, digits=2, min_digits=2, steps=4, min_steps=4)
    assert all(len(e.meta["terms"]) == 5 and all(10 <= t <= 99 for t in e.meta["terms"]) for e in hard)
    with pytest.raises(ValueError, match="min_digits <= digits"):
        M.load("train", 5, digits=1, min_digits=2)


# ---------------------------------------------------------------- search_tiny


def test_search_docstring_example():
    ex = next(e for e in S.load("test", n=4, seed=0) if e.meta["kind"] == "born_country")
    assert ex.prompt == S.prompt(ex) == "Which country was Dares Ribe born in?"
    assert S.demonstration(ex) == (
        "<search>Dares Ribe</search><information>Dares Ribe was born in Naron. Dares Ribe works as a teacher. "
        "Dares Nizol was born in Guzu.</information><search>Naron</search><information>Naron is a city in Nozukar. "
        "Tevas Bile was born in Naron. Siru Bifer was born in Naron.</information><answer>Nozukar</answer>"
    )
    assert ex.answer == ["Nozukar"] and S.evaluate(ex, S.demonstration(ex)) == 1


def _search(answer: str = "Tesmo") -> Example:
    return Example(id="t", prompt="Where was Bara Kovin born?", answer=[answer], meta={})


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<answer>Tesmo</answer>", 1),
        ("<answer> tesmo. </answer>", 1),  # case, punctuation, whitespace
        ("<answer>The Tesmo</answer>", 1),  # articles
        ("<search>x</search><information>..</information><answer>Tesmo</answer> trailing", 1),
        ("<answer>Arvo</answer><answer>Tesmo</answer>", 1),  # last answer wins
        ("<answer>Tesmo</answer><answer>Arvo</answer>", 0),
        ("<answer>Tesmo or Arvo</answer>", 0),  # several answers in one span
        ("<answer>Tesmo, Valdoria</answer>", 0),
        ("Tesmo", 0),  # no answer tags
        ("<answer>Tesmo", 0),  # unclosed
        ("<answer>Tesmo</answer><answer>Arvo", 0),  # the last answer is unclosed
        ("<answer></answer>", 0),
        ("", 0),
    ],
)
def test_search_evaluate_adversarial(response, expected):
    assert S.evaluate(_search(), response) == expected
    assert S.reward(_search(), response) == float(expected)


def test_search_gold_aliases_and_normalisation():
    ex = Example(id="t", prompt="q", answer=["New Tesmo", "Tesmo City"], meta={})
    assert S.evaluate(ex, "<answer>tesmo city</answer>") == 1
    assert S.normalize_answer("  The  Tesmo-City! ") == "tesmocity"


class _FakeRetriever:
    def __init__(self):
        self.queries = []

    def search(self, query, k=3):
        self.queries.append((query, k))
        return [f"doc about {query}.", "other doc."]

    def batch_search(self, queries, k=3):
        return [self.search(q, k) for q in queries]


def test_search_tool_response_protocol():
    fake = _FakeRetriever()
    assert S.tool_response("<search>Bara Kovin", fake) is None  # not at a search call
    assert S.tool_response("<answer>x</answer>", fake) is None
    info = S.tool_response("<search>old</search><information>i</information><search> Bara Kovin </search>", fake)
    assert info == "<information>doc about Bara Kovin. other doc.</information>"
    assert fake.queries == [("Bara Kovin", S.TOPK)]
    assert S.tool_response("</search>", fake) == "<information></information>"  # no query
    assert S.STOP == "</search>" and S.STOP_STRINGS == (S.STOP,)


def test_search_questions_are_split_by_subject():
    train = {e.meta["subject"] for e in S.load("train", 500, seed=0)}
    test = {e.meta["subject"] for e in S.load("test", 100, seed=0)}
    assert train.isdisjoint(test)


def test_search_two_hop_fraction_and_world_knobs():
    exs = S.load("train", 100, seed=0, two_hop=0.3)
    assert sum(len(e.meta["hops"]) == 2 for e in exs) == 30
    small = S.corpus(n_people=20, n_cities=4, n_countries=2)
    assert len(small) == 2 * 20 + 4
    with pytest.raises(ValueError, match="two_hop must be in"):
        S.load("train", 5, two_hop=1.5)
    with pytest.raises(ValueError, match="only .* questions"):
        S.load("test", 500, n_people=20, n_cities=4, n_countries=2)


def test_a_task_without_a_yaml_file_is_a_config_option(monkeypatch):
    """`task=<name>` composes for a registered task that has no experiments/conf/task/<name>.yaml."""
    import types

    from hydra.core.config_store import ConfigStore

    from experiments import build, tasks

    monkeypatch.setitem(tasks.TASKS, "echo", types.ModuleType("experiments.tasks.echo"))
    try:
        cfg = build.compose(["task=echo", "task.train_size=3"])
        assert (cfg.task.name, cfg.task.train_size, cfg.task.knobs) == ("echo", 3, {})
        assert "echo" in build.group_options()["task"]
        assert build.compose(["task=search_tiny"]).task.name == "search_tiny"  # the YAML file still wins
    finally:
        ConfigStore.instance().repo["task"].pop("echo.yaml", None)


@pytest.mark.parametrize("knob", ["require_think", "instruction"])
def test_math_knobs_that_did_nothing_are_refused(knob):
    """Both were accepted and never read (the reward always needs `</think>`; no prompt got an instruction)."""
    with pytest.raises(ValueError, match=rf"unknown math knob\(s\) \['{knob}'\]; allowed: data_dir$"):
        math_task.load("train", n=1, **{knob: "x"})
