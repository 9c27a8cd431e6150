"""NanoR2MED's three published profiles: the candidate rankings its splits ship, and the hybrid
candidate list rebuilt from its two members.

HAKARI-Bench, which publishes NanoR2MED, stores three rankings per split beside the task files
and scores its card's profiles on them (nDCG@10 of each list as it is ordered, binary qrels):

* ``bm25``: its BM25 top-500 (bm25s). Where a positive document was missing from the 500 it was
  written over the tail of the list (rank ~500), so the list is not a pure BM25 ranking there.
* ``harrier_oss_v1_270m``: the dense top-500 of ``microsoft/harrier-oss-v1-270m``, queries with
  its ``web_search_query`` prompt, documents without one, cosine over L2-normalised embeddings
  (the ``harrier`` encoder of ``configs/encoders.yaml``).
* ``reranking_hybrid``: reciprocal-rank fusion of the two with k=100, ties broken by the better
  of a document's two ranks, then by id; the top 100 are kept. When those 100 hold no positive
  document, one positive (chosen at random, seeded per query) is appended at rank 101, the
  *safeguard*, so that a reranker always has something to find.

The safeguard is read from the qrels: it is not a retrieval result, and a reranker that moves it
up scores better than any retriever could make it. The retrievers here therefore leave it out
unless their name says ``-safeguard``. It never reaches a default run (which keeps the top 100);
it matters for ``--rerank-k 101`` or ``--top-k`` above 100.

Retriever names (``--retriever``):

* ``nano-bm25``, ``nano-dense``, ``nano-hybrid``, ``nano-hybrid-safeguard``: the shipped lists, as
  they are (the card's BM25 and hybrid numbers are these lists' scores).
* ``hakari-hybrid``, ``hakari-hybrid-safeguard``: the hybrid list rebuilt here from the shipped
  BM25 list and this project's ``harrier`` dense ranking, as HAKARI-Bench builds it.

A shipped list is fixed per query: it can only answer the task's own queries (``--method none``,
or as the first stage of a reranker), never a query an LLM wrote.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from r2med_agent.errors import ConfigError
from r2med_agent.retrieval.base import Retriever
from r2med_agent.types import Qrels, Run, SearchRequest, Task

if TYPE_CHECKING:  # pragma: no cover
    from r2med_agent.retrieval.dense.spec import EncoderOptions

logger = logging.getLogger(__name__)

SHIPPED: dict[str, str] = {
    "nano-bm25": "bm25",
    "nano-dense": "harrier_oss_v1_270m",
    "nano-hybrid": "reranking_hybrid",
    "nano-hybrid-safeguard": "reranking_hybrid",
}
"""Retriever name -> the NanoR2MED candidate subset it reads."""

REBUILT: tuple[str, ...] = ("hakari-hybrid", "hakari-hybrid-safeguard")
"""Retriever names of the hybrid list rebuilt from ``nano-bm25`` and ``harrier``."""

HYBRID_RRF_K = 100
"""HAKARI-Bench's RRF constant for ``reranking_hybrid`` (not the usual 60)."""
HYBRID_TOP = 100
"""Fused documents kept; a safeguard positive goes at rank ``HYBRID_TOP + 1``."""
MEMBER_DEPTH = 500
"""Depth of each fused list (the shipped BM25 and dense lists are top-500)."""
SAFEGUARD_SEED = 20260524
"""Seed of HAKARI-Bench's reranking-hybrid builder for the safeguard choice."""
DENSE_ENCODER = "harrier"
"""The encoder registry entry of HAKARI-Bench's dense profile."""


def candidate_names() -> list[str]:
    """Every retriever name this module provides."""
    return [*SHIPPED, *REBUILT]


def keeps_safeguard(name: str) -> bool:
    return name.endswith("-safeguard")


def ranking_scores(ranking: Sequence[str]) -> dict[str, float]:
    """A ranked list as run scores that keep its order: ``n, n-1, ..., 1``."""
    n = len(ranking)
    return {doc: float(n - i) for i, doc in enumerate(ranking)}


def hybrid_ranking(
    bm25: Sequence[str], dense: Sequence[str], *, rrf_k: int = HYBRID_RRF_K, top: int = HYBRID_TOP
) -> list[str]:
    """HAKARI-Bench's reranking-hybrid order of two ranked lists: ``sum 1/(rrf_k + rank)`` over the
    lists a document is in (ranks from 1), ties by the document's best rank in either list, then
    by id; the first ``top``."""
    fused: dict[str, float] = {}
    best: dict[str, int] = {}
    for ranking in (bm25, dense):
        for rank, doc in enumerate(ranking, start=1):
            fused[doc] = fused.get(doc, 0.0) + 1.0 / (rrf_k + rank)
            best[doc] = min(best.get(doc, rank), rank)
    return sorted(fused, key=lambda d: (-fused[d], best[d], d))[:top]


def safeguard_positive(positives: Sequence[str], *, split: str, query_id: str, seed: int = SAFEGUARD_SEED) -> str:
    """The positive HAKARI-Bench appends for a query whose fused top 100 has none: a seeded
    choice among its positives in id order."""
    rng = random.Random(f"{seed}\0{split}\0{query_id}\0positive_safeguard")
    return rng.choice(sorted(positives))


def with_safeguard(
    ranking: list[str], positives: Sequence[str], *, split: str, query_id: str, top: int = HYBRID_TOP
) -> list[str]:
    """``ranking`` (a fused top ``top``) with the safeguard positive at rank ``top + 1`` when it
    holds no positive (unchanged when it holds one, or the query has none)."""
    if not positives or set(ranking) & set(positives):
        return ranking
    return [*ranking[:top], safeguard_positive(positives, split=split, query_id=query_id)]


class _FixedRanking:
    """Answers a task's own queries from rankings fixed per query id."""

    name: str

    def __init__(self, name: str, task: Task) -> None:
        self.name = name
        self._texts = {q.query_id: q.text for q in task.queries}

    def _check(self, requests: Sequence[SearchRequest]) -> None:
        for req in requests:
            if req.combine != "none" or req.expansion or self._texts.get(req.query_id) != req.query:
                raise ConfigError(
                    f"retriever '{self.name}' holds a fixed ranking per task query and cannot search "
                    "for other text (an LLM's expansion or a loop's search); use it with --method none "
                    "(or as the first stage of --reranker)"
                )


class CandidateRetriever(_FixedRanking):
    """A candidate ranking a NanoR2MED split ships (see the module docstring).

    Args:
        name: the retriever name (a key of SHIPPED).
        task: the loaded NanoR2MED task.
        rankings: ``{query id: ranked doc ids}`` (default: read with
            :func:`r2med_agent.data.read_nano_candidates`).
    """

    def __init__(self, name: str, task: Task, rankings: Mapping[str, Sequence[str]] | None = None) -> None:
        if name not in SHIPPED:
            raise ConfigError(f"unknown candidate retriever '{name}'; allowed: {', '.join(SHIPPED)}")
        super().__init__(name, task)
        if rankings is None:
            from r2med_agent.data import read_nano_candidates

            rankings, path = read_nano_candidates(task, SHIPPED[name])
            logger.info("%s: %d candidate rankings from %s", name, len(rankings), path)
        self.subset = SHIPPED[name]
        self.rankings = {q: list(r) for q, r in rankings.items()}
        self.safeguards = 0
        if self.subset == "reranking_hybrid":
            # Rows longer than the fused top 100 end with the safeguard positive.
            self.safeguards = sum(1 for r in self.rankings.values() if len(r) > HYBRID_TOP)
            if not keeps_safeguard(name):
                self.rankings = {q: r[:HYBRID_TOP] for q, r in self.rankings.items()}
            elif self.safeguards:
                logger.warning(
                    "%s on %s: %d queries carry a safeguard positive at rank %d, taken from the qrels "
                    "(not a retrieval result)", name, task.name, self.safeguards, HYBRID_TOP + 1,
                )

    def search(self, requests: Sequence[SearchRequest], k: int) -> Run:
        self._check(requests)
        return {r.query_id: ranking_scores(self.rankings.get(r.query_id, [])[:k]) for r in requests}


class HybridRetriever(_FixedRanking):
    """HAKARI-Bench's reranking-hybrid list rebuilt from two retrievers (BM25 and dense): each
    searched to MEMBER_DEPTH, fused by :func:`hybrid_ranking`, and, with ``safeguard``, a
    positive appended at rank 101 where the fused 100 have none.

    Args:
        name: the retriever name.
        task: the task (its queries; its qrels and split for the safeguard).
        bm25, dense: the two members, in HAKARI-Bench's order (the order decides nothing but is kept).
        safeguard: append the safeguard positive (read from the qrels: not a retrieval result).
        split: the split name that seeds the safeguard choice (default: the task's Nano split).
    """

    def __init__(
        self,
        name: str,
        task: Task,
        bm25: Retriever,
        dense: Retriever,
        *,
        safeguard: bool = False,
        split: str | None = None,
        depth: int = MEMBER_DEPTH,
    ) -> None:
        super().__init__(name, task)
        self.members = (bm25, dense)
        self.safeguard = safeguard
        self.depth = depth
        self._qrels: Qrels = task.qrels
        if split is None:
            from r2med_agent.data import get_task_spec

            split = get_task_spec(task.name).split or task.name
        self.split = split

    def search(self, requests: Sequence[SearchRequest], k: int) -> Run:
        self._check(requests)
        runs = [m.search(requests, max(self.depth, k)) for m in self.members]
        out: Run = {}
        added = 0
        for req in requests:
            lists = [sorted(run.get(req.query_id, {}).items(), key=lambda kv: (-kv[1], kv[0])) for run in runs]
            ranking = hybrid_ranking([d for d, _ in lists[0]], [d for d, _ in lists[1]])
            if self.safeguard:
                positives = list(self._qrels.get(req.query_id, {}))
                before = len(ranking)
                ranking = with_safeguard(ranking, positives, split=self.split, query_id=req.query_id)
                added += len(ranking) > before
            out[req.query_id] = ranking_scores(ranking[:k])
        if added:
            logger.warning(
                "%s: %d queries got a safeguard positive at rank %d, taken from the qrels "
                "(not a retrieval result)", self.name, added, HYBRID_TOP + 1,
            )
        return out


def make_candidate_retriever(name: str, task: Task, dense_options: EncoderOptions | None = None) -> Retriever:
    """The retriever ``name`` (one of :func:`candidate_names`) over ``task``; ``dense_options``
    build the dense member of a rebuilt hybrid."""
    if name in SHIPPED:
        return CandidateRetriever(name, task)
    if name in REBUILT:
        from r2med_agent.retrieval.dense.index import DenseRetriever

        bm25 = CandidateRetriever("nano-bm25", task)
        dense = DenseRetriever.for_task(task, DENSE_ENCODER, dense_options)
        return HybridRetriever(name, task, bm25, dense, safeguard=keeps_safeguard(name))
    raise ConfigError(f"unknown candidate retriever '{name}'; allowed: {', '.join(candidate_names())}")
