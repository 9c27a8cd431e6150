"""Agentic loop: the batched engine against a one-trajectory-at-a-time loop.

Runs Search-R1 (or Search-o1) for every query of a small inline medical corpus on the local GGUF
engine (SmolLM2-135M on llama.cpp, registry entry ``smollm2``) with the real BM25 retriever, twice:

* batched: ONE loop over all queries (each step: one ``llm.generate`` call over every unfinished
  trajectory, one ``retriever.search`` call for all of the step's searches, and for Search-o1
  one Reason-in-Documents call);
* sequential: the same loop run for one query at a time (what a per-item agent loop does).

A 135M model rarely decides to search on its own, so by default (``--prefill``) each
trajectory's first step starts with the method's opening search tag already written (after
``<think>I need to search.</think>`` for Search-R1, a short sentence for Search-o1): the real
model writes the query and closes the tag, the loop runs the real search (and, for Search-o1,
the real Reason-in-Documents call), and the model continues from the inserted results. Nothing
else is scripted. ``--no-prefill`` runs the plain prompts.

It prints, for each way: wall time, trajectories per second, loop steps, ``llm.generate`` calls
and backend calls (reasoning and Reason-in-Documents), backend calls per step, trajectories per
backend call, searches, retriever calls, tokens; then the per-step backend calls of the batched
run, and checks that both ways produce the same trajectories (greedy decoding, no cache).
llama.cpp in-process serves the prompts of a batch one after another, so on this engine batching
saves calls and per-call overhead, not model time; on vLLM or an HTTP server the batch is
decoded concurrently, which is where the large gain is.

Usage::

    python benchmarks/agentic.py [--method search-r1|search-o1] [--queries 6] [--max-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

from r2med_agent.llm import make_llm
from r2med_agent.methods import METHODS
from r2med_agent.retrieval.bm25.retriever import BM25Retriever
from r2med_agent.types import Doc, Generation, Message, Query, Run, SamplingParams, SearchRequest, Task

PREFILLS = {
    "search-r1": "<think>I need to search.</think>\n<search>",
    "search-o1": "I need to search for this.\n<|begin_search_query|>",
}

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


class OpeningTagPrefill:
    """The real (cached) LLM, with each trajectory's FIRST reasoning step started by ``prefix``.

    A first-step request (``meta`` kind ``reason``, step 0) gets ``prefix`` as an assistant
    message to continue; the returned text is ``prefix`` plus what the model wrote, as if it had
    written all of it. Every request, the first steps included, goes to the real model in the
    one ``generate`` call the loop makes. ``stats`` and ``parse`` are the wrapped LLM's.
    """

    def __init__(self, inner: Any, prefix: str) -> None:
        self.inner = inner
        self.prefix = prefix
        self.model_id = inner.model_id
        self.stats = inner.stats
        self.parse = inner.parse

    def generate(
        self,
        prompts: Sequence[list[Message]],
        params: SamplingParams,
        *,
        sample_index: int = 0,
        template_hash: str = "",
        meta: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> list[Generation]:
        first = [bool(m) and m.get("kind") == "reason" and m.get("step") == 0 for m in (meta or [None] * len(prompts))]
        sent = [[*p, {"role": "assistant", "content": self.prefix}] if f else p for p, f in zip(prompts, first)]
        gens = self.inner.generate(sent, params, sample_index=sample_index, template_hash=template_hash, meta=meta)
        out = []
        for gen, f in zip(gens, first):
            if f:
                reasoning, final = self.parse(self.prefix + gen.text)
                gen = dataclasses.replace(gen, text=self.prefix + gen.text, reasoning=reasoning, final=final)
            out.append(gen)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="search-r1", choices=["search-r1", "search-o1"])
    ap.add_argument("--queries", type=int, default=6, help=f"1 to {len(QUERIES) - 1}")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--llm", default="smollm2")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each way; the fastest is reported")
    ap.add_argument("--prefill", action=argparse.BooleanOptionalAction, default=True,
                    help="start each trajectory with the opening search tag (default: on)")
    args = ap.parse_args()
    if not 1 <= args.queries < len(QUERIES):
        ap.error(f"--queries must be between 1 and {len(QUERIES) - 1} (the last query warms up)")

    task = make_task(args.queries)
    bm25 = BM25Retriever.for_task(task, show_progress=False)
    # Greedy decoding so both ways must produce the same trajectories; no cache, so every
    # generation is made; all of a step's prompts in one backend call.
    sampling = {"max_tokens": args.max_tokens, "temperature": 0.0}
    llm = make_llm(args.llm, use_cache=False, chunk_size=None)
    llm.generate([[{"role": "user", "content": "Hello"}]], llm.spec.sampling_params(max_tokens=4))  # load
    loop_llm = OpeningTagPrefill(llm, PREFILLS[args.method]) if args.prefill else llm
    method = METHODS[args.method]()
    # Warm-up, not measured: one trajectory of a query outside the measured set (the first
    # long prompts llama.cpp evaluates in a process are much slower than later ones).
    spare = dataclasses.replace(task, queries=(Query("warm-up", QUERIES[-1]),))
    method.run([(spare, bm25)], loop_llm, sampling=sampling)

    # Each way runs --repeats times, in alternating order, and its fastest run is reported (the
    # counts are the same every time: greedy decoding, no cache).
    best: dict[str, tuple[float, Any, CountingRetriever]] = {}
    traces: dict[str, list[Any]] = {}
    step_stats: dict[str, list[Any]] = {}
    for r in range(args.repeats):
        for mode in ("sequential", "batched") if r % 2 == 0 else ("batched", "sequential"):
            before = llm.stats.copy()
            retr = CountingRetriever(bm25)
            t0 = time.perf_counter()
            if mode == "batched":
                res = method.run([(task, retr)], loop_llm, sampling=sampling)["bench"]
                traces[mode], step_stats[mode] = list(res.traces), list(res.steps)
            else:
                traces[mode], step_stats[mode] = [], []
                for q in task.queries:
                    one = dataclasses.replace(task, queries=(q,))
                    res = method.run([(one, retr)], loop_llm, sampling=sampling)["bench"]
                    traces[mode].extend(res.traces)
                    step_stats[mode].extend(res.steps)
            wall = time.perf_counter() - t0
            if mode not in best or wall < best[mode][0]:
                best[mode] = (wall, llm.stats - before, retr)
    rows = [(mode, *best[mode]) for mode in ("sequential", "batched")]

    n = len(task.queries)
    print(f"{args.method} on {args.llm} (llama.cpp in-process), {n} queries, {len(DOCS)} docs, "
          f"max_tokens {args.max_tokens} per step, BM25 ({bm25.name}), "
          f"{'first step prefilled with the opening search tag' if args.prefill else 'no prefill'}")
    print(f"{'mode':<11} {'wall s':>7} {'traj/s':>7} {'steps':>6} {'generate':>9} {'backend':>8} "
          f"{'(condense)':>10} {'backend/step':>12} {'traj/call':>9} {'searches':>9} {'search calls':>12} "
          f"{'tok in':>7} {'tok out':>8} {'model s':>8}")
    for mode, wall, d, retr in rows:
        steps = step_stats[mode]
        condense = sum(s.condense_backend_calls for s in steps)
        traj_steps = sum(s.active + s.searches * (1 if method.condenses else 0) for s in steps)
        per_step = d.backend_calls / len(steps) if steps else 0.0
        per_call = traj_steps / d.backend_calls if d.backend_calls else 0.0
        print(f"{mode:<11} {wall:7.2f} {n / wall:7.3f} {len(steps):6d} {d.calls:9d} {d.backend_calls:8d} "
              f"{condense:10d} {per_step:12.2f} {per_call:9.2f} {retr.requests:9d} {retr.calls:12d} "
              f"{d.prompt_tokens:7d} {d.completion_tokens:8d} {d.model_time_s:8.2f}")
    print("batched, backend calls per step (reasoning + Reason-in-Documents): "
          + ", ".join(f"{s.backend_calls}+{s.condense_backend_calls}" for s in step_stats["batched"]))
    same = [(t.steps, t.final, t.finish_reason) for t in traces["batched"]] == [
        (t.steps, t.final, t.finish_reason) for t in traces["sequential"]
    ]
    reasons: dict[str, int] = {}
    for t in traces["batched"]:
        reasons[t.finish_reason] = reasons.get(t.finish_reason, 0) + 1
    ran = sum(len(t.extra["searches"]) for t in traces["batched"])
    print(f"identical trajectories both ways: {same}; finish reasons: {reasons}; "
          f"searches run per trajectory: {ran / n:.2f}")
    (_, w_seq, d_seq, _), (_, w_bat, d_bat, _) = rows
    print(f"speed-up {w_seq / w_bat:.2f}x wall; overhead outside the model: "
          f"sequential {w_seq - d_seq.model_time_s:.2f} s, batched {w_bat - d_bat.model_time_s:.2f} s")


if __name__ == "__main__":
    main()
