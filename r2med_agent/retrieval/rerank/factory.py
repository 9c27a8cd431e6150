"""The reranker of a registry entry (:func:`make_reranker`): a cross-encoder or an LLM reranker."""

from __future__ import annotations

import dataclasses
from typing import Any

from r2med_agent.retrieval.rerank.cross_encoder import PairwiseReranker
from r2med_agent.retrieval.rerank.spec import Reranker, get_reranker_spec

__all__ = ["make_reranker"]


def make_reranker(
    name: str, *, device: str | None = None, backend: str | None = None, show_progress: bool = False,
    precision: str | None = None,
    max_length: int | None = None,
    **llm_options: Any,
) -> Reranker:
    """The reranker of a registry entry (``configs/rerankers.yaml``); models load on first use.
    ``precision`` overrides the entry's (None: the entry's, the reference's); so does a
    cross-encoder's ``max_length`` (``run --rerank-max-length``).

    ``llm_options`` go to :class:`~r2med_agent.retrieval.rerank.llm.LLMReranker` (or the groupwise
    and setwise rerankers built on it) for the LLM kinds (``llm``, ``cache_path``, ``use_cache``,
    ``refresh``, ``chunk_size``) and are ignored by cross-encoders."""
    spec = get_reranker_spec(name)
    if spec.kind == "groupwise":
        from r2med_agent.retrieval.rerank.groupwise import GroupwiseReranker

        return GroupwiseReranker(spec, **llm_options)  # type: ignore[return-value]
    if spec.kind == "setwise":
        from r2med_agent.retrieval.rerank.setwise import SetwiseReranker

        return SetwiseReranker(spec, **llm_options)  # type: ignore[return-value]
    if spec.kind != "cross-encoder":
        from r2med_agent.retrieval.rerank.llm import LLMReranker

        return LLMReranker(spec, **llm_options)  # type: ignore[return-value]
    if precision is not None:
        spec = dataclasses.replace(spec, precision=precision)
    if max_length is not None:
        spec = dataclasses.replace(spec, max_length=max_length)
    return PairwiseReranker(spec, device=device, backend=backend, show_progress=show_progress)
