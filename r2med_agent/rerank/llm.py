"""LLM rerankers that reason about relevance: listwise permutation generation and pointwise
reasoning judgments, over the top documents of a first-stage run.

**Listwise** (``kind: listwise``, as RankGPT): the model reads a window of candidates (each cut to
``max_doc_words`` whitespace-separated words and numbered ``[1]``, ``[2]``, ... by its position in
the window, never by its document id) and writes their order, ``[2] > [1] > [3]``. Windows slide
from the bottom of the top ``k`` upward: with the defaults (window 20, step 10, top 100) they are
ranks 81-100, 71-90, ..., 1-20, nine windows, each re-ordering what the one below it promoted.
:func:`window_positions` gives the windows (when the list is not a multiple of the step, the last
window is moved down to rank 1, so the top of the list is always read). The model's order is
repaired (:func:`parse_permutation`): numbers out of range and repeated numbers are dropped,
and candidates it left out keep their relative order after the ones it named; each kind of
repair is counted in the traces and the result's stats.

**Pointwise reasoning** (``kind: pointwise-reasoning``): for each (query, document) pair the
model reasons and ends with ``Relevant: yes`` or ``Relevant: no``. A reasoning model's
``<think>`` block is split off by the model's reasoning-output parser, and the judgment is read
from the final response (:func:`parse_judgment`). Where the backend returns log-probabilities
(vLLM, or an OpenAI-compatible vLLM server), a second request continues the model's own answer up
to ``Relevant:`` and asks for one token with the top 20 log-probabilities: the score is
P(yes) / (P(yes) + P(no)) summed over the token spellings of each word
(:func:`yes_probability`). Elsewhere (llama.cpp, hosted APIs, which cannot continue an answer)
the parsed judgment is the score: 1 for yes, 0 for no, 0.5 when none was found. Ties keep the
first-stage order.

**Published formats** (``format:`` of the entry): ReasonRank's and InsertRank's listwise prompts
and Rank1's pointwise one, with their own answer reading and scores
(:mod:`~r2med_agent.rerank.formats`); InsertRank's scores are those of the run being
reranked.

Batching, as the reasoning loops: the listwise reranker makes ONE ``generate`` call per window
position for all queries of all tasks (nine calls for the top 100), the pointwise reranker one
call for all pairs (two with log-probabilities). Every call goes through the generation cache,
so a killed rerank resumes with what is cached. Each query's permutations or judgments are
returned as a :class:`~r2med_agent.types.Trace` (``trace show`` reads them).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from r2med_agent.prompts import templates as prompts
from r2med_agent.errors import ConfigError
from r2med_agent.rerank import formats, listwise, pointwise, tokens
from r2med_agent.rerank.answers import (
    JUDGMENT_MARKER,
    Repair,
    cut_words,
    judgment_prefix,
    parse_judgment,
    parse_permutation,
    permutation_of,
    read_window,
    reasonrank_permutation,
    window_positions,
    yes_probability,
)
from r2med_agent.rerank.listwise import SCORE_DECIMALS
from r2med_agent.rerank.llm_jobs import (
    RerankJob,
    RerankOutput,
    RerankQuery,
    generation_stats,
    ranked_requests,
)
from r2med_agent.rerank.pointwise import TOP_LOGPROBS
from r2med_agent.types import Message, Run, SamplingParams, SearchRequest, Task

__all__ = [
    "JUDGMENT_MARKER", "LLM_KINDS", "PROMPT_FOLDERS", "SCORE_DECIMALS", "TOP_LOGPROBS", "LLMReranker", "Repair",
    "RerankJob", "RerankOutput", "RerankQuery", "cut_words", "judgment_prefix", "parse_judgment",
    "parse_permutation", "permutation_of", "prompt_folder", "ranked_requests", "read_window",
    "reasonrank_permutation", "window_positions", "yes_probability",
]
"""The LLM reranker and the names it is built from: reading answers
(:mod:`~r2med_agent.rerank.answers`), jobs and per-query state
(:mod:`~r2med_agent.rerank.llm_jobs`), and its two ways of reranking
(:mod:`~r2med_agent.rerank.listwise`, :mod:`~r2med_agent.rerank.pointwise`)."""

logger = logging.getLogger(__name__)

LLM_KINDS = ("listwise", "pointwise-reasoning")
"""``kind`` values of ``configs/rerankers.yaml`` entries reranked by an LLM."""

PROMPT_FOLDERS = {"listwise": "rerank-listwise", "pointwise-reasoning": "rerank-pointwise"}
"""Prompt folder of each kind: ``prompts/<folder>/<family>.j2``; a ``format`` other than
``default`` has its own, ``<folder>-<format>`` (:func:`prompt_folder`)."""


def prompt_folder(kind: str, fmt: str = "default") -> str:
    """The prompt folder of a reranker kind and format (``rerank-listwise-reasonrank``...)."""
    return PROMPT_FOLDERS[kind] if fmt == "default" else f"{PROMPT_FOLDERS[kind]}-{fmt}"


class LLMReranker:
    """A listwise or pointwise-reasoning reranker over an LLM of the registry.

    Args:
        spec: the reranker's entry (``RerankerSpec`` with ``kind`` and ``llm``).
        llm: the LLM to use (a :class:`~r2med_agent.llm.CachedLLM`); None builds ``spec.llm``
            with :func:`~r2med_agent.llm.make_llm` and the cache options below on first use.
        cache_path, use_cache, refresh, chunk_size: as for ``make_llm``.
        prompts_dir: a folder of prompt files overriding the package's.
    """

    batches_tasks = True

    def __init__(
        self,
        spec: Any,
        *,
        llm: Any = None,
        cache_path: Any = None,
        use_cache: bool = True,
        refresh: bool = False,
        chunk_size: Any = "auto",
        prompts_dir: Any = None,
    ) -> None:
        if spec.kind not in LLM_KINDS:
            raise ConfigError(f"reranker '{spec.name}' is not an LLM reranker (kind {spec.kind})")
        self.spec = spec
        self.name = spec.name
        self.kind = spec.kind
        self.format = getattr(spec, "format", "default")
        self.folder = prompt_folder(spec.kind, self.format)
        self._llm = llm
        self._llm_opts = dict(cache_path=cache_path, use_cache=use_cache, refresh=refresh, chunk_size=chunk_size)
        self.prompts_dir = prompts_dir
        self._cut: tokens.PassageCut | None = None

    # -- setup ---------------------------------------------------------------------------------

    def llm_spec(self) -> Any:
        from r2med_agent.llm.registry import get_llm_spec

        return get_llm_spec(self.spec.llm)

    def check(self) -> None:
        """Fail now (ConfigError) on an unknown LLM or a missing prompt; loads nothing."""
        self.llm_spec()
        for family in ("qa", "exam", "treatment", "case"):
            prompts.template_hash(self.folder, family, prompts_dir=self.prompts_dir)

    def share_llm(self, llm: Any) -> None:
        """Use ``llm`` (the run's own, when it is this reranker's LLM) unless one is built."""
        if self._llm is None:
            self._llm = llm

    @property
    def built_llm(self) -> Any:
        """The LLM if it was built or given, else None (nothing is built)."""
        return self._llm

    @property
    def llm(self) -> Any:
        if self._llm is None:
            from r2med_agent.llm import make_llm

            self._llm = make_llm(self.spec.llm, **self._llm_opts)
        return self._llm

    def passage_cut(self) -> tokens.PassageCut:
        """The token cut of the LLM's tokenizer (loaded once; see
        :mod:`~r2med_agent.rerank.tokens`): the built LLM's entry, else the registry's."""
        if self._cut is None:
            spec = getattr(self._llm, "spec", None) if self._llm is not None else None
            if spec is None:
                try:
                    spec = self.llm_spec()
                except ConfigError:
                    spec = None
            self._cut = tokens.load_passage_cut(spec)
        return self._cut

    def prepared(self, text: str) -> str:
        """A candidate's text as the prompt shows it: stripped and repaired by ftfy
        (``fix_text``), then cut to ``max_doc_tokens`` tokens of the LLM's tokenizer, or else to
        ``max_doc_words`` words. Rank1's passages go as they are; ``max_doc_tokens`` is then a
        guard that cuts only a passage longer than that."""
        spec = self.spec
        if self.format == "rank1":  # Rank1 sends a passage as it is; the guard cuts only a longer one
            n = getattr(spec, "max_doc_tokens", 0)
            return self.passage_cut().cut(text, n) if n and self.passage_cut().count(text) > n else text
        if getattr(spec, "fix_text", False):
            text = tokens.fix_text(text.strip())
        if getattr(spec, "max_doc_tokens", 0):
            return self.passage_cut().cut(text, spec.max_doc_tokens)
        return cut_words(text, spec.max_doc_words)

    def cut_stats(self) -> dict[str, Any]:
        """How the passages were cut, for the stats (empty when not by tokens)."""
        return {"passage_cut": self.passage_cut().how} if getattr(self.spec, "max_doc_tokens", 0) else {}

    def sampling(self) -> SamplingParams:
        """The LLM's default sampling with the entry's temperature, top_p and token limit."""
        llm_spec = getattr(self.llm, "spec", None)
        if llm_spec is None and self._llm is None:
            llm_spec = self.llm_spec()
        if llm_spec is None:  # an LLM given without a registry entry: the defaults
            params = SamplingParams(temperature=self.spec.temperature)
        else:
            params = llm_spec.sampling_params(temperature=self.spec.temperature)
        if self.spec.max_tokens:
            params = replace(params, max_tokens=self.spec.max_tokens)
        if getattr(self.spec, "top_p", 0.0):
            params = replace(params, top_p=self.spec.top_p)
        return params

    def returns_logprobs(self) -> bool:
        """Whether the LLM's backend returns log-probabilities and continues an answer (vLLM
        offline, or an OpenAI-compatible vLLM server)."""
        return self._backend_can("returns_logprobs", ("vllm",))

    def scores_choices(self) -> bool:
        """Whether the LLM's backend scores a next token restricted to given choices
        (``SamplingParams.token_choices``): vLLM offline, a vLLM server, or local llama.cpp."""
        return self._backend_can("scores_choices", ("vllm", "local"))

    def _backend_can(self, capability: str, backends: tuple[str, ...]) -> bool:
        """Whether the LLM's registry entry has one of ``backends`` or is an OpenAI-compatible
        vLLM server; for an LLM built without an entry, the backend's ``capability`` attribute."""
        spec = getattr(self.llm, "spec", None)
        if spec is None:  # an LLM built without a registry entry: the backend says
            backend = getattr(self.llm, "backend", self.llm)
            return bool(getattr(backend, capability, False))
        if spec.backend in backends:
            return True
        if spec.backend == "openai":
            from r2med_agent.llm.servers import resolve_server

            return resolve_server(spec) == "vllm"
        return False

    # -- reranking -----------------------------------------------------------------------------

    def rerank(self, requests: Sequence[SearchRequest], run: Run, corpus: Mapping[str, str], k: int,
               task: Task | None = None) -> Run:
        """One task's run reranked (see :meth:`rerank_tasks` for all tasks in one batch)."""
        if task is None:
            raise ValueError("an LLM reranker needs the task (its family decides the prompt)")
        return self.rerank_tasks([RerankJob(task, requests, run, corpus)], k)[0].run

    def rerank_tasks(self, jobs: Sequence[RerankJob], k: int) -> list[RerankOutput]:
        """Rerank the top ``k`` of every query of every job, batched over all of them."""
        queries = [RerankQuery(j, job.task, req, items[:k], items[k:], job.corpus, first=job.run.get(req.query_id, {}))
                   for j, job, req, items in ranked_requests(jobs, k)]
        if self.kind == "listwise":
            listwise.rerank_windows(self, queries)
        elif self.format == "rank1":
            pointwise.rank1(self, queries)
        else:
            pointwise.judge(self, queries)
        return self._outputs(jobs, queries)

    def prompt(self, task: Task, **variables: Any) -> list[Message]:
        """The messages of one prompt: the template's text as the user turn; ReasonRank's system
        message before it; for Rank1 the text alone, as an assistant message to be continued
        (a conversation of one assistant message is raw text, no chat template)."""
        path = f"{self.folder}/{task.family}.j2"
        text = prompts.render(path, prompts_dir=self.prompts_dir, domain=task.domain, **variables).rstrip()
        if self.format == "rank1":
            return [{"role": "assistant", "content": text}]
        if self.format == "reasonrank":
            messages = [{"role": "system", "content": formats.REASONRANK_SYSTEM}, {"role": "user", "content": text}]
        else:
            messages = [{"role": "user", "content": text}]
        if getattr(self.spec, "fix_text", False):  # ReasonRank repairs the whole rendered prompt too
            messages = [{**m, "content": tokens.fix_text(m["content"], in_prompt=True)} for m in messages]
        return messages

    def template_hash(self, task: Task) -> str:
        """The version hash of the task's prompt template (part of each cache key)."""
        return prompts.template_hash(self.folder, task.family, prompts_dir=self.prompts_dir)

    def meta(self, q: RerankQuery, **extra: Any) -> dict[str, Any]:
        """What the cache records of a request: its task, query and reranker (not in the key)."""
        return {"task": q.task.name, "query_id": q.request.query_id, "method": f"rerank-{self.kind}",
                "reranker": self.name, **extra}

    def _outputs(self, jobs: Sequence[RerankJob], queries: list[RerankQuery]) -> list[RerankOutput]:
        """Each task's reranked run, a trace per query, and the task's statistics."""
        outputs = [RerankOutput({}, []) for _ in jobs]
        for q in queries:
            extra: dict[str, Any] = {"task": q.task.name, "query": q.request.query, "reranker": self.name,
                                     "kind": self.kind}
            if self.format != "default":
                extra["format"] = self.format
            extra["windows" if self.kind == "listwise" else "judgments"] = q.records
            out = outputs[q.job]
            out.run[q.request.query_id] = q.reranked_run()
            out.traces.append(q.trace(f"rerank-{self.kind}", extra))
        for j, out in enumerate(outputs):
            mine = [q for q in queries if q.job == j]
            records = [r for q in mine for r in q.records]
            stats: dict[str, Any] = {"reranker": self.name, "kind": self.kind, "llm": self.spec.llm,
                                     **generation_stats([g for q in mine for g in q.gens])}
            if self.format != "default":
                stats["format"] = self.format
            stats.update(self.cut_stats())
            if self.kind == "listwise":
                stats.update(listwise.window_stats(records, self.format))
            else:
                stats.update(pointwise.judgment_stats(records, self.format))
            out.stats = stats
        return outputs
