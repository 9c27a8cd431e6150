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
(:mod:`~r2med_agent.retrieval.rerank.formats`); InsertRank's scores are those of the run being
reranked.

Batching, as the reasoning loops: the listwise reranker makes ONE ``generate`` call per window
position for all queries of all tasks (nine calls for the top 100), the pointwise reranker one
call for all pairs (two with log-probabilities). Every call goes through the generation cache,
so a killed rerank resumes with what is cached. Each query's permutations or judgments are
returned as a :class:`~r2med_agent.types.Trace` (``trace show`` reads them).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from r2med_agent import prompt_templates as prompts
from r2med_agent.errors import ConfigError, DataError
from r2med_agent.progress import part as progress_part
from r2med_agent.retrieval.fusion import ranked
from r2med_agent.retrieval.rerank import formats, tokens
from r2med_agent.retrieval.rerank.base import RerankJob, RerankOutput  # noqa: F401 - the batch protocol's records
from r2med_agent.types import Generation, Run, SamplingParams, SearchRequest, Task, Trace, TraceStep

logger = logging.getLogger(__name__)

LLM_KINDS = ("listwise", "pointwise-reasoning")
"""``kind`` values of ``configs/rerankers.yaml`` entries reranked by an LLM."""

PROMPT_FOLDERS = {"listwise": "rerank-listwise", "pointwise-reasoning": "rerank-pointwise"}
"""Prompt folder of each kind: ``prompts/<folder>/<family>.j2``; a ``format`` other than
``default`` has its own, ``<folder>-<format>`` (:func:`prompt_folder`)."""


def prompt_folder(kind: str, fmt: str = "default") -> str:
    """The prompt folder of a reranker kind and format (``rerank-listwise-reasonrank``...)."""
    return PROMPT_FOLDERS[kind] if fmt == "default" else f"{PROMPT_FOLDERS[kind]}-{fmt}"

JUDGMENT_MARKER = "Relevant:"
"""What the pointwise prompt asks the answer to end with, before ``yes`` or ``no``."""

SCORE_DECIMALS = 3
"""InsertRank: decimals of the first-stage score shown beside each candidate."""

TOP_LOGPROBS = 20
"""Alternatives asked for at the judgment position (vLLM's and OpenAI's limit)."""

_MARKER_RE = re.compile(r"relevan(?:t|ce)\s*[:\-]", re.IGNORECASE)
_JUDGMENT_RE = re.compile(r"relevan(?:t|ce)\W{0,6}(yes|no)\b", re.IGNORECASE)
_YES_NO_RE = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_BRACKETED_RE = re.compile(r"\[\s*(\d+)\s*\]")
_NUMBER_RE = re.compile(r"\d+")


# --------------------------------------------------------------------------- pure parts


def window_positions(n: int, window: int, step: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` slices the listwise reranker reads, in order, for a list of ``n``.

    From the bottom up: ``(n - window, n)``, then each ``step`` higher, the last one starting at
    0. ``window_positions(100, 20, 10)`` is ``(80, 100), (70, 90), ..., (0, 20)``.
    """
    if window < 1 or step < 1:
        raise ValueError("window and step must be at least 1")
    out: list[tuple[int, int]] = []
    end = n
    while n > 0:
        start = max(end - window, 0)
        out.append((start, end))
        if start == 0:
            break
        end -= step
    return out


@dataclass(frozen=True)
class Repair:
    """What :func:`parse_permutation` had to fix in one answer."""

    missing: int = 0
    """Candidates the answer did not name (appended in their window order)."""
    repeated: int = 0
    """Numbers named again after their first mention (ignored)."""
    out_of_range: int = 0
    """Numbers that are not a position of the window (ignored)."""

    @property
    def any(self) -> bool:
        return bool(self.missing or self.repeated or self.out_of_range)

    def to_dict(self) -> dict[str, int]:
        return {"missing": self.missing, "repeated": self.repeated, "out_of_range": self.out_of_range}


def parse_permutation(text: str, size: int) -> tuple[list[int], Repair]:
    """The order an answer gives to a window of ``size`` candidates, as 0-based positions.

    The bracketed numbers of the answer (``[3] > [1]``) are read, or its bare numbers when it
    has none. A number outside 1..``size`` or named a second time is dropped; candidates never
    named follow in their window order. The result is always a permutation of ``range(size)``.
    """
    return permutation_of([int(t) for t in _BRACKETED_RE.findall(text) or _NUMBER_RE.findall(text)], size)


def permutation_of(numbers: Sequence[int], size: int) -> tuple[list[int], Repair]:
    """The permutation of ``range(size)`` that 1-based ``numbers`` name, repaired as
    :func:`parse_permutation` says (the first mention counts; candidates never named follow in
    their window order)."""
    order: list[int] = []
    seen: set[int] = set()
    repeated = out_of_range = 0
    for number in numbers:
        i = number - 1
        if not 0 <= i < size:
            out_of_range += 1
        elif i in seen:
            repeated += 1
        else:
            seen.add(i)
            order.append(i)
    missing = [i for i in range(size) if i not in seen]
    return order + missing, Repair(len(missing), repeated, out_of_range)


def parse_judgment(text: str) -> bool | None:
    """The yes/no relevance judgment at the end of an answer (None when there is none).

    ``Relevant: yes`` (any case, with markup such as ``**Relevant:** no``) counts first, the last
    one when several; otherwise the last stand-alone ``yes`` or ``no`` of the answer.
    """
    matches = _JUDGMENT_RE.findall(text) or _YES_NO_RE.findall(text)
    if not matches:
        return None
    return matches[-1].lower() == "yes"


def yes_probability(top: Sequence[tuple[str, float]] | None) -> float | None:
    """P(yes) / (P(yes) + P(no)) from one position's top tokens and their log-probabilities.

    Every spelling of each word counts (``yes``, `` Yes``, ``YES``: the token stripped and
    lower-cased); None when neither word is among the tokens.
    """
    if not top:
        return None
    yes = sum(math.exp(lp) for tok, lp in top if tok.strip().lower() == "yes")
    no = sum(math.exp(lp) for tok, lp in top if tok.strip().lower() == "no")
    if yes + no <= 0.0:
        return None
    return yes / (yes + no)


def judgment_prefix(text: str) -> str:
    """The answer up to and including its last ``Relevant:``, to be continued by one token; an
    answer without one gets the marker appended on a line of its own."""
    last = None
    for m in _MARKER_RE.finditer(text):
        last = m
    if last is not None:
        return text[: last.end()]
    return text.rstrip() + "\n\n" + JUDGMENT_MARKER


def cut_words(text: str, max_words: int) -> str:
    """The first ``max_words`` whitespace-separated words of ``text`` on one line."""
    return " ".join(text.split()[:max_words])


def reasonrank_permutation(answer: str, size: int) -> tuple[list[int], Repair, bool]:
    """The order ReasonRank reads from an answer block (``receive_permutation``): every run of
    digits in it is a number, whatever surrounds it; then as :func:`permutation_of`. When a run of
    digits is no number (``int`` refuses it, e.g. superscript digits) ReasonRank leaves the window
    as it was: the third value is then False."""
    numbers = formats.reasonrank_numbers(answer)
    if numbers is None:
        return list(range(size)), Repair(), False
    order, repair = permutation_of(numbers, size)
    return order, repair, True


# --------------------------------------------------------------------------- reranker


@dataclass
class _Query:
    job: int
    task: Task
    request: SearchRequest
    head: list[str]
    tail: list[str]
    corpus: Mapping[str, str]
    first: Mapping[str, float] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    """Each candidate's text as the prompt shows it (cut once, read by every window)."""
    gens: list[Generation] = field(default_factory=list)
    windows: list[tuple[int, int]] = field(default_factory=list)
    steps: list[TraceStep] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)


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
        :mod:`~r2med_agent.retrieval.rerank.tokens`): the built LLM's entry, else the registry's."""
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
            from r2med_agent.llm.openai_compat import resolve_server

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
        queries = [_Query(j, job.task, req, items[:k], items[k:], job.corpus, first=job.run.get(req.query_id, {}))
                   for j, job, req, items in ranked_requests(jobs, k)]
        if self.kind == "listwise":
            self._listwise(queries)
        elif self.format == "rank1":
            self._rank1(queries)
        else:
            self._pointwise(queries)
        return self._outputs(jobs, queries)

    def _prompt(self, task: Task, **variables: Any) -> list[dict[str, str]]:
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

    def _hash(self, task: Task) -> str:
        return prompts.template_hash(self.folder, task.family, prompts_dir=self.prompts_dir)

    def _window_prompt(self, q: _Query, start: int, end: int) -> list[dict[str, str]]:
        """One window's prompt: its candidates cut to ``max_doc_words`` in window order (ReasonRank:
        bracketed numbers rewritten; InsertRank: each with its first-stage score)."""
        shown = q.head[start:end]
        passages = [self._shown_text(q, d) for d in shown]
        query = q.request.query
        extra: dict[str, Any] = {}
        if self.format == "reasonrank":
            query = formats.replace_numbers(query).strip()
        elif self.format == "insertrank":
            extra["scores"] = [f"{q.first[d]:.{SCORE_DECIMALS}f}" for d in shown]
        return self._prompt(q.task, query=query, passages=passages, **extra)

    def _shown_text(self, q: _Query, doc_id: str) -> str:
        """A candidate as a window shows it (:meth:`prepared`; ReasonRank: its bracketed numbers
        rewritten), made once per query."""
        if doc_id not in q.texts:
            text = self.prepared(self._corpus_text(q, doc_id))
            q.texts[doc_id] = formats.replace_numbers(text) if self.format == "reasonrank" else text
        return q.texts[doc_id]

    def _read_window(self, gen: Generation, size: int) -> tuple[list[int], Repair, dict[str, Any]]:
        """A window's order from its answer, and what the window's record adds (ReasonRank: its
        answer block; read strictly, whether its numbers could be read at all)."""
        if self.format != "reasonrank":
            order, repair = parse_permutation(gen.final, size)
            return order, repair, {}
        answer, block = formats.answer_block(gen.text)
        if getattr(self.spec, "parse", "lenient") != "strict":
            order, repair = parse_permutation(answer, size)
            return order, repair, {"answer_block": block}
        order, repair, readable = reasonrank_permutation(answer, size)
        return order, repair, {"answer_block": block, "readable": readable}

    def _meta(self, q: _Query, **extra: Any) -> dict[str, Any]:
        return {"task": q.task.name, "query_id": q.request.query_id, "method": f"rerank-{self.kind}",
                "reranker": self.name, **extra}

    def _listwise(self, queries: list[_Query]) -> None:
        spec = self.spec
        positions = {id(q): [q.first[d] for d in q.head] for q in queries}  # the first-stage score of each rank
        for q in queries:
            q.windows = window_positions(len(q.head), spec.window, spec.step)
        params = self.sampling()
        position = 0
        while True:
            batch = [q for q in queries if position < len(q.windows)]
            if not batch:
                break
            prompts_, hashes, metas = [], [], []
            for q in batch:
                start, end = q.windows[position]
                prompts_.append(self._window_prompt(q, start, end))
                hashes.append(self._hash(q.task))
                metas.append(self._meta(q, window=[start, end]))
            logger.info("%s: window %d, %d queries in one batch", self.name, position + 1, len(batch))
            outs = self.llm.generate(prompts_, params, template_hash=hashes, meta=metas)
            for q, gen in zip(batch, outs):
                q.gens.append(gen)
                start, end = q.windows[position]
                shown = q.head[start:end]
                order, repair, read = self._read_window(gen, len(shown))
                q.head[start:end] = [shown[i] for i in order]
                q.records.append({"start": start, "end": end, "permutation": [i + 1 for i in order],
                                  **repair.to_dict(), "finish_reason": gen.finish_reason, **read})
                note = " > ".join(f"[{i + 1}]" for i in order)
                if read.get("readable") is False:
                    note += " (its numbers could not be read: the window keeps its order)"
                if repair.any:
                    note += " (repaired: " + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in repair.to_dict().items() if n) + ")"
                q.steps.append(TraceStep(
                    generated=gen.text, search_query=f"ranks {start + 1}-{end}", doc_ids=tuple(shown),
                    inserted=note, prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens,
                ))
            position += 1
        for q in queries:
            if getattr(spec, "run_scores", "rank") == "positional":
                q.scores = [float(f"{s:.6f}") for s in positions[id(q)]]
            else:
                q.scores = [float(len(q.head) - i) for i in range(len(q.head))]

    def _judge_pairs(
        self, queries: list[_Query], params: SamplingParams,
    ) -> tuple[list[tuple[_Query, str]], list[Any], list[str], list[Generation]]:
        """Every (query, document) pair of the top ``k``, its prompt and template hash, and the
        answers of ONE generate call for all of them (each kept with its query)."""
        pairs = [(q, d) for q in queries for d in q.head]
        prompts_ = [
            self._prompt(q.task, query=q.request.query, document=self.prepared(self._corpus_text(q, d)))
            for q, d in pairs
        ]
        hashes = [self._hash(q.task) for q, _ in pairs]
        logger.info("%s: %d (query, document) pairs in one batch", self.name, len(pairs))
        first = self.llm.generate(prompts_, params, template_hash=hashes,
                                  meta=[self._meta(q, doc_id=d) for q, d in pairs])
        for (q, _), g in zip(pairs, first):
            q.gens.append(g)
        return pairs, prompts_, hashes, first

    def _pointwise(self, queries: list[_Query]) -> None:
        params = self.sampling()
        pairs, prompts_, hashes, first = self._judge_pairs(queries, params)
        probs: list[float | None] = [None] * len(pairs)
        if pairs and self.returns_logprobs():
            judge = replace(params, temperature=0.0, max_tokens=1, stop=(), logprobs=TOP_LOGPROBS)
            follow = [p + [{"role": "assistant", "content": judgment_prefix(g.text)}] for p, g in zip(prompts_, first)]
            with progress_part("(the one-token judgment of each answer)"):
                second = self.llm.generate(follow, judge, template_hash=hashes,
                                           meta=[self._meta(q, doc_id=d, step="judgment") for q, d in pairs])
            for (q, _), g in zip(pairs, second):
                q.gens.append(g)
            probs = [yes_probability(g.logprobs[0] if g.logprobs else None) for g in second]
        for (q, d), gen, p in zip(pairs, first, probs):
            judged = parse_judgment(gen.final)
            score = p if p is not None else (0.5 if judged is None else float(judged))
            q.scores.append(score)
            q.records.append({"doc_id": d, "judgment": None if judged is None else ("yes" if judged else "no"),
                              "p_yes": None if p is None else round(p, 6), "score": round(score, 6),
                              "finish_reason": gen.finish_reason})
            label = "none found" if judged is None else ("yes" if judged else "no")
            note = f"judgment: {label}; " + (f"P(yes) = {p:.4f}" if p is not None else "score from the judgment")
            q.steps.append(TraceStep(generated=gen.text, doc_ids=(d,), inserted=note,
                                     prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens))
        _sort_by_score(queries)

    def _rank1(self, queries: list[_Query]) -> None:
        """Rank1 (:mod:`~r2med_agent.retrieval.rerank.formats`): all pairs in one call that stops
        at the judgment token; the score is P(true) of that token. With log-probabilities of the
        generation (vLLM), as Rank1 does: read at the stop, and the answers lacking both tokens
        among the top ones are ended by force in one more call restricted to the two tokens.
        A backend that scores token choices but returns no generation log-probabilities (local
        llama.cpp) scores every answer in that one more call: a finished one right after its
        ``</think>``, an unfinished one ended by force. Without either, the parsed judgment
        (1, 0, or 0.5 when none)."""
        logprobs, choices = self.returns_logprobs(), self.scores_choices()
        params = replace(self.sampling(), stop=formats.RANK1_STOPS, logprobs=TOP_LOGPROBS if logprobs else 0)
        pairs, prompts_, hashes, first = self._judge_pairs(queries, params)
        probs = [formats.true_probability(g.logprobs[-1]) if logprobs and g.logprobs else None for g in first]
        later = [i for i, p in enumerate(probs) if p is None] if choices else []
        forced = {i for i in later if logprobs or first[i].stop_reason not in formats.RANK1_STOPS}
        if later:
            end = replace(params, temperature=0.0, max_tokens=1, stop=(), logprobs=0,
                          token_choices=(formats.RANK1_TRUE, formats.RANK1_FALSE))
            follow = [[{"role": "assistant", "content": formats.judgment_point(
                prompts_[i][0]["content"], first[i].text, force=i in forced)}] for i in later]
            # The same pairs again: said so in the log line and the progress of this second batch.
            with progress_part(f"(the judgment token of each answer, {len(forced)} of them ended by force)"):
                second = self.llm.generate(follow, end, template_hash=[hashes[i] for i in later], meta=[
                    self._meta(pairs[i][0], doc_id=pairs[i][1], step="forced end" if i in forced else "judgment")
                    for i in later])
            for i, g in zip(later, second):
                pairs[i][0].gens.append(g)
                probs[i] = formats.true_probability(g.logprobs[0] if g.logprobs else None)
        for i, ((q, d), gen, p) in enumerate(zip(pairs, first, probs)):
            judged = formats.rank1_judgment(gen.text, gen.stop_reason)
            fallback = 0.5 if choices or judged is None else float(judged)
            score = p if p is not None else fallback
            q.scores.append(score)
            q.records.append({"doc_id": d, "judgment": None if judged is None else ("true" if judged else "false"),
                              "p_true": None if p is None else round(p, 6), "score": round(score, 6),
                              "forced": i in forced, "finish_reason": gen.finish_reason})
            label = "none found" if judged is None else ("true" if judged else "false")
            how = f"P(true) = {p:.4f}" if p is not None else ("no judgment token: 0.5" if choices else "score from the judgment")
            note = f"judgment: {label}; {how}" + ("; thinking ended by force" if i in forced else "")
            q.steps.append(TraceStep(generated=gen.text, doc_ids=(d,), inserted=note,
                                     prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens))
        _sort_by_score(queries)

    @staticmethod
    def _corpus_text(q: _Query, doc_id: str) -> str:
        return q.corpus[doc_id]

    def _outputs(self, jobs: Sequence[RerankJob], queries: list[_Query]) -> list[RerankOutput]:
        outputs = [RerankOutput({}, []) for _ in jobs]
        for q in queries:
            new = {d: s for d, s in zip(q.head, q.scores)}
            floor = min(q.scores) if q.scores else 0.0
            for j, d in enumerate(q.tail, start=1):
                new[d] = floor - j
            out = outputs[q.job]
            out.run[q.request.query_id] = new
            extra: dict[str, Any] = {"task": q.task.name, "query": q.request.query, "reranker": self.name,
                                     "kind": self.kind}
            if self.format != "default":
                extra["format"] = self.format
            extra["windows" if self.kind == "listwise" else "judgments"] = q.records
            out.traces.append(Trace(
                query_id=q.request.query_id, method=f"rerank-{self.kind}", steps=tuple(q.steps),
                final="reranked: " + ", ".join(q.head), finish_reason="stop", extra=extra,
            ))
        for j, out in enumerate(outputs):
            mine = [q for q in queries if q.job == j]
            records = [r for q in mine for r in q.records]
            gens = [g for q in mine for g in q.gens]
            made = [g for g in gens if not g.cached]
            stats: dict[str, Any] = {
                "reranker": self.name, "kind": self.kind, "llm": self.spec.llm,
                "generations": len(made),
                "cache_hits": len(gens) - len(made),
                "prompt_tokens": sum(g.prompt_tokens for g in gens),
                "completion_tokens": sum(g.completion_tokens for g in gens),
                "llm_time_s": round(sum(g.latency_s for g in gens), 4),
                "llm_time_new_s": round(sum(g.latency_s for g in made), 4),
            }
            if self.format != "default":
                stats["format"] = self.format
            stats.update(self.cut_stats())
            if self.kind == "listwise":
                stats["windows"] = len(records)
                stats["repairs"] = {k: sum(r[k] for r in records) for k in ("missing", "repeated", "out_of_range")}
                stats["answers_repaired"] = sum(1 for r in records if r["missing"] or r["repeated"] or r["out_of_range"])
                if self.format == "reasonrank":
                    stats["no_answer_block"] = sum(1 for r in records if not r["answer_block"])
                    stats["unreadable_answers"] = sum(1 for r in records if r.get("readable") is False)
            else:
                stats["pairs"] = len(records)
                prob = "p_true" if self.format == "rank1" else "p_yes"
                stats["scored_by_logprobs"] = sum(1 for r in records if r[prob] is not None)
                stats["no_judgment"] = sum(1 for r in records if r["judgment"] is None)
                if self.format == "rank1":
                    stats["forced_end"] = sum(1 for r in records if r["forced"])
            out.stats = stats
        return outputs


def _sort_by_score(queries: Sequence[_Query]) -> None:
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
