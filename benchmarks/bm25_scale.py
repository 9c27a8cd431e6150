"""BM25 across corpus sizes: ``bm25`` (lucene mode) beside real Lucene at 61k, 250k and 1M documents.

Run through ``benchmarks/bm25.py --docs 61000,250000,1000000`` (a comma list of sizes). For each size
the corpus and queries are built from text as ``bm25.py`` builds them (``write_task``: docstring
sentences cut into 150-480-word passages; 100 queries of 100-600 words, and the same queries cut to
their first 8 words), then each step runs in a process of its own, so that its peak resident memory
(``VmHWM`` of the process itself: ``ru_maxrss`` would keep the forking parent's) is its own:

* ``ours-index``: the first run, ``load_task`` (parsing and validating the files, cold task cache)
  and ``BM25Retriever.for_task`` (analysis, indexing, saving);
* ``ours-search``: the re-run, ``load_task`` (task cache) and ``for_task`` (loading the saved index),
  then the long queries and the 8-word queries searched to depth 100, each timed after 5 warm-up
  queries (the first search of a process loads the compiled kernel; the re-run counts it);
* ``lucene-index``: Anserini's ``IndexCollection`` with one thread in a child JVM (its peak is the
  JVM's, read while it runs), the same documents as a ``JsonCollection``;
* ``lucene-search``: pyserini's ``batch_search`` with one thread (the JVM runs in that process), the
  same long and 8-word queries, after 5 warm-up queries.

The table gives, per size: indexing seconds, search queries/s in wall-clock and CPU seconds (the
machine may be shared: read the ratios and the CPU column), peak RSS of indexing and of searching,
the index on disk, the re-run end to end, and how many queries have the same top 10, in the same
order, as Lucene (and the same top 100: pyserini rounds its scores to 4 decimals and orders
exact ties by id ascending, as ``bm25`` does, so only near-ties it rounds together can differ).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_TOP = 100


def _du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _short(text: str) -> str:
    return " ".join(text.split()[:8])


def _timed(fn):  # noqa: ANN001, ANN202
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def stage(name: str, data: Path, work: Path, k1: float, b: float) -> dict:
    """One step, in this process; its numbers as a dict."""
    from bm25 import _TASK  # noqa: PLC0415  (benchmarks/bm25.py)

    from lucene_peer import peak_rss_mb  # noqa: PLC0415

    from r2med_agent.data import load_task
    from r2med_agent.types import SearchRequest

    if name in ("ours-index", "ours-search"):
        from r2med_agent.retrieval.bm25.retriever import BM25Retriever

        task, load_w, _ = _timed(lambda: load_task(_TASK, data, allow_count_mismatch=True))
        ret, ret_w, ret_c = _timed(lambda: BM25Retriever.for_task(
            task, k1=k1, b=b, index_root=work / "ours", show_progress=False))
        out = {"load_s": load_w, "retriever_s": ret_w, "retriever_cpu": ret_c,
               "built": ret.built_index}
        if name == "ours-index":
            out["rss_mb"] = peak_rss_mb()
            out["disk"] = _du(ret.index_dir)
            return out
        runs = {}
        for kind in ("long", "short"):
            reqs = [SearchRequest(q.query_id, q.text if kind == "long" else _short(q.text))
                    for q in task.queries]
            # 5 warm-up queries, as Lucene gets (the first loads the compiled kernel: in the re-run)
            _, out[f"{kind}_warm_s"], _ = _timed(lambda: ret.search(reqs[:5], _TOP))
            runs[kind], out[f"{kind}_s"], out[f"{kind}_cpu"] = _timed(lambda: ret.search(reqs, _TOP))
        out["n"] = len(task.queries)
        out["rss_mb"] = peak_rss_mb()
        out["runs"] = {kind: {q: list(r) for q, r in run.items()} for kind, run in runs.items()}
        return out

    import lucene_peer  # noqa: PLC0415  (benchmarks/lucene_peer.py)

    task = load_task(_TASK, data, allow_count_mismatch=True)
    if name == "lucene-index":
        lucene_peer.write_collection(work / "collection", task.doc_ids, [d.text for d in task.corpus])
        del task
        peak: list[float] = []
        seconds = lucene_peer.build_index(work / "collection", work / "lucene", threads=1, peak=peak)
        return {"index_s": seconds, "rss_mb": peak[0], "disk": _du(work / "lucene")}
    qids = [q.query_id for q in task.queries]
    texts = {"long": [q.text for q in task.queries], "short": [_short(q.text) for q in task.queries]}
    del task
    searcher = lucene_peer.Searcher(work / "lucene", k1, b)
    out: dict = {"runs": {}}
    for kind, qs in texts.items():
        searcher.batch_search(qs[:5], qids[:5], _TOP)
        run, out[f"{kind}_s"], out[f"{kind}_cpu"] = _timed(
            lambda: searcher.batch_search(qs, qids, _TOP, threads=1))
        out["runs"][kind] = {q: [d for d, _ in hits] for q, hits in run.items()}
    out["rss_mb"] = peak_rss_mb()
    return out


def _run_stage(name: str, data: Path, work: Path, k1: float, b: float) -> dict:
    cmd = [sys.executable, str(Path(__file__)), "--stage", name, "--data", str(data),
           "--work", str(work), "--k1", str(k1), "--b", str(b)]
    w, c = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"stage {name} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - w
    out["process_cpu"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - c
    return out


def scale(sizes: list[int], n_queries: int, seed: int, k1: float, b: float,
          with_lucene: bool = True) -> int:
    """Every step at every size, then one table."""
    from bm25 import write_task  # noqa: PLC0415

    import lucene_peer  # noqa: PLC0415

    why = lucene_peer.unavailable() if with_lucene else "not asked for"
    rows = []
    for n_docs in sizes:
        with tempfile.TemporaryDirectory(prefix=f"r2med-bm25-scale-{n_docs}-") as tmp:
            root = Path(tmp)
            os.environ["R2MED_CACHE_DIR"] = str(root / "cache")
            write_task(root / "data", n_docs, n_queries, seed)
            r = {"docs": n_docs}
            for name in ("ours-index", "ours-search") + (() if why else ("lucene-index", "lucene-search")):
                r[name] = _run_stage(name, root / "data", root / "work", k1, b)
                print(f"  {n_docs:,} docs: {name} done in {r[name]['process_s']:.0f}s", file=sys.stderr)
            rows.append(r)
    _print_table(rows, why)
    return 0


def _print_table(rows: list[dict], why: str | None) -> None:
    def fmt(x: float | None, spec: str = ".1f") -> str:
        return "-" if x is None else format(x, spec)

    print("| docs | system | index s | long q/s wall (cpu) | 8-word q/s wall (cpu) | peak RSS index / search MB | index on disk MB | re-run s | same top 10 (top 100) as Lucene |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        oi, os_ = r["ours-index"], r["ours-search"]
        n = os_["n"]
        rerun = os_["load_s"] + os_["retriever_s"] + os_["long_warm_s"] + os_["long_s"]
        first = oi["load_s"] + oi["retriever_s"] + os_["long_s"]
        same = {}
        li, ls = r.get("lucene-index"), r.get("lucene-search")
        if ls:
            for kind in ("long", "short"):
                ours_, theirs = os_["runs"][kind], ls["runs"][kind]
                same[kind] = (sum(ours_[q][:10] == theirs[q][:10] for q in theirs),
                              sum(ours_[q] == theirs[q] for q in theirs))
        print(f"| {r['docs']:,} | r2med-agent bm25 | {oi['retriever_s']:.1f} | "
              f"{n / os_['long_s']:.1f} ({n / os_['long_cpu']:.1f}) | "
              f"{n / os_['short_s']:.0f} ({n / os_['short_cpu']:.0f}) | "
              f"{oi['rss_mb']:.0f} / {os_['rss_mb']:.0f} | {oi['disk'] / 1e6:.0f} | "
              f"{rerun:.2f} (first {first:.1f}: {first / rerun:.0f}x) | "
              + (f"{same['long'][0]}/{n} long ({same['long'][1]} to 100), {same['short'][0]}/{n} "
                 f"8-word ({same['short'][1]} to 100) |" if same else "- |"))
        if ls:
            print(f"| {r['docs']:,} | pyserini (Lucene 9.9.1, 1 thread) | {li['index_s']:.1f} | "
                  f"{n / ls['long_s']:.1f} ({n / ls['long_cpu']:.1f}) | "
                  f"{n / ls['short_s']:.0f} ({n / ls['short_cpu']:.0f}) | "
                  f"{li['rss_mb']:.0f} / {ls['rss_mb']:.0f} | {li['disk'] / 1e6:.0f} | - | - |")
            print(f"| {r['docs']:,} | ratio | {li['index_s'] / oi['retriever_s']:.1f}x | "
                  f"{ls['long_s'] / os_['long_s']:.1f}x ({ls['long_cpu'] / os_['long_cpu']:.1f}x) | "
                  f"{ls['short_s'] / os_['short_s']:.1f}x ({ls['short_cpu'] / os_['short_cpu']:.1f}x) | "
                  f"{oi['rss_mb'] / li['rss_mb']:.2f} / {os_['rss_mb'] / ls['rss_mb']:.2f} | "
                  f"{oi['disk'] / li['disk']:.2f} | - | - |")
    if why:
        print(f"pyserini peer skipped: {why}")
    from r2med_agent.retrieval.bm25 import pruning

    print(f"bm25 search kernel: {'compiled (numba)' if pruning.COMPILED else 'exhaustive numpy (numba not installed)'}; "
          "ratio rows: Lucene's time over ours (above 1: ours faster), ours over Lucene's for memory and disk")


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--k1", type=float, default=0.9)
    ap.add_argument("--b", type=float, default=0.4)
    args = ap.parse_args()
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    sys.path.insert(0, str(_HERE))
    print(json.dumps(stage(args.stage, args.data, args.work, args.k1, args.b)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
