"""Bounds on what a server may send back: a cap on a reply's size, counted after decompression
(:func:`capped_hooks`), and a deadline on a whole request, not on each read
(:func:`within`), so a server that trickles a byte every few seconds, sends an endless chunked
body or a small gzip that inflates to gigabytes costs one failed request, not the run's memory or
time. The LLM client, the embeddings client, the server-type probes and the prompt fetch all use
them (docs/llms.md, "Timeouts, retries and caps")."""

from __future__ import annotations

import asyncio
import concurrent.futures
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import httpx

__all__ = [
    "MAX_FETCH_BYTES", "MAX_PROBE_BYTES", "MAX_REPLY_BYTES", "DeadlineError", "ReplyTooLarge",
    "capped_hooks", "get_bytes", "mib", "read_capped", "run_coroutine", "transport_reason", "within",
]

T = TypeVar("T")

MAX_REPLY_BYTES = 64 * 2**20
"""The most a reply of an LLM or embeddings server may hold (after decompression): 64 MiB, some
hundred times a long generation with log-probabilities or a batch of large embeddings."""

MAX_PROBE_BYTES = 2**20
"""The most an answer to a server-type probe (``/v1/models``, ``/openapi.json`` ...) may hold: 1 MiB."""

MAX_FETCH_BYTES = 16 * 2**20
"""The most a fetched (or cached) prompt file of the authors may hold: 16 MiB (the pinned files
are source files of a few kB)."""

_PIECE = 2**20
"""Bytes inflated at a time: a small gzip piece may inflate a thousandfold."""

_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
"""Content-Encoding -> zlib window bits; the only encodings asked for (``Accept-Encoding``)."""


def mib(n: int) -> str:
    """``n`` bytes as ``64 MiB`` (or kB under a MiB)."""
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 1000:.0f} kB"


class ReplyTooLarge(Exception):
    """A reply over its cap (declared by ``Content-Length`` or counted as it arrives), or in an
    encoding that was not asked for; refused without reading (or inflating) the rest."""


class DeadlineError(Exception):
    """A request that did not end within its deadline (:func:`within`)."""


class _CappedStream:
    """(Mixed into the ``AsyncByteStream`` of the client's HTTP module, :func:`_stream_class`.)
    The body of a reply, decompressed here when it is gzip or deflate, and stopped with
    :class:`ReplyTooLarge` once it passes ``cap`` bytes."""

    def __init__(self, inner: Any, cap: int, wbits: int | None) -> None:
        self._inner = inner
        self._cap = cap
        self._wbits = wbits

    async def __aiter__(self) -> AsyncIterator[bytes]:
        total = 0
        inflate = zlib.decompressobj(self._wbits) if self._wbits is not None else None
        async for chunk in self._inner:
            if inflate is None:
                total += len(chunk)
                self._check(total)
                yield chunk
                continue
            data = chunk
            while data:
                try:
                    out = inflate.decompress(data, min(self._cap - total + 1, _PIECE))
                except zlib.error as e:
                    raise ReplyTooLarge(f"the reply's compressed body is corrupt ({e})") from None
                total += len(out)
                self._check(total)
                if out:
                    yield out
                data = inflate.unconsumed_tail
        if inflate is not None:
            rest = inflate.flush()
            self._check(total + len(rest))
            if rest:
                yield rest

    def _check(self, total: int) -> None:
        if total > self._cap:
            raise ReplyTooLarge(f"the reply is over the {mib(self._cap)} cap on a reply; refused")

    async def aclose(self) -> None:
        await self._inner.aclose()


_STREAM_CLASSES: dict[str, type] = {}


def _stream_class(module: Any) -> type:
    """:class:`_CappedStream` as an ``AsyncByteStream`` of ``module`` (httpx, or the httpx2 fork
    that recent openai clients use)."""
    if module.__name__ not in _STREAM_CLASSES:
        _STREAM_CLASSES[module.__name__] = type("CappedStream", (_CappedStream, module.AsyncByteStream), {})
    return _STREAM_CLASSES[module.__name__]


async def _ask_for_known_encodings(request: Any) -> None:
    request.headers["Accept-Encoding"] = "gzip, deflate"


def _capping(cap: int, module: Any) -> Callable[[Any], Awaitable[None]]:
    capped = _stream_class(module)

    async def cap_reply(response: Any) -> None:
        # Called before the body is read: refuse what is over the cap or in an encoding that was
        # not asked for, and decompress here (the encoding header goes) with the count running.
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        declared = response.headers.get("content-length", "")
        problem = None
        if encoding not in ("", "identity") and encoding not in _ENCODINGS:
            problem = f"the reply is in Content-Encoding {encoding[:40]!r}, which was not asked for; refused"
        elif encoding in ("", "identity") and declared.isdigit() and int(declared) > cap:
            problem = (f"the reply declares {mib(int(declared))} (Content-Length), over the {mib(cap)} "
                       "cap on a reply; refused")
        if problem:
            await response.aclose()
            raise ReplyTooLarge(problem)
        if encoding in _ENCODINGS:
            del response.headers["content-encoding"]
            response.headers.pop("content-length", None)
        response.stream = capped(response.stream, cap, _ENCODINGS.get(encoding))

    return cap_reply


def capped_hooks(cap: int = MAX_REPLY_BYTES, module: Any = httpx) -> dict[str, list[Any]]:
    """The ``event_hooks`` of an ``AsyncClient`` of ``module`` (httpx, or httpx2) whose replies stop at ``cap`` bytes, counted
    after decompression (only gzip and deflate are asked for, and inflated here as they arrive): a
    longer one raises :class:`ReplyTooLarge` as soon as it passes the cap, a declared one before a
    byte is read. Hooks, not a transport, so the client keeps its proxy settings."""
    return {"request": [_ask_for_known_encodings], "response": [_capping(cap, module)]}


async def within(seconds: float, make: Awaitable[T] | Callable[[], Awaitable[T]], what: str) -> T:
    """Await ``make`` (an awaitable, or a function giving one) for at most ``seconds`` in all:
    connecting, sending and reading every byte of the reply. Raises :class:`DeadlineError`
    (``what`` timed out after ...) when it has not ended by then."""
    awaitable = make() if callable(make) else make
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:
        raise DeadlineError(f"{what} timed out after {seconds:.3g}s (the whole request, not one read)") from None


def get_bytes(url: str, *, timeout_s: float, cap: int) -> tuple[int, str, bytes]:
    """``GET url`` (redirects followed): its status, reason and body, the whole request within
    ``timeout_s`` and the body at most ``cap`` bytes.

    Raises:
        httpx.HTTPError: no connection, or another transport error.
        DeadlineError: it took longer than ``timeout_s``.
        ReplyTooLarge: the body is over ``cap``.
    """

    async def get() -> tuple[int, str, bytes]:
        async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=True, event_hooks=capped_hooks(cap)) as client:
            response = await within(timeout_s, client.get(url), "the download")
            return response.status_code, response.reason_phrase, response.content

    return run_coroutine(get)


def transport_reason(e: BaseException) -> str:
    """A transport error in a few words, with the system's reason when one is chained to it
    (``All connection attempts failed (Connection refused)``)."""
    import os

    from r2med_agent.errors import exception_chain

    text = str(e) or type(e).__name__
    for cause in exception_chain(e):
        if isinstance(cause, OSError) and cause.errno:
            reason = os.strerror(cause.errno)
            return text if reason in text else f"{text} ({reason})"
    return text


def read_capped(stream: Any, cap: int, what: str) -> bytes:
    """All of a binary file object (an open file, a ``file://`` response), refused with
    :class:`ReplyTooLarge` once it passes ``cap`` bytes, without reading the rest."""
    data = stream.read(cap + 1)
    if len(data) > cap:
        raise ReplyTooLarge(f"{what} is over the {mib(cap)} cap; refused")
    return bytes(data)


def run_coroutine(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run the coroutine ``make()`` to its end from synchronous code: on a new event loop, or,
    when called from inside a running loop (a notebook, an async app, a probe made while a batch
    runs), on its own loop in a worker thread."""
    try:
        asyncio.get_running_loop()
        in_loop = True
    except RuntimeError:
        in_loop = False
    if not in_loop:  # (outside the except block: errors then carry no loop-lookup context)
        return asyncio.run(make())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()
