"""What the runner hands a reranker that batches tasks, and what it gets back: one
:class:`RerankJob` per task in, one :class:`RerankOutput` per task out, which writes its own logs
(:meth:`RerankOutput.artifacts`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from r2med_agent.types import Run, SearchRequest, Task, Trace

__all__ = ["BatchReranker", "RerankJob", "RerankOutput", "built_llm"]


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


@runtime_checkable
class BatchReranker(Protocol):
    """A reranker whose kind declares ``batches_tasks`` (the LLM rerankers): what the runner
    calls of it besides :class:`~r2med_agent.rerank.spec.Reranker`'s.

    The runner hands it the run's own LLM (:meth:`share_llm`) when the entry's kind uses an LLM
    and names the run's, calls :meth:`rerank_tasks` once with every task, and reports the
    statistics of :attr:`built_llm` when that is not the run's own.
    """

    def rerank_tasks(self, jobs: Sequence[RerankJob], k: int) -> list[RerankOutput]:
        """One :class:`~r2med_agent.rerank.base.RerankOutput` per
        :class:`~r2med_agent.rerank.base.RerankJob`, in order."""
        ...

    def share_llm(self, llm: Any) -> None:
        """Use ``llm`` (the run's own) instead of building one, unless one is built."""
        ...

    @property
    def built_llm(self) -> Any:
        """The LLM it built or was given (None: none yet; nothing is built by asking)."""
        ...


def built_llm(reranker: Any) -> Any:
    """A reranker's :attr:`BatchReranker.built_llm`; None for one that does not batch tasks (it has no LLM)."""
    return reranker.built_llm if isinstance(reranker, BatchReranker) else None
