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

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from r2med_agent.errors import ConfigError, DiskFullError, LLMError
from r2med_agent.llm.base import (
    LLM,
    Finished,
    PartialBatchError,
    PromptMeta,
    TemplateHashes,
    generate_reporting,
    samples_reporting,
)
from r2med_agent.llm.cache import (
    LEASE_TTL_S,
    CacheRecord,
    GenerationCache,
    LeaseOwner,
    Use,
    build_request,
    canonical_json,
    request_key,
)
from r2med_agent.llm.openai_compat import key_params, resolve_server
from r2med_agent.llm.parsing import check_format, split_reasoning
from r2med_agent.llm.registry import with_system_prompt
from r2med_agent.progress import current_part as progress_label
from r2med_agent.progress import part as progress_part
from r2med_agent.progress import tracking
from r2med_agent.types import Generation, Message, SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 256
"""Chunk size of a CachedLLM built directly (``make_llm`` picks per backend)."""

DEFAULT_CHUNK_SIZES: dict[str, int | None] = {"vllm": None, "openai": 256, "local": 4}
"""Backend name -> the chunk size of ``chunk_size: auto`` (None: all misses in one call)."""


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


@dataclass(frozen=True)
class RequestBuilder:
    """Turns a prompt into the cache request record and key exactly as a CachedLLM would, without
    a backend (the importer of published caches uses it to key rows it did not generate).

    Attributes:
        model_id: the model's identity (``spec.model``, which every backend reports as its id).
        reasoning_format: how outputs are split into reasoning and final response.
        chat_template_kwargs: chat template options (part of the key).
        system_prompt: prepended as a system message when a prompt has none ("" = never).
        options: other output-changing settings (part of the key), see ``generation_options``.
        wire: for ``openai`` entries, ``server`` (resolved), ``drop_params`` and
            ``max_tokens_param``: the key then holds the sampling fields as they are sent
            (``openai_compat.key_params``), not the SamplingParams asked for. None: every
            SamplingParams field is sent, and keyed, as is.
    """

    model_id: str
    reasoning_format: str = "plain"
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    system_prompt: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)
    wire: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        check_format(self.reasoning_format)

    @classmethod
    def from_spec(cls, spec: Any, model_id: str | None = None) -> RequestBuilder:
        """From a registry entry (``LLMSpec`` or anything with its attribute names)."""
        return cls(
            model_id=model_id if model_id is not None else spec.model,
            reasoning_format=getattr(spec, "reasoning_format", None) or "plain",
            chat_template_kwargs=dict(getattr(spec, "chat_template_kwargs", None) or {}),
            system_prompt=getattr(spec, "system_prompt", "") or "",
            options=generation_options(spec),
            wire=wire_settings(spec),
        )

    def as_sent(self, messages: Sequence[Message]) -> list[Message]:
        """``messages`` as the backend receives them: the system prompt is prepended when the
        prompt has no system message (backends do the same, so this is idempotent)."""
        return with_system_prompt(list(messages), self.system_prompt)

    def request(
        self,
        messages: Sequence[Message],
        params: SamplingParams,
        *,
        sample_index: int = 0,
        template_hash: str = "",
    ) -> dict[str, Any]:
        """The request record hashed into the key (system prompt already prepended)."""
        sampling = key_params(params, **self.wire) if self.wire is not None else params.to_dict()
        return build_request(
            self.model_id,
            self.as_sent(messages),
            sampling,
            chat_template_kwargs=self.chat_template_kwargs,
            sample_index=sample_index,
            template_hash=template_hash,
            options=_request_options(self.options, messages),
        )

    def key(self, messages: Sequence[Message], params: SamplingParams, **kw: Any) -> str:
        return request_key(self.request(messages, params, **kw))

    def parse(self, text: str) -> tuple[str, str]:
        """``(reasoning, final)`` of a raw text under this model's reasoning format."""
        return split_reasoning(text, self.reasoning_format)

    def finish(self, text: str, api_reasoning: str = "") -> tuple[str, str]:
        """``(reasoning, final)`` of an output: the text parsed under this model's format, with
        reasoning the API returned apart from the text (``api_reasoning``) put first."""
        reasoning, final = self.parse(text)
        return join_reasoning(api_reasoning, reasoning), final


def join_reasoning(api_reasoning: str, parsed: str) -> str:
    """Reasoning returned apart from the text, then any reasoning found inside the text."""
    return "\n\n".join(r for r in (api_reasoning.strip(), parsed) if r)


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
    attributes below tune it; see ``GenerationCache.claim``).
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

    def _finished(self, out: Generation) -> Generation:
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

    def _generate_shared(
        self, misses: Sequence[str], requests: Mapping[str, dict[str, Any]], params: SamplingParams,
        uses_of: Mapping[str, Sequence[Use]], t_start: float, hits: dict[str, CacheRecord],
    ) -> tuple[dict[str, Generation], float]:
        """Generate the ``misses`` that no other run is generating (see :meth:`_shared`)."""

        def produce(keys: list[str], owner: LeaseOwner | None) -> tuple[dict[str, Generation], float]:
            self._log_plan(len(keys), len(requests), len(hits), len(misses) - len(keys))
            return self._generate_misses(keys, requests, params, uses_of, t_start, owner)

        return self._shared(misses, produce, hits, uses_of)

    def _shared(
        self, misses: Sequence[str],
        produce: Callable[[list[str], LeaseOwner | None], tuple[dict[str, Generation], float]],
        hits: dict[str, CacheRecord], uses_of: Mapping[str, Sequence[Use]],
    ) -> tuple[dict[str, Generation], float]:
        """``produce`` (one backend call per chunk) the ``misses`` no other run is generating;
        wait for the rest.

        The misses are leased in the cache first (see ``GenerationCache.claim``): those this call
        claims are produced together; those another live run holds are waited for, and their
        rows are added to ``hits`` (with their uses) when that run writes them. A key whose
        owner died or gave up (no row, no live lease) is claimed again and produced here.
        Without a cache, or on ``refresh``, every miss is produced here.
        """
        if self.cache is None or self.refresh or not misses:
            return produce(list(misses), None) if misses else ({}, 0.0)
        made: dict[str, Generation] = {}
        model_time = 0.0
        pending, force = list(misses), False
        while pending:
            owner = LeaseOwner.new()
            claim = self.cache.claim(pending, owner, ttl_s=self.lease_ttl_s, force=force)
            self._take_rows(claim.done, hits, uses_of)
            if claim.held:
                logger.info("%s: %d texts are being generated by another run; waiting for them",
                            self.model_id, len(claim.held))
            if claim.claimed:
                with self._holding(owner):
                    new, dt = produce(claim.claimed, owner)
                made.update(new)
                model_time += dt
            pending, force = self._wait_for_others(list(claim.held), hits, uses_of)
        return made, model_time

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

    def _take_rows(
        self, keys: Sequence[str], hits: dict[str, CacheRecord], uses_of: Mapping[str, Sequence[Use]]
    ) -> list[str]:
        """Add the rows of ``keys`` that are in the cache to ``hits``, recording their uses;
        returns the keys still without a row."""
        assert self.cache is not None
        rows = self.cache.get_many(keys) if keys else {}
        hits.update(rows)
        uses = [u for k in rows for u in uses_of.get(k, ())]
        if uses:
            self.cache.add_uses(uses)
        return [k for k in keys if k not in rows]

    def _wait_for_others(
        self, keys: list[str], hits: dict[str, CacheRecord], uses_of: Mapping[str, Sequence[Use]],
    ) -> tuple[list[str], bool]:
        """Poll the cache until another run has written every row of ``keys``, or some key has
        no live owner any more (it died, or its item failed); returns the keys still missing, to
        claim again, and whether to take them by force (after :attr:`lease_wait_s`)."""
        assert self.cache is not None
        started = last_note = time.monotonic()
        while True:
            keys = self._take_rows(keys, hits, uses_of)
            if not keys:
                return [], False
            held = self.cache.held_by_others(keys, LeaseOwner.new(), ttl_s=self.lease_ttl_s)
            if len(held) < len(keys):
                return keys, False
            waited = time.monotonic() - started
            if waited >= self.lease_wait_s:
                logger.warning(
                    "%s: waited %.0fs for %d texts another run is generating; generating them here",
                    self.model_id, waited, len(keys),
                )
                return keys, True
            if time.monotonic() - last_note >= self.lease_note_s:
                last_note = time.monotonic()
                who = ", ".join(sorted({o.describe() for o in held.values()}))
                logger.info("%s: waiting for %d texts being generated by %s (%.0fs so far)",
                            self.model_id, len(keys), who, waited)
            time.sleep(self.lease_poll_s)

    @contextlib.contextmanager
    def _holding(self, owner: LeaseOwner) -> Any:
        """While the block runs, refresh ``owner``'s heartbeat every third of the lease's time to
        live (from a thread); afterwards, by success or error, release its remaining leases."""
        assert self.cache is not None
        cache = self.cache
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.lease_ttl_s / 3):
                try:
                    cache.heartbeat(owner)
                except Exception as e:  # a missed heartbeat only lets others take over sooner
                    logger.warning("generation cache heartbeat failed: %s", e)

        thread = threading.Thread(target=beat, name="cache-lease-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            try:
                cache.release(owner)
            except Exception as e:  # never hides the error that ended the block
                # (a full disk is the run's own error, said once by whoever meets it)
                log = logger.debug if isinstance(e, DiskFullError) else logger.warning
                log("%s: could not release its cache leases (%s); they lapse when this process ends",
                    self.model_id, e)

    def _generate_misses(
        self, misses: Sequence[str], requests: Mapping[str, dict[str, Any]], params: SamplingParams,
        uses_of: Mapping[str, Sequence[Use]], t_start: float, owner: LeaseOwner | None = None,
    ) -> tuple[dict[str, Generation], float]:
        """Generate the ``misses`` in chunks of :attr:`chunk_size` (one backend call each),
        committing each generation to the cache as it finishes where the backend reports each
        (the project's backends do), else each chunk when its call returns (releasing ``owner``'s
        leases on what it stores); returns the new generations by key and the seconds spent in
        the backend.

        Raises:
            LLMError: as :meth:`generate` (a partly failed chunk is committed first).
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
                    self._count_time(model_time, t_start)
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
            gen = made[key] = self._finished(out)
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

        def produce(wanted: list[str], owner: LeaseOwner | None) -> tuple[dict[str, Generation], float]:
            return self._draw_missing_samples(reqs, keys, set(wanted), params, n, owner)

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

    def _draw_missing_samples(
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
                gen = made[key] = self._finished(out)
                if gen.finish_reason != "error":
                    records.append(CacheRecord.from_generation(key, reqs[i][s], gen, api_reasoning=out.reasoning or ""))
        if self.cache is not None and records:
            self.cache.put_many(records, release=owner)

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


def _empty_reply(gen: Generation, api_reasoning: str) -> bool:
    """Whether a reply holds nothing although the model reported a normal end: no text (an
    OpenAI-compatible ``content: null``, or only whitespace) and no reasoning returned apart.
    Not a success: caching it would serve an empty text to every later run. A reply cut at the
    token limit (``length``) or already failed (``error``) is judged as such, not here."""
    return gen.finish_reason not in ("length", "error") and not gen.text.strip() and not api_reasoning.strip()


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


def generation_options(spec: Any) -> dict[str, Any]:
    """Spec settings outside SamplingParams that change what a model generates (part of the key).

    ``reasoning_effort`` goes in as is; ``extra_body`` only as a hash, so whatever a user put
    there is never stored in the cache file.
    """
    options: dict[str, Any] = {}
    effort = getattr(spec, "reasoning_effort", None)
    if effort is not None:
        options["reasoning_effort"] = effort
    extra = getattr(spec, "extra_body", None)
    if extra:
        options["extra_body_sha256"] = hashlib.sha256(canonical_json(extra).encode("utf-8")).hexdigest()
    backend = getattr(spec, "backend", None)
    if backend == "vllm" and getattr(spec, "prompt_path", "chat") != "chat":
        options["prompt_path"] = spec.prompt_path
    if backend == "vllm":
        engine = engine_options(spec)
        if engine:
            options["engine"] = engine
        # The generation prompt is rendered once and the running text appended (never
        # continue_final_message, whose prompts differ under reasoning templates): such
        # continuations never share keys with ones made the other way.
        options[_CONTINUES] = "append"
    elif backend == "openai" and resolve_server(spec) == "vllm":
        # Rendered on the client the same way and sent to the completions endpoint; the
        # tokenizer whose template renders it is part of the key.
        tokenizer = getattr(spec, "tokenizer", None)
        options[_CONTINUES] = f"append (tokenizer {tokenizer})" if tokenizer else "append"
    elif backend == "local":
        options[_CONTINUES] = "continue"
    return options


def engine_options(spec: Any) -> dict[str, Any]:
    """The vLLM engine settings that change outputs, for the key: every ``engine_kwargs`` entry
    (``enforce_eager``: compiled and eager engines decode differently; ``dtype``,
    ``quantization``, ...) and ``max_model_len``. Empty when none is set, so entries without
    them keep their keys. Memory and parallelism settings are left out."""
    out: dict[str, Any] = {}
    kwargs = getattr(spec, "engine_kwargs", None) or {}
    if kwargs:
        out["engine_kwargs"] = json_safe(dict(kwargs))
    max_len = getattr(spec, "max_model_len", None)
    if max_len is not None:
        out["max_model_len"] = max_len
    return out


def json_safe(value: Any) -> Any:
    """``value`` with anything JSON cannot hold as its ``repr`` (keys stay comparable)."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def wire_settings(spec: Any) -> dict[str, Any] | None:
    """For an ``openai`` entry, what decides how sampling parameters are sent (resolved server
    kind, dropped parameters, the token-limit field); None for other backends, which send every
    SamplingParams field. The URLs themselves never enter: only the server kind they resolve to."""
    if getattr(spec, "backend", None) != "openai":
        return None
    return {
        "server": resolve_server(spec),
        "drop_params": tuple(getattr(spec, "drop_params", ()) or ()),
        "max_tokens_param": getattr(spec, "max_tokens_param", "max_tokens"),
    }


_CONTINUES = "continues_final_message"
"""Option marking backends that continue a trailing assistant message instead of answering it
in a new turn, valued by how they build the continued prompt; it enters a key only for prompts
that end with an assistant message."""


def _request_options(options: Mapping[str, Any], messages: Sequence[Message]) -> dict[str, Any]:
    opts = dict(options)
    continues = opts.pop(_CONTINUES, None)
    if messages and messages[-1].get("role") == "assistant":
        opts["final_assistant"] = continues or "new_turn"
    return opts
