"""What both BM25 scorings share: term counts of documents and queries, the top ``k`` in
trec_eval's order, and the map over queries on threads."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from r2med_agent.retrieval.bm25.analysis import AnalyzedTexts


_POSTINGS_CHUNK = 1 << 24  # tokens counted at a time (bounds the memory of indexing)


def _postings(docs: AnalyzedTexts, n_terms: int) -> tuple[np.ndarray, ...]:
    """(term, doc, tf) of every distinct (term, document) pair, term-major, documents ascending.

    Documents are counted in chunks of about ``_POSTINGS_CHUNK`` tokens, each chunk's pairs sorted
    term-major; a stable sort by term then merges the chunks (already in document order), so the
    memory held is a few bytes per posting plus one chunk's worth per token, not per token of the
    whole corpus."""
    n_docs = len(docs)
    lengths = docs.lengths()
    offsets = docs.offsets
    cuts = np.searchsorted(offsets, np.arange(0, int(offsets[-1]), _POSTINGS_CHUNK), side="right") - 1
    edges = np.unique(np.concatenate([[0], np.maximum(cuts, 0), [n_docs]])).tolist()
    terms, doc_ids, tfs = [], [], []
    for a, b in zip(edges[:-1], edges[1:]):
        nd = b - a
        doc_of = np.repeat(np.arange(nd, dtype=np.int64), lengths[a:b])
        pair, tf = np.unique(docs.ids[offsets[a]:offsets[b]].astype(np.int64) * nd + doc_of,
                             return_counts=True)
        del doc_of
        term = pair // nd
        terms.append(term.astype(np.int32))
        doc_ids.append((pair - term * nd + a).astype(np.int32))
        tfs.append(tf.astype(np.int32))
        del pair, term, tf
    term, doc, tf = np.concatenate(terms), np.concatenate(doc_ids), np.concatenate(tfs)
    del terms, doc_ids, tfs
    if len(edges) > 2:
        order = np.argsort(term, kind="stable")  # merges the chunks' sorted runs
        term, doc, tf = term[order], doc[order], tf[order]
    return term.astype(np.int64), doc, tf.astype(np.int64)


def _bag_of_words(queries: AnalyzedTexts, n_terms: int) -> tuple[np.ndarray, ...]:
    """(query row, term id, count, query length) of each distinct (query, term), sorted by row."""
    qlen = queries.lengths()
    row_of = np.repeat(np.arange(len(queries), dtype=np.int64), qlen)
    pair, count = np.unique(row_of * n_terms + queries.ids, return_counts=True)
    row = pair // n_terms
    return row, pair - row * n_terms, count, qlen[row]


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


def _map(fn: Any, items: Any, n_threads: int) -> list:
    if n_threads == -1:
        n_threads = os.cpu_count() or 1
    if n_threads <= 1:
        return [fn(i) for i in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=n_threads) as pool:
        return list(pool.map(fn, items))
