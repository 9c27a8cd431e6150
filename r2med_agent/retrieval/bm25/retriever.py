"""The BM25 retriever over a task's corpus, with an on-disk index reused across runs.

Two modes share one analyzer (:class:`~r2med_agent.retrieval.bm25.analysis.LuceneEnglishAnalyzer`,
a match of pyserini's default Lucene English analyzer): ``lucene`` (retriever name ``bm25``),
Lucene 9's ``BM25Similarity`` to the bit (:mod:`~r2med_agent.retrieval.bm25.lucene`), and
``r2med-compat`` (retriever name ``bm25-compat``), R2MED's reference gensim scoring
(:mod:`~r2med_agent.retrieval.bm25.compat`). Each builds its index once and saves it
(:mod:`~r2med_agent.retrieval.bm25.index`).

Search takes all queries of a call at once. Only documents with a positive score are returned
(sharing no term with the query is not a match), so a query may get fewer than ``k`` documents,
or none; except in ``r2med-compat`` mode, which, as R2MED's script, fills the ranking up to ``k``
with score-0 documents in corpus order.

In ``r2med-compat`` mode ties are settled as trec_eval settles them: equal scores rank by
document id, the larger id (string order) first, both inside the returned ranking and at the ``k``
cut (``lucene`` mode follows Anserini instead, smaller id first, so it keeps what pyserini
keeps). The kept documents are therefore exactly the first ``k`` of the full ranking in trec_eval's order
(:func:`r2med_agent.evaluation.trec_sorted`), so a search to depth ``k`` equals a full search cut
to ``k`` by the evaluation, and the first ``j`` results (LameR's first pass, an agent's top 3) are
the ones trec_eval would rank first. (R2MED's reference sorts with Python's stable ``sorted`` and
keeps boundary ties in corpus order; its kept set can then differ from the top ``k`` that
trec_eval ranks, which only matters for exactly equal scores, such as duplicate documents.)
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from r2med_agent import paths
from r2med_agent.errors import ConfigError, DataError
from r2med_agent.retrieval.bm25.analysis import LuceneEnglishAnalyzer
from r2med_agent.retrieval.bm25.compat import _CompatIndex
from r2med_agent.retrieval.bm25.index import OpenedIndex, index_key, load_saved, save_index
from r2med_agent.retrieval.bm25.lucene import _LuceneIndex
from r2med_agent.retrieval.bm25.ranking import _doc_id_ranks
from r2med_agent.retrieval.query import bm25_query_text
from r2med_agent.types import Run, SearchRequest, Task

__all__ = ["DEFAULT_B", "DEFAULT_K1", "MODES", "BM25Options", "BM25Retriever"]

logger = logging.getLogger(__name__)

MODES = {"lucene": "bm25", "r2med-compat": "bm25-compat"}
"""BM25 mode -> retriever name."""

DEFAULT_K1 = 0.9
"""R2MED's BM25 term-frequency saturation."""
DEFAULT_B = 0.4
"""R2MED's BM25 length normalisation."""


@dataclass(frozen=True)
class BM25Options:
    """The BM25 settings of a run (``make_retriever(options=...)``); each field as the keyword of
    :meth:`BM25Retriever.for_task` of the same name."""

    k1: float = DEFAULT_K1
    b: float = DEFAULT_B
    index_root: str | os.PathLike[str] | None = None
    show_progress: bool = True
    n_threads: int = 0


_BACKENDS: dict[str, type] = {"lucene": _LuceneIndex, "r2med-compat": _CompatIndex}
"""BM25 mode -> its scoring's index class."""


class BM25Retriever:
    """BM25 over one task's corpus (see the module doc for the two modes).

    Build with :meth:`for_task`; :meth:`search` takes all queries of a task at once.

    Attributes:
        name: ``bm25`` (lucene mode) or ``bm25-compat`` (r2med-compat mode).
        mode: ``lucene`` or ``r2med-compat``.
        k1, b: BM25 parameters.
        index_dir: the folder of the saved index.
        built_index: True when this instance built the index, False when it loaded a saved one.
    """

    def __init__(
        self,
        *,
        mode: str,
        k1: float,
        b: float,
        opened: OpenedIndex,
        analyzer: LuceneEnglishAnalyzer,
        show_progress: bool = True,
        n_threads: int = 0,
    ) -> None:
        self.mode = mode
        self.name = MODES[mode]
        self.k1, self.b = k1, b
        self.index_dir = opened.folder
        self.built_index = opened.built
        self.show_progress = show_progress
        self.n_threads = n_threads
        self._doc_ids = list(opened.doc_ids)
        rank = _doc_id_ranks(self._doc_ids)
        # the larger tie_rank comes first among equal scores: lucene mode breaks ties as Anserini
        # does (document id ascending), r2med-compat as R2MED's BM25 script does (a stable sort
        # by score over the corpus: the earlier document first, and kept at the depth cut)
        self._tie_rank = len(rank) - 1 - rank if mode == "lucene" else np.arange(len(rank))[::-1].copy()
        self._index = opened.index
        self._analyzer = analyzer

    @property
    def num_docs(self) -> int:
        return len(self._doc_ids)

    @classmethod
    def for_task(
        cls,
        task: Task,
        mode: str = "lucene",
        k1: float = DEFAULT_K1,
        b: float = DEFAULT_B,
        index_root: str | os.PathLike[str] | None = None,
        show_progress: bool = True,
        n_threads: int = 0,
    ) -> BM25Retriever:
        """The retriever over ``task.corpus``, loading its saved index or building and saving it.

        A document's title, when it has one, is indexed before its text (R2MED's corpora have
        none).

        Args:
            task: the loaded task; ``task.fingerprint`` keys the index.
            mode: ``lucene`` (Lucene's BM25) or ``r2med-compat`` (R2MED's gensim scoring).
            k1: BM25 term-frequency saturation (R2MED: 0.9).
            b: BM25 length normalisation, 0..1 (R2MED: 0.4).
            index_root: folder holding saved indexes; default ``paths.cache_dir()/"bm25"``.
            show_progress: progress bars while indexing and searching.
            n_threads: threads for the per-query part of a search (0: the calling thread, -1: all
                cores); the shared part is one BLAS product, which uses BLAS's own threads.
        """
        if mode not in MODES:
            raise ConfigError(f"unknown BM25 mode '{mode}'; allowed: {', '.join(MODES)}")
        k1, b = _check_params(k1, b)
        if not task.corpus:
            raise DataError(f"task {task.name} has an empty corpus; nothing to index", task.source)
        analyzer = LuceneEnglishAnalyzer()
        root = Path(index_root) if index_root is not None else paths.cache_dir() / "bm25"
        key = index_key(task, mode, k1, b, analyzer.id)
        folder = root / key
        doc_ids = task.doc_ids  # (a corpus not read yet stays so when the index is saved)
        backend: Any = _BACKENDS[mode]

        index = load_saved(folder, backend, key, doc_ids, show_progress)
        built = index is None
        if index is None:
            t0 = time.perf_counter()
            texts = [d.full_text for d in task.corpus]
            docs, vocab = analyzer.fit(texts, show_progress=show_progress)
            if not vocab:
                raise DataError(
                    f"task {task.name}: no document has an indexable term (all empty or stopwords)",
                    task.source,
                )
            index = backend.build(docs, vocab, k1, b, show_progress)
            save_index(folder, index, key, doc_ids, show_progress)
            logger.info(
                "indexed %d docs (%d terms, %s) in %.1fs; saved to %s",
                len(doc_ids), len(vocab), mode, time.perf_counter() - t0, folder,
            )
        return cls(
            mode=mode, k1=k1, b=b, opened=OpenedIndex(index, doc_ids, folder, built), analyzer=analyzer,
            show_progress=show_progress, n_threads=n_threads,
        )

    def search(self, requests: Sequence[SearchRequest], k: int) -> Run:
        """Top-``k`` documents of every request, in one batched search.

        Every requested query id is in the result; its ranking holds only documents that share a
        term with the query (an empty dict when none does), score descending, scores as Python
        floats. Equal scores, and the ``k`` cut through them, follow document id ascending in
        ``lucene`` mode (Anserini's order) and corpus order in ``r2med-compat`` mode (R2MED's
        stable sort; ``r2med-compat`` also fills a short ranking with zero-score documents in
        corpus order, as that script keeps them). The evaluation orders ties by its own rule.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"k must be a positive integer, got {k!r}")
        texts = self._query_texts(requests)
        queries = self._analyzer.transform(texts, self._index.vocab)
        ranked = self._index.top_k(
            queries, min(k, self.num_docs), self._tie_rank, self.show_progress, self.n_threads
        )
        doc_ids = self._doc_ids
        depth = min(k, self.num_docs)
        run: Run = {}
        for request, (docs, scores) in zip(requests, ranked):
            ranking = {doc_ids[d]: s for d, s in zip(docs.tolist(), scores.tolist()) if s > 0}
            if self.mode == "r2med-compat" and len(ranking) < depth:
                ranking = self._fill_with_zeros(ranking, depth)
            run[request.query_id] = ranking
        return run

    def _fill_with_zeros(self, ranking: dict[str, float], depth: int) -> dict[str, float]:
        """``ranking`` followed by score-0 documents in corpus order up to ``depth`` documents.

        R2MED's BM25 script scores every document and keeps the first ``depth`` of a stable sort
        by score, so a query matching fewer documents gets the non-matching ones of the start of
        the corpus, with score 0, in its run file (and they count in its scores)."""
        out = dict(ranking)
        for doc_id in self._doc_ids:
            if len(out) >= depth:
                break
            if doc_id not in out:
                out[doc_id] = 0.0
        return out

    def _query_texts(self, requests: Sequence[SearchRequest]) -> list[str]:
        seen: set[str] = set()
        blank: dict[str, int] = {}
        texts = []
        for r in requests:
            if r.query_id in seen:
                raise ValueError(f"query id {r.query_id!r} appears twice in one search")
            seen.add(r.query_id)
            if r.combine != "none" and not r.expansion.strip() and not r.keep_empty:
                blank[r.combine] = blank.get(r.combine, 0) + 1
            texts.append(bm25_query_text(r, compat=self.mode == "r2med-compat"))
        if blank:
            logger.warning(
                "%s: %s with an empty expansion; searching with the query alone",
                self.name, ", ".join(f"{n} '{rule}' request(s)" for rule, n in blank.items()),
            )
        return texts


def _check_params(k1: float, b: float) -> tuple[float, float]:
    try:
        k1, b = float(k1), float(b)
    except (TypeError, ValueError):
        raise ConfigError(f"BM25 k1 and b must be numbers, got k1={k1!r}, b={b!r}") from None
    if not (np.isfinite(k1) and k1 >= 0):
        raise ConfigError(f"BM25 k1 must be a finite number >= 0, got {k1}")
    if not 0.0 <= b <= 1.0:
        raise ConfigError(f"BM25 b must be between 0 and 1, got {b}")
    return k1, b
