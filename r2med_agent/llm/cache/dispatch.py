"""Backend dispatch and the write queue of the cache wrapper.

The misses of a call go to the backend in chunks, one ``backend.generate`` (or
``generate_samples``) call each. Every output is finished (reasoning and final answer parsed,
counted in :class:`LLMStats`) and written to the cache as it finishes where the backend reports
each (``on_done``), else with its chunk when the call returns; a failed or empty item is never
written, so the next run asks for it again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from r2med_agent.errors import LLMError
from r2med_agent.llm.base import LLM, Finished, PartialBatchError, generate_reporting, samples_reporting
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.keys import RequestBuilder
from r2med_agent.llm.cache.leases import LeaseOwner
from r2med_agent.llm.cache.records import CacheRecord, Use
from r2med_agent.progress import tracking
from r2med_agent.types import Generation, Message, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class LLMStats:
    """Counters of one CachedLLM, updated on each ``generate`` call (the runner reads them).

    Attributes:
        calls: ``generate`` calls on the wrapper.
        backend_calls: ``generate`` calls that reached the backend (one per chunk of misses).
        generations: outputs the backend produced (each unique miss once).
        cache_hits: outputs served from the cache (counted per input prompt).
        deduplicated: input prompts answered by an identical prompt earlier in the same call.
        empty: replies that came back without any text (an OpenAI-compatible ``content: null``)
            while the model reported a normal stop: returned as failed items, never cached.
        prompt_tokens: input tokens of the generations made (cache hits cost nothing).
        completion_tokens: output tokens of the generations made.
        model_time_s: wall seconds spent inside ``backend.generate``.
        overhead_time_s: the rest of ``generate``'s wall time (keys, cache reads/writes, parsing).
    """

    calls: int = 0
    backend_calls: int = 0
    generations: int = 0
    cache_hits: int = 0
    deduplicated: int = 0
    empty: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model_time_s: float = 0.0
    overhead_time_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def copy(self) -> LLMStats:
        return replace(self)

    def __sub__(self, other: LLMStats) -> LLMStats:
        """Counters accumulated since the snapshot ``other`` (``stats - before``)."""
        return LLMStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})


@dataclass
class Dispatch:
    """Sends one call's misses to the backend and writes what comes back to the cache.

    Attributes:
        backend: the LLM behind the wrapper.
        builder: the wrapper's key builder (its reasoning format parses the outputs).
        cache: the generation cache, or None (nothing is written).
        stats: the wrapper's counters.
        chunk_size: misses per backend call (None: all in one).
        count_time: called with the backend seconds so far before a partly failed chunk raises.
    """

    backend: LLM
    builder: RequestBuilder
    cache: GenerationCache | None
    stats: LLMStats
    chunk_size: int | None
    count_time: Callable[[float], None]

    @property
    def model_id(self) -> str:
        return self.backend.model_id

    def finished(self, out: Generation) -> Generation:
        """A backend's new generation with its reasoning and final answer parsed, counted in
        :attr:`stats`."""
        text, api_reasoning = out.text or "", out.reasoning or ""
        reasoning, final = self.builder.finish(text, api_reasoning)
        gen = replace(out, text=text, final=final, reasoning=reasoning, cached=False)
        if _empty_reply(gen, api_reasoning):
            self.stats.empty += 1
            gen = replace(gen, finish_reason="error")
        self.stats.generations += 1
        self.stats.prompt_tokens += gen.prompt_tokens
        self.stats.completion_tokens += gen.completion_tokens
        return gen

    # -- one sample per request ---------------------------------------------------------------

    def generate(
        self, misses: Sequence[str], requests: Mapping[str, dict[str, Any]], params: SamplingParams,
        uses_of: Mapping[str, Sequence[Use]], owner: LeaseOwner | None = None,
    ) -> tuple[dict[str, Generation], float]:
        """Generate the ``misses`` in chunks of :attr:`chunk_size` (one backend call each),
        committing each generation to the cache as it finishes where the backend reports each
        (the project's backends do), else each chunk when its call returns (releasing ``owner``'s
        leases on what it stores); returns the new generations by key and the seconds spent in
        the backend.

        Raises:
            LLMError: the backend returned the wrong number of outputs, or failed; a partly
                failed chunk is committed first.
        """
        made: dict[str, Generation] = {}
        model_time = 0.0
        step = self.chunk_size or max(len(misses), 1)
        progress = contextlib.ExitStack()
        bar = None
        if misses:
            bar = progress.enter_context(tracking(len(misses), f"generating ({self.model_id})"))
        with progress:
            for start in range(0, len(misses), step):
                chunk = misses[start : start + step]
                empty, saved = self.stats.empty, [0]

                def done(i: int, out: Any, chunk: Sequence[str] = chunk, saved: list[int] = saved) -> None:
                    if out is not None and chunk[i] not in made:
                        saved[0] += self._commit_chunk([chunk[i]], [out], requests, uses_of, made, owner)

                outs, failure, dt = self._backend_chunk([requests[k]["messages"] for k in chunk], params, done)
                model_time += dt
                rest = [(k, o) for k, o in zip(chunk, outs) if k not in made]
                saved[0] += self._commit_chunk([k for k, _ in rest], [o for _, o in rest], requests, uses_of,
                                               made, owner)
                self._warn_empty(self.stats.empty - empty, len(outs))
                missing = start + len(chunk) - bar.n - bar.failed if bar is not None else 0
                if bar is not None and missing > 0:  # a backend that reports nothing itself
                    lost = min(sum(o is None for o in outs), missing)
                    bar.fail(lost)
                    bar.update(missing - lost)
                logger.debug(
                    "%s: generated %d/%d missing outputs (%.1fs)", self.model_id, start + len(chunk), len(misses), dt
                )
                if failure is not None:
                    self.count_time(model_time)
                    raise self._partial_failure(failure, saved[0]) from None
        return made, model_time

    def _backend_chunk(
        self, prompts: list[list[Message]], params: SamplingParams, on_done: Finished | None = None,
    ) -> tuple[Sequence[Generation | None], PartialBatchError | None, float]:
        """ONE ``backend.generate`` call (``on_done`` called as each request finishes, where the
        backend reports each): its outputs (None where a request failed), the
        :class:`PartialBatchError` when some failed, and its wall seconds."""
        t0 = time.perf_counter()
        failure: PartialBatchError | None = None
        try:
            outs: Sequence[Generation | None] = generate_reporting(self.backend, prompts, params, on_done)
        except PartialBatchError as e:
            failure, outs = e, e.generations
        dt = time.perf_counter() - t0
        self.stats.backend_calls += 1
        if len(outs) != len(prompts):
            raise LLMError(
                f"backend {self.model_id!r} returned {len(outs)} generations for {len(prompts)} prompts"
            )
        return outs, failure, dt

    def _commit_chunk(
        self, chunk: Sequence[str], outs: Sequence[Generation | None],
        requests: Mapping[str, dict[str, Any]], uses_of: Mapping[str, Sequence[Use]],
        made: dict[str, Generation], owner: LeaseOwner | None = None,
    ) -> int:
        """Finish outputs into ``made`` and store them (with their uses) in the cache; returns how
        many were stored (not failed or empty items, which a later run retries)."""
        records, kept = [], []
        for key, out in zip(chunk, outs):
            if out is None:
                continue
            gen = made[key] = self.finished(out)
            if gen.finish_reason != "error":  # a failed item is retried next run, not frozen
                records.append(CacheRecord.from_generation(key, requests[key], gen, api_reasoning=out.reasoning or ""))
                kept.append(key)
        if self.cache is not None and records:
            self.cache.put_many(records, [u for k in kept for u in uses_of.get(k, ())], release=owner)
        return len(records)

    def _warn_empty(self, count: int, of: int) -> None:
        if count:
            logger.warning(
                "%s: %d of %d replies came back without any text (content null); they count as "
                "failed, are not cached, and a re-run asks for them again",
                self.model_id, count, of,
            )

    def _partial_failure(self, failure: PartialBatchError, saved: int) -> LLMError:
        """The error a partly failed chunk raises: its first failure's kind, saying what was kept."""
        if self.cache is not None:
            note = (
                f"{saved} generations of that batch were saved to the generation "
                "cache, so a re-run generates only the failed ones"
            )
        else:
            note = "the generations that succeeded are not kept (the cache is off)"
        return type(failure.first)(f"{failure}; {note}")

    # -- several samples per request ----------------------------------------------------------

    def draw_samples(
        self, reqs: Sequence[Sequence[dict[str, Any]]], keys: Sequence[Sequence[str]],
        wanted: Collection[str], params: SamplingParams, n: int, owner: LeaseOwner | None = None,
    ) -> tuple[dict[str, Generation], float]:
        """Every prompt with a sample in ``wanted``, once, through ``backend.generate_samples``
        with ``n`` (in chunks; each prompt's samples committed to the cache as they finish, where the
        backend reports each, else as its chunk returns; releasing ``owner``'s leases); returns
        the ``wanted`` samples, by key, and the seconds spent in the backend."""
        todo: dict[str, int] = {}  # first key of a prompt missing a sample -> its prompt index
        for i, row in enumerate(keys):
            if any(k in wanted for k in row):
                todo.setdefault(row[0], i)
        made: dict[str, Generation] = {}
        model_time = 0.0
        pending = list(todo.values())
        step = self.chunk_size or max(len(pending), 1)
        committed: set[int] = set()  # prompts whose samples are stored
        for start in range(0, len(pending), step):
            chunk = pending[start : start + step]
            empty = self.stats.empty

            def done(j: int, samples: Any, chunk: list[int] = chunk) -> None:
                if samples is not None and len(samples) == n and chunk[j] not in committed:
                    self._commit_samples({chunk[j]: samples}, reqs, keys, wanted, made, owner)
                    committed.add(chunk[j])

            t0 = time.perf_counter()
            outs = samples_reporting(self.backend, [reqs[i][0]["messages"] for i in chunk], params, n, done)
            model_time += time.perf_counter() - t0
            self.stats.backend_calls += 1
            if len(outs) != len(chunk) or any(len(o) != n for o in outs):
                raise LLMError(f"backend {self.model_id!r} did not return {n} samples for each of {len(chunk)} prompts")
            self._commit_samples({i: o for i, o in zip(chunk, outs) if i not in committed}, reqs, keys, wanted,
                                 made, owner)
            committed.update(chunk)
            self._warn_empty(self.stats.empty - empty, len(chunk) * n)
        return made, model_time

    def _commit_samples(
        self, outs: Mapping[int, Sequence[Generation]], reqs: Sequence[Sequence[dict[str, Any]]],
        keys: Sequence[Sequence[str]], wanted: Collection[str], made: dict[str, Generation],
        owner: LeaseOwner | None,
    ) -> None:
        """Finish the ``wanted`` samples of the prompts in ``outs`` (prompt index -> its samples)
        into ``made`` and store them in the cache."""
        records = []
        for i, samples in outs.items():
            for s, out in enumerate(samples):
                key = keys[i][s]
                if key not in wanted:  # cached, or another run's to write
                    continue
                gen = made[key] = self.finished(out)
                if gen.finish_reason != "error":
                    records.append(CacheRecord.from_generation(key, reqs[i][s], gen, api_reasoning=out.reasoning or ""))
        if self.cache is not None and records:
            self.cache.put_many(records, release=owner)


def _empty_reply(gen: Generation, api_reasoning: str) -> bool:
    """Whether a reply holds nothing although the model reported a normal end: no text (an
    OpenAI-compatible ``content: null``, or only whitespace) and no reasoning returned apart.
    Not a success: caching it would serve an empty text to every later run. A reply cut at the
    token limit (``length``) or already failed (``error``) is judged as such, not here."""
    return gen.finish_reason not in ("length", "error") and not gen.text.strip() and not api_reasoning.strip()
