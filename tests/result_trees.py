"""Build result trees in the runner's layout for the compare/report/reproduce tests.

Scores come from the real evaluation (pytrec_eval) of hand-written runs, and the files are written
the way r2med_agent.api writes them: ``<root>/<method>/<llm>/<retriever>[__<reranker>]/<Task>.json``
(R2MED's keys plus per_query, config and stats), ``<Task>.run`` and, when given,
``<Task>.generations.jsonl`` / ``<Task>.traces.jsonl``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from r2med_agent.evaluation import DEFAULT_METRICS, evaluate, write_trec_run
from r2med_agent.types import Doc, Qrels, Query, Run, Task

CORPUS = {f"d{i}": f"Document {i} text about topic {i % 4}." for i in range(1, 16)}
QUERIES = {
    "q1": "Why do insects fly towards light?",
    "q2": "Which enzyme digests lactose?",
    "q3": "What causes a fever after a vaccine?",
    "q4": "How are prions transmitted?",
}
QRELS: Qrels = {"q1": {"d1": 1, "d5": 1}, "q2": {"d2": 1}, "q3": {"d3": 2, "d7": 1}, "q4": {"d4": 1}}


def read_trec_run(path: Path) -> dict[str, dict[str, float]]:
    """A written TREC run file read independently of the package: query id -> {doc id: score}."""
    run: dict[str, dict[str, float]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        qid, _, doc, _, score, _ = line.split()
        run.setdefault(qid, {})[doc] = float(score)
    return run


def make_task(name: str = "sample") -> Task:
    """A small in-memory Task over CORPUS/QUERIES/QRELS."""
    return Task(
        name=name,
        family="qa",
        domain="biology",
        queries=tuple(Query(q, t) for q, t in QUERIES.items()),
        corpus=tuple(Doc(d, t) for d, t in CORPUS.items()),
        qrels=QRELS,
        source="inline test data",
        fingerprint="test",
    )


def write_r2med_task(folder: Path) -> None:
    """CORPUS/QUERIES/QRELS as a task folder in R2MED layout."""
    folder.mkdir(parents=True)
    (folder / "query.jsonl").write_text("".join(json.dumps({"id": q, "text": t}) + "\n" for q, t in QUERIES.items()))
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"id": d, "text": t}) + "\n" for d, t in CORPUS.items()))
    (folder / "qrels.jsonl").write_text(
        "".join(json.dumps({"q_id": q, "p_id": d, "score": g}) + "\n" for q, docs in QRELS.items() for d, g in docs.items())
    )


def ranking(*doc_ids: str) -> dict[str, float]:
    """A ranking with descending scores in the given order."""
    return {d: float(len(doc_ids) - i) for i, d in enumerate(doc_ids)}


def write_result(
    root: Path,
    method: str,
    llm: str,
    retriever: str,
    task: str,
    run: Run,
    qrels: Qrels = QRELS,
    *,
    reranker: str = "",
    stats: Mapping[str, Any] | None = None,
    generations: Sequence[Mapping[str, Any]] | None = None,
    traces: Sequence[Mapping[str, Any]] | None = None,
    config: Mapping[str, Any] | None = None,
    source: str | None = None,
    fingerprint: str | None = None,
) -> Path:
    """Evaluate ``run`` against ``qrels`` and write the task's files; returns the leaf folder.

    ``config`` overrides fields of the recorded run config (by default the RunConfig the names
    give, as the runner records it); ``source`` and ``fingerprint`` default to what the runner
    would record for a registered task (its provenance; a package task's real corpus fingerprint).
    """
    leaf = root / method / llm / (f"{retriever}__{reranker}" if reranker else retriever)
    leaf.mkdir(parents=True, exist_ok=True)
    ev = evaluate(run, qrels, DEFAULT_METRICS)
    tag = f"r2med-agent.{method}.{llm}.{leaf.name}"
    (leaf / f"{task}.run").write_text(write_trec_run(run, tag), encoding="utf-8")
    record = {
        "dataset_name": task,
        "model_name": f"{method}/{llm}/{leaf.name}",
        "evaluation_time": 1.25,
        "evaluated_at": "2025-01-01T00:00:00+00:00",
        "test": ev.mean,
        "num_queries": ev.num_queries,
        "missing_queries": len(ev.missing),
        "missing_query_ids": list(ev.missing),
        "per_query": ev.per_query,
        "stats": dict(
            stats
            or {"generations": 0, "cache_hits": 0, "prompt_tokens": 0, "completion_tokens": 0,
                "llm_time_s": 0.0, "retrieval_time_s": 0.01, "cost_usd": None}
        ),
        "config": runconfig_record(method, llm, retriever, task, reranker, config),
        **data_record(task, source, fingerprint),
    }
    (leaf / f"{task}.json").write_text(json.dumps(record, indent=2), encoding="utf-8")
    if generations is not None:
        (leaf / f"{task}.generations.jsonl").write_text(
            "".join(json.dumps(g) + "\n" for g in generations), encoding="utf-8"
        )
    if traces is not None:
        (leaf / f"{task}.traces.jsonl").write_text("".join(json.dumps(t) + "\n" for t in traces), encoding="utf-8")
    return leaf


def runconfig_record(
    method: str, llm: str, retriever: str, task: str, reranker: str = "",
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``config`` block the runner writes for this configuration (its own record function),
    in the project's own wording (the folders these trees write have no prompts token)."""
    from r2med_agent.experiment.run_config import config_record
    from r2med_agent.api import RunConfig

    cfg = RunConfig(
        tasks=(task,), method=method, llm=None if llm == "none" else llm, retriever=retriever,
        reranker=reranker or None, prompts_from="own",
    )
    return {**config_record(cfg), **(overrides or {})}


def data_record(task: str, source: str | None = None, fingerprint: str | None = None) -> dict[str, str]:
    """``source`` and ``corpus_fingerprint`` as the runner records them for a registered task."""
    from r2med_agent.data import load_task, task_registry

    spec = task_registry().get(task)
    if source is None:
        source = spec.provenance if spec is not None else "inline test data"
    if fingerprint is None:
        fingerprint = load_task(task).fingerprint if spec is not None and spec.source == "package" else "test"
    return {"source": source, "corpus_fingerprint": fingerprint}


GOOD: Run = {"q1": ranking("d1", "d5", "d9"), "q2": ranking("d2", "d8"), "q3": ranking("d3", "d7"), "q4": ranking("d4")}
"""Every relevant document on top."""
MIXED: Run = {"q1": ranking("d9", "d1"), "q2": ranking("d8", "d2"), "q3": ranking("d7", "d11"), "q4": ranking("d10")}
"""Relevant documents second or missing."""
WEAK: Run = {"q1": ranking("d9", "d10", "d1"), "q2": ranking("d8"), "q3": ranking("d11", "d3"), "q4": ranking("d12")}
"""Few relevant documents, low."""


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))
