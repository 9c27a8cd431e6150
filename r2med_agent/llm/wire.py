"""How sampling parameters travel to an OpenAI-compatible server, and the stop strings applied
on the client (:func:`wire_sampling`); the cache key of an ``openai`` entry holds exactly what
is sent (:func:`key_params`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from r2med_agent.errors import ConfigError
from r2med_agent.types import SamplingParams

OPENAI_MAX_STOP = 4
"""The OpenAI API accepts at most this many stop strings; more are applied client-side."""


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


def unsent_token_limit(spec: Any) -> int | None:
    """The token limit an ``openai`` entry does not send (its own, where ``sends_max_tokens`` is
    false); None: every limit is sent."""
    return None if getattr(spec, "sends_max_tokens", True) else spec.max_tokens


def wire_sampling(
    params: SamplingParams,
    *,
    server: str,
    drop_params: Sequence[str] = (),
    max_tokens_param: str = "max_tokens",
    unsent_max_tokens: int | None = None,
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """How ``params`` travel to an OpenAI-compatible ``server`` (``openai``/``vllm``/``llamacpp``).

    Returns:
        ``(fields, extra, client_stops)``: the request's top-level sampling fields, the
        server-specific fields that go in ``extra_body``, and the stop strings applied
        client-side (dropped, or over the OpenAI API's limit of 4). The cache key of an
        ``openai`` entry is built from exactly these, so two entries that send the same
        request share generations and two that do not never do. ``unsent_max_tokens``: a token
        limit that is not sent (the entry's own, where it ``sends_max_tokens: false``).
    """
    drop = set(drop_params)
    fields: dict[str, Any] = {} if params.max_tokens == unsent_max_tokens else {max_tokens_param: params.max_tokens}
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
    unsent_max_tokens: int | None = None,
) -> dict[str, Any]:
    """The sampling part of an ``openai`` entry's cache key: every field :func:`wire_sampling`
    sends (``extra_body`` ones under their wire names), plus ``client_stop`` when stops are
    applied client-side."""
    fields, extra, client_stops = wire_sampling(
        params, server=server, drop_params=drop_params, max_tokens_param=max_tokens_param,
        unsent_max_tokens=unsent_max_tokens,
    )
    out = {**fields, **extra}
    if client_stops:
        out["client_stop"] = client_stops
    return out
