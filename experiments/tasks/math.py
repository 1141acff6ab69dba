r"""math: competition math with a boxed final answer (the paper's DeepScaleR recipe).

Training set agentica-org/DeepScaleR-Preview-Dataset; benchmarks AIME 2024, AMC (LiveMathBench
v202412_AMC_en), MATH-500, Minerva and OlympiadBench (OE_TO_maths_en_COMP), loaded with HF
`datasets` exactly as the authors' prepare_all_math_data.py does, written to verl parquet by
`prepare(out_dir)` (`emapg data prepare math`: from the hub, or `--from` a local copy; tests
pass a fixture loader). A real example (MATH-500):

    prompt:    "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates. ..."
    response:  "<think> r = 3, theta = pi/2 ... </think> The answer is $\boxed{\left( 3, \frac{\pi}{2} \right)}$."
    answer:    ["\left( 3, \frac{\pi}{2} \right)"]      evaluate(example, response) == 1

Reward (the rLLM math reward the paper used): the text after the last `</think>` must contain a
`\boxed{}`; its content is compared with the gold answer(s) by math-verify. No `</think>` (a
truncated thought), no box, or a wrong answer: 0. Same function for verl (`compute_score`).

Schedule: three stages of growing response length (`STAGES`: 8k -> 16k -> 24k tokens), each
resuming from the previous stage's checkpoint (the EMA anchor carries over). Evaluation protocols
(`PROTOCOLS`) and the unbiased pass@k estimator (`pass_at_k`) are below.

Simplifications: the prompt is the raw problem as the user message (the authors' MathAgent adds
no instruction); math-verify runs without its SIGALRM timeout
(it fails outside the main thread, e.g. in Ray/verl reward workers), so boxed answers longer than
`MAX_ANSWER_CHARS` score 0 instead of risking a slow parse.
"""

from __future__ import annotations

import math as _math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from experiments.tasks import (
    Example,
    Rehearsal,
    RehearsalData,
    Reporting,
    Source,
    make_knobs,
    prepared_examples,
    write_prepared,
)
from experiments.tasks.math_tiny import extract_answer as last_boxed
from experiments.tasks.math_tiny import is_equiv

NAME = "math"
MAX_NEW_TOKENS = 8192  # stage 1 response budget; see STAGES
MAX_ANSWER_CHARS = 300
THINK_END = "</think>"

# name -> (HF dataset, config, split, question field, answer field): the authors' sources
SOURCES = {
    "deepscaler": ("agentica-org/DeepScaleR-Preview-Dataset", None, "train", "problem", "answer"),
    "aime2024": ("HuggingFaceH4/aime_2024", None, "train", "problem", "answer"),
    "amc": ("opencompass/LiveMathBench", "v202412_AMC_en", "test", "question", "answer"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem", "answer"),
    "minerva": ("math-ai/minervamath", None, "test", "question", "answer"),
    "olympiad_bench": ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train", "question", "final_answer"),
}
TRAIN = ("deepscaler",)
BENCHMARKS = ("aime2024", "amc", "math500", "minerva", "olympiad_bench")
VALIDATION = ("aime2024",)  # the in-training validation set of the paper's scripts
# The report's paper-format table: the five benchmarks' pass@1 beside the paper's math numbers.
REPORTING = Reporting(
    benchmarks=("AIME24", "AMC", "MATH-500", "Minerva", "OlympiadBench"),
    names={
        "aime24": "AIME24",
        "aime2024": "AIME24",
        "amc": "AMC",
        "amc23": "AMC",
        "amc2023": "AMC",
        "math500": "MATH-500",
        "minerva": "Minerva",
        "minervamath": "Minerva",
        "olympiadbench": "OlympiadBench",
        "olympiad": "OlympiadBench",
    },
    metrics=("pass@1", "acc"),
    paper="math",
)
# `emapg rehearse`: single-turn prompts of a few characters; a turn is a boxed sum (`rehearsal_data`).
REHEARSAL = Rehearsal(prompt_tokens=128, turn_tokens=24)


@dataclass(frozen=True)
class Knobs:
    data_dir: str = "~/data/emapg/math"  # where `prepare` wrote the parquet files


@dataclass(frozen=True)
class Stage:
    """One stage of the paper's released 8k/16k/24k schedule; later stages resume the previous one."""

    max_response_length: int
    mask_truncated: bool  # drop length-capped responses from the update, after advantages
    data_seed: int
    iterations: tuple[int, int | None]  # (start, end) global steps; the 24k stage's end is not published


STAGES = {
    "8k": Stage(8192, True, 6725, (0, 480)),
    "16k": Stage(16384, False, 986, (480, 800)),
    "24k": Stage(24576, False, 986, (800, None)),
}


def stage_overrides(stage: str) -> dict:
    """Run-config keys (dotted) for one stage (where it starts from: experiments.stages.verl_resume_overrides)."""
    if stage not in STAGES:
        raise ValueError(f"unknown math stage {stage!r}; allowed: {', '.join(STAGES)}")
    s = STAGES[stage]
    out = {
        "rollout.max_new_tokens": s.max_response_length,
        "backend.verl.max_response_length": s.max_response_length,
        "backend.verl.mask_truncated": s.mask_truncated,
        "backend.verl.overrides": [f"data.seed={s.data_seed}"],
    }
    if s.iterations[1] is not None:
        out["trainer.iterations"] = s.iterations[1]
    return out


# ---------------------------------------------------------------- data preparation (verl parquet)
def hf_loader(name: str) -> Iterable[dict]:
    """Rows of one source from the HF hub (network)."""
    from datasets import load_dataset

    path, config, split, _, _ = SOURCES[name]
    return load_dataset(path, config, split=split) if config else load_dataset(path, split=split)


def sources() -> list[Source]:
    """Every data set `prepare` loads, with the arguments it passes its loader (`emapg data prepare`)."""
    return [Source((name,), path, config, (split,), (q, a)) for name, (path, config, split, q, a) in SOURCES.items()]


def _gold(value) -> list[str]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return [str(v).strip() for v in values]


def verl_row(source: str, index: int, question: str, gold: list[str], split: str) -> dict:
    """One verl RL-dataset row (verl's RLHFDataset schema): chat prompt, rule reward with the gold answers."""
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": question.strip()}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gold},
        "extra_info": {"split": split, "index": index, "source": source},
    }


def rows(name: str, loader: Callable[[str], Iterable[dict]] = hf_loader) -> list[dict]:
    _, _, _, q_key, a_key = SOURCES[name]
    split = "train" if name in TRAIN else "test"
    return [verl_row(name, i, ex[q_key], _gold(ex[a_key]), split) for i, ex in enumerate(loader(name))]


def prepare(out_dir: str, loader: Callable[[str], Iterable[dict]] = hf_loader) -> dict[str, str]:
    """Write train.parquet, test.parquet (all benchmarks), val.parquet (AIME24) and <benchmark>.parquet."""
    tables = {name: rows(name, loader) for name in TRAIN + BENCHMARKS}
    groups = {"train": TRAIN, "test": BENCHMARKS, "val": VALIDATION, **{b: (b,) for b in BENCHMARKS}}
    return write_prepared(out_dir, {file: [r for n in names for r in tables[n]] for file, names in groups.items()})


def rehearsal_data(out_dir, rows: dict[str, int]) -> RehearsalData:
    """The rehearsal's data, written by `prepare`: single-digit sums ("Compute 3+4", gold "7"), `rows["train"]`
    for training and `rows["test"]` per benchmark; a tiny model learns the format (and some sums) in seconds,
    so rewards vary. SFT pairs: "3+4</think>\\boxed{7}"."""

    def sums(n: int, seed: int) -> list[tuple[str, str]]:
        rng = random.Random(seed)
        return [(f"Compute {a}+{b}", str(a + b)) for a, b in ((rng.randrange(10), rng.randrange(10)) for _ in range(n))]

    def loader(name: str):
        _, _, _, q_key, a_key = SOURCES[name]
        n = rows["train"] if name in TRAIN else rows["test"]
        return [{q_key: q, a_key: a} for q, a in sums(n, seed=sorted(SOURCES).index(name))]

    files = prepare(str(out_dir), loader=loader)
    sft = [(q, f"{q[len('Compute ') :]}{THINK_END}\\boxed{{{a}}}") for q, a in sums(200, seed=100)]
    return RehearsalData(files=files, sft=sft)


# ---------------------------------------------------------------- the task interface
def load(split: str, n: int, seed: int = 0, **knobs) -> list[Example]:
    """Up to `n` prepared problems of `split` (train, test, val or a benchmark name), shuffled by `seed`."""
    k = make_knobs(Knobs, NAME, knobs)
    example_id = lambda r: f"{NAME}/{r['data_source']}/{r['extra_info']['index']}"
    return prepared_examples(NAME, k.data_dir, split, n=n, seed=seed, example_id=example_id)


def prompt(example: Example) -> str:
    return example.prompt


def extract_answer(response: str) -> str | None:
    r"""Content of the last `\boxed{}` after the last `</think>`; None without either (or if too long)."""
    if THINK_END not in response:
        return None
    answer = last_boxed(response.rsplit(THINK_END, 1)[1])
    return answer if answer and len(answer) <= MAX_ANSWER_CHARS else None


def evaluate(example: Example, response: str) -> int:
    pred = extract_answer(response)
    gold = example.answer if isinstance(example.answer, list) else [example.answer]
    return int(pred is not None and is_equiv(pred, gold))


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's custom reward function (reward.custom_reward_function.path=experiments.tasks.math)."""
    gold = _gold(list(ground_truth) if not isinstance(ground_truth, str) else ground_truth)
    pred = extract_answer(solution_str)
    return float(pred is not None and is_equiv(pred, gold))


# ---------------------------------------------------------------- evaluation protocol
@dataclass(frozen=True)
class Protocol:
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None = None


PROTOCOLS = {  # the three in the released code (README, benchmark defaults, in-training); which one
    # the paper's tables used is unverified
    "readme": Protocol(n=32, temperature=0.8, top_p=0.9, max_tokens=28000, seed=429),  # pass@1 = mean of 32
    "benchmark": Protocol(n=16, temperature=0.6, top_p=0.95, max_tokens=32768),
    "in_training": Protocol(n=8, temperature=1.0, top_p=0.95, max_tokens=8192),
}


def pass_at_k(n, c, k: int):
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), exact in integers
    and rounded once (Python's int / int). `n` and `c` may be arrays (one entry per problem, as
    analysis.stats.pass_at_k_frame passes; an array back); requires 0 <= c <= n and 1 <= k <= n."""
    n_arr, c_arr = np.broadcast_arrays(np.asarray(n, dtype=int), np.asarray(c, dtype=int))
    if (c_arr < 0).any() or (c_arr > n_arr).any() or k < 1 or (k > n_arr).any():
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    pairs = zip(n_arr.ravel().tolist(), c_arr.ravel().tolist())
    out = np.array([1.0 - _math.comb(ni - ci, k) / _math.comb(ni, k) for ni, ci in pairs]).reshape(n_arr.shape)
    return float(out) if out.ndim == 0 else out
