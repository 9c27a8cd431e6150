"""The batched reasoning-search loop shared by Search-R1 and Search-o1.

Every step of :meth:`ReasoningLoop.run_loop`:

1. builds the request of each unfinished trajectory from its state alone (the original prompt
   plus the canonical running text), so the same state always makes the same request and a run
   interrupted anywhere resumes from the generation cache;
2. generates for ALL unfinished trajectories, of all tasks, in ONE ``llm.generate`` call with
   the method's stop strings (the caching wrapper may split its cache misses into crash-safe
   chunks, one backend call each; :class:`StepStats` records both counts);
3. parses each output robustly (:func:`parse_output`): the backend may return the text without
   the stop string (OpenAI/vLLM default), with it, with whitespace after it, or ignore it and run
   on; ``stop_reason`` may be missing; an unclosed ``<search>`` at the end is an issued query;
4. runs ALL searches issued in the step with ONE ``retriever.search`` call per task;
5. optionally condenses the documents with ONE more ``llm.generate`` call over every trajectory
   that searched (Search-o1's Reason-in-Documents);
6. appends the generated text and the inserted text, and records a finish reason per trajectory:
   ``answer``, ``max_turns``, ``max_searches``, ``length`` or ``error``.

How the conversation is re-submitted: the LLM protocol takes chat messages, so each request is
the method's original user message followed, once something was generated, by ONE assistant
message holding the running text (the model's own output with the inserted results). A final
assistant message means "continue this message". The vLLM offline and local llama.cpp backends
do it as the original repos do: the prompt is rendered ONCE with the chat template's generation
prompt and the running text is appended to it as raw text, so every earlier token of the request
stays identical from step to step (prefix caching makes re-submission cheap) and reasoning
models' templates cannot rewrite the running text. An OpenAI-compatible vLLM server is asked
with ``continue_final_message``, which re-renders the text as an assistant message (see the
README for its limits); backends that cannot continue a message (hosted chat APIs) see it as a
finished assistant turn and answer in a new one; the loop parses that the same.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any, ClassVar, Literal

from r2med_agent.errors import ConfigError
from r2med_agent.llm.base import LLM
from r2med_agent.methods.base import LoopMethod
from r2med_agent.methods.loop_engine import LoopSteps, ranked_doc_ids
from r2med_agent.methods.loop_parsing import Action, Parser, final_text, parse_output, plain_parse, reasoning_parser
from r2med_agent.methods.token_cut import TokenCut, cut_whitespace_tokens, cut_words, load_token_cut
from r2med_agent.traces import read_traces, trace_from_dict, trace_to_dict, traces_to_jsonl
from r2med_agent.methods.trajectory import (
    AgenticResult,
    LoopJob,
    LoopOutcome,
    PendingSearch,
    StepStats,
    Trajectory,
)
from r2med_agent.retrieval.base import Retriever
from r2med_agent.retrieval.fusion import DEFAULT_RRF_K, rrf
from r2med_agent.types import Doc, Generation, Message, Query, Run, SamplingParams, SearchRequest, Task, Trace

__all__ = [
    "FINAL_MODES", "FINISH_REASONS", "Action", "AgenticResult", "FinalMode", "FinalRanking", "FinishReason",
    "LoopJob", "LoopLimits", "LoopOutcome", "Parser", "PendingSearch", "ReasoningLoop", "StepStats", "TokenCut",
    "Trajectory", "apply_sampling_overrides", "cut_whitespace_tokens", "cut_words", "final_text", "load_token_cut",
    "parse_output", "plain_parse", "ranked_doc_ids", "read_traces", "reasoning_parser", "trace_from_dict",
    "trace_to_dict", "traces_to_jsonl",
]
"""The loop's names. Its parts live beside it: the engine (:mod:`~r2med_agent.methods.loop_engine`),
reading a step (:mod:`~r2med_agent.methods.loop_parsing`), trajectory state and results
(:mod:`~r2med_agent.methods.trajectory`), cutting inserted text
(:mod:`~r2med_agent.methods.token_cut`) and traces as JSON lines
(:mod:`~r2med_agent.traces`)."""

logger = logging.getLogger(__name__)

FinishReason = Literal["answer", "max_turns", "max_searches", "length", "error"]
FINISH_REASONS: tuple[str, ...] = ("answer", "max_turns", "max_searches", "length", "error")

FinalMode = Literal["default", "fuse"]
FINAL_MODES: tuple[str, ...] = ("default", "fuse")

_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def apply_sampling_overrides(params: SamplingParams, overrides: Mapping[str, Any] | None) -> SamplingParams:
    """``params`` with CLI sampling overrides applied; unknown names raise ConfigError.

    ``stop`` cannot be overridden: the loop's stop strings are part of its protocol.
    """
    if not overrides:
        return params
    allowed = [n for n in _SAMPLING_FIELDS if n != "stop"]
    unknown = sorted(set(overrides) - set(allowed))
    if unknown:
        raise ConfigError(
            f"unknown sampling option(s) for an agentic method: {', '.join(unknown)}; "
            f"allowed: {', '.join(allowed)}"
        )
    return dataclasses.replace(params, **dict(overrides))


@dataclass(frozen=True)
class LoopLimits:
    """How far a trajectory may go.

    Attributes:
        max_turns: generation steps in which a trajectory may search.
        max_searches: most searches a trajectory may run (None: bounded by ``max_turns`` only).
            A query over the limit gets the method's notice (``blocked_search``); without one it
            ends the trajectory (``max_searches``).
        docs_per_search: documents retrieved per search.
        final_turn: a trajectory still unfinished after ``max_turns`` steps gets one more
            generation, its final answer turn, in which a search is not run (Search-R1's final
            rollout).
        max_doc_words: each inserted document is cut to this many whitespace tokens (None: not
            cut).
    """

    max_turns: int
    max_searches: int | None
    docs_per_search: int
    final_turn: bool = False
    max_doc_words: int | None = None

    def __post_init__(self) -> None:
        for label, value in (("max_turns", self.max_turns), ("docs_per_search", self.docs_per_search)):
            if value < 1:
                raise ConfigError(f"{label} must be at least 1, got {value}")
        if self.max_searches is not None and self.max_searches < 0:
            raise ConfigError(f"max_searches must be >= 0 or None, got {self.max_searches}")


@dataclass(frozen=True)
class FinalRanking:
    """How the final ranking of a trajectory is made.

    Attributes:
        final: ``default`` (the final response is the query) or ``fuse`` (RRF of every search
            the loop ran for the trajectory plus the final query).
        fuse_depth: documents per list searched for, and kept after, fusion.
        rrf_k: the RRF constant.
    """

    final: str = "default"
    fuse_depth: int = 100
    rrf_k: int = DEFAULT_RRF_K

    def __post_init__(self) -> None:
        if self.final not in FINAL_MODES:
            raise ConfigError(f"final must be one of {', '.join(FINAL_MODES)}, got {self.final!r}")
        if self.fuse_depth < 1:
            raise ConfigError(f"fuse_depth must be at least 1, got {self.fuse_depth}")


class ReasoningLoop(LoopMethod):
    """Base class of the agentic methods: the batched loop plus the hooks a method fills in.

    Subclasses set the class attributes and implement :meth:`initial_messages`,
    :meth:`insert_documents` (or :meth:`condense_messages`/:meth:`condense_insert` when
    ``condenses``), :meth:`final_response`, and optionally :meth:`invalid_turn` and
    :meth:`blocked_search`.

    Args:
        params: sampling settings of the reasoning generations (the stop strings are set from
            the tags).
        limits: how far a trajectory may go (:class:`LoopLimits`); each of its fields is also
            an attribute of the loop (``max_turns``, ...).
        ranking: how the final ranking is made (:class:`FinalRanking`); its fields too are
            attributes of the loop (``final``, ``fuse_depth``, ``rrf_k``).
    """

    name: ClassVar[str] = ""
    agentic: ClassVar[bool] = True
    search_tags: ClassVar[tuple[str, str]] = ("", "")
    answer_tags: ClassVar[tuple[str, str] | None] = None
    result_tags: ClassVar[tuple[str, str]] = ("", "")
    condenses: ClassVar[bool] = False
    llm_overrides: ClassVar[Mapping[str, Any]] = {}
    """Registry-entry fields the runner changes for this method's LLM (Search-o1: no system
    prompt, as the original sends one user message)."""
    model_sampling: Mapping[str, Any] = {}
    """Sampling the method uses for the model it was adapted to (:meth:`for_model`); the runner
    applies it beneath CLI overrides and before capping by the entry's ``max_tokens``."""
    template_hash: str = ""
    length_ends: ClassVar[bool] = True
    """A step cut by ``max_tokens`` without a search or an answer ends the trajectory (``length``);
    False: it is a step with neither (:meth:`invalid_turn`), as Search-R1's evaluation reads it."""
    empty_actions: ClassVar[bool] = False
    """A search (answer) tag with nothing inside is a search with an empty query (an empty
    answer), as Search-R1's loop reads it; False: a step with neither (Search-o1 ends there)."""
    needs_tokenizer: bool = False
    """The method counts tokens of inserted text (:attr:`token_cut`); the runner then loads the
    model's tokenizer (:func:`load_token_cut`)."""
    token_cut: TokenCut = staticmethod(cut_whitespace_tokens)  # type: ignore[assignment]
    prompts_dir: Path | None = None
    """The prompts folder the loop renders from (None: ``$R2MED_PROMPTS_DIR`` or the package's)."""

    def __init__(self, *, params: SamplingParams, limits: LoopLimits, ranking: FinalRanking = FinalRanking()) -> None:
        self.params = dataclasses.replace(params, stop=self.stop_strings())
        self.max_turns = limits.max_turns
        self.max_searches = limits.max_searches
        self.final_turn = limits.final_turn
        self.docs_per_search = limits.docs_per_search
        self.max_doc_words = limits.max_doc_words
        self.final = ranking.final
        self.fuse_depth = ranking.fuse_depth
        self.rrf_k = ranking.rrf_k

    # ---- protocol description -------------------------------------------------------------

    @classmethod
    def tags(cls) -> dict[str, tuple[str, str]]:
        out = {"search": cls.search_tags}
        if cls.answer_tags is not None:
            out["answer"] = cls.answer_tags
        return out

    @classmethod
    def stop_strings(cls) -> tuple[str, ...]:
        return tuple(close for _, close in cls.tags().values())

    # ---- hooks -------------------------------------------------------------------------------

    def for_model(self, model: str) -> ReasoningLoop:
        """This loop adapted to ``model`` (the registry entry's model id), as the original method
        runs that model; the default is the loop itself."""
        return self

    def initial_messages(self, task: Task, query: Query) -> list[Message]:
        """The chat messages that start a trajectory."""
        raise NotImplementedError

    def invalid_turn(self, traj: Trajectory) -> str | None:
        """Text to insert after a step with neither a search nor an answer (None: finished)."""
        return None

    def blocked_search(self, traj: Trajectory, query: str, *, last_turn: bool) -> str | None:
        """Text to insert instead of running ``query`` (None: run it).

        ``last_turn`` is True in the last step that may search (step ``max_turns``).
        """
        return None

    def insert_documents(self, traj: Trajectory, query: str, docs: Sequence[Doc]) -> str:
        """Text inserted after a search (methods that do not condense)."""
        raise NotImplementedError

    def condense_messages(
        self, traj: Trajectory, body: str, query: str, docs: Sequence[Doc]
    ) -> list[Message]:
        """The Reason-in-Documents request for one search (methods that condense).

        ``body`` is the step's generated text ending with the query, not yet in ``traj.text``.
        """
        raise NotImplementedError

    def condense_insert(self, gen: Generation) -> tuple[str, str]:
        """``(extracted information, text to insert)`` from a Reason-in-Documents output."""
        raise NotImplementedError

    def final_response(self, traj: Trajectory, parse: Parser) -> str:
        """The final response of a finished trajectory (what becomes the query).

        ``parse`` is the model's reasoning-output parser (:func:`reasoning_parser`).
        """
        raise NotImplementedError

    def condense_params(self) -> SamplingParams:
        """Sampling of the Reason-in-Documents call: the loop's, without its stop strings."""
        return dataclasses.replace(self.params, stop=())

    # ---- helpers for hooks ------------------------------------------------------------------

    def searches_left(self, traj: Trajectory) -> bool:
        return self.max_searches is None or len(traj.searches) < self.max_searches

    @staticmethod
    def model_output(traj: Trajectory) -> str:
        """Everything the model generated in the trajectory, as one text (inserted text, i.e.
        results, notices and corrective messages, excluded)."""
        return "".join(s.generated for s in traj.steps)

    def without_tags(self, text: str) -> str:
        """``text`` without the method's tags (search, answer, results) and ``<think>`` tags,
        runs of spaces collapsed."""
        for open_, close in (*self.tags().values(), self.result_tags, ("<think>", "</think>")):
            if open_:
                text = text.replace(open_, " ")
            if close:
                text = text.replace(close, " ")
        return re.sub(r"[ \t]+", " ", text).strip()

    def parsed_response(self, traj: Trajectory, parse: Parser) -> str:
        """The model's final response under its reasoning format, over the WHOLE output of the
        trajectory (:meth:`model_output`), tags removed: with ``think`` the text after the first
        ``</think>`` wherever it came, with ``huatuo`` after the first ``Final Response``, with
        ``search-r1`` the first ``<answer>`` span, with ``plain`` all of it."""
        return self.without_tags(parse(self.model_output(traj))[1])

    # ---- engine ------------------------------------------------------------------------------

    def run_loop(self, jobs: Sequence[LoopJob], llm: LLM) -> LoopOutcome:
        """Run every job's trajectory to the end, batching each step over all of them
        (:class:`~r2med_agent.methods.loop_engine.LoopSteps`).

        Steps ``0 .. max_turns - 1`` may search; with ``final_turn``, step ``max_turns`` is the
        final answer turn of the trajectories still unfinished, in which a search is not run.

        Returns:
            The trajectories in job order (``final`` filled) and per-step statistics.
        """
        return LoopSteps(self, llm).run(jobs)

    # ---- the method interface the runner calls ------------------------------------------------

    def run_tasks(self, jobs: Sequence[Any], llm: LLM, settings: Any) -> Any:
        """:meth:`LoopMethod.run_tasks`, with the model's tokenizer loaded first when the method
        counts tokens (:attr:`needs_tokenizer`)."""
        loop = self
        if self.needs_tokenizer and settings.llm_spec is not None:
            loop = self._copy(token_cut=load_token_cut(settings.llm_spec))
        return LoopMethod.run_tasks(loop, jobs, llm, settings)

    def run(
        self,
        tasks_and_retrievers: Sequence[tuple[Task, Retriever]],
        llm: LLM,
        *,
        final: str | None = None,
        top_k: int | None = None,
        sampling: Mapping[str, Any] | None = None,
        final_retrievers: Sequence[Retriever] | None = None,
    ) -> dict[str, AgenticResult]:
        """Run the loop for every query of every task in one batched loop.

        Args:
            tasks_and_retrievers: each task with the retriever searched inside its loop.
            llm: the (cached) LLM; every generation goes through it.
            final: overrides the constructor's ``final`` (``default`` or ``fuse``).
            top_k: overrides ``fuse_depth`` (documents kept per query by fusion).
            sampling: sampling overrides (``temperature``, ``max_tokens``, ``seed``, ...).
            final_retrievers: per task, the retriever of the final ranking, which ``fuse``
                searches with (default: the loop's retriever of that task).

        Returns:
            ``{task name: AgenticResult}``.
        """
        loop = self
        changes: dict[str, Any] = {}
        if final is not None and final != self.final:
            if final not in FINAL_MODES:
                raise ConfigError(f"final must be one of {', '.join(FINAL_MODES)}, got {final!r}")
            changes["final"] = final
        if top_k is not None and top_k != self.fuse_depth:
            if top_k < 1:
                raise ConfigError(f"top_k must be at least 1, got {top_k}")
            changes["fuse_depth"] = top_k
        if sampling:
            changes["params"] = apply_sampling_overrides(self.params, sampling)
        if changes:
            loop = self._copy(**changes)
        if final_retrievers is not None and len(final_retrievers) != len(tasks_and_retrievers):
            raise ValueError(
                f"{len(final_retrievers)} final retrievers for {len(tasks_and_retrievers)} tasks"
            )
        return loop._run(tasks_and_retrievers, llm, final_retrievers)

    def with_prompts(self, prompts_dir: str | PathLike[str]) -> ReasoningLoop:
        """This loop rendering its prompts from ``prompts_dir`` (an authors' templates folder, or
        a folder of the user's own over the package's)."""
        if self.prompts_dir is not None and Path(prompts_dir) == self.prompts_dir:
            return self
        return self._copy(prompts_dir=Path(prompts_dir), _hash=None)

    def _copy(self, **changes: Any) -> ReasoningLoop:
        other = copy.copy(self)
        for k, v in changes.items():
            setattr(other, k, v)
        return other

    def _run(
        self, tasks_and_retrievers: Sequence[tuple[Task, Retriever]], llm: LLM,
        final_retrievers: Sequence[Retriever] | None = None,
    ) -> dict[str, AgenticResult]:
        names = [t.name for t, _ in tasks_and_retrievers]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"task(s) given twice: {', '.join(dup)}")
        jobs = [
            LoopJob(ti, task, retriever, q)
            for ti, (task, retriever) in enumerate(tasks_and_retrievers)
            for q in task.queries
        ]
        outcome = self.run_loop(jobs, llm)
        by_task: dict[int, list[Trajectory]] = {}
        for traj in outcome.trajectories:
            by_task.setdefault(traj.job.task_index, []).append(traj)
        results: dict[str, AgenticResult] = {}
        for ti, (task, retriever) in enumerate(tasks_and_retrievers):
            trajs = by_task.get(ti, [])
            requests = tuple(self.final_request(t) for t in trajs)
            empty = sum(1 for r in requests if not r.expansion.strip())
            if empty:
                logger.warning("%s: %d of %d trajectories of %s ended with an empty final response",
                               self.name, empty, len(requests), task.name)
            traces = tuple(self.to_trace(t) for t in trajs)
            ranker = final_retrievers[ti] if final_retrievers is not None else retriever
            fused = self.fuse(trajs, requests, ranker) if self.final == "fuse" else None
            results[task.name] = AgenticResult(requests, traces, fused, tuple(outcome.steps))
        return results

    def final_request(self, traj: Trajectory) -> SearchRequest:
        q = traj.job.query
        return SearchRequest(query_id=q.query_id, query=q.text, expansion=traj.final, combine="reasoning")

    def fuse(self, trajs: Sequence[Trajectory], finals: Sequence[SearchRequest], retriever: Retriever) -> Run:
        """RRF, per trajectory, of every search the loop ran for it (each distinct query once;
        queries answered with a notice, and those of the final turn, were not run) plus its
        final request, all searched again with ``retriever`` to ``fuse_depth``; one search call."""
        requests: list[SearchRequest] = []
        owner: dict[str, str] = {}
        for traj, final_req in zip(trajs, finals):
            qid = traj.job.query.query_id
            for query in dict.fromkeys(traj.searches):
                rid = str(len(requests))
                requests.append(SearchRequest(query_id=rid, query=query))
                owner[rid] = qid
            rid = str(len(requests))
            requests.append(dataclasses.replace(final_req, query_id=rid))
            owner[rid] = qid
        run = retriever.search(requests, self.fuse_depth) if requests else {}
        lists: dict[str, list[Run]] = {}
        for rid, qid in owner.items():
            lists.setdefault(qid, []).append({qid: run.get(rid, {})})
        fused: Run = {}
        for traj in trajs:
            qid = traj.job.query.query_id
            fused.update(rrf(lists.get(qid, []), k=self.rrf_k, depth=self.fuse_depth))
            fused.setdefault(qid, {})
        return fused

    def to_trace(self, traj: Trajectory) -> Trace:
        extra: dict[str, Any] = {
            "task": traj.job.task.name,
            "query": traj.job.query.text,
            "turns": len(traj.steps),
            "searches": list(traj.searches),
            "issued": list(traj.issued),
            "answer": traj.answer,
            "generations": traj.generations,
            "cache_hits": traj.cache_hits,
            "llm_time_s": round(traj.llm_time_s, 4),
            "llm_time_new_s": round(traj.llm_time_new_s, 4),
        }
        if self.condenses:
            extra["condensed"] = list(traj.condensed)
        return Trace(
            query_id=traj.job.query.query_id,
            method=self.name,
            steps=tuple(traj.steps),
            final=traj.final,
            finish_reason=traj.finish_reason or "max_turns",
            extra=extra,
        )

