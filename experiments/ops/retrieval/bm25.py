"""BM25 retrieval (`bm25s`): the default retriever, in process or behind `emapg retriever serve` (in memory:
wiki-18 takes tens of GB)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from experiments.ops.retrieval import Retriever, check_k


class BM25Retriever(Retriever):
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

    def batch_search(self, queries: Sequence[str], k: int = 3) -> list[list[str]]:
        """Top-`k` passages for each query (fewer when fewer documents share a term with it)."""
        check_k(k)
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
