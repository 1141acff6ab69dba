"""The real math and search tasks: rewards (docstring examples), data preparation to verl parquet
with fixture loaders in the HF sources' schemas (no network), stage presets and pass@k.
The last test [verl] loads the prepared parquet with verl's own RLHFDataset."""

import numpy as np
import pandas as pd
import pytest

from experiments.tasks import Example
from experiments.tasks import math as m
from experiments.tasks import search as s

# ------------------------------------------------------------------ fixtures in the sources' schemas
MATH_ROWS = {
    "deepscaler": [
        {"problem": "What is $1+1$?", "answer": "2", "solution": "..."},
        {"problem": "Compute $\\frac{1}{2}+\\frac{1}{4}$.", "answer": "\\frac{3}{4}", "solution": "..."},
    ],
    "aime2024": [{"problem": "Find $x$ if $x^2=49$ and $x>0$.", "answer": "7", "id": 1}],
    "amc": [{"question": "What is $3 \\cdot 4$?", "answer": "12"}],
    "math500": [
        {
            "problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
            "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
            "subject": "Precalculus",
        }
    ],
    "minerva": [{"question": "Give $2^{10}$.", "answer": "1024"}],
    "olympiad_bench": [{"question": "Solve $x^2=4$.", "final_answer": ["$2$", "$-2$"], "id": 7}],
}


def math_loader(name):
    return MATH_ROWS[name]


def search_loader(source, split):
    if split == "train":
        return [{"question": f"who wrote {source} book one", "golden_answers": ["Ann Smith", "A. Smith"]}]
    if source == "bamboogle":
        return None  # a source without the split: skipped
    return [{"question": f"where is {source} located?", "golden_answers": ["Paris"]}]


# ------------------------------------------------------------------ math
def test_math_docstring_example():
    ex = Example(id="math/math500/0", prompt="...", answer=["\\left( 3, \\frac{\\pi}{2} \\right)"])
    response = "<think> r = 3, theta = pi/2 ... </think> The answer is $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$."
    assert m.evaluate(ex, response) == 1 and m.reward(ex, response) == 1.0


@pytest.mark.parametrize(
    "response,gold,want",
    [
        ("<think>..</think> so \\boxed{0.5}", ["\\frac{1}{2}"], 1.0),  # math-verify equivalence
        ("<think>..</think> \\boxed{1} then \\boxed{2}", ["2"], 1.0),  # last box counts
        ("<think>.. \\boxed{2}", ["2"], 0.0),  # thought never closed: format error
        ("<think>..</think> 2", ["2"], 0.0),  # no box
        ("\\boxed{2}</think> nothing boxed after", ["2"], 0.0),  # only the text after </think> counts
        ("<think>..</think> \\boxed{-2}", np.array(["$2$", "$-2$"], dtype=object), 1.0),  # any gold answer
        ("<think>..</think> \\boxed{" + "1" * 400 + "}", ["1"], 0.0),  # over-long answers are not parsed
    ],
)
def test_math_compute_score(response, gold, want):
    assert m.compute_score("x", response, gold) == want


def test_math_prepare_writes_verl_parquet(tmp_path):
    files = m.prepare(str(tmp_path), loader=math_loader)
    assert set(files) == {"train", "test", "val", *m.BENCHMARKS}
    train, test = pd.read_parquet(files["train"]), pd.read_parquet(files["test"])
    assert len(train) == 2 and len(test) == 5 and set(test["data_source"]) == set(m.BENCHMARKS)
    row = test[test.data_source == "olympiad_bench"].iloc[0]
    assert list(row["reward_model"]["ground_truth"]) == ["$2$", "$-2$"] and row["ability"] == "math"
    assert list(row["prompt"])[0]["role"] == "user" and row["extra_info"]["split"] == "test"
    exs = m.load("train", n=5, seed=0, data_dir=str(tmp_path))
    assert sorted(e.answer[0] for e in exs) == ["2", "\\frac{3}{4}"]
    assert m.reward(exs[0], "<think>.</think>\\boxed{" + exs[0].answer[0] + "}") == 1.0


def test_math_stages_and_protocols():
    assert [m.STAGES[k].max_response_length for k in ("8k", "16k", "24k")] == [8192, 16384, 24576]
    assert m.STAGES["8k"].mask_truncated and not m.STAGES["16k"].mask_truncated
    o = m.stage_overrides("16k")
    assert o["rollout.max_new_tokens"] == 16384 and o["trainer.iterations"] == 800
    assert o["backend.verl.overrides"] == ["data.seed=986"]
    assert o["backend.verl.mask_truncated"] is False and m.stage_overrides("8k")["backend.verl.mask_truncated"] is True
    assert "trainer.iterations" not in m.stage_overrides("24k")  # its end is unpublished
    p = m.PROTOCOLS["readme"]
    assert (p.n, p.temperature, p.top_p, p.max_tokens, p.seed) == (32, 0.8, 0.9, 28000, 429)


def test_pass_at_k():
    # n=5, c=2: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7; pass@4 = 1 (n - c < k)
    assert m.pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert m.pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert m.pass_at_k(5, 2, 4) == 1.0 and m.pass_at_k(5, 0, 3) == 0.0
    with pytest.raises(ValueError):
        m.pass_at_k(3, 4, 1)


# ------------------------------------------------------------------ search
def test_search_template_and_reward():
    q = s.format_question("  who got the first nobel prize in physics ")
    assert q.startswith("Answer the given question. You must conduct reasoning inside <think>")
    assert q.endswith("Question: who got the first nobel prize in physics?\n")
    resp = "<think>x</think><search> q </search>\n\n<information>..</information>\n\n" + (
        "<answer> Wilhelm Conrad Röntgen </answer>"
    )
    assert s.compute_score("nq", resp, np.array(["Wilhelm Conrad Röntgen"])) == 1.0
    assert s.compute_score("nq", "<answer>The  Paris.</answer>", ["paris"]) == 1.0  # SQuAD normalisation
    assert s.compute_score("nq", "<answer>Paris</answer><answer>Rome</answer>", ["paris"]) == 0.0  # last span
    assert s.compute_score("nq", "Paris", ["paris"]) == 0.0


def test_search_tool_protocol():
    class Fake:
        def search(self, query, k=3):
            return [f'"Title {i}"\ntext {i} for {query}' for i in range(k)]

    out = s.tool_response("<think>a</think><search> eiffel tower </search>", Fake())
    assert out.startswith('\n\n<information>Doc 1(Title: "Title 0") text 0 for eiffel tower\nDoc 2(')
    assert out.endswith("</information>\n\n")
    assert s.tool_response("<answer>x</answer>", Fake()) is None


def test_search_prepare(tmp_path):
    files = s.prepare(str(tmp_path), loader=search_loader)
    train, test = pd.read_parquet(files["train"]), pd.read_parquet(files["test"])
    assert list(train["data_source"]) == ["nq", "hotpotqa"]
    assert set(test["data_source"]) == set(s.TEST_SOURCES) - {"bamboogle"}
    uids = [e["uid"] for e in train["extra_info"]]
    assert len(set(uids)) == len(uids)  # unique group ids across sources (NQ/HotpotQA indices collide)
    ex = s.load("train", n=1, seed=0, data_dir=str(tmp_path))[0]
    assert s.evaluate(ex, "<answer>A. Smith</answer>") == 1


@pytest.mark.parametrize("task", [m, s])
def test_load_before_prepare_names_the_file_and_the_fix(task, tmp_path):
    with pytest.raises(ValueError, match=rf"train.parquet not found: run experiments.tasks.{task.NAME}.prepare"):
        task.load("train", n=1, data_dir=str(tmp_path))


@pytest.mark.verl
def test_verl_dataset_reads_prepared_parquet(tmp_path, tiny_path):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    files = m.prepare(str(tmp_path), loader=math_loader)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    cfg = OmegaConf.create(
        {
            "max_prompt_length": 256,
            "return_raw_chat": True,
            "filter_overlong_prompts": False,
            "cache_dir": str(tmp_path / "cache"),
        }
    )
    ds = RLHFDataset(data_files=[files["test"]], tokenizer=tok, config=cfg)
    assert len(ds) == 5
    item = ds[0]
    assert item["data_source"] in m.BENCHMARKS and list(item["reward_model"]["ground_truth"])
