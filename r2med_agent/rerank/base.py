"""What the runner hands a reranker that batches tasks, and what it gets back: one
:class:`RerankJob` per task in, one :class:`RerankOutput` per task out, which writes its own logs
(:meth:`RerankOutput.artifacts`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from r2med_agent.types import Run, SearchRequest, Task, Trace

__all__ = ["RerankJob", "RerankOutput"]


@dataclass
class RerankJob:
    """One task's input to a reranker's ``rerank_tasks(jobs, k)``."""

    task: Task
    requests: Sequence[SearchRequest]
    run: Run
    corpus: Mapping[str, str]
    ordered: bool = False
    """True: each query's documents in ``run`` are already in their first-stage order (a run
    file read as given, ``run --candidates``), which the reranker keeps, tied scores included, as
    the published rerankers read their run files; False: they are ranked by score, ties by
    document id."""


@dataclass
class RerankOutput:
    """One task's output: the reranked run, a trace per query, and the stage's statistics."""

    run: Run
    traces: list[Trace]
    stats: dict[str, Any] = field(default_factory=dict)

    def artifacts(self) -> dict[str, str]:
        """The files the reranker writes beside the task's run, by suffix: its traces as
        ``.rerank.jsonl`` (the permutations, judgments, groups or comparisons of each query)."""
        from r2med_agent.traces import traces_to_jsonl

        return {".rerank.jsonl": traces_to_jsonl(self.traces)}
