"""Load result trees written by the runner and lay them out as one comparison table.

The runner writes ``<output-dir>/<method>/<llm>/<retriever>[__<reranker>]/<Task>.json`` (R2MED's
result JSON plus ``per_query``, ``config`` and ``stats``). :func:`load_results` turns each such
folder into a :class:`ResultRow`; :func:`build_table` lines the rows up with tasks as columns, the
average over the tasks present (flagged when a row lacks some), optionally the paper's numbers
(:class:`PublishedResults`), significance against a baseline row (:mod:`r2med_agent.stats`) and the
cost columns; :func:`render_markdown`, :func:`render_csv` and :func:`render_rich` print it.
"""

from __future__ import annotations

import csv
import io
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from r2med_agent.errors import ConfigError, DataError
from r2med_agent.io import read_json
from r2med_agent.paths import resources_dir
from r2med_agent.stats import EXACT_MAX_N, OVERALL, TESTS, PairedTest, compare_tasks

logger = logging.getLogger(__name__)

STATS_KEYS: tuple[str, ...] = (
    "generations",
    "cache_hits",
    "prompt_tokens",
    "completion_tokens",
    "llm_time_s",
    "retrieval_time_s",
    "cost_usd",
)
"""Keys of a result JSON's ``stats``; ``compare --cost`` sums them over tasks."""

STATS_HEADERS: dict[str, str] = {
    "generations": "gens",
    "cache_hits": "cache hits",
    "prompt_tokens": "prompt tok",
    "completion_tokens": "compl tok",
    "llm_time_s": "LLM s",
    "retrieval_time_s": "retr s",
    "cost_usd": "cost $",
}

NO_LLM = "none"
"""The ``<llm>`` folder of rows whose method uses no LLM (plain retrieval, reranking)."""

METHOD_ORDER: tuple[str, ...] = ("none", "hyde", "query2doc", "lamer", "search-r1", "search-o1")
"""Rows are sorted by method in this order (others after, alphabetically), then llm, retriever."""

PUBLISHED_METRICS: tuple[str, ...] = ("ndcg_at_10", "ndcg_at_100", "recall_at_100", "map_at_10", "mrr")
"""Metrics the packaged CSV of published scores has."""

PARTIAL_MARK = "†"
BETTER_MARK = "▲"
WORSE_MARK = "▼"
MISSING = "—"


VARIANTS: tuple[str, ...] = ("fuse",)
"""Leaf-folder suffixes that belong to the retriever part (``bm25__fuse``: an agentic run whose
final ranking fuses every search), not to a reranker. ``k<N>`` (a run scored at depth N instead
of 100, ``bm25__k10``) is one too, and so is ``top<N>`` (a reranker run that keeps only the
reranked top N, ``nv__top10__bge-reranker``), and ``n<N>`` (N samples per query, ``bm25__n8``)."""

_DEPTH_VARIANT = re.compile(r"(?:k|top|n)[0-9]+")


def split_leaf(name: str) -> tuple[str, str]:
    """``retriever[__variant][__reranker]`` -> ``(retriever[__variant], reranker)``."""
    parts = name.split("__")
    n = 1
    while n < len(parts) and (parts[n] in VARIANTS or _DEPTH_VARIANT.fullmatch(parts[n])):
        n += 1
    return "__".join(parts[:n]), "__".join(parts[n:])


def r2med_tasks() -> tuple[str, ...]:
    """The eight R2MED tasks in the paper's order (the task registry's ``all`` group)."""
    from r2med_agent.data import task_names

    return tuple(task_names("all"))


def task_order(tasks: Iterable[str]) -> list[str]:
    """The R2MED tasks in the paper's order, then NanoR2MED's, then any others alphabetically."""
    from r2med_agent.data import task_names

    known = [*task_names("all"), *task_names("nano-all")]
    tasks = set(tasks)
    return [t for t in known if t in tasks] + sorted(tasks - set(known))


# ----------------------------------------------------------------------------------------------
# Loading result trees


@dataclass(frozen=True)
class TaskResult:
    """One ``<Task>.json`` of a result folder.

    Attributes:
        task: task name (the file's stem).
        path: the JSON file.
        scores: its ``test`` block, metric -> mean over queries.
        per_query: query id -> metric -> score (empty when the file has none).
        num_queries: ``num_queries`` of the file (None when absent).
        missing_queries: queries the run returned nothing for (scored 0).
        config: the ``config`` block the runner recorded.
        stats: the ``stats`` block (generations, tokens, times, cost), absent keys left out.
    """

    task: str
    path: Path
    scores: dict[str, float]
    per_query: dict[str, dict[str, float]]
    num_queries: int | None
    missing_queries: tuple[str, ...]
    config: dict[str, Any]
    stats: dict[str, float]

    def _sibling(self, suffix: str) -> Path:
        return self.path.with_name(self.task + suffix)

    @property
    def run_path(self) -> Path:
        """``<Task>.run``: the TREC run (top 100)."""
        return self._sibling(".run")

    @property
    def generations_path(self) -> Path:
        """``<Task>.generations.jsonl`` (generation-augmented methods)."""
        return self._sibling(".generations.jsonl")

    @property
    def traces_path(self) -> Path:
        """``<Task>.traces.jsonl`` (agentic methods)."""
        return self._sibling(".traces.jsonl")

    @property
    def rerank_traces_path(self) -> Path:
        """``<Task>.rerank.jsonl`` (LLM rerankers: permutations or judgments per query)."""
        return self._sibling(".rerank.jsonl")


@dataclass
class ResultRow:
    """One configuration (method, llm, retriever, reranker) and its per-task results.

    Attributes:
        method: the ``<method>`` folder name.
        llm: the ``<llm>`` folder name (``none`` without an LLM).
        retriever: the retriever part of the leaf folder.
        reranker: the part after ``__`` in the leaf folder ("" when none).
        directory: the leaf folder.
        source: the results directory (as given) it was found under.
        tasks: task name -> TaskResult.
    """

    method: str
    llm: str
    retriever: str
    reranker: str
    directory: Path
    source: str
    tasks: dict[str, TaskResult] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.method, self.llm, self.retriever, self.reranker)

    @property
    def label(self) -> str:
        """``method/llm/retriever[/reranker]`` (what ``--baseline`` matches)."""
        return "/".join(self.key if self.reranker else self.key[:3])

    def score(self, task: str, metric: str) -> float | None:
        """The task's mean for ``metric``, None when the row lacks the task or the metric."""
        result = self.tasks.get(task)
        if result is None:
            return None
        value = result.scores.get(metric)
        return None if value is None else float(value)

    def per_query(self, task: str, metric: str) -> dict[str, float]:
        """``{query_id: score}`` of one task; DataError when the file has no per-query scores."""
        result = self.tasks[task]
        out: dict[str, float] = {}
        for qid, values in result.per_query.items():
            if metric not in values:
                raise DataError(f"per_query['{qid}'] has no '{metric}'", result.path)
            out[qid] = float(values[metric])
        if not out and (result.num_queries or 0) > 0:
            raise DataError(
                "no per_query scores in this result file; significance tests need them", result.path
            )
        return out

    def totals(self, tasks: Iterable[str] | None = None) -> dict[str, float]:
        """``stats`` summed over ``tasks`` (default: all of the row's tasks); keys no file has are absent."""
        out: dict[str, float] = {}
        for task in self.tasks if tasks is None else tasks:
            result = self.tasks.get(task)
            if result is None:
                continue
            for key, value in result.stats.items():
                out[key] = out.get(key, 0) + value
        return out


def _read_result_json(path: Path) -> dict[str, Any] | None:
    """The result object of ``path``, or None when the JSON is not a task result (no ``test``)."""
    obj = read_json(path, "result file")
    if not isinstance(obj, dict) or "test" not in obj:
        return None
    if not isinstance(obj["test"], dict):
        raise DataError("'test' must be an object of metric -> score", path)
    return obj


def _number(value: Any, what: str, path: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(f"{what} must be a number, got {value!r}", path)
    return float(value)


def _task_result(path: Path, obj: Mapping[str, Any]) -> TaskResult:
    scores = {str(k): _number(v, f"test.{k}", path) for k, v in obj["test"].items()}
    per_query_raw = obj.get("per_query") or {}
    if not isinstance(per_query_raw, Mapping):
        raise DataError("'per_query' must be an object of query id -> metrics", path)
    per_query = {}
    for qid, values in per_query_raw.items():
        if not isinstance(values, Mapping):
            raise DataError(f"per_query['{qid}'] must be an object of metric -> score", path)
        per_query[str(qid)] = {str(k): _number(v, f"per_query.{qid}.{k}", path) for k, v in values.items()}
    stats_raw = obj.get("stats") or {}
    if not isinstance(stats_raw, Mapping):
        raise DataError("'stats' must be an object", path)
    stats = {k: _number(stats_raw[k], f"stats.{k}", path) for k in STATS_KEYS if stats_raw.get(k) is not None}
    num = obj.get("num_queries")
    missing = obj.get("missing_queries") or ()
    if isinstance(missing, int):  # the runner writes the count here and the ids beside it
        missing = obj.get("missing_query_ids") or ()
    config = obj.get("config") or {}
    return TaskResult(
        task=path.stem,
        path=path,
        scores=scores,
        per_query=per_query,
        num_queries=int(num) if isinstance(num, int) else None,
        missing_queries=tuple(str(q) for q in missing),
        config=dict(config) if isinstance(config, Mapping) else {},
        stats=stats,
    )


def _sort_key(row: ResultRow, sources: Sequence[str]) -> tuple[Any, ...]:
    m = METHOD_ORDER.index(row.method) if row.method in METHOD_ORDER else len(METHOD_ORDER)
    return (sources.index(row.source), m, row.method, row.llm, row.retriever, row.reranker)


def load_results(paths: Sequence[str | Path]) -> list[ResultRow]:
    """Find every result folder under ``paths`` and read its task results.

    A path may be the runner's output directory or any folder inside it (down to one leaf
    folder). Every ``*.json`` but ``summary.json`` is read; those with a ``test`` block are task
    results, and their folder's last three path parts name the row
    (``<method>/<llm>/<retriever>[__<reranker>]``). The same folder reached through two paths is
    loaded once.

    Raises:
        DataError: a path does not exist, or a result file is malformed.
    """
    sources = [str(p) for p in paths]
    rows: dict[Path, ResultRow] = {}
    for source in sources:
        root = Path(source)
        if not root.is_dir():
            raise DataError("results directory does not exist", root)
        for path in sorted(root.rglob("*.json")):
            if path.name == "summary.json" or path.name.startswith("."):
                continue
            obj = _read_result_json(path)
            if obj is None:
                logger.debug("%s: not a task result (no 'test' block); skipped", path)
                continue
            leaf = path.parent.resolve()
            row = rows.get(leaf)
            if row is None:
                if len(leaf.parts) < 4:
                    raise DataError(
                        "result file is not inside <method>/<llm>/<retriever>[__<reranker>]/", path
                    )
                retriever, reranker = split_leaf(leaf.name)
                row = rows[leaf] = ResultRow(
                    method=leaf.parent.parent.name,
                    llm=leaf.parent.name,
                    retriever=retriever,
                    reranker=reranker,
                    directory=leaf,
                    source=source,
                )
            result = _task_result(path, obj)
            row.tasks[result.task] = result
    return sorted(rows.values(), key=lambda r: _sort_key(r, sources))


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

RowAliases = Mapping[tuple[str, str, str, str], PublishedKey]
"""``(method, llm, retriever, reranker)`` of a result row -> its name in the published CSV."""


def grid_aliases() -> dict[tuple[str, str, str, str], PublishedKey]:
    """Run names -> published names of every package reproduction grid entry."""
    from r2med_agent.reproduce import load_grids  # the grids name the runs behind each published row

    return {key: e.published_key for grid in load_grids().values() for e in grid.entries for key in e.row_keys()}


def published_key(
    row: ResultRow, published: PublishedResults | None = None, aliases: RowAliases | None = None
) -> PublishedKey | None:
    """The published configuration matching ``row``, or None.

    Rows match by name as the CSV spells them (method ``none`` for plain retrieval; the CSV's llm
    is empty where the row's is ``none``), with the retriever renamed by PUBLISHED_RETRIEVERS
    (``bm25-compat`` -> ``bm25``). A row run under other names matches through ``aliases``
    (default: the package reproduction grids, whose entries may carry a ``published:`` override).
    """
    from r2med_agent.data.released import base_llm

    published = published or published_results()
    # A row made from R2MED's released generations (<llm>@r2med) stands for the same published row.
    llm = "" if row.llm in (NO_LLM, "", "-") else base_llm(row.llm)
    for retriever in dict.fromkeys([row.retriever, PUBLISHED_RETRIEVERS.get(row.retriever, row.retriever)]):
        key = PublishedKey(row.method, llm, retriever, row.reranker)
        if key in published:
            return key
    alias = (grid_aliases() if aliases is None else aliases).get((row.method, llm or NO_LLM, *row.key[2:]))
    return alias if alias is not None and alias in published else None


# ----------------------------------------------------------------------------------------------
# The comparison table


@dataclass(frozen=True)
class TableRow:
    """One line of a :class:`ComparisonTable`.

    Attributes:
        index: position in the table (what ``--baseline`` accepts as a number).
        row: the loaded results.
        values: task -> mean for the table's metric (None: the row lacks that task).
        average: mean of ``values`` over the tasks the row has (None when it has none).
        missing_tasks: table tasks the row lacks; the average is partial when not empty.
        published: task -> the paper's score (only with published=True; tasks without one absent).
        published_average: the paper's mean over exactly the row's tasks (None when any is missing).
        tests: task (and ``"all"``) -> paired test against the baseline (empty for the baseline).
        totals: ``stats`` summed over the table's tasks.
    """

    index: int
    row: ResultRow
    values: dict[str, float | None]
    average: float | None
    missing_tasks: tuple[str, ...]
    published: dict[str, float]
    published_average: float | None
    tests: dict[str, PairedTest]
    totals: dict[str, float]

    @property
    def partial(self) -> bool:
        return bool(self.missing_tasks)


@dataclass(frozen=True)
class ComparisonTable:
    """Rows of results against the tasks; build it with :func:`build_table`."""

    metric: str
    tasks: tuple[str, ...]
    rows: tuple[TableRow, ...]
    show_source: bool = False
    with_published: bool = False
    baseline: int | None = None
    alpha: float = 0.05
    test: str = "permutation"
    n_resamples: int = 10_000
    with_cost: bool = False

    def marker(self, row: TableRow, task: str) -> str:
        """``▲``/``▼`` when ``row`` differs significantly from the baseline on ``task`` (or ``"all"``)."""
        t = row.tests.get(task)
        if t is None or not t.significant(self.alpha):
            return ""
        return BETTER_MARK if t.mean_diff > 0 else WORSE_MARK

    def footnotes(self) -> list[str]:
        """Legend lines: partial averages, significance markers."""
        notes = []
        for r in self.rows:
            if r.partial and r.average is not None:
                have = len(self.tasks) - len(r.missing_tasks)
                notes.append(
                    f"{PARTIAL_MARK} row {r.index} ({r.row.label}): average over {have} of {len(self.tasks)} "
                    f"tasks; missing: {', '.join(r.missing_tasks)}"
                )
        if self.baseline is not None:
            base = self.rows[self.baseline].row.label
            how = (
                f"paired randomisation test over queries: all 2^n sign flips for n <= {EXACT_MAX_N}, "
                f"else {self.n_resamples} random ones"
                if self.test == "permutation"
                else f"paired bootstrap test over queries, {self.n_resamples} resamples"
            )
            notes.append(
                f"{BETTER_MARK}/{WORSE_MARK}: better/worse than the baseline, row {self.baseline} ({base}), "
                f"with p < {self.alpha:g} ({how}). The Avg column's test is stratified by task: its "
                "statistic is the mean over the tasks both rows have of the per-task mean differences "
                "(every task weighs the same, as in the average), with signs flipped per query or "
                "queries resampled within each task; W/T/L counts queries over those tasks"
            )
        if self.with_published:
            notes.append(
                "paper: R2MED's published score (arXiv 2505.14558; on the nano- tasks, the "
                "NanoR2MED card's, hakari-bench/NanoR2MED); its average covers the same "
                f"tasks as ours and is {MISSING} when the paper lacks any of them"
            )
        return notes


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def find_row(rows: Sequence[ResultRow], spec: str) -> int:
    """Index of the row ``spec`` names: a row index, or ``method/llm/retriever[/reranker]``.

    Raises:
        ConfigError: no row or several rows match (the message lists the rows).
    """
    spec = spec.strip()
    listing = "; ".join(f"{i}: {r.label}" for i, r in enumerate(rows))
    if spec.isdigit():
        i = int(spec)
        if i >= len(rows):
            raise ConfigError(f"--baseline {spec}: there are only {len(rows)} rows ({listing})")
        return i
    parts = spec.split("/")
    if len(parts) not in (3, 4):
        raise ConfigError(
            f"--baseline '{spec}': use a row index or method/llm/retriever[/reranker] (rows: {listing})"
        )
    method, llm, retriever = parts[:3]
    reranker = parts[3] if len(parts) == 4 else ""
    llm_names = {NO_LLM, "", "-"} if llm in (NO_LLM, "", "-") else {llm}
    hits = [
        i
        for i, r in enumerate(rows)
        if (r.method, r.retriever, r.reranker) == (method, retriever, reranker) and r.llm in llm_names
    ]
    if not hits:
        raise ConfigError(f"--baseline '{spec}' matches no row; rows: {listing}")
    if len(hits) > 1:
        raise ConfigError(
            f"--baseline '{spec}' matches rows {', '.join(map(str, hits))} (same configuration in "
            f"several results directories); give the row index instead. Rows: {listing}"
        )
    return hits[0]


def build_table(
    rows: Sequence[ResultRow],
    metric: str = "ndcg_at_10",
    *,
    tasks: Sequence[str] | None = None,
    published: bool = False,
    baseline: str | int | None = None,
    alpha: float = 0.05,
    test: str = "permutation",
    n_resamples: int = 10_000,
    seed: int = 0,
    cost: bool = False,
    published_scores: PublishedResults | None = None,
    published_aliases: RowAliases | None = None,
) -> ComparisonTable:
    """Lay ``rows`` out against the tasks.

    Args:
        rows: loaded results (:func:`load_results`), in display order.
        metric: the metric key shown (``ndcg_at_10``, ``recall_at_100``, ...).
        tasks: columns to show (default: every task any row has, R2MED order first).
        published: add the paper's scores (matched by :func:`published_key`).
        baseline: a row index or ``method/llm/retriever[/reranker]``; every other row is tested
            against it, per task and over the tasks (stratified: each task weighs the same).
        alpha: significance level of the markers.
        test: ``permutation`` or ``bootstrap``.
        n_resamples: Monte Carlo permutations / bootstrap resamples.
        seed: seed of the tests.
        cost: sum the result files' ``stats`` into cost columns.
        published_scores: another published CSV (default: the packaged one).
        published_aliases: row names -> published names (default: the package grids').

    Raises:
        ConfigError: unknown metric (none of the files has it), bad baseline, bad test name.
    """
    if not rows:
        raise ConfigError("no results to compare: no <Task>.json found under the given directories")
    if test not in TESTS:
        raise ConfigError(f"unknown significance test '{test}'; allowed: {', '.join(TESTS)}")
    if not 0 < alpha < 1:
        raise ConfigError(f"--alpha must be between 0 and 1, got {alpha}")
    from r2med_agent.evaluation import metric_key

    metric = metric_key(metric)  # ndcg@10, NDCG@10, ndcg_cut_10 -> ndcg_at_10
    known = {m for r in rows for t in r.tasks.values() for m in t.scores}
    if metric not in known:
        raise ConfigError(f"no result file has metric '{metric}'; available: {', '.join(sorted(known))}")
    all_tasks = task_order({t for r in rows for t in r.tasks})
    if tasks is None:
        columns = tuple(all_tasks)
    else:
        unknown = [t for t in tasks if t not in all_tasks]
        if unknown:
            raise ConfigError(
                f"no results for task(s) {', '.join(unknown)}; tasks found: {', '.join(all_tasks)}"
            )
        columns = tuple(tasks)
    base_index = None if baseline is None else (
        baseline if isinstance(baseline, int) else find_row(rows, str(baseline))
    )
    if base_index is not None and not 0 <= base_index < len(rows):
        raise ConfigError(f"baseline row {base_index} out of range (0..{len(rows) - 1})")
    pub = (published_scores or published_results()) if published else None
    aliases = published_aliases if published_aliases is not None else (grid_aliases() if published else {})
    if pub is not None and metric not in PUBLISHED_METRICS:
        logger.warning("the paper reports no %s; the published columns stay empty", metric)

    def per_query_table(r: ResultRow) -> dict[str, dict[str, float]]:
        return {t: r.per_query(t, metric) for t in columns if r.score(t, metric) is not None}

    base_pq = per_query_table(rows[base_index]) if base_index is not None else None
    out = []
    for i, r in enumerate(rows):
        values = {t: r.score(t, metric) for t in columns}
        present = [v for v in values.values() if v is not None]
        missing = tuple(t for t, v in values.items() if v is None)
        pub_values: dict[str, float] = {}
        pub_avg = None
        if pub is not None:
            key = published_key(r, pub, aliases)
            if key is not None:
                scores = pub.scores(key, metric)
                pub_values = {t: scores[t] for t in columns if t in scores}
                have = [t for t, v in values.items() if v is not None]
                if have and all(t in pub_values for t in have):
                    pub_avg = _mean(pub_values[t] for t in have)
        tests: dict[str, PairedTest] = {}
        if base_pq is not None and i != base_index:
            tests = compare_tasks(base_pq, per_query_table(r), test=test, n_resamples=n_resamples, seed=seed)
        out.append(
            TableRow(
                index=i,
                row=r,
                values=values,
                average=_mean(present),
                missing_tasks=missing,
                published=pub_values,
                published_average=pub_avg,
                tests=tests,
                totals=r.totals(columns) if cost else {},
            )
        )
    return ComparisonTable(
        metric=metric,
        tasks=columns,
        rows=tuple(out),
        show_source=len({r.source for r in rows}) > 1,
        with_published=published,
        baseline=base_index,
        alpha=alpha,
        test=test,
        n_resamples=n_resamples,
        with_cost=cost,
    )


# ----------------------------------------------------------------------------------------------
# Rendering


def _fmt(value: float | None, digits: int = 4) -> str:
    return MISSING if value is None else f"{value:.{digits}f}"


def _fmt_diff(ours: float | None, paper: float | None) -> str:
    return MISSING if ours is None or paper is None else f"{ours - paper:+.4f}"


def _fmt_stat(key: str, value: float | None) -> str:
    if value is None:
        return MISSING
    if key == "cost_usd":
        return f"{value:.4f}"
    if key.endswith("_s"):
        return f"{value:.2f}"
    return f"{int(round(value)):,}"


def _fmt_p(p: float | None) -> str:
    if p is None:
        return MISSING
    return "<0.0001" if p < 1e-4 else f"{p:.4f}"


def key_headers(table: ComparisonTable) -> list[str]:
    return ["#", "method", "llm", "retriever", "reranker"] + (["results"] if table.show_source else [])


def key_cells(table: ComparisonTable, r: TableRow) -> list[str]:
    idx = f"{r.index} (base)" if r.index == table.baseline else str(r.index)
    cells = [idx, r.row.method, r.row.llm, r.row.retriever, r.row.reranker or MISSING]
    return cells + ([r.row.source] if table.show_source else [])


def text_grid(table: ComparisonTable) -> tuple[list[str], list[list[str]]]:
    """Headers and cell strings shared by the Markdown and HTML renderings."""
    headers = key_headers(table)
    for t in [*table.tasks, "Avg"]:
        headers.append(t)
        if table.with_published:
            headers += [f"{t} paper", f"{t} Δ"]
    if table.baseline is not None:
        headers += ["W/T/L", "p"]
    if table.with_cost:
        headers += [STATS_HEADERS[k] for k in STATS_KEYS]
    body = []
    for r in table.rows:
        cells = key_cells(table, r)
        for t in table.tasks:
            cells.append(_fmt(r.values[t]) + table.marker(r, t))
            if table.with_published:
                cells += [_fmt(r.published.get(t)), _fmt_diff(r.values[t], r.published.get(t))]
        avg = _fmt(r.average) + (PARTIAL_MARK if r.partial and r.average is not None else "")
        cells.append(avg + table.marker(r, OVERALL))
        if table.with_published:
            cells += [_fmt(r.published_average), _fmt_diff(r.average, r.published_average)]
        if table.baseline is not None:
            t = r.tests.get(OVERALL)
            cells += [f"{t.wins}/{t.ties}/{t.losses}" if t else MISSING, _fmt_p(t.p_value if t else None)]
        if table.with_cost:
            cells += [_fmt_stat(k, r.totals.get(k)) for k in STATS_KEYS]
        body.append(cells)
    return headers, body


def _fmt_test(t: PairedTest | None) -> str:
    """``Δ +0.0500 [+0.0100, +0.0900], p 0.0312, W/T/L 4/1/1`` (the interval with bootstrap only)."""
    if t is None:
        return MISSING
    ci = f" [{t.ci_low:+.4f}, {t.ci_high:+.4f}]" if t.ci_low is not None and t.ci_high is not None else ""
    return f"Δ {t.mean_diff:+.4f}{ci}, p {_fmt_p(t.p_value)}, W/T/L {t.wins}/{t.ties}/{t.losses}"


def significance_grid(table: ComparisonTable) -> tuple[list[str], list[list[str]]]:
    """Per row and task (and Avg) the test against the baseline: difference of means (with the
    bootstrap's 95% interval), p-value and win/tie/loss counts. Empty without a baseline; no Avg
    column with one task (it would repeat the task's)."""
    if table.baseline is None:
        return [], []
    with_avg = len(table.tasks) > 1
    headers = ["#", "configuration", *table.tasks, *(["Avg"] if with_avg else [])]
    body = []
    for r in table.rows:
        if r.index == table.baseline:
            continue
        cells = [str(r.index), r.row.label]
        cells += [_fmt_test(r.tests.get(t)) for t in table.tasks]
        if with_avg:
            cells.append(_fmt_test(r.tests.get(OVERALL)))
        body.append(cells)
    return headers, body


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(table: ComparisonTable) -> str:
    """A GitHub-flavoured Markdown table, then its footnotes."""
    headers, body = text_grid(table)
    lines = [f"Metric: {table.metric}", ""]
    lines.append("| " + " | ".join(map(_md_escape, headers)) + " |")
    n_keys = len(key_headers(table))
    lines.append("|" + "|".join("---" if i < n_keys else "---:" for i in range(len(headers))) + "|")
    for cells in body:
        lines.append("| " + " | ".join(map(_md_escape, cells)) + " |")
    sig_headers, sig_body = significance_grid(table)
    if sig_body:
        lines += ["", f"Against the baseline, row {table.baseline} ({table.rows[table.baseline].row.label}):", ""]
        lines.append("| " + " | ".join(map(_md_escape, sig_headers)) + " |")
        lines.append("|---|---|" + "|".join("---:" for _ in sig_headers[2:]) + "|")
        for cells in sig_body:
            lines.append("| " + " | ".join(map(_md_escape, cells)) + " |")
    notes = table.footnotes()
    if notes:
        lines.append("")
        lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _csv_num(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def render_csv(table: ComparisonTable) -> str:
    """CSV with full-precision numbers (empty cells where there is no value).

    Columns: index, method, llm, retriever, reranker, [results], per task ``<task>`` (and
    ``<task>_published``, ``<task>_diff``; against a baseline ``<task>_p``, ``<task>_wins``,
    ``<task>_ties``, ``<task>_losses`` and, with the bootstrap test, ``<task>_ci_low`` and
    ``<task>_ci_high``: the 95% interval of the difference of means), ``avg``, ``avg_tasks``
    (how many tasks the average covers), ``avg_missing`` (``;``-joined), the published/diff
    columns of the average, ``avg_p``, ``wins``, ``ties``, ``losses`` (queries over all tested
    tasks), ``avg_ci_low``/``avg_ci_high`` (bootstrap), and the summed stats.
    """
    pub, base = table.with_published, table.baseline is not None
    ci = base and table.test == "bootstrap"
    headers = ["index", "method", "llm", "retriever", "reranker"] + (["results"] if table.show_source else [])
    for t in table.tasks:
        headers.append(t)
        headers += [f"{t}_published", f"{t}_diff"] if pub else []
        headers += [f"{t}_p", f"{t}_wins", f"{t}_ties", f"{t}_losses"] if base else []
        headers += [f"{t}_ci_low", f"{t}_ci_high"] if ci else []
    headers += ["avg", "avg_tasks", "avg_missing"]
    headers += ["avg_published", "avg_diff"] if pub else []
    headers += ["avg_p", "wins", "ties", "losses"] if base else []
    headers += ["avg_ci_low", "avg_ci_high"] if ci else []
    headers += list(STATS_KEYS) if table.with_cost else []
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(headers)

    def diff(a: float | None, b: float | None) -> str:
        return "" if a is None or b is None else repr(a - b)

    def test_cells(test: PairedTest | None) -> list[str]:
        """p, wins, ties, losses (and the interval with the bootstrap), empty without a test."""
        if test is None:
            return [""] * (6 if ci else 4)
        cells = [_csv_num(test.p_value), str(test.wins), str(test.ties), str(test.losses)]
        return cells + ([_csv_num(test.ci_low), _csv_num(test.ci_high)] if ci else [])

    for r in table.rows:
        rec = [str(r.index), r.row.method, r.row.llm, r.row.retriever, r.row.reranker]
        rec += [r.row.source] if table.show_source else []
        for t in table.tasks:
            rec.append(_csv_num(r.values[t]))
            if pub:
                rec += [_csv_num(r.published.get(t)), diff(r.values[t], r.published.get(t))]
            if base:
                rec += test_cells(r.tests.get(t))
        rec += [_csv_num(r.average), str(len(table.tasks) - len(r.missing_tasks)), ";".join(r.missing_tasks)]
        if pub:
            rec += [_csv_num(r.published_average), diff(r.average, r.published_average)]
        if base:
            rec += test_cells(r.tests.get(OVERALL))
        if table.with_cost:
            rec += [_csv_num(r.totals.get(k)) for k in STATS_KEYS]
        w.writerow(rec)
    return buf.getvalue()


def render_rich(table: ComparisonTable):  # -> rich.table.Table
    """A rich terminal table: one configuration column (``method/llm/retriever[/reranker]``);
    with published scores each task cell shows ours over the paper's and the difference.
    The footnotes are not part of it (:func:`print_rich` prints both)."""
    from rich.table import Table
    from rich.text import Text

    title = f"{table.metric}" + (f" (baseline: row {table.baseline})" if table.baseline is not None else "")
    out = Table(title=title, show_lines=table.with_published)
    out.add_column("#", no_wrap=True)
    out.add_column("configuration", overflow="fold", min_width=12)
    if table.show_source:
        out.add_column("results", overflow="fold")
    sub = "\npaper (Δ)" if table.with_published else ""
    for t in [*table.tasks, "Avg"]:
        out.add_column(t + sub, justify="right", min_width=8 if table.with_published else 7)
    if table.baseline is not None:
        out.add_column("W/T/L", justify="right")
        out.add_column("p", justify="right", min_width=6)
    if table.with_cost:
        for k in STATS_KEYS:
            out.add_column(STATS_HEADERS[k], justify="right")

    def cell(ours: float | None, mark: str, paper: float | None, partial: bool = False) -> Text:
        text = Text(_fmt(ours) + (PARTIAL_MARK if partial else ""))
        if mark:
            text.append(mark, style="green" if mark == BETTER_MARK else "red")
        if table.with_published:
            text.append(f"\n{_fmt(paper)}\n({_fmt_diff(ours, paper)})", style="dim")
        return text

    for r in table.rows:
        cells: list[Any] = [f"{r.index}*" if r.index == table.baseline else str(r.index), r.row.label]
        if table.show_source:
            cells.append(r.row.source)
        for t in table.tasks:
            cells.append(cell(r.values[t], table.marker(r, t), r.published.get(t)))
        partial = r.partial and r.average is not None
        cells.append(cell(r.average, table.marker(r, OVERALL), r.published_average, partial))
        if table.baseline is not None:
            t = r.tests.get(OVERALL)
            cells += [f"{t.wins}/{t.ties}/{t.losses}" if t else MISSING, _fmt_p(t.p_value if t else None)]
        if table.with_cost:
            cells += [_fmt_stat(k, r.totals.get(k)) for k in STATS_KEYS]
        out.add_row(*cells, style="bold" if r.index == table.baseline else None)
    return out


def print_rich(table: ComparisonTable, console=None) -> None:
    """Print the rich table and its footnotes; a table wider than the console gets a hint."""
    from rich.console import Console

    console = console or Console()
    rich_table = render_rich(table)
    if console.measure(rich_table).minimum > console.width:
        logger.warning(
            "the table is wider than the terminal (%d columns); use --format md or --out FILE", console.width
        )
    console.print(rich_table)
    for note in table.footnotes():
        console.print(note, style="dim", highlight=False, markup=False)


FORMATS: tuple[str, ...] = ("rich", "md", "csv")


def render(table: ComparisonTable, fmt: str) -> str:
    """``md`` or ``csv`` text, or the rich table as plain text (``rich``)."""
    if fmt == "md":
        return render_markdown(table)
    if fmt == "csv":
        return render_csv(table)
    if fmt == "rich":
        from rich.console import Console

        console = Console(file=io.StringIO(), width=240, color_system=None)
        print_rich(table, console)
        return console.file.getvalue()  # type: ignore[attr-defined]
    raise ConfigError(f"unknown format '{fmt}'; allowed: {', '.join(FORMATS)}")
