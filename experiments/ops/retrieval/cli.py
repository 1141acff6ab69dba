"""`emapg retriever serve|index`: serve a task's corpus or a corpus file over HTTP, or build an e5 FAISS index.

Usage: docs/scaling-out.md, "The retriever service"."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from experiments import user_yaml
from experiments.ops.retrieval import check_file, import_faiss, load_corpus
from experiments.ops.retrieval.bm25 import BM25Retriever
from experiments.ops.retrieval.service import (
    DEFAULT_HOST,
    TOKEN_ENV,
    Limits,
    bind,
    configured_token,
    is_loopback,
    serve,
)

DESCRIPTION = "Retrieval for search tasks: one interface, BM25 and e5 dense retrievers, an HTTP server/client pair."
RETRIEVERS = ("bm25", "e5")
E5_FLAGS = ("model", "index", "batch_size")  # argparse dests that apply to --retriever e5 only
LIMITS = Limits()  # the defaults of --max-body-bytes, --max-queries, --max-topk


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="emapg retriever", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="serve a task's corpus or a corpus file over HTTP (POST /retrieve, GET /health)")
    p.add_argument("--task", default="search_tiny", help="task whose corpus is served (BM25)")
    p.add_argument("--corpus", help="serve this file instead (JSONL with 'contents', or one passage per line)")
    p.add_argument(
        "--retriever", default="bm25", choices=RETRIEVERS, help="bm25 (default) or e5 (dense; needs --corpus)"
    )
    p.add_argument("--model", help="e5 only: encoder name or local dir (default: intfloat/e5-base-v2)")
    p.add_argument("--index", help="e5 only: prebuilt FAISS index of --corpus (e.g. Search-R1's e5_Flat.index)")
    p.add_argument("--batch-size", type=_positive_int, help="e5 only: texts per encoder batch (default: 64)")
    p.add_argument("--host", default=DEFAULT_HOST, help="bind address (default: loopback only)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port, 0-65535 (0: any free port; default 8000)")
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a --host other than loopback (reachable from other machines: give it a token)",
    )
    p.add_argument(
        "--token",
        help=f"require 'Authorization: Bearer <token>' on every request (default: ${TOKEN_ENV}, which is "
        "better: a flag shows in the process list; clients send the variable's value)",
    )
    for dest, what in (
        ("max_body_bytes", "largest request body, else 413"),
        ("max_queries", "most queries in one POST /retrieve, else 422"),
        ("max_topk", "largest topk of a POST /retrieve, else 422"),
    ):
        default = getattr(LIMITS, dest)
        flag = "--" + dest.replace("_", "-")
        p.add_argument(flag, type=_positive_int, default=default, help=f"{what} (default {default})")
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
        parser.error(
            f"{', '.join(given)}: only for --retriever e5 "
            f"(--retriever is one of: {', '.join(RETRIEVERS)}; default bm25)"
        )
    if args.retriever == "e5" and not args.corpus:
        parser.error("--retriever e5 needs --corpus FILE (JSONL with 'contents', or one passage per line)")
    if args.index is not None:
        check_file("--index", args.index)
        import_faiss()  # ImportError naming the install command
    if not args.allow_remote and not is_loopback(args.host):
        raise ValueError(
            f"--host {args.host} is not a loopback address: the retriever would be reachable from other "
            f"machines; add --allow-remote (and set {TOKEN_ENV}), or leave --host at {DEFAULT_HOST}"
        )
    token = configured_token(args.token)
    if token is not None and not re.fullmatch(r"[!-~]+", token):
        raise ValueError(f"--token / ${TOKEN_ENV}: must be printable ASCII without spaces (it goes in an HTTP header)")


def _positive_int(text: str) -> int:
    if not text.lstrip("-").isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {text!r}")
    return int(text)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port 0-65535; got {text!r}")
    return int(text)


def _dense_kwargs(args: argparse.Namespace) -> dict:
    """DenseRetriever / write_faiss_index keyword arguments from --model and --batch-size."""
    return {k: v for k, v in (("model", args.model), ("batch_size", args.batch_size)) if v is not None}


def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "index":
        from experiments.ops.retrieval.dense import write_faiss_index  # loads torch, transformers

        out_dir = os.path.dirname(os.path.abspath(os.path.expanduser(args.out)))
        if not os.path.isdir(out_dir):  # before the corpus is read or anything is encoded
            raise ValueError(f"--out {args.out!r}: directory {out_dir} does not exist")
        import_faiss()
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
        try:
            knobs[key] = user_yaml.loads(value)  # "300" -> 300, "0.5" -> 0.5, "abc" -> "abc"
        except ValueError as e:
            raise ValueError(f"knob {key}=...: {e}") from None
    sock = bind(args.host, args.port)  # the port is checked (and held) before anything is loaded or announced
    try:
        env, what = _retriever(args, knobs)
    except BaseException:
        sock.close()
        raise
    token = configured_token(args.token)
    port = sock.getsockname()[1]
    if not is_loopback(args.host):
        print(f"emapg retriever: warning: {_remote_warning(args.host, port, token)}", file=sys.stderr, flush=True)
    url_host = f"[{args.host}]" if ":" in args.host else args.host
    need = " (requests need the token)" if token else ""
    print(f"serving {what} ({len(env.docs)} passages) on http://{url_host}:{port}{need}", flush=True)
    limits = Limits(max_body_bytes=args.max_body_bytes, max_queries=args.max_queries, max_topk=args.max_topk)
    serve(env, sock, limits=limits, token=token)


def _retriever(args: argparse.Namespace, knobs: dict):
    """(the retriever `serve` serves, what it serves in words)."""
    if args.retriever == "e5":
        from experiments.ops.retrieval.dense import DenseRetriever  # loads torch, transformers

        env = DenseRetriever(load_corpus(args.corpus), index_path=args.index, **_dense_kwargs(args))
        return env, f"{args.corpus} with e5 ({env.backend} search)"
    if args.corpus:
        return BM25Retriever(load_corpus(args.corpus)), args.corpus
    from experiments.tasks import get_task  # tasks import retrievers, never the reverse

    env = get_task(args.task).make_env(**knobs)
    if env is None or not hasattr(env, "docs"):
        raise ValueError(f"task {args.task!r} has no local corpus to serve; use --task search_tiny or --corpus FILE")
    return env, args.task


def _remote_warning(host: str, port: int, token: str | None) -> str:
    reach = f"--host {host}: the retriever on port {port} is reachable from other machines"
    if token:
        return f"{reach}; every request must carry the token"
    return f"{reach} and anyone reaching it can query it; set {TOKEN_ENV} (server and clients) to require a token"


if __name__ == "__main__":
    main()
