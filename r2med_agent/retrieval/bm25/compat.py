"""R2MED's reference BM25 scoring (``eval_bench_BM25.py``), the ``bm25-compat`` retriever's.

gensim's ``LuceneBM25Model(k1, b)`` turns the documents **and the query** into BM25 weight
vectors, and the score is their dot product (``SparseMatrixSimilarity``, no normalisation). A
query term is weighted as if the query were a document of the corpus::

    w_q(t) = idf(t) * qtf / (qtf + k1 * (1 - b + b * qlen / avgdl))
    w_d(t) = idf(t) *  tf / ( tf + k1 * (1 - b + b *   dl / avgdl))
    score  = sum over distinct query terms t of w_q(t) * w_d(t)

with gensim's ``idf = ln(N + 1) - ln(df + 0.5)`` (equal to Lucene's) and ``qlen`` the number of
query tokens in the corpus vocabulary. The weights are computed with numpy and saved as arrays
(:class:`_CompatIndex`). A search multiplies each query's term weights with the index's
per-(term, document) weights, the most frequent terms added as dense rows and the rest from their
posting lists (:class:`_ScoreMatrix`).
"""

from __future__ import annotations

import numpy as np

from r2med_agent.retrieval.bm25.analysis import AnalyzedTexts
from r2med_agent.retrieval.bm25.index import SavedArrays
from r2med_agent.retrieval.bm25.ranking import _bag_of_words, _map, _postings, _top_positive

class _ScoreMatrix:
    """Per-(term, document) BM25 weights, term-major, and the search over them.

    ``data[indptr[t]:indptr[t + 1]]`` are the weights of term ``t`` in the documents
    ``indices[indptr[t]:indptr[t + 1]]`` (the layout of bm25s's saved index: a CSC matrix of
    documents x terms). A query is a weighted bag of terms; a document's score is the sum of
    ``query weight * document weight`` over the query's terms (a sparse matrix product).

    Speed: a long query spends most of its time on frequent terms (on a 61k-document corpus the
    275 most frequent terms hold about 85% of the postings an R2MED-length query touches). The
    weights of the most frequent terms (document frequency >= N/50, at most ``DENSE_BUDGET``
    bytes) are also kept as dense rows, built when the index is loaded; a query adds such a term's
    whole row (a contiguous vectorised pass, well under 1 ns per document) instead of scattering
    its postings (10-20 ns each), which makes a search 2-3x faster. Rarer terms are scattered from
    their posting lists.
    """

    DENSE_BUDGET = 64 * 2**20
    DENSE_MIN_DF = 1 / 50

    def __init__(self, data: np.ndarray, indices: np.ndarray, indptr: np.ndarray, num_docs: int):
        # plain ndarray views of memory-mapped files (slicing a np.memmap is slow)
        self.data, self.indices = np.asarray(data), np.asarray(indices)
        self.indptr = np.asarray(indptr)
        self.num_docs = num_docs
        self.dense_row, self.dense = self._dense_rows()

    def _dense_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(row of each term in the dense block or -1, the block: terms x documents)."""
        df = np.diff(self.indptr)
        frequent = np.flatnonzero(df >= max(2.0, self.num_docs * self.DENSE_MIN_DF))
        cap = self.DENSE_BUDGET // (4 * self.num_docs)
        if len(frequent) > cap:
            frequent = np.sort(frequent[np.argsort(-df[frequent], kind="stable")[:cap]])
        row = np.full(len(df), -1, dtype=np.int64)
        row[frequent] = np.arange(len(frequent))
        block = np.zeros((len(frequent), self.num_docs), dtype=np.float32)
        starts, ends = self.indptr[frequent].tolist(), self.indptr[frequent + 1].tolist()
        for i, (lo, hi) in enumerate(zip(starts, ends)):
            block[i, self.indices[lo:hi]] = self.data[lo:hi]
        return row, block

    def search(
        self,
        rows: np.ndarray,
        terms: np.ndarray,
        weights: np.ndarray,
        n_queries: int,
        k: int,
        tie_rank: np.ndarray,
        show_progress: bool,
        n_threads: int,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Top-``k`` positive-score documents of each query, best first (see :func:`_top_positive`).

        Args:
            rows, terms, weights: the queries as (query row, term id, weight) triples, sorted by
                row, one per distinct term of a query.
            n_queries: the number of queries (rows without a triple get no results).
            k: results per query.
            tie_rank: per document, its place among equal scores: the larger comes first and is
                kept at the cut (the retriever gives corpus order, R2MED's stable sort).
            show_progress: a progress bar over the queries.
            n_threads: threads over the queries (0: the calling thread; -1: all cores).
        """
        block = self.dense
        bounds = np.searchsorted(rows, np.arange(n_queries + 1)).tolist()
        term_row = self.dense_row[terms]

        def one(q: int) -> tuple[np.ndarray, np.ndarray]:
            a, z = bounds[q], bounds[q + 1]
            scores = np.zeros(self.num_docs, dtype=np.float32)
            scaled = np.empty_like(scores)  # reused: no page-faulting temporary per row
            r, w = term_row[a:z], weights[a:z]
            dense = r >= 0
            for row, weight in zip(r[dense].tolist(), w[dense].tolist()):
                if weight == 1.0:
                    scores += block[row]
                else:
                    np.multiply(block[row], weight, out=scaled)
                    scores += scaled
            _accumulate(scores, self.data, self.indices, self.indptr, terms[a:z][~dense],
                        w[~dense])
            return _top_positive(scores, k, tie_rank)

        items = range(n_queries)
        if show_progress:
            from r2med_agent.progress import stage_bar

            items = stage_bar(items, desc="BM25 search", unit="query", leave=False)
        return _map(one, items, n_threads)


def _accumulate(
    scores: np.ndarray,
    data: np.ndarray,
    indices: np.ndarray,
    indptr: np.ndarray,
    terms: np.ndarray,
    weights: np.ndarray,
) -> None:
    """``scores += weight(t) * column(t)`` for each term, from the posting lists.

    A term's posting list holds each document once, so plain fancy-index ``+=`` is exact.
    """
    starts = indptr[terms].tolist()
    ends = indptr[terms + 1].tolist()
    for start, end, w in zip(starts, ends, weights.tolist()):
        if w == 1.0:
            scores[indices[start:end]] += data[start:end]
        else:
            scores[indices[start:end]] += w * data[start:end]


class _CompatIndex(SavedArrays):
    """R2MED's gensim ``LuceneBM25Model`` weights (documents and queries), saved as numpy arrays."""

    _ARRAYS = ("data", "indices", "indptr", "idf")

    def __init__(
        self,
        arrays: dict[str, np.ndarray],
        params: dict[str, float],
        vocab: dict[str, int],
    ) -> None:
        super().__init__(arrays, params, vocab)
        self.matrix = _ScoreMatrix(arrays["data"], arrays["indices"], arrays["indptr"],
                                   int(params["num_docs"]))

    @classmethod
    def build(
        cls, docs: AnalyzedTexts, vocab: dict[str, int], k1: float, b: float, show_progress: bool
    ) -> _CompatIndex:
        n_docs, n_terms = len(docs), len(vocab)
        dl = docs.lengths()
        avgdl = float(dl.sum()) / n_docs
        term, doc, tf = _postings(docs, n_terms)  # distinct (term, doc) pairs, term-major
        df = np.bincount(term, minlength=n_terms)
        idf = np.log(n_docs + 1.0) - np.log(df + 0.5)
        data = idf[term] * tf / (tf + k1 * (1.0 - b + b * dl[doc] / avgdl))
        indptr = np.zeros(n_terms + 1, dtype=np.int64)
        np.cumsum(df, out=indptr[1:])
        arrays = {"data": data.astype(np.float32), "indices": doc, "indptr": indptr, "idf": idf}
        params = {"avgdl": avgdl, "k1": k1, "b": b, "num_docs": n_docs}
        return cls(arrays, params, vocab)

    def query_weights(self, queries: AnalyzedTexts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """gensim's ``model[dictionary.doc2bow(query)]`` of every query, as float32 (gensim's
        similarity index stores the query vector as float32).

        Returns (query row, term id, weight) of each distinct (query, term) pair.
        """
        p = self.params
        row, term, qtf, qlen = _bag_of_words(queries, len(self.matrix.indptr) - 1)
        norm = p["k1"] * (1.0 - p["b"] + p["b"] * qlen / p["avgdl"])
        weight = np.asarray(self.arrays["idf"])[term] * qtf / (qtf + norm)
        return row, term, weight.astype(np.float32)

    def top_k(
        self, queries: AnalyzedTexts, k: int, tie_rank: np.ndarray, show_progress: bool,
        n_threads: int,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        row, term, weight = self.query_weights(queries)
        return self.matrix.search(row, term, weight, len(queries), k, tie_rank, show_progress,
                                  n_threads)
