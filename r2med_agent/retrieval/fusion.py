"""Rank fusion: reciprocal rank fusion and weighted min-max score fusion, as pure functions over
Runs, plus a retriever that fuses several retrievers.

Ranks inside each input run are read by (score descending, doc id ascending), and fused lists are
ordered by (fused score descending, doc id ascending), so results never depend on dict order.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Literal

from r2med_agent.errors import ConfigError
from r2med_agent.retrieval.base import Retriever
from r2med_agent.types import Run, SearchRequest

logger = logging.getLogger(__name__)

FusionMethod = Literal["rrf", "score"]


def ranked(docs: Mapping[str, float]) -> list[tuple[str, float]]:
    """``(doc_id, score)`` pairs by score descending, ties by doc id ascending."""
    return sorted(docs.items(), key=lambda kv: (-kv[1], kv[0]))


def _finish(fused: dict[str, float], depth: int | None) -> dict[str, float]:
    items = ranked(fused)
    if depth is not None:
        items = items[:depth]
    return dict(items)


def _query_ids(runs: Sequence[Run]) -> list[str]:
    seen: dict[str, None] = {}
    for run in runs:
        for qid in run:
            seen.setdefault(qid, None)
    return list(seen)


def rrf(runs: Sequence[Run], k: int = 60, depth: int | None = None) -> Run:
    """Reciprocal rank fusion (Cormack et al., 2009): ``score(d) = sum_r 1 / (k + rank_r(d))``,
    ranks starting at 1; documents missing from a run get nothing from it.

    Args:
        runs: the runs to fuse; every query id of any run appears in the result.
        k: the RRF constant (60 in the paper).
        depth: keep this many documents per query (all when None).
    """
    if k < 0:
        raise ConfigError(f"rrf k must be >= 0, got {k}")
    out: Run = {}
    for qid in _query_ids(runs):
        fused: dict[str, float] = {}
        for run in runs:
            for rank, (doc, _) in enumerate(ranked(run.get(qid, {})), start=1):
                fused[doc] = fused.get(doc, 0.0) + 1.0 / (k + rank)
        out[qid] = _finish(fused, depth)
    return out


def min_max(docs: Mapping[str, float]) -> dict[str, float]:
    """Scores mapped to [0, 1] per query; a list whose scores are all equal maps to 1.0."""
    if not docs:
        return {}
    lo, hi = min(docs.values()), max(docs.values())
    if hi == lo:
        return {d: 1.0 for d in docs}
    span = hi - lo
    return {d: (s - lo) / span for d, s in docs.items()}


def weighted_score_fusion(
    runs: Sequence[Run], weights: Sequence[float] | None = None, depth: int | None = None
) -> Run:
    """Weighted sum of per-query min-max normalised scores; a missing document adds 0.

    Args:
        runs: the runs to fuse.
        weights: one weight per run (all 1.0 when None).
        depth: keep this many documents per query (all when None).
    """
    if weights is None:
        weights = [1.0] * len(runs)
    if len(weights) != len(runs):
        raise ConfigError(f"fusion weights: {len(weights)} weight(s) for {len(runs)} run(s)")
    out: Run = {}
    for qid in _query_ids(runs):
        fused: dict[str, float] = {}
        for run, w in zip(runs, weights):
            for doc, s in min_max(run.get(qid, {})).items():
                fused[doc] = fused.get(doc, 0.0) + w * s
        out[qid] = _finish(fused, depth)
    return out


class FusionRetriever:
    """Fuses the runs of several retrievers for the same requests.

    Args:
        retrievers: the members; each is searched to ``depth`` (at least ``k``).
        method: ``rrf`` or ``score`` (weighted min-max score sum).
        rrf_k: the RRF constant.
        weights: per-retriever weights for ``score``.
        depth: how deep each member is searched before fusing.
        name: defaults to the members' names joined by ``+`` (``-score`` appended for ``score``).
    """

    def __init__(
        self,
        retrievers: Sequence[Retriever],
        method: FusionMethod = "rrf",
        *,
        rrf_k: int = 60,
        weights: Sequence[float] | None = None,
        depth: int = 100,
        name: str | None = None,
    ) -> None:
        if len(retrievers) < 1:
            raise ConfigError("fusion needs at least one retriever")
        if method not in ("rrf", "score"):
            raise ConfigError(f"fusion method '{method}' is not one of: rrf, score")
        if weights is not None and len(weights) != len(retrievers):
            raise ConfigError(f"fusion weights: {len(weights)} weight(s) for {len(retrievers)} retriever(s)")
        if weights is not None and method != "score":
            raise ConfigError("fusion weights apply to method 'score' only")
        self.retrievers = list(retrievers)
        self.method = method
        self.rrf_k = rrf_k
        self.weights = list(weights) if weights is not None else None
        self.depth = depth
        default = "+".join(r.name for r in self.retrievers)
        self.name = name or (default if method == "rrf" else f"{default}-score")

    def search(self, requests: Sequence[SearchRequest], k: int) -> Run:
        depth = max(self.depth, k)
        runs = [r.search(requests, depth) for r in self.retrievers]
        if self.method == "rrf":
            fused = rrf(runs, k=self.rrf_k, depth=k)
        else:
            fused = weighted_score_fusion(runs, self.weights, depth=k)
        return {req.query_id: fused.get(req.query_id, {}) for req in requests}
