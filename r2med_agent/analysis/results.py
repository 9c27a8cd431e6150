"""Result rows: every task result of a results tree, grouped by the run spec it records."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from r2med_agent.errors import DataError
from r2med_agent.experiment.spec import RunSpec

logger = logging.getLogger(__name__)

STATS_KEYS: tuple[str, ...] = (
    "generations",
    "cache_hits",
    "prompt_tokens",
    "completion_tokens",
    "llm_time_s",
    "retrieval_time_s",
    "cost_usd",
    "empty_generations",
    "identical_ids_removed",
)
"""Keys of a result JSON's ``stats``; ``compare --cost`` sums them over tasks (empty generations:
blank generated texts, which R2MED used as they are; identical ids: hits left out because the
document's id was the query's)."""

STATS_HEADERS: dict[str, str] = {
    "generations": "gens",
    "cache_hits": "cache hits",
    "prompt_tokens": "prompt tok",
    "completion_tokens": "compl tok",
    "llm_time_s": "LLM s",
    "retrieval_time_s": "retr s",
    "cost_usd": "cost $",
    "empty_generations": "empty gens",
    "identical_ids_removed": "self hits",
}

NO_LLM = "none"
"""The ``<llm>`` folder of rows whose method uses no LLM (plain retrieval, reranking)."""

def method_order() -> tuple[str, ...]:
    """Rows are sorted by method in the method registry's order (others after, alphabetically),
    then llm, retriever."""
    from r2med_agent.methods import METHODS

    return tuple(METHODS)

VARIANTS: tuple[str, ...] = ("fuse",)
"""Leaf-folder suffixes that earlier versions put after the retriever (``bm25__fuse``), read only
for result files that record no run config; ``k<N>``, ``top<N>`` and ``n<N>`` are some too."""

_DEPTH_VARIANT = re.compile(r"(?:k|top|n)[0-9]+")


def split_leaf(name: str) -> tuple[str, str]:
    """``retriever[__variant][__reranker]`` -> ``(retriever[__variant], reranker)``: how a folder
    of an early version (its files record no run config) is named back. Every newer result is
    named by the run spec its file records (:func:`load_results`)."""
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
    """The R2MED tasks in the paper's order, then NanoR2MED's, then BRIGHT's (its own order, then its
    long-document tasks), then any others alphabetically."""
    from r2med_agent.data import task_names

    known = [*task_names("all"), *task_names("nano-all"), *task_names("bright-all"), *task_names("bright-long-all")]
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
        files: where each of the task's files is (suffix -> path): the set the JSON belongs to,
            read through a set still being moved into place (``experiment.store.task_set_files``);
            empty: beside the JSON.
    """

    task: str
    path: Path
    scores: dict[str, float]
    per_query: dict[str, dict[str, float]]
    num_queries: int | None
    missing_queries: tuple[str, ...]
    config: dict[str, Any]
    stats: dict[str, float]
    files: Mapping[str, Path] = field(default_factory=dict)

    def _sibling(self, suffix: str) -> Path:
        return self.files.get(suffix) or self.path.with_name(self.task + suffix)

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
    spec: RunSpec | None = None
    """The run spec every task file of the row records (None: files that record no config)."""

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.method, self.llm, self.retriever, self.reranker)

    @property
    def settings(self) -> dict[str, Any]:
        """The row's settings beyond method, LLM, retriever and reranker that differ from their
        defaults (temperature, depth, precision, ...): what tells two rows of one configuration apart."""
        return self.spec.settings() if self.spec is not None else {}

    @property
    def settings_label(self) -> str:
        """:attr:`settings` as ``name=value`` pairs ("" when every other setting is a default)."""
        return self.spec.settings_label if self.spec is not None else ""

    @property
    def base_label(self) -> str:
        """``method/llm/retriever[/reranker]``."""
        return "/".join(self.key if self.reranker else self.key[:3])

    @property
    def label(self) -> str:
        """``method/llm/retriever[/reranker]``, then the row's other non-default settings in
        brackets (``hyde/smollm2/bm25 [sampling.temperature=0.9]``); what ``--baseline`` matches."""
        return self.spec.label if self.spec is not None else self.base_label

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


def _number(value: Any, what: str, path: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(f"{what} must be a number, got {value!r}", path)
    return float(value)


def _task_result(path: Path, obj: Mapping[str, Any], files: Mapping[str, Path] | None = None) -> TaskResult:
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
        files=dict(files or {}),
    )


def _sort_key(row: ResultRow, sources: Sequence[str]) -> tuple[Any, ...]:
    order = method_order()
    m = order.index(row.method) if row.method in order else len(order)
    return (sources.index(row.source), m, row.method, row.llm, row.retriever, row.reranker, row.label)


def load_results(paths: Sequence[str | Path], *, require_scored: bool = False) -> list[ResultRow]:
    """Find every task result under ``paths`` and group them into rows, one per run spec.

    A path may be the runner's output directory or any folder inside it (down to one result
    folder). Every ``*.json`` but ``summary.json`` and ``spec.json`` is read; those with a ``test``
    block are task results. A row is named by the run spec the files record (so folders written by
    earlier versions, whose names held only some settings, are named right); the same spec found in
    two folders of one path (an earlier version's folder and its own) is one row, each task's newest
    result kept. Files that record no config are named by their folder
    (``<method>/<llm>/<retriever>[__<reranker>]``).

    Results of unscored runs (``run --no-eval``, tasks without qrels) are left out, with a log
    line naming them; with ``require_scored`` a tree that holds no scored result is an error
    saying what it holds.

    Raises:
        DataError: a path does not exist, or a result file is malformed.
        ConfigError: ``require_scored`` and no scored result.
    """
    from r2med_agent.experiment.store import ResultStore

    sources = [str(p) for p in paths]
    rows: dict[tuple[str, str], ResultRow] = {}
    made_at: dict[Path, str] = {}  # each kept task file's evaluated_at
    unscored: set[Path] = set()
    for source in sources:
        for found in ResultStore(source).results():
            path = found.path.resolve()
            if path in made_at:
                continue  # the same folder reached through two paths
            if found.record.get("not_scored"):  # `run --no-eval`, or a task without qrels
                unscored.add(path)
                continue
            made_at[path] = str(found.record.get("evaluated_at") or "")
            key = (source, found.spec.key()) if found.spec is not None else (source, str(found.folder.resolve()))
            row = rows.get(key)
            if row is None:
                row = rows[key] = _new_row(found, source)
            result = _task_result(found.path, found.record, found.files)
            old = row.tasks.get(result.task)
            if old is None or made_at[path] >= made_at[old.path.resolve()]:
                row.tasks[result.task] = result
                if found.spec is not None and found.folder.name == found.spec.leaf:
                    row.directory = found.folder.resolve()
    names = ", ".join(sorted(str(p.parent.name + "/" + p.name) for p in unscored)[:5])
    if require_scored and not rows:
        from r2med_agent.errors import ConfigError

        if unscored:
            raise ConfigError(
                f"nothing to compare: the {len(unscored)} result file(s) under {', '.join(sources)} hold no scores "
                f"(their runs were made with --no-eval or on tasks without qrels: {names}); their rankings are "
                "in the <Task>.run beside each, which `r2med-agent evaluate --run FILE --qrels QRELS` scores"
            )
        raise ConfigError(f"nothing to compare: no result file (<Task>.json) under {', '.join(sources)}")
    if unscored:
        logger.info("left out %d result file(s) with no scores (run --no-eval, or tasks without qrels): %s",
                    len(unscored), names)
    return sorted(rows.values(), key=lambda r: _sort_key(r, sources))


def _new_row(found: Any, source: str) -> ResultRow:
    leaf = found.folder.resolve()
    spec = found.spec
    if spec is not None:
        return ResultRow(method=spec.method, llm=spec.llm_label, retriever=spec.retriever_name,
                         reranker=spec.reranker or "", directory=leaf, source=source, spec=spec)
    if len(leaf.parts) < 4:
        raise DataError("result file is not inside <method>/<llm>/<retriever>[__<reranker>]/", found.path)
    retriever, reranker = split_leaf(leaf.name)
    return ResultRow(method=leaf.parent.parent.name, llm=leaf.parent.name, retriever=retriever,
                     reranker=reranker, directory=leaf, source=source)


