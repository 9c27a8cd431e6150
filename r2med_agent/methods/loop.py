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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any, ClassVar, Literal

from r2med_agent.errors import ConfigError, DataError, LLMError
from r2med_agent.llm.base import LLM
from r2med_agent.methods.base import LoopMethod
from r2med_agent.retrieval.base import Retriever
from r2med_agent.retrieval.fusion import rrf
from r2med_agent.traces import read_traces, trace_from_dict, trace_to_dict, traces_to_jsonl  # noqa: F401 - their home was here
from r2med_agent.types import (
    Doc,
    Generation,
    Message,
    Query,
    Run,
    SamplingParams,
    SearchRequest,
    Task,
    Trace,
    TraceStep,
)

logger = logging.getLogger(__name__)

FinishReason = Literal["answer", "max_turns", "max_searches", "length", "error"]
FINISH_REASONS: tuple[str, ...] = ("answer", "max_turns", "max_searches", "length", "error")

FinalMode = Literal["default", "fuse"]
FINAL_MODES: tuple[str, ...] = ("default", "fuse")


# --------------------------------------------------------------------------------------------
# Parsing one step's output


@dataclass(frozen=True, slots=True)
class Action:
    """What one generated step asks for.

    Attributes:
        kind: ``search`` (issued a query), ``answer`` (gave a tagged answer) or ``none``.
        body: the step's text in canonical form: cut at the first closing tag, with that tag
            appended when the model closed (or, by the stop string, ended) a search or an answer.
            The same model output gives the same body whatever the backend did with stop strings.
        content: the query or the answer, stripped; empty for ``none``.
    """

    kind: Literal["search", "answer", "none"]
    body: str
    content: str = ""


def parse_output(
    text: str,
    tags: Mapping[str, tuple[str, str]],
    *,
    stop_reason: object = None,
    finish_reason: str = "stop",
    empty_ok: bool = False,
) -> Action:
    """Parse one generated step into an :class:`Action`.

    Args:
        text: the generated text as the backend returned it.
        tags: ``{"search": (open, close), "answer": (open, close)}``; the closing tags are the
            loop's stop strings (``answer`` may be absent, as in Search-o1).
        stop_reason: the stop string the backend reports, if any (may be None, or a token id).
        finish_reason: the backend's finish reason; ``length`` means the text was cut by
            ``max_tokens``, so an unclosed tag at the end is not a finished query.
        empty_ok: a tag with nothing inside is still a search (answer) with an empty query
            (Search-R1's parser reads ``<search> </search>`` so); False: it is ``none``.

    Returns:
        The action. A closing tag found in the text ends the step there (the backend included
        the stop string, maybe followed by whitespace, or ignored the stop and ran on); otherwise
        a reported stop string, or an unclosed opening tag left at the end of a generation that
        stopped (stop reason missing), closes the last opened tag. The content runs from the
        FIRST opening tag of its kind before the closing one, as both originals read it
        (Search-R1's ``<(search|answer)>(.*?)</\1>``, Search-o1's ``extract_between``): in
        ``<search>a<search>b</search>`` the query is ``a<search>b``. A closing tag without its
        opening tag is ``none``, and so is an empty query/answer unless ``empty_ok``.
    """
    closes = {close: kind for kind, (_, close) in tags.items()}
    kind: str | None = None
    head = text
    first = -1
    for close, k in closes.items():
        i = text.find(close)
        if i != -1 and (first == -1 or i < first):
            first, kind = i, k
    if kind is not None:
        head = text[:first]
    elif isinstance(stop_reason, str) and stop_reason.strip() in closes:
        kind = closes[stop_reason.strip()]
    elif finish_reason != "length":
        last = -1
        for k, (open_, close) in tags.items():
            j = text.rfind(open_)
            if j > last and text.find(close, j) == -1:
                last, kind = j, k
    if kind is None:
        return Action("none", text)
    open_, close = tags[kind]
    body = head + close
    j = head.find(open_)
    if j == -1:
        return Action("none", body)
    content = head[j + len(open_) :].strip()
    if not content and not empty_ok:
        return Action("none", body)
    return Action(kind, body, content)  # type: ignore[arg-type]


def final_text(gen: Generation) -> str:
    """The final response of a generation: ``final`` when the reasoning parser ran, else ``text``.

    The caching wrapper fills ``final``/``reasoning``; a bare backend leaves both empty.
    """
    if gen.final or gen.reasoning:
        return gen.final
    return gen.text.strip()


Parser = Callable[[str], tuple[str, str]]
"""``text -> (reasoning, final)``: a model's reasoning-output parser (``CachedLLM.parse``)."""


def plain_parse(text: str) -> tuple[str, str]:
    """The parser of a non-reasoning model: no reasoning, the whole text is the final response."""
    return "", text.strip()


def reasoning_parser(llm: object) -> Parser:
    """The reasoning-output parser of ``llm``: its ``parse`` method (the caching wrapper applies
    the registry entry's ``reasoning_format``), or :func:`plain_parse` for a bare backend."""
    parse = getattr(llm, "parse", None)
    return parse if callable(parse) else plain_parse


# --------------------------------------------------------------------------------------------
# Trajectory state, results, statistics


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


# --------------------------------------------------------------------------------------------
# The engine


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


def ranked_doc_ids(scores: Mapping[str, float], k: int) -> list[str]:
    """Doc ids by descending score (ties by doc id, so the order is deterministic), top ``k``."""
    return [d for d, _ in sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]


def cut_words(text: str, max_words: int | None) -> str:
    """``text`` cut to its first ``max_words`` whitespace tokens (unchanged when shorter)."""
    if max_words is None:
        return text
    words = text.split()
    if len(words) <= max_words:
        return text
    return " ".join(words[:max_words]) + " ..."


TokenCut = Callable[[str, int], str]
"""``(text, n) -> text``: ``text`` cut to its first ``n`` tokens of a model's tokenizer."""


def cut_whitespace_tokens(text: str, max_tokens: int) -> str:
    """The cut of a loop run without its model's tokenizer (a bare ``run`` call):
    whitespace-separated words stand in for tokens. The cut text is a prefix of ``text``."""
    words = list(re.finditer(r"\S+", text))
    return text if len(words) <= max_tokens else text[: words[max_tokens - 1].end()]


def load_token_cut(spec: Any) -> TokenCut:
    """The token cut of an LLM registry entry's model: its GGUF vocabulary (``local``, read
    without the weights) or its ``transformers`` tokenizer (``tokenizer``, else ``model``; only
    tokenizer files are read). Tokens are counted without special tokens added, as Search-R1
    tokenizes its observations. When neither can be loaded, a warning says so and whitespace
    words stand in for tokens (:func:`cut_whitespace_tokens`)."""
    try:
        return _gguf_cut(spec) if spec.backend == "local" else _transformers_cut(spec)
    except Exception as e:  # noqa: BLE001 - missing packages, hub and file errors alike
        logger.warning(
            "llm '%s': its tokenizer could not be loaded (%s: %s), so inserted text is cut by "
            "whitespace words instead of tokens; set tokenizer: in the entry to the model's Hugging "
            "Face id or a local folder", spec.name, type(e).__name__, " ".join(str(e).split())[:200],
        )
        return cut_whitespace_tokens


def _gguf_cut(spec: Any) -> TokenCut:
    from r2med_agent.llm.local import _import_llama_cpp, resolve_gguf

    import contextlib
    import io

    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        vocab = _import_llama_cpp().Llama(model_path=str(resolve_gguf(spec.model)), vocab_only=True, verbose=False)
    # A vocabulary-only model has no training context (n_ctx_train 0), so llama.cpp's context
    # warns that any context overflows it; nothing runs in that context. Anything else it says is
    # passed on.
    for line in said.getvalue().splitlines():
        if line.strip() and "n_ctx_train (0)" not in line:
            logger.warning("llama.cpp: %s", line.strip())

    def cut(text: str, n: int) -> str:
        ids = vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        return text if len(ids) <= n else vocab.detokenize(ids[:n]).decode("utf-8", "ignore")

    return cut


def _transformers_cut(spec: Any) -> TokenCut:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(getattr(spec, "tokenizer", None) or spec.model)

    def cut(text: str, n: int) -> str:
        ids = tok.encode(text, add_special_tokens=False)
        return text if len(ids) <= n else tok.decode(ids[:n], clean_up_tokenization_spaces=False)

    return cut


class ReasoningLoop(LoopMethod):
    """Base class of the agentic methods: the batched loop plus the hooks a method fills in.

    Subclasses set the class attributes and implement :meth:`initial_messages`,
    :meth:`insert_documents` (or :meth:`condense_messages`/:meth:`condense_insert` when
    ``condenses``), :meth:`final_response`, and optionally :meth:`invalid_turn` and
    :meth:`blocked_search`.

    Args:
        params: sampling settings of the reasoning generations (the stop strings are set from
            the tags).
        max_turns: generation steps in which a trajectory may search.
        max_searches: most searches a trajectory may run (None: bounded by ``max_turns`` only).
            A query over the limit gets :meth:`blocked_search`'s notice; without one it ends
            the trajectory (``max_searches``).
        final_turn: a trajectory still unfinished after ``max_turns`` steps gets one more
            generation, its final answer turn, in which a search is not run (Search-R1's final
            rollout).
        docs_per_search: documents retrieved per search.
        max_doc_words: each inserted document is cut to this many whitespace tokens.
        final: ``default`` (the final response is the query) or ``fuse`` (RRF of every search
            the loop ran for the trajectory plus the final query).
        fuse_depth: documents per list searched for, and kept after, fusion.
        rrf_k: the RRF constant.
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

    def __init__(
        self,
        *,
        params: SamplingParams,
        max_turns: int,
        max_searches: int | None,
        final_turn: bool,
        docs_per_search: int,
        max_doc_words: int | None,
        final: str = "default",
        fuse_depth: int = 100,
        rrf_k: int = 60,
    ) -> None:
        if final not in FINAL_MODES:
            raise ConfigError(f"final must be one of {', '.join(FINAL_MODES)}, got {final!r}")
        for label, value in (("max_turns", max_turns), ("docs_per_search", docs_per_search),
                             ("fuse_depth", fuse_depth)):
            if value < 1:
                raise ConfigError(f"{label} must be at least 1, got {value}")
        if max_searches is not None and max_searches < 0:
            raise ConfigError(f"max_searches must be >= 0 or None, got {max_searches}")
        self.params = dataclasses.replace(params, stop=self.stop_strings())
        self.max_turns = max_turns
        self.max_searches = max_searches
        self.final_turn = final_turn
        self.docs_per_search = docs_per_search
        self.max_doc_words = max_doc_words
        self.final = final
        self.fuse_depth = fuse_depth
        self.rrf_k = rrf_k

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

    def _generate(
        self, llm: LLM, trajs: Sequence[Trajectory], prompts: list[list[Message]],
        params: SamplingParams, kind: str, turn: int,
    ) -> tuple[list[Generation], int]:
        """ONE ``llm.generate`` call; returns the generations and the backend calls it made."""
        counters = getattr(llm, "stats", None)
        before = getattr(counters, "backend_calls", None)
        meta = [
            {"task": t.job.task.name, "query_id": t.job.query.query_id, "method": self.name,
             "step": turn, "kind": kind}
            for t in trajs
        ]
        gens = llm.generate(prompts, params, sample_index=0, template_hash=self.template_hash, meta=meta)
        if len(gens) != len(prompts):
            raise LLMError(
                f"{getattr(llm, 'model_id', 'the LLM')} returned {len(gens)} generations for {len(prompts)} prompts"
            )
        after = getattr(counters, "backend_calls", None)
        backend_calls = after - before if isinstance(before, int) and isinstance(after, int) else 1
        return list(gens), backend_calls

    def run_loop(self, jobs: Sequence[LoopJob], llm: LLM) -> LoopOutcome:
        """Run every job's trajectory to the end, batching each step over all of them.

        Steps ``0 .. max_turns - 1`` may search; with ``final_turn``, step ``max_turns`` is the
        final answer turn of the trajectories still unfinished, in which a search is not run.

        Returns:
            The trajectories in job order (``final`` filled) and per-step statistics.
        """
        trajs = [Trajectory(job=j, messages=self.initial_messages(j.task, j.query)) for j in jobs]
        lookups: dict[int, dict[str, Doc]] = {}
        stats: list[StepStats] = []
        last_turn = self.max_turns + (1 if self.final_turn else 0)
        for turn in range(last_turn):
            active = [t for t in trajs if not t.finished]
            if not active:
                break
            stats.append(self._run_step(llm, trajs, active, turn, lookups))
        parse = reasoning_parser(llm)
        for traj in trajs:
            if not traj.finished:
                traj.finish_reason = self._out_of_turns(traj)
            traj.final = self.final_response(traj, parse)
        return LoopOutcome(trajs, stats)

    def _run_step(
        self, llm: LLM, trajs: Sequence[Trajectory], active: Sequence[Trajectory], turn: int,
        lookups: dict[int, dict[str, Doc]],
    ) -> StepStats:
        """One step of the ``active`` trajectories: ONE generation call, the searches it asks
        for, and (methods that condense) ONE Reason-in-Documents call; returns its statistics."""
        before = sum(1 for t in trajs if t.finished)
        gens, backend_calls = self._generate(
            llm, active, [t.request_messages() for t in active], self.params, "reason", turn
        )
        pending, notices = self._read_outputs(active, gens, turn)
        search_calls, docs_of = self._run_searches(pending, lookups)
        condense_calls = condense_backend_calls = 0
        if pending and self.condenses:
            condense_calls = 1
            condense_backend_calls = self._condense(llm, pending, docs_of, turn)
        else:
            for (traj, query, body, gen), docs in zip(pending, docs_of):
                traj.add_step(gen, body, search_query=query, doc_ids=[d.doc_id for d in docs],
                              inserted=self.insert_documents(traj, query, docs))
        step = StepStats(
            turn=turn, active=len(active), generate_calls=1, backend_calls=backend_calls,
            condense_calls=condense_calls, condense_backend_calls=condense_backend_calls,
            search_calls=search_calls, searches=len(pending), notices=notices,
            finished=sum(1 for t in trajs if t.finished) - before,
        )
        logger.info(
            "%s step %d: %d active, %d searches, %d notices, %d finished; backend calls: "
            "%d generate, %d condense",
            self.name, turn + 1, step.active, step.searches, step.notices, step.finished,
            step.backend_calls, step.condense_backend_calls,
        )
        return step

    def _read_outputs(
        self, active: Sequence[Trajectory], gens: Sequence[Generation], turn: int
    ) -> tuple[list[PendingSearch], int]:
        """Record each active trajectory's generated step (an answer, a search, a cut-off or
        failed output, or a step with neither, see :meth:`invalid_turn`).

        Returns:
            The searches to run, in trajectory order, and how many notices replaced a search.
        """
        closing = turn >= self.max_turns  # the final turn: a search is not run
        tags = self.tags()
        pending: list[PendingSearch] = []
        notices = 0
        for traj, gen in zip(active, gens):
            traj.count(gen)
            if gen.finish_reason == "error":
                logger.warning("%s: generation failed for %s/%s", self.name, traj.job.task.name,
                               traj.job.query.query_id)
                traj.add_step(gen, gen.text)
                traj.finish_reason = "error"
                continue
            act = parse_output(gen.text, tags, stop_reason=gen.stop_reason,
                               finish_reason=gen.finish_reason, empty_ok=self.empty_actions)
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
        ``"notice"`` when :meth:`blocked_search` inserted a notice instead, ``"ended"`` when the
        trajectory ends (the final turn, or over ``max_searches`` without a notice)."""
        traj.issued.append(act.content)
        if closing:
            traj.add_step(gen, act.body, search_query=act.content)
            traj.finish_reason = self._out_of_turns(traj)
            return "ended"
        notice = self.blocked_search(traj, act.content, last_turn=turn == self.max_turns - 1)
        if notice is not None:
            traj.add_step(gen, act.body, search_query=act.content, inserted=notice)
            return "notice"
        if not self.searches_left(traj):  # over the limit and no notice for it
            traj.add_step(gen, act.body, search_query=act.content)
            traj.finish_reason = "max_searches"
            return "ended"
        return "run"

    def _read_no_search(self, traj: Trajectory, gen: Generation, act: Action, closing: bool) -> None:
        """Record a step without a search: an answer, an output cut at ``max_tokens``, or a
        step with neither (the method's :meth:`invalid_turn` decides)."""
        if act.kind == "answer":
            traj.add_step(gen, act.body)
            traj.answer = act.content
            traj.finish_reason = "answer"
        elif gen.finish_reason == "length" and self.length_ends:
            traj.add_step(gen, act.body)
            traj.finish_reason = "length"
        else:
            fix = self.invalid_turn(traj)
            if fix is None:  # the method reads a step without a search as the end
                traj.add_step(gen, act.body)
                traj.finish_reason = "answer"
            elif closing:
                traj.add_step(gen, act.body)
                traj.finish_reason = self._out_of_turns(traj)
            else:
                traj.add_step(gen, act.body, inserted=fix)

    def _out_of_turns(self, traj: Trajectory) -> FinishReason:
        """Why a trajectory that ran out of steps ended: ``max_turns``, or ``max_searches``
        when it had no search left either."""
        return "max_turns" if self.searches_left(traj) else "max_searches"

    def _condense(
        self, llm: LLM, pending: Sequence[PendingSearch], docs_of: Sequence[Sequence[Doc]], turn: int
    ) -> int:
        """ONE Reason-in-Documents call over the step's searches; each trajectory gets the
        extracted information inserted. Returns the backend calls it made."""
        prompts = [self.condense_messages(t, b, q, docs) for (t, q, b, _), docs in zip(pending, docs_of)]
        cgens, backend_calls = self._generate(
            llm, [p[0] for p in pending], prompts, self.condense_params(), "condense", turn
        )
        for (traj, query, body, gen), docs, cgen in zip(pending, docs_of, cgens):
            traj.count(cgen)
            ids = [d.doc_id for d in docs]
            if cgen.finish_reason == "error":
                logger.warning("%s: Reason-in-Documents failed for %s/%s", self.name,
                               traj.job.task.name, traj.job.query.query_id)
                traj.add_step(gen, body, search_query=query, doc_ids=ids,
                              extra_tokens=(cgen.prompt_tokens, cgen.completion_tokens))
                traj.finish_reason = "error"
                continue
            info, inserted = self.condense_insert(cgen)
            traj.condensed.append({
                "step": len(traj.steps), "raw": cgen.text, "information": info,
                "prompt_tokens": cgen.prompt_tokens, "completion_tokens": cgen.completion_tokens,
            })
            traj.add_step(gen, body, search_query=query, doc_ids=ids, inserted=inserted,
                          extra_tokens=(cgen.prompt_tokens, cgen.completion_tokens))
        return backend_calls

    def _run_searches(
        self,
        pending: Sequence[PendingSearch],
        lookups: dict[int, dict[str, Doc]],
    ) -> tuple[int, list[list[Doc]]]:
        """Run the step's searches, one ``retriever.search`` call per task.

        Returns ``(number of search calls, the documents of each search in pending order)`` and
        records each executed query on its trajectory.
        """
        by_task: dict[int, list[int]] = {}
        for i, (traj, _, _, _) in enumerate(pending):
            by_task.setdefault(traj.job.task_index, []).append(i)
        found: list[list[Doc]] = [[] for _ in pending]
        for task_index, idxs in by_task.items():
            job = pending[idxs[0]][0].job
            requests = [SearchRequest(query_id=str(n), query=pending[i][1]) for n, i in enumerate(idxs)]
            run = job.retriever.search(requests, self.docs_per_search)
            lookup = lookups.get(task_index)
            if lookup is None:
                lookup = lookups[task_index] = {d.doc_id: d for d in job.task.corpus}
            for n, i in enumerate(idxs):
                ids = ranked_doc_ids(run.get(str(n), {}), self.docs_per_search)
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
