"""The reranker of a registry entry (:func:`make_reranker`), built by its kind's declared builder
(:data:`~r2med_agent.rerank.kinds.RERANKER_KINDS`), and the builders of the built-in kinds."""

from __future__ import annotations

import dataclasses
from typing import Any

from r2med_agent.errors import ConfigError
from r2med_agent.rerank.kinds import RerankerKind, RerankerOptions
from r2med_agent.rerank.spec import Reranker, RerankerSpec, get_reranker_spec

__all__ = ["build_cross_encoder", "build_reranker", "build_groupwise", "build_llm_reranker", "build_setwise", "make_reranker"]


def make_reranker(name: str, *, entry: RerankerSpec | None = None, options: RerankerOptions | None = None,
                  **keywords: Any) -> Reranker:
    """The reranker of a registry entry (``configs/rerankers.yaml``); models load on first use.

    Args:
        name: the entry's name.
        entry: the entry itself, already looked up (a run's plan holds it): ``name`` is not looked up again.
        options: what the run passes (:class:`~r2med_agent.rerank.kinds.RerankerOptions`:
            precision and ``max_length`` overrides of a kind with a model, device, backend,
            progress; the LLM kinds' ``llm``, ``cache_path``, ``use_cache``, ``refresh``,
            ``chunk_size``, ``prompts_dir``). Each kind reads what applies to it.
        **keywords: instead of ``options``, its fields as keywords.

    Raises:
        ConfigError: an unknown entry or option; a builder whose reranker does not batch tasks as
            its kind declares.
    """
    if options is None:
        known = {f.name for f in dataclasses.fields(RerankerOptions)}
        unknown = sorted(set(keywords) - known)
        if unknown:
            raise ConfigError(f"unknown reranker option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
        options = RerankerOptions(**keywords)
    elif keywords:
        raise ConfigError(f"make_reranker takes options= or keywords, not both (got {', '.join(sorted(keywords))})")
    spec = entry if entry is not None else get_reranker_spec(name)
    return build_reranker(spec, spec.kind_of, options)


def build_reranker(spec: RerankerSpec, kind: RerankerKind, options: RerankerOptions) -> Reranker:
    """The reranker of an entry already looked up (a run's plan holds it and its ``kind``), built
    by the kind's declared builder.

    Raises:
        ConfigError: a builder whose reranker does not batch tasks as its kind declares.
    """
    reranker = kind.builder()(spec, options)
    if bool(getattr(reranker, "batches_tasks", False)) != kind.batches_tasks:
        raise ConfigError(f"reranker '{spec.name}': kind {spec.kind} declares batches_tasks={kind.batches_tasks}, but "
                          f"its builder made a {type(reranker).__name__} that does not")
    return reranker


def build_cross_encoder(spec: RerankerSpec, options: RerankerOptions) -> Reranker:
    """A cross-encoder (:class:`~r2med_agent.rerank.cross_encoder.PairwiseReranker`), at
    the run's precision and ``max_length`` where it sets them."""
    from r2med_agent.rerank.cross_encoder import PairwiseReranker

    if options.precision is not None:
        spec = dataclasses.replace(spec, precision=options.precision)  # type: ignore[arg-type]
    if options.max_length is not None:
        spec = dataclasses.replace(spec, max_length=options.max_length)
    return PairwiseReranker(spec, device=options.device, backend=options.backend, show_progress=options.show_progress)


def _llm_options(options: RerankerOptions) -> dict[str, Any]:
    return dict(llm=options.llm, cache_path=options.cache_path, use_cache=options.use_cache,
                refresh=options.refresh, chunk_size=options.chunk_size, prompts_dir=options.prompts_dir)


def build_llm_reranker(spec: RerankerSpec, options: RerankerOptions) -> Reranker:
    """A listwise or pointwise-reasoning LLM reranker
    (:class:`~r2med_agent.rerank.llm.LLMReranker`)."""
    from r2med_agent.rerank.llm import LLMReranker

    return LLMReranker(spec, **_llm_options(options))  # type: ignore[return-value]


def build_groupwise(spec: RerankerSpec, options: RerankerOptions) -> Reranker:
    """GroupRank's groupwise reranker (:class:`~r2med_agent.rerank.groupwise.GroupwiseReranker`)."""
    from r2med_agent.rerank.groupwise import GroupwiseReranker

    return GroupwiseReranker(spec, **_llm_options(options))  # type: ignore[return-value]


def build_setwise(spec: RerankerSpec, options: RerankerOptions) -> Reranker:
    """Rank-R1's setwise reranker (:class:`~r2med_agent.rerank.setwise.SetwiseReranker`)."""
    from r2med_agent.rerank.setwise import SetwiseReranker

    return SetwiseReranker(spec, **_llm_options(options))  # type: ignore[return-value]
