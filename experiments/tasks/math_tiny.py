r"""math_tiny: multi-step integer arithmetic (chain sums) answered in `\boxed{}`, for tiny CPU models.

Problems come from reasoning-gym's `chain_sum` generator (offline, seeded); a tiny char-level model
sees only the compact expression and writes one step per operation, then the boxed result.
A real example (`load("test", n=1, seed=0)[0]` with the default knobs):

    prompt:        "2+3+2="
    demonstration: "2+3=5,5+2=7 \boxed{7}"
    answer:        "7"              evaluate(example, demonstration) == 1

Reward: the LAST `\boxed{...}` of the response must hold an integer literal (`-10`, `+07`), which
math-verify (the field's answer checker) compares with the gold answer. An expression such as
`\boxed{2+3+2}` scores 0: math-verify would evaluate it, and copying the prompt would be an
easy reward hack for RL. No `\boxed{}` scores 0.

Simplifications compared with the paper's math task (DAPO/MATH data, Qwen models): synthetic
problems, single-turn, no chat template, a ~0.5M-parameter char-level model.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

from experiments.tasks import Example, check_load, hash_split, make_knobs


def _not_the_timeout_notice(record: logging.LogRecord) -> bool:
    """math-verify warns once per process that its timeouts are off; ours are off on purpose
    (see `evaluate`), so that line would only be noise in every trial's log."""
    return not record.getMessage().startswith("Timeout is disabled")


for _logger in ("math_verify.parser", "math_verify.grader"):  # filters do not propagate: one per logger
    logging.getLogger(_logger).addFilter(_not_the_timeout_notice)

NAME = "math_tiny"  # single turn, no environment: the registry's defaults (experiments.tasks)
MAX_NEW_TOKENS = 48  # tokens (= characters) per turn; demonstrations use <= 36
# Calibrated warm start of the tiny model (experiments.pretrain): SFT stops when greedy validation accuracy
# reaches target_acc; steps is only a cap. Measured on 100 test problems, greedy / sampled (temperature 1,
# mean of 4 samples), pretrain seeds 0, 1, 2: stops at 780/520/540 steps; greedy .31/.37/.32, sampled
# .245/.30/.23; seed 0 takes 38 s on 2 idle CPU threads.
PRETRAIN = dict(steps=2000, target_acc=0.35, eval_every=20, batch_size=32, lr=3e-3)
TEST_BUCKETS = 5  # 1 in TEST_BUCKETS distinct problems (by a hash of the prompt) is test; the rest train

_INT = re.compile(r"[+-]?\d{1,12}")  # the answer format; the length cap keeps sympy away from huge inputs


@dataclass(frozen=True)
class Knobs:
    """Difficulty knobs (the defaults are the calibrated ones, see experiments/pretrain.py)."""

    digits: int = 1  # most digits per number (each problem draws its digit count in [min_digits, digits])
    min_digits: int = 1
    steps: int = 3  # most operations (+ or -) per problem; a problem has steps + 1 numbers
    min_steps: int = 1

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"math_tiny knob {f.name} must be an integer >= 1; got {value!r}")
        if self.min_digits > self.digits or self.min_steps > self.steps:
            raise ValueError(f"math_tiny knobs need min_digits <= digits and min_steps <= steps; got {self}")


def _example(entry: dict, split: str) -> Example:
    """Turn one reasoning-gym chain_sum entry into an Example (prompt = compact expression)."""
    tokens = entry["metadata"]["expression"].split()  # "57 + 87 - 70" -> ["57", "+", "87", "-", "70"]
    text = "".join(tokens) + "="
    meta = {
        "terms": [int(t) for t in tokens[0::2]],
        "ops": tokens[1::2],
        "source": "reasoning_gym/chain_sum",
        "source_index": entry["metadata"]["source_index"],
        "split": split,
    }
    return Example(id=f"{NAME}/{text}", prompt=text, answer=str(entry["answer"]), meta=meta)


def load(split: str, n: int, seed: int = 0, **knobs) -> list[Example]:
    """`n` distinct problems of `split` ('train' or 'test'), deterministic in (split, n, seed, knobs): those of
    reasoning-gym's chain_sum stream for `seed` whose prompt hashes into `split` (no problem in both splits)."""
    try:
        import reasoning_gym  # lazy: ~0.6 s import
    except ImportError as e:
        raise ImportError(
            "math_tiny's problems come from reasoning-gym, an optional dependency: pip install -e '.[tiny]' "
            "(`make setup` installs it; the GPU install leaves it out)"
        ) from e

    check_load(split, n)
    k = make_knobs(Knobs, NAME, knobs)
    ds = reasoning_gym.create_dataset(
        "chain_sum",
        min_terms=k.min_steps + 1,
        max_terms=k.steps + 1,
        min_digits=k.min_digits,
        max_digits=k.digits,
        seed=seed,
        size=10**9,
    )
    out: dict[str, Example] = {}
    for idx in range(50 * n + 1000):
        ex = _example(ds[idx], split)
        if ex.prompt not in out and hash_split(ex.prompt, TEST_BUCKETS) == split:
            out[ex.prompt] = ex
            if len(out) == n:
                return list(out.values())
    raise ValueError(
        f"math_tiny: only {len(out)} distinct {split} problems found for n={n}; "
        f"raise the difficulty knobs (digits, steps) or lower n (knobs: {asdict(k)})"
    )


def prompt(example: Example) -> str:
    return example.prompt  # the compact expression, e.g. '12+7-5='


def demonstration(example: Example, rng=None) -> str:
    r"""'12+7-5=' -> '12+7=19,19-5=14 \boxed{14}': one step per operation, then the boxed result (`rng` unused)."""
    terms, ops = example.meta["terms"], example.meta["ops"]
    value, steps = terms[0], []
    for op, term in zip(ops, terms[1:]):
        new = value + term if op == "+" else value - term
        steps.append(f"{value}{op}{term}={new}")
        value = new
    return ",".join(steps) + f" \\boxed{{{value}}}"


def extract_answer(response: str) -> str | None:
    r"""Content of the LAST `\boxed{...}` (braces balanced), stripped; None when there is none or it is unclosed:
    'a \boxed{1} b \boxed{ 14 }' -> '14'; '\boxed{1} \boxed{14' -> None."""
    start = response.rfind("\\boxed{")
    if start == -1:
        return None
    depth, i = 1, start + len("\\boxed{")
    while i < len(response) and depth:
        depth += {"{": 1, "}": -1}.get(response[i], 0)
        i += 1
    return response[start + len("\\boxed{") : i - 1].strip() if depth == 0 else None


def evaluate(example: Example, response: str) -> int:
    """1 if the last boxed answer is an integer literal equal to the gold answer, else 0."""
    answer = extract_answer(response)
    return int(answer is not None and _INT.fullmatch(answer) is not None and is_equiv(answer, [str(example.answer)]))


def is_equiv(pred: str, gold: Iterable[str]) -> bool:
    """math-verify's equivalence of a boxed prediction with any gold answer (math's reward uses it too)."""
    from math_verify import verify  # here, not at import: `emapg report` reads this package's metadata

    target = _parsed(pred)
    return any(verify(_parsed(g), target, timeout_seconds=None) for g in gold)


@functools.lru_cache(maxsize=4096)
def _parsed(literal: str) -> list:
    """math-verify's parse of ``\\boxed{literal}``, memoised: a batch repeats the same few answers, and parsing
    (sympy) is most of a reward's cost. Timeouts off: math-verify's timeout uses SIGALRM, which fails outside
    the main thread (Ray/uvicorn workers); answers are capped in length instead (_INT here, math's
    MAX_ANSWER_CHARS)."""
    from math_verify import parse

    return parse(f"\\boxed{{{literal}}}", parsing_timeout=None)
