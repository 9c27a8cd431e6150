"""Backend for any OpenAI-compatible chat endpoint: the OpenAI API, ``vllm serve``, SGLang,
``python -m llama_cpp.server``.

A batch is sent as concurrent requests (at most ``max_concurrency`` in flight) over one or more
base URLs, least-loaded first; results come back in input order. Our retries are the only ones
(the openai client's own are off): 429, 5xx, 408, timeouts, connection errors and malformed
200 replies (a body that is not JSON, an HTML page, no choices, or valid JSON of the wrong types:
a ``content`` that is a number or a list, a ``message`` that is a string, a token count that is
not a number) are retried with exponential backoff and jitter, or after the server's
``Retry-After``; 400/401/403/404/422 raise
:class:`LLMError` at once. A reply whose content is null (and that has no separate reasoning)
is a generation with ``finish_reason`` ``error``, which the cache does not keep; such replies
are counted (``null_replies``) and a batch that had some says so in one warning. While replies
are awaited and none has come for :data:`HEARTBEAT_S`, a line says what is waited for.

With several base URLs a retry goes to another URL than the attempt that failed, and a URL whose
attempt failed with a connection error, a timeout or a 5xx is cooled down: skipped while any
other URL is available, for ``backoff_initial_s`` after its first failure in a row, doubling per
further failure up to ``backoff_max_s``; one success ends it. A dead endpoint thus costs a few
probes, not a share of the traffic.

A request that fails for good does not stop its siblings: the batch finishes and raises
:class:`~r2med_agent.llm.base.PartialBatchError` with every generation that succeeded (the cache
wrapper stores them before the error propagates). Only an authentication error (401/403), which
every request would meet, cancels the requests still running.

The API key is read only from the environment variable the registry entry names
(``api_key_env``); it is never logged, cached or put into an error message.

A conversation whose last message is an assistant message asks the model to CONTINUE that text
(the reasoning-search loops re-submit a trajectory's running text that way). What happens
depends on the ``server`` of the registry entry (``auto``: asked of the server itself, see
:func:`resolve_server`):

- ``vllm`` (vLLM, SGLang): the prompt is rendered HERE, as the offline vLLM backend and the
  original Search-o1 do it: the messages before the final one through the model's own chat
  template (a ``transformers`` tokenizer of ``tokenizer``, default ``model``: its files only, no
  weights) with the generation prompt, then the running text appended as it is; that text goes
  to the server's completions endpoint (``/v1/completions``, ``add_special_tokens: false``, as
  the template holds them). Letting the server re-render the text as an assistant message
  (``continue_final_message``) breaks reasoning models: QwQ and the R1 distills lose the
  ``<think>`` their generation prompt opened, Qwen3 gets an empty think block in front.
- ``llamacpp``: the messages are sent as they are. llama.cpp's own ``llama-server`` continues a
  final assistant message by default (its "assistant prefill"; off with
  ``--no-prefill-assistant``). llama-cpp-python's ``python -m llama_cpp.server`` has no such
  option: its chat endpoint always renders the generation prompt, so the model answers in a new
  turn; continuing would need ``/v1/completions`` with a prompt rendered by the model's chat
  template, which that server does not expose to clients. Use the ``local`` backend (llama.cpp
  in-process, which continues) or a vLLM/``llama-server`` endpoint where it matters.
- ``openai`` (hosted OpenAI API): chat completions have no prefill; the model answers in a new
  turn (logged once at debug level).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from r2med_agent.errors import ConfigError, LLMError
from r2med_agent.llm.base import (
    AuthError, Finished, PartialBatchError, PromptMeta, TemplateHashes, UnreachableError, choice_token_ids,
)
from r2med_agent.llm.continuation import continuation_prompt, continues_final_message
from r2med_agent.llm.registry import LLMSpec, with_system_prompt
from r2med_agent.llm.replies import (
    MalformedReplyError,
    check_reply,
    samples,
    task_completion_tokens,
    to_generation,
)
from r2med_agent.llm.retry import RequestErrors, UrlPool, retry_after_seconds, retrying
from r2med_agent.llm.servers import PROBE_TIMEOUT_S, detect_server, is_loopback_url, resolve_server
from r2med_agent.llm.wire import OPENAI_MAX_STOP, key_params, truncate_at_stop, unsent_token_limit, wire_sampling
from r2med_agent.net import DeadlineError, ReplyTooLarge, capped_hooks, run_coroutine, within
from r2med_agent.progress import for_backend
from r2med_agent.redaction import redact_url, remember_secret, remember_url_secrets
from r2med_agent.types import Generation, Message, SamplingParams

__all__ = [
    "CONNECT_TIMEOUT_S", "HEARTBEAT_S", "OPENAI_MAX_STOP", "PROBE_TIMEOUT_S", "MalformedReplyError",
    "OpenAICompatBackend", "check_reply", "detect_server", "is_loopback_url", "key_params", "load_chat_tokenizer",
    "resolve_server", "retry_after_seconds", "truncate_at_stop", "wire_sampling",
]
"""The backend and the names it is built from: server detection (:mod:`~r2med_agent.llm.servers`),
sampling on the wire (:mod:`~r2med_agent.llm.wire`), reading replies
(:mod:`~r2med_agent.llm.replies`) and retries (:mod:`~r2med_agent.llm.retry`)."""

logger = logging.getLogger(__name__)
T = TypeVar("T")

HEARTBEAT_S = 30.0
"""While replies are awaited and none has come for this many seconds, a line (logged at info
level, which the CLI shows) says how many are awaited from where and the attempt timeout, so a
hung server is not silent until the timeout."""

CONNECT_TIMEOUT_S = 10.0
"""The most of ``timeout_s`` spent connecting: a server that does not accept a connection in
this time is down or unreachable, whatever the generation time allowed."""

_NEW_TURN_NOTES = {
    "openai": "the OpenAI API has no assistant prefill: a final assistant message is answered "
    "in a new turn, not continued",
    "llamacpp": "a final assistant message is sent as is: llama.cpp's llama-server continues it, "
    "llama-cpp-python's server answers it in a new turn",
}
"""Logged once per backend (debug) when a server cannot be asked to continue a final message."""


class _Reporter:
    """The done-callback of a batch's request tasks: counts each in the progress (a failed or
    cancelled one apart: a batch whose requests failed is not "done"), passes each success to
    ``on_done`` (its index and output) and keeps the first error ``on_done`` raises (asyncio
    would only log it). Idempotent per index: the batch calls it again for every done task
    before it closes, because ``asyncio.wait`` can see a task done before its done-callbacks ran
    (a progress line once said 6 of 12 failed requests)."""

    def __init__(self, on_done: Finished | None, progress: Any, last_reply: list[float]) -> None:
        self.on_done = on_done
        self.progress = progress
        self.last_reply = last_reply
        self.error: Exception | None = None
        self._seen: set[int] = set()

    def __call__(self, index: int, task: asyncio.Future[Any]) -> None:
        if index in self._seen:
            return
        self._seen.add(index)
        self.last_reply[0] = time.monotonic()
        if task.cancelled() or task.exception() is not None:
            self.progress.fail(1)
            return
        self.progress.update(1, task_completion_tokens(task))
        if self.on_done is None or self.error is not None:
            return
        try:
            self.on_done(index, task.result())
        except Exception as e:  # noqa: BLE001 - raised again when the batch ends
            self.error = e

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


async def _wait_for_batch(tasks: list[asyncio.Future[Any]]) -> None:
    """Wait for every request of a batch; after an authentication or unreachable-server error
    the others are cancelled (each would be refused the same way)."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        if any(isinstance(t.exception(), (AuthError, UnreachableError)) for t in done if not t.cancelled()):
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            return


class _NotSent(Exception):
    """A request left unsent because an authentication error stopped its batch."""


class OpenAICompatBackend:
    """An :class:`~r2med_agent.llm.base.LLM` over OpenAI-compatible HTTP endpoints.

    Attributes:
        spec: the registry entry.
        model_id: the served model name (``spec.model``).
        requests_per_url: HTTP attempts sent to each base URL since construction.
        attempts: all HTTP attempts sent since construction (retries included).
        null_replies: replies whose message content was null (returned as generations with
            ``finish_reason`` ``error``) since construction.
    """

    def __init__(self, spec: LLMSpec) -> None:
        if spec.backend != "openai":
            raise ConfigError(f"llm '{spec.name}': OpenAICompatBackend needs backend 'openai'")
        self.spec = spec
        self.model_id = spec.model
        for url in spec.base_urls:
            remember_url_secrets(url)
        self._server: str | None = None
        self.requests_per_url: dict[str, int] = dict.fromkeys(spec.base_urls, 0)
        self.attempts = 0
        self.null_replies = 0
        self._noted_new_turn = False
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._pool = UrlPool(spec.base_urls, spec.backoff_initial_s, spec.backoff_max_s)
        self._retry_lines: set[int] = set()

    @property
    def server(self) -> str:
        """The server kind (:func:`resolve_server`), found on first use: ``auto`` asks the
        server then, not when the backend is built."""
        if self._server is None:
            self._server = resolve_server(self.spec)
        return self._server

    # ------------------------------------------------------------------ public API
    reports_each = True
    """``generate`` and ``generate_samples`` take ``on_done``, called as each reply arrives
    (:data:`~r2med_agent.llm.base.Finished`)."""

    def generate(
        self, prompts: Sequence[list[Message]], params: SamplingParams, *, sample_index: int = 0,
        template_hash: TemplateHashes = "", meta: Sequence[PromptMeta] | None = None,
        on_done: Finished | None = None,
    ) -> list[Generation]:
        """One Generation per prompt, in input order. The request options are the cache's
        (:class:`~r2med_agent.llm.base.LLM`); ``on_done(i, generation)`` is called as each reply
        arrives (the caching wrapper commits it there).

        Safe to call from inside a running event loop (a notebook, an async app): the batch
        then runs on its own loop in a worker thread.
        """
        if not prompts:
            return []
        return run_coroutine(lambda: self.agenerate([list(p) for p in prompts], params, on_done=on_done))

    def generate_samples(
        self, prompts: Sequence[list[Message]], params: SamplingParams, n: int, *,
        template_hash: TemplateHashes = "", meta: Sequence[PromptMeta] | None = None,
        on_done: Finished | None = None,
    ) -> list[list[Generation]]:
        """``n`` samples of each prompt, one request each with the API's ``n`` (OpenAI, vLLM
        servers). The response's prompt tokens are counted on sample 0 and its completion tokens
        shared evenly over the samples; a request that fails fails the batch. ``on_done(i,
        samples)`` as each reply arrives."""
        if not prompts:
            return []
        return run_coroutine(  # type: ignore[return-value]
            lambda: self.agenerate([list(p) for p in prompts], params, n=n, on_done=on_done)
        )

    async def agenerate(
        self, prompts: Sequence[list[Message]], params: SamplingParams, n: int = 1,
        on_done: Finished | None = None,
    ) -> list[Generation]:
        """Async form of :meth:`generate` (must run on one event loop from start to end); with
        ``n`` > 1, a list of ``n`` samples per prompt. ``on_done(i, output)`` is called on the
        loop as each request succeeds; an error it raises is raised once the batch ends."""
        import openai

        key = self._api_key()
        timeout = _timeout(self.spec.timeout_s)
        clients = {
            url: openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=timeout,
                                    http_client=openai.DefaultAsyncHttpxClient(
                                        timeout=timeout, event_hooks=capped_hooks(module=_openai_http())))
            for url in self.spec.base_urls
        }
        limit = asyncio.Semaphore(self.spec.max_concurrency)
        abort = asyncio.Event()  # set by an AuthError: requests not yet sent are not sent
        self._retry_lines: set[int] = set()
        progress = for_backend(len(prompts), f"{self.spec.name}")
        last_reply = [time.monotonic()]

        heartbeat = asyncio.ensure_future(self._heartbeat(last_reply))
        tasks: list[asyncio.Future[Any]] = []
        reported = _Reporter(on_done, progress, last_reply)
        try:
            tasks = [
                asyncio.ensure_future(self._one(m, params, clients, self._pool, limit, key, abort, n))
                for m in prompts
            ]
            for i, t in enumerate(tasks):
                t.add_done_callback(functools.partial(reported, i))
            await _wait_for_batch(tasks)
        finally:
            heartbeat.cancel()
            for i, t in enumerate(tasks):
                if t.done():  # callbacks asyncio has queued but not yet run (see _Reporter)
                    reported(i, t)
            progress.close()
            for client in clients.values():
                await client.close()
        results: list[Generation | None] = []
        failures: dict[int, LLMError] = {}
        for i, t in enumerate(tasks):
            if t.cancelled():
                results.append(None)
                continue
            exc = t.exception()
            if isinstance(exc, _NotSent):
                results.append(None)
            elif exc is None:
                results.append(t.result())
            elif isinstance(exc, LLMError):
                results.append(None)
                failures[i] = exc
            else:
                raise exc
        self._warn_null_content(results)
        reported.raise_error()
        if failures:
            if all(r is None for r in results):
                raise failures[min(failures)]  # nothing to keep: the plain error
            raise PartialBatchError(results, failures)
        return results  # type: ignore[return-value]

    def _warn_null_content(self, results: Sequence[Generation | list[Generation] | None]) -> None:
        """Count the replies whose content was null (failed generations) and say so once."""
        flat = [g for r in results if r is not None for g in (r if isinstance(r, list) else [r])]
        empty = sum(g.finish_reason == "error" for g in flat)
        self.null_replies += empty
        if empty:
            logger.warning(
                "llm %s: %d of %d replies had no content (content: null); they count as failed "
                "generations, which the cache does not keep, so a re-run asks for them again",
                self.spec.name, empty, len(flat),
            )

    async def _heartbeat(self, last_reply: list[float]) -> None:
        """Every :data:`HEARTBEAT_S` without a reply while requests are in flight, one line
        saying how many are awaited from where (runs until cancelled)."""
        last_line = time.monotonic()
        while True:
            quiet_since = max(last_reply[0], last_line)
            await asyncio.sleep(max(quiet_since + HEARTBEAT_S - time.monotonic(), 0.01))
            now = time.monotonic()
            waiting = {u: k for u, k in self._pool.in_flight.items() if k}
            if now - max(last_reply[0], last_line) < HEARTBEAT_S or not waiting:
                continue
            last_line = now
            logger.info(
                "llm %s: waiting for %d repl%s (%s); none came for %.0fs; an attempt times out "
                "after %gs (timeout_s)", self.spec.name, sum(waiting.values()),
                "y" if sum(waiting.values()) == 1 else "ies",
                ", ".join(f"{k} at {redact_url(u)}" for u, k in waiting.items()), now - last_reply[0],
                self.spec.timeout_s,
            )

    def continuation_text(self, messages: Sequence[Message]) -> str:
        """The raw prompt that continues ``messages``' final assistant message, rendered with
        the chat template of the entry's ``tokenizer`` (default: ``model``)."""
        conversation = with_system_prompt(list(messages), self.spec.system_prompt)
        return continuation_prompt(self._chat_tokenizer(), conversation,
                                   dict(self.spec.chat_template_kwargs) or None)

    def _chat_tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = load_chat_tokenizer(self.spec)
            return self._tokenizer

    # ------------------------------------------------------------------ internals
    def _api_key(self) -> str:
        env = self.spec.api_key_env
        if env is None:
            return "EMPTY"
        value = os.environ.get(env, "")
        if value:
            remember_secret(value)  # masked wherever a message or log line would show it
            return value
        if all(is_loopback_url(u) for u in self.spec.base_urls):
            return "EMPTY"
        raise ConfigError(
            f"llm '{self.spec.name}' needs an API key for {', '.join(map(redact_url, self.spec.base_urls))}: "
            f"set the environment variable ${env}"
        )

    def _request(self, messages: list[Message], params: SamplingParams) -> dict[str, Any]:
        spec = self.spec
        top, extra, _ = wire_sampling(
            params, server=self.server, drop_params=spec.drop_params,
            max_tokens_param=spec.max_tokens_param, unsent_max_tokens=unsent_token_limit(spec),
        )
        req: dict[str, Any] = {
            "model": spec.model,
            "messages": with_system_prompt(messages, spec.system_prompt),
            **top,
        }
        if spec.reasoning_effort is not None:
            req["reasoning_effort"] = spec.reasoning_effort
        if self.server != "openai" and spec.chat_template_kwargs:
            extra["chat_template_kwargs"] = dict(spec.chat_template_kwargs)
        if continues_final_message(messages):
            if self.server == "vllm":
                # A raw-text completion of the prompt rendered here (module docstring).
                del req["messages"]
                req["prompt"] = self.continuation_text(messages)
                if req.pop("logprobs", None):  # the completions API takes the number itself
                    req["logprobs"] = req.pop("top_logprobs")
                extra.pop("chat_template_kwargs", None)
                extra["add_special_tokens"] = False
            elif not self._noted_new_turn:
                self._noted_new_turn = True
                logger.debug("llm %s: %s", spec.name, _NEW_TURN_NOTES[self.server])
        choices = extra.pop("token_choices", None)
        if choices:
            # vLLM's sampling fields, by the ids of the entry's tokenizer (what the server loads).
            tokenizer = self._chat_tokenizer()
            ids = choice_token_ids(lambda s: tokenizer.encode(s, add_special_tokens=False), choices)
            extra.update(allowed_token_ids=ids, logprob_token_ids=ids)
        extra.update(spec.extra_body)
        if extra:
            req["extra_body"] = extra
        return req

    async def _one(
        self,
        messages: list[Message],
        params: SamplingParams,
        clients: dict[str, Any],
        pool: UrlPool,
        limit: asyncio.Semaphore,
        key: str,
        abort: asyncio.Event,
        n: int = 1,
    ) -> Generation | list[Generation]:
        """One request (``n`` samples of it when ``n`` > 1), sent when ``limit`` lets it and
        not at all once ``abort`` is set (:class:`_NotSent`)."""
        request = self._request(messages, params)
        if n > 1:
            request["n"] = n
        async with limit:
            if abort.is_set():
                raise _NotSent
            start = time.perf_counter()

            def read(response: Any, url: str) -> Generation | list[Generation]:
                # inside the attempt: a reply of the wrong types is retried like a malformed one
                latency = time.perf_counter() - start
                if n == 1:
                    return to_generation(response, params, latency)
                return samples(response, params, latency, n, llm=self.spec.name, url=url)

            return await self._send(request, clients, pool, key, abort, read)

    async def _send(
        self, request: dict[str, Any], clients: dict[str, Any], pool: UrlPool, key: str,
        abort: asyncio.Event, read: Callable[[Any, str], T],
    ) -> T:
        """Send ``request`` under the retry policy (:func:`~r2med_agent.llm.retry.retrying`), a
        retry to another URL when one is ready; returns ``read(response, url)`` (a reply it
        cannot read, of the wrong types, is malformed: retried).

        Raises:
            LLMError: the request failed for good (:class:`AuthError` and
                :class:`UnreachableError` also set ``abort``).
        """
        import openai
        from tenacity import RetryError

        last_url: str | None = None
        deadline = time.monotonic() + self.spec.max_retry_s
        errors = RequestErrors(self.spec, key)
        try:
            async for attempt in retrying(errors, self._retry_lines):
                with attempt:
                    # A retry goes elsewhere when another URL is ready.
                    last_url = pool.acquire(avoid=last_url)
                    self.attempts += 1
                    self.requests_per_url[last_url] += 1
                    failure: BaseException | None = None
                    # the last attempt waits only for what the retry budget has left
                    timeout_s = max(min(self.spec.timeout_s, deadline - time.monotonic()), 0.1)
                    try:
                        client = clients[last_url]
                        create = (client.completions.create if "prompt" in request
                                  else client.chat.completions.create)
                        try:
                            # the whole attempt, not each read, ends by timeout_s (a trickle)
                            response = await within(timeout_s, lambda: create(**request, timeout=_timeout(timeout_s)),
                                                    "the attempt")
                        except DeadlineError:
                            raise openai.APITimeoutError(request=_request_of(last_url)) from None
                        except (ReplyTooLarge, openai.APIConnectionError) as e:
                            too_large = e if isinstance(e, ReplyTooLarge) else e.__cause__
                            if isinstance(too_large, ReplyTooLarge):  # not retried: it would come again
                                raise LLMError(errors.scrub(f"llm '{self.spec.name}': request to {last_url} "
                                                            f"failed: {too_large}")) from None
                            raise
                        except (ValueError, RecursionError, openai.APIResponseValidationError) as e:
                            # A 200 whose body is not the JSON it claims (json errors are
                            # ValueErrors; one nested thousands deep a RecursionError): the
                            # server's fault, like a 5xx.
                            raise MalformedReplyError(f"the reply is not valid JSON ({_brief(e)})") from None
                        try:
                            check_reply(response)
                            result = read(response, last_url)
                        except MalformedReplyError:
                            raise
                        except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError) as e:
                            raise MalformedReplyError(f"a field of the reply has the wrong type ({_brief(e)})") from None
                    except BaseException as e:
                        failure = e
                        if isinstance(e, openai.APITimeoutError):
                            e.r2med_timeout_s = timeout_s  # type: ignore[attr-defined]  (for its message)
                        raise
                    finally:
                        pool.release(last_url, failure)
        except RetryError as e:
            exc = e.last_attempt.exception()
            raise LLMError(errors.scrub(
                f"llm '{self.spec.name}': request to {last_url} failed after "
                f"{e.last_attempt.attempt_number} attempts: {errors.describe(exc)}"
            )) from None
        except openai.OpenAIError as e:
            raise errors.final(e, last_url, abort) from None
        return result


def _brief(e: BaseException) -> str:
    """An exception in one short line (a JSON error's text, a RecursionError's)."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"


def _request_of(url: str | None) -> Any:
    """A request to ``url`` of the openai client's HTTP module, for an ``openai.APITimeoutError``
    raised here."""
    return _openai_http().Request("POST", url or "http://unknown")


def _openai_http() -> Any:
    """The HTTP module the openai client is built on: httpx, or its fork httpx2 (openai 3)."""
    from openai import _base_client

    return getattr(_base_client, "httpx2", None) or _base_client.httpx


def _timeout(seconds: float) -> Any:
    """An attempt's httpx timeout: ``seconds`` in all, at most :data:`CONNECT_TIMEOUT_S` of it to
    connect."""
    return _openai_http().Timeout(seconds, connect=min(CONNECT_TIMEOUT_S, seconds))


def load_chat_tokenizer(spec: LLMSpec) -> Any:
    """The ``transformers`` tokenizer (files only) whose chat template renders continuation
    prompts for a ``server: vllm`` entry: ``spec.tokenizer``, else ``spec.model``.

    Raises:
        MissingExtraError: transformers is not installed.
        ConfigError: it cannot be loaded, or has no chat template.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError:
        from r2med_agent.errors import MissingExtraError

        raise MissingExtraError(
            "transformers", "dense", "needed to continue turns over a vLLM server"
        ) from None
    source = spec.tokenizer or spec.model
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as e:  # noqa: BLE001 - hub, file and format errors alike
        raise ConfigError(
            f"llm '{spec.name}': continuing a turn over a vLLM server renders the prompt with "
            f"the model's chat template, but the tokenizer '{source}' could not be loaded "
            f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); set tokenizer: to the "
            f"model's Hugging Face id or a local folder with its tokenizer files"
        ) from None
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"llm '{spec.name}': the tokenizer '{source}' has no chat template; set tokenizer: "
            f"to the served model's Hugging Face id or folder"
        )
    return tokenizer

