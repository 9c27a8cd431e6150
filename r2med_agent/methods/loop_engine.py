"""The engine of the reasoning-search loop: the steps of one run over every trajectory.

Each step generates for all unfinished trajectories in ONE ``llm.generate`` call, reads each
output (:func:`~r2med_agent.methods.loop_parsing.parse_output`), runs all searches the step asks
for with ONE ``retriever.search`` call per task, and, for methods that condense, makes ONE
Reason-in-Documents call over every trajectory that searched. What the steps say and insert is
the method's (:class:`LoopHooks`, which :class:`~r2med_agent.methods.loop.ReasoningLoop`
implements); the engine only schedules, batches and records.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

from r2med_agent.errors import DataError, LLMError
from r2med_agent.llm.base import LLM
from r2med_agent.methods.loop_parsing import Action, Parser, parse_output, reasoning_parser
from r2med_agent.methods.trajectory import LoopJob, LoopOutcome, PendingSearch, StepStats, Trajectory
from r2med_agent.types import Doc, Generation, Message, Query, SamplingParams, SearchRequest, Task

logger = logging.getLogger(__name__)


class LoopHooks(Protocol):
    """What the engine reads of a loop method (see :class:`~r2med_agent.methods.loop.ReasoningLoop`
    for each member)."""

    name: str
    params: SamplingParams
    max_turns: int
    final_turn: bool
    docs_per_search: int
    template_hash: str
    condenses: bool
    empty_actions: bool
    length_ends: bool

    def tags(self) -> dict[str, tuple[str, str]]: ...

    def initial_messages(self, task: Task, query: Query) -> list[Message]: ...

    def invalid_turn(self, traj: Trajectory) -> str | None: ...

    def blocked_search(self, traj: Trajectory, query: str, *, last_turn: bool) -> str | None: ...

    def insert_documents(self, traj: Trajectory, query: str, docs: Sequence[Doc]) -> str: ...

    def condense_messages(self, traj: Trajectory, body: str, query: str, docs: Sequence[Doc]) -> list[Message]: ...

    def condense_insert(self, gen: Generation) -> tuple[str, str]: ...

    def condense_params(self) -> SamplingParams: ...

    def final_response(self, traj: Trajectory, parse: Parser) -> str: ...

    def searches_left(self, traj: Trajectory) -> bool: ...


def ranked_doc_ids(scores: Mapping[str, float], k: int) -> list[str]:
    """Doc ids by descending score (ties by doc id, so the order is deterministic), top ``k``."""
    return [d for d, _ in sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]


def out_of_turns(loop: LoopHooks, traj: Trajectory) -> str:
    """Why a trajectory that ran out of steps ended: ``max_turns``, or ``max_searches`` when it
    had no search left either."""
    return "max_turns" if loop.searches_left(traj) else "max_searches"


class LoopSteps:
    """One run of ``loop``'s steps with ``llm``: every job's trajectory to its end.

    Steps ``0 .. max_turns - 1`` may search; with ``final_turn``, step ``max_turns`` is the final
    answer turn of the trajectories still unfinished, in which a search is not run.
    """

    def __init__(self, loop: LoopHooks, llm: LLM) -> None:
        self.loop = loop
        self.llm = llm
        self.lookups: dict[int, dict[str, Doc]] = {}  # task index -> its corpus by doc id

    def run(self, jobs: Sequence[LoopJob]) -> LoopOutcome:
        """The trajectories in job order (``final`` filled) and per-step statistics."""
        loop = self.loop
        trajs = [Trajectory(job=j, messages=loop.initial_messages(j.task, j.query)) for j in jobs]
        stats: list[StepStats] = []
        last_turn = loop.max_turns + (1 if loop.final_turn else 0)
        for turn in range(last_turn):
            active = [t for t in trajs if not t.finished]
            if not active:
                break
            stats.append(self._step(trajs, active, turn))
        parse = reasoning_parser(self.llm)
        for traj in trajs:
            if not traj.finished:
                traj.finish_reason = out_of_turns(loop, traj)
            traj.final = loop.final_response(traj, parse)
        return LoopOutcome(trajs, stats)

    def _generate(
        self, trajs: Sequence[Trajectory], prompts: list[list[Message]], params: SamplingParams, kind: str,
        turn: int,
    ) -> tuple[list[Generation], int]:
        """ONE ``llm.generate`` call; returns the generations and the backend calls it made."""
        llm = self.llm
        counters = getattr(llm, "stats", None)
        before = getattr(counters, "backend_calls", None)
        meta = [
            {"task": t.job.task.name, "query_id": t.job.query.query_id, "method": self.loop.name,
             "step": turn, "kind": kind}
            for t in trajs
        ]
        gens = llm.generate(prompts, params, sample_index=0, template_hash=self.loop.template_hash, meta=meta)
        if len(gens) != len(prompts):
            raise LLMError(
                f"{getattr(llm, 'model_id', 'the LLM')} returned {len(gens)} generations for {len(prompts)} prompts"
            )
        after = getattr(counters, "backend_calls", None)
        backend_calls = after - before if isinstance(before, int) and isinstance(after, int) else 1
        return list(gens), backend_calls

    def _step(self, trajs: Sequence[Trajectory], active: Sequence[Trajectory], turn: int) -> StepStats:
        """One step of the ``active`` trajectories: ONE generation call, the searches it asks
        for, and (methods that condense) ONE Reason-in-Documents call; returns its statistics."""
        loop = self.loop
        before = sum(1 for t in trajs if t.finished)
        gens, backend_calls = self._generate(active, [t.request_messages() for t in active], loop.params,
                                             "reason", turn)
        pending, notices = self._read_outputs(active, gens, turn)
        search_calls, docs_of = self._run_searches(pending)
        condense_calls = condense_backend_calls = 0
        if pending and loop.condenses:
            condense_calls = 1
            condense_backend_calls = self._condense(pending, docs_of, turn)
        else:
            for (traj, query, body, gen), docs in zip(pending, docs_of):
                traj.add_step(gen, body, search_query=query, doc_ids=[d.doc_id for d in docs],
                              inserted=loop.insert_documents(traj, query, docs))
        step = StepStats(
            turn=turn, active=len(active), generate_calls=1, backend_calls=backend_calls,
            condense_calls=condense_calls, condense_backend_calls=condense_backend_calls,
            search_calls=search_calls, searches=len(pending), notices=notices,
            finished=sum(1 for t in trajs if t.finished) - before,
        )
        logger.info(
            "%s step %d: %d active, %d searches, %d notices, %d finished; backend calls: "
            "%d generate, %d condense",
            loop.name, turn + 1, step.active, step.searches, step.notices, step.finished,
            step.backend_calls, step.condense_backend_calls,
        )
        return step

    def _read_outputs(
        self, active: Sequence[Trajectory], gens: Sequence[Generation], turn: int
    ) -> tuple[list[PendingSearch], int]:
        """Record each active trajectory's generated step (an answer, a search, a cut-off or
        failed output, or a step with neither, see ``invalid_turn``).

        Returns:
            The searches to run, in trajectory order, and how many notices replaced a search.
        """
        loop = self.loop
        closing = turn >= loop.max_turns  # the final turn: a search is not run
        tags = loop.tags()
        pending: list[PendingSearch] = []
        notices = 0
        for traj, gen in zip(active, gens):
            traj.count(gen)
            if gen.finish_reason == "error":
                logger.warning("%s: generation failed for %s/%s", loop.name, traj.job.task.name,
                               traj.job.query.query_id)
                traj.add_step(gen, gen.text)
                traj.finish_reason = "error"
                continue
            act = parse_output(gen.text, tags, stop_reason=gen.stop_reason,
                               finish_reason=gen.finish_reason, empty_ok=loop.empty_actions)
            if act.kind != "search":
                self._read_no_search(traj, gen, act, closing)
                continue
            outcome = self._read_search(traj, gen, act, turn, closing)
            if outcome == "run":
                pending.append((traj, act.content, act.body, gen))
            elif outcome == "notice":
                notices += 1
        return pending, notices

    def _read_search(self, traj: Trajectory, gen: Generation, act: Action, turn: int, closing: bool) -> str:
        """Record a step that asks for a search: ``"run"`` when the search is to run,
        ``"notice"`` when ``blocked_search`` inserted a notice instead, ``"ended"`` when the
        trajectory ends (the final turn, or over ``max_searches`` without a notice)."""
        loop = self.loop
        traj.issued.append(act.content)
        if closing:
            traj.add_step(gen, act.body, search_query=act.content)
            traj.finish_reason = out_of_turns(loop, traj)
            return "ended"
        notice = loop.blocked_search(traj, act.content, last_turn=turn == loop.max_turns - 1)
        if notice is not None:
            traj.add_step(gen, act.body, search_query=act.content, inserted=notice)
            return "notice"
        if not loop.searches_left(traj):  # over the limit and no notice for it
            traj.add_step(gen, act.body, search_query=act.content)
            traj.finish_reason = "max_searches"
            return "ended"
        return "run"

    def _read_no_search(self, traj: Trajectory, gen: Generation, act: Action, closing: bool) -> None:
        """Record a step without a search: an answer, an output cut at ``max_tokens``, or a
        step with neither (the method's ``invalid_turn`` decides)."""
        if act.kind == "answer":
            traj.add_step(gen, act.body)
            traj.answer = act.content
            traj.finish_reason = "answer"
        elif gen.finish_reason == "length" and self.loop.length_ends:
            traj.add_step(gen, act.body)
            traj.finish_reason = "length"
        else:
            fix = self.loop.invalid_turn(traj)
            if fix is None:  # the method reads a step without a search as the end
                traj.add_step(gen, act.body)
                traj.finish_reason = "answer"
            elif closing:
                traj.add_step(gen, act.body)
                traj.finish_reason = out_of_turns(self.loop, traj)
            else:
                traj.add_step(gen, act.body, inserted=fix)

    def _condense(self, pending: Sequence[PendingSearch], docs_of: Sequence[Sequence[Doc]], turn: int) -> int:
        """ONE Reason-in-Documents call over the step's searches; each trajectory gets the
        extracted information inserted. Returns the backend calls it made."""
        loop = self.loop
        prompts = [loop.condense_messages(t, b, q, docs) for (t, q, b, _), docs in zip(pending, docs_of)]
        cgens, backend_calls = self._generate([p[0] for p in pending], prompts, loop.condense_params(),
                                              "condense", turn)
        for (traj, query, body, gen), docs, cgen in zip(pending, docs_of, cgens):
            traj.count(cgen)
            ids = [d.doc_id for d in docs]
            if cgen.finish_reason == "error":
                logger.warning("%s: Reason-in-Documents failed for %s/%s", loop.name,
                               traj.job.task.name, traj.job.query.query_id)
                traj.add_step(gen, body, search_query=query, doc_ids=ids,
                              extra_tokens=(cgen.prompt_tokens, cgen.completion_tokens))
                traj.finish_reason = "error"
                continue
            info, inserted = loop.condense_insert(cgen)
            traj.condensed.append({
                "step": len(traj.steps), "raw": cgen.text, "information": info,
                "prompt_tokens": cgen.prompt_tokens, "completion_tokens": cgen.completion_tokens,
            })
            traj.add_step(gen, body, search_query=query, doc_ids=ids, inserted=inserted,
                          extra_tokens=(cgen.prompt_tokens, cgen.completion_tokens))
        return backend_calls

    def _run_searches(self, pending: Sequence[PendingSearch]) -> tuple[int, list[list[Doc]]]:
        """Run the step's searches, one ``retriever.search`` call per task.

        Returns ``(number of search calls, the documents of each search in pending order)`` and
        records each executed query on its trajectory.
        """
        k = self.loop.docs_per_search
        by_task: dict[int, list[int]] = {}
        for i, (traj, _, _, _) in enumerate(pending):
            by_task.setdefault(traj.job.task_index, []).append(i)
        found: list[list[Doc]] = [[] for _ in pending]
        for task_index, idxs in by_task.items():
            job = pending[idxs[0]][0].job
            requests = [SearchRequest(query_id=str(n), query=pending[i][1]) for n, i in enumerate(idxs)]
            run = job.retriever.search(requests, k)
            lookup = self.lookups.get(task_index)
            if lookup is None:
                lookup = self.lookups[task_index] = {d.doc_id: d for d in job.task.corpus}
            for n, i in enumerate(idxs):
                ids = ranked_doc_ids(run.get(str(n), {}), k)
                missing = [d for d in ids if d not in lookup]
                if missing:
                    raise DataError(
                        f"retriever returned doc ids not in the corpus of {job.task.name}: "
                        f"{', '.join(missing[:5])}"
                    )
                found[i] = [lookup[d] for d in ids]
        for traj, query, _, _ in pending:
            traj.searches.append(query)
        return len(by_task), found
