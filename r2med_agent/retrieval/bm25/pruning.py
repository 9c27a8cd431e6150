"""Exact top-``k`` Lucene BM25 search that skips what cannot enter the top ``k`` (MaxScore, term at
a time), compiled with numba when it is installed (``pip install r2med-agent[fast]``).

Every clause of a query has an upper bound: its Lucene score in the document where it scores most
(from the largest ``1 + tf * normInv`` of its postings, :func:`max_denominators`; the score grows
with it). :func:`maxscore` takes one query's clauses in descending order of bound:

1. **Essential terms.** The clauses of largest bound (rare terms: short posting lists) are
   scattered into one accumulator. The ``k``-th largest partial sum is a lower bound ``theta`` of
   the ``k``-th score of the full ranking (a partial sum never exceeds the full one). A document
   none of these terms touched scores at most the sum of the other clauses' bounds; once that
   sum rounds below ``theta`` in float32, no such document can reach the top ``k`` nor tie its
   last score, and the other clauses need not be scattered: the candidates are the documents
   touched so far.
2. **The other terms** are looked up in the candidates only (a forward binary search in the
   term's posting list), largest bound first; after each, a candidate whose partial sum plus the
   bounds of the clauses still to come rounds below ``theta`` is dropped, and ``theta`` rises to
   the ``k``-th largest partial sum.
3. The survivors' sums are exact (every clause added); the caller cuts the top ``k`` from them by
   the exhaustive search's rule (:func:`~r2med_agent.retrieval.bm25.ranking._top_positive`).

Every document whose score can reach the ``k``-th score is scored exactly, so the ranking is the
exhaustive search's, bit for bit and tie for tie. Term values are Lucene's float32 ones
(``w - w / denom`` in float32, as the index stores them) summed in double, as the exhaustive search
sums them (exactly, so the order of the additions changes no bit). "Rounds below ``theta``" is
tested with a margin: a bound ``x`` prunes only when ``x * (1 + 1e-9)`` is below the midpoint of
``theta`` and the float32 before it, so no rounding of the bound's own double sum can prune a
document whose float32 score equals ``theta``.

Without numba the index keeps its exhaustive numpy search (the same results); :func:`maxscore` is
plain Python then and the tests run it as such on small corpora.
"""

from __future__ import annotations

import numpy as np

__all__ = ["COMPILED", "max_denominators", "maxscore"]

_SLACK = 1.0 + 1e-9  # relative margin on a double bound before its float32 test
_BLOCK = 16384  # documents per block of a scatter (128 KiB of accumulator)


def max_denominators(indptr: np.ndarray, denom: np.ndarray) -> np.ndarray:
    """The largest ``denom`` of each term's postings, float32 (1 for a term without postings)."""
    n_terms = len(indptr) - 1
    out = np.ones(n_terms, dtype=np.float32)
    has = np.flatnonzero(np.diff(indptr) > 0)
    if len(has):
        out[has] = np.maximum.reduceat(np.asarray(denom), np.asarray(indptr)[:-1][has])
    return out


def _raise_theta(values: np.ndarray, n: int, k: int, theta: np.float32, scratch: np.ndarray
                 ) -> np.float32:
    """``theta`` or the float32 of the ``k``-th largest of ``values[:n]`` if that is larger (only
    the values above ``theta`` are partitioned)."""
    above = 0
    for i in range(n):
        if values[i] > theta:
            scratch[above] = values[i]
            above += 1
    if above < k:
        return theta
    kth = np.float32(np.partition(scratch[:above], above - k)[above - k])
    return kth if kth > theta else theta


def _below(theta: np.float32) -> float:
    """The midpoint between ``theta`` and the float32 before it: a double below it rounds to a
    float32 below ``theta``."""
    return (float(np.nextafter(theta, np.float32(0.0))) + float(theta)) / 2.0


def _seek(indices: np.ndarray, p: int, hi: int, d: int) -> int:
    """The first position in ``p:hi`` whose document is ``>= d`` (galloping, then binary)."""
    step = 1
    b = p
    while b < hi and indices[b] < d:
        p = b + 1
        b = p + step
        step *= 2
    if b > hi:
        b = hi
    while p < b:
        h = (p + b) >> 1
        if indices[h] < d:
            p = h + 1
        else:
            b = h
    return p


def _add_clause(lo: int, hi: int, once_only: bool, w: np.float32, indices: np.ndarray,
                once: np.ndarray, denom: np.ndarray, docs: np.ndarray, sums: np.ndarray,
                c: int) -> None:
    """Add a clause (postings ``lo:hi``) to the sums of ``docs[:c]`` (ascending) that hold it."""
    p = lo
    for i in range(c):
        p = _seek(indices, p, hi, docs[i])
        if p == hi:
            return
        if indices[p] == docs[i]:
            if once_only:
                sums[i] += once[p]
            else:
                sums[i] += w - w / denom[p]  # float32, as Lucene


def _seed_theta(
    starts: np.ndarray, ends: np.ndarray, once_only: np.ndarray, w: np.ndarray,
    indices: np.ndarray, once: np.ndarray, denom: np.ndarray, k: int, acc: np.ndarray,
    cand: np.ndarray, nc: int, m: int, theta: np.float32, scratch: np.ndarray,
) -> np.float32:
    """``theta`` raised to the ``k``-th best full score of about the ``2k`` documents of best
    partial sum (clauses ``m..`` looked up for them alone): a lower bound of the ``k``-th score.
    The documents are those of the highest buckets of a 64-bucket histogram of the partial sums
    above ``theta`` that hold ``2k`` of them (no sort, no partition)."""
    top = float(theta)
    for i in range(nc):
        v = acc[cand[i]]
        if v > top:
            top = v
    lowest = float(theta)
    if top <= lowest:
        return theta
    counts = np.zeros(65, dtype=np.int64)
    scale = 64.0 / (top - lowest)
    for i in range(nc):
        v = acc[cand[i]]
        if v > lowest:
            counts[min(64, int((v - lowest) * scale))] += 1
    floor = lowest
    total = 0
    for b in range(64, -1, -1):
        total += counts[b]
        if total >= 2 * k:
            floor = lowest + b / scale
            break
    if total < k:
        return theta
    docs = np.empty(total, dtype=np.int64)
    s = 0
    for i in range(nc):
        v = acc[cand[i]]
        if v > lowest and v >= floor and s < total:
            docs[s] = cand[i]
            s += 1
    docs = np.sort(docs[:s])
    sums = np.empty(s)
    for i in range(s):
        sums[i] = acc[docs[i]]
    for t in range(m, len(starts)):
        _add_clause(starts[t], ends[t], once_only[t], w[t], indices, once, denom, docs, sums, s)
    if s < k:
        return theta
    kth = np.float32(np.partition(sums, s - k)[s - k])
    return kth if kth > theta else theta


def _scatter(starts: np.ndarray, ends: np.ndarray, once_only: np.ndarray, w: np.ndarray,
             indices: np.ndarray, once: np.ndarray, denom: np.ndarray, acc: np.ndarray,
             cand: np.ndarray, nc: int, m: int, g: int) -> int:
    """Add clauses ``m:g`` into ``acc``, block of ``_BLOCK`` documents by block; a document
    touched for the first time goes to ``cand``. Returns the new count of ``cand``."""
    pos = starts[m:g].copy()
    n_docs = len(acc)
    for edge in range(_BLOCK, n_docs + _BLOCK, _BLOCK):
        for j in range(g - m):
            t = m + j
            p, hi = pos[j], ends[t]
            if once_only[t]:
                while p < hi and indices[p] < edge:
                    d = indices[p]
                    if acc[d] == 0.0:
                        cand[nc] = d
                        nc += 1
                    acc[d] += once[p]
                    p += 1
            else:
                wt = w[t]
                while p < hi and indices[p] < edge:
                    d = indices[p]
                    if acc[d] == 0.0:
                        cand[nc] = d
                        nc += 1
                    acc[d] += wt - wt / denom[p]  # float32, as Lucene
                    p += 1
            pos[j] = p
    return nc


def maxscore(clauses: tuple, postings: tuple, work: tuple, k: int, first_budget: int) -> int:
    """One query's candidates that can reach its top ``k``, with their exact double sums.

    Args:
        clauses: ``(starts, ends, once_only, w, tail)``, in descending order of bound: each
            clause's posting range; True where the query holds the term once (its values are
            ``once``); Lucene's float32 ``count * idf``; ``tail[m]`` the double sum of the bounds
            of clauses ``m..`` (``tail[n] == 0``).
        postings: the index's ``(indices, once, denom)`` (documents ascending within a term).
        work: ``(acc, cand, part, scratch)``, one slot per document: float64 zeros (left zeroed),
            int64, float64, float64.
        k: the depth.
        first_budget: postings scattered before the first test of ``theta``.

    Returns the number ``c`` of candidates: ``cand[:c]`` (ascending) and their sums ``part[:c]``.
    """
    m, nc, theta = _essential(clauses, postings, work, k, first_budget)
    c = _collect(work, nc, clauses[4][m], _below(theta) if theta > 0 else 0.0)
    return _look_up_rest(clauses, postings, work, k, c, m, theta)


def _essential(clauses: tuple, postings: tuple, work: tuple, k: int, first_budget: int
               ) -> tuple[int, int, np.float32]:
    """Scatter clauses, largest bound first, until the rest cannot lift an untouched document to
    ``theta``; (clauses scattered, documents touched, theta)."""
    starts, ends, once_only, w, tail = clauses
    indices, once, denom = postings
    acc, cand, part, scratch = work
    n = len(starts)
    nc = 0
    theta = np.float32(0.0)
    mid = 0.0  # below mid, a double rounds to a float32 below theta
    m = 0
    scored = 0
    check = first_budget
    while m < n:
        # the clauses up to the next test of theta
        g = m
        group = 0
        while g < n and (g == m or scored + group < check):
            group += ends[g] - starts[g]
            g += 1
        nc = _scatter(starts, ends, once_only, w, indices, once, denom, acc, cand, nc, m, g)
        scored += group
        m = g
        if m < n:
            check = scored + scored // 2
            raised = _seed_theta(starts, ends, once_only, w, indices, once, denom, k, acc, cand,
                                 nc, m, theta, scratch)
            if raised > theta:
                theta = raised
                mid = _below(theta)
            if tail[m] * _SLACK < mid:
                break  # no document untouched so far can reach the top k
    return m, nc, theta


def _collect(work: tuple, nc: int, limit: float, mid: float) -> int:
    """Move the ``nc`` touched documents whose sum plus ``limit`` may reach ``mid`` to
    ``cand``/``part``, ascending, and zero the accumulator; their number."""
    acc, cand, part, _ = work
    n_docs = len(acc)
    c = 0
    if 16 * nc > n_docs:  # read the accumulator in document order
        for d in range(n_docs):
            v = acc[d]
            if v != 0.0:
                acc[d] = 0.0
                if (v + limit) * _SLACK >= mid:
                    cand[c], part[c] = d, v
                    c += 1
        return c
    for i in range(nc):  # keep the touched documents that may reach theta, then sort them
        d = cand[i]
        v = acc[d]
        acc[d] = 0.0
        if (v + limit) * _SLACK >= mid:
            cand[c], part[c] = d, v
            c += 1
    order = np.argsort(cand[:c])
    cand[:c], part[:c] = cand[:c][order], part[:c][order]
    return c


def _look_up_rest(clauses: tuple, postings: tuple, work: tuple, k: int, c: int, m: int,
                  theta: np.float32) -> int:
    """Add clauses ``m..`` to the ``c`` candidates, dropping those that fall below ``theta``;
    the number left."""
    starts, ends, once_only, w, tail = clauses
    indices, once, denom = postings
    _, cand, part, scratch = work
    n = len(starts)
    mid = _below(theta) if theta > 0 else 0.0
    for t in range(m, n):
        _add_clause(starts[t], ends[t], once_only[t], w[t], indices, once, denom, cand, part, c)
        if t + 1 == n:
            break
        if c > k and (t - m) % 4 == 3:
            raised = _raise_theta(part, c, k, theta, scratch)
            if raised > theta:
                theta = raised
                mid = _below(theta)
        limit = tail[t + 1]
        kept = 0
        for i in range(c):
            if (part[i] + limit) * _SLACK >= mid:
                cand[kept], part[kept] = cand[i], part[i]
                kept += 1
        c = kept
    return c


try:  # the optional compiled kernel
    import numba
except ImportError:  # pragma: no cover - depends on the environment
    numba = None

COMPILED = numba is not None
"""True when :func:`maxscore` runs compiled (numba installed)."""

if numba is not None:
    _jit = numba.njit(cache=True, nogil=True)
    _raise_theta, _below, _seek = _jit(_raise_theta), _jit(_below), _jit(_seek)
    _add_clause, _seed_theta, _scatter = _jit(_add_clause), _jit(_seed_theta), _jit(_scatter)
    _essential, _collect, _look_up_rest = _jit(_essential), _jit(_collect), _jit(_look_up_rest)
    maxscore = _jit(maxscore)
