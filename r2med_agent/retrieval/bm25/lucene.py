"""Lucene 9's ``BM25Similarity`` as pyserini's ``LuceneSearcher`` runs it, to the bit (the
``bm25`` retriever's scoring; see :class:`_LuceneIndex`).

``idf = ln(1 + (N - df + 0.5) / (df + 0.5))`` and per query term ``w - w / (1 + tf * normInv)``
with ``w = count * idf`` (a term repeated in the query is one clause boosted by its count, as
Anserini's bag-of-words query builds it) and ``normInv = 1 / (k1 * (1 - b + b * dl / avgdl))``,
where ``dl`` is the document length as Lucene stores it, in one byte (exact below 24 tokens, then
its 4 most significant bits: a 1,000-token document counts as 984), all in float32 in Lucene's
order of operations and the terms summed in double. With numba installed a search is the pruned
one of :mod:`~r2med_agent.retrieval.bm25.pruning` (one query at a time, skipping what cannot enter
the top ``k``); without it, one matrix product in double over the frequent terms' rows for all
queries, then the other postings. Both give the same results, bit for bit.
"""

from __future__ import annotations

import threading

import numpy as np

from r2med_agent.retrieval.bm25 import pruning
from r2med_agent.retrieval.bm25.analysis import AnalyzedTexts
from r2med_agent.retrieval.bm25.index import SavedArrays
from r2med_agent.retrieval.bm25.ranking import _bag_of_words, _map, _postings, _top_positive

__all__ = ["length_to_norm", "lucene_idf", "lucene_norm_inverse", "norm_to_length"]

# Lucene's SmallFloat.intToByte4: a document length is stored in one byte, exact below 24, then
# with its 4 most significant bits (rounded down), so lengths 984..1047 all read back as 984.
_NUM_FREE_VALUES = 24


def length_to_norm(lengths: np.ndarray) -> np.ndarray:
    """Lucene's ``SmallFloat.intToByte4`` of each length (an unsigned byte, 0..255)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rest = np.maximum(lengths - _NUM_FREE_VALUES, 0)
    bits = np.frexp(rest.astype(np.float64))[1].astype(np.int64)  # bit length (exact < 2**53)
    shift = np.maximum(bits - 4, 0)
    encoded = np.where(bits >= 4, ((rest >> shift) & 0x07) | ((shift + 1) << 3), rest)
    return np.where(lengths < _NUM_FREE_VALUES, lengths,
                    _NUM_FREE_VALUES + encoded).astype(np.uint8)


def norm_to_length(norms: np.ndarray) -> np.ndarray:
    """Lucene's ``SmallFloat.byte4ToInt``: the length a norm byte stands for."""
    i = np.asarray(norms, dtype=np.int64)
    e = i - _NUM_FREE_VALUES
    shift = (e >> 3) - 1
    decoded = np.where(shift < 0, e & 0x07, ((e & 0x07) | 0x08) << np.maximum(shift, 0))
    return np.where(i < _NUM_FREE_VALUES, i, _NUM_FREE_VALUES + decoded)


def lucene_norm_inverse(k1: float, b: float, avgdl: np.float32) -> np.ndarray:
    """``BM25Similarity``'s cache: ``1 / (k1 * ((1 - b) + b * length / avgdl))`` per norm byte,
    in float32 with Lucene's order of operations."""
    f = np.float32
    length = norm_to_length(np.arange(256)).astype(np.float32)
    k1_, b_ = f(k1), f(b)
    return (f(1) / (k1_ * ((f(1) - b_) + b_ * length / f(avgdl)))).astype(np.float32)


def lucene_idf(df: np.ndarray, doc_count: int) -> np.ndarray:
    """``BM25Similarity.idf``: ``log(1 + (docCount - df + 0.5) / (df + 0.5))`` in double, as
    float32."""
    df = np.asarray(df, dtype=np.float64)
    return np.log(1.0 + (doc_count - df + 0.5) / (df + 0.5)).astype(np.float32)


class _LuceneIndex(SavedArrays):
    """Lucene's ``BM25Similarity`` (Lucene 9), to the bit.

    Lucene keeps each document's length in one byte (:func:`length_to_norm`) and scores a term
    of a bag-of-words query (Anserini's ``BagOfWordsQueryGenerator``: one clause per distinct term,
    boosted by its count) in float32 as ``w - w / (1 + tf * normInv)`` with ``w = count * idf``
    and ``normInv`` the cache entry of the document's norm byte; the clauses' scores are summed in
    double and the sum rounded to float32. ``avgdl`` is the total number of tokens over the number
    of documents that have at least one token (Lucene's ``docCount``), also the ``N`` of the idf.

    Stored per (term, document), term-major: ``once``, the float32 score of the term for a query
    holding it once (``w = idf``, the most common case), and ``denom``, Lucene's float32
    ``1 + tf * normInv`` of the document, from which the score for any other count is one
    subtraction and one division. A search computes the values of each (term, count) pair of the
    batch once and, per query, adds every term's values into one double accumulator in a single
    ``bincount`` over the concatenated posting lists.

    The few most frequent terms (document frequency >= ``DENSE_MIN_DF`` of the corpus, within
    ``DENSE_BUDGET`` bytes) are also kept as dense rows (``dense_once`` in double, ``dense_denom``
    in float32, 1 where the term is absent, which scores exactly 0): a dense row is added in one
    contiguous pass, faster than scattering a posting list that covers a quarter of the corpus or
    more, and the count-1 rows of a batch of queries are one matrix product (BLAS). A sum of
    float32 values in double is exact at these magnitudes, so the order of the additions
    (BLAS's, bincount's or Lucene's) does not change a bit of the result.
    """

    _ARRAYS = ("indptr", "indices", "once", "denom", "idf", "norms", "norm_inv", "dense_terms",
               "dense_once", "dense_denom", "max_denom")
    DENSE_BUDGET = 96 * 2**20
    DENSE_MIN_DF = 1 / 8
    QUERY_BLOCK = 64  # queries per matrix product (bounds the product's memory)
    FIRST_BUDGET = 1 / 32  # pruned search: share of a query's postings scattered before theta
    pruned = pruning.COMPILED  # the pruned search (compiled) or the exhaustive one (numpy)

    def __init__(self, arrays: dict[str, np.ndarray], params: dict[str, float],
                 vocab: dict[str, int]) -> None:
        # plain read-only ndarray views (slicing a np.memmap is slow), built or loaded alike (one
        # signature of the compiled kernel)
        views = {n: np.asarray(a).view() for n, a in arrays.items()}
        for a in views.values():
            a.flags.writeable = False
        super().__init__(views, params, vocab)
        self.num_docs = int(params["num_docs"])
        self.dense_row = np.full(len(self.arrays["idf"]), -1, dtype=np.int64)
        self.dense_row[self.arrays["dense_terms"]] = np.arange(len(self.arrays["dense_terms"]))
        self._scratch = threading.local()  # the pruned search's per-thread work arrays

    @classmethod
    def build(
        cls, docs: AnalyzedTexts, vocab: dict[str, int], k1: float, b: float, show_progress: bool
    ) -> _LuceneIndex:
        n_docs, n_terms = len(docs), len(vocab)
        dl = docs.lengths()
        doc_count = int(np.count_nonzero(dl))
        avgdl = np.float32(float(dl.sum()) / doc_count)
        norm_inv = lucene_norm_inverse(k1, b, avgdl)
        norms = length_to_norm(dl)
        term, doc, tf = _postings(docs, n_terms)
        denom = np.float32(1) + tf.astype(np.float32) * norm_inv[norms[doc]]
        df = np.bincount(term, minlength=n_terms)
        idf = lucene_idf(df, doc_count)
        w = idf[term]
        once = w - w / denom
        indptr = np.zeros(n_terms + 1, dtype=np.int64)
        np.cumsum(df, out=indptr[1:])
        # the dense rows: the most frequent terms, within the budget
        frequent = np.flatnonzero(df >= max(2.0, n_docs * cls.DENSE_MIN_DF))
        cap = cls.DENSE_BUDGET // (12 * n_docs)
        if len(frequent) > cap:
            frequent = np.sort(frequent[np.argsort(-df[frequent], kind="stable")[:cap]])
        dense_once = np.zeros((len(frequent), n_docs), dtype=np.float64)
        dense_denom = np.ones((len(frequent), n_docs), dtype=np.float32)
        for i, t in enumerate(frequent.tolist()):
            lo, hi = indptr[t], indptr[t + 1]
            dense_once[i, doc[lo:hi]] = once[lo:hi]
            dense_denom[i, doc[lo:hi]] = denom[lo:hi]
        arrays = {"indptr": indptr, "indices": doc, "once": once, "denom": denom, "idf": idf,
                  "norms": norms, "norm_inv": norm_inv, "dense_terms": frequent.astype(np.int64),
                  "dense_once": dense_once, "dense_denom": dense_denom,
                  "max_denom": pruning.max_denominators(indptr, denom)}
        params = {"avgdl": float(avgdl), "doc_count": doc_count, "k1": k1, "b": b,
                  "num_docs": n_docs}
        return cls(arrays, params, vocab)

    def top_k(
        self, queries: AnalyzedTexts, k: int, tie_rank: np.ndarray, show_progress: bool,
        n_threads: int,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        if self.pruned:
            return self._top_k_pruned(queries, k, tie_rank, show_progress, n_threads)
        return self._top_k_exhaustive(queries, k, tie_rank, show_progress, n_threads)

    def _top_k_pruned(
        self, queries: AnalyzedTexts, k: int, tie_rank: np.ndarray, show_progress: bool,
        n_threads: int,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """The search of :mod:`~r2med_agent.retrieval.bm25.pruning`, one query at a time."""
        a = self.arrays
        indptr, indices, once, denom = a["indptr"], a["indices"], a["once"], a["denom"]
        row, term, count, _ = _bag_of_words(queries, len(a["idf"]))
        w = count.astype(np.float32) * a["idf"][term]  # Lucene's boosted idf of each clause
        bound = (w - w / a["max_denom"][term]).astype(np.float64)  # its score at most
        bounds = np.searchsorted(row, np.arange(len(queries) + 1)).tolist()

        def one(q: int) -> tuple[np.ndarray, np.ndarray]:
            lo, hi = bounds[q], bounds[q + 1]
            order = lo + np.argsort(-bound[lo:hi], kind="stable")
            t = term[order]
            starts, ends = indptr[t], indptr[t + 1]
            tail = np.zeros(len(t) + 1)
            tail[:-1] = np.cumsum(bound[order][::-1])[::-1]
            budget = max(int((ends - starts).sum() * self.FIRST_BUDGET), 4 * k)
            work = self._work_arrays()
            c = pruning.maxscore((starts, ends, count[order] == 1, w[order], tail),
                                 (indices, once, denom), work, k, budget)
            docs = work[1][:c].copy()
            hits, scores = _top_positive(work[2][:c].astype(np.float32), k, tie_rank[docs])
            return docs[hits], scores

        items = range(len(queries))
        if show_progress:
            from r2med_agent.progress import stage_bar

            items = stage_bar(items, desc="BM25 search", unit="query", leave=False)
        return _map(one, items, n_threads)

    def _work_arrays(self) -> tuple[np.ndarray, ...]:
        """This thread's accumulator (zeros), candidate, sum and scratch arrays, one slot per
        document."""
        work = getattr(self._scratch, "arrays", None)
        if work is None:
            n = self.num_docs
            work = (np.zeros(n), np.empty(n, dtype=np.int64), np.empty(n), np.empty(n))
            self._scratch.arrays = work
        return work

    def _top_k_exhaustive(
        self, queries: AnalyzedTexts, k: int, tie_rank: np.ndarray, show_progress: bool,
        n_threads: int,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        a = self.arrays
        n_queries, n_docs = len(queries), self.num_docs
        row, term, count, _ = _bag_of_words(queries, len(a["idf"]))
        drow = self.dense_row[term]
        dense_once, dense_denom = a["dense_once"], a["dense_denom"]
        in_product = (count == 1) & (drow >= 0)  # summed by the matrix product
        select = np.zeros((n_queries, len(dense_once)), dtype=np.float64)
        select[row[in_product], drow[in_product]] = 1.0
        rest = np.flatnonzero(~in_product)
        bounds = np.searchsorted(row[rest], np.arange(n_queries + 1)).tolist()
        indptr, indices, once, denom, idf = a["indptr"], a["indices"], a["once"], a["denom"], a["idf"]
        terms, counts, rows = term.tolist(), count.tolist(), drow.tolist()
        starts, ends = indptr[term].tolist(), indptr[term + 1].tolist()
        values: dict[tuple[int, int], np.ndarray] = {}  # (term, count) -> its float32 scores

        def value(j: int) -> np.ndarray:
            """Lucene's float32 score of term ``j`` for its count, per posting (or dense row)."""
            key = (terms[j], counts[j])
            v = values.get(key)
            if v is None:
                w = np.float32(counts[j]) * idf[terms[j]]
                if rows[j] >= 0:  # a dense row, added as is: kept in double (exact)
                    v = (w - w / dense_denom[rows[j]]).astype(np.float64)
                else:
                    d = denom[starts[j] : ends[j]]
                    v = w - w / d
                values[key] = v
            return v

        def finish(q: int, total: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """Add query ``q``'s other terms to its matrix-product part; its top k."""
            docs, vals = [], []
            for j in rest[bounds[q] : bounds[q + 1]].tolist():
                if rows[j] >= 0:  # a dense term repeated in the query: its whole row
                    total += value(j)
                    continue
                docs.append(indices[starts[j] : ends[j]])
                vals.append(once[starts[j] : ends[j]] if counts[j] == 1 else value(j))
            if docs:  # every posting in one pass, summed in double
                total += np.bincount(np.concatenate(docs), np.concatenate(vals),
                                     minlength=n_docs)
            return _top_positive(total.astype(np.float32), k, tie_rank)

        blocks = range(0, n_queries, self.QUERY_BLOCK)
        if show_progress:
            from r2med_agent.progress import stage_bar

            blocks = stage_bar(blocks, desc="BM25 search", unit="block", leave=False)
        out: list[tuple[np.ndarray, np.ndarray]] = []
        for start in blocks:
            stop = min(start + self.QUERY_BLOCK, n_queries)
            if len(dense_once):
                part = select[start:stop] @ dense_once  # one BLAS product for the block
            else:
                part = np.zeros((stop - start, n_docs))
            out.extend(_map(lambda q: finish(q, part[q - start]), range(start, stop), n_threads))
        return out
