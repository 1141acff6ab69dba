"""Retrieval for search tasks: one interface, an in-process BM25 and an HTTP server/client pair.

The local trainer can call `BM25Retriever` in process; the verl backend (and anyone running the
retriever on another machine) needs a service, so the same retriever is served over HTTP with the
request/response shape of Search-R1's retrieval server:

    emapg retriever serve --task search_tiny --port 8000        # host defaults to 127.0.0.1
    emapg retriever serve --corpus wiki-18.jsonl --port 8000    # BM25 over a local corpus file
    POST /retrieve  {"queries": ["Bara Kovin"], "topk": 3}  ->  {"result": [["passage", ...]]}
    GET  /health    -> {"status": "ok", "num_docs": 1234}

Simplifications compared with Search-R1: BM25 (`bm25s`) only, no e5 dense index; results are plain
passage strings (no scores). A corpus file is Search-R1's / FlashRAG's JSONL (one {"id", "contents"}
object per line, contents = '"Title"\ntext', e.g. wiki-18.jsonl) or plain text, one passage per line;
BM25 holds its index in memory (the 21M-passage wiki-18 needs tens of GB).
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
from typing import Iterator, Protocol, Sequence

import numpy as np
import yaml
from pydantic import BaseModel, Field

DEFAULT_HOST = "127.0.0.1"


class Retriever(Protocol):
    """Anything that returns the top-k passages for a query."""

    def search(self, query: str, k: int = 3) -> list[str]: ...
    def batch_search(self, queries: Sequence[str], k: int = 3) -> list[list[str]]: ...


def _check_k(k: int) -> None:
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k (topk) must be an integer >= 1; got {k!r}")


class BM25Retriever:
    """BM25 (Lucene variant, k1=1.5, b=0.75, as bm25s defaults) over `docs`, English stopwords removed.

    Results are ordered by score, ties broken by document order (deterministic); documents with a
    zero score (no query term in common) are dropped, so a query matching nothing returns [].
    """

    def __init__(self, docs: Sequence[str]):
        import bm25s

        if not docs:
            raise ValueError("docs must be a non-empty sequence of passages")
        self.docs = list(docs)
        self._bm25s = bm25s
        self._index = bm25s.BM25()
        self._index.index(self._tokenize(self.docs), show_progress=False)
        self._lock = threading.Lock()  # bm25s is not documented as thread-safe; the server uses threads

    def _tokenize(self, texts: Sequence[str]) -> list[list[str]]:
        return self._bm25s.tokenize(list(texts), stopwords="en", return_ids=False, show_progress=False)

    def search(self, query: str, k: int = 3) -> list[str]:
        """Top-`k` passages for `query` (fewer when fewer documents share a term with it)."""
        return self.batch_search([query], k)[0]

    def batch_search(self, queries: Sequence[str], k: int = 3) -> list[list[str]]:
        """Top-`k` passages for each query: len(result) == len(queries)."""
        _check_k(k)
        out = []
        for tokens in self._tokenize(queries):
            if not tokens:
                out.append([])
                continue
            with self._lock:
                scores = self._index.get_scores(tokens)  # (num_docs,)
            top = np.argsort(-scores, kind="stable")[:k]  # stable: ties keep document order
            out.append([self.docs[i] for i in top if scores[i] > 0])
        return out


class HTTPRetriever:
    """Client for a retrieval server started by `serve` (or Search-R1-compatible ones)."""

    def __init__(self, url: str, timeout: float = 30.0):
        import httpx

        self.url = url.rstrip("/")
        self._client = httpx.Client(timeout=timeout)

    def search(self, query: str, k: int = 3) -> list[str]:
        return self.batch_search([query], k)[0]

    def batch_search(self, queries: Sequence[str], k: int = 3) -> list[list[str]]:
        _check_k(k)
        response = self._client.post(f"{self.url}/retrieve", json={"queries": list(queries), "topk": k})
        response.raise_for_status()
        return response.json()["result"]

    def health(self) -> dict:
        response = self._client.get(f"{self.url}/health")
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self._client.close()


# ---------------------------------------------------------------- server


class RetrieveRequest(BaseModel):
    """Body of POST /retrieve (Search-R1's field names)."""

    queries: list[str]
    topk: int = Field(default=3, ge=1, le=100)


def make_app(retriever: Retriever, num_docs: int | None = None):
    """The FastAPI app serving `retriever` (POST /retrieve, GET /health)."""
    from fastapi import FastAPI

    app = FastAPI(title="emapg retriever")

    @app.post("/retrieve")
    def retrieve(request: RetrieveRequest) -> dict:
        return {"result": retriever.batch_search(request.queries, request.topk)}

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "num_docs": num_docs}

    return app


def _server(retriever: Retriever, host: str, port: int):
    import uvicorn

    num_docs = len(retriever.docs) if hasattr(retriever, "docs") else None
    config = uvicorn.Config(make_app(retriever, num_docs), host=host, port=port, log_level="warning")
    return uvicorn.Server(config)


def serve(retriever: Retriever, host: str = DEFAULT_HOST, port: int = 8000) -> None:
    """Serve `retriever` over HTTP until interrupted (blocking)."""
    _server(retriever, host, port).run()


@contextlib.contextmanager
def running_server(retriever: Retriever, host: str = DEFAULT_HOST, port: int = 0,
                   startup_timeout: float = 10.0) -> Iterator[str]:
    """Serve `retriever` in a background thread; yields its base URL and shuts it down on exit.

    `port=0` lets the OS pick a free port.
    """
    server = _server(retriever, host, port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"retriever server did not start on {host}:{port}")
        time.sleep(0.02)
    bound_port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=startup_timeout)


def load_corpus(path: str) -> list[str]:
    """Passages of a corpus file: JSONL objects with a "contents" field, or one passage per text line."""
    import json
    import os

    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise ValueError(f"--corpus {path!r}: no such file")
    passages = []
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
    if not passages:
        raise ValueError(f"--corpus {path!r} holds no passages")
    return passages


def main(argv: Sequence[str] | None = None) -> None:
    """`emapg retriever serve (--task search_tiny [knob=value ...] | --corpus FILE) [--port 8000] [--host 127.0.0.1]`."""
    from experiments.tasks import get_task

    parser = argparse.ArgumentParser(prog="emapg retriever", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="serve a task's corpus over HTTP (POST /retrieve, GET /health)")
    p.add_argument("--task", default="search_tiny", help="task whose corpus is served")
    p.add_argument("--corpus", help="serve BM25 over this file instead (JSONL with 'contents', or one passage per line)")
    p.add_argument("--host", default=DEFAULT_HOST, help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("knobs", nargs="*", metavar="knob=value", help="task knobs, e.g. n_people=300")
    args = parser.parse_args(argv)
    knobs = {}
    for item in args.knobs:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"knob {item!r} must look like key=value")
        knobs[key] = yaml.safe_load(value)  # "300" -> 300, "0.5" -> 0.5, "abc" -> "abc"
    if args.corpus:
        if knobs:
            parser.error("task knobs do not apply to --corpus")
        env, what = BM25Retriever(load_corpus(args.corpus)), args.corpus
    else:
        env, what = get_task(args.task).make_env(**knobs), args.task
        if env is None or not hasattr(env, "docs"):
            raise ValueError(f"task {args.task!r} has no local corpus to serve; use --task search_tiny or --corpus FILE")
    print(f"serving {what} ({len(env.docs)} passages) on http://{args.host}:{args.port}", flush=True)
    serve(env, args.host, args.port)


if __name__ == "__main__":
    main()
