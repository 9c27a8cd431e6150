"""Data records shared by every stage. Data only: no I/O, no behaviour beyond small helpers.

Runs and qrels use the plain nested-dict shape that pytrec_eval takes
(``{query_id: {doc_id: score}}``), as BEIR and ir_measures do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Run = dict[str, dict[str, float]]
"""A ranked list per query: ``{query_id: {doc_id: score}}``; higher scores rank first."""

Qrels = dict[str, dict[str, int]]
"""Graded relevance judgements: ``{query_id: {doc_id: grade}}``."""

Family = Literal["qa", "exam", "treatment", "case"]
"""Task families, which decide the prompt wording (PROTOCOL.md, "Prompt structure")."""


@dataclass(frozen=True, slots=True)
class Doc:
    """One corpus document."""

    doc_id: str
    text: str
    title: str = ""


@dataclass(frozen=True, slots=True)
class Query:
    """One benchmark query; ``answer`` is the reference answer where the release has one."""

    query_id: str
    text: str
    answer: str = ""


@dataclass(frozen=True)
class Task:
    """A loaded task: its queries, corpus and qrels, plus what prompts need to know of it.

    Attributes:
        name: canonical task name (``Biology``, ``PMC-Clinical``, ...).
        family: prompt family (``qa``, ``exam``, ``treatment``, ``case``).
        domain: the subject used in Q&A prompts ("biology", "bioinformatics", "medical sciences").
        queries: queries in file order.
        corpus: documents in file order.
        qrels: relevance judgements (only positive grades are kept by the loader).
        source: where the data came from (hub repo@revision or a directory), for provenance.
        fingerprint: hash of the corpus content; keys every on-disk index and embedding cache.
    """

    name: str
    family: Family
    domain: str
    queries: tuple[Query, ...]
    corpus: tuple[Doc, ...]
    qrels: Qrels
    source: str
    fingerprint: str


Combine = Literal["none", "hyde", "query2doc", "lamer", "reasoning"]
"""How a retriever turns (query, generated text) into its query; see PROTOCOL.md's table."""


@dataclass(frozen=True, slots=True)
class SearchRequest:
    """What a method hands a retriever for one query.

    ``combine`` names the rule of PROTOCOL.md's table ("How the generated text becomes the
    retrieval query"); each retriever implements it for its own kind (BM25 text, dense embeddings).
    With ``combine="none"`` only ``query`` is used.
    """

    query_id: str
    query: str
    expansion: str = ""
    combine: Combine = "none"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings, named as in the OpenAI API. Every field is part of the cache key.

    Attributes:
        temperature: sampling temperature; 0 means greedy.
        top_p: nucleus sampling mass.
        top_k: top-k sampling (-1 disables it); ignored by APIs that do not support it.
        max_tokens: most tokens to generate.
        seed: random seed, passed to backends that honour it.
        stop: strings that end generation; the matched stop string is not part of the output text.
        repetition_penalty: multiplicative penalty (1.0 disables it), vLLM/llama.cpp only.
    """

    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 10240
    seed: int | None = 42
    stop: tuple[str, ...] = ()
    repetition_penalty: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
            "stop": list(self.stop),
            "repetition_penalty": self.repetition_penalty,
        }


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
