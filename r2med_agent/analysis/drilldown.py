"""The report's per-query drill-down: for each row, task and query, the query text, the generated
text or agent trace, the top documents of the run with the relevant ones marked, and per-query
metrics; texts come from the loaded tasks, else from what the result files hold."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from r2med_agent.analysis.results import TaskResult
from r2med_agent.analysis.tables import ComparisonTable
from r2med_agent.evaluation import read_trec_run, trec_sorted
from r2med_agent.io import iter_jsonl
from r2med_agent.types import Task

DRILL_METRICS: tuple[str, ...] = ("ndcg_at_10", "ndcg_at_100", "recall_at_100", "map_at_10", "mrr")
"""Per-query metrics shown in the drill-down (beside the table's own metric)."""

TOP_K = 10


def _cut(text: Any, limit: int) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= limit else text[:limit] + f" … [{len(text) - limit} more characters]"


def _by_query(path: Path, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return out
    for _, rec in iter_jsonl(path):
        for k in keys:
            if k in rec:
                out[str(rec[k])] = rec
                break
    return out


def _trace_view(rec: Mapping[str, Any], limit: int) -> dict[str, Any]:
    steps = []
    for s in rec.get("steps") or []:
        if not isinstance(s, Mapping):
            continue
        steps.append(
            {
                "generated": _cut((s.get("generated") or "").strip(), limit),
                "search_query": s.get("search_query"),
                "doc_ids": [str(d) for d in s.get("doc_ids") or []],
                "inserted": _cut(s.get("inserted"), limit),
            }
        )
    return {
        "method": rec.get("method", ""),
        "final": _cut(rec.get("final"), limit),
        "finish_reason": rec.get("finish_reason", ""),
        "steps": steps,
    }


def drilldown_data(
    table: ComparisonTable,
    tasks: Mapping[str, Task] | None = None,
    *,
    top_k: int = TOP_K,
    doc_chars: int = 700,
    text_chars: int = 20_000,
) -> dict[str, Any]:
    """The JSON the report's drill-down reads.

    Shape: ``{"metric", "rows": [{"index", "label", "tasks"}], "tasks": {task: {"queries":
    {qid: text}, "order": [qid], "qrels": {qid: {doc: grade}}, "qrels_source", "docs": {doc:
    text}}}, "results": {row index: {task: {qid: {"metrics", "top": [[doc, score]],
    "relevant_ranks": {doc: rank or null}, "generation", "trace"}}}}}``.
    """
    tasks = tasks or {}
    out_tasks = {t: _task_view(tasks.get(t), text_chars) for t in table.tasks}
    # Read every row's files first: without task data, the generations files supply the query
    # texts and positives that every row's drill-down needs.
    loaded = _read_row_files(table, out_tasks, text_chars)
    keep = list(dict.fromkeys([table.metric, *DRILL_METRICS]))
    results: dict[str, dict[str, Any]] = {}
    shown_docs: dict[str, set[str]] = {t: set() for t in table.tasks}
    for (index, t), files in loaded.items():
        per_task = _query_entries(files, out_tasks[t]["qrels"], keep, top_k, text_chars)
        for entry in per_task.values():
            shown_docs[t].update(d for d, _ in entry["top"])
        results.setdefault(str(index), {})[t] = per_task
    _add_doc_texts(out_tasks, tasks, shown_docs, doc_chars)
    _default_orders(out_tasks, results)
    return {
        "metric": table.metric,
        "rows": [
            {"index": r.index, "label": r.row.label, "tasks": [t for t in table.tasks if t in r.row.tasks]}
            for r in table.rows
        ],
        "tasks": out_tasks,
        "results": results,
    }


def _task_view(task: Task | None, text_chars: int) -> dict[str, Any]:
    """A task's part of the drill-down data, from its loaded data (empty without it): query texts,
    query order and qrels; its document texts come later, once the shown documents are known."""
    return {
        "queries": {q.query_id: _cut(q.text, text_chars) for q in task.queries} if task else {},
        "order": [q.query_id for q in task.queries] if task else [],
        "qrels": (
            {q: {d: int(g) for d, g in docs.items() if g > 0} for q, docs in task.qrels.items()}
            if task
            else {}
        ),
        "qrels_source": "qrels" if task else "",
        "docs": {},
    }


@dataclass(frozen=True)
class _RowFiles:
    """One row's result for one task and its files: the run, and the generations, traces and
    rerank traces by query id (empty where a file is missing)."""

    result: TaskResult
    run: dict[str, dict[str, float]]
    gens: dict[str, dict[str, Any]]
    traces: dict[str, dict[str, Any]]
    reranks: dict[str, dict[str, Any]]


def _read_row_files(
    table: ComparisonTable, out_tasks: dict[str, dict[str, Any]], text_chars: int
) -> dict[tuple[int, str], _RowFiles]:
    """Every row's files, by (row index, task); query texts and positives that only the
    generations files carry are added to ``out_tasks``."""
    loaded: dict[tuple[int, str], _RowFiles] = {}
    for r in table.rows:
        for t in table.tasks:
            result = r.row.tasks.get(t)
            if result is None:
                continue
            files = _RowFiles(
                result,
                read_trec_run(result.run_path) if result.run_path.exists() else {},
                _by_query(result.generations_path, ("id", "query_id")),
                _by_query(result.traces_path, ("query_id", "id")),
                _by_query(result.rerank_traces_path, ("query_id", "id")),
            )
            loaded[(r.index, t)] = files
            _add_generation_queries(out_tasks[t], files.gens, text_chars)
    return loaded


def _add_generation_queries(
    info: dict[str, Any], gens: Mapping[str, Mapping[str, Any]], text_chars: int
) -> None:
    """Query texts the task view lacks, and (without task qrels) the positives, from a generations
    file's rows (``text``, ``doc_id``)."""
    for qid, g in gens.items():
        if qid not in info["queries"] and g.get("text"):
            info["queries"][qid] = _cut(g["text"], text_chars)
        if info["qrels_source"] != "qrels" and isinstance(g.get("doc_id"), list):
            info["qrels"][qid] = {str(d): 1 for d in g["doc_id"]}
            info["qrels_source"] = "generations"


def _query_entries(
    files: _RowFiles, qrels: Mapping[str, Mapping[str, int]], keep: Sequence[str], top_k: int, text_chars: int
) -> dict[str, dict[str, Any]]:
    """One row's drill-down entries for one task, for every query any of its files names."""
    qids = dict.fromkeys([*files.result.per_query, *files.run, *files.gens, *files.traces])
    return {qid: _query_entry(files, qid, qrels.get(qid, {}), keep, top_k, text_chars) for qid in qids}


def _query_entry(
    files: _RowFiles, qid: str, relevant: Mapping[str, int], keep: Sequence[str], top_k: int, text_chars: int
) -> dict[str, Any]:
    """One query's entry: its metrics, top documents, the ranks of its relevant documents, and its
    generation, trace and rerank trace where the row has them."""
    ranked = trec_sorted(files.run.get(qid, {}))
    rank_of = {d: i for i, (d, _) in enumerate(ranked, start=1)}
    metrics = files.result.per_query.get(qid, {})
    entry: dict[str, Any] = {
        "metrics": {m: metrics[m] for m in keep if m in metrics},
        "top": [[d, s] for d, s in ranked[:top_k]],
        "relevant_ranks": {d: rank_of.get(d) for d in relevant},
        "run_length": len(ranked),
        "generation": None,
        "trace": None,
        "rerank": None,
    }
    if qid in files.gens:
        g = files.gens[qid]
        entry["generation"] = {
            "text": _cut(g.get("final", g.get("hy_doc", "")), text_chars),
            "reasoning": _cut(g.get("reasoning", ""), text_chars),
            "finish_reason": g.get("finish_reason", ""),
        }
    if qid in files.traces:
        entry["trace"] = _trace_view(files.traces[qid], text_chars)
    if qid in files.reranks:
        entry["rerank"] = _trace_view(files.reranks[qid], text_chars)
    return entry


def _add_doc_texts(
    out_tasks: dict[str, dict[str, Any]], tasks: Mapping[str, Task], shown_docs: Mapping[str, set[str]],
    doc_chars: int,
) -> None:
    """The texts of the documents any row shows, for the tasks whose data is loaded."""
    for t, task in tasks.items():
        if t not in out_tasks:
            continue
        texts = {d.doc_id: d for d in task.corpus if d.doc_id in shown_docs[t]}
        out_tasks[t]["docs"] = {
            d: _cut(doc.full_text, doc_chars) for d, doc in texts.items()
        }


def _default_orders(out_tasks: dict[str, dict[str, Any]], results: Mapping[str, Mapping[str, Any]]) -> None:
    """Without task data, a task's query order is the order the rows' results name them in."""
    for t, info in out_tasks.items():
        if not info["order"]:
            seen = list(dict.fromkeys(q for per_row in results.values() for q in per_row.get(t, {})))
            info["order"] = seen
