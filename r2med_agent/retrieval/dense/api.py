"""The API backend (:class:`APIEncoder`): OpenAI-compatible ``/embeddings`` endpoints (OpenAI,
Voyage, vLLM, TEI), with R2MED's reference truncation and input preparation."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from r2med_agent.errors import ConfigError, LLMError
from r2med_agent.llm.replies import MalformedReplyError
from r2med_agent.net import MAX_REPLY_BYTES, DeadlineError, ReplyTooLarge, capped_hooks, run_coroutine, transport_reason, within
from r2med_agent.redaction import redact, redact_url, remember_secret, remember_url_secrets
from r2med_agent.retrieval.dense.models import _import_transformers, resolve_model_path
from r2med_agent.retrieval.dense.spec import EncoderSpec, Side
from r2med_agent.retrieval.dense.tokens import bounded_token_ids

logger = logging.getLogger(__name__)

ATTEMPTS = 5
"""Attempts of one batch (transport errors, a request over ``timeout_s``, 429, 5xx, a malformed reply)."""
BACKOFF_S = 0.5
"""Seconds before the second attempt; doubled before each further one (at most 20)."""


def read_embeddings(response: Any, n: int) -> list[np.ndarray]:
    """The ``n`` embeddings of an ``/embeddings`` reply in input order, each a vector of finite
    numbers of one length; a reply of another shape (not JSON, nested too deep, no ``data``, an
    ``embedding`` that is a string or missing, a wrong count) raises :class:`MalformedReplyError`."""
    try:
        body = response.json()
    except (ValueError, RecursionError) as e:
        shown = " ".join(response.text[:80].split()) if isinstance(e, ValueError) else "nested too deep"
        raise MalformedReplyError(f"the reply is not JSON ({type(e).__name__}: {shown!r})") from None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or len(data) != n:
        got = f"{len(data)} items" if isinstance(data, list) else type(data).__name__
        raise MalformedReplyError(f"the reply's data is {got}, not a list of {n} embeddings")
    if not all(isinstance(d, dict) for d in data):
        raise MalformedReplyError("an item of the reply's data is not an object")
    indexes = [d.get("index", i) for i, d in enumerate(data)]
    if sorted(indexes) != list(range(n)) or not all(type(i) is int for i in indexes):
        raise MalformedReplyError(f"the reply's indexes are not 0 to {n - 1}")
    rows = []
    for d in sorted(data, key=lambda d: d.get("index", 0)):
        vector = d.get("embedding")
        row = np.asarray(vector) if isinstance(vector, list) else None
        if row is None or row.ndim != 1 or not row.size or row.dtype.kind not in "if":
            shown = "missing" if vector is None else f"{type(vector).__name__} {str(vector)[:40]!r}"
            raise MalformedReplyError(f"an embedding is {shown}, not a list of numbers")
        row = row.astype(np.float32)
        if not np.isfinite(row).all() or (rows and row.shape != rows[0].shape):
            raise MalformedReplyError("an embedding has a number that is not finite, or another length than the others")
        rows.append(row)
    return rows


def hf_token_cut(tokenizer: Any, texts: list[str], n: int) -> list[str]:
    """Each text cut to ``n`` tokens of a transformers tokenizer as R2MED's reference cuts it
    (``tokenizer(text)``, and a text of more than ``n`` ids becomes the decoding of its first
    ``n``), but tokenizing a cut of each text
    (:func:`~r2med_agent.retrieval.dense.tokens.bounded_token_ids`), so a huge one costs no more
    than ``n`` allows, and never sending a text longer than the longest cut: one whose cut
    still has no more than ``n`` tokens (a word WordPiece makes one ``[UNK]``, characters the
    tokenizer deletes) is sent as the decoding of the tokens it gave, as an over-long text is."""

    def ids_of(cut: list[str], _titles: list[str] | None) -> Any:
        return tokenizer(cut, verbose=False)["input_ids"], None  # no "longer than the maximum" warning: counted here

    bounded = bounded_token_ids(tokenizer, texts, n + 1, ids_of)
    return [
        tokenizer.decode(ids[:n]) if len(ids) > n or not whole else text
        for ids, text, whole in zip(bounded.ids, bounded.texts, bounded.whole)
    ]


class APIEncoder:
    """An OpenAI-compatible ``POST {base_url}/embeddings`` client (OpenAI, Voyage, vLLM, TEI).

    Batches of ``batch_size`` texts (:meth:`_post`: retried on transport errors, a request over
    ``timeout_s`` in all, 429, 5xx and malformed replies; a reply over
    :data:`~r2med_agent.net.MAX_REPLY_BYTES` is refused). The key is read from ``api_key_env`` at
    call time and never logged or cached; errors show no key and no URL credentials.
    """

    def __init__(self, spec: EncoderSpec, *, show_progress: bool = False, timeout_s: float = 120.0) -> None:
        self.spec = spec
        self.name = spec.name
        self.show_progress = show_progress
        self.timeout_s = timeout_s
        remember_url_secrets(spec.base_url)
        self._encoding: Any = False  # not looked up yet
        self._hf: Any = False

    def check(self) -> None:
        """Fail now if the API key is not set (see :meth:`~r2med_agent.retrieval.dense.hf.HFEncoder.check`)."""
        self._key()

    def _token_encoding(self) -> Any | None:
        """The tiktoken encoding for ``max_tokens``, or None (tiktoken missing or the encoding
        not loadable, e.g. offline before its first download): inputs are then cut by characters."""
        if self._encoding is not False:
            return self._encoding
        name = self.spec.tiktoken_encoding
        encoding = None
        if name:
            try:
                import tiktoken

                encoding = tiktoken.get_encoding(name)
            except ImportError:
                logger.warning(
                    "encoder '%s': tiktoken is not installed; inputs are cut to %d characters "
                    "instead of %d tokens (pip install tiktoken for exact truncation)",
                    self.name, self.spec.max_tokens, self.spec.max_tokens,
                )
            except (ValueError, OSError) as e:
                logger.warning(
                    "encoder '%s': tiktoken encoding '%s' unavailable (%s); inputs are cut to %d characters",
                    self.name, name, e, self.spec.max_tokens,
                )
        self._encoding = encoding
        return encoding

    def _hf_token_cutter(self) -> Any | None:
        """The ``hf_tokenizer`` (loaded once), or None when unset or not loadable."""
        if self._hf is not False:
            return self._hf
        tokenizer = None
        if self.spec.hf_tokenizer:
            try:
                transformers = _import_transformers()
                tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_path(self.spec.hf_tokenizer))
            except Exception as e:  # noqa: BLE001 - offline, not in the cache, no transformers
                logger.warning(
                    "encoder '%s': tokenizer '%s' unavailable (%s); inputs are cut to %d characters "
                    "instead of %d tokens", self.name, self.spec.hf_tokenizer, str(e).splitlines()[0][:200],
                    self.spec.max_tokens, self.spec.max_tokens,
                )
        self._hf = tokenizer
        return tokenizer

    def _cuts_by_tokens(self) -> bool:
        if self.spec.tiktoken_encoding:
            return self._token_encoding() is not None
        return self._hf_token_cutter() is not None

    def truncate(self, texts: list[str]) -> list[str]:
        """Cut each input to ``max_tokens`` tokens (or characters, see the field) and ``max_chars``
        (with an ``hf_tokenizer``: :func:`hf_token_cut`)."""
        spec = self.spec
        if spec.max_tokens:
            n = spec.max_tokens
            enc = self._token_encoding() if spec.tiktoken_encoding else None
            hf = None if spec.tiktoken_encoding else self._hf_token_cutter()
            if hf is not None:
                texts = hf_token_cut(hf, texts, n)
            else:
                cut = []
                for t in texts:
                    if enc is not None:
                        ids = enc.encode(t, disallowed_special=())
                        cut.append(enc.decode(ids[:n]) if len(ids) > n else t)
                    else:
                        cut.append(t[:n])
                texts = cut
        if spec.max_chars:
            texts = [t[: spec.max_chars] for t in texts]
        return texts

    def prepare(self, texts: list[str]) -> list[str]:
        """The strings sent to the API: cut (:meth:`truncate`), then, with ``json_inputs``,
        newlines to spaces and JSON-encoded as R2MED's reference sends them; an empty input
        (which APIs reject) becomes one space."""
        texts = self.truncate(texts)
        if self.spec.json_inputs:
            return [json.dumps(t.replace("\n", " ")) for t in texts]
        return [t if t.strip() else " " for t in texts]

    def doc_runtime_fields(self) -> dict[str, Any]:
        """How inputs were truncated (tokens or characters) changes the embeddings: part of the
        embedding cache key."""
        if not self.spec.max_tokens:
            return {}
        return {"truncation": "tokens" if self._cuts_by_tokens() else "characters"}

    def _key(self) -> str:
        key = os.environ.get(self.spec.api_key_env, "")
        remember_secret(key)  # masked wherever a message or log line would show it
        if not key:
            raise ConfigError(
                f"encoder '{self.name}' needs an API key: set the environment variable "
                f"{self.spec.api_key_env}"
            )
        return key

    async def _post(self, client: Any, payload: dict[str, Any]) -> list[np.ndarray]:
        """One batch: retried on transport errors, a whole request over :attr:`timeout_s`, 429,
        5xx and a malformed reply (:func:`read_embeddings`); a reply over
        :data:`~r2med_agent.net.MAX_REPLY_BYTES` and other statuses fail at once."""
        import httpx
        from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

        url = f"{redact_url(self.spec.base_url.rstrip('/'))}/embeddings"

        def transient(e: BaseException) -> bool:
            if isinstance(e, (httpx.TransportError, DeadlineError, MalformedReplyError)):
                return True
            return isinstance(e, httpx.HTTPStatusError) and (
                e.response.status_code == 429 or e.response.status_code >= 500
            )

        try:
            async for attempt in AsyncRetrying(retry=retry_if_exception(transient), stop=stop_after_attempt(ATTEMPTS),
                                               wait=wait_exponential(multiplier=BACKOFF_S, max=20), reraise=True):
                with attempt:
                    r = await within(self.timeout_s, client.post("/embeddings", json=payload), "the request")
                    r.raise_for_status()
                    return read_embeddings(r, len(payload["input"]))
        except httpx.HTTPStatusError as e:
            raise LLMError(redact(
                f"encoder '{self.name}': {url} answered {e.response.status_code}: {e.response.text[:300]}"
            )) from None
        except (httpx.TransportError, DeadlineError, MalformedReplyError, ReplyTooLarge) as e:
            what = "cannot reach" if isinstance(e, httpx.TransportError) else "no usable reply from"
            raise LLMError(redact(f"encoder '{self.name}': {what} {url} after {ATTEMPTS if transient(e) else 1} "
                                  f"attempt(s): {transport_reason(e)}")) from None
        raise AssertionError("unreachable")  # the retry loop returns or raises

    def encode(
        self,
        texts: Sequence[str],
        *,
        side: Side,
        prefix: str = "",
        titles: Sequence[str] | None = None,
    ) -> np.ndarray:
        import httpx

        spec = self.spec
        inputs = self.prepare([(prefix + t) for t in texts])
        if not inputs:
            return np.zeros((0, 0), dtype=np.float32)
        headers = {"Authorization": f"Bearer {self._key()}"}
        bar = None
        if self.show_progress:
            from r2med_agent.progress import stage_bar

            bar = stage_bar(total=len(inputs), desc=f"embed {self.name} ({side})", unit="text", leave=False)

        async def batches() -> list[np.ndarray]:
            rows: list[np.ndarray] = []
            async with httpx.AsyncClient(base_url=spec.base_url.rstrip("/"), headers=headers, timeout=self.timeout_s,
                                         event_hooks=capped_hooks(MAX_REPLY_BYTES)) as client:
                for s in range(0, len(inputs), spec.batch_size):
                    payload: dict[str, Any] = {"model": spec.model, "input": inputs[s : s + spec.batch_size]}
                    if spec.provider == "voyage":
                        payload["input_type"] = "query" if side == "query" else "document"
                    got = await self._post(client, payload)
                    if rows and got and got[0].shape != rows[0].shape:
                        raise LLMError(f"encoder '{self.name}': a batch of embeddings of {got[0].shape[0]} "
                                       f"dimensions after one of {rows[0].shape[0]}")
                    rows.extend(got)
                    if bar is not None:
                        bar.update(len(payload["input"]))
            return rows

        try:
            rows = run_coroutine(batches)
        finally:
            if bar is not None:
                bar.close()
        out = np.stack(rows).astype(np.float32, copy=False)
        if spec.normalize:
            out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out
