"""The protocol every LLM backend implements, and the error a backend raises for a batch that
partly failed."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from r2med_agent.errors import LLMError
from r2med_agent.types import Generation, Message, SamplingParams


PromptMeta = Mapping[str, Any] | None
"""Bookkeeping of one prompt (``{"task", "query_id", "method", ...}``) or None: stored with its
cache rows so a cache can be exported per query, never part of a cache key."""

TemplateHashes = str | Sequence[str]
"""Version hash of the prompt template: one for every prompt of a call, or one per prompt."""


Finished = Callable[[int, Any], None]
"""``on_done(index, output)``: what a backend that reports each request (:func:`reports_each`) calls
as each request of a batch finishes, before the batch returns: the prompt's place in the batch and
its Generation (``generate``) or its list of samples (``generate_samples``). The caching wrapper
commits each to the generation cache there, so an interrupt or a kill loses only what had not
finished. It may be called from another thread than the caller's (an HTTP backend's event loop)."""


def reports_each(backend: Any) -> bool:
    """Whether ``backend``'s ``generate``/``generate_samples`` take ``on_done`` (:data:`Finished`):
    the project's backends do (attribute ``reports_each``); an LLM of your own need not, and then
    its outputs are committed when its call returns."""
    return bool(getattr(backend, "reports_each", False))


def generate_reporting(backend: Any, prompts: Sequence[list[Message]], params: SamplingParams,
                       on_done: Finished | None) -> list[Generation]:
    """``backend.generate(prompts, params)``, with ``on_done`` where the backend takes it."""
    if on_done is not None and reports_each(backend):
        return backend.generate(prompts, params, on_done=on_done)
    return backend.generate(prompts, params)


def samples_reporting(backend: Any, prompts: Sequence[list[Message]], params: SamplingParams, n: int,
                      on_done: Finished | None) -> list[list[Generation]]:
    """``backend.generate_samples(prompts, params, n)``, with ``on_done`` where the backend takes it."""
    if on_done is not None and reports_each(backend):
        return backend.generate_samples(prompts, params, n, on_done=on_done)
    return backend.generate_samples(prompts, params, n)


def choice_token_ids(encode: Callable[[str], Sequence[int]], choices: Sequence[str]) -> list[int]:
    """The token id of each of ``SamplingParams.token_choices``: the first token ``encode``
    (the model's tokenizer, no special tokens) gives it, as Rank1 takes ``" true"`` and
    ``" false"`` (orionw/rank1, rank1.py).

    Raises:
        LLMError: a choice has no token, or two choices begin with the same one.
    """
    ids = []
    for choice in choices:
        tokens = list(encode(choice))
        if not tokens:
            raise LLMError(f"token choice {choice!r} is no token of the model's vocabulary")
        ids.append(int(tokens[0]))
    if len(set(ids)) != len(ids):
        raise LLMError(f"token choices {list(choices)!r} share a first token ({ids}): they cannot be told apart")
    return ids


@runtime_checkable
class LLM(Protocol):
    """Batch in, batch out: ``generate`` returns one Generation per prompt, in input order.

    Backends fill ``text`` (the model's output as returned), ``finish_reason``, ``stop_reason``
    and token usage, and ``reasoning`` only when the API returns the reasoning apart from the
    text (``reasoning_content``). Reasoning-output parsing of the text (``final`` and the
    reasoning inside it) is applied by the caching wrapper from the model's registry entry, so
    every backend gets it the same way.

    Callers (the runner, the reasoning loops, the LLM rerankers) pass each call's request
    options as keywords: ``sample_index`` (which sample of each prompt this is),
    ``template_hash`` (:data:`TemplateHashes`) and ``meta`` (one :data:`PromptMeta` per prompt).
    They describe the request for the generation cache: the caching wrapper
    (:class:`~r2med_agent.llm.cache.wrapper.CachedLLM`) keys and stores its rows by them; a backend
    accepts them and generates the same text whatever they are.

    A backend whose batch partly fails raises :class:`PartialBatchError` with the outputs it did
    make, so the wrapper can keep them before the error propagates.
    """

    model_id: str

    def generate(
        self, prompts: Sequence[list[Message]], params: SamplingParams, *, sample_index: int = 0,
        template_hash: TemplateHashes = "", meta: Sequence[PromptMeta] | None = None,
    ) -> list[Generation]: ...


@runtime_checkable
class SamplingLLM(LLM, Protocol):
    """An LLM that draws several samples of each prompt in one request (vLLM's and the OpenAI
    API's ``n``). ``out[i][s]`` is sample ``s`` of prompt ``i``; ``template_hash`` and ``meta``
    are those of :meth:`LLM.generate` (a sample's index is its position)."""

    def generate_samples(
        self, prompts: Sequence[list[Message]], params: SamplingParams, n: int, *,
        template_hash: TemplateHashes = "", meta: Sequence[PromptMeta] | None = None,
    ) -> list[list[Generation]]: ...


class AuthError(LLMError):
    """The endpoint refused the credentials (HTTP 401/403): every request would fail the same
    way, so a batch stops at once instead of sending the rest."""


class UnreachableError(LLMError):
    """The endpoint's host name does not resolve or its port refuses connections: not a
    transient fault, so a batch stops at once instead of retrying every request."""


class PartialBatchError(LLMError):
    """Some requests of a batch failed for good; the others produced generations.

    Attributes:
        generations: one entry per prompt, in input order: the Generation, or None where the
            request failed (or was cancelled after an :class:`AuthError`).
        failures: prompt index -> the error of that request.
    """

    def __init__(
        self, generations: Sequence[Generation | None], failures: Mapping[int, LLMError]
    ) -> None:
        self.generations = list(generations)
        self.failures = dict(failures)
        first = self.failures[min(self.failures)]
        made = sum(g is not None for g in self.generations)
        super().__init__(
            f"{first} ({len(self.failures)} of {len(self.generations)} requests failed, "
            f"{made} succeeded)"
        )
        self.first = first
