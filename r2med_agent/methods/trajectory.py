"""The state of a reasoning-search loop: one trajectory per query (the loop's only state; each
request derives from it), what one step did, and what an agentic method returns per task."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from r2med_agent.retrieval.base import Retriever
from r2med_agent.types import Generation, Message, Query, Run, SearchRequest, Task, Trace, TraceStep


@dataclass(frozen=True)
class LoopJob:
    """One query to run the loop for, with its task and the retriever searched for that task."""

    task_index: int
    task: Task
    retriever: Retriever
    query: Query


@dataclass
class Trajectory:
    """The mutable state of one trajectory; the loop's only state (requests derive from it).

    ``text`` is the canonical running assistant text; it always equals the concatenation of
    ``generated + inserted`` over ``steps``.
    """

    job: LoopJob
    messages: list[Message]
    text: str = ""
    steps: list[TraceStep] = field(default_factory=list)
    searches: list[str] = field(default_factory=list)
    issued: list[str] = field(default_factory=list)
    answer: str | None = None
    finish_reason: str | None = None
    condensed: list[dict[str, Any]] = field(default_factory=list)
    generations: int = 0
    cache_hits: int = 0
    llm_time_s: float = 0.0
    llm_time_new_s: float = 0.0
    final: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def request_messages(self) -> list[Message]:
        """The request for the next step: the prompt, then the running text to continue."""
        if not self.text:
            return [dict(m) for m in self.messages]
        return [*(dict(m) for m in self.messages), {"role": "assistant", "content": self.text}]

    def count(self, gen: Generation) -> None:
        # Model time of every generation (a cached one keeps its original time), as the
        # expansion methods report it; llm_time_new_s is what this run spent.
        self.llm_time_s += gen.latency_s
        if gen.cached:
            self.cache_hits += 1
        else:
            self.generations += 1
            self.llm_time_new_s += gen.latency_s

    def add_step(
        self,
        gen: Generation,
        generated: str,
        *,
        search_query: str | None = None,
        doc_ids: Sequence[str] = (),
        inserted: str = "",
        extra_tokens: tuple[int, int] = (0, 0),
    ) -> None:
        self.steps.append(
            TraceStep(
                generated=generated,
                search_query=search_query,
                doc_ids=tuple(doc_ids),
                inserted=inserted,
                prompt_tokens=gen.prompt_tokens + extra_tokens[0],
                completion_tokens=gen.completion_tokens + extra_tokens[1],
            )
        )
        self.text += generated + inserted


PendingSearch = tuple[Trajectory, str, str, Generation]
"""A search a step asks for: (trajectory, query, the step's generated text, its generation)."""


@dataclass(frozen=True)
class StepStats:
    """What one step of the loop did.

    ``generate_calls`` count calls of ``llm.generate`` on the LLM given to the loop (the caching
    wrapper); ``backend_calls`` count the calls that wrapper made to the backend for them: 0 when
    every request was a cache hit, more than 1 when it split the misses into crash-safe chunks
    (``chunk_size``). A bare backend given directly is one backend call per generate call.

    Attributes:
        turn: 0-based step number.
        active: trajectories that generated in this step.
        generate_calls: ``llm.generate`` calls for the step's generations (1 when any was active).
        backend_calls: backend calls those made.
        condense_calls: ``llm.generate`` calls for Reason-in-Documents (0 or 1).
        condense_backend_calls: backend calls those made.
        search_calls: ``retriever.search`` calls (one per task that searched).
        searches: queries executed.
        notices: queries answered with a notice instead of results (repeated, over the limit).
        finished: trajectories that finished in this step.
    """

    turn: int
    active: int
    generate_calls: int
    backend_calls: int
    condense_calls: int
    condense_backend_calls: int
    search_calls: int
    searches: int
    notices: int
    finished: int

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass
class LoopOutcome:
    """Trajectories in job order, and the per-step statistics."""

    trajectories: list[Trajectory]
    steps: list[StepStats]


@dataclass(frozen=True)
class AgenticResult:
    """What an agentic method returns for one task.

    Attributes:
        requests: one final SearchRequest per query, in task order (``combine="reasoning"``:
            the final response is the expansion), for the runner to search with its retriever.
        traces: one Trace per query, in task order.
        fused_run: with ``final="fuse"``, the reciprocal-rank fusion of every search the loop
            ran for each trajectory (each distinct query once; queries answered with a notice and
            those of the final turn were not run) plus its final request (use it instead of
            searching ``requests``); None with ``final="default"``.
        steps: the loop's per-step statistics; one loop serves every task of a ``run`` call,
            so every task's result holds the same steps.
    """

    requests: tuple[SearchRequest, ...]
    traces: tuple[Trace, ...]
    fused_run: Run | None = None
    steps: tuple[StepStats, ...] = ()
