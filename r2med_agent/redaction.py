"""Secrets out of everything printed or stored: :func:`redact` is the one function every path that
shows a server's text or a URL goes through (LLM and embedding errors, the prompt fetch, the CLI's
log lines and error messages).

It masks the API keys this process has read (:func:`remember_secret`; the backends remember the
key they send), bearer tokens (``Bearer ***``) and other ``Authorization`` values, key-like headers and query
parameters (``x-api-key``, ``api_key=``), and the user part of a URL (``http://***@host``).
"""

from __future__ import annotations

import re
import threading
from urllib.parse import unquote, urlsplit

__all__ = ["redact", "redact_url", "remember_secret", "remember_url_secrets"]

MASK = "***"

_SECRETS: set[str] = set()
_LOCK = threading.Lock()

_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#@\s\"']+@")
_BEARER = re.compile(r"(?i)\b(bearer)(\s+)[A-Za-z0-9._~+/=:-]+")
_AUTH_HEADER = re.compile(
    r"(?i)(\b(?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?)(?!bearer\s|\*\*\*)([^\s\"'][^\"'\r\n,}]*)"
)
_KEY_FIELD = re.compile(
    r"(?i)([\"']?\b(?:x-api-key|api-key|api_key|apikey|x-goog-api-key|access_token|password|secret)[\"']?"
    r"\s*[:=]\s*[\"']?)([^\"'\s,;&}]+)"
)


def remember_secret(value: str | None) -> None:
    """Mask ``value`` wherever :func:`redact` meets it from now on (an API key read from the
    environment; placeholders such as ``EMPTY`` and very short values are not secrets)."""
    if value and len(value) >= 6 and value != "EMPTY":
        with _LOCK:
            _SECRETS.add(value)


def remember_url_secrets(url: str) -> None:
    """Remember the user name and password a URL carries (``http://user:secret@host``)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return
    for value in (parts.password, parts.username):
        if value:
            remember_secret(value)
            remember_secret(unquote(value))


def redact(text: str, *secrets: str) -> str:
    """``text`` with every remembered secret, every one of ``secrets``, bearer tokens and
    ``Authorization`` values, key-like fields and URL user parts replaced by ``***``."""
    with _LOCK:
        known = sorted({s for s in (*_SECRETS, *secrets) if s and s != "EMPTY"}, key=len, reverse=True)
    for secret in known:
        if secret in text:
            text = text.replace(secret, MASK)
    text = _USERINFO.sub(rf"\1{MASK}@", text)
    text = _BEARER.sub(lambda m: m.group(1) + m.group(2) + MASK, text)
    text = _AUTH_HEADER.sub(lambda m: m.group(1) + MASK, text)
    return _KEY_FIELD.sub(lambda m: m.group(1) + MASK, text)


def redact_url(url: str) -> str:
    """``url`` as it may be shown: its user part masked (``http://***@host/v1``)."""
    return redact(url)
