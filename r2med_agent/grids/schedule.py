"""The schedule of a grid on a cluster: each row's resource request, the generation stages rows
share, and the estimated makespan beside the sequential total (``reproduce --dry-run --ray``).

A *stage* is a row's work that other rows can read from a cache: a *generation stage* (rows
whose generating settings are equal: method, LLM, sampling, prompts, first pass, loop retriever;
everything but the retrieval and reranking after it, send the same requests) or an *embedding
stage* (one encoder's document embeddings of one task's corpus, which the embedding cache keeps
per encoder and corpus). The first row of a stage makes it; the others run after it, seeded with
what it made, so every text and every embedding is made once. Grouping too much only orders rows
that could have run side by side; it never changes a result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from r2med_agent.grids.rows import Resources

GENERATING = ("method", "llm", "generations", "sampling", "samples", "prompts", "prompts_from", "llm_prompt",
              "first_pass", "loop_retriever", "loop_rules", "request_rules", "entries")
"""The run-spec settings that decide the requests of a row's generation stage."""

CPU_ROW_MEMORY = 2 * 2**30
"""The memory a row on CPUs only asks for (BM25 indexes and the sample tasks fit well within)."""


def stage_key(spec: Any, agentic: bool = False) -> str | None:
    """The generation stage ``spec`` makes or reads (None: it sends no LLM request of a stage:
    no LLM, or released generations). An agentic loop searches between turns, so its retriever
    belongs to its stage."""
    import json

    if not spec.llm or spec.generations != "fresh":
        return None
    rec = spec.record()
    if agentic and rec.get("loop_retriever") is None:
        rec["loop_retriever"] = rec["retriever"]
    return json.dumps({k: rec.get(k) for k in GENERATING}, sort_keys=True, default=str)


def embedding_stages(plan: Any, tasks: Sequence[str]) -> list[str]:
    """The embedding stages of a row: each encoder entry of its retrievers (first pass and loop
    included; the row's plan holds them) over each of its tasks."""
    return [embedding_stage(name, task) for name, _ in plan.encoders for task in tasks]


def embedding_stage(encoder: str, task: str) -> str:
    """The key of the stage that makes ``encoder``'s document embeddings of ``task``'s corpus."""
    return f"embeddings {encoder} {task}"


def is_embedding(stage: str) -> bool:
    """Whether ``stage`` is an embedding stage (else a generation stage)."""
    return stage.startswith("embeddings ")


def row_resources(plan: Any) -> Resources:
    """What a row asks Ray for: GPUs for its self-hosted LLM's tensor-parallel size (vLLM), its
    local encoder and its reranker's model (the largest of them: they run one after another in
    the row), else one CPU and :data:`CPU_ROW_MEMORY`. The entries are the row's plan's
    (:class:`~r2med_agent.experiment.plan.RunPlan`)."""
    spec = plan.spec
    gpus = 0
    llm = plan.llm if spec.llm and spec.generations == "fresh" else None
    if llm is not None and llm.backend == "vllm":
        gpus = max(gpus, llm.tensor_parallel_size)
    if any(getattr(enc, "kind", "hf") != "api" for _, enc in plan.encoders):
        gpus = max(gpus, 1)
    rr = plan.reranker if spec.reranker else None
    if rr is not None:
        rllm = plan.reranker_llm if rr.llm else None
        if rllm is None:
            gpus = max(gpus, 1)
        elif rllm.backend == "vllm":
            gpus = max(gpus, rllm.tensor_parallel_size)
    if gpus:
        return Resources(num_cpus=1, num_gpus=gpus)
    return Resources(num_cpus=1, memory=CPU_ROW_MEMORY)


@dataclass(frozen=True)
class Slot:
    """A row placed by :func:`pack`: its start and end hours and GPUs."""

    index: int
    start: float
    end: float
    gpus: int


def pack(hours: Sequence[float], gpus: Sequence[int], after: Mapping[int, Sequence[int]],
         total_gpus: int) -> list[Slot]:
    """Rows placed on ``total_gpus`` GPUs, longest first among those whose stages are made (``after``:
    a row's index -> the rows that make the stages it reads), each as soon as its GPUs are free (list scheduling, the way a Ray cluster fills up). A row that
    needs no GPU runs beside the others; one that needs more GPUs than there are cannot run and
    is left out."""
    free = [0.0] * total_gpus
    done: dict[int, float] = {}
    slots: list[Slot] = []
    todo = [i for i in range(len(hours)) if gpus[i] <= total_gpus]
    while todo:
        ready = [i for i in todo if all(a in done for a in after.get(i, ()))]
        if not ready:  # a producer cannot run: its dependents cannot either
            break
        i = max(ready, key=lambda j: (hours[j], -j))
        todo.remove(i)
        earliest = max((done[a] for a in after.get(i, ())), default=0.0)
        if gpus[i] == 0:
            start = earliest
        else:
            free.sort()
            start = max(earliest, free[gpus[i] - 1])
            for g in range(gpus[i]):
                free[g] = start + hours[i]
        slots.append(Slot(i, start, start + hours[i], gpus[i]))
        done[i] = start + hours[i]
    return slots


def longest_chain(hours: Sequence[float], after: Mapping[int, Sequence[int]]) -> float:
    """Hours of the longest chain of dependent rows (a lower bound of any makespan)."""
    def chain(i: int) -> float:
        return hours[i] + max((chain(a) for a in after.get(i, ())), default=0.0)
    return max((chain(i) for i in range(len(hours))), default=0.0)


def idle_share(slots: Sequence[Slot], total_gpus: int) -> float:
    """The share of GPU-hours left idle over the makespan."""
    makespan = max((s.end for s in slots), default=0.0)
    if not makespan or not total_gpus:
        return 0.0
    busy = sum((s.end - s.start) * s.gpus for s in slots)
    return 1.0 - busy / (makespan * total_gpus)

