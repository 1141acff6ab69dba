"""search: Search-R1 question answering with a retriever (the paper's search recipe).

Training set: NQ + HotpotQA train splits; test sets: NQ, TriviaQA, PopQA, HotpotQA, 2WikiMultiHopQA,
Musique, Bamboogle (their test split, else dev, else train), all from RUC-NLPIR/FlashRAG_datasets
via HF `datasets`, in Search-R1's "base" prompt template, written to verl parquet by
`prepare(out_dir)` (`emapg data prepare search`: from the hub, or `--from` a local copy; tests
pass a fixture loader). A real example (NQ):

    prompt:   "Answer the given question. You must conduct reasoning inside <think> and </think> ...
               Question: who got the first nobel prize in physics?"
    response: "<think>I need to search.</think><search> first nobel prize in physics </search>
               <information>Doc 1(Title: "Nobel Prize in Physics") ... Wilhelm Röntgen ...</information>
               <answer> Wilhelm Conrad Röntgen </answer>"                          (one string)
    answer:   ["Wilhelm Conrad Röntgen"]          evaluate(example, response) == 1

Reward: exact match (SQuAD normalisation: lower-case, no punctuation/articles, squeezed spaces) of
the LAST `<answer>...</answer>` span with any gold answer: 1 or 0, no format reward. Evaluation:
greedy decoding, 4 searches of top-3 passages, EM per data source (the released evaluation).

Tool protocol: generation stops at `</search>`; the environment appends
`\\n\\n<information>Doc 1(Title: ...) ...</information>\\n\\n` (top-3 passages from `emapg retriever
serve`, or any `experiments.ops.retrieval.Retriever`); those tokens get no loss.

Simplifications compared with Search-R1: verl 0.9.1 passes only the response to the reward, so one
`<answer>` span suffices (Search-R1 decodes the prompt too and needs two); group ids are unique per
prompt (the released code's per-dataset indices collide between NQ and HotpotQA).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from experiments.ops.retrieval.service import HTTPRetriever
from experiments.tasks import (
    Example,
    Rehearsal,
    RehearsalData,
    Reporting,
    Source,
    make_knobs,
    prepared_examples,
    search_tiny,
    write_prepared,
)
from experiments.tasks.search_tiny import em, evaluate, extract_answer, normalize_answer  # noqa: F401  same rules

NAME = "search"
STOP = "</search>"
STOP_STRINGS: tuple[str, ...] = (STOP,)
MAX_TURNS = 4  # search calls per rollout; one more generation gives the final answer
MAX_NEW_TOKENS = 500  # per-turn generation budget (max_response_length of the paper's script)
TOPK = 3
FLASHRAG = "RUC-NLPIR/FlashRAG_datasets"
TRAIN_SOURCES = ("nq", "hotpotqa")
TEST_SOURCES = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
TEST_SPLITS = ("test", "dev", "train")  # a test set's split: the first of these the data set has
BENCHMARKS = TEST_SOURCES  # named as their `data_source` (metric keys eval/<name>/acc on the verl backend)
# The report's paper-format table: greedy exact match on the seven test sets beside the paper's search numbers.
REPORTING = Reporting(
    benchmarks=("NQ", "TriviaQA", "PopQA", "HotpotQA", "2WikiMultiHopQA", "Musique", "Bamboogle"),
    names={
        "nq": "NQ",
        "naturalquestions": "NQ",
        "triviaqa": "TriviaQA",
        "popqa": "PopQA",
        "hotpotqa": "HotpotQA",
        "2wikimultihopqa": "2WikiMultiHopQA",
        "2wiki": "2WikiMultiHopQA",
        "musique": "Musique",
        "bamboogle": "Bamboogle",
    },
    metrics=("acc", "pass@1"),
    paper="search",
)
# `emapg rehearse`: the Search-R1 template is ~630 tokens of the tiny tokenizer; a turn is a `<search> name
# </search>` or `<answer> name </answer>`; two searches and their information fit 224 tokens.
REHEARSAL = Rehearsal(prompt_tokens=768, turn_tokens=40, response_tokens=224, max_turns=2, tool_response_tokens=48)
# Search-R1's "base" template, verbatim (including its "as your want").
TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge needed, "
    "you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Question: {question}\n"
)


@dataclass(frozen=True)
class Knobs:
    data_dir: str = "~/data/emapg/search"  # where `prepare` wrote the parquet files
    retriever_url: str = "http://127.0.0.1:8000"  # `emapg retriever serve` endpoint used by `make_env`


# ---------------------------------------------------------------- data preparation (verl parquet)
def format_question(question: str) -> str:
    """Search-R1's cleanup: strip, end with '?'; then the base template."""
    q = question.strip()
    return TEMPLATE.format(question=q if q.endswith("?") else q + "?")


def verl_row(source: str, index: int, question: str, golden: list[str], split: str) -> dict:
    """One verl RL-dataset row; `extra_info.uid` is unique across sources (the GRPO group id)."""
    uid = f"{source}/{split}/{index}"
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": format_question(question)}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": [str(g) for g in golden]},
        "extra_info": {"split": split, "index": index, "uid": uid, "question": question.strip()},
    }


def hf_loader(source: str, split: str) -> Iterable[dict] | None:
    """FlashRAG rows of `source` for `split` ('train', or 'test' = test, else dev, else train); network."""
    from datasets import load_dataset

    ds = load_dataset(FLASHRAG, source)
    if split == "train":
        return ds["train"]
    return next((ds[name] for name in TEST_SPLITS if name in ds), None)


def sources() -> list[Source]:
    """Every data set `prepare` loads, with the arguments it passes its loader (`emapg data prepare`)."""
    fields = ("question", "golden_answers")
    train = [Source((s, "train"), FLASHRAG, s, ("train",), fields) for s in TRAIN_SOURCES]
    return train + [Source((s, "test"), FLASHRAG, s, TEST_SPLITS, fields) for s in TEST_SOURCES]


def rows(split: str, loader: Callable[[str, str], Iterable[dict]] = hf_loader) -> list[dict]:
    sources = TRAIN_SOURCES if split == "train" else TEST_SOURCES
    return [
        verl_row(s, i, ex["question"], list(ex["golden_answers"]), split)
        for s in sources
        for i, ex in enumerate(loader(s, split) or [])
    ]


def prepare(out_dir: str, loader: Callable[[str, str], Iterable[dict]] = hf_loader) -> dict[str, str]:
    """Write train.parquet (NQ + HotpotQA) and test.parquet (the 7 test sets)."""
    return write_prepared(out_dir, {split: rows(split, loader) for split in ("train", "test")})


def rehearsal_data(out_dir, rows: dict[str, int]) -> RehearsalData:
    """The rehearsal's data: search_tiny's questions in every source (`rows["train"]` training questions in all,
    `rows["test"]` per test source), written by `prepare`; its world as the corpus (corpus.jsonl, for `emapg
    retriever serve --corpus`); SFT pairs of whole trajectories (search call, information, answer)."""

    def loader(source: str, split: str):
        seed = sorted(set(TRAIN_SOURCES + TEST_SOURCES)).index(source) + (0 if split == "train" else 50)
        n = rows["train"] // len(TRAIN_SOURCES) if split == "train" else rows["test"]
        return [
            {"question": ex.prompt, "golden_answers": list(ex.answer)}
            for ex in search_tiny.load("train", n=n, seed=seed)
        ]

    files = prepare(str(out_dir), loader=loader)
    corpus = Path(out_dir) / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i, passage in enumerate(search_tiny.corpus()):
            f.write(json.dumps({"id": str(i), "contents": passage}) + "\n")
    env, sft = search_tiny.make_env(), []
    for ex in search_tiny.load("train", n=64, seed=100):
        query = f"<search> {ex.meta['subject']} </search>"
        answer = f"<answer> {ex.answer[0]} </answer>"
        sft.append((format_question(ex.prompt), query + tool_response(query, env) + answer))
    return RehearsalData(files=files, sft=sft, corpus=str(corpus))


# ---------------------------------------------------------------- the task interface
def load(split: str, n: int, seed: int = 0, **knobs) -> list[Example]:
    """Up to `n` prepared questions of `split` (train, test or a test-set name), shuffled by `seed`."""
    k = make_knobs(Knobs, NAME, knobs)
    return prepared_examples(
        NAME, k.data_dir, split, n=n, seed=seed, example_id=lambda r: f"{NAME}/{r['extra_info']['uid']}"
    )


def prompt(example: Example) -> str:
    return example.prompt


def format_passages(passages: list[str]) -> str:
    """Search-R1's passage string: 'Doc i(Title: <first line>) <rest>' per passage, one per line."""
    out = []
    for i, p in enumerate(passages):
        title, _, text = p.partition("\n")
        out.append(f"Doc {i + 1}(Title: {title.strip()}) {text.strip()}" if text else f"Doc {i + 1} {title.strip()}")
    return "\n".join(out) + ("\n" if out else "")


def tool_response(response_so_far: str, env, k: int = TOPK) -> str | None:
    """`\\n\\n<information>...</information>\\n\\n` after a response ending in `<search>q</search>`, else None."""
    passages = search_tiny.searched(response_so_far, env, k)
    return None if passages is None else f"\n\n<information>{format_passages(passages).strip()}</information>\n\n"


def make_env(**knobs):
    """An HTTP client of `emapg retriever serve` (BM25 or dense, over the Wikipedia corpus)."""
    return HTTPRetriever(make_knobs(Knobs, NAME, knobs).retriever_url)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's custom reward function (reward.custom_reward_function.path=experiments.tasks.search)."""
    gold = [ground_truth] if isinstance(ground_truth, str) else [str(g) for g in ground_truth]
    return float(em(extract_answer(solution_str), gold))
