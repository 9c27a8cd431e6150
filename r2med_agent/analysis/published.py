"""The published scores, packaged as CSVs: R2MED's paper and the NanoR2MED card's
(``published_results.csv``), the systems published since (``frontier_results.csv``: reasoning
embedders and reasoning rerankers, each row with its source and how it was checked), BRIGHT's own
tables (``bright_results.csv``) and those systems' BRIGHT numbers (``bright_frontier_results.csv``).

One configuration may have rows on several benchmarks (R2MED's tasks, BRIGHT's, BRIGHT's long
documents), each with its own source; the benchmark of a row is its task's registry group
(:func:`benchmark_of`)."""

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

AVERAGE_TASK = "average"
"""The ``task`` of a row that gives a configuration's published 8-task average (frontier rows,
many of which were published as an average only)."""

AVERAGE_TASKS: dict[str, str] = {"": AVERAGE_TASK, "bright": "bright-average", "bright-long": "bright-long-average"}
"""Benchmark -> the ``task`` of a row giving its published average: R2MED's 8 tasks (``""``),
BRIGHT's 12 (``bright-average``), BRIGHT's 8 long-document tasks (``bright-long-average``)."""

BENCHMARK_GROUPS: dict[str, str] = {"": "all", "bright": "bright-all", "bright-long": "bright-long-all"}
"""Benchmark -> the task group whose tasks its average covers."""


def benchmark_of(task: str) -> str:
    """The benchmark a published row's task belongs to: ``bright`` or ``bright-long`` for BRIGHT's
    tasks (their registry groups), ``""`` for R2MED's and any other."""
    for bench, name in AVERAGE_TASKS.items():
        if task == name:
            return bench
    if not task.startswith("bright-"):
        return ""
    from r2med_agent.data import get_task_spec
    from r2med_agent.errors import ConfigError

    try:
        group = get_task_spec(task).group
    except ConfigError:
        return ""
    return group if group in AVERAGE_TASKS else ""

PAPER_SOURCE = "R2MED paper (arXiv 2505.14558)"
"""The source of a row whose file gives none (the paper's CSV)."""

DEFAULT_FILES: tuple[str, ...] = ("published_results.csv", "frontier_results.csv", "bright_results.csv",
                                   "bright_frontier_results.csv")
"""The packaged files, read in this order (a configuration may be in only one of them)."""


# ----------------------------------------------------------------------------------------------
# Published scores (R2MED paper, packaged CSV)


@dataclass(frozen=True)
class PublishedKey:
    """A configuration as the published CSV spells it (llm and reranker "" when none)."""

    method: str
    llm: str
    retriever: str
    reranker: str = ""


@dataclass(frozen=True)
class PublishedInfo:
    """Where a published configuration's numbers come from (frontier rows; the paper's rows give
    only ``source``)."""

    source: str = PAPER_SOURCE
    system: str = ""
    """The name its source gives it (``GroupRank-32B``)."""
    first_stage: str = ""
    """What it reranked (``DIVER-Retriever-4B top 100``), empty for a first stage."""
    checked: str = ""
    """How the numbers were checked against the source before they shipped."""
    note: str = ""
    """A caveat shown with it (a disputed number)."""


class PublishedResults:
    """Published scores, read from ``r2med_agent/resources/``: ``published_results.csv``, the R2MED
    paper's (kinds ``retrieval``, ``gar``, ``rerank``, ...) on the 8 R2MED tasks, and the
    NanoR2MED card's three profiles (kind ``nano``: retrievers ``nano-bm25``, ``harrier``,
    ``nano-hybrid``) on its 8 splits; ``frontier_results.csv``, the systems published since
    (kind ``frontier``), per task where their source gives tasks and as an ``average`` row.

    Columns: ``kind, method, llm, retriever, reranker, task`` and one column per metric in
    PUBLISHED_METRICS (empty where the source has no number); optionally ``system, first_stage,
    source, checked, note`` (:class:`PublishedInfo`).
    """

    def __init__(self, path: str | Path | None = None, *more: str | Path) -> None:
        paths = [Path(path), *map(Path, more)] if path else [resources_dir() / f for f in DEFAULT_FILES]
        self.path = paths[0]
        self.paths = tuple(paths)
        self._scores: dict[PublishedKey, dict[str, dict[str, float]]] = {}
        self._averages: dict[tuple[PublishedKey, str], dict[str, float]] = {}
        self._info: dict[tuple[PublishedKey, str], PublishedInfo] = {}
        self._kinds: dict[tuple[PublishedKey, str], str] = {}
        self.kinds: dict[PublishedKey, str] = {}
        """The kind of each configuration's first row (``retrieval``, ``frontier``, ``bright`` ...);
        :meth:`kind` gives it per benchmark."""
        seen: dict[tuple[PublishedKey, str], Path] = {}
        for p in paths:
            self._read(p, seen)

    def _read(self, path: Path, seen: dict[tuple[PublishedKey, str], Path]) -> None:
        try:
            f = path.open(encoding="utf-8", newline="")
        except OSError as e:
            raise DataError(f"cannot read published scores: {e.strerror}", path) from None
        with f:
            reader = csv.DictReader(f)
            needed = {"kind", "method", "llm", "retriever", "reranker", "task"}
            if not needed <= set(reader.fieldnames or ()):
                raise DataError(f"published scores need columns {', '.join(sorted(needed))}", path, 1)
            for lineno, rec in enumerate(reader, start=2):
                key = PublishedKey(rec["method"], rec["llm"], rec["retriever"], rec["reranker"])
                bench = benchmark_of(rec["task"])
                if seen.setdefault((key, bench), path) != path:
                    what = f"{key} on {bench or 'R2MED'}'s tasks"
                    raise DataError(f"{what} is also in {seen[(key, bench)].name}", path, lineno)
                self.kinds.setdefault(key, rec["kind"])
                self._kinds.setdefault((key, bench), rec["kind"])
                self._info.setdefault((key, bench), PublishedInfo(
                    source=(rec.get("source") or "").strip() or PAPER_SOURCE,
                    **{k: (rec.get(k) or "").strip() for k in ("system", "first_stage", "checked", "note")}))
                per_task = self._scores.setdefault(key, {})
                is_average = rec["task"] == AVERAGE_TASKS[bench]
                if rec["task"] in per_task or (is_average and (key, bench) in self._averages):
                    raise DataError(f"duplicate row for {key} on task {rec['task']}", path, lineno)
                values = _metric_values(rec, path, lineno)
                if is_average:
                    self._averages[(key, bench)] = values
                else:
                    per_task[rec["task"]] = values

    def keys(self, kind: str | None = None) -> list[PublishedKey]:
        """Every published configuration (of ``kind``: retrieval, gar, rerank, frontier, bright ...,
        on any benchmark), in file order."""
        return [k for k in self._scores if kind is None or any(
            self._kinds.get((k, b)) == kind for b in AVERAGE_TASKS)]

    def kind(self, key: PublishedKey, benchmark: str = "") -> str | None:
        """The kind of ``key``'s rows on ``benchmark`` (None: it has none there)."""
        return self._kinds.get((key, benchmark))

    def benchmarks(self, key: PublishedKey) -> list[str]:
        """The benchmarks ``key`` has published rows on."""
        return [b for b in AVERAGE_TASKS if (key, b) in self._kinds]

    def scores(self, key: PublishedKey, metric: str = "ndcg_at_10") -> dict[str, float]:
        """``{task: score}`` of one configuration (tasks without a number for ``metric`` left out)."""
        out = {}
        for task, values in self._scores.get(key, {}).items():
            if metric in values:
                out[task] = values[metric]
        return out

    def average(self, key: PublishedKey, metric: str = "ndcg_at_10", benchmark: str = "") -> float | None:
        """The published average of ``key`` over ``benchmark``'s tasks (``""``: R2MED's 8,
        ``bright``, ``bright-long``) where its source gives one, else None."""
        return self._averages.get((key, benchmark), {}).get(metric)

    def info(self, key: PublishedKey, benchmark: str | None = None) -> PublishedInfo:
        """Source, system name, first stage, check and caveat of ``key``'s rows on ``benchmark``
        (None: the first benchmark it has)."""
        if benchmark is None:
            benchmark = next(iter(self.benchmarks(key)), "")
        return self._info.get((key, benchmark), PublishedInfo())

    def __contains__(self, key: object) -> bool:
        return key in self._scores


def _metric_values(rec: dict[str, str], path: Path, lineno: int) -> dict[str, float]:
    values: dict[str, float] = {}
    for metric in PUBLISHED_METRICS:
        cell = (rec.get(metric) or "").strip()
        if not cell:
            continue
        try:
            values[metric] = float(cell)
        except ValueError:
            raise DataError(f"{metric} '{cell}' is not a number", path, lineno) from None
    return values


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

