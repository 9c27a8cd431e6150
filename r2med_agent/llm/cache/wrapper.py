"""``CachedLLM``: the wrapper every backend runs behind.

It looks every request up in the generation cache, sends only the misses to the backend (in
chunks), commits each generation to the cache as it finishes, so an interrupted or killed run
resumes where it stopped, applies reasoning-output parsing (``final``/``reasoning``) from the
model's registry entry, and counts calls, hits, tokens and seconds in ``stats``.

Every backend of the project reports each request as it finishes, inside its call
(``on_done``, :data:`~r2med_agent.llm.base.Finished`): llama.cpp after each completion, the HTTP
backend as each reply arrives, vLLM's offline engine as each request leaves the engine, while the
others still run. A Ctrl-C or a kill then loses only the generations in progress. An LLM of your
own without ``on_done`` is committed when each of its calls returns.

Chunk size: each chunk is one ``backend.generate`` call, i.e. one engine batch. One chunk for
everything gives an engine the whole run at once (vLLM's continuous batching stays full to the
end, with one drain tail instead of one per chunk); smaller chunks show the plan's calls sooner and
bound what one call holds in memory, at the price of a drain tail per chunk. The registry's
``chunk_size`` (and ``run --chunk-size``) decides; ``auto`` picks per backend
(``DEFAULT_CHUNK_SIZES``): vLLM everything in ONE engine call (the reference's way, e.g. R2MED's
876 queries), HTTP APIs 256 (within a chunk requests run concurrently and every success is kept
even when some fail), the in-process llama.cpp engine 4 (it decodes prompts one after another, so
small chunks cost no throughput).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from r2med_agent.errors import ConfigError
from r2med_agent.llm.base import (
    LLM,
    Finished,
    PromptMeta,
    TemplateHashes,
    generate_reporting,
    samples_reporting,
)
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.dispatch import Dispatch, LLMStats
from r2med_agent.llm.cache.keys import RequestBuilder, engine_options, generation_options, join_reasoning, json_safe, wire_settings
from r2med_agent.llm.cache.leases import LEASE_TTL_S, LeaseOwner
from r2med_agent.llm.cache.records import CacheRecord, Use, request_key
from r2med_agent.llm.servers import resolve_server
from r2med_agent.llm.cache.sharing import LeaseTiming, Produce, SharedMisses
from r2med_agent.progress import current_part as progress_label
from r2med_agent.progress import part as progress_part
from r2med_agent.types import Generation, Message, SamplingParams

__all__ = [
    "DEFAULT_CHUNK_SIZE", "DEFAULT_CHUNK_SIZES", "CachedLLM", "LLMStats", "LazyBackend", "RequestBuilder",
    "close_backend", "engine_options", "generation_options", "join_reasoning", "json_safe", "wire_settings",
]
"""The wrapper's names; its parts live beside it: key building in :mod:`~r2med_agent.llm.cache.keys`,
backend dispatch and the write queue in :mod:`~r2med_agent.llm.cache.dispatch`, waiting for other runs
in :mod:`~r2med_agent.llm.cache.sharing`."""

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 256
"""Chunk size of a CachedLLM built directly (``make_llm`` picks per backend)."""

DEFAULT_CHUNK_SIZES: dict[str, int | None] = {"vllm": None, "openai": 256, "local": 4}
"""Backend name -> the chunk size of ``chunk_size: auto`` (None: all misses in one call)."""


class LazyBackend:
    """Builds the real backend on the first ``generate`` call.

    A run whose every request is a cache hit (e.g. scoring imported R2MED generations) then
    never loads a model or needs the backend's optional dependency. ``model_id`` is fixed up
    front (the registry's ``spec.model``), so cache keys do not depend on whether the backend
    was built.
    """

    def __init__(self, factory: Callable[[], LLM], model_id: str) -> None:
        self._factory = factory
        self._backend: LLM | None = None
        self.model_id = model_id

    @property
    def built(self) -> bool:
        return self._backend is not None

    def get(self) -> LLM:
        """The real backend (built now if needed)."""
        if self._backend is None:
            logger.info("loading backend for %s", self.model_id)
            self._backend = self._factory()
        return self._backend

    reports_each = True
    """It passes ``on_done`` on to a backend that takes it (:func:`~r2med_agent.llm.base.reports_each`)."""

    # The request options are the cache's (see LLM): the backend's texts do not depend on them,
    # so they are not passed on.
    def generate(
        self, prompts: Sequence[list[Message]], params: SamplingParams, *, sample_index: int = 0,
        template_hash: TemplateHashes = "", meta: Sequence[PromptMeta] | None = None,
        on_done: Finished | None = None,
    ) -> list[Generation]:
        return generate_reporting(self.get(), prompts, params, on_done)

    def generate_samples(
        self, prompts: Sequence[list[Message]], params: SamplingParams, n: int, *,
        template_hash: TemplateHashes = "", meta: Sequence[PromptMeta] | None = None,
        on_done: Finished | None = None,
    ) -> list[list[Generation]]:
        return samples_reporting(self.get(), prompts, params, n, on_done)

    def close(self) -> None:
        """Close the real backend if it was built (a vLLM engine shuts down); a later
        ``generate`` builds a new one."""
        backend, self._backend = self._backend, None
        close_backend(backend)


def close_backend(backend: Any) -> None:
    """Call ``backend.close()`` when it has one (backends holding engines or processes do)."""
    close = getattr(backend, "close", None)
    if callable(close):
        close()


class CachedLLM:
    """A backend behind the generation cache and reasoning-output parsing.

    Args:
        backend: any ``LLM`` (vLLM, OpenAI-compatible, local llama.cpp, a test fake).
        spec_or_model_id: the registry entry (``LLMSpec``), whose ``reasoning_format``,
            ``chat_template_kwargs``, ``system_prompt``, ``reasoning_effort`` and ``extra_body``
            apply, or just a model id string (then no system prompt is added).
        reasoning_format: ``plain``, ``think``, ``huatuo`` or ``search-r1``; overrides the spec's.
        cache: the generation cache, or None to disable caching (``--no-cache``).
        refresh: ignore cache hits and overwrite them with new generations (``--refresh-cache``).
        chunk_size: misses sent per backend call and committed together; None or 0 sends all
            misses in one call (see the module docstring for the trade-off).
        chat_template_kwargs: chat template options the backend applies (part of the key);
            overrides the spec's.

    ``model_id`` is the backend's. The spec's name, base URLs and API key never reach the cache.

    Runs sharing a cache file never send the same request twice: misses are leased in the cache
    before the backend call, and misses another live run holds are waited for (the class
    attributes below tune it; see :mod:`~r2med_agent.llm.cache.sharing`).
    """

    lease_ttl_s: float = LEASE_TTL_S
    """A lease of another host whose heartbeat is older than this is taken over."""
    lease_wait_s: float = 6 * 3600.0
    """The longest wait for texts another live run is generating; then they are generated here."""
    lease_poll_s: float = 0.5
    """Seconds between looks at the cache while waiting."""
    lease_note_s: float = 30.0
    """Seconds between progress lines while waiting."""

    def __init__(
        self,
        backend: LLM,
        spec_or_model_id: Any = None,
        reasoning_format: str | None = None,
        cache: GenerationCache | None = None,
        refresh: bool = False,
        chunk_size: int | None = DEFAULT_CHUNK_SIZE,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.backend = backend
        if isinstance(spec_or_model_id, str) and spec_or_model_id != backend.model_id:
            raise ConfigError(
                f"model id {spec_or_model_id!r} does not match the backend's {backend.model_id!r}"
            )
        spec = None if spec_or_model_id is None or isinstance(spec_or_model_id, str) else spec_or_model_id
        self.spec = spec
        base = (
            RequestBuilder.from_spec(spec, model_id=backend.model_id)
            if spec is not None
            else RequestBuilder(model_id=backend.model_id)
        )
        changes: dict[str, Any] = {}
        if reasoning_format is not None:
            changes["reasoning_format"] = reasoning_format
        if chat_template_kwargs is not None:
            changes["chat_template_kwargs"] = dict(chat_template_kwargs)
        self.builder = replace(base, **changes)
        self.cache = cache
        self.refresh = refresh
        if chunk_size is not None and chunk_size < 0:
            raise ConfigError(
                f"chunk_size must be a positive integer, or 0/None for one call, got {chunk_size}"
            )
        self.chunk_size = chunk_size or None
        self.stats = LLMStats()

    @property
    def model_id(self) -> str:
        return self.backend.model_id

    @property
    def reasoning_format(self) -> str:
        return self.builder.reasoning_format

    def close(self) -> None:
        """Release the backend's engine or processes (vLLM: its engine shuts down). The runner
        calls it when a run ends; a later ``generate`` starts the backend again."""
        close_backend(self.backend)

    def request(
        self,
        messages: Sequence[Message],
        params: SamplingParams,
        *,
        sample_index: int = 0,
        template_hash: str = "",
    ) -> dict[str, Any]:
        """The cache request record (hashed into the key) for one prompt as this wrapper sends it."""
        return self.builder.request(messages, params, sample_index=sample_index, template_hash=template_hash)

    def parse(self, text: str) -> tuple[str, str]:
        """``(reasoning, final)`` of a raw text under this model's reasoning format."""
        return self.builder.parse(text)

    def generate(
        self,
        prompts: Sequence[list[Message]],
        params: SamplingParams,
        *,
        sample_index: int = 0,
        template_hash: TemplateHashes = "",
        meta: Sequence[PromptMeta] | None = None,
    ) -> list[Generation]:
        """One Generation per prompt, in input order, with ``final``/``reasoning`` filled.

        Args:
            prompts: chat message lists, each exactly as it will be sent.
            params: sampling settings (every field is part of the key).
            sample_index: which sample of each request this is (part of the key); use 0, 1, ...
                to draw several samples of the same prompts.
            template_hash: version hash of the prompt template (part of the key): one string
                for all prompts, or one per prompt (a batch spanning several tasks' templates).
            meta: optional per-prompt dicts such as ``{"task", "query_id", "method"}``, stored
                with the rows (not part of the key) so the cache can be exported per query.

        Returns:
            Generations in input order; ``cached=True`` for those served from the cache, whose
            token counts and latency are those of the original generation.

        Raises:
            LLMError: the backend returned the wrong number of outputs, or failed. When some
                requests of a chunk failed and others succeeded
                (:class:`~r2med_agent.llm.base.PartialBatchError`), the successes are committed
                to the cache first, so a re-run generates only what failed.
        """
        t_start = time.perf_counter()
        if meta is not None and len(meta) != len(prompts):
            raise ValueError(f"meta has {len(meta)} entries for {len(prompts)} prompts")
        hashes = _template_hashes(template_hash, len(prompts))
        self.stats.calls += 1
        keys, requests = self._keyed_requests(prompts, params, sample_index, hashes)
        uses_of: dict[str, list[Use]] = {}
        for k, m in zip(keys, meta or ()):
            if m:
                uses_of.setdefault(k, []).append(Use.from_meta(k, m))
        hits = self._cached(requests)
        misses = [k for k in requests if k not in hits]
        if self.cache is not None:
            hit_uses = [u for k in hits for u in uses_of.get(k, ())]
            if hit_uses:
                self.cache.add_uses(hit_uses)
        made, model_time = self._generate_shared(misses, requests, params, uses_of, t_start, hits)
        out = self._in_prompt_order(keys, made, hits)
        self._count_time(model_time, t_start)
        if hits or misses:
            logger.debug(
                "%s: %d prompts, %d cache hits, %d generated (%.1fs in the model)",
                self.model_id, len(keys), sum(1 for k in keys if k in hits), len(made), model_time,
            )
        return out

    def _keyed_requests(
        self, prompts: Sequence[list[Message]], params: SamplingParams, sample_index: int,
        hashes: Sequence[str],
    ) -> tuple[list[str], dict[str, dict[str, Any]]]:
        """The key of each prompt in input order, and each distinct key's request record."""
        requests: dict[str, dict[str, Any]] = {}
        keys: list[str] = []
        for messages, t_hash in zip(prompts, hashes):
            req = self.request(messages, params, sample_index=sample_index, template_hash=t_hash)
            key = request_key(req)
            keys.append(key)
            requests.setdefault(key, req)
        return keys, requests

    def _cached(self, keys: Iterable[str]) -> dict[str, CacheRecord]:
        """The cache's records of ``keys`` (none with the cache off or on ``refresh``)."""
        if self.cache is None or self.refresh:
            return {}
        return self.cache.get_many(keys)

    def _dispatch(self, t_start: float) -> Dispatch:
        """The backend dispatch and write queue of one call (started at ``t_start``)."""
        return Dispatch(self.backend, self.builder, self.cache, self.stats, self.chunk_size,
                        count_time=lambda model_time: self._count_time(model_time, t_start))

    def _generate_shared(
        self, misses: Sequence[str], requests: Mapping[str, dict[str, Any]], params: SamplingParams,
        uses_of: Mapping[str, Sequence[Use]], t_start: float, hits: dict[str, CacheRecord],
    ) -> tuple[dict[str, Generation], float]:
        """Generate the ``misses`` that no other run is generating (see :meth:`_shared`)."""
        dispatch = self._dispatch(t_start)

        def produce(keys: list[str], owner: LeaseOwner | None) -> tuple[dict[str, Generation], float]:
            self._log_plan(len(keys), len(requests), len(hits), len(misses) - len(keys))
            return dispatch.generate(keys, requests, params, uses_of, owner)

        return self._shared(misses, produce, hits, uses_of)

    def _shared(
        self, misses: Sequence[str], produce: Produce, hits: dict[str, CacheRecord],
        uses_of: Mapping[str, Sequence[Use]],
    ) -> tuple[dict[str, Generation], float]:
        """``produce`` (one backend call per chunk) the ``misses`` no other run is generating;
        wait for the rest (:class:`~r2med_agent.llm.cache.sharing.SharedMisses`; rows others write are
        added to ``hits``). Without a cache, or on ``refresh``, every miss is produced here."""
        if self.cache is None or self.refresh or not misses:
            return produce(list(misses), None) if misses else ({}, 0.0)
        timing = LeaseTiming(self.lease_ttl_s, self.lease_wait_s, self.lease_poll_s, self.lease_note_s)
        return SharedMisses(self.cache, self.model_id, timing, hits, uses_of).produce(misses, produce)

    def _log_plan(self, generating: int, total: int, cached: int, elsewhere: int) -> None:
        if not generating:
            return
        calls = -(-generating // (self.chunk_size or generating))
        label = progress_label()  # which pass over the same prompts this is, when there are several
        logger.info(
            "%s: generating %d of %d texts (%d from the cache%s) in %d backend call%s%s",
            self.model_id, generating, total, cached,
            f", {elsewhere} from another run" if elsewhere else "", calls, "" if calls == 1 else "s",
            f" {label}" if label else "",
        )

    def _in_prompt_order(
        self, keys: Sequence[str], made: Mapping[str, Generation], hits: Mapping[str, CacheRecord]
    ) -> list[Generation]:
        """One generation per key, new or from the cache, counting hits and duplicates."""
        out: list[Generation] = []
        seen: set[str] = set()
        for key in keys:
            if key in made:
                out.append(made[key])
                if key in seen:
                    self.stats.deduplicated += 1
            else:
                out.append(self._from_record(hits[key]))
                self.stats.cache_hits += 1
            seen.add(key)
        return out

    def _from_record(self, rec: CacheRecord) -> Generation:
        """A cached record as a Generation, its reasoning and final answer parsed."""
        reasoning, final = self.builder.finish(rec.text, rec.api_reasoning)
        return replace(rec.to_generation(), reasoning=reasoning, final=final)

    def _count_time(self, model_time: float, t_start: float) -> None:
        """Add a call's seconds to :attr:`stats`: ``model_time`` in the backend, the rest of the
        time since ``t_start`` as overhead."""
        self.stats.model_time_s += model_time
        self.stats.overhead_time_s += time.perf_counter() - t_start - model_time

    def generate_samples(
        self,
        prompts: Sequence[list[Message]],
        params: SamplingParams,
        n: int,
        *,
        template_hash: TemplateHashes = "",
        meta: Sequence[PromptMeta] | None = None,
    ) -> list[list[Generation]]:
        """``n`` samples of each prompt: ``out[i][s]`` is sample ``s`` of prompt ``i``.

        Sample ``s`` is cached under the prompt's request with ``sample_index=s``, so sample 0 is
        the generation :meth:`generate` makes, and asking for more samples later makes only the
        new ones. A backend that draws several samples per request (vLLM, and the ``openai`` and
        ``vllm`` server kinds, through ``n``) gets every prompt missing a sample once, with ``n``,
        and the missing samples are kept. Another backend (llama.cpp) gets one ``generate`` call
        per sample index, sample ``s`` drawn with the seed plus ``s`` (and keyed so).
        """
        if n < 1:
            raise ConfigError(f"the number of samples must be at least 1, got {n}")
        hashes = _template_hashes(template_hash, len(prompts))
        if n == 1 or not self._draws_n():
            return self._samples_one_index_at_a_time(prompts, params, n, hashes, meta)
        t_start = time.perf_counter()
        self.stats.calls += 1
        reqs = [
            [self.request(p, params, sample_index=s, template_hash=h) for s in range(n)]
            for p, h in zip(prompts, hashes)
        ]
        keys = [[request_key(r) for r in row] for row in reqs]
        hits = self._cached([k for row in keys for k in row])
        missing = list(dict.fromkeys(k for row in keys for k in row if k not in hits))

        dispatch = self._dispatch(t_start)

        def produce(wanted: list[str], owner: LeaseOwner | None) -> tuple[dict[str, Generation], float]:
            return dispatch.draw_samples(reqs, keys, set(wanted), params, n, owner)

        made, model_time = self._shared(missing, produce, hits, {})
        out = self._samples_in_order(keys, made, hits, meta)
        self._count_time(model_time, t_start)
        return out

    def _samples_one_index_at_a_time(
        self, prompts: Sequence[list[Message]], params: SamplingParams, n: int,
        hashes: Sequence[str], meta: Sequence[PromptMeta] | None,
    ) -> list[list[Generation]]:
        """``n`` samples as one :meth:`generate` call per sample index (a backend without
        ``n``), sample ``s`` drawn with the seed plus ``s``."""

        def meta_of(s: int) -> list[PromptMeta] | None:
            if meta is None:
                return None
            return [None if m is None else {**m, "sample": s} for m in meta]

        per = []
        for s in range(n):
            with progress_part(f"sample {s + 1}/{n}" if n > 1 else ""):  # which bar is which
                per.append(self.generate(prompts, _sample_seed(params, s), sample_index=s,
                                         template_hash=hashes, meta=meta_of(s)))
        return [[per[s][i] for s in range(n)] for i in range(len(prompts))]

    def _samples_in_order(
        self, keys: Sequence[Sequence[str]], made: Mapping[str, Generation],
        hits: Mapping[str, CacheRecord], meta: Sequence[PromptMeta] | None,
    ) -> list[list[Generation]]:
        """Each prompt's samples, new or from the cache, in order; records each sample's use."""
        uses = []
        out: list[list[Generation]] = []
        for i, row in enumerate(keys):
            samples = []
            for s, key in enumerate(row):
                if key in made:
                    samples.append(made[key])
                else:
                    samples.append(self._from_record(hits[key]))
                    self.stats.cache_hits += 1
                if meta is not None and meta[i]:
                    uses.append(Use.from_meta(key, {**meta[i], "sample": s}))
            out.append(samples)
        if self.cache is not None and uses:
            self.cache.add_uses(uses)
        return out

    def _draws_n(self) -> bool:
        """Whether the backend draws several samples in one request (without building it)."""
        spec = self.spec
        if spec is not None and getattr(spec, "backend", None) in ("vllm", "openai", "local"):
            return spec.backend == "vllm" or (
                spec.backend == "openai" and resolve_server(spec) in ("openai", "vllm")
            )
        return callable(getattr(self.backend, "generate_samples", None))


def _template_hashes(template_hash: TemplateHashes, count: int) -> list[str]:
    """``template_hash`` as one hash per prompt (a single string stands for every prompt)."""
    hashes = [template_hash] * count if isinstance(template_hash, str) else list(template_hash)
    if len(hashes) != count:
        raise ValueError(f"template_hash has {len(hashes)} entries for {count} prompts")
    return hashes


def _sample_seed(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index`` of a backend without ``n``: drawn alone, with the seed moved by the
    index (the same seed would draw the same text again)."""
    if index == 0 or params.seed is None:
        return params
    return replace(params, seed=params.seed + index)

