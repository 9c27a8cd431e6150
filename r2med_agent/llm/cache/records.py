"""The generation cache's records: the request record hashed into a key, and what is stored
under it (a generation, the queries it served, per-model totals). No storage here: the SQLite
file is :mod:`r2med_agent.llm.cache.store`."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from r2med_agent.types import Generation, Message

KEY_VERSION = 1
"""Bumped when the key's layout changes (old rows then simply stop matching)."""


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: equal objects give byte-equal strings."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def build_request(
    model_id: str,
    messages: Sequence[Message],
    params: Mapping[str, Any],
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    sample_index: int = 0,
    template_hash: str = "",
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The request record that is hashed into the key and stored with the row (no secrets).

    Args:
        model_id: the model's identity (checkpoint or API model name), never a URL.
        messages: the chat messages exactly as sent, system prompt included.
        params: every sampling parameter (``SamplingParams.to_dict()``).
        chat_template_kwargs: chat template options (e.g. ``{"enable_thinking": True}``).
        sample_index: which of several samples of the same request this is.
        template_hash: version hash of the prompt template that rendered ``messages``.
        options: other settings that change the output (e.g. ``reasoning_effort``); added to
            the record only when non-empty.
    """
    req: dict[str, Any] = {
        "v": KEY_VERSION,
        "model_id": model_id,
        "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
        "params": dict(params),
        "chat_template_kwargs": dict(chat_template_kwargs or {}),
        "sample_index": int(sample_index),
        "template_hash": template_hash,
    }
    if options:
        req["options"] = dict(options)
    return req


def request_key(request: Mapping[str, Any]) -> str:
    """sha256 hex digest of the canonical JSON of a ``build_request`` record."""
    return hashlib.sha256(canonical_json(request).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class CacheRecord:
    """One stored generation.

    Attributes:
        key: the request hash.
        model_id: the model that produced it.
        sample_index: the request's sample index.
        text: the raw generated text (for reasoning APIs, the content without the reasoning).
        reasoning: the reasoning (as parsed when stored, with ``api_reasoning`` first).
        final: the final response (as parsed when stored).
        finish_reason: ``stop`` or ``length``.
        stop_reason: the stop string that ended generation, if any.
        prompt_tokens: input tokens of the original generation.
        completion_tokens: output tokens of the original generation.
        latency_s: backend seconds of the original generation.
        created: unix time the row was written.
        request: the ``build_request`` record (messages, params, ...), for export and inspection.
        api_reasoning: reasoning the API returned apart from the text (``reasoning_content``);
            kept on its own because no reasoning format can find it in ``text``.
        logprobs: ``Generation.logprobs`` (None when not asked for or not returned).
    """

    key: str
    model_id: str
    sample_index: int
    text: str
    reasoning: str
    final: str
    finish_reason: str
    stop_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    created: float
    request: dict[str, Any] = field(repr=False)
    api_reasoning: str = ""
    logprobs: tuple[tuple[tuple[str, float], ...], ...] | None = field(default=None, repr=False)

    @classmethod
    def from_generation(
        cls,
        key: str,
        request: Mapping[str, Any],
        gen: Generation,
        created: float | None = None,
        api_reasoning: str = "",
    ) -> CacheRecord:
        return cls(
            key=key,
            model_id=str(request["model_id"]),
            sample_index=int(request.get("sample_index", 0)),
            text=gen.text,
            reasoning=gen.reasoning,
            final=gen.final,
            finish_reason=gen.finish_reason,
            stop_reason=gen.stop_reason,
            prompt_tokens=int(gen.prompt_tokens),
            completion_tokens=int(gen.completion_tokens),
            latency_s=float(gen.latency_s),
            created=time.time() if created is None else created,
            request=dict(request),
            api_reasoning=api_reasoning,
            logprobs=gen.logprobs,
        )

    def to_generation(self) -> Generation:
        """The record as a Generation marked ``cached=True`` (token counts of the original run)."""
        return Generation(
            text=self.text,
            final=self.final,
            reasoning=self.reasoning,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            latency_s=self.latency_s,
            cached=True,
            logprobs=self.logprobs,
        )


@dataclass(frozen=True)
class Use:
    """Which query of which task a generation served (not part of the key).

    Built from the ``meta`` dicts callers pass to ``CachedLLM.generate``: the keys ``task``,
    ``query_id`` and ``method`` become columns; any other keys are kept as JSON in ``extra``.
    """

    key: str
    task: str = ""
    query_id: str = ""
    method: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_meta(cls, key: str, meta: Mapping[str, Any]) -> Use:
        rest = {k: v for k, v in meta.items() if k not in ("task", "query_id", "method")}
        return cls(
            key=key,
            task=str(meta.get("task", "")),
            query_id=str(meta.get("query_id", "")),
            method=str(meta.get("method", "")),
            extra=rest,
        )


@dataclass(frozen=True)
class ModelStats:
    """Per-model totals reported by ``GenerationCache.stats``."""

    model_id: str
    rows: int
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    first_created: float
    last_created: float
