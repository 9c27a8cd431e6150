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
import concurrent.futures
import email.utils
import functools
import ipaddress
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from typing import Any, TypeVar
from urllib.parse import urlparse

from r2med_agent.errors import ConfigError, LLMError, exception_chain
from r2med_agent.llm.base import (
    AuthError, Finished, PartialBatchError, PromptMeta, TemplateHashes, UnreachableError, choice_token_ids,
)
from r2med_agent.llm.continuation import continuation_prompt, continues_final_message
from r2med_agent.llm.registry import LLMSpec, with_system_prompt
from r2med_agent.progress import for_backend
from r2med_agent.types import Generation, Message, SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

OPENAI_MAX_STOP = 4
"""The OpenAI API accepts at most this many stop strings; more are applied client-side."""

_RETRY_STATUSES = frozenset({408, 429})

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


def is_loopback_url(url: str) -> bool:
    """True when ``url`` points at this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


PROBE_TIMEOUT_S = 5.0
"""Seconds each request of :func:`detect_server` may take."""

_DETECTED: dict[str, tuple[str, str]] = {}
_DETECT_LOCK = threading.Lock()


def resolve_server(spec: LLMSpec) -> str:
    """The server kind for ``spec``: ``openai``, ``vllm`` or ``llamacpp``.

    ``auto`` is resolved by asking the server what it is (:func:`detect_server`, once per base
    URL and process): vLLM and SGLang -> ``vllm``, llama.cpp's ``llama-server`` and
    llama-cpp-python's server -> ``llamacpp``, ``api.openai.com`` -> ``openai`` without asking;
    a server that answers but does not say gets the chat API with OpenAI's parameters
    (``openai``), with a one-line warning. When no base URL answers at all, ``vllm`` (the guess
    of earlier versions, whose cache keys a re-run from the cache then still finds), with a
    warning, and the server is asked again next time. The choice is logged, and it is part of
    every cache key of the entry."""
    if spec.server != "auto":
        return spec.server
    if (urlparse(spec.base_urls[0]).hostname or "") == "api.openai.com":
        return "openai"
    key = os.environ.get(spec.api_key_env, "") if spec.api_key_env else ""
    for url in spec.base_urls:
        found = detect_server(url, key)
        if found is not None:
            return found[0]
    # Nothing answered: the guess of earlier versions, so keys made with them still match (a
    # re-run from the cache while the server is down); asked again on the next resolve.
    logger.warning(
        "llm %s: could not ask %s what it serves (no answer); taking it for vLLM (server: vllm); "
        "set server: in its llms entry to choose", spec.name, ", ".join(spec.base_urls),
    )
    return "vllm"


def detect_server(base_url: str, api_key: str = "") -> tuple[str, str] | None:
    """What serves ``base_url``: ``(kind, what answered)``, or None when nothing answered (not
    remembered, so a server started later is asked again).

    Asked in turn (:data:`_PROBES`): the model list under the base URL, whose ``owned_by``
    vLLM, SGLang and llama.cpp's ``llama-server`` fill with their own names (``vllm``,
    ``sglang``, ``llamacpp``); then each server's endpoint outside the OpenAI API: SGLang's
    ``GET /get_model_info`` (``model_path``), ``llama-server``'s ``GET /props``
    (``default_generation_settings``), vLLM's ``GET /version`` (``{"version": ...}`` alone),
    and llama-cpp-python's FastAPI schema (``GET /openapi.json``, titled "llama.cpp Python API";
    its model list says ``owned_by: me``).
    A server that answers none of them is taken to be OpenAI-like: kind ``openai``. The answer
    is remembered per base URL for the life of the process and logged once.
    """
    with _DETECT_LOCK:
        if base_url in _DETECTED:
            return _DETECTED[base_url]
        found = _probe(base_url, api_key)
        if found is None:
            return None
        _DETECTED[base_url] = found
    kind, what = found
    if what:
        logger.info("%s is %s: server %s", base_url, what, kind)
    else:
        logger.warning(
            "%s did not say what it is (not vLLM, SGLang or llama.cpp): using the chat API with "
            "OpenAI's parameters (server: openai); a final assistant message is answered in a "
            "new turn; set server: in the llms entry to choose", base_url,
        )
    return found


_OWNERS = {"vllm": ("vllm", "vLLM"), "sglang": ("vllm", "SGLang"),
           "llamacpp": ("llamacpp", "llama.cpp's llama-server")}
"""``owned_by`` in a model list -> (kind, server) for the servers that put their own name there."""


def _owner(j: dict[str, Any]) -> str | None:
    owners = {str(m.get("owned_by")) for m in j.get("data") or [] if isinstance(m, dict)}
    return next((name for name in _OWNERS if name in owners), None)


_PROBES: tuple[tuple[str, Callable[[dict[str, Any]], tuple[str, str] | None]], ...] = (
    ("models", lambda j: _OWNERS[o] if (o := _owner(j)) else None),
    ("/get_model_info", lambda j: ("vllm", "SGLang") if "model_path" in j else None),
    ("/props", lambda j: ("llamacpp", "llama.cpp's llama-server")
     if "default_generation_settings" in j else None),
    ("/version", lambda j: ("vllm", f"vLLM {j['version']}") if set(j) == {"version"} else None),
    ("/openapi.json", lambda j: ("llamacpp", "llama-cpp-python's server")
     if "llama.cpp" in str((j.get("info") or {}).get("title", "")) else None),
)
"""``(path, recognise)``: a path under the base URL, or with a leading ``/`` under the server's
root (the base URL without ``/v1``); ``recognise`` turns a JSON object answered with 200 into
``(kind, server)``, or None."""


def _probe(base_url: str, api_key: str) -> tuple[str, str] | None:
    import httpx

    root = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    answered = False
    with httpx.Client(timeout=PROBE_TIMEOUT_S, headers=headers, follow_redirects=False) as client:
        for path, recognise in _PROBES:
            url = f"{root}{path}" if path.startswith("/") else f"{base_url.rstrip('/')}/{path}"
            try:
                response = client.get(url)
            except httpx.HTTPError:
                break  # no connection, or no answer in time: asking more would not help
            answered = True
            try:
                body = response.json() if response.status_code == 200 else None
            except ValueError:
                body = None
            found = recognise(body) if isinstance(body, dict) else None
            if found:
                return found[0], f"{found[1]} (GET {url})"
    return ("openai", "") if answered else None


def truncate_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Cut ``text`` before the earliest occurrence of any stop string.

    Returns the (possibly) shortened text and the stop string that matched, or None.
    """
    cut, matched = len(text), None
    for s in stops:
        if not s:
            continue
        i = text.find(s)
        if i != -1 and i < cut:
            cut, matched = i, s
    return text[:cut], matched


def retry_after_seconds(exc: BaseException) -> float | None:
    """The wait a server asked for in ``Retry-After`` / ``retry-after-ms``, if any."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    if headers is None:
        return None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class MalformedReplyError(Exception):
    """A 200 reply that is not a completion: a body that is not JSON (cut short, an HTML page
    from a gateway or a captive portal), one without choices, or one whose fields have the wrong
    types (``content: 123``). Retried like a 5xx."""


def check_reply(response: Any) -> None:
    """Raise :class:`MalformedReplyError` unless ``response`` is a completion with choices, each
    with a message (chat) or a text (completions endpoint)."""
    if isinstance(response, (str, bytes)):
        text = response.decode("utf-8", "replace") if isinstance(response, bytes) else response
        shown = " ".join(text.split())[:80]
        raise MalformedReplyError(f"the reply is not JSON but {shown!r}")
    choices = getattr(response, "choices", None)
    if not isinstance(choices, list) or not choices:
        raise MalformedReplyError("the reply has no choices")
    for choice in choices:
        message = getattr(choice, "message", None)
        if message is None and not hasattr(choice, "text"):
            raise MalformedReplyError("a choice of the reply has neither a message nor a text")
        if message is not None and (isinstance(message, (str, int, float, list)) or not hasattr(message, "content")):
            raise MalformedReplyError(f"a choice's message is {type(message).__name__} {str(message)[:40]!r}, "
                                      "not an object with a content")


class _Reporter:
    """A done-callback of a batch's request tasks that passes each success to ``on_done`` (its
    index and output) and keeps the first error ``on_done`` raises (asyncio would only log it)."""

    def __init__(self, on_done: Finished | None) -> None:
        self.on_done = on_done
        self.error: Exception | None = None

    def __call__(self, index: int, task: asyncio.Future[Any]) -> None:
        if self.on_done is None or self.error is not None or task.cancelled() or task.exception() is not None:
            return
        try:
            self.on_done(index, task.result())
        except Exception as e:  # noqa: BLE001 - raised again when the batch ends
            self.error = e

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


def _is_retryable(exc: BaseException) -> bool:
    import openai

    if isinstance(exc, (openai.APIConnectionError, MalformedReplyError)):  # incl. APITimeoutError
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in _RETRY_STATUSES or exc.status_code >= 500
    return False


def _run_coroutine(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run the coroutine ``make()`` to its end from synchronous code: on a new event loop, or,
    when called from inside a running loop (a notebook, an async app), on its own loop in a
    worker thread."""
    try:
        asyncio.get_running_loop()
        in_loop = True
    except RuntimeError:
        in_loop = False
    if not in_loop:  # (outside the except block: errors then carry no loop-lookup context)
        return asyncio.run(make())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


def _unreachable(exc: BaseException) -> bool:
    """True when a connection error is a host name that does not resolve or a refused port:
    failures that retrying in a few seconds does not fix (no network, a wrong URL, no server)."""
    return any(
        isinstance(e, (socket.gaierror, ConnectionRefusedError)) or any(s in str(e) for s in _UNREACHABLE_TEXTS)
        for e in exception_chain(exc)
    )


_UNREACHABLE_TEXTS = (
    "Name or service not known", "nodename nor servname", "Temporary failure in name resolution",
    "No address associated with hostname", "getaddrinfo failed", "Connection refused",
)
"""What httpx/httpcore say for the same failures when the OS error itself is not chained."""


def _server_message(exc: BaseException) -> str:
    body = getattr(exc, "body", None)
    msg: Any = None
    if isinstance(body, dict):
        err = body.get("error", body)
        msg = err.get("message") if isinstance(err, dict) else err
        msg = msg or body.get("detail") or body.get("message")
    if not msg:
        msg = getattr(exc, "message", None) or str(exc)
    text = str(msg)
    return text if len(text) <= 500 else text[:500] + "..."


class _NotSent(Exception):
    """A request left unsent because an authentication error stopped its batch."""


def _cools_url(exc: BaseException) -> bool:
    """True for failures that say the endpoint itself is unwell: no connection, a timeout, 5xx."""
    import openai

    if isinstance(exc, (openai.APIConnectionError, MalformedReplyError)):  # incl. APITimeoutError
        return True
    return isinstance(exc, openai.APIStatusError) and exc.status_code >= 500


class _UrlPool:
    """Picks a base URL for each attempt.

    Ready URLs (not cooling down) come first, the fewest requests in flight among them, ties
    round-robin; the URL a retry's previous attempt failed on (``avoid``) only when no other
    ready URL exists. When every URL is cooling down, the one whose cooldown ends first.

    A URL that fails (:func:`_cools_url`) cools down for ``initial_s * 2**(n-1)`` seconds after
    its n-th failure in a row, at most ``max_s``; a success resets it. Thread-safe; the state
    lives as long as the backend, so a dead URL found by one batch is still avoided by the next.
    """

    def __init__(
        self,
        urls: Sequence[str],
        initial_s: float,
        max_s: float,
        clock: Any = time.monotonic,
    ) -> None:
        self.urls = list(urls)
        self.initial_s = initial_s
        self.max_s = max_s
        self.in_flight = dict.fromkeys(self.urls, 0)
        self.failures = dict.fromkeys(self.urls, 0)
        self.cool_until = dict.fromkeys(self.urls, 0.0)
        self._clock = clock
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def acquire(self, avoid: str | None = None) -> str:
        with self._lock:
            now = self._clock()
            start = next(self._turn) % len(self.urls)
            order = self.urls[start:] + self.urls[:start]

            def rank(u: str) -> tuple[bool, float, bool, int]:
                cooling = self.cool_until[u] > now
                return (cooling, self.cool_until[u] if cooling else 0.0, u == avoid, self.in_flight[u])

            url = min(order, key=rank)
            self.in_flight[url] += 1
            return url

    def release(self, url: str, exc: BaseException | None) -> None:
        """End an attempt on ``url``: ``exc`` is its error, or None when it succeeded."""
        with self._lock:
            self.in_flight[url] -= 1
            if exc is None:
                self.failures[url] = 0
                self.cool_until[url] = 0.0
            elif _cools_url(exc):
                self.failures[url] += 1
                wait = min(self.initial_s * 2 ** (self.failures[url] - 1), self.max_s)
                self.cool_until[url] = self._clock() + wait
                if len(self.urls) > 1:
                    logger.info("%s failed %d time(s) in a row; skipped for %.2fs", url,
                                self.failures[url], wait)


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
        self._server: str | None = None
        self.requests_per_url: dict[str, int] = dict.fromkeys(spec.base_urls, 0)
        self.attempts = 0
        self.null_replies = 0
        self._noted_new_turn = False
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._pool = _UrlPool(spec.base_urls, spec.backoff_initial_s, spec.backoff_max_s)
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
        return _run_coroutine(lambda: self.agenerate([list(p) for p in prompts], params, on_done=on_done))

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
        return _run_coroutine(  # type: ignore[return-value]
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

        import httpx

        key = self._api_key()
        timeout = httpx.Timeout(self.spec.timeout_s, connect=min(CONNECT_TIMEOUT_S, self.spec.timeout_s))
        clients = {
            url: openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=timeout)
            for url in self.spec.base_urls
        }
        limit = asyncio.Semaphore(self.spec.max_concurrency)
        abort = asyncio.Event()  # set by an AuthError: requests not yet sent are not sent
        self._retry_lines: set[int] = set()
        progress = for_backend(len(prompts), f"{self.spec.name}")
        last_reply = [time.monotonic()]

        def finished(task: asyncio.Future[Any]) -> None:
            last_reply[0] = time.monotonic()
            if task.cancelled() or task.exception() is not None:
                progress.fail(1)  # counted apart: a batch whose requests failed is not "done"
            else:
                progress.update(1, _completion_tokens(task))

        heartbeat = asyncio.ensure_future(self._heartbeat(last_reply))
        try:
            tasks = [
                asyncio.ensure_future(self._one(m, params, clients, self._pool, limit, key, abort, n))
                for m in prompts
            ]
            for t in tasks:
                t.add_done_callback(finished)
            reported = _Reporter(on_done)
            for i, t in enumerate(tasks):
                t.add_done_callback(functools.partial(reported, i))
            pending: set[asyncio.Future[Generation]] = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                if any(isinstance(t.exception(), (AuthError, UnreachableError))
                       for t in done if not t.cancelled()):
                    # Every other request would be refused the same way: stop now.
                    for t in pending:
                        t.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
                    break
        finally:
            heartbeat.cancel()
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
                ", ".join(f"{k} at {u}" for u, k in waiting.items()), now - last_reply[0],
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
            return value
        if all(is_loopback_url(u) for u in self.spec.base_urls):
            return "EMPTY"
        raise ConfigError(
            f"llm '{self.spec.name}' needs an API key for {', '.join(self.spec.base_urls)}: "
            f"set the environment variable ${env}"
        )

    def _request(self, messages: list[Message], params: SamplingParams) -> dict[str, Any]:
        spec = self.spec
        top, extra, _ = wire_sampling(
            params, server=self.server, drop_params=spec.drop_params,
            max_tokens_param=spec.max_tokens_param,
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
        pool: _UrlPool,
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
                    return self._to_generation(response, params, latency)
                return self._samples(response, params, latency, n, url)

            return await self._send(request, clients, pool, key, abort, read)

    def _retrying(self, key: str) -> Any:
        """The retry policy of one request (module docstring): exponential backoff with jitter
        or the server's ``Retry-After``, one warning per attempt number in a batch (its first
        failure: the errors of one attempt differ only in details such as byte offsets), no
        attempt started after ``max_retry_s``."""
        from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, stop_before_delay
        from tenacity.wait import wait_exponential_jitter

        spec = self.spec
        single_url = len(spec.base_urls) == 1

        def retryable(exc: BaseException) -> bool:
            # With one URL, an unresolvable name or a refused port fails at once; with several,
            # the retry goes to another URL (the failing one cools off).
            return _is_retryable(exc) and not (single_url and _unreachable(exc))
        backoff = wait_exponential_jitter(
            initial=spec.backoff_initial_s, max=spec.backoff_max_s, jitter=spec.backoff_initial_s
        )

        def wait(state: Any) -> float:
            exc = state.outcome.exception() if state.outcome else None
            asked = retry_after_seconds(exc) if exc is not None else None
            if asked is not None:
                return min(asked, spec.backoff_max_s)
            return float(backoff(state))

        def before_sleep(state: Any) -> None:
            exc = state.outcome.exception()
            # One line per attempt, not one per prompt of the batch.
            if state.attempt_number in self._retry_lines:
                return
            self._retry_lines.add(state.attempt_number)
            logger.warning(
                "llm %s: attempt %d failed (%s); retrying in %.2fs",
                spec.name,
                state.attempt_number,
                self._describe(exc, key),
                state.next_action.sleep if state.next_action else 0.0,
            )

        return AsyncRetrying(
            stop=stop_after_attempt(spec.max_retries + 1) | stop_before_delay(spec.max_retry_s),
            wait=wait,
            retry=retry_if_exception(retryable),
            before_sleep=before_sleep,
            reraise=False,
        )

    async def _send(
        self, request: dict[str, Any], clients: dict[str, Any], pool: _UrlPool, key: str,
        abort: asyncio.Event, read: Callable[[Any, str], T],
    ) -> T:
        """Send ``request`` under :meth:`_retrying`, a retry to another URL when one is ready;
        returns ``read(response, url)`` (a reply it cannot read, of the wrong types, is
        malformed: retried).

        Raises:
            LLMError: the request failed for good (:class:`AuthError` and
                :class:`UnreachableError` also set ``abort``).
        """
        import openai
        from tenacity import RetryError

        last_url: str | None = None
        deadline = time.monotonic() + self.spec.max_retry_s
        try:
            async for attempt in self._retrying(key):
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
                            response = await create(**request, timeout=_timeout(timeout_s))
                        except (ValueError, openai.APIResponseValidationError) as e:
                            # A 200 whose body is not the JSON it claims (json errors are
                            # ValueErrors): the server's fault, like a 5xx.
                            raise MalformedReplyError(
                                f"the reply is not valid JSON ({type(e).__name__}: "
                                f"{' '.join(str(e).split())[:120]})"
                            ) from None
                        check_reply(response)
                        try:
                            result = read(response, last_url)
                        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
                            raise MalformedReplyError(
                                f"a field of the reply has the wrong type ({type(e).__name__}: "
                                f"{' '.join(str(e).split())[:120]})"
                            ) from None
                    except BaseException as e:
                        failure = e
                        if isinstance(e, openai.APITimeoutError):
                            e.r2med_timeout_s = timeout_s  # type: ignore[attr-defined]  (for its message)
                        raise
                    finally:
                        pool.release(last_url, failure)
        except RetryError as e:
            exc = e.last_attempt.exception()
            raise LLMError(
                f"llm '{self.spec.name}': request to {last_url} failed after "
                f"{e.last_attempt.attempt_number} attempts: {self._describe(exc, key)}"
            ) from None
        except openai.OpenAIError as e:
            raise self._final_error(e, last_url, key, abort) from None
        return result

    def _final_error(self, exc: Any, url: str | None, key: str, abort: asyncio.Event) -> LLMError:
        """The error of a request that failed without (further) retries; sets ``abort`` when
        every other request would fail the same way."""
        import openai

        if isinstance(exc, openai.APIStatusError):
            error = self._fatal(exc, url, key)
            if isinstance(error, AuthError):
                abort.set()
            return error
        if isinstance(exc, openai.APIConnectionError) and _unreachable(exc):
            abort.set()  # every other request would fail the same way
            return UnreachableError(
                f"llm '{self.spec.name}': {url} is not reachable "
                f"({self._describe(exc, key)}); check the entry's base_url and the "
                "network, or start the server"
            )
        return LLMError(f"llm '{self.spec.name}': request to {url} failed: {self._describe(exc, key)}")

    def _samples(
        self, response: Any, params: SamplingParams, latency: float, n: int, url: str | None
    ) -> list[Generation]:
        """The ``n`` choices of one response: prompt tokens on sample 0, completion tokens and
        latency shared evenly."""
        if len(response.choices) != n:
            raise LLMError(
                f"llm '{self.spec.name}': asked {url} for {n} samples (n), got {len(response.choices)}; "
                "the server does not support n"
            )
        usage = getattr(response, "usage", None)
        p_in = _token_count(usage, "prompt_tokens")
        p_out = _token_count(usage, "completion_tokens")
        out = []
        for j in range(n):
            g = self._to_generation(response, params, latency / n, index=j)
            share = p_out // n + (1 if j < p_out % n else 0)
            out.append(replace(g, prompt_tokens=p_in if j == 0 else 0, completion_tokens=share))
        return out

    def _describe(self, exc: BaseException | None, key: str) -> str:
        import openai

        if exc is None:
            return "unknown error"
        if isinstance(exc, openai.APITimeoutError):
            waited = getattr(exc, "r2med_timeout_s", self.spec.timeout_s)
            text = f"timed out after {waited:.3g}s" + (
                " (what the retry budget max_retry_s had left)" if waited < self.spec.timeout_s else "")
        elif isinstance(exc, openai.APIConnectionError):
            text = f"connection error: {exc.__cause__ or exc}"
        elif isinstance(exc, openai.AuthenticationError):
            text = "HTTP 401 (authentication failed)"
        elif isinstance(exc, openai.APIStatusError):
            text = f"HTTP {exc.status_code}: {_server_message(exc)}"
        elif isinstance(exc, MalformedReplyError):
            text = f"malformed reply: {exc}"
        else:
            text = f"{type(exc).__name__}: {exc}"
        return self._scrub(text, key)

    @staticmethod
    def _scrub(text: str, key: str) -> str:
        if key and key != "EMPTY":
            text = text.replace(key, "***")
        return text

    def _fatal(self, exc: Any, url: str | None, key: str) -> LLMError:
        spec, status = self.spec, exc.status_code
        if status == 401:
            if spec.api_key_env:
                return AuthError(f"authentication failed for {url}: check ${spec.api_key_env}")
            return AuthError(
                f"authentication failed for {url}: the endpoint wants an API key; name the "
                f"environment variable holding it in api_key_env of llm '{spec.name}'"
            )
        if status == 403:
            hint = f"check ${spec.api_key_env} and its access" if spec.api_key_env else "no key"
            return AuthError(
                f"permission denied by {url} for model '{spec.model}' ({hint}): "
                f"{self._scrub(_server_message(exc), key)}"
            )
        if status == 404:
            return LLMError(
                f"not found at {url} (is model '{spec.model}' served there, and does the URL "
                f"end in /v1?): {self._scrub(_server_message(exc), key)}"
            )
        return LLMError(
            f"llm '{spec.name}': request rejected by {url} (HTTP {status}): "
            f"{self._scrub(_server_message(exc), key)}"
        )

    @staticmethod
    def _to_generation(response: Any, params: SamplingParams, latency: float, index: int = 0) -> Generation:
        """The response as a Generation: ``text`` is the message content as returned, and
        reasoning the API returns apart from it (``reasoning_content``, as vLLM's reasoning
        parsers and DeepSeek's API send it, or ``reasoning``) goes to ``reasoning`` whatever the
        entry's reasoning format, so it never becomes part of the final response."""
        choice = response.choices[index]
        message = getattr(choice, "message", None)
        if message is None:  # a completions-endpoint choice (continued text)
            text, reasoning = _typed(getattr(choice, "text", None), str, "text") or "", None
        else:
            text = _typed(getattr(message, "content", None), str, "message.content") or ""
            reasoning = getattr(message, "reasoning_content", None) or getattr(
                message, "reasoning", None
            )
        if not isinstance(reasoning, str):
            reasoning = ""
        finish_reason = _typed(getattr(choice, "finish_reason", None), str, "finish_reason") or "stop"
        if message is not None and getattr(message, "content", None) is None and not reasoning.strip():
            # ``content: null`` with no reasoning either: nothing was generated (a filtered or
            # failed answer); a failed generation, which the cache does not keep.
            finish_reason = "error"
        stop_reason = getattr(choice, "stop_reason", None)
        if not isinstance(stop_reason, str):
            stop_reason = None  # vLLM reports a token id (int) when a stop token ended it
        # Stops the server was not sent (over the API's limit, or dropped) are applied here;
        # the token counts stay the server's (what was generated and billed).
        text, matched = truncate_at_stop(text, params.stop)
        if matched is not None:
            finish_reason, stop_reason = "stop", matched
        usage = getattr(response, "usage", None)
        return Generation(
            text=text,
            reasoning=reasoning.strip(),
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            prompt_tokens=_token_count(usage, "prompt_tokens"),
            completion_tokens=_token_count(usage, "completion_tokens"),
            latency_s=latency,
            logprobs=(
                None if not (params.logprobs or params.token_choices)
                else _chat_logprobs(getattr(choice, "logprobs", None)) if message is not None
                else _completion_logprobs(getattr(choice, "logprobs", None))
            ),
        )


def _timeout(seconds: float) -> Any:
    """An attempt's httpx timeout: ``seconds`` in all, at most :data:`CONNECT_TIMEOUT_S` of it to
    connect."""
    import httpx

    return httpx.Timeout(seconds, connect=min(CONNECT_TIMEOUT_S, seconds))


def _typed(value: Any, kind: type, name: str) -> Any:
    """``value`` when it is None or a ``kind``; else the reply is malformed (retried)."""
    if value is None or isinstance(value, kind):
        return value
    raise MalformedReplyError(f"{name} is {type(value).__name__} {str(value)[:40]!r}, not {kind.__name__}")


def _token_count(usage: Any, name: str) -> int:
    """A token count of ``usage`` (0 when the server gives none); one that is not a whole
    number makes the reply malformed."""
    value = getattr(usage, name, None) if usage is not None else None
    if value is None:
        return 0
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value < 0:
        raise MalformedReplyError(f"usage.{name} is {value!r}, not a token count")
    return int(value)


def _completion_tokens(task: asyncio.Future[Generation]) -> int:
    """Output tokens of a finished request (0 when it failed or was cancelled)."""
    if task.cancelled() or task.exception() is not None:
        return 0
    result = task.result()  # one Generation, or a list of them when n samples were drawn
    return sum(g.completion_tokens for g in (result if isinstance(result, list) else [result]))


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


def _chat_logprobs(logprobs: Any) -> tuple[tuple[tuple[str, float], ...], ...] | None:
    """A chat completion choice's ``logprobs.content`` as ``(token, logprob)`` pairs per
    position, most likely first (None when the server sent none)."""
    content = getattr(logprobs, "content", None) if logprobs is not None else None
    if not content:
        return None
    out = []
    for pos in content:
        top = getattr(pos, "top_logprobs", None) or []
        pairs = [(str(t.token), float(t.logprob)) for t in top]
        if not pairs:
            pairs = [(str(pos.token), float(pos.logprob))]
        out.append(tuple(sorted(pairs, key=lambda p: -p[1])))
    return tuple(out)


def _completion_logprobs(logprobs: Any) -> tuple[tuple[tuple[str, float], ...], ...] | None:
    """A completions-endpoint choice's ``logprobs.top_logprobs`` (one ``{token: logprob}`` per
    position) as ``(token, logprob)`` pairs per position, most likely first (None when absent)."""
    top = getattr(logprobs, "top_logprobs", None) if logprobs is not None else None
    if not top:
        return None
    return tuple(
        tuple(sorted(((str(t), float(v)) for t, v in (pos or {}).items()), key=lambda p: -p[1]))
        for pos in top
    )


def wire_sampling(
    params: SamplingParams,
    *,
    server: str,
    drop_params: Sequence[str] = (),
    max_tokens_param: str = "max_tokens",
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """How ``params`` travel to an OpenAI-compatible ``server`` (``openai``/``vllm``/``llamacpp``).

    Returns:
        ``(fields, extra, client_stops)``: the request's top-level sampling fields, the
        server-specific fields that go in ``extra_body``, and the stop strings applied
        client-side (dropped, or over the OpenAI API's limit of 4). The cache key of an
        ``openai`` entry is built from exactly these, so two entries that send the same
        request share generations and two that do not never do.
    """
    drop = set(drop_params)
    fields: dict[str, Any] = {max_tokens_param: params.max_tokens}
    if "temperature" not in drop:
        fields["temperature"] = params.temperature
    if "top_p" not in drop:
        fields["top_p"] = params.top_p
    if params.seed is not None and "seed" not in drop:
        fields["seed"] = params.seed
    if params.logprobs:
        fields["logprobs"] = True
        fields["top_logprobs"] = params.logprobs
    if params.token_choices:
        if server != "vllm":
            raise ConfigError(
                f"token choices (a reranker's judgment tokens) need a vLLM server; this one is '{server}'"
            )
        # Turned into vLLM's allowed_token_ids and logprob_token_ids by the backend, whose
        # tokenizer knows the ids; vLLM wants as many top log-probabilities as choices.
        fields["logprobs"] = True
        fields["top_logprobs"] = len(params.token_choices)
    client_stops: list[str] = []
    if params.stop:
        if "stop" in drop:
            client_stops = list(params.stop)
        else:
            limit = OPENAI_MAX_STOP if server == "openai" else len(params.stop)
            fields["stop"] = list(params.stop[:limit])
            client_stops = list(params.stop[limit:])
    extra: dict[str, Any] = {}
    if params.token_choices:
        extra["token_choices"] = list(params.token_choices)
    if server != "openai":
        if "top_k" not in drop:
            # llama.cpp's server rejects -1; 0 turns top-k off there.
            off = 0 if server == "llamacpp" else -1
            extra["top_k"] = off if params.top_k == -1 else params.top_k
        if server == "llamacpp":
            extra["min_p"] = 0.0  # its default is 0.05; SamplingParams has no min-p
        if "repetition_penalty" not in drop:
            name = "repeat_penalty" if server == "llamacpp" else "repetition_penalty"
            extra[name] = params.repetition_penalty
    return fields, extra, client_stops


def key_params(
    params: SamplingParams,
    *,
    server: str,
    drop_params: Sequence[str] = (),
    max_tokens_param: str = "max_tokens",
) -> dict[str, Any]:
    """The sampling part of an ``openai`` entry's cache key: every field :func:`wire_sampling`
    sends (``extra_body`` ones under their wire names), plus ``client_stop`` when stops are
    applied client-side."""
    fields, extra, client_stops = wire_sampling(
        params, server=server, drop_params=drop_params, max_tokens_param=max_tokens_param
    )
    out = {**fields, **extra}
    if client_stops:
        out["client_stop"] = client_stops
    return out
