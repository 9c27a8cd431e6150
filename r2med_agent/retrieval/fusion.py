"""Rank fusion: reciprocal rank fusion and weighted min-max score fusion, as pure functions over
Runs, plus a retriever that fuses several retrievers.

Ranks inside each input run are read by (score descending, doc id ascending), and fused lists are
ordered by (fused score descending, doc id ascending), so results never depend on dict order.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from r2med_agent.errors import ConfigError
from r2med_agent.names import DEFAULT_RRF_K, ORIGINAL_QUERY, fusion_label, member_names
from r2med_agent.retrieval.base import Retriever
from r2med_agent.types import Run, SearchRequest

logger = logging.getLogger(__name__)

class OriginalQueryRetriever:
    """A member that searches with each request's original query (``combine`` none)."""

    def __init__(self, inner: Retriever) -> None:
        self.inner = inner
        self.name = inner.name + ORIGINAL_QUERY

    def search(self, requests: Sequence[SearchRequest], k: int) -> Run:
        plain = [SearchRequest(r.query_id, r.query) for r in requests]
        return self.inner.search(plain, k)


FusionMethod = Literal["rrf", "weighted"]
FUSION_METHODS: tuple[str, ...] = ("rrf", "weighted")

def check_fusion_options(
    n_members: int, method: str = "rrf", rrf_k: int = DEFAULT_RRF_K, weights: Sequence[float] | None = None
) -> None:
    """Raise a ConfigError naming the option when fusion settings are out of range."""
    if method not in FUSION_METHODS:
        raise ConfigError(f"--fusion must be one of {', '.join(FUSION_METHODS)}, got '{method}'")
    if rrf_k < 0:
        raise ConfigError(f"--rrf-k must be >= 0, got {rrf_k}")
    if method != "rrf" and rrf_k != DEFAULT_RRF_K:
        raise ConfigError("--rrf-k applies to --fusion rrf only")
    if weights is None:
        return
    if method != "weighted":
        raise ConfigError("--fusion-weights apply to --fusion weighted only")
    if len(weights) != n_members:
        raise ConfigError(
            f"--fusion-weights: {len(weights)} weight(s) for {n_members} fused retriever(s); give one per retriever"
        )
    if any(not math.isfinite(w) or w < 0 for w in weights) or not any(w > 0 for w in weights):
        raise ConfigError(f"--fusion-weights must be finite, >= 0 and not all 0, got {list(weights)}")


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


def rrf(runs: Sequence[Run], k: int = DEFAULT_RRF_K, depth: int | None = None) -> Run:
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
        method: ``rrf`` or ``weighted`` (weighted min-max score sum).
        rrf_k: the RRF constant.
        weights: per-retriever weights for ``weighted`` (all 1.0 when None).
        depth: how deep each member is searched before fusing (at least ``k``).
        member_depths: one depth per member instead of ``depth`` (each at least ``k``).
        name: defaults to :func:`fusion_label` of the members' names joined by ``+``.
    """

    def __init__(
        self,
        retrievers: Sequence[Retriever],
        method: FusionMethod = "rrf",
        *,
        rrf_k: int = DEFAULT_RRF_K,
        weights: Sequence[float] | None = None,
        depth: int = 100,
        member_depths: Sequence[int] | None = None,
        name: str | None = None,
    ) -> None:
        if len(retrievers) < 1:
            raise ConfigError("fusion needs at least one retriever")
        check_fusion_options(len(retrievers), method, rrf_k, weights)
        if member_depths is not None and len(member_depths) != len(retrievers):
            raise ConfigError(f"fusion depths: {len(member_depths)} for {len(retrievers)} retriever(s)")
        self.member_depths = list(member_depths) if member_depths is not None else None
        self.retrievers = list(retrievers)
        self.method = method
        self.rrf_k = rrf_k
        self.weights = list(weights) if weights is not None else None
        self.depth = depth
        members = "+".join(r.name for r in self.retrievers)
        self.name = name or fusion_label(members, method, rrf_k, self.weights)

    def search(self, requests: Sequence[SearchRequest], k: int) -> Run:
        depths = self.member_depths or [self.depth] * len(self.retrievers)
        runs = [r.search(requests, max(d, k)) for r, d in zip(self.retrievers, depths)]
        if self.method == "rrf":
            fused = rrf(runs, k=self.rrf_k, depth=k)
        else:
            fused = weighted_score_fusion(runs, self.weights, depth=k)
        return {req.query_id: fused.get(req.query_id, {}) for req in requests}


@dataclass(frozen=True)
class FusionOptions:
    """How a '+'-joined retriever spec fuses its members (``make_retriever(options=...)``): the
    arguments of :class:`FusionRetriever` of the same names (``method``: ``fusion``)."""

    method: FusionMethod = "rrf"
    rrf_k: int = DEFAULT_RRF_K
    weights: Sequence[float] | None = None
    depth: int = 100
    member_depths: Sequence[int] | None = None

    def check(self, n_members: int) -> None:
        """Raise a ConfigError when these settings do not fit ``n_members`` members."""
        check_fusion_options(n_members, self.method, self.rrf_k, self.weights)

    def retriever(self, members: Sequence[Retriever]) -> FusionRetriever:
        """The fusion of ``members`` with these settings."""
        return FusionRetriever(members, method=self.method, rrf_k=self.rrf_k, weights=self.weights, depth=self.depth,
                               member_depths=self.member_depths)
