"""The paper's reported numbers that could be verified, each with its source tag.

Paper: Zhang & Ba, "EMA Policy Gradient", arXiv 2602.04417 v1 (https://arxiv.org/abs/2602.04417).
Only the numbers stated in its abstract are here. The body's tables (every other benchmark, the
averages, the ablations) were not readable, so a table cell that the paper's body would hold is
shown as unavailable ("—"); nothing is filled in or guessed.

Source tags (each number names where it was read):
    [ABS]  the paper abstract (api.emergentmind.com/papers/2602.04417, sciencestack.ai/paper/2602.04417)
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCES = {"[ABS]": "abstract of arXiv 2602.04417 v1"}
SETTINGS = {
    "math": "R1-distilled Qwen-1.5B (DeepScaleR recipe); math pass@1 protocol UNVERIFIED "
    "(the released code has three; experiments/tasks/math.py, PROTOCOLS)",
    "search": "Qwen2.5-3B base, Search-R1 style; greedy exact match (the released evaluation)",
}


@dataclass(frozen=True)
class PaperNumber:
    """One reported number, in percent: a method's accuracy, or (method GAIN) EMA-PG's relative gain over GRPO."""

    setting: str  # "math" | "search"
    benchmark: str  # display name, as in analysis.tables
    method: str  # "GRPO" | "EMA-PG" | GAIN
    value: float  # percent, e.g. 33.3 for a gain of "+33.3%"
    source: str  # a key of SOURCES


GAIN = "gain"


NUMBERS: tuple[PaperNumber, ...] = (
    PaperNumber("math", "OlympiadBench", "GRPO", 50.8, "[ABS]"),
    PaperNumber("math", "OlympiadBench", "EMA-PG", 53.9, "[ABS]"),
    PaperNumber("search", "HotpotQA", "GRPO", 29.7, "[ABS]"),
    PaperNumber("search", "HotpotQA", "EMA-PG", 44.1, "[ABS]"),
    PaperNumber("search", "2WikiMultiHopQA", "GRPO", 27.4, "[ABS]"),
    PaperNumber("search", "2WikiMultiHopQA", "EMA-PG", 40.1, "[ABS]"),
)

GAINS: tuple[PaperNumber, ...] = (
    # '+33.3% on average' over 7 QA datasets; whether the mean of per-dataset gains or the gain of the means: UNVERIFIED
    PaperNumber("search", "Average", GAIN, 33.3, "[ABS]"),
)


def number(setting: str, benchmark: str, method: str) -> PaperNumber | None:
    """The reported number for one cell (method GAIN: a gain reported directly), or None when unavailable."""
    found = (p for p in NUMBERS + GAINS if (p.setting, p.benchmark, p.method) == (setting, benchmark, method))
    return next(found, None)
