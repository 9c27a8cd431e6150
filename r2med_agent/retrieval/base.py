"""The protocol every retriever implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from r2med_agent.types import Run, SearchRequest


@runtime_checkable
class Retriever(Protocol):
    """One ``search`` shape for every backend (as pyserini's ``batch_search``).

    ``search`` takes all queries of a task at once and returns a Run holding every requested
    query id (an empty dict where nothing matched), each with at most ``k`` documents.
    Requests are turned into backend queries by their ``combine`` rule (the table of docs/protocol.md).

    Optional, read through :func:`keeps_order` (a retriever without it is False):
    ``keeps_order``, True where each query's documents come in a given first-stage order (a run
    file) that a reranker keeps, tied scores included (``RerankJob.ordered``).
    """

    name: str

    def search(self, requests: Sequence[SearchRequest], k: int) -> Run: ...


KEEPS_ORDER_DEFAULT = False
"""What :func:`keeps_order` answers for a retriever that does not declare ``keeps_order``."""


def keeps_order(retriever: Any) -> bool:
    """The retriever's declared ``keeps_order`` (:class:`Retriever`), False where it declares none."""
    return bool(getattr(retriever, "keeps_order", KEEPS_ORDER_DEFAULT))
