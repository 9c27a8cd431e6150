"""BM25 speed at the scale of R2MED's largest task, beside the reference approach and rank_bm25.

R2MED's largest corpus (MedXpertQA-Exam) has 61,379 documents; its queries are clinical vignettes
of a few hundred words. The benchmark cannot download it here, so it builds a corpus of the same shape
from real English text that is on every machine with Python: the docstrings of the standard library
and of the installed packages. Docstrings are split into sentences; each document is a run of
consecutive sentences starting at a random place (seeded), cut to a length drawn uniformly from
150-480 words; each query is built the same way (100-600 words) from a different seed, so a query
shares a passage with some documents, as an R2MED query shares facts with its positives.

Compared, in the same run and with the same analyzer (so the numbers measure indexing and search,
not Java vs Python tokenisation; every search time includes analyzing its queries):

* r2med-agent ``BM25Retriever`` in ``lucene`` mode and ``r2med-compat`` mode, on one core (BLAS
  limited to one thread);
* real Lucene when pyserini and Java 21+ are installed (``benchmarks/lucene_peer.py``): Anserini's
  ``IndexCollection`` with one thread and ``LuceneSearcher.batch_search`` with one thread, with the
  ratios of the targets (indexing at least as fast, search at least 10x, a re-run at least 50x
  faster than the first run);
* the reference approach of R2MED's ``eval_bench_BM25.py``: gensim ``Dictionary`` +
  ``LuceneBM25Model(k1=0.9, b=0.4)`` + ``SparseMatrixSimilarity``, every document scored for each
  query, then the top 100 kept by sorting all scores in Python;
* ``rank_bm25.BM25Okapi.get_scores`` per query, top 100 by argsort.

The reference is timed on all queries (``--ref-queries`` fewer); rank_bm25, the slowest, on
``--subset`` queries, its rate standing for all (the table says which). Throughput is given in
wall-clock and in CPU seconds of this process (steadier when the machine is shared).

End to end, per mode: the task is written to a temporary folder in R2MED's layout
(``corpus.jsonl``, ``query.jsonl``, ``qrels.jsonl``; the qrels name one random document per query,
since the layout needs them and nothing here is scored) and a run is timed as the runner does it:
``load_task`` + ``BM25Retriever.for_task`` + one batched search. The first run starts cold: it parses
and validates the task files (and stores the task in the task cache) and indexes (analysis,
indexing, saving). The re-run finds both: ``load_task`` hashes the files and takes the validated task
from the task cache without parsing the corpus, and the retriever loads the saved index; the
breakdown is printed. Every cache lives in a temporary folder (``R2MED_CACHE_DIR``), removed at
the end.

Usage: ``python benchmarks/bm25.py [--docs 61000] [--queries 100] [--subset 10] [--seed 13]``;
``--docs 61000,250000,1000000`` prints one table across the sizes instead (``bm25`` beside Lucene,
each step in its own process with its peak memory: ``benchmarks/bm25_scale.py``);
``taskset -c 0 python benchmarks/bm25.py`` holds every system to one core (unpinned, the JVM's
garbage collector and compiler threads give pyserini a second core).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# One core for every system compared: BLAS (numpy's matrix products) gets one thread, as
# pyserini's searcher and Anserini's indexer do (set before numpy is imported).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from r2med_agent.data import load_task  # noqa: E402
from r2med_agent.retrieval.bm25.analysis import LuceneEnglishAnalyzer  # noqa: E402
from r2med_agent.retrieval.bm25.retriever import BM25Retriever  # noqa: E402
from r2med_agent.types import Run, SearchRequest, Task  # noqa: E402

from realtext import passages, sentence_pool, write_jsonl  # noqa: E402  (benchmarks/realtext.py)

_TOP = 100
_TASK = "MedXpertQA-Exam"  # the registry task whose scale the corpus copies (a synthetic stand-in:
# loaded with allow_count_mismatch, its counts are the benchmark's own)


def write_task(data_dir: Path, n_docs: int, n_queries: int, seed: int) -> tuple[int, int, int]:
    """Write the benchmark task in R2MED layout under ``data_dir/<_TASK>/``.

    Returns the number of .py files read, the words in the sentence pool and the corpus bytes.
    """
    need = n_docs * 315 + n_queries * 350
    sentences, counts, files = sentence_pool(min(need, 12_000_000))
    docs = passages(sentences, n_docs, 150, 480, seed)
    queries = passages(sentences, n_queries, 100, 600, seed + 1)
    folder = data_dir / _TASK
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed + 2)

    write_jsonl(folder / "corpus.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(docs)])
    write_jsonl(folder / "query.jsonl", [{"id": f"q{i}", "text": t} for i, t in enumerate(queries)])
    write_jsonl(folder / "qrels.jsonl", [{"q_id": f"q{i}", "p_id": f"d{j}", "score": 1}
                                              for i, j in enumerate(rng.integers(0, n_docs, size=n_queries).tolist())])
    return files, int(counts.sum()), (folder / "corpus.jsonl").stat().st_size


def end_to_end(data_dir: Path, mode: str, k1: float, b: float, index_root: Path
               ) -> tuple[Task, BM25Retriever, Run, dict[str, Timer]]:
    """One run as the runner does it: load the task, get the retriever, search all queries."""
    times: dict = {"load": Timer(), "retriever": Timer(), "search": Timer()}
    with times["load"]:
        task = load_task(_TASK, data_dir, allow_count_mismatch=True)
    with times["retriever"]:
        ret = BM25Retriever.for_task(task, mode=mode, k1=k1, b=b, index_root=index_root,
                                     show_progress=False)
    with times["search"]:
        run = ret.search([SearchRequest(q.query_id, q.text) for q in task.queries], _TOP)
    times["index_root"] = index_root  # (not a timer: where the index is, for the peers)
    return task, ret, run, times


class Timer:
    """Wall-clock and CPU seconds of a block (CPU time is steadier on a shared machine)."""

    def __enter__(self) -> Timer:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0


def _pyserini_peer(task: Task, requests: list[SearchRequest], ours: Run,
                   first: dict[str, Timer], k1: float, b: float, work: Path
                   ) -> tuple[list[tuple], list[str]]:
    """Real Lucene beside ``bm25``: Anserini's IndexCollection with one thread, and pyserini's
    ``batch_search`` with one thread, on the same documents and queries (when installed)."""
    import lucene_peer  # benchmarks/lucene_peer.py

    why = lucene_peer.unavailable()
    if why:
        return [], [f"pyserini peer skipped: {why}"]
    lucene_peer.write_collection(work / "collection", task.doc_ids, [d.text for d in task.corpus])
    index_s = lucene_peer.build_index(work / "collection", work / "index", threads=1)
    searcher = lucene_peer.Searcher(work / "index", k1, b)
    short = [SearchRequest(r.query_id, " ".join(r.query.split()[:8])) for r in requests]
    out = {}
    for name, reqs in (("long", requests), ("short", short)):
        searcher.batch_search([r.query for r in reqs[:5]], [r.query_id for r in reqs[:5]], _TOP)
        with Timer() as t:
            out[name] = searcher.batch_search([r.query for r in reqs],
                                              [r.query_id for r in reqs], _TOP, threads=1)
        out[name + "_t"] = t
    same = sum([d for d, _ in out["long"][r.query_id][:10]] == list(ours[r.query_id])[:10]
               for r in requests)
    n = len(requests)
    rows = [("pyserini LuceneSearcher.batch_search (Lucene 9.9.1, 1 thread)", index_s,
             n / out["long_t"].wall, n / out["long_t"].cpu, f"all {n}")]
    # ours on the short queries, to print the short-query ratio beside pyserini's
    ret = BM25Retriever.for_task(task, mode="lucene", k1=k1, b=b,
                                 index_root=first["index_root"], show_progress=False)
    ret.search(short[:5], _TOP)
    with Timer() as ts:
        ret.search(short, _TOP)
    notes = [
        f"bm25 vs pyserini: indexing {index_s / first['retriever'].wall:.1f}x as fast "
        f"({first['retriever'].wall:.1f}s vs Anserini IndexCollection 1 thread {index_s:.1f}s, "
        f"JVM start included; target >= 1x); search {out['long_t'].wall / first['search'].wall:.0f}x "
        f"(cpu: {out['long_t'].cpu / first['search'].cpu:.0f}x) on the R2MED-length queries "
        f"(target >= 10x), "
        f"{out['short_t'].wall / ts.wall:.0f}x on 8-word queries; same top 10 in the same order as "
        f"pyserini on {same} of {n} queries",
    ]
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", default="61000",
                    help="corpus size (R2MED max: 61,379); a comma list (61000,250000,1000000) "
                    "prints one table across the sizes, bm25 beside Lucene (benchmarks/bm25_scale.py)")
    ap.add_argument("--no-lucene", action="store_true", help="with a list of sizes: bm25 alone")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--ref-queries", type=int, default=None,
                    help="queries timed for the gensim reference (default: all)")
    ap.add_argument("--subset", type=int, default=10, help="queries timed for rank_bm25")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--k1", type=float, default=0.9)
    ap.add_argument("--b", type=float, default=0.4)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sizes = [int(x) for x in str(args.docs).split(",")]
    if len(sizes) > 1:
        import bm25_scale  # benchmarks/bm25_scale.py

        return bm25_scale.scale(sizes, args.queries, args.seed, args.k1, args.b,
                                with_lucene=not args.no_lucene)
    args.docs = sizes[0]

    root = Path(tempfile.mkdtemp(prefix="r2med-bm25-bench-"))
    data_dir, index_root = root / "data", root / "indexes"
    os.environ["R2MED_CACHE_DIR"] = str(root / "cache")  # the task cache, cold at each first run
    try:
        return _run(args, data_dir, index_root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(args: argparse.Namespace, data_dir: Path, index_root: Path) -> int:
    k1, b = args.k1, args.b
    with Timer() as t:
        files, pool_words, corpus_bytes = write_task(data_dir, args.docs, args.queries, args.seed)
        task = load_task(_TASK, data_dir, allow_count_mismatch=True)
    doc_words = np.array([len(d.text.split()) for d in task.corpus])
    q_words = np.array([len(q.text.split()) for q in task.queries])
    print(f"corpus: {len(task.corpus):,} docs of {doc_words.min()}-{doc_words.max()} words (mean "
          f"{doc_words.mean():.0f}), {len(task.queries)} queries of {q_words.min()}-{q_words.max()} "
          f"words (mean {q_words.mean():.0f})")
    print(f"text: docstring sentences from {files:,} .py files of the standard library and "
          f"site-packages ({pool_words:,} words), cut into passages with seed {args.seed}, "
          f"written in R2MED layout ({corpus_bytes / 1e6:.0f} MB corpus.jsonl) [{t.wall:.0f}s]")
    del task  # each end-to-end run below loads the task itself
    # name, index build s (None: not built), q/s wall, q/s cpu, queries timed
    rows: list[tuple[str, float | None, float, float, str]] = []
    notes: list[str] = []
    runs = {}
    for mode in ("lucene", "r2med-compat"):
        shutil.rmtree(Path(os.environ["R2MED_CACHE_DIR"]) / "tasks", ignore_errors=True)
        task, ret, runs[mode], first = end_to_end(data_dir, mode, k1, b, index_root)
        del task
        task, again, rerun, second = end_to_end(data_dir, mode, k1, b, index_root)
        if not ret.built_index or again.built_index or rerun != runs[mode]:
            raise RuntimeError(f"{mode}: the second run did not reuse the saved index intact")
        if getattr(task.corpus, "loaded", True):
            raise RuntimeError(f"{mode}: the second run parsed the corpus (task cache not used)")
        del task
        task = load_task(_TASK, data_dir, allow_count_mismatch=True)
        requests = [SearchRequest(q.query_id, q.text) for q in task.queries]
        n = len(requests)
        rows.append((f"r2med-agent {ret.name} ({mode}, 1 thread)", first["retriever"].wall,
                     n / first["search"].wall, n / first["search"].cpu, f"all {n}"))
        if mode == "lucene":
            lucene_rows, lucene_notes = _pyserini_peer(task, requests, runs[mode], first, k1, b,
                                                       index_root.parent / "pyserini")
            rows.extend(lucene_rows)
            notes.extend(lucene_notes)
        timers = ("load", "retriever", "search")
        fresh = sum(first[t].wall for t in timers)
        again_s = sum(second[t].wall for t in timers)
        fresh_cpu = sum(first[t].cpu for t in timers)
        again_cpu = sum(second[t].cpu for t in timers)
        no_load = (fresh - first["load"].wall) / (again_s - second["load"].wall)
        notes.append(
            f"{ret.name}: re-run on the saved index, end to end {again_s:.2f}s (load_task "
            f"{second['load'].wall:.2f}s from the task cache: files hashed, corpus not parsed; index load "
            f"{second['retriever'].wall:.2f}s; search {second['search'].wall:.2f}s) vs first run "
            f"{fresh:.1f}s (load_task {first['load'].wall:.2f}s parsing and validating; analysis + indexing + saving "
            f"{first['retriever'].wall:.1f}s; search {first['search'].wall:.2f}s): "
            f"{fresh / again_s:.0f}x faster (cpu: {fresh_cpu / again_cpu:.0f}x) (target >= 50x); "
            f"leaving out load_task, which both runs need: {no_load:.0f}x"
        )

    n_ref = min(args.ref_queries or len(requests), len(requests))
    n_sub = min(args.subset, len(requests))
    # the same analyzed text for the peers
    analyzer = LuceneEnglishAnalyzer()
    with Timer() as ta:
        doc_terms = analyzer.analyze_many([d.text for d in task.corpus])
    doc_ids = [d.doc_id for d in task.corpus]

    # R2MED's eval_bench_BM25.retrieval_bm25 (minus pyserini's Java analyzer)
    from gensim.corpora import Dictionary
    from gensim.models import LuceneBM25Model
    from gensim.similarities import SparseMatrixSimilarity

    with Timer() as tb:
        dictionary = Dictionary(doc_terms)
        model = LuceneBM25Model(dictionary=dictionary, k1=k1, b=b)
        bm25_corpus = model[list(map(dictionary.doc2bow, doc_terms))]
        index = SparseMatrixSimilarity(bm25_corpus, num_docs=len(doc_terms),
                                       num_terms=len(dictionary), normalize_queries=False,
                                       normalize_documents=False)
    reference = {}
    with Timer() as ts:  # R2MED's loop: analyze, transform, score every document, sort
        for req in requests[:n_ref]:
            terms = analyzer.analyze(req.query)
            sims = index[model[dictionary.doc2bow(terms)]].tolist()
            ranked = sorted(zip(doc_ids, sims), key=lambda x: x[1], reverse=True)[:_TOP]
            reference[req.query_id] = dict(ranked)
    on = f"all {n_ref}" if n_ref == len(requests) else f"{n_ref} of {len(requests)}, extrapolated"
    rows.append(("reference: gensim LuceneBM25Model + SparseMatrixSimilarity",
                 ta.wall + tb.wall, n_ref / ts.wall, n_ref / ts.cpu, on))
    ref_qps = (n_ref / ts.wall, n_ref / ts.cpu)
    del index, bm25_corpus

    from rank_bm25 import BM25Okapi

    with Timer() as tb:
        okapi = BM25Okapi(doc_terms, k1=k1, b=b)
    with Timer() as ts:
        for req in requests[:n_sub]:
            np.argsort(-okapi.get_scores(analyzer.analyze(req.query)))[:_TOP]
    rows.append(("rank_bm25 BM25Okapi.get_scores", ta.wall + tb.wall, n_sub / ts.wall,
                 n_sub / ts.cpu, f"{n_sub} of {len(requests)}, extrapolated"))

    same10 = sum(list(runs["r2med-compat"][q])[:10] == list(reference[q])[:10]
                 for q in reference)
    overlap = np.mean([len(set(runs["lucene"][q]) & set(reference[q])) / _TOP
                       for q in reference])

    print()
    print(f"{'system':<60} {'index s':>8} {'q/s wall':>9} {'q/s cpu':>8}  queries timed")
    for name, build, qps, cps, on in rows:
        built = "-" if build is None else f"{build:.1f}"
        print(f"{name:<60} {built:>8} {qps:>9.2f} {cps:>8.2f}  {on}")
    print()
    for name, _, qps, cps, _ in [r for r in rows if r[0].startswith("r2med-agent")]:
        print(f"{name}: search {qps / ref_qps[0]:.0f}x the reference (wall), "
              f"{cps / ref_qps[1]:.0f}x (cpu); target >= 20x")
    for note in notes:
        print(note)
    print(f"bm25-compat top-10 identical (same order) to the reference on {same10} of "
          f"{len(reference)} queries; bm25 (lucene) shares {overlap:.0%} of the reference's top 100")
    print(f"peers' index times include one shared analyzer pass ({ta.wall:.1f}s, the same "
          "analyzer as r2med-agent); r2med-agent's include its analysis and writing the index")
    return 0


if __name__ == "__main__":
    sys.exit(main())
