"""Dense retrieval as in Search-R1: an e5 encoder and an exact inner-product search over the corpus.

e5 conventions (model card of intfloat/e5-base-v2, as Search-R1 / FlashRAG): inputs prefixed "query: " /
"passage: ", truncated to 256 tokens, mean-pooled over the attention mask and L2-normalised (inner product = cosine).
Search is exact: a FAISS `IndexFlatIP` when faiss is installed, else a torch matmul + topk. A prebuilt index
(Search-R1's `e5_Flat.index`: encoding wiki-18's 21M passages takes GPU hours) must hold the corpus passages in
file order. Memory: num_docs x D float32 (wiki-18: 21M x 768, about 65 GB).

Ranking: best score first, equal scores in document order on both backends; among documents tied at the k-th
place torch picks the earliest, FAISS by its own rule. The two compute the same float32 products with different
kernels, so scores that differ only by rounding (~1e-7) may order differently.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel, AutoTokenizer

from experiments.ops.retrieval import Retriever, check_file, check_k, import_faiss
from experiments.progress import bar as progress_bar

DEFAULT_MODEL = "intfloat/e5-base-v2"
QUERY_PREFIX, PASSAGE_PREFIX = "query: ", "passage: "
BACKENDS = ("auto", "faiss", "torch")


# ---------------------------------------------------------------- pure functions
def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of the token states where `mask` is 1: (B, T, D), (B, T) -> (B, D). Padding never counts."""
    assert hidden.dim() == 3 and mask.shape == hidden.shape[:2], (hidden.shape, mask.shape)
    mask = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)  # (B, D)


def topk_in_doc_order(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best `k` of each row of `scores` (Q, N) -> scores (Q, k), doc ids (Q, k), ties in document order.

    `torch.topk` does not specify which of several equal values it returns, so it only supplies the
    k-th best score; every document scoring at least that is a candidate (ids ascending), and a stable
    sort of the candidates keeps document order among equal scores.
    """
    assert scores.dim() == 2 and 1 <= k <= scores.shape[1], (scores.shape, k)
    kth = scores.topk(k, dim=1).values[:, -1]  # (Q,)
    top_scores, top_ids = [], []
    for row, threshold in zip(scores, kth):  # Q is a request's batch: small
        candidates = (row >= threshold).nonzero().squeeze(1)  # (C,) ascending, C >= k
        order = row[candidates].sort(descending=True, stable=True).indices[:k]  # (k,)
        top_scores.append(row[candidates[order]])
        top_ids.append(candidates[order])
    return torch.stack(top_scores), torch.stack(top_ids)


def exact_search(
    docs: torch.Tensor, queries: torch.Tensor, k: int, max_scores: int = 2**26
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inner-product top-`k` of `queries` (Q, D) over `docs` (N, D) -> scores (Q, k), ids (Q, k).

    Queries go in chunks so the (chunk, N) score matrix holds at most `max_scores` floats (256 MB).
    """
    assert docs.dim() == 2 and queries.dim() == 2 and docs.shape[1] == queries.shape[1], (docs.shape, queries.shape)
    chunk = max(1, max_scores // docs.shape[0])
    parts = [topk_in_doc_order(q @ docs.T, k) for q in queries.split(chunk)]  # each (chunk, N) scores
    return torch.cat([s for s, _ in parts]), torch.cat([i for _, i in parts])


def sort_ties_by_id(scores: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder each row of a top-k result (Q, k) by score descending, equal scores by ascending id."""
    by_id = ids.argsort(dim=1)  # (Q, k); ids within a row are distinct
    scores, ids = scores.gather(1, by_id), ids.gather(1, by_id)
    by_score = scores.sort(dim=1, descending=True, stable=True).indices  # (Q, k)
    return scores.gather(1, by_score), ids.gather(1, by_score)


def faiss_search(index, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`k` of `queries` (Q, D) in a FAISS inner-product index -> scores (Q, k), ids (Q, k)."""
    scores, ids = index.search(queries.float().contiguous().numpy(), k)  # numpy (Q, k), (Q, k)
    return sort_ties_by_id(torch.from_numpy(scores), torch.from_numpy(ids))


# ---------------------------------------------------------------- encoder and index
@contextlib.contextmanager
def _loading(model: str) -> Iterator[None]:
    """An OSError from transformers (no network and not in the HF cache, or not a model directory) as
    one ValueError naming --model."""
    try:
        yield
    except OSError as e:
        raise ValueError(
            f"--model {model!r}: cannot load the encoder ({str(e).splitlines()[0]}); pass a local "
            "directory with the model and tokenizer, or run once with network access"
        ) from e


class E5Encoder:
    """Texts -> L2-normalised mean-pooled embeddings (N, D) float32, with an e5 model from the hub or a local dir."""

    def __init__(
        self, model: str = DEFAULT_MODEL, max_length: int = 256, batch_size: int = 64, device: str | None = None
    ):
        self.max_length, self.batch_size = max_length, batch_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        with _loading(model):
            self.tokenizer = AutoTokenizer.from_pretrained(model)
            self.model = AutoModel.from_pretrained(model, dtype=torch.float32).to(self.device).eval()
        self.dim = self.model.config.hidden_size

    @torch.inference_mode()
    def batches(self, texts: Sequence[str], prefix: str, progress: bool = False) -> Iterator[torch.Tensor]:
        """(B, D) embeddings of `prefix + text` on the CPU, `batch_size` texts at a time (a bar if `progress`)."""
        show = progress and len(texts) > self.batch_size
        with progress_bar(len(texts), "encoding", unit="passage", show=show) as bar:
            for start in range(0, len(texts), self.batch_size):
                chunk = [prefix + t for t in texts[start : start + self.batch_size]]
                batch = self.tokenizer(
                    chunk, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
                ).to(self.device)
                hidden = self.model(**batch).last_hidden_state  # (B, T, D)
                yield F.normalize(mean_pool(hidden, batch["attention_mask"]), dim=-1).float().cpu()  # (B, D)
                bar.update(len(chunk))

    def encode(self, texts: Sequence[str], prefix: str, progress: bool = False) -> torch.Tensor:
        """All of `texts` -> (N, D)."""
        return torch.cat(list(self.batches(texts, prefix, progress)))


def build_faiss_index(encoder: E5Encoder, docs: Sequence[str]):
    """A FAISS `IndexFlatIP` of the passage embeddings, filled batch by batch (no second full copy)."""
    faiss = import_faiss()
    index = faiss.IndexFlatIP(encoder.dim)
    for batch in encoder.batches(docs, PASSAGE_PREFIX, progress=True):
        index.add(batch.numpy())  # (B, D) float32
    return index


def write_faiss_index(docs: Sequence[str], out: str, **encoder_kwargs) -> None:
    """Encode `docs` (E5Encoder(**encoder_kwargs)) and write their IndexFlatIP to `out` (`emapg retriever index`)."""
    faiss = import_faiss()
    faiss.write_index(build_faiss_index(E5Encoder(**encoder_kwargs), docs), os.path.expanduser(out))


def read_faiss_index(path: str, num_docs: int, dim: int, model: str):
    """The FAISS index at `path`, checked against the corpus size and the encoder's dimension."""
    faiss = import_faiss()
    index = faiss.read_index(check_file("--index", path))
    if index.ntotal != num_docs:
        raise ValueError(
            f"--index {path!r} holds {index.ntotal} vectors but the corpus has {num_docs} passages; "
            "build it from this corpus with `emapg retriever index --corpus FILE --out FILE.index`"
        )
    if index.d != dim:
        raise ValueError(f"--index {path!r} holds {index.d}-dim vectors but --model {model} encodes {dim}-dim ones")
    if index.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise ValueError(f"--index {path!r} does not use inner-product scores; e5 needs one (e.g. IndexFlatIP)")
    return index


# ---------------------------------------------------------------- the retriever
class DenseRetriever(Retriever):
    """e5 dense retrieval over `docs` (the `Retriever` protocol): top-k passages by cosine similarity.

    backend: "faiss" (IndexFlatIP), "torch" (exact matmul + topk) or "auto" (faiss when installed).
    `index_path`: a prebuilt FAISS index of exactly these `docs`, in order (needs faiss), instead of
    encoding them. Unlike BM25 every query gets min(k, len(docs)) passages, even an empty one.
    """

    def __init__(
        self,
        docs: Sequence[str],
        model: str = DEFAULT_MODEL,
        index_path: str | None = None,
        *,
        backend: str = "auto",
        max_length: int = 256,
        batch_size: int = 64,
        device: str | None = None,
    ):
        if not docs:
            raise ValueError("docs must be a non-empty sequence of passages")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
        if index_path is not None and backend == "torch":
            raise ValueError("index_path is a FAISS index: it needs backend 'faiss' or 'auto'")
        self.docs = list(docs)
        auto_faiss = backend == "auto" and importlib.util.find_spec("faiss") is not None
        use_faiss = index_path is not None or backend == "faiss" or auto_faiss
        self.backend = "faiss" if use_faiss else "torch"
        index = None
        if index_path is not None:  # checked before the model's weights are loaded
            with _loading(model):
                dim = AutoConfig.from_pretrained(model).hidden_size
            index = read_faiss_index(index_path, len(self.docs), dim, model)
        self.encoder = E5Encoder(model, max_length=max_length, batch_size=batch_size, device=device)
        if use_faiss:
            index = index if index is not None else build_faiss_index(self.encoder, self.docs)
            self._search: Callable = partial(faiss_search, index)
        else:
            self._search = partial(exact_search, self.encoder.encode(self.docs, PASSAGE_PREFIX, progress=True))
        self._lock = threading.Lock()  # the server calls from threads; fast tokenizers are not re-entrant

    def scored_search(self, queries: Sequence[str], k: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores (Q, k') and doc ids (Q, k') of the best k' = min(k, len(docs)) passages per query."""
        check_k(k)
        if not queries:
            return torch.empty(0, 0), torch.empty(0, 0, dtype=torch.long)
        with self._lock:
            q = self.encoder.encode(queries, QUERY_PREFIX)  # (Q, D)
            return self._search(q, min(k, len(self.docs)))

    def batch_search(self, queries: Sequence[str], k: int = 3) -> list[list[str]]:
        """Top-`k` passages for each query: len(result) == len(queries)."""
        _, ids = self.scored_search(queries, k)
        return [[self.docs[i] for i in row] for row in ids.tolist()]
