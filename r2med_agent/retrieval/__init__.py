"""Retrievers (BM25, dense, fusion) and rerankers, built from short spec strings.

``make_retriever("bm25", task)``, ``make_retriever("minilm", task)`` or
``make_retriever("bm25+minilm", task)`` (reciprocal rank fusion of the parts);
``make_reranker("bge-reranker")``. What each spec word builds, and how a new kind of retriever is
added, is :mod:`r2med_agent.retrieval.registry`. BM25 is :mod:`r2med_agent.retrieval.bm25`, dense
retrieval :mod:`r2med_agent.retrieval.dense`, the query text of a request
:mod:`r2med_agent.retrieval.query`, fusion :mod:`r2med_agent.retrieval.fusion` and the rerankers
:mod:`r2med_agent.rerank`; NanoR2MED's shipped candidate rankings and the hybrid list
rebuilt from them are :mod:`r2med_agent.retrieval.candidates` (``nano-bm25``, ``hakari-hybrid``,
...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from r2med_agent.retrieval.base import Retriever
from r2med_agent.retrieval.registry import (
    BM25_SPECS,
    RetrieverOptions,
    make_retriever,
    register_retriever,
    retriever_names,
    unregister_retriever,
)

if TYPE_CHECKING:  # pragma: no cover
    from r2med_agent.rerank.spec import Reranker

__all__ = [
    "BM25_SPECS", "Retriever", "RetrieverOptions", "make_retriever", "make_reranker", "register_retriever",
    "retriever_names", "unregister_retriever",
]


def make_reranker(name: str, **opts: Any) -> Reranker:
    """The reranker registered as ``name`` in ``configs/rerankers.yaml`` (options: ``device``,
    ``backend``, ``show_progress``, ``precision``)."""
    from r2med_agent.rerank.factory import make_reranker as _make

    return _make(name, **opts)
