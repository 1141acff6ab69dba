"""Retrieval for search tasks: one interface, BM25 and e5 dense retrievers, an HTTP server/client pair.

The local trainer can call `BM25Retriever` in process; the verl backend (and anyone running the
retriever on another machine) needs a service, so the same retriever is served over HTTP with the
request/response shape of Search-R1's retrieval server:

    emapg retriever serve --task search_tiny --port 8000        # host defaults to 127.0.0.1
    emapg retriever serve --corpus wiki-18.jsonl --port 8000    # BM25 over a local corpus file
    emapg retriever serve --corpus wiki-18.jsonl --retriever e5 --index e5_Flat.index   # Search-R1's setup
    emapg retriever index --corpus wiki-18.jsonl --out e5_Flat.index    # encode once, serve with --index
    POST /retrieve  {"queries": ["Bara Kovin"], "topk": 3}  ->  {"result": [["passage", ...]]}
    GET  /health    -> {"status": "ok", "num_docs": 1234}

Two retrievers: BM25 (`bm25s`, the default) and `DenseRetriever` (experiments/tasks/dense_retriever.py:
intfloat/e5-base-v2 embeddings, exact inner-product search with a FAISS IndexFlatIP where `faiss` is
installed, a torch matmul otherwise), which is the paper's (Search-R1's) retriever. `--index` reads a
prebuilt FAISS index such as Search-R1's `e5_Flat.index` instead of encoding the corpus (encoding
wiki-18's 21M passages takes GPU hours); it must list the passages in the corpus file's order.
Simplifications compared with Search-R1: results are plain passage strings (no scores); the e5
encoder runs in float32. A corpus file is Search-R1's / FlashRAG's JSONL (one {"id", "contents"}
object per line, contents = '"Title"\ntext', e.g. wiki-18.jsonl) or plain text, one passage per line.
Both retrievers hold their index in memory (wiki-18: tens of GB for BM25, about 65 GB for e5).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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


def __getattr__(name: str):
    """`DenseRetriever` is imported on first use: it needs torch, which BM25 and the HTTP client do not."""
    if name == "DenseRetriever":
        from experiments.tasks.dense_retriever import DenseRetriever

        return DenseRetriever
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    path = check_file("--corpus", path)
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


RETRIEVERS = ("bm25", "e5")
E5_FLAGS = ("model", "index", "batch_size")  # argparse dests that apply to --retriever e5 only


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="emapg retriever", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="serve a task's corpus or a corpus file over HTTP (POST /retrieve, GET /health)")
    p.add_argument("--task", default="search_tiny", help="task whose corpus is served (BM25)")
    p.add_argument("--corpus", help="serve this file instead (JSONL with 'contents', or one passage per line)")
    p.add_argument("--retriever", default="bm25", choices=RETRIEVERS, help="bm25 (default) or e5 (dense; needs --corpus)")
    p.add_argument("--model", help="e5 only: encoder name or local dir (default: intfloat/e5-base-v2)")
    p.add_argument("--index", help="e5 only: prebuilt FAISS index of --corpus (e.g. Search-R1's e5_Flat.index)")
    p.add_argument("--batch-size", type=_positive_int, help="e5 only: texts per encoder batch (default: 64)")
    p.add_argument("--host", default=DEFAULT_HOST, help="bind address (default: loopback only)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port, 0-65535 (0: any free port; default 8000)")
    p.add_argument("knobs", nargs="*", metavar="knob=value", help="task knobs, e.g. n_people=300")
    p = sub.add_parser("index", help="encode a corpus file with e5 and write a FAISS IndexFlatIP (needs faiss)")
    p.add_argument("--corpus", required=True, help="JSONL with 'contents', or one passage per line")
    p.add_argument("--out", required=True, help="the index file to write, e.g. e5_Flat.index")
    p.add_argument("--model", help="encoder name or local dir (default: intfloat/e5-base-v2)")
    p.add_argument("--batch-size", type=_positive_int, help="texts per encoder batch (default: 64)")
    return parser


def _check_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flag errors of `serve`, before any corpus or model is loaded."""
    if args.corpus and args.knobs:
        parser.error("task knobs do not apply to --corpus")
    given = [f"--{d.replace('_', '-')}" for d in E5_FLAGS if getattr(args, d) is not None]
    if args.retriever == "bm25" and given:
        parser.error(f"{', '.join(given)}: only for --retriever e5 "
                     f"(--retriever is one of: {', '.join(RETRIEVERS)}; default bm25)")
    if args.retriever == "e5" and not args.corpus:
        parser.error("--retriever e5 needs --corpus FILE (JSONL with 'contents', or one passage per line)")
    if args.index is not None:
        check_file("--index", args.index)
        _require_faiss()


def _check_index_args(args: argparse.Namespace) -> None:
    """Flag errors of `index`, before the corpus is read or anything is encoded."""
    out_dir = os.path.dirname(os.path.abspath(os.path.expanduser(args.out)))
    if not os.path.isdir(out_dir):
        raise ValueError(f"--out {args.out!r}: directory {out_dir} does not exist")
    _require_faiss()


def _positive_int(text: str) -> int:
    if not text.lstrip("-").isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {text!r}")
    return int(text)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port 0-65535; got {text!r}")
    return int(text)


def check_file(flag: str, path: str) -> str:
    """`path` with ``~`` expanded; ValueError naming `flag` when it is not a file."""
    expanded = os.path.expanduser(path)
    if not os.path.isfile(expanded):
        raise ValueError(f"{flag} {path!r}: no such file")
    return expanded


def _require_faiss() -> None:
    from experiments.tasks.dense_retriever import import_faiss

    import_faiss()  # ImportError naming the install command


def _dense_kwargs(args: argparse.Namespace) -> dict:
    """DenseRetriever / write_faiss_index keyword arguments from --model and --batch-size."""
    return {k: v for k, v in (("model", args.model), ("batch_size", args.batch_size)) if v is not None}


def main(argv: Sequence[str] | None = None) -> None:
    """`emapg retriever serve ...` or `emapg retriever index ...` (see the module docstring)."""
    from experiments.tasks import get_task

    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "index":
        from experiments.tasks.dense_retriever import write_faiss_index

        _check_index_args(args)
        docs = load_corpus(args.corpus)
        write_faiss_index(docs, args.out, **_dense_kwargs(args))
        print(f"wrote {args.out} ({len(docs)} passages)", flush=True)
        return
    _check_serve_args(parser, args)
    knobs = {}
    for item in args.knobs:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"knob {item!r} must look like key=value")
        knobs[key] = yaml.safe_load(value)  # "300" -> 300, "0.5" -> 0.5, "abc" -> "abc"
    if args.retriever == "e5":
        from experiments.tasks.dense_retriever import DenseRetriever

        env = DenseRetriever(load_corpus(args.corpus), index_path=args.index, **_dense_kwargs(args))
        what = f"{args.corpus} with e5 ({env.backend} search)"
    elif args.corpus:
        env, what = BM25Retriever(load_corpus(args.corpus)), args.corpus
    else:
        env, what = get_task(args.task).make_env(**knobs), args.task
        if env is None or not hasattr(env, "docs"):
            raise ValueError(f"task {args.task!r} has no local corpus to serve; use --task search_tiny or --corpus FILE")
    print(f"serving {what} ({len(env.docs)} passages) on http://{args.host}:{args.port}", flush=True)
    serve(env, args.host, args.port)


if __name__ == "__main__":
    main()
