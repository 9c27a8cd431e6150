"""What the LLM rerankers share: a task's job and output, the working state of each query
(its top ``k`` in their current order, the answers, the trace steps and records), and how a
reranked query becomes its run, the task's statistics and the order of tied scores."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from r2med_agent.errors import DataError
from r2med_agent.retrieval.fusion import ranked
from r2med_agent.rerank.base import RerankJob, RerankOutput  # the batch protocol's records
from r2med_agent.types import Generation, Message, Run, SamplingParams, SearchRequest, Task, Trace, TraceStep

@dataclass
class RerankQuery:
    """One query's working state while it is reranked.

    Attributes:
        job: the index of its job (task).
        task: its task.
        request: its search request.
        head: its top ``k`` document ids, in their current order.
        tail: the rest of its run, below the reranked head in their first-stage order.
        corpus: the task's documents by id.
        first: the first-stage score of each document.
        texts: each candidate's text as the prompt shows it (cut once, read by every window or
            group).
        gens: every answer given for it.
        windows: the listwise windows read, ``(start, end)``.
        steps: its trace steps.
        records: what each window, judgment or group gave (the trace's records).
        scores: the new score of each document of ``head``.
        unscored: groupwise: candidates no answer scored.
        run_position: its place among the queries of its job's first-stage run, in the order the
            run lists them (a run file's order; GroupRank's shuffles run through it).
    """

    job: int
    task: Task
    request: SearchRequest
    head: list[str]
    tail: list[str]
    corpus: Mapping[str, str]
    first: Mapping[str, float] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    gens: list[Generation] = field(default_factory=list)
    windows: list[tuple[int, int]] = field(default_factory=list)
    steps: list[TraceStep] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    unscored: list[str] = field(default_factory=list)
    run_position: int = 0

    def reranked_run(self) -> dict[str, float]:
        """The query's new run: the head with its scores, then the tail below the lowest one."""
        new = dict(zip(self.head, self.scores))
        floor = min(self.scores) if self.scores else 0.0
        for j, d in enumerate(self.tail, start=1):
            new[d] = floor - j
        return new

    def trace(self, method: str, extra: Mapping[str, Any]) -> Trace:
        """The query's trace: its steps, and the reranked order as its final text."""
        return Trace(query_id=self.request.query_id, method=method, steps=tuple(self.steps),
                     final="reranked: " + ", ".join(self.head), finish_reason="stop", extra=dict(extra))


class PromptingReranker(Protocol):
    """What the ways of reranking with an LLM (:mod:`~r2med_agent.rerank.listwise`,
    :mod:`~r2med_agent.rerank.pointwise`) use of their reranker
    (:class:`~r2med_agent.rerank.llm.LLMReranker`)."""

    name: str
    format: str
    spec: Any

    @property
    def llm(self) -> Any: ...

    def sampling(self) -> SamplingParams: ...

    def returns_logprobs(self) -> bool: ...

    def scores_choices(self) -> bool: ...

    def prepared(self, text: str) -> str: ...

    def prompt(self, task: Task, **variables: Any) -> list[Message]: ...

    def template_hash(self, task: Task) -> str: ...

    def meta(self, q: RerankQuery, **extra: Any) -> dict[str, Any]: ...


def ranked_requests(jobs: Sequence[RerankJob], k: int) -> Iterator[tuple[int, RerankJob, SearchRequest, list[str]]]:
    """``(job index, job, request, its run's document ids in rank order)`` for every request of
    every job, once its top ``k`` is checked against the job's corpus (a DataError names a
    document the corpus lacks)."""
    for j, job in enumerate(jobs):
        for req in job.requests:
            docs = job.run.get(req.query_id, {})
            items = list(docs) if job.ordered else [d for d, _ in ranked(docs)]
            for doc_id in items[:k]:
                if doc_id not in job.corpus:
                    raise DataError(
                        f"{job.task.name}: query {req.query_id}: document '{doc_id}' of the run is not in the corpus"
                    )
            yield j, job, req, items


def sort_by_score(queries: Sequence[RerankQuery]) -> None:
    """Each query's candidates by descending score; ties keep the first-stage order.

    A tied score is lowered to the next float below the one above it, so the run's scores
    strictly decrease: evaluation (trec_eval) would otherwise order ties by document id. The
    judgments' records keep the scores as they were.
    """
    for q in queries:
        order = sorted(range(len(q.head)), key=lambda i: (-q.scores[i], i))
        q.head = [q.head[i] for i in order]
        scores = [q.scores[i] for i in order]
        for i in range(1, len(scores)):
            scores[i] = min(scores[i], math.nextafter(scores[i - 1], -math.inf))
        q.scores = scores


def generation_stats(gens: Sequence[Generation]) -> dict[str, Any]:
    """What a task's answers cost: generations made and served from the cache, tokens and model
    seconds (``llm_time_new_s``: of the generations made now)."""
    made = [g for g in gens if not g.cached]
    return {
        "generations": len(made),
        "cache_hits": len(gens) - len(made),
        "prompt_tokens": sum(g.prompt_tokens for g in gens),
        "completion_tokens": sum(g.completion_tokens for g in gens),
        "llm_time_s": round(sum(g.latency_s for g in gens), 4),
        "llm_time_new_s": round(sum(g.latency_s for g in made), 4),
    }
