"""Retriever: BM25 finds the facts; the HTTP server (loopback only) answers like the in-process one."""

import httpx
import pytest

from experiments.ops.retrieval.bm25 import BM25Retriever
from experiments.ops.retrieval.cli import main
from experiments.ops.retrieval.service import HTTPRetriever, running_server
from experiments.tasks import search_tiny as S

DOCS = [
    "Bara Kovin was born in Tesmo.",
    "Bara Kovin works as a baker.",
    "Lemi Kovin was born in Arvo.",
    "Tesmo is a city in Valdoria.",
]


def test_bm25_ranks_by_score_and_drops_non_matches():
    r = BM25Retriever(DOCS)
    assert r.search("Where was Bara Kovin born?", k=1) == ["Bara Kovin was born in Tesmo."]
    # equal scores keep document order; "Lemi Kovin" matches only on "kovin"
    assert r.search("Bara Kovin", k=3) == DOCS[:3]
    assert r.search("Tesmo", k=3) == ["Tesmo is a city in Valdoria.", "Bara Kovin was born in Tesmo."]
    assert r.search("zzz qqq") == [] and r.search("") == [] and r.search("the a of") == []
    assert r.batch_search(["Arvo", "Valdoria"], k=2) == [["Lemi Kovin was born in Arvo."], [DOCS[3]]]
    with pytest.raises(ValueError, match="k \\(topk\\) must be an integer >= 1"):
        r.search("Tesmo", k=0)
    with pytest.raises(ValueError, match="docs must be"):
        BM25Retriever([])


def test_bm25_finds_the_fact_for_one_hop_questions():
    env = S.make_env()
    one_hop = [e for e in S.load("test", 100, seed=0) if len(e.meta["hops"]) == 1]
    assert len(one_hop) >= 40
    for ex in one_hop:
        gold = ex.answer[0]
        # the question text itself retrieves a passage holding the answer within the top 3
        assert any(gold in p for p in env.search(ex.prompt, k=3)), ex.prompt
        # and so does the entity query the demonstrations use
        assert any(gold in p for p in env.search(ex.meta["hops"][0], k=S.TOPK))


def test_http_server_on_loopback_matches_in_process():
    env = S.make_env()
    queries = [e.meta["hops"][0] for e in S.load("test", 20, seed=0)] + ["no such entity", ""]
    with running_server(env, host="127.0.0.1", port=0) as url:
        assert url.startswith("http://127.0.0.1:")
        client = HTTPRetriever(url)
        try:
            assert client.health() == {"status": "ok", "num_docs": len(env.docs)}
            assert client.batch_search(queries, k=3) == env.batch_search(queries, k=3)
            assert client.search(queries[0], k=2) == env.search(queries[0], k=2)
            bad = httpx.post(f"{url}/retrieve", json={"queries": ["x"], "topk": 0})
            assert bad.status_code == 422
            # the task's tool protocol works through the client too
            resp = f"<search>{queries[0]}</search>"
            assert S.tool_response(resp, client) == S.tool_response(resp, env)
        finally:
            client.close()


def test_cli_rejects_tasks_without_a_retriever():
    with pytest.raises(ValueError, match="has no local corpus to serve"):
        main(["serve", "--task", "math_tiny", "--port", "0"])
    with pytest.raises(ValueError, match="has no local corpus to serve"):  # the real task's env is a client
        main(["serve", "--task", "search", "--port", "0"])


def test_cli_serves_bm25_over_a_corpus_file(tmp_path, monkeypatch):
    import json

    from experiments.ops.retrieval import cli, load_corpus

    wiki = tmp_path / "wiki-18.jsonl"  # Search-R1 / FlashRAG corpus format
    wiki.write_text(
        "".join(
            json.dumps({"id": str(i), "contents": c}) + "\n"
            for i, c in enumerate(
                ['"Eiffel Tower"\nThe Eiffel Tower is in Paris.', '"Big Ben"\nBig Ben is a bell in London.']
            )
        )
        + "\n"
    )
    served = []
    monkeypatch.setattr(cli, "serve", lambda env, sock, **kw: served.append((env, sock.getsockname()[0])))
    main(["serve", "--corpus", str(wiki), "--port", "0"])
    ((env, host),) = served
    assert host == "127.0.0.1" and len(env.docs) == 2
    assert env.search("where is the eiffel tower", k=1) == ['"Eiffel Tower"\nThe Eiffel Tower is in Paris.']
    lines = tmp_path / "passages.txt"
    lines.write_text("alpha beta\n\ngamma delta\n")
    assert load_corpus(str(lines)) == ["alpha beta", "gamma delta"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"contents": "ok"}\n{"text": "no contents"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: expected a JSON object with a 'contents' field"):
        main(["serve", "--corpus", str(bad), "--port", "0"])
    with pytest.raises(ValueError, match="no such file"):
        main(["serve", "--corpus", str(tmp_path / "missing.jsonl")])
    with pytest.raises(SystemExit):  # knobs belong to --task
        main(["serve", "--corpus", str(wiki), "n_people=3"])


# ---------------------------------------------------------------- limits, token, bind address, port


def test_limits_answer_413_and_422_with_a_message():
    from experiments.ops.retrieval.service import Limits

    limits = Limits(max_body_bytes=2000, max_queries=5, max_topk=10)
    with running_server(BM25Retriever(DOCS), port=0, limits=limits) as url:
        ok = httpx.post(f"{url}/retrieve", json={"queries": ["Tesmo"] * 5, "topk": 10})
        assert ok.status_code == 200 and len(ok.json()["result"]) == 5
        many = httpx.post(f"{url}/retrieve", json={"queries": ["Tesmo"] * 6, "topk": 3})
        assert many.status_code == 422 and "6 queries" in many.text and "--max-queries" in many.text, many.text
        for k in (0, 11):
            bad_k = httpx.post(f"{url}/retrieve", json={"queries": ["Tesmo"], "topk": k})
            assert bad_k.status_code == 422 and f"topk={k}" in bad_k.text and "1..10" in bad_k.text, bad_k.text
        big = httpx.post(f"{url}/retrieve", json={"queries": ["x" * 5000], "topk": 3})
        assert big.status_code == 413 and "2000 bytes" in big.text and "--max-body-bytes" in big.text, big.text
        assert httpx.get(f"{url}/health").status_code == 200  # the server is still up


def test_a_streamed_body_is_read_no_further_than_the_limit():
    """Without Content-Length (chunked), reading stops at the first chunk past the limit: 413, the rest unread."""
    import asyncio

    from experiments.ops.retrieval.service import Limits, guarded

    reached = []

    async def app(scope, receive, send):  # never reached
        reached.append(scope)

    read, sent = [], []

    async def receive():  # an endless body of 1000-byte chunks
        read.append(1)
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/retrieve", "headers": []}
    asyncio.run(guarded(app, Limits(max_body_bytes=5000), None)(scope, receive, send))
    assert not reached and len(read) == 6
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413


def test_a_token_is_checked_on_every_request_and_the_client_sends_it(monkeypatch):
    from experiments.ops.retrieval.service import TOKEN_ENV

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with running_server(BM25Retriever(DOCS), port=0, token="s3cret-token") as url:
        for response in (
            httpx.get(f"{url}/health"),
            httpx.post(f"{url}/retrieve", json={"queries": ["Tesmo"], "topk": 1}),
            httpx.get(f"{url}/health", headers={"Authorization": "Bearer wrong"}),
        ):
            assert response.status_code == 401 and TOKEN_ENV in response.text, response.text
            assert "s3cret-token" not in response.text
        with pytest.raises(ValueError, match="needs a token"):
            HTTPRetriever(url).health()
        monkeypatch.setenv(TOKEN_ENV, "s3cret-token")  # the search task's client (local and verl) reads it
        from experiments.tasks import search

        client = search.make_env(retriever_url=url)
        assert client.health()["status"] == "ok"
        assert client.search("Tesmo", k=1) == ["Tesmo is a city in Valdoria."]


def _serve_calls(monkeypatch):
    from experiments.ops.retrieval import cli

    served = []
    monkeypatch.setattr(cli, "serve", lambda env, sock, **kw: served.append((sock.getsockname(), kw)))
    return served


def test_cli_refuses_a_remote_bind_address_without_allow_remote(monkeypatch, capsys):
    from experiments.cli import main as emapg

    served = _serve_calls(monkeypatch)
    assert emapg(["retriever", "serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--host 0.0.0.0" in err and "--allow-remote" in err, err
    assert not served


def test_cli_warns_on_a_remote_bind_address_and_passes_limits_and_token(monkeypatch, capsys):
    import socket

    from experiments.ops.retrieval import cli
    from experiments.ops.retrieval.service import TOKEN_ENV

    served = _serve_calls(monkeypatch)
    bound = []

    def fake_bind(host, port):  # nothing listens beyond loopback in the tests
        bound.append(host)
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        return s

    monkeypatch.setattr(cli, "bind", fake_bind)
    monkeypatch.setenv(TOKEN_ENV, "from-the-env")
    argv = ["serve", "--host", "0.0.0.0", "--allow-remote", "--port", "0", "--max-queries", "7", "--max-topk", "9"]
    main(argv + ["--max-body-bytes", "12345"])
    out, err = capsys.readouterr()
    assert bound == ["0.0.0.0"] and "warning" in err and "0.0.0.0" in err and "other machines" in err, err
    assert "from-the-env" not in out + err
    ((_, kw),) = served
    assert kw["token"] == "from-the-env"
    assert (kw["limits"].max_queries, kw["limits"].max_topk, kw["limits"].max_body_bytes) == (7, 9, 12345)
    main(["serve", "--port", "0", "--token", "from-the-flag"])  # the flag wins; loopback: no warning
    out, err = capsys.readouterr()
    assert served[-1][1]["token"] == "from-the-flag" and "warning" not in err and "from-the-flag" not in out + err


def test_cli_names_a_port_in_use_before_serving(capsys):
    import socket

    from experiments.cli import main as emapg

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            raise SystemExit(emapg(["retriever", "serve", "--host", "127.0.0.1", "--port", str(port)]))
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and "serving" not in out, out + err
    assert err.count("\n") == 1 and f"--port {port}" in err and "in use" in err, err


def test_a_refused_token_is_one_line_saying_so_not_an_answer(monkeypatch):
    """A client whose token the server refuses (401), or that has none, gets one line naming the token and where it
    comes from (exit 2 in a CLI), from every call; `check_answers`, the start-up check of a run's retriever, too."""
    from experiments.ops.retrieval.service import TOKEN_ENV, check_answers

    with running_server(BM25Retriever(DOCS), port=0, token="right-token") as url:
        monkeypatch.setenv(TOKEN_ENV, "wrong-token")
        for call in (HTTPRetriever(url).health, lambda: HTTPRetriever(url).search("Tesmo"), lambda: check_answers(url)):
            with pytest.raises(ValueError) as refused:
                call()
            line = str(refused.value)
            assert "\n" not in line and f"{url} refused this client's token (HTTP 401)" in line, line
            assert line.endswith(
                f"set ${TOKEN_ENV} to the token the server was started with (its --token or ${TOKEN_ENV})"
            )
            assert "wrong-token" not in line and "right-token" not in line, line
        monkeypatch.delenv(TOKEN_ENV)
        with pytest.raises(ValueError, match=rf"{url} needs a token \(HTTP 401\): set \${TOKEN_ENV}"):
            check_answers(url)
        monkeypatch.setenv(TOKEN_ENV, "right-token")
        check_answers(url)


def test_check_answers_takes_any_other_answer_and_raises_httpx_errors_when_nothing_answers():
    """Search-R1-compatible servers may have no /health: a 404 is an answer. A closed port: httpx's ConnectError."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from experiments.ops.retrieval.service import check_answers

    class NoHealth(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), NoHealth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        check_answers(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(httpx.ConnectError):
            check_answers(f"http://127.0.0.1:{closed}", timeout=2.0)


def test_idle_connections_are_closed_and_health_still_answers():
    """Connections that send nothing, part of a request head, or nothing after a response are closed after the idle
    timeout (uvicorn alone times out only the last kind: the others were held for ever, until the process ran out of
    descriptors and /health stopped answering). A request the server is still answering is not cut."""
    import select
    import socket
    import threading
    import time

    from experiments.ops.retrieval.service import Limits

    class Slow(BM25Retriever):
        def batch_search(self, queries, k=3):
            time.sleep(1.0)  # twice the idle timeout
            return super().batch_search(queries, k)

    with running_server(Slow(DOCS), port=0, limits=Limits(idle_timeout=0.5)) as url:
        port = int(url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        idle[0].sendall(b"GET /hea")  # part of a request head
        idle[1].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # a whole request, then nothing (keep-alive)
        slow = threading.Thread(target=lambda: answers.append(HTTPRetriever(url).search("Tesmo", k=1)))
        answers: list = []
        slow.start()
        deadline, open_ = time.monotonic() + 30, set(idle)  # a hang guard, not a timing
        while open_ and time.monotonic() < deadline:
            for s in select.select(list(open_), [], [], 1.0)[0]:
                if s.recv(4096) == b"":  # closed by the server (idle[1] reads its response first)
                    open_.discard(s)
        for s in idle:
            s.close()
        assert not open_, f"{len(open_)} of {len(idle)} idle connections still open"
        slow.join(timeout=30)
        assert answers == [["Tesmo is a city in Valdoria."]]
        assert HTTPRetriever(url).health()["status"] == "ok"
