"""Retrieval for search tasks: one interface, BM25 and e5 dense retrievers, an HTTP server/client pair.

    experiments/ops/retrieval/__init__.py   the `Retriever` protocol and what every retriever shares
                                        (argument checks, reading a corpus file, importing faiss)
    experiments/ops/retrieval/bm25.py       `BM25Retriever` (`bm25s`, the default)
    experiments/ops/retrieval/dense.py      `DenseRetriever`: intfloat/e5-base-v2 embeddings, exact
                                        inner-product search (FAISS IndexFlatIP, else a torch matmul)
    experiments/ops/retrieval/service.py    the HTTP server (`serve`, `running_server`) and its client
                                        `HTTPRetriever`
    experiments/ops/retrieval/cli.py        `emapg retriever serve|index`

Dependencies point one way: bm25, dense and service import only this module (which imports
experiments.errors for its messages); cli imports them (and, for `serve --task`, the task
registry); a task (search_tiny, search) imports bm25 or service.

The local trainer can call `BM25Retriever` in process; the verl backend (and anyone running the
retriever on another machine) needs a service, so the same retriever is served over HTTP with the
request/response shape of Search-R1's retrieval server:

    emapg retriever serve --task search_tiny --port 8000        # host defaults to 127.0.0.1
    emapg retriever serve --task search_tiny --host 0.0.0.0 --allow-remote   # other machines: set a token
    emapg retriever serve --corpus wiki-18.jsonl --port 8000    # BM25 over a local corpus file
    emapg retriever serve --corpus wiki-18.jsonl --retriever e5 --index e5_Flat.index   # Search-R1's setup
    emapg retriever index --corpus wiki-18.jsonl --out e5_Flat.index    # encode once, serve with --index
    POST /retrieve  {"queries": ["Bara Kovin"], "topk": 3}  ->  {"result": [["passage", ...]]}
    GET  /health    -> {"status": "ok", "num_docs": 1234}

The token (EMAPG_RETRIEVER_TOKEN or --token) and the bounds on a request and a connection (`Limits`, 401 / 413 /
422): `service`'s docstring and docs/scaling-out.md, "The retriever service".

The dense retriever is the paper's (Search-R1's). `--index` reads a prebuilt FAISS index such as
Search-R1's `e5_Flat.index` instead of encoding the corpus (encoding wiki-18's 21M passages takes
GPU hours); it must list the passages in the corpus file's order.
Simplifications compared with Search-R1: results are plain passage strings (no scores); the e5
encoder runs in float32. A corpus file is Search-R1's / FlashRAG's JSONL (one {"id", "contents"}
object per line, contents = '"Title"\ntext', e.g. wiki-18.jsonl) or plain text, one passage per line.
Both retrievers hold their index in memory (wiki-18: tens of GB for BM25, about 65 GB for e5).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Protocol

from experiments.errors import undecodable

FAISS_HINT = "pip install faiss-cpu (or the [retrieval] extra: pip install -e '.[retrieval]')"


class Retriever(Protocol):
    """Anything that returns the top-k passages for a query."""

    def search(self, query: str, k: int = 3) -> list[str]: ...
    def batch_search(self, queries: Sequence[str], k: int = 3) -> list[list[str]]: ...


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


def faiss_available() -> bool:
    try:
        import_faiss()
    except ImportError:
        return False
    return True


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
