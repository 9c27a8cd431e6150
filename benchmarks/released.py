"""A paper row from R2MED's released generations, end to end, at R2MED's scale: HyDE with BM25.

``run --generations r2med`` scores the LLM outputs R2MED released instead of generating them, so a
BM25 HyDE row needs no GPU and no model. This times that row over the 8 tasks as the runner runs it
(``run_experiment``: load and validate each task, read and parse its released file, index with
``bm25-compat``, search with the 876 passages, score with pytrec_eval, write the files), cold and
again with the saved indexes and the task cache.

The data cannot be downloaded here, so each task is written in R2MED's layout at its registry size
(``configs/tasks.yaml``: docs and queries) from real English text every Python install has (see
``realtext.py``): documents of 150-480 words, queries of 100-600, and one released ``hy_doc`` per
query of 150-350 words (HyDE passages run to a few hundred words), in
``<Task>/hyde/qwen-7b/query_with_hydoc.jsonl``.

The peer, measured in the same run on the largest task: R2MED's own BM25 evaluation
(``eval_bench_BM25.py``: gensim ``LuceneBM25Model(k1=0.9, b=0.4)`` + ``SparseMatrixSimilarity``,
every document scored per query, top 100 by a Python sort) over the same analyzed text, index and
search, beside this runner's index and search times for that task.

Usage: ``python benchmarks/released.py [--scale 1.0] [--seed 13]`` (``--scale 0.1``: a tenth of
each corpus, for a quick look).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from realtext import passages, sentence_pool, write_jsonl  # benchmarks/realtext.py  # noqa: E402

from r2med_agent.data import get_task_spec, task_names  # noqa: E402


def write_tasks(data_dir: Path, scale: float, seed: int) -> dict[str, tuple[int, int]]:
    """Every R2MED task at its registry size (times ``scale`` for the corpus), with a released
    HyDE file; returns task -> (docs, queries)."""
    sizes = {t: (max(100, int(get_task_spec(t).docs * scale)), get_task_spec(t).queries) for t in task_names("all")}
    need = sum(d * 315 + q * 600 for d, q in sizes.values())
    sentences, _, _ = sentence_pool(min(need, 40_000_000))
    for i, (task, (n_docs, n_queries)) in enumerate(sizes.items()):
        folder = data_dir / task
        (folder / "hyde" / "qwen-7b").mkdir(parents=True)
        docs = passages(sentences, n_docs, 150, 480, seed + 10 * i)
        queries = passages(sentences, n_queries, 100, 600, seed + 10 * i + 1)
        hydocs = passages(sentences, n_queries, 150, 350, seed + 10 * i + 2)

        write_jsonl(folder / "corpus.jsonl", [{"id": f"d{j}", "text": t} for j, t in enumerate(docs)])
        write_jsonl(folder / "query.jsonl", [{"id": f"q{j}", "text": t} for j, t in enumerate(queries)])
        write_jsonl(folder / "qrels.jsonl", [{"q_id": f"q{j}", "p_id": f"d{(j * 7919) % n_docs}", "score": 1}
                                                  for j in range(n_queries)])
        write_jsonl(folder / "hyde/qwen-7b/query_with_hydoc.jsonl",
                    [{"id": f"q{j}", "text": q, "hy_doc": h, "doc_id": []}
                     for j, (q, h) in enumerate(zip(queries, hydocs))])
    return sizes


def reference_bm25(data_dir: Path, task: str) -> tuple[float, float, int]:
    """R2MED's BM25 evaluation on one task's released passages: (index s, search s, queries)."""
    from gensim.corpora import Dictionary
    from gensim.models import LuceneBM25Model
    from gensim.similarities import SparseMatrixSimilarity

    from r2med_agent.data import load_task
    from r2med_agent.data.released import read_rows
    from r2med_agent.retrieval.bm25.analysis import LuceneEnglishAnalyzer

    loaded = load_task(task, data_dir)
    rows = read_rows(data_dir / task / "hyde" / "qwen-7b" / "query_with_hydoc.jsonl")
    analyzer = LuceneEnglishAnalyzer()
    doc_ids = [d.doc_id for d in loaded.corpus]
    t0 = time.perf_counter()
    terms = analyzer.analyze_many([d.text for d in loaded.corpus])
    dictionary = Dictionary(terms)
    model = LuceneBM25Model(dictionary=dictionary, k1=0.9, b=0.4)
    index = SparseMatrixSimilarity(model[list(map(dictionary.doc2bow, terms))], num_docs=len(terms),
                                   num_terms=len(dictionary), normalize_queries=False, normalize_documents=False)
    t1 = time.perf_counter()
    for q in loaded.queries:
        sims = index[model[dictionary.doc2bow(analyzer.analyze(rows[q.query_id]))]].tolist()
        sorted(zip(doc_ids, sims), key=lambda x: x[1], reverse=True)[:100]
    return t1 - t0, time.perf_counter() - t1, len(loaded.queries)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each task's corpus size")
    ap.add_argument("--seed", type=int, default=13)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="r2med-released-bench-"))
    os.environ["R2MED_CACHE_DIR"] = str(root / "cache")
    try:
        return _run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(args: argparse.Namespace, root: Path) -> int:
    from r2med_agent.api import RunConfig, run_experiment

    data_dir = root / "data"
    t0 = time.perf_counter()
    sizes = write_tasks(data_dir, args.scale, args.seed)
    print(f"wrote 8 tasks, {sum(d for d, _ in sizes.values()):,} docs, {sum(q for _, q in sizes.values())} "
          f"queries in {time.perf_counter() - t0:.1f} s")
    cfg = RunConfig(tasks=tuple(sizes), method="hyde", llm="qwen-7b", generations="r2med",
                    retriever="bm25-compat", data_dir=data_dir, output_dir=root / "results", show_progress=False)
    timings = []
    for label in ("cold (parse, index, search, score, write)", "again (task cache, saved indexes)"):
        t0 = time.perf_counter()
        result = run_experiment(cfg)
        timings.append((label, time.perf_counter() - t0, result))
    made = sum(o.stats["generations"] for o in result.outcomes)
    released = sum(o.stats["released_generations"] for o in result.outcomes)
    print(f"\nHyDE / qwen-7b@r2med / bm25-compat over 8 tasks: {made} generations made, {released} released texts")
    for label, seconds, _ in timings:
        print(f"  {label:<45} {seconds:7.1f} s")
    largest = max(sizes, key=lambda t: sizes[t][0])
    cold = next(o for o in timings[0][2].outcomes if o.task == largest)
    ref_index, ref_search, n = reference_bm25(data_dir, largest)
    print(f"\n{largest} ({sizes[largest][0]:,} docs, {n} released passages as queries):")
    print(f"  {'':<45} {'index s':>8} {'search s':>9} {'queries/s':>10}")
    ours = cold.stats
    print(f"  {'r2med-agent bm25-compat (runner, cold)':<45} {ours['index_time_s']:8.1f} {ours['retrieval_time_s']:9.2f} "
          f"{n / ours['retrieval_time_s']:10.1f}")
    print(f"  {'R2MED eval_bench_BM25 way (gensim)':<45} {ref_index:8.1f} {ref_search:9.2f} {n / ref_search:10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
