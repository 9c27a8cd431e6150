"""Key building: how a prompt becomes the request record hashed into its cache key.

:class:`RequestBuilder` is what :class:`~r2med_agent.llm.cache.wrapper.CachedLLM` keys with, and what
the importer of published caches keys rows it did not generate with. Besides the messages and
the sampling, a key holds every setting of the registry entry that changes what the model
generates (:func:`generation_options`); never a URL, an API key or ``extra_body``'s content.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from r2med_agent.llm.parsing import check_format, split_reasoning
from r2med_agent.llm.cache.records import build_request, canonical_json, request_key
from r2med_agent.llm.registry import with_system_prompt
from r2med_agent.llm.servers import resolve_server
from r2med_agent.llm.wire import key_params, unsent_token_limit
from r2med_agent.types import Message, SamplingParams


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
            (``wire.key_params``), not the SamplingParams asked for. None: every
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
        "unsent_max_tokens": unsent_token_limit(spec),
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
