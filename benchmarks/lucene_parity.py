"""Parity with real Lucene (pyserini 1.6.0 = Anserini 1.7.1 = Lucene 9.9.1) on real text.

Two checks, each printed with its counts:

* **Tokens.** Every text is analyzed by r2med-agent's ``LuceneEnglishAnalyzer`` and by pyserini's
  default analyzer (``get_lucene_analyzer()``, what R2MED's reference uses); the token lists must
  be identical. The first differences are printed.
* **Rankings.** ``BM25Retriever`` in ``lucene`` mode (``--retriever bm25``) against Lucene's own
  search over an index built by Anserini's ``IndexCollection``: the same top 10 (documents and
  order) per query, and the same float32 scores, bit for bit.

Corpora (real text available offline on every machine with Python):

* ``docstrings``: the docstring passages of ``benchmarks/bm25.py`` (150-480 words from the standard
  library's and the installed packages' docstrings), with R2MED-length queries (100-600 words)
  and short ones (5-15 words) cut the same way from another seed;
* ``packages``: the metadata descriptions of the installed distributions (READMEs: Markdown,
  reStructuredText, emoji, non-English text), queried with each distribution's one-line summary
  and with long queries from the docstring passages.

Needs pyserini and Java 21+ (see ``benchmarks/lucene_peer.py``); exits 2 with the reason when
they are missing. Usage: ``python benchmarks/lucene_parity.py [--docs 61000] [--queries 200]``.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import lucene_peer  # benchmarks/lucene_peer.py
from realtext import passages, sentence_pool  # benchmarks/realtext.py

from r2med_agent.retrieval.bm25.analysis import LuceneEnglishAnalyzer
from r2med_agent.retrieval.bm25.retriever import BM25Retriever
from r2med_agent.types import Doc, Query, SearchRequest, Task


def package_descriptions() -> tuple[list[str], list[str]]:
    """(descriptions, summaries) of the installed distributions, one per distinct name."""
    seen: set[str] = set()
    docs, summaries = [], []
    for dist in sorted(metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        name = (dist.metadata["Name"] or "").lower()
        if not name or name in seen:
            continue
        seen.add(name)
        body = dist.metadata.get_payload() or dist.metadata["Description"] or ""
        if len(body.split()) >= 20:
            docs.append(body)
            summaries.append(dist.metadata["Summary"] or name)
    return docs, summaries


def make_task(name: str, texts: Sequence[str], queries: Sequence[str]) -> Task:
    corpus = tuple(Doc(f"d{i}", t) for i, t in enumerate(texts))
    h = hashlib.sha256()
    for d in corpus:
        h.update(f"{len(d.text)}:{d.text}\n".encode())
    return Task(name=name, family="qa", domain="parity",
                queries=tuple(Query(f"q{i}", q) for i, q in enumerate(queries)), corpus=corpus,
                qrels={}, source=f"benchmark: {name}", fingerprint=h.hexdigest())


def token_parity(texts: Sequence[str], ours: LuceneEnglishAnalyzer,
                 lucene: lucene_peer.Analyzer, show: int = 5) -> tuple[int, list[str]]:
    """(texts with identical tokens, descriptions of the first ``show`` differences)."""
    same, diffs = 0, []
    mine = ours.analyze_many(texts)
    for text, got in zip(texts, mine):
        want = lucene.analyze(text)
        if got == want:
            same += 1
        elif len(diffs) < show:
            a, b = set(got) - set(want), set(want) - set(got)
            diffs.append(f"ours only {sorted(a)[:6]!r}, Lucene only {sorted(b)[:6]!r}")
    return same, diffs


def ranking_parity(task: Task, index_root: Path, work: Path, k: int = 10) -> dict[str, float]:
    """Our lucene-mode top ``k`` against Lucene's, per query; index and search times."""
    t0 = time.perf_counter()
    ret = BM25Retriever.for_task(task, mode="lucene", index_root=index_root, show_progress=False)
    ours_index_s = time.perf_counter() - t0
    requests = [SearchRequest(q.query_id, q.text) for q in task.queries]
    ours = ret.search(requests, k)
    lucene_peer.write_collection(work / "collection", task.doc_ids,
                                 [d.text for d in task.corpus])
    lucene_index_s = lucene_peer.build_index(work / "collection", work / "index", threads=1)
    exact = lucene_peer.ExactSearcher(work / "index")
    same_ids = same_scores = 0
    for r in requests:
        want = exact.search(r.query, k)
        got = list(ours[r.query_id].items())
        if [d for d, _ in got] == [d for d, _ in want]:
            same_ids += 1
            same_scores += [s for _, s in got] == [s for _, s in want]
    return {"queries": len(requests), "same_top": same_ids, "same_scores": same_scores,
            "ours_index_s": ours_index_s, "lucene_index_s": lucene_index_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=61_000, help="docstring passages in the corpus")
    ap.add_argument("--queries", type=int, default=200, help="queries of each kind per corpus")
    ap.add_argument("--seed", type=int, default=13)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    why = lucene_peer.unavailable()
    if why:
        print(f"lucene_parity: cannot run real Lucene: {why}", file=sys.stderr)
        return 2

    sentences, _, _ = sentence_pool(min(args.docs * 315 + 4 * args.queries * 350, 12_000_000))
    doc_passages = passages(sentences, args.docs, 150, 480, args.seed)
    long_q = passages(sentences, args.queries, 100, 600, args.seed + 1)
    short_q = passages(sentences, args.queries, 5, 15, args.seed + 3)
    pkg_docs, pkg_summaries = package_descriptions()

    ours, lucene = LuceneEnglishAnalyzer(), lucene_peer.Analyzer()
    print("tokens: identical token lists, r2med-agent analyzer vs pyserini's Lucene analyzer")
    for name, texts in (("docstring passages", doc_passages),
                        ("package descriptions", pkg_docs),
                        ("package summaries", pkg_summaries),
                        ("queries (long and short)", long_q + short_q)):
        same, diffs = token_parity(texts, ours, lucene)
        print(f"  {name:<26} {same:>6} of {len(texts):>6} ({same / len(texts):.2%})")
        for d in diffs:
            print(f"      {d}")

    root = Path(tempfile.mkdtemp(prefix="r2med-lucene-parity-"))
    try:
        print("rankings: same top 10 (ids and order) as Lucene, and bit-identical scores")
        for name, texts, queries in (
            ("docstrings", doc_passages, long_q + short_q),
            ("packages", pkg_docs, pkg_summaries + long_q[: len(pkg_summaries)]),
        ):
            res = ranking_parity(make_task(name, texts, queries), root / "ours", root / name)
            n = res["queries"]
            print(f"  {name:<12} {len(texts):>6} docs {n:>5} queries: same top 10 "
                  f"{res['same_top']} ({res['same_top'] / n:.2%}), same scores "
                  f"{res['same_scores']} ({res['same_scores'] / n:.2%}); index build "
                  f"r2med-agent {res['ours_index_s']:.1f}s, Anserini (1 thread) "
                  f"{res['lucene_index_s']:.1f}s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
