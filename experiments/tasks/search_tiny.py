"""search_tiny: 1-hop and 2-hop questions over a generated knowledge base, answered by searching.

A seeded world of fictional people, cities and countries is written as one short passage per fact
and indexed with BM25 (`retriever.BM25Retriever`, top-3). The policy follows the Search-R1
protocol: it writes `<search>query</search>`, generation stops at `STOP`, the environment appends
`tool_response(...)` = `<information>passages</information>` (observation tokens: no loss), and it
finally writes `<answer>...</answer>`. A real 2-hop example (the first 2-hop question of
`load("test", n=4, seed=0)`, default knobs) and its demonstration:

    prompt:   "Which country was Dares Ribe born in?"
    response: "<search>Dares Ribe</search><information>Dares Ribe was born in Naron. Dares Ribe
              works as a teacher. Dares Nizol was born in Guzu.</information><search>Naron</search>
              <information>Naron is a city in Nozukar. Tevas Bile was born in Naron. Siru Bifer was
              born in Naron.</information><answer>Nozukar</answer>"      (one line; wrapped here)
    answer:   ["Nozukar"]          evaluate(example, response) == 1

The other question kinds: "Where was X born?" (city), "What is the job of X?" (job) and
"Which country is C in?" (country), each answered by one search.

Reward: exact match of the LAST `<answer>...</answer>` span with a gold answer after SQuAD
normalisation (lower-case; punctuation, articles a/an/the and extra whitespace removed).

Simplifications compared with the paper's search task (Search-R1 on NQ/HotpotQA with an e5 index
over Wikipedia): a generated world, BM25, short passages, no chat template or instructions.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from functools import lru_cache

from experiments.ops.retrieval import Retriever
from experiments.ops.retrieval.bm25 import BM25Retriever
from experiments.tasks import Example, check_load, hash_split, make_knobs

NAME = "search_tiny"
STOP = "</search>"
STOP_STRINGS: tuple[str, ...] = (STOP,)  # generation pauses there for the environment's passages
MAX_TURNS = 3  # environment calls per rollout (2-hop questions need 2)
MAX_NEW_TOKENS = 48  # tokens (= characters) per turn
# Calibrated warm start of the tiny model (experiments.pretrain): SFT stops when greedy validation accuracy
# reaches target_acc; steps is only a cap. Measured on 100 test problems, greedy / sampled (temperature 1,
# mean of 4 samples), pretrain seeds 0, 1, 2: stops at 320/360/320 steps; greedy .36/.43/.37, sampled
# .19/.26/.20; seed 0 takes ~80 s on 2 idle CPU threads (170 s on a loaded machine).
PRETRAIN = dict(steps=800, target_acc=0.35, eval_every=20, batch_size=16, lr=3e-3)
TOPK = 3  # passages per search
TEST_BUCKETS = 5  # 1 in TEST_BUCKETS question subjects (by a hash of the entity name) is test; the rest train
JOBS = ("baker", "pilot", "farmer", "doctor", "painter", "teacher", "sailor", "miner", "tailor", "singer")


@dataclass(frozen=True)
class Knobs:
    """World and question-mix knobs (the defaults are the calibrated ones, see experiments/pretrain.py)."""

    world_seed: int = 0  # fixed across training seeds, so that runs share one corpus
    # People in the world (2 passages each: birthplace, job); ~1/5 of them are test subjects, enough for 200
    # distinct test questions at two_hop=0.5.
    n_people: int = 600
    n_cities: int = 24  # 1 passage each: its country
    n_countries: int = 8
    two_hop: float = 0.5  # fraction of 2-hop questions ("Which country was X born in?"); the rest are 1-hop

    def __post_init__(self):
        for name in ("n_people", "n_cities", "n_countries"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 2:
                raise ValueError(f"search_tiny knob {name} must be an integer >= 2; got {getattr(self, name)!r}")
        if not 0.0 <= self.two_hop <= 1.0:
            raise ValueError(f"search_tiny knob two_hop must be in [0, 1]; got {self.two_hop!r}")

    def world(self) -> tuple[int, int, int, int]:
        return (self.world_seed, self.n_people, self.n_cities, self.n_countries)


@dataclass(frozen=True)
class Question:
    kind: str  # born | job | country (1-hop) | born_country (2-hop)
    subject: str  # entity the question is about (decides the split)
    text: str
    answer: str
    hops: tuple[str, ...]  # the search queries of the demonstration, one per hop
    facts: tuple[str, ...]  # the passage each hop must retrieve


@dataclass
class World:
    docs: list[str]
    questions: list[Question]
    retriever: BM25Retriever


def _words(rng: random.Random, count: int, syllables: int, taken: set[str]) -> list[str]:
    """`count` new pronounceable capitalised words (consonant-vowel syllables + optional coda)."""
    out = []
    while len(out) < count:
        word = "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(syllables))
        word = (word + rng.choice(["", "", "n", "l", "r", "s"])).capitalize()
        if word.lower() not in taken:
            taken.add(word.lower())
            out.append(word)
    return out


@lru_cache(maxsize=4)
def _world(world_seed: int, n_people: int, n_cities: int, n_countries: int) -> World:
    """Entities, passages (one per fact), questions, and a BM25 index; built once per knob set."""
    rng = random.Random(world_seed)
    taken: set[str] = set()
    countries = _words(rng, n_countries, 3, taken)
    cities = _words(rng, n_cities, 2, taken)
    firsts, lasts = _words(rng, 40, 2, taken), _words(rng, 40, 2, taken)
    if n_people > len(firsts) * len(lasts):
        raise ValueError(f"search_tiny knob n_people must be <= {len(firsts) * len(lasts)}; got {n_people}")
    names = rng.sample([f"{first} {last}" for first in firsts for last in lasts], n_people)
    country_of = {c: rng.choice(countries) for c in cities}
    docs, questions = [], []
    for c in cities:
        docs.append(f"{c} is a city in {country_of[c]}.")
        questions.append(Question("country", c, f"Which country is {c} in?", country_of[c], (c,), (docs[-1],)))
    for p in names:
        city, job = rng.choice(cities), rng.choice(JOBS)
        born, works = f"{p} was born in {city}.", f"{p} works as a {job}."
        docs += [born, works]
        city_doc = f"{city} is a city in {country_of[city]}."
        questions += [
            Question("born", p, f"Where was {p} born?", city, (p,), (born,)),
            Question("job", p, f"What is the job of {p}?", job, (p,), (works,)),
            Question(
                "born_country", p, f"Which country was {p} born in?", country_of[city], (p, city), (born, city_doc)
            ),
        ]
    retriever = BM25Retriever(docs)
    # Keep only questions whose every hop retrieves its fact, so demonstrations are always valid.
    ok = [q for q in questions if all(f in retriever.search(h, TOPK) for h, f in zip(q.hops, q.facts))]
    return World(docs=docs, questions=ok, retriever=retriever)


def corpus(**knobs) -> list[str]:
    """All passages of the world defined by `knobs` (what a retrieval server indexes)."""
    return list(_world(*make_knobs(Knobs, NAME, knobs).world()).docs)


def make_env(**knobs) -> BM25Retriever:
    """The in-process retriever over the world's corpus (cached per world)."""
    return _world(*make_knobs(Knobs, NAME, knobs).world()).retriever


def _example(q: Question, k: Knobs) -> Example:
    meta = {"kind": q.kind, "subject": q.subject, "hops": list(q.hops), "world": asdict(k)}
    return Example(id=f"{NAME}/{q.kind}/{q.subject}", prompt=q.text, answer=[q.answer], meta=meta)


def _draw(pool: list[Question], m: int, rng: random.Random, split: str) -> list[Question]:
    """`m` questions: shuffled passes over `pool` (test: at most one pass, i.e. all distinct)."""
    if split == "test" and m > len(pool):
        raise ValueError(
            f"search_tiny test split has only {len(pool)} questions of this kind; "
            f"asked for {m} (lower n or raise n_people)"
        )
    out: list[Question] = []
    while len(out) < m and pool:
        out += rng.sample(pool, min(len(pool), m - len(out)))
    return out


def load(split: str, n: int, seed: int = 0, **knobs) -> list[Example]:
    """`n` questions of `split`, a `two_hop` fraction of them 2-hop; deterministic in all arguments. Split by
    subject entity (no person or city in both splits); test questions are distinct, train ones repeat only when n
    exceeds the pool."""
    check_load(split, n)
    k = make_knobs(Knobs, NAME, knobs)
    questions = [q for q in _world(*k.world()).questions if hash_split(q.subject, TEST_BUCKETS) == split]
    rng = random.Random(f"{NAME}/{split}/{seed}")
    n2 = round(n * k.two_hop)
    picked = _draw([q for q in questions if len(q.hops) == 2], n2, rng, split) + _draw(
        [q for q in questions if len(q.hops) == 1], n - n2, rng, split
    )
    rng.shuffle(picked)
    return [_example(q, k) for q in picked]


def prompt(example: Example) -> str:
    return example.prompt  # the bare question, e.g. 'Where was Tesa Lunul born?'


def searched(response_so_far: str, retriever: Retriever, k: int) -> list[str] | None:
    """The top-`k` passages for the query between the last `<search>` and the final `</search>` ([] for an empty or
    missing query); None when the response does not end with `</search>` (search's tool protocol too)."""
    text = response_so_far.rstrip()
    if not text.endswith(STOP):
        return None
    start = text.rfind("<search>")
    query = text[start + len("<search>") : -len(STOP)].strip() if start != -1 else ""
    return retriever.search(query, k) if query else []


def tool_response(response_so_far: str, retriever: Retriever, k: int = TOPK) -> str | None:
    """`<information>passages joined by spaces</information>` (`searched`), or None."""
    passages = searched(response_so_far, retriever, k)
    return None if passages is None else "<information>" + " ".join(passages) + "</information>"


def demonstration(example: Example, rng=None) -> str:
    """The full Search-R1 trajectory: one search per hop with the passages the BM25 retriever
    returns, then the answer. `rng` is unused (one canonical demonstration)."""
    retriever = make_env(**example.meta["world"])
    response = ""
    for query in example.meta["hops"]:
        response += f"<search>{query}</search>"
        response += tool_response(response, retriever)
    return response + f"<answer>{example.answer[0]}</answer>"


def extract_answer(response: str) -> str | None:
    """Content of the LAST `<answer>...</answer>` span, stripped; None when the last `<answer>` is
    not closed or there is none. '<answer>a</answer><answer>b</answer>' -> 'b'."""
    start = response.rfind("<answer>")
    if start == -1:
        return None
    end = response.find("</answer>", start)
    return response[start + len("<answer>") : end].strip() if end != -1 else None


def normalize_answer(s: str) -> str:
    """SQuAD v1.1 normalisation: lower-case, drop punctuation and articles, squeeze whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def em(prediction: str | None, golden: Iterable[str]) -> int:
    return int(prediction is not None and any(normalize_answer(prediction) == normalize_answer(g) for g in golden))


def evaluate(example: Example, response: str) -> int:
    """1 if the last answer span exactly matches a gold answer after normalisation, else 0."""
    return em(extract_answer(response), example.answer if isinstance(example.answer, list) else [example.answer])
