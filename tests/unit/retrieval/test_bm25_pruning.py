"""The pruned BM25 search (MaxScore, :mod:`r2med_agent.retrieval.bm25.pruning`) against the
exhaustive one: the same documents, the same float32 scores and the same tie order, at every depth.

The kernel runs compiled when numba is installed and as plain Python otherwise (then over a
smaller corpus); both are checked where numba is present.
"""

from __future__ import annotations

import numpy as np
import pytest

from r2med_agent.retrieval.bm25 import pruning
from r2med_agent.retrieval.bm25.analysis import LuceneEnglishAnalyzer
from r2med_agent.retrieval.bm25.lucene import _LuceneIndex
from r2med_agent.retrieval.bm25.retriever import BM25Retriever
from r2med_agent.types import SearchRequest

from tests.unit.retrieval.test_bm25 import _stdlib_docstrings, make_task

K1, B = 0.9, 0.4


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    texts = _stdlib_docstrings(1500 if pruning.COMPILED else 600)
    if len(texts) < 500:
        pytest.skip(f"only {len(texts)} standard-library docstrings found")
    rng = np.random.default_rng(5)
    # duplicates (exact ties) scattered through the corpus, and short documents (high norms)
    dups = [texts[i] for i in rng.choice(len(texts), size=60, replace=False).tolist()]
    short = [" ".join(t.split()[:4]) for t in texts[:40]]
    out = texts + dups + short
    return [out[i] for i in rng.permutation(len(out)).tolist()]


@pytest.fixture(scope="module")
def index(corpus: list[str]) -> tuple[_LuceneIndex, LuceneEnglishAnalyzer]:
    analyzer = LuceneEnglishAnalyzer()
    docs, vocab = analyzer.fit(corpus, show_progress=False)
    return _LuceneIndex.build(docs, vocab, K1, B, False), analyzer


@pytest.fixture(scope="module")
def query_texts(corpus: list[str]) -> list[str]:
    rng = np.random.default_rng(11)
    out = ["return return value value value the object default", "socket socket socket timeout",
           "zzqxv qqqqzz", "the of and"]
    for n, i in enumerate(rng.choice(len(corpus), size=30, replace=False).tolist()):
        words = corpus[i].split() * 4
        size = [3, 8, 40, 150][n % 4]
        start = int(rng.integers(0, max(1, len(words) - size)))
        out.append(" ".join(words[start : start + size]))
    return out


def _kernels() -> list[str]:
    return ["compiled", "python"] if pruning.COMPILED else ["python"]


def _as_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the kernel and its helpers as plain Python (numba's ``py_func``)."""
    for name in ("maxscore", "_essential", "_collect", "_look_up_rest", "_scatter", "_add_clause",
                 "_seed_theta", "_raise_theta", "_below", "_seek"):
        monkeypatch.setattr(pruning, name, getattr(getattr(pruning, name), "py_func"))


@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize("k", [1, 10, 100, 5000])
def test_pruned_search_equals_the_exhaustive_search_bit_for_bit_and_tie_for_tie(
    kernel: str, k: int, index: tuple[_LuceneIndex, LuceneEnglishAnalyzer], query_texts: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if kernel == "python" and pruning.COMPILED:
        _as_python(monkeypatch)
    idx, analyzer = index
    queries = analyzer.transform(query_texts, idx.vocab)
    k = min(k, idx.num_docs)
    # ties by a rank unrelated to the corpus order, so a wrong tie rule shows
    tie_rank = np.random.default_rng(2).permutation(idx.num_docs)
    monkeypatch.setattr(idx, "pruned", False)
    want = idx.top_k(queries, k, tie_rank, False, 0)
    monkeypatch.setattr(idx, "pruned", True)
    got = idx.top_k(queries, k, tie_rank, False, 0)
    ties = 0
    for text, (wd, ws), (gd, gs) in zip(query_texts, want, got):
        assert gd.tolist() == wd.tolist(), text
        assert gs.dtype == ws.dtype == np.float32
        assert gs.tobytes() == ws.tobytes(), text
        ties += int((np.diff(ws) == 0).sum())
    if k >= 100:
        assert ties > 0  # duplicate documents tie, and the order among them held
    assert not got[2][0].size and not got[3][0].size  # unknown terms, stopwords: no match


def test_the_kernel_leaves_out_documents_that_cannot_reach_the_top_k(
    index: tuple[_LuceneIndex, LuceneEnglishAnalyzer], query_texts: list[str],
) -> None:
    # what makes it fast: far fewer candidates scored to the end than documents matching, and the
    # accumulator handed back zeroed for the next query
    idx, analyzer = index
    a = idx.arrays
    queries = analyzer.transform(query_texts[4:], idx.vocab)
    from r2med_agent.retrieval.bm25.ranking import _bag_of_words

    row, term, count, _ = _bag_of_words(queries, len(a["idf"]))
    w = count.astype(np.float32) * a["idf"][term]
    bound = (w - w / a["max_denom"][term]).astype(np.float64)
    acc = np.zeros(idx.num_docs)
    cand, part, scratch = np.empty(idx.num_docs, np.int64), np.empty(idx.num_docs), np.empty(idx.num_docs)
    kept, matched = 0, 0
    for q in range(len(queries)):
        sel = np.flatnonzero(row == q)
        sel = sel[np.argsort(-bound[sel], kind="stable")]
        t = term[sel]
        tail = np.zeros(len(t) + 1)
        tail[:-1] = np.cumsum(bound[sel][::-1])[::-1]
        c = pruning.maxscore((a["indptr"][t], a["indptr"][t + 1], count[sel] == 1, w[sel], tail),
                             (a["indices"], a["once"], a["denom"]), (acc, cand, part, scratch), 10, 50)
        assert (np.diff(cand[:c]) > 0).all()  # ascending, each document once
        assert not acc.any()
        kept += c
        matched += len(np.unique(np.concatenate([a["indices"][a["indptr"][x]:a["indptr"][x + 1]]
                                                  for x in t.tolist()])))
    assert kept < matched / 4


def test_max_denominators_bound_every_posting(index: tuple[_LuceneIndex, LuceneEnglishAnalyzer]
                                              ) -> None:
    idx, _ = index
    a = idx.arrays
    term_of = np.repeat(np.arange(len(a["idf"])), np.diff(a["indptr"]))
    assert (a["denom"] <= a["max_denom"][term_of]).all()
    assert (np.maximum.reduceat(a["denom"], a["indptr"][:-1]) == a["max_denom"]).all()


def test_retriever_runs_are_the_same_pruned_or_exhaustive(
    corpus: list[str], tmp_path, monkeypatch: pytest.MonkeyPatch, query_texts: list[str],
) -> None:
    if not pruning.COMPILED:
        _as_python(monkeypatch)
    task = make_task(corpus)
    requests = [SearchRequest(f"q{i}", t) for i, t in enumerate(query_texts)]
    runs = []
    for pruned in (False, True):
        monkeypatch.setattr(_LuceneIndex, "pruned", pruned)
        r = BM25Retriever.for_task(task, index_root=tmp_path, show_progress=False)
        runs.append(r.search(requests, 20))
    assert runs[0] == runs[1]
    assert list(runs[0].items()) == list(runs[1].items())
    assert all(list(a) == list(b) for a, b in zip(runs[0].values(), runs[1].values()))


def test_postings_counted_in_chunks_equal_one_pass(corpus: list[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # indexing counts (term, document) pairs a chunk of documents at a time to bound its memory;
    # the merged postings are the single pass's, dtypes included
    from r2med_agent.retrieval.bm25 import ranking

    docs, vocab = LuceneEnglishAnalyzer().fit(corpus, show_progress=False)
    whole = ranking._postings(docs, len(vocab))
    for chunk in (1, 997, 20_000):
        monkeypatch.setattr(ranking, "_POSTINGS_CHUNK", chunk)
        parts = ranking._postings(docs, len(vocab))
        for a, b in zip(whole, parts):
            assert a.dtype == b.dtype and np.array_equal(a, b)
