"""Retriever: BM25 finds the facts; the HTTP server (loopback only) answers like the in-process one."""

import httpx
import pytest

from experiments.retrieval.bm25 import BM25Retriever
from experiments.retrieval.cli import main
from experiments.retrieval.service import HTTPRetriever, running_server
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

    from experiments.retrieval import cli, load_corpus

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
    monkeypatch.setattr(cli, "serve", lambda env, host, port: served.append((env, host, port)))
    main(["serve", "--corpus", str(wiki), "--port", "0"])
    ((env, host, _),) = served
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
