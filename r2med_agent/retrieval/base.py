"""The protocol every retriever implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from r2med_agent.types import Run, SearchRequest


@runtime_checkable
class Retriever(Protocol):
    """One ``search`` shape for every backend (as pyserini's ``batch_search``).

    ``search`` takes all queries of a task at once and returns a Run holding every requested
    query id (an empty dict where nothing matched), each with at most ``k`` documents.
    Requests are turned into backend queries by their ``combine`` rule (the table of docs/protocol.md).
    """

    name: str

    def search(self, requests: Sequence[SearchRequest], k: int) -> Run: ...
