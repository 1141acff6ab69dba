"""e5 dense retriever on a tiny random BERT built offline: exact ranking against a naive reference,
padding-invariant batching, FAISS == torch, `emapg retriever index` + `serve --index`, CLI errors.

The FAISS checks use `pytest.importorskip("faiss")` (the dev extra installs it); each has a torch or
error-path counterpart that always runs.
"""

import json
import re
import sys

import httpx
import pytest
import torch

from experiments.ops.retrieval import cli
from experiments.ops.retrieval import dense as D
from experiments.ops.retrieval.cli import main
from experiments.ops.retrieval.dense import DenseRetriever
from experiments.ops.retrieval.service import running_server

DOCS = [
    "Bara Kovin was born in Tesmo.",
    "Bara Kovin works as a baker in the old town of Tesmo near the river.",
    "Lemi Kovin was born in Arvo.",
    "Tesmo is a city in Valdoria.",
    "Arvo is a small village in the north of Valdoria, famous for its bread and its bakers.",
    "The river Sel flows through Tesmo and Arvo.",
    "Valdoria is a country.",
    "Lemi Kovin is a teacher.",
    "The old town has a famous bakery.",
    "Bread from Arvo is sold in Tesmo.",
]
QUERIES = ["where was bara kovin born", "what is tesmo", "who is a teacher", "bread", "river in valdoria"]


@pytest.fixture(scope="module", autouse=True)
def offline():
    """Nothing here may touch the network: the model and tokenizer are local directories."""
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


def _words(texts):
    return re.findall(r"\w+|[^\w\s]", " ".join(texts).lower())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, the in-memory model, its tokenizer): a 2-layer, 32-dim BERT with a word-level vocab."""
    import transformers

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = sorted(set(_words(DOCS + QUERIES + ["query:", "passage:"])))
    tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(specials + words)})
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(specials) + len(words),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
    )
    model = transformers.BertModel(config).eval()
    path = tmp_path_factory.mktemp("tiny-e5")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), model, tokenizer


def _naive_embedding(model, tokenizer, text):
    """One text alone (no padding): average the last hidden states by hand, divide by the norm."""
    with torch.no_grad():
        hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]  # (T, D)
    v = hidden.sum(dim=0) / hidden.shape[0]
    return v / v.norm()


def _naive_topk(tiny, queries, k):
    _, model, tokenizer = tiny
    docs = [_naive_embedding(model, tokenizer, "passage: " + d) for d in DOCS]
    out = []
    for q in queries:
        qv = _naive_embedding(model, tokenizer, "query: " + q)
        scores = [float(qv @ d) for d in docs]
        order = sorted(range(len(DOCS)), key=lambda i: (-scores[i], i))[:k]
        out.append(([scores[i] for i in order], order))
    return out


def _backend(name):
    if name == "faiss":
        pytest.importorskip("faiss")
    return name


@pytest.mark.parametrize("backend", ["torch", "faiss"])
def test_topk_matches_a_naive_one_text_at_a_time_reference(tiny, backend):
    r = DenseRetriever(DOCS, model=tiny[0], backend=_backend(backend), batch_size=4)
    assert r.backend == backend
    scores, ids = r.scored_search(QUERIES, k=4)  # (Q, 4), (Q, 4)
    expected = _naive_topk(tiny, QUERIES, k=4)
    for q in range(len(QUERIES)):
        exp_scores, exp_ids = expected[q]
        assert ids[q].tolist() == exp_ids
        torch.testing.assert_close(scores[q], torch.tensor(exp_scores), atol=1e-5, rtol=0)
    # the data has no near-ties, so the ranking above is not an accident of rounding
    gaps = [s[i] - s[i + 1] for s, _ in expected for i in range(3)]
    assert min(gaps) > 1e-4
    assert r.batch_search(QUERIES[:2], k=2) == [[DOCS[i] for i in expected[q][1][:2]] for q in range(2)]
    assert r.search(QUERIES[0], k=1) == [DOCS[expected[0][1][0]]]
    assert len(r.search("bread", k=50)) == len(DOCS)  # k is capped at the corpus size
    assert r.batch_search([], k=3) == []
    with pytest.raises(ValueError, match="k \\(topk\\) must be an integer >= 1"):
        r.search("bread", k=0)


def test_batching_and_padding_do_not_change_embeddings(tiny):
    one = D.E5Encoder(tiny[0], batch_size=1).encode(DOCS, D.PASSAGE_PREFIX)  # (N, D), no padding
    four = D.E5Encoder(tiny[0], batch_size=4).encode(DOCS, D.PASSAGE_PREFIX)  # padded to each batch's longest
    assert one.shape == (len(DOCS), 32) and one.dtype == torch.float32
    torch.testing.assert_close(four, one, atol=1e-5, rtol=0)
    torch.testing.assert_close(one.norm(dim=1), torch.ones(len(DOCS)), atol=1e-5, rtol=0)
    # max_length truncates: the long passage then embeds as its first tokens only
    short = D.E5Encoder(tiny[0], max_length=6).encode(DOCS[4:5], D.PASSAGE_PREFIX)
    assert not torch.allclose(short, one[4:5], atol=1e-3)


def test_mean_pool_ignores_padding():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])  # (1, 3, 2), last token is padding
    assert D.mean_pool(hidden, torch.tensor([[1, 1, 0]])).tolist() == [[2.0, 3.0]]  # (1+3)/2, (2+4)/2


def test_exact_search_breaks_ties_by_document_order():
    # docs 1, 2 and 4 are the same vector: equal scores for any query, including at the k-th place
    docs = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.6, 0.8], [1.0, 0.0]])  # (N, D)
    queries = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # (Q, D)
    scores, ids = D.exact_search(docs, queries, k=2)
    assert ids.tolist() == [[1, 2], [0, 3]] and scores.tolist() == [[1.0, 1.0], [1.0, 0.800000011920929]]
    assert D.exact_search(docs, queries, k=4)[1].tolist() == [[1, 2, 4, 3], [0, 3, 1, 2]]
    # chunking the queries (a bounded score matrix) changes nothing
    assert D.exact_search(docs, queries, k=4, max_scores=1)[1].tolist() == [[1, 2, 4, 3], [0, 3, 1, 2]]
    # a FAISS-style result with ties out of id order is put back in document order
    s, i = D.sort_ties_by_id(torch.tensor([[0.9, 0.9, 0.5, 0.5]]), torch.tensor([[7, 3, 9, 2]]))
    assert i.tolist() == [[3, 7, 2, 9]] and s.tolist() == [[0.8999999761581421] * 2 + [0.5] * 2]


def test_faiss_search_equals_exact_search_and_orders_ties():
    faiss = pytest.importorskip("faiss")
    gen = torch.Generator().manual_seed(0)
    # Multiples of 1/1024 in [-1, 1]: every inner product is an integer / 2^20 of magnitude below 2^24 / 2^20,
    # exact in float32 in any summation order, so a doc and its copy score exactly alike whatever BLAS kernel and
    # blocking either search uses (MKL's COMPATIBLE branch, which the tests pin, sums edge rows in another order),
    # and distinct docs almost never tie by accident.
    grid = lambda n: torch.randint(-1000, 1001, (n, 16), generator=gen).float() / 1024  # noqa: E731
    docs = grid(200)  # (N, D)
    docs = torch.cat([docs, docs[:3]])  # docs 200..202 duplicate 0..2: exact ties
    queries = torch.cat([grid(30), docs[:3]])  # (Q, D); 30 >= faiss's BLAS threshold
    index = faiss.IndexFlatIP(16)
    index.add(docs.numpy())
    f_scores, f_ids = D.faiss_search(index, queries, k=5)
    t_scores, t_ids = D.exact_search(docs, queries, k=5)
    assert f_ids.tolist() == t_ids.tolist()
    assert f_scores.tolist() == t_scores.tolist()  # exact arithmetic: equal to the bit
    assert f_ids[-3:, :2].tolist() == [[0, 200], [1, 201], [2, 202]]  # a doc and its copy: document order


def _write_jsonl(path, passages):
    path.write_text("".join(json.dumps({"id": str(i), "contents": c}) + "\n" for i, c in enumerate(passages)))
    return str(path)


def test_cli_index_then_serve_with_index_matches_in_process(tiny, tmp_path, monkeypatch):
    pytest.importorskip("faiss")
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", DOCS)
    out = str(tmp_path / "e5_Flat.index")
    main(["index", "--corpus", corpus, "--out", out, "--model", tiny[0], "--batch-size", "3"])
    served = []
    monkeypatch.setattr(cli, "serve", lambda env, sock, **kw: served.append(env))
    main(["serve", "--corpus", corpus, "--retriever", "e5", "--model", tiny[0], "--index", out, "--port", "0"])
    (env,) = served
    assert env.backend == "faiss"
    in_process = DenseRetriever(DOCS, model=tiny[0], backend="torch")
    assert env.batch_search(QUERIES, k=3) == in_process.batch_search(QUERIES, k=3)
    # an index of another corpus (fewer passages) is refused, naming the flag
    other = _write_jsonl(tmp_path / "other.jsonl", DOCS[:4])
    main(["index", "--corpus", other, "--out", str(tmp_path / "other.index"), "--model", tiny[0]])
    with pytest.raises(ValueError, match=r"--index .*other.index' holds 4 vectors but the corpus has 10 passages"):
        main(
            [
                "serve",
                "--corpus",
                corpus,
                "--retriever",
                "e5",
                "--model",
                tiny[0],
                "--index",
                str(tmp_path / "other.index"),
            ]
        )
    with pytest.raises(ValueError, match="--index .* holds 4 vectors"):  # the Python API says the same
        DenseRetriever(DOCS, model=tiny[0], index_path=str(tmp_path / "other.index"))


def test_index_of_another_dimension_or_metric_is_refused(tiny, tmp_path):
    faiss = pytest.importorskip("faiss")
    for name, index, message in [
        ("dim16.index", faiss.IndexFlatIP(16), "holds 16-dim vectors but --model .* 32-dim"),
        ("l2.index", faiss.IndexFlatL2(32), "does not use inner-product scores"),
    ]:
        index.add(torch.randn(len(DOCS), index.d).numpy())
        faiss.write_index(index, str(tmp_path / name))
        with pytest.raises(ValueError, match=message):
            DenseRetriever(DOCS, model=tiny[0], index_path=str(tmp_path / name))


def test_without_faiss_index_files_name_the_install_command(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # `import faiss` now raises ImportError
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", DOCS)
    (tmp_path / "e5_Flat.index").write_bytes(b"")
    hint = re.escape("pip install faiss-cpu (or the [retrieval] extra")
    with pytest.raises(ImportError, match=hint):
        main(["serve", "--corpus", corpus, "--retriever", "e5", "--index", str(tmp_path / "e5_Flat.index")])
    with pytest.raises(ImportError, match=hint):
        main(["index", "--corpus", corpus, "--out", str(tmp_path / "new.index")])
    with pytest.raises(ImportError, match=hint):
        DenseRetriever(DOCS, model=tiny[0], backend="faiss")
    # the default backend falls back to the exact torch search
    assert DenseRetriever(DOCS, model=tiny[0]).backend == "torch"


def test_cli_serves_e5_over_a_corpus_file_on_loopback(tiny, tmp_path, monkeypatch):
    corpus = _write_jsonl(tmp_path / "wiki-18.jsonl", DOCS)
    answers = []

    def serve_and_ask(env, sock, **kw):  # what `serve` would do, in a background thread, then one request
        host = sock.getsockname()[0]
        sock.close()
        with running_server(env, host=host, port=0, **kw) as url:
            assert url.startswith("http://127.0.0.1:")
            health = httpx.get(f"{url}/health").json()
            body = httpx.post(f"{url}/retrieve", json={"queries": QUERIES, "topk": 3}).json()
        answers.append((env, health, body))

    monkeypatch.setattr(cli, "serve", serve_and_ask)
    main(["serve", "--corpus", corpus, "--retriever", "e5", "--model", tiny[0], "--port", "0"])
    ((env, health, body),) = answers
    assert health == {"status": "ok", "num_docs": len(DOCS)}
    expected = [[DOCS[i] for i in ids] for _, ids in _naive_topk(tiny, QUERIES, k=3)]
    assert body == {"result": expected}


def test_cli_rejects_bad_flags_before_loading_anything(tmp_path, capsys):
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", DOCS)
    missing_model = str(tmp_path / "no-such-model")  # loading it would fail with another error
    cases = [
        (
            ["serve", "--corpus", corpus, "--retriever", "tfidf"],
            "argument --retriever: invalid choice: 'tfidf' (choose from 'bm25', 'e5')",
        ),
        (
            ["serve", "--corpus", corpus, "--index", "x.index"],
            "--index: only for --retriever e5 (--retriever is one of: bm25, e5",
        ),
        (["serve", "--corpus", corpus, "--model", missing_model], "--model: only for --retriever e5"),
        (["serve", "--retriever", "e5", "--model", missing_model], "--retriever e5 needs --corpus FILE"),
        (
            ["serve", "--corpus", corpus, "--retriever", "e5", "--batch-size", "0"],
            "argument --batch-size: must be an integer >= 1",
        ),
        (["serve", "--corpus", corpus, "--retriever", "e5", "n_people=3"], "task knobs do not apply to --corpus"),
        (["index", "--corpus", corpus], "the following arguments are required: --out"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err.replace("from bm25, e5", "from 'bm25', 'e5'"), (
            argv
        )  # older Pythons: unquoted
    with pytest.raises(ValueError, match="--index .*missing.index': no such file"):
        main(
            [
                "serve",
                "--corpus",
                corpus,
                "--retriever",
                "e5",
                "--model",
                missing_model,
                "--index",
                str(tmp_path / "missing.index"),
            ]
        )
    with pytest.raises(ValueError, match="--out .*: directory .* does not exist"):
        main(["index", "--corpus", corpus, "--out", str(tmp_path / "nodir" / "e5.index"), "--model", missing_model])
    with pytest.raises(ValueError, match="unknown backend 'gpu'; valid backends: auto, faiss, torch"):
        DenseRetriever(DOCS, model=missing_model, backend="gpu")
    with pytest.raises(ValueError, match="index_path is a FAISS index: it needs backend 'faiss' or 'auto'"):
        DenseRetriever(DOCS, model=missing_model, index_path="x.index", backend="torch")
    with pytest.raises(ValueError, match=r"--model '.*no-such-model': cannot load the encoder"):  # offline, or a typo
        main(["serve", "--corpus", corpus, "--retriever", "e5", "--model", missing_model])
