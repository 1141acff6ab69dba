"""Retrieval for search tasks: one interface, BM25 and e5 dense retrievers, an HTTP server/client pair.

    __init__.py   the `Retriever` protocol and what every retriever shares (argument checks, corpus files, faiss)
    bm25.py       `BM25Retriever` (`bm25s`, the default)
    dense.py      `DenseRetriever`: e5-base-v2 embeddings, exact inner-product search (FAISS, else torch)
    service.py    the HTTP server (`serve`, `running_server`) with Search-R1's request/response shape, and
                  its client `HTTPRetriever`
    cli.py        `emapg retriever serve|index` (usage: docs/scaling-out.md, "The retriever service")

bm25, dense and service import only this module; cli imports them (and, for `serve --task`, the task registry);
a task imports bm25 or service. The local trainer can call `BM25Retriever` in process; the verl backend needs the
service. A corpus file is Search-R1's / FlashRAG's JSONL (one {"id", "contents"} object a line, e.g. wiki-18.jsonl)
or plain text, one passage a line. Unlike Search-R1, results are plain passage strings (no scores) and the e5
encoder runs in float32.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Protocol

from experiments.errors import undecodable

FAISS_HINT = "pip install faiss-cpu (or the [retrieval] extra: pip install -e '.[retrieval]')"


class Retriever(Protocol):
    """Anything that returns the top-k passages for a query; a subclass inherits `search`."""

    def batch_search(self, queries: Sequence[str], k: int = 3) -> list[list[str]]: ...

    def search(self, query: str, k: int = 3) -> list[str]:
        return self.batch_search([query], k)[0]


def check_k(k: int) -> None:
    """ValueError unless `k` (the number of passages asked for) is an integer >= 1."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k (topk) must be an integer >= 1; got {k!r}")


def check_file(flag: str, path: str) -> str:
    """`path` with ``~`` expanded; ValueError naming `flag` when it is not a file."""
    expanded = os.path.expanduser(path)
    if not os.path.isfile(expanded):
        raise ValueError(f"{flag} {path!r}: no such file")
    return expanded


def import_faiss():
    """The `faiss` module (the e5 retriever's index); ImportError with the install command when it is missing."""
    try:
        import faiss
    except ImportError:
        raise ImportError(f"the FAISS index needs faiss: {FAISS_HINT}") from None
    return faiss


def load_corpus(path: str) -> list[str]:
    """Passages of a corpus file: JSONL objects with a "contents" field, or one passage per text line."""
    path = check_file("--corpus", path)
    passages = []
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                if path.endswith((".jsonl", ".json")):
                    try:
                        passages.append(str(json.loads(line)["contents"]))
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise ValueError(f"{path}:{i}: expected a JSON object with a 'contents' field") from None
                else:
                    passages.append(line)
    except UnicodeDecodeError as e:
        raise ValueError(f"--corpus {path!r}: {undecodable(e)}; a corpus is JSONL or plain text") from None
    if not passages:
        raise ValueError(f"--corpus {path!r} holds no passages")
    return passages
