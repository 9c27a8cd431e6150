"""The published R2MED scores (the paper's and the NanoR2MED card's), packaged as a CSV."""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from r2med_agent.errors import DataError
from r2med_agent.paths import resources_dir

logger = logging.getLogger(__name__)

PUBLISHED_METRICS: tuple[str, ...] = ("ndcg_at_10", "ndcg_at_100", "recall_at_100", "map_at_10", "mrr")
"""Metrics the packaged CSV of published scores has."""


# ----------------------------------------------------------------------------------------------
# Published scores (R2MED paper, packaged CSV)


@dataclass(frozen=True)
class PublishedKey:
    """A configuration as the published CSV spells it (llm and reranker "" when none)."""

    method: str
    llm: str
    retriever: str
    reranker: str = ""


class PublishedResults:
    """Published scores, read from ``r2med_agent/resources/published_results.csv``: the R2MED
    paper's (kinds ``retrieval``, ``gar``, ``rerank``, ...) on the 8 R2MED tasks, and the
    NanoR2MED card's three profiles (kind ``nano``: retrievers ``nano-bm25``, ``harrier``,
    ``nano-hybrid``) on its 8 splits.

    Columns: ``kind, method, llm, retriever, reranker, task`` and one column per metric in
    PUBLISHED_METRICS (empty where the source has no number).
    """

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else resources_dir() / "published_results.csv"
        self._scores: dict[PublishedKey, dict[str, dict[str, float]]] = {}
        self.kinds: dict[PublishedKey, str] = {}
        try:
            f = self.path.open(encoding="utf-8", newline="")
        except OSError as e:
            raise DataError(f"cannot read published scores: {e.strerror}", self.path) from None
        with f:
            reader = csv.DictReader(f)
            needed = {"kind", "method", "llm", "retriever", "reranker", "task"}
            if not needed <= set(reader.fieldnames or ()):
                raise DataError(f"published scores need columns {', '.join(sorted(needed))}", self.path, 1)
            for lineno, rec in enumerate(reader, start=2):
                key = PublishedKey(rec["method"], rec["llm"], rec["retriever"], rec["reranker"])
                self.kinds[key] = rec["kind"]
                per_task = self._scores.setdefault(key, {})
                if rec["task"] in per_task:
                    raise DataError(f"duplicate row for {key} on task {rec['task']}", self.path, lineno)
                values: dict[str, float] = {}
                for metric in PUBLISHED_METRICS:
                    cell = (rec.get(metric) or "").strip()
                    if not cell:
                        continue
                    try:
                        values[metric] = float(cell)
                    except ValueError:
                        raise DataError(f"{metric} '{cell}' is not a number", self.path, lineno) from None
                per_task[rec["task"]] = values

    def keys(self, kind: str | None = None) -> list[PublishedKey]:
        """Every published configuration (of ``kind``: retrieval, gar, rerank), in file order."""
        return [k for k in self._scores if kind is None or self.kinds[k] == kind]

    def scores(self, key: PublishedKey, metric: str = "ndcg_at_10") -> dict[str, float]:
        """``{task: score}`` of one configuration (tasks without a number for ``metric`` left out)."""
        out = {}
        for task, values in self._scores.get(key, {}).items():
            if metric in values:
                out[task] = values[metric]
        return out

    def __contains__(self, key: object) -> bool:
        return key in self._scores


@lru_cache(maxsize=1)
def published_results() -> PublishedResults:
    """The packaged published scores (read once)."""
    return PublishedResults()


PUBLISHED_RETRIEVERS: dict[str, str] = {
    "bm25-compat": "bm25",
    "nano-dense": "harrier",
    "nano-hybrid-safeguard": "nano-hybrid",
    "hakari-hybrid": "nano-hybrid",
    "hakari-hybrid-safeguard": "nano-hybrid",
}
"""Run retriever names -> the published CSV's name for the same retriever. ``bm25-compat`` is the
reference's own BM25 (gensim ``LuceneBM25Model`` weights on query and documents), the scoring
behind every BM25 number of the paper. On NanoR2MED, the card's dense profile is ``harrier``'s
ranking (shipped as ``nano-dense``) and its hybrid profile the shipped ``nano-hybrid`` list, which
``hakari-hybrid`` rebuilds; the safeguard positive (rank 101) changes no top-100 score."""

