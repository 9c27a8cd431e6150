"""Agentic loop: the batched engine against a one-trajectory-at-a-time loop.

Runs Search-R1 (or Search-o1) for every query of a small inline medical corpus on the local GGUF
engine (SmolLM2-135M on llama.cpp, registry entry ``smollm2``) with the real BM25 retriever, twice:

* batched: ONE loop over all queries (each step: one ``llm.generate`` call over every unfinished
  trajectory, one ``retriever.search`` call for all of the step's searches);
* sequential: the same loop run for one query at a time (what a per-item agent loop does).

It prints wall time, trajectories per second, ``llm.generate`` calls, backend calls, calls per
step and retriever calls for each, and checks that both produce the same trajectories (greedy
decoding, no cache). llama.cpp in-process serves the prompts of a batch one after another, so on
this engine batching saves per-call overhead, not model time; on vLLM or an HTTP server the batch
is decoded concurrently, which is where the large gain is.

Usage::

    python benchmarks/agentic.py [--method search-r1|search-o1] [--queries 6] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import time
from collections.abc import Sequence

from r2med_agent.llm import make_llm
from r2med_agent.methods import METHODS
from r2med_agent.retrieval.bm25 import BM25Retriever
from r2med_agent.types import Doc, Query, Run, SearchRequest, Task

DOCS = [
    "Iron deficiency anemia is treated with oral ferrous sulfate; intravenous iron is used when oral iron fails.",
    "Fever is a raised body temperature caused by pyrogens that reset the hypothalamic set point.",
    "Acute appendicitis presents with periumbilical pain migrating to the right lower quadrant, fever and nausea.",
    "Type 2 diabetes is first treated with lifestyle change and metformin.",
    "Hypertension in adults is treated first with thiazide diuretics, ACE inhibitors, ARBs or calcium channel blockers.",
    "Community-acquired pneumonia causes fever, cough and consolidation on chest radiograph; amoxicillin treats mild cases.",
    "Bacterial meningitis presents with fever, neck stiffness and altered mental status; treat with ceftriaxone and vancomycin.",
    "Hypothyroidism causes fatigue, weight gain and cold intolerance; levothyroxine replaces thyroid hormone.",
    "Asthma causes reversible airway obstruction; inhaled corticosteroids control symptoms and beta agonists relieve them.",
    "Myocardial infarction presents with crushing chest pain; aspirin and urgent reperfusion are the first steps.",
    "Vitamin B12 deficiency causes macrocytic anemia and neuropathy; it is treated with cobalamin injections.",
    "Gout is caused by urate crystals in joints; colchicine or NSAIDs treat acute attacks and allopurinol prevents them.",
    "Migraine headaches are throbbing and unilateral with photophobia; triptans abort attacks.",
    "Urinary tract infections cause dysuria and frequency; nitrofurantoin treats uncomplicated cystitis.",
    "Deep vein thrombosis causes a swollen painful leg and is treated with anticoagulants such as apixaban.",
    "Celiac disease is an immune reaction to gluten causing diarrhea and iron deficiency; a gluten-free diet treats it.",
    "Sickle cell disease causes painful vaso-occlusive crises; hydroxyurea reduces their frequency.",
    "Hemoglobin carries oxygen in red blood cells; its synthesis needs iron, which is why iron deficiency causes anemia.",
    "Insulin lowers blood glucose by promoting uptake into muscle and fat cells.",
    "The hypothalamus regulates body temperature, hunger and the release of pituitary hormones.",
    "Sepsis is a dysregulated response to infection; early antibiotics and fluids reduce mortality.",
    "Peptic ulcers are often caused by Helicobacter pylori and treated with a proton pump inhibitor and antibiotics.",
    "Parkinson disease causes tremor, rigidity and bradykinesia; levodopa is the most effective treatment.",
    "Kidney stones cause colicky flank pain radiating to the groin; most pass with fluids and analgesia.",
]
QUERIES = [
    "Why does iron deficiency cause anemia and how is it treated?",
    "What causes a fever during an infection?",
    "Which drug is first-line for type 2 diabetes?",
    "How is bacterial meningitis treated?",
    "What prevents recurrent gout attacks?",
    "What is the first treatment for a heart attack?",
    "What treats an uncomplicated urinary tract infection?",
    "How is deep vein thrombosis treated?",
]


def make_task(n_queries: int) -> Task:
    corpus = tuple(Doc(f"doc{i}", text) for i, text in enumerate(DOCS))
    queries = tuple(Query(f"q{i}", text) for i, text in enumerate(QUERIES[:n_queries]))
    fp = hashlib.sha256("\n".join(DOCS).encode()).hexdigest()[:16]
    return Task(name="bench", family="exam", domain="medicine", queries=queries, corpus=corpus,
                qrels={}, source="inline benchmark corpus", fingerprint=fp)


class CountingRetriever:
    """The real BM25 retriever, counting search calls and requests."""

    def __init__(self, inner: BM25Retriever) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls = 0
        self.requests = 0

    def search(self, requests: Sequence[SearchRequest], k: int) -> Run:
        self.calls += 1
        self.requests += len(requests)
        return self.inner.search(requests, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="search-r1", choices=["search-r1", "search-o1"])
    ap.add_argument("--queries", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--llm", default="smollm2")
    args = ap.parse_args()

    task = make_task(args.queries)
    bm25 = BM25Retriever.for_task(task, show_progress=False)
    # Greedy decoding so both ways must produce the same trajectories; no cache, so every
    # generation is made; all of a step's prompts in one backend call.
    sampling = {"max_tokens": args.max_tokens, "temperature": 0.0}
    llm = make_llm(args.llm, use_cache=False, chunk_size=None)
    llm.generate([[{"role": "user", "content": "Hello"}]], llm.spec.sampling_params(max_tokens=4))  # load
    method = METHODS[args.method]()

    rows = []
    traces = {}
    for mode in ("sequential", "batched"):
        before = llm.stats.copy()
        retr = CountingRetriever(bm25)
        t0 = time.perf_counter()
        if mode == "batched":
            res = method.run([(task, retr)], llm, sampling=sampling)["bench"]
            traces[mode] = list(res.traces)
        else:
            traces[mode] = []
            for q in task.queries:
                one = dataclasses.replace(task, queries=(q,))
                res = method.run([(one, retr)], llm, sampling=sampling)["bench"]
                traces[mode].extend(res.traces)
        wall = time.perf_counter() - t0
        d = llm.stats - before
        # trajectory-steps: one per trajectory per generation step (the same work both ways)
        steps = sum(len(t.steps) for t in traces[mode])
        rows.append((mode, wall, d, retr, steps))

    n = len(task.queries)
    print(f"{args.method} on {args.llm} (llama.cpp in-process), {n} queries, {len(DOCS)} docs, "
          f"max_tokens {args.max_tokens} per step, BM25 ({bm25.name})")
    print(f"{'mode':<11} {'wall s':>7} {'traj/s':>7} {'generate':>9} {'backend':>8} {'traj-steps':>10} "
          f"{'steps/call':>10} {'searches':>9} {'search calls':>12} {'gens':>5} {'tok in':>7} {'tok out':>8} {'model s':>8}")
    for mode, wall, d, retr, steps in rows:
        per_call = steps / d.calls if d.calls else 0.0
        print(f"{mode:<11} {wall:7.2f} {n / wall:7.3f} {d.calls:9d} {d.backend_calls:8d} {steps:10d} "
              f"{per_call:10.2f} {retr.requests:9d} {retr.calls:12d} {d.generations:5d} "
              f"{d.prompt_tokens:7d} {d.completion_tokens:8d} {d.model_time_s:8.2f}")
    same = [(t.steps, t.final, t.finish_reason) for t in traces["batched"]] == [
        (t.steps, t.final, t.finish_reason) for t in traces["sequential"]
    ]
    reasons: dict[str, int] = {}
    for t in traces["batched"]:
        reasons[t.finish_reason] = reasons.get(t.finish_reason, 0) + 1
    print(f"identical trajectories both ways: {same}; finish reasons: {reasons}")
    (_, w_seq, d_seq, _, _), (_, w_bat, d_bat, _, _) = rows
    print(f"speed-up {w_seq / w_bat:.2f}x wall; overhead outside the model: "
          f"sequential {w_seq - d_seq.model_time_s:.2f} s, batched {w_bat - d_bat.model_time_s:.2f} s")


if __name__ == "__main__":
    main()
