"""What happens to a failed request to an OpenAI-compatible server: which failures are retried
and how (:func:`retrying`: exponential backoff with jitter, or the server's ``Retry-After``),
which base URL the next attempt goes to (:class:`UrlPool`: a failing URL cools down), and what a
request that failed for good says (:class:`RequestErrors`; the API key never shows)."""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from r2med_agent.errors import LLMError, exception_chain
from r2med_agent.llm.base import AuthError, UnreachableError
from r2med_agent.llm.registry import LLMSpec
from r2med_agent.llm.replies import MalformedReplyError
from r2med_agent.redaction import redact, redact_url

logger = logging.getLogger(__name__)

_RETRY_STATUSES = frozenset({408, 429})


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


def _is_retryable(exc: BaseException) -> bool:
    import openai

    if isinstance(exc, (openai.APIConnectionError, MalformedReplyError)):  # incl. APITimeoutError
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in _RETRY_STATUSES or exc.status_code >= 500
    return False


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


def _cools_url(exc: BaseException) -> bool:
    """True for failures that say the endpoint itself is unwell: no connection, a timeout, 5xx."""
    import openai

    if isinstance(exc, (openai.APIConnectionError, MalformedReplyError)):  # incl. APITimeoutError
        return True
    return isinstance(exc, openai.APIStatusError) and exc.status_code >= 500


class UrlPool:
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
                    logger.info("%s failed %d time(s) in a row; skipped for %.2fs", redact_url(url),
                                self.failures[url], wait)


@dataclass(frozen=True)
class RequestErrors:
    """What a failed request of the entry ``spec`` says; ``key`` (the API key), bearer tokens and
    the credentials of a URL are scrubbed from every message (:func:`~r2med_agent.redaction.redact`)."""

    spec: LLMSpec
    key: str

    def describe(self, exc: BaseException | None) -> str:
        """One phrase for a failure: a timeout, a connection error, an HTTP status with the
        server's message, a malformed reply."""
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
        return self.scrub(text)

    def scrub(self, text: str) -> str:
        """``text`` with the API key, bearer tokens and URL credentials replaced by ``***``."""
        return redact(text, self.key)

    def rejected(self, exc: Any, url: str | None) -> LLMError:
        """The error of a request the server refused with an HTTP status that is not retried."""
        error = self._rejected(exc, url and redact_url(url))
        error.args = (self.scrub(str(error)),)
        return error

    def _rejected(self, exc: Any, url: str | None) -> LLMError:
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
                f"{self.scrub(_server_message(exc))}"
            )
        if status == 404:
            return LLMError(
                f"not found at {url} (is model '{spec.model}' served there, and does the URL "
                f"end in /v1?): {self.scrub(_server_message(exc))}"
            )
        return LLMError(
            f"llm '{spec.name}': request rejected by {url} (HTTP {status}): "
            f"{self.scrub(_server_message(exc))}"
        )

    def final(self, exc: Any, url: str | None, abort: asyncio.Event) -> LLMError:
        """The error of a request that failed without (further) retries; sets ``abort`` when
        every other request would fail the same way."""
        import openai

        url = url and redact_url(url)
        if isinstance(exc, openai.APIStatusError):
            error = self.rejected(exc, url)
            if isinstance(error, AuthError):
                abort.set()
            return error
        if isinstance(exc, openai.APIConnectionError) and _unreachable(exc):
            abort.set()  # every other request would fail the same way
            return UnreachableError(
                f"llm '{self.spec.name}': {url} is not reachable "
                f"({self.describe(exc)}); check the entry's base_url and the "
                "network, or start the server"
            )
        return LLMError(f"llm '{self.spec.name}': request to {url} failed: {self.describe(exc)}")


def retrying(errors: RequestErrors, warned: set[int]) -> Any:
    """The retry policy of one request of ``errors.spec`` (module docstring): exponential
    backoff with jitter or the server's ``Retry-After``, one warning per attempt number in a
    batch (its first failure: the errors of one attempt differ only in details such as byte
    offsets; ``warned`` holds the attempt numbers said so far), no attempt started after
    ``max_retry_s``."""
    from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, stop_before_delay
    from tenacity.wait import wait_exponential_jitter

    spec = errors.spec
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
        if state.attempt_number in warned:
            return
        warned.add(state.attempt_number)
        logger.warning(
            "llm %s: attempt %d failed (%s); retrying in %.2fs",
            spec.name,
            state.attempt_number,
            errors.describe(exc),
            state.next_action.sleep if state.next_action else 0.0,
        )

    return AsyncRetrying(
        stop=stop_after_attempt(spec.max_retries + 1) | stop_before_delay(spec.max_retry_s),
        wait=wait,
        retry=retry_if_exception(retryable),
        before_sleep=before_sleep,
        reraise=False,
    )
