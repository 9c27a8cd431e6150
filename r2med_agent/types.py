"""Data records shared by every stage. Data only: no I/O, no behaviour beyond small helpers.

Runs and qrels use the plain nested-dict shape that pytrec_eval takes
(``{query_id: {doc_id: score}}``), as BEIR and ir_measures do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, overload

Run = dict[str, dict[str, float]]
"""A ranked list per query: ``{query_id: {doc_id: score}}``; higher scores rank first."""

Qrels = dict[str, dict[str, int]]
"""Graded relevance judgements: ``{query_id: {doc_id: grade}}``."""

Family = Literal["qa", "exam", "treatment", "case"]
"""Task families, which decide the prompt wording (docs/protocol.md, "Prompts")."""


@dataclass(frozen=True, slots=True)
class Doc:
    """One corpus document."""

    doc_id: str
    text: str
    title: str = ""

    @property
    def full_text(self) -> str:
        """The text every stage sees (BM25, dense encoders, rerankers, prompts, the report):
        ``title + " " + text`` as BEIR and MTEB build it, or the text alone when there is no
        title. (Encoders that take the pair, such as MedCPT's, get title and text apart.)"""
        return f"{self.title} {self.text}".strip() if self.title else self.text


@dataclass(frozen=True, slots=True)
class Query:
    """One benchmark query; ``answer`` is the reference answer where the release has one."""

    query_id: str
    text: str
    answer: str = ""


class Corpus(Sequence[Doc]):
    """A task's documents in file order, whose ids are known up front and whose texts may be read
    on first use.

    A task found in the task cache (see :func:`r2med_agent.data.load_task_dir`) knows its document
    ids, queries, qrels and fingerprint without parsing its corpus file; the documents are read by
    ``load`` when something first needs them (indexing, encoding, prompts, reranking), once, under
    a lock. A re-run over saved indexes and embeddings never reads them.

    Args:
        ids: the document ids, in corpus order.
        load: returns the documents (their ids must be ``ids``, in order).
    """

    __slots__ = ("_ids", "_docs", "_load", "_lock")

    def __init__(self, ids: Iterable[str], load: Callable[[], Sequence[Doc]]) -> None:
        self._ids = tuple(ids)
        self._docs: tuple[Doc, ...] | None = None
        self._load: Callable[[], Sequence[Doc]] | None = load
        self._lock = threading.Lock()

    @property
    def doc_ids(self) -> tuple[str, ...]:
        return self._ids

    @property
    def loaded(self) -> bool:
        """Whether the documents have been read."""
        return self._docs is not None

    def docs(self) -> tuple[Doc, ...]:
        """The documents, read on the first call."""
        if self._docs is None:
            with self._lock:
                if self._docs is None:
                    docs = tuple(self._load())  # type: ignore[misc]  # set until read
                    if tuple(d.doc_id for d in docs) != self._ids:
                        raise RuntimeError("the corpus loader returned other documents than its ids")
                    self._docs, self._load = docs, None
        return self._docs

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, i: int) -> Doc: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[Doc, ...]: ...
    def __getitem__(self, i: int | slice) -> Doc | tuple[Doc, ...]:
        return self.docs()[i]

    def __iter__(self) -> Iterator[Doc]:
        return iter(self.docs())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Corpus):
            return self._ids == other._ids and self.docs() == other.docs()
        if isinstance(other, tuple):
            return self.docs() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Corpus({len(self._ids)} docs{'' if self.loaded else ', not read yet'})"


def doc_ids_of(docs: Sequence[Doc]) -> list[str]:
    """The ids of ``docs`` in order, without reading a :class:`Corpus` that has not been read."""
    ids = getattr(docs, "doc_ids", None)
    return list(ids) if ids is not None else [d.doc_id for d in docs]


@dataclass(frozen=True)
class DataOrigin:
    """Where a task's files were read from, as data: result files record it (``"data"``) and
    ``report`` loads the task's texts from it again.

    Attributes:
        folder: the absolute path of a local folder (``--data-dir``, a config's ``path:``); None for
            the hub and the package, which are loaded by the task's name.
        layout: ``r2med``, ``beir`` or ``nano``.
        name: the task's name before a BEIR split's suffix (``mine`` for ``mine@dev``).
        split: the BEIR qrels split read (``qrels/<split>.tsv``) or the Nano split; None otherwise.
        all_queries: a BEIR folder's queries its split does not judge were kept.
    """

    folder: str | None = None
    layout: str = ""
    name: str = ""
    split: str | None = None
    all_queries: bool = False

    def record(self) -> dict[str, Any]:
        """The result file's ``"data"`` block."""
        return {"folder": self.folder, "layout": self.layout, "name": self.name, "split": self.split,
                "all_queries": self.all_queries}


@dataclass(frozen=True)
class Task:
    """A loaded task: its queries, corpus and qrels, plus what prompts need to know of it.

    Attributes:
        name: canonical task name (``Biology``, ``PMC-Clinical``, ...).
        family: prompt family (``qa``, ``exam``, ``treatment``, ``case``).
        domain: the subject used in Q&A prompts ("biology", "bioinformatics", "medical sciences").
        queries: queries in file order.
        corpus: documents in file order (a tuple, or a :class:`Corpus` read on first use).
        qrels: relevance judgements (only positive grades are kept by the loader).
        source: where the data came from (hub repo@revision or a directory), for provenance.
        fingerprint: hash of the corpus content; keys every on-disk index and embedding cache.
        excluded: per query, the documents never ranked for it (BRIGHT's ``excluded_ids``, its
            ``"N/A"`` left out): the runner removes them from every ranking before the cut and the
            scoring. None for a task of another layout, which excludes nothing.
        origin: where its files were read from, as data (None for a task built in memory).
    """

    name: str
    family: Family
    domain: str
    queries: tuple[Query, ...]
    corpus: Sequence[Doc]
    qrels: Qrels
    source: str
    fingerprint: str
    excluded: Mapping[str, tuple[str, ...]] | None = None
    origin: DataOrigin | None = None

    @property
    def doc_ids(self) -> list[str]:
        """The corpus's document ids in order (without reading a corpus not read yet)."""
        return doc_ids_of(self.corpus)


Combine = Literal["none", "hyde", "query2doc", "lamer", "reasoning", "rewrite"]
"""How a retriever turns (query, generated text) into its query; see the table of docs/protocol.md."""


@dataclass(frozen=True, slots=True)
class SearchRequest:
    """What a method hands a retriever for one query.

    ``combine`` names the rule of the table of docs/protocol.md
    ("How generated text becomes the query"); each retriever implements it for its own kind
    (BM25 text, dense embeddings).
    With ``combine="none"`` only ``query`` is used.
    """

    query_id: str
    query: str
    expansion: str = ""
    combine: Combine = "none"
    more_expansions: tuple[str, ...] = ()
    """Further samples of the generated text (``run --samples N``: samples 2..N). BM25 searches
    with all samples joined by spaces where the rule uses the expansion; dense retrieval with the
    mean of the query's embedding and every sample's (HyDE's way), or for ``query2doc`` the mean
    of each sample's ``query[SEP]passage`` embedding."""
    keep_empty: bool = False
    """Use a blank generated text as it is (``run --empty-generation keep``, as R2MED's scripts
    did) instead of falling back to the query alone."""

    @property
    def expansions(self) -> tuple[str, ...]:
        """The samples of the generated text the retrievers use, the first one first: every
        non-blank one, or with ``keep_empty`` every one as it is."""
        samples = (self.expansion, *self.more_expansions)
        return samples if self.keep_empty else tuple(x for x in samples if x.strip())

    @property
    def empty_generations(self) -> int:
        """How many samples of the generated text are blank (0 for a request without one)."""
        if self.combine == "none":
            return 0
        return sum(1 for x in (self.expansion, *self.more_expansions) if not x.strip())


def _knob(default: Any, rule: str, *, flag: str | None = None, token: str | None = None,
          check: Callable[[Any], bool] | None = None, help: str = "") -> Any:
    """A sampling knob's field: its default, its rule (what a value must be, for messages), the
    ``run`` option that overrides it with that option's help, its result-folder token and its check."""
    return field(default=default, metadata={"knob": True, "rule": rule, "flag": flag, "token": token, "check": check,
                                            "help": help})


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings, named as in the OpenAI API. Every field is part of the cache key.

    The knobs (every field but ``stop``, ``logprobs`` and ``token_choices``) are stated here once:
    their defaults, which an LLM registry entry starts from; their rules, checked for an entry and
    for a run's overrides (:func:`sampling_problems`); the ``run`` options that override them and
    their result-folder tokens (:data:`SAMPLING_KNOBS`).

    Attributes:
        temperature: sampling temperature; 0 means greedy.
        top_p: nucleus sampling mass.
        top_k: top-k sampling (-1 disables it); ignored by APIs that do not support it.
        max_tokens: most tokens to generate.
        seed: random seed, passed to backends that honour it (None: none sent).
        stop: strings that end generation; the matched stop string is not part of the output text.
        repetition_penalty: multiplicative penalty (1.0 disables it), vLLM/llama.cpp only.
        logprobs: how many most likely tokens to return, with their log-probabilities, at each
            generated position (0: none). Part of the key only when set, so keys made before
            the field existed stay valid. The local llama.cpp backend returns none.
        token_choices: strings that are each one token of the model's vocabulary (the first
            token of each is taken, as Rank1 takes its judgment tokens); when set, the next
            token is one of them (vLLM's ``allowed_token_ids``) and ``Generation.logprobs``
            holds the log-probability of every choice at each position (vLLM's
            ``logprob_token_ids``; ``logprobs`` is then ignored). The vLLM engine, a vLLM
            server and the local llama.cpp backend (one token at a time) support it. Part of
            the key only when set.
    """

    temperature: float = _knob(0.7, ">= 0 (0 = greedy)", flag="--temperature", token="t",
                               check=lambda v: v >= 0, help="Override the LLM's default sampling temperature.")
    top_p: float = _knob(1.0, "in (0, 1]", flag="--top-p", token="p", check=lambda v: 0 < v <= 1,
                         help="Override the LLM's default top_p (nucleus sampling mass).")
    top_k: int = _knob(-1, "-1 (off) or >= 1", check=lambda v: v == -1 or v >= 1)
    max_tokens: int = _knob(10240, "at least 1", flag="--max-tokens", token="mt", check=lambda v: v >= 1,
                         help="Override the most tokens generated per call.")
    seed: int | None = _knob(42, "an integer, or none to send no seed", flag="--seed", token="seed",
                              help="Override the sampling seed: an integer, or 'none' to send no seed (unseeded sampling; "
                                   "the loops too).")
    stop: tuple[str, ...] = ()
    repetition_penalty: float = _knob(1.0, "> 0 (1 = off)", check=lambda v: v > 0)
    logprobs: int = 0
    token_choices: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
            "stop": list(self.stop),
            "repetition_penalty": self.repetition_penalty,
        }
        if self.logprobs:
            out["logprobs"] = self.logprobs
        if self.token_choices:
            out["token_choices"] = list(self.token_choices)
        return out


SAMPLING_KNOBS: dict[str, Mapping[str, Any]] = {
    f.name: {**f.metadata, "default": f.default, "type": float if "float" in str(f.type) else int,
             "optional": "None" in str(f.type)}
    for f in fields(SamplingParams) if f.metadata.get("knob")
}
"""Knob name -> its default, type (``float`` or ``int``), whether None is a value (``optional``:
the seed), rule, ``run`` option (``flag``; None: set in the LLM's registry entry only) and its
help, result-folder token and check; in field order."""


def canonical_sampling(sampling: Mapping[str, Any] | None) -> dict[str, Any]:
    """Sampling overrides in canonical form: names sorted, each knob's value as its type (1 and
    1.0 are the same temperature); None and names that are not knobs are kept as given."""
    out: dict[str, Any] = {}
    for name, value in sorted((sampling or {}).items()):
        knob = SAMPLING_KNOBS.get(str(name))
        if value is not None and knob is not None and not isinstance(value, bool):
            value = knob["type"](value)
        out[str(name)] = value
    return out


def sampling_problems(values: Mapping[str, Any], *, options: bool = False) -> list[str]:
    """What is wrong with sampling ``values`` (knob -> value), each as ``<name> must be <rule>,
    got <value>``; ``options`` names each knob by its ``run`` option (``--top-p``)."""
    problems = []
    for name, value in values.items():
        knob = SAMPLING_KNOBS.get(name)
        if knob is None or value is None or knob["check"] is None or knob["check"](value):
            continue
        label = (knob["flag"] or name) if options else name
        problems.append(f"{label} must be {knob['rule']}, got {value}")
    return problems


Message = dict[str, str]
"""One chat message: ``{"role": ..., "content": ...}``."""


@dataclass(frozen=True, slots=True)
class Generation:
    """One LLM output.

    Attributes:
        text: the raw generated text (for reasoning APIs that return reasoning separately, the
            reasoning wrapped in ``<think>...</think>`` followed by the content).
        final: the final response after reasoning-output parsing (what becomes the query).
        reasoning: the reasoning part, empty when the model has none.
        finish_reason: ``stop``, ``length``, or ``error``.
        stop_reason: the stop string that ended generation, when a backend reports it.
        prompt_tokens: input tokens, as the backend counted them.
        completion_tokens: output tokens.
        latency_s: wall time the backend spent on this item (a batch's time shared evenly).
        cached: True when this came from the generation cache.
        logprobs: when asked for (``SamplingParams.logprobs``) and the backend returns them, one
            entry per generated token: its most likely tokens as ``(token text, log-probability)``
            pairs, most likely first; None otherwise.
    """

    text: str
    final: str = ""
    reasoning: str = ""
    finish_reason: str = "stop"
    stop_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    cached: bool = False
    logprobs: tuple[tuple[tuple[str, float], ...], ...] | None = None


@dataclass(frozen=True, slots=True)
class TraceStep:
    """One step of an agentic trajectory."""

    generated: str
    search_query: str | None = None
    doc_ids: tuple[str, ...] = ()
    inserted: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class Trace:
    """A whole trajectory of a reasoning loop for one query."""

    query_id: str
    method: str
    steps: tuple[TraceStep, ...]
    final: str
    finish_reason: str
    extra: Mapping[str, Any] = field(default_factory=dict)
