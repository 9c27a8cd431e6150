"""Reading an OpenAI-compatible reply: a completion with choices, each of the right types, or
a malformed reply (:class:`MalformedReplyError`, retried like a 5xx); its choices as
Generations, with the reasoning returned apart from the text, token counts and
log-probabilities."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from r2med_agent.errors import LLMError
from r2med_agent.llm.wire import truncate_at_stop
from r2med_agent.types import Generation, SamplingParams

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


def to_generation(response: Any, params: SamplingParams, latency: float, index: int = 0) -> Generation:
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

def samples(
    response: Any, params: SamplingParams, latency: float, n: int, *, llm: str, url: str | None
) -> list[Generation]:
    """The ``n`` choices of one response: prompt tokens on sample 0, completion tokens and
    latency shared evenly (``llm``: the entry's name, for the error)."""
    if len(response.choices) != n:
        raise LLMError(
            f"llm '{llm}': asked {url} for {n} samples (n), got {len(response.choices)}; "
            "the server does not support n"
        )
    usage = getattr(response, "usage", None)
    p_in = _token_count(usage, "prompt_tokens")
    p_out = _token_count(usage, "completion_tokens")
    out = []
    for j in range(n):
        g = to_generation(response, params, latency / n, index=j)
        share = p_out // n + (1 if j < p_out % n else 0)
        out.append(replace(g, prompt_tokens=p_in if j == 0 else 0, completion_tokens=share))
    return out

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


def task_completion_tokens(task: asyncio.Future[Generation]) -> int:
    """Output tokens of a finished request (0 when it failed or was cancelled)."""
    if task.cancelled() or task.exception() is not None:
        return 0
    result = task.result()  # one Generation, or a list of them when n samples were drawn
    return sum(g.completion_tokens for g in (result if isinstance(result, list) else [result]))


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

