"""BM25 over a task's corpus, with an on-disk index reused across runs.

Two modes share one analyzer (:class:`~r2med_agent.retrieval.analysis.LuceneEnglishAnalyzer`, a
match of pyserini's default Lucene English analyzer):

``lucene`` (retriever name ``bm25``)
    Lucene 9's ``BM25Similarity`` as pyserini's ``LuceneSearcher`` runs it, to the bit (see
    :class:`_LuceneIndex`): ``idf = ln(1 + (N - df + 0.5) / (df + 0.5))`` and per query term
    ``w - w / (1 + tf * normInv)`` with ``w = count * idf`` (a term repeated in the query is one
    clause boosted by its count, as Anserini's bag-of-words query builds it) and
    ``normInv = 1 / (k1 * (1 - b + b * dl / avgdl))``, where ``dl`` is the document length as
    Lucene stores it, in one byte (exact below 24 tokens, then its 4 most significant bits: a
    1,000-token document counts as 984), all in float32 in Lucene's order of operations and the
    terms summed in double. Ties are broken as Anserini breaks them: document id ascending.

``r2med-compat`` (retriever name ``bm25-compat``)
    R2MED's reference scoring (``eval_bench_BM25.py``): gensim's ``LuceneBM25Model(k1, b)`` turns
    the documents **and the query** into BM25 weight vectors, and the score is their dot product
    (``SparseMatrixSimilarity``, no normalisation). A query term is weighted as if the query were a
    document of the corpus::

        w_q(t) = idf(t) * qtf / (qtf + k1 * (1 - b + b * qlen / avgdl))
        w_d(t) = idf(t) *  tf / ( tf + k1 * (1 - b + b *   dl / avgdl))
        score  = sum over distinct query terms t of w_q(t) * w_d(t)

    with gensim's ``idf = ln(N + 1) - ln(df + 0.5)`` (equal to Lucene's) and ``qlen`` the number of
    query tokens in the corpus vocabulary. The weights are computed with numpy and saved as arrays.

Search takes all queries of a call at once. ``r2med-compat``: each query's term weights times
the index's per-(term, document) weights, the most frequent terms added as dense rows and the rest
from their posting lists (see :class:`_ScoreMatrix`). ``lucene``: one matrix product in double
over the frequent terms' rows for all queries, then the other postings (see
:class:`_LuceneIndex`). Only documents with
a positive score are returned (sharing no term with the query is not a match), so a query may
get fewer than ``k`` documents, or none; except in ``r2med-compat`` mode, which, as R2MED's script,
fills the ranking up to ``k`` with score-0 documents in corpus order.

In ``r2med-compat`` mode ties are settled as trec_eval settles them: equal scores rank by
document id, the larger id (string order) first, both inside the returned ranking and at the ``k``
cut (``lucene`` mode follows Anserini instead, smaller id first, so it keeps what pyserini
keeps). The kept documents are therefore exactly the first ``k`` of the full ranking in trec_eval's order
(:func:`r2med_agent.evaluation.trec_sorted`), so a search to depth ``k`` equals a full search cut
to ``k`` by the evaluation, and the first ``j`` results (LameR's first pass, an agent's top 3) are
the ones trec_eval would rank first. (R2MED's reference sorts with Python's stable ``sorted`` and
keeps boundary ties in corpus order; its kept set can then differ from the top ``k`` that
trec_eval ranks, which only matters for exactly equal scores, such as duplicate documents.)

The index of a (corpus, mode, k1, b, analyzer) combination is built once and saved under
``paths.cache_dir()/"bm25"/<key>`` (or ``index_root``), written to a temporary folder and renamed
into place; later runs load it memory-mapped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from r2med_agent import paths
from r2med_agent.errors import ConfigError, DataError
from r2med_agent.io import atomic_write_json
from r2med_agent.retrieval.analysis import AnalyzedTexts, LuceneEnglishAnalyzer
from r2med_agent.types import Run, SearchRequest, Task

__all__ = ["BM25Options", "BM25Retriever", "MODES", "bm25_query_text", "index_key"]

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

_FORMAT = 4  # bump when the on-disk layout or the scoring code changes
_META = "meta.json"
_DOC_IDS = "doc_ids.json"
_TERMS = "terms.txt"  # the vocabulary, one term per line in id order (faster to load than JSON)


def _save_terms(folder: Path, vocab: dict[str, int]) -> None:
    terms = sorted(vocab, key=vocab.__getitem__)
    if any(vocab[t] != i for i, t in enumerate(terms)):
        raise ValueError("vocabulary ids are not 0..V-1")
    (folder / _TERMS).write_text("\n".join(terms), encoding="utf-8")


def _load_terms(folder: Path) -> dict[str, int]:
    terms = (folder / _TERMS).read_text(encoding="utf-8").split("\n")
    return dict(zip(terms, range(len(terms))))


# --- query construction -----------------------------------------------------------------------

_COMBINE_RULES = ("none", "hyde", "query2doc", "lamer", "reasoning")


def bm25_query_text(request: SearchRequest, *, compat: bool = False) -> str:
    """The BM25 query text of a request, by its ``combine`` rule (the table of docs/protocol.md).

    ``none``: the query; ``hyde``: the expansion; ``query2doc``: query, query and expansion joined
    by spaces; ``lamer``: query + " " + expansion; ``reasoning``: the expansion (the final
    response). A rule that uses the expansion falls back to the query when the expansion is blank
    (the caller logs that); see :meth:`BM25Retriever.search`. Several samples
    (``more_expansions``) are joined by spaces into the expansion.

    ``compat`` (the ``bm25-compat`` retriever) builds Query2Doc's query as R2MED's BM25 script
    does: the query repeated with nothing between the two copies, then a space and the passage
    (``query * 2 + " " + passage``). The analyzer then reads the last word of the first copy and
    the first word of the second as one token when no punctuation separates them.
    """
    rule = request.combine
    if rule not in _COMBINE_RULES:
        raise ConfigError(
            f"unknown combine rule '{rule}' for query {request.query_id}; "
            f"allowed: {', '.join(_COMBINE_RULES)}"
        )
    q, x = request.query, " ".join(request.expansions) if request.more_expansions else request.expansion
    if rule == "none" or not x.strip():
        return q
    if rule in ("hyde", "reasoning"):
        return x
    if rule == "query2doc":
        return f"{q}{q} {x}" if compat else f"{q} {q} {x}"
    return f"{q} {x}"  # lamer


# --- index keys -------------------------------------------------------------------------------


def index_key(task: Task, mode: str, k1: float, b: float, analyzer_id: str) -> str:
    """The folder name of a task's index: task name, mode and a hash of everything it depends on."""
    backend = _backend_version(mode)
    payload = json.dumps(
        {
            "format": _FORMAT,
            "corpus": task.fingerprint,
            "n_docs": len(task.corpus),
            "mode": mode,
            "k1": float(k1),
            "b": float(b),
            "analyzer": analyzer_id,
            "backend": backend,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(payload.encode()).hexdigest()[:20]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", task.name).strip("-.") or "task"
    return f"{slug}-{mode}-{digest}"


def _backend_version(mode: str) -> str:
    return "numpy"


# --- scoring ----------------------------------------------------------------------------------


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
            tie_rank: per document, its rank in document-id order; equal scores go to the larger.
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
            from tqdm.auto import tqdm

            items = tqdm(items, desc="BM25 search", unit="query", leave=False)
        return _map(one, items, n_threads)


def _map(fn: Any, items: Any, n_threads: int) -> list:
    if n_threads == -1:
        n_threads = os.cpu_count() or 1
    if n_threads <= 1:
        return [fn(i) for i in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=n_threads) as pool:
        return list(pool.map(fn, items))


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


def _top_positive(
    scores: np.ndarray, k: int, tie_rank: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Indices and scores of the first ``k`` positive-score documents in trec_eval's order.

    trec_eval's order is score descending, then document id descending; ``tie_rank[i]`` is
    document ``i``'s position in ascending document-id order, so among equal scores the larger
    ``tie_rank`` comes first. Documents scoring exactly the ``k``-th score are kept by that rule
    too, never by their position in the corpus.
    """
    n = len(scores)
    if k < n:
        kth = np.partition(scores, n - k)[n - k]  # the k-th highest score
        if kth > 0:
            above = np.flatnonzero(scores > kth)
            tied = np.flatnonzero(scores == kth)
            need = k - len(above)
            if need < len(tied):
                tied = tied[np.argsort(-tie_rank[tied], kind="stable")[:need]]
            hits = np.concatenate([above, tied])
        else:  # fewer than k positive scores
            hits = np.flatnonzero(scores > 0)
    else:
        hits = np.flatnonzero(scores > 0)
    hits = hits[np.lexsort((-tie_rank[hits], -scores[hits]))]
    return hits, scores[hits]


def _doc_id_ranks(doc_ids: Sequence[str]) -> np.ndarray:
    """Each document's position when the ids are sorted as strings (trec_eval compares ids with
    ``strcmp``; for UTF-8 text byte order and Python's code-point order agree)."""
    rank = np.empty(len(doc_ids), dtype=np.int64)
    rank[sorted(range(len(doc_ids)), key=doc_ids.__getitem__)] = np.arange(len(doc_ids))
    return rank


def _bag_of_words(queries: AnalyzedTexts, n_terms: int) -> tuple[np.ndarray, ...]:
    """(query row, term id, count, query length) of each distinct (query, term), sorted by row."""
    qlen = queries.lengths()
    row_of = np.repeat(np.arange(len(queries), dtype=np.int64), qlen)
    pair, count = np.unique(row_of * n_terms + queries.ids, return_counts=True)
    row = pair // n_terms
    return row, pair - row * n_terms, count, qlen[row]


# --- the two indexes ---------------------------------------------------------------------------


class _Index(Protocol):
    vocab: dict[str, int]

    def save(self, folder: Path, show_progress: bool) -> None: ...

    def top_k(
        self, queries: AnalyzedTexts, k: int, tie_rank: np.ndarray, show_progress: bool,
        n_threads: int,
    ) -> list[tuple[np.ndarray, np.ndarray]]: ...


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


def _postings(docs: AnalyzedTexts, n_terms: int) -> tuple[np.ndarray, ...]:
    """(term, doc, tf) of every distinct (term, document) pair, term-major, documents ascending."""
    n_docs = len(docs)
    doc_of = np.repeat(np.arange(n_docs, dtype=np.int64), docs.lengths())
    pair, tf = np.unique(docs.ids.astype(np.int64) * n_docs + doc_of, return_counts=True)
    term = pair // n_docs
    return term, (pair - term * n_docs).astype(np.int32), tf


class _LuceneIndex:
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
               "dense_once", "dense_denom")
    DENSE_BUDGET = 96 * 2**20
    DENSE_MIN_DF = 1 / 8
    QUERY_BLOCK = 64  # queries per matrix product (bounds the product's memory)

    def __init__(self, arrays: dict[str, np.ndarray], params: dict[str, float],
                 vocab: dict[str, int]) -> None:
        # plain ndarray views of memory-mapped files (slicing a np.memmap is slow)
        self.arrays = {n: np.asarray(a) for n, a in arrays.items()}
        self.params, self.vocab = params, vocab
        self.num_docs = int(params["num_docs"])
        self.dense_row = np.full(len(self.arrays["idf"]), -1, dtype=np.int64)
        self.dense_row[self.arrays["dense_terms"]] = np.arange(len(self.arrays["dense_terms"]))

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
                  "dense_once": dense_once, "dense_denom": dense_denom}
        params = {"avgdl": float(avgdl), "doc_count": doc_count, "k1": k1, "b": b,
                  "num_docs": n_docs}
        return cls(arrays, params, vocab)

    @classmethod
    def load(cls, folder: Path, show_progress: bool) -> _LuceneIndex:
        arrays = {n: np.load(folder / f"{n}.npy", mmap_mode="r") for n in cls._ARRAYS}
        params = json.loads((folder / "params.json").read_text(encoding="utf-8"))
        return cls(arrays, params, _load_terms(folder))

    def save(self, folder: Path, show_progress: bool) -> None:
        _save_arrays(folder, self.arrays, self.params, self.vocab)

    def top_k(
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
            from tqdm.auto import tqdm

            blocks = tqdm(blocks, desc="BM25 search", unit="block", leave=False)
        out: list[tuple[np.ndarray, np.ndarray]] = []
        for start in blocks:
            stop = min(start + self.QUERY_BLOCK, n_queries)
            if len(dense_once):
                part = select[start:stop] @ dense_once  # one BLAS product for the block
            else:
                part = np.zeros((stop - start, n_docs))
            out.extend(_map(lambda q: finish(q, part[q - start]), range(start, stop), n_threads))
        return out


def _save_arrays(folder: Path, arrays: dict[str, np.ndarray], params: dict[str, Any],
                 vocab: dict[str, int]) -> None:
    for n, a in arrays.items():
        np.save(folder / f"{n}.npy", a)
    (folder / "params.json").write_text(json.dumps(params), encoding="utf-8")
    _save_terms(folder, vocab)


class _CompatIndex:
    """R2MED's gensim ``LuceneBM25Model`` weights (documents and queries), saved as numpy arrays."""

    _ARRAYS = ("data", "indices", "indptr", "idf")

    def __init__(
        self,
        arrays: dict[str, np.ndarray],
        params: dict[str, float],
        vocab: dict[str, int],
    ) -> None:
        self.arrays, self.params, self.vocab = arrays, params, vocab
        self.matrix = _ScoreMatrix(arrays["data"], arrays["indices"], arrays["indptr"],
                                   int(params["num_docs"]))

    @classmethod
    def build(
        cls, docs: AnalyzedTexts, vocab: dict[str, int], k1: float, b: float, show_progress: bool
    ) -> _CompatIndex:
        n_docs, n_terms = len(docs), len(vocab)
        dl = docs.lengths()
        avgdl = float(dl.sum()) / n_docs
        doc_of = np.repeat(np.arange(n_docs, dtype=np.int64), dl)
        # distinct (term, doc) pairs, term-major, with their counts
        pair, tf = np.unique(docs.ids.astype(np.int64) * n_docs + doc_of, return_counts=True)
        term = pair // n_docs
        doc = (pair - term * n_docs).astype(np.int32)
        df = np.bincount(term, minlength=n_terms)
        idf = np.log(n_docs + 1.0) - np.log(df + 0.5)
        data = idf[term] * tf / (tf + k1 * (1.0 - b + b * dl[doc] / avgdl))
        indptr = np.zeros(n_terms + 1, dtype=np.int64)
        np.cumsum(df, out=indptr[1:])
        arrays = {"data": data.astype(np.float32), "indices": doc, "indptr": indptr, "idf": idf}
        params = {"avgdl": avgdl, "k1": k1, "b": b, "num_docs": n_docs}
        return cls(arrays, params, vocab)

    @classmethod
    def load(cls, folder: Path, show_progress: bool) -> _CompatIndex:
        arrays = {n: np.load(folder / f"{n}.npy", mmap_mode="r") for n in cls._ARRAYS}
        params = json.loads((folder / "params.json").read_text(encoding="utf-8"))
        return cls(arrays, params, _load_terms(folder))

    def save(self, folder: Path, show_progress: bool) -> None:
        _save_arrays(folder, self.arrays, self.params, self.vocab)

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


_BACKENDS: dict[str, type] = {"lucene": _LuceneIndex, "r2med-compat": _CompatIndex}


# --- the retriever ----------------------------------------------------------------------------


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
        doc_ids: Sequence[str],
        index: _Index,
        analyzer: LuceneEnglishAnalyzer,
        index_dir: Path,
        built_index: bool,
        show_progress: bool = True,
        n_threads: int = 0,
    ) -> None:
        self.mode = mode
        self.name = MODES[mode]
        self.k1, self.b = k1, b
        self.index_dir = index_dir
        self.built_index = built_index
        self.show_progress = show_progress
        self.n_threads = n_threads
        self._doc_ids = list(doc_ids)
        rank = _doc_id_ranks(self._doc_ids)
        # the larger tie_rank comes first among equal scores: lucene mode breaks ties as Anserini
        # does (document id ascending), r2med-compat as trec_eval does (descending)
        self._tie_rank = len(rank) - 1 - rank if mode == "lucene" else rank
        self._index = index
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

        index = _load_saved(folder, backend, key, doc_ids, show_progress)
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
            _save(folder, index, key, doc_ids, show_progress)
            logger.info(
                "indexed %d docs (%d terms, %s) in %.1fs; saved to %s",
                len(doc_ids), len(vocab), mode, time.perf_counter() - t0, folder,
            )
        return cls(
            mode=mode, k1=k1, b=b, doc_ids=doc_ids, index=index, analyzer=analyzer,
            index_dir=folder, built_index=built, show_progress=show_progress, n_threads=n_threads,
        )

    def search(self, requests: Sequence[SearchRequest], k: int) -> Run:
        """Top-``k`` documents of every request, in one batched search.

        Every requested query id is in the result; its ranking holds only documents that share a
        term with the query (an empty dict when none does), in trec_eval's order (score
        descending, equal scores by document id descending; the ``k`` cut follows the same
        order), scores as Python floats.
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
            if r.combine != "none" and not r.expansion.strip():
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


def _load_saved(
    folder: Path, backend: Any, key: str, doc_ids: list[str], show_progress: bool
) -> _Index | None:
    """The saved index in ``folder`` if it is complete and belongs to this corpus, else None."""
    meta_path = folder / _META
    if not meta_path.is_file():
        if folder.exists():
            logger.warning("BM25 index folder %s is incomplete; rebuilding it", folder)
            shutil.rmtree(folder, ignore_errors=True)
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        saved_ids = json.loads((folder / _DOC_IDS).read_text(encoding="utf-8"))
        if meta.get("key") != key or saved_ids != doc_ids:
            logger.warning("saved BM25 index %s does not match this corpus; rebuilding it", folder)
            shutil.rmtree(folder, ignore_errors=True)
            return None
        t0 = time.perf_counter()
        index = backend.load(folder, show_progress)
    except (OSError, ValueError, KeyError) as e:
        logger.warning("cannot read saved BM25 index %s (%s); rebuilding it", folder, e)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    logger.info("loaded BM25 index from %s in %.2fs", folder, time.perf_counter() - t0)
    return index


def _save(folder: Path, index: _Index, key: str, doc_ids: list[str], show_progress: bool) -> None:
    """Write the index into a temporary sibling folder, then rename it into place."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"))
    try:
        index.save(tmp, show_progress)
        (tmp / _DOC_IDS).write_text(json.dumps(doc_ids, ensure_ascii=False), encoding="utf-8")
        atomic_write_json(tmp / _META, {"key": key, "format": _FORMAT, "num_docs": len(doc_ids),
                                        "num_terms": len(index.vocab)})
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / _META).is_file():
                raise
            # another process saved the same index first; keep theirs
            logger.info("BM25 index %s was saved by another process meanwhile", folder)
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
