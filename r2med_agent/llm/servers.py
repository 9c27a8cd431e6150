"""What serves an OpenAI-compatible base URL: vLLM or SGLang (``vllm``), llama.cpp
(``llamacpp``), or the OpenAI API and servers that do not say (``openai``).

The kind decides how a final assistant message is continued and how sampling parameters travel
(:mod:`~r2med_agent.llm.wire`); it is part of every cache key of the entry. ``server: auto``
asks the server itself, once per base URL and process (:func:`detect_server`).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from r2med_agent.llm.registry import LLMSpec
from r2med_agent.redaction import redact_url

logger = logging.getLogger(__name__)


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
        "set server: in its llms entry to choose", spec.name, ", ".join(map(redact_url, spec.base_urls)),
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
        logger.info("%s is %s: server %s", redact_url(base_url), what, kind)
    else:
        logger.warning(
            "%s did not say what it is (not vLLM, SGLang or llama.cpp): using the chat API with "
            "OpenAI's parameters (server: openai); a final assistant message is answered in a "
            "new turn; set server: in the llms entry to choose", redact_url(base_url),
        )
    return found


_OWNERS = {"vllm": ("vllm", "vLLM"), "sglang": ("vllm", "SGLang"),
           "llamacpp": ("llamacpp", "llama.cpp's llama-server")}
"""``owned_by`` in a model list -> (kind, server) for the servers that put their own name there."""


def _owner(j: dict[str, Any]) -> str | None:
    models = j.get("data")
    owners = {str(m.get("owned_by")) for m in models if isinstance(m, dict)} if isinstance(models, list) else set()
    return next((name for name in _OWNERS if name in owners), None)


def _title(j: dict[str, Any]) -> str:
    info = j.get("info")
    return str(info.get("title", "")) if isinstance(info, dict) else ""


_PROBES: tuple[tuple[str, Callable[[dict[str, Any]], tuple[str, str] | None]], ...] = (
    ("models", lambda j: _OWNERS[o] if (o := _owner(j)) else None),
    ("/get_model_info", lambda j: ("vllm", "SGLang") if "model_path" in j else None),
    ("/props", lambda j: ("llamacpp", "llama.cpp's llama-server")
     if "default_generation_settings" in j else None),
    ("/version", lambda j: ("vllm", f"vLLM {str(j['version'])[:40]}") if set(j) == {"version"} else None),
    ("/openapi.json", lambda j: ("llamacpp", "llama-cpp-python's server") if "llama.cpp" in _title(j) else None),
)
"""``(path, recognise)``: a path under the base URL, or with a leading ``/`` under the server's
root (the base URL without ``/v1``); ``recognise`` turns a JSON object answered with 200 into
``(kind, server)``, or None. An answer of another shape (``{"data": 5}``, ``{"info": ["x"]}``),
not JSON, nested too deep or over :data:`~r2med_agent.net.MAX_PROBE_BYTES` says nothing: the next
probe is asked."""


def _probe(base_url: str, api_key: str) -> tuple[str, str] | None:
    from r2med_agent.net import run_coroutine

    return run_coroutine(lambda: _aprobe(base_url, api_key))


async def _aprobe(base_url: str, api_key: str) -> tuple[str, str] | None:
    import httpx

    from r2med_agent.net import MAX_PROBE_BYTES, DeadlineError, ReplyTooLarge, capped_hooks, within

    root = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    answered = False
    async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, headers=headers, follow_redirects=False,
                                 event_hooks=capped_hooks(MAX_PROBE_BYTES)) as client:
        for path, recognise in _PROBES:
            url = f"{root}{path}" if path.startswith("/") else f"{base_url.rstrip('/')}/{path}"
            try:  # PROBE_TIMEOUT_S for the whole answer, not for each read
                response = await within(PROBE_TIMEOUT_S, client.get(url), "the probe")
            except (httpx.HTTPError, DeadlineError):
                break  # no connection, or no answer in time: asking more would not help
            except ReplyTooLarge as e:
                logger.debug("%s: %s", redact_url(url), e)
                answered = True
                continue
            answered = True
            try:
                body = response.json() if response.status_code == 200 else None
                found = recognise(body) if isinstance(body, dict) else None
            except (ValueError, TypeError, AttributeError, KeyError, RecursionError) as e:
                logger.debug("%s: an answer of no known shape (%s)", redact_url(url), type(e).__name__)
                found = None
            if found:
                return found[0], f"{found[1]} (GET {redact_url(url)})"
    return ("openai", "") if answered else None
