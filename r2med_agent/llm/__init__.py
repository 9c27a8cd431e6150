"""LLMs: the registry (``configs/llms.yaml``), the backends, and the cache wrapper.

``make_llm(name)`` is the one entry point: it builds the registry entry's backend and wraps it in
:class:`~r2med_agent.llm.cache.wrapper.CachedLLM` (generation cache + reasoning-output parsing + stats).
Importing this package never imports openai, llama_cpp or vllm; backends load them when built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from r2med_agent.config import build
from r2med_agent.errors import ConfigError
from r2med_agent.llm.base import LLM
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.wrapper import DEFAULT_CHUNK_SIZE, DEFAULT_CHUNK_SIZES, CachedLLM, LazyBackend, LLMStats, RequestBuilder
from r2med_agent.llm.parsing import REASONING_FORMATS, split_reasoning
from r2med_agent.llm.registry import LLMSpec, get_llm_spec, load_llm_specs, make_backend
from r2med_agent.paths import cache_dir
from r2med_agent.types import SamplingParams

__all__ = [
    "LLM",
    "CachedLLM",
    "GenerationCache",
    "LLMSpec",
    "LLMStats",
    "LazyBackend",
    "RequestBuilder",
    "REASONING_FORMATS",
    "default_cache_path",
    "default_sampling",
    "get_llm_spec",
    "load_llm_specs",
    "make_llm",
    "resolve_chunk_size",
    "resolve_spec",
    "split_reasoning",
]


def default_cache_path() -> Path:
    """``<cache_dir>/generations.sqlite`` (``R2MED_CACHE_DIR`` moves it)."""
    return cache_dir() / "generations.sqlite"


def resolve_spec(name: str, overrides: Mapping[str, Any] | None = None, entry: LLMSpec | None = None) -> LLMSpec:
    """The registry entry ``name`` (``entry``: that entry, already looked up) with ``overrides``
    (spec field -> value) applied and validated.

    Raises:
        ConfigError: unknown entry, unknown field, or an invalid value.
    """
    spec = entry if entry is not None else get_llm_spec(name)
    if not overrides:
        return spec
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(LLMSpec)}
    if "name" in overrides:
        raise ConfigError(f"llm '{name}': the name cannot be overridden")
    # build() checks unknown keys and types (YAML-style values from a CLI or a user file).
    return build(LLMSpec, {**fields, **overrides}, f"llm '{name}' overrides")


def default_sampling(spec: LLMSpec, **overrides: Any) -> SamplingParams:
    """The spec's default sampling settings (the reference's for that model), with overrides."""
    return spec.sampling_params(**overrides)


def make_llm(
    name: str,
    *,
    cache_path: str | Path | None = None,
    use_cache: bool = True,
    refresh: bool = False,
    overrides: Mapping[str, Any] | None = None,
    chunk_size: int | None | Literal["auto"] = "auto",
    entry: LLMSpec | None = None,
) -> CachedLLM:
    """The registry entry ``name``'s backend behind the generation cache.

    Args:
        name: registry name (``smollm2``, ``qwen-7b``, ``gpt4``, ...).
        cache_path: the SQLite cache file; default ``default_cache_path()``.
        use_cache: False disables the cache (``--no-cache``): every call reaches the backend.
        refresh: ignore cached outputs and overwrite them (``--refresh-cache``).
        overrides: spec fields to change for this run (e.g. ``{"max_tokens": 64}``).
        chunk_size: misses per backend call, each committed to the cache when done (None or
            0: all at once; ``auto``: the entry's ``chunk_size``, whose own ``auto`` is
            ``DEFAULT_CHUNK_SIZES`` of its backend); see :mod:`r2med_agent.llm.cache.wrapper` for the
            trade-off.
        entry: the entry ``name`` itself, already looked up (a run's plan holds it): not looked up again.

    Raises:
        ConfigError: unknown name or bad override.
        MissingExtraError: (on the first cache miss) the backend's optional dependency is not
            installed.
    """
    spec = resolve_spec(name, overrides, entry)
    cache = GenerationCache(cache_path or default_cache_path()) if use_cache else None
    # Built on the first cache miss: a fully cached run never loads the model or its extra.
    backend = LazyBackend(lambda: make_backend(spec), spec.model)
    return CachedLLM(
        backend, spec, cache=cache, refresh=refresh, chunk_size=resolve_chunk_size(spec, chunk_size)
    )


def resolve_chunk_size(spec: LLMSpec, chunk_size: int | None | Literal["auto"] = "auto") -> int | None:
    """The chunk size a run uses: ``chunk_size`` unless ``auto``, else the entry's, else its
    backend's default; 0 becomes None (all misses in one backend call)."""
    size = spec.chunk_size if chunk_size == "auto" else chunk_size
    if size == "auto":
        size = DEFAULT_CHUNK_SIZES.get(spec.backend, DEFAULT_CHUNK_SIZE)
    return size or None
