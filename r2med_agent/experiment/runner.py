"""The one place that orchestrates stages and writes files.

CLI -> RunConfig (a RunSpec plus run options) -> run_experiment: load tasks -> build retrievers ->
the method's one call over all tasks (``Method.run_tasks``) -> search per task (all queries in one
call) -> optional rerank (``Reranker`` protocol) -> evaluate -> ResultStore. Methods never write
files; this module never parses LLM text and never asks which method or reranker it runs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from r2med_agent.errors import ConfigError
from r2med_agent.data.formats import data_fingerprint
from r2med_agent.data import excluded_depth, ranking_depth, remove_excluded, task_metrics
from r2med_agent.evaluation import (
    Evaluation,
    average_over_tasks,
    drop_identical_ids,
    evaluate,
    metrics_within_depth,
    truncate,
)
from r2med_agent.experiment.run_config import RunConfig, entries_in_use, folder_fingerprint, model_precisions, prompts_in_use
from r2med_agent.experiment.run_config import config_record as _config_record
from r2med_agent.experiment.spec import DEFAULT_TOP_K, FINAL_MODES, RunSpec
from r2med_agent.experiment.store import ResultStore, folder_scores, summary_text, write_task_set
from r2med_agent.types import Generation, Run, SamplingParams, SearchRequest, Task

__all__ = ["DEFAULT_TOP_K", "FINAL_MODES", "ExperimentResult", "RunConfig", "RunSpec", "TaskOutcome", "cut_run",
           "entries_in_use", "folder_fingerprint", "model_precisions", "prompts_in_use", "run_experiment"]

log = logging.getLogger(__name__)

@dataclass
class TaskOutcome:
    task: str
    evaluation: Evaluation
    files: list[Path]
    stats: dict[str, Any]
    not_scored: str = ""
    """Why the task's run was not scored ("" when it was): ``--no-eval``, or no qrels."""
    queries_run: int = 0
    """The queries that ran (scored or not; ``evaluation.num_queries`` counts the scored ones)."""


@dataclass
class ExperimentResult:
    config: RunConfig
    outcomes: list[TaskOutcome]
    average: dict[str, float]
    result_dir: Path
    llm_stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class _TaskRun:
    """Everything the stages make for one task (one record, instead of a dict per stage)."""

    task: Task
    retriever: Any
    index_time: float = 0.0
    output: Any = None  # methods.base.TaskOutput
    run: Run | None = None
    retrieval_time: float = 0.0
    rerank: Any = None  # an LLM reranker's output for this task
    released_source: str | None = None
    identical_ids_removed: int | None = None  # hits dropped by exclude_identical_ids
    excluded_removed: int | None = None  # a BRIGHT task's excluded ids dropped from its rankings


@dataclass
class _Context:
    """The run's shared parts: its config, its spec and result store (made once), LLM entry,
    reranker and the LLM itself."""

    cfg: RunConfig
    method: Any
    spec: RunSpec
    store: ResultStore
    llm_spec: Any = None
    reranker: Any = None
    reranker_entry: Any = None  # the reranker's registry entry (rerank.spec.RerankerSpec)
    llm: Any = None
    loop_steps: list[dict[str, int]] | None = None
    prompts: Any = None  # prompt_sources.RunPrompts: where the method and the reranker read their templates


def _cost_usd(spec: Any, prompt_tokens: int, completion_tokens: int) -> float | None:
    """Dollars at the LLM registry's prices (LLMSpec.cost_usd); None where there is no price
    (self-hosted or local models, runs without an LLM), so tables show no invented $0."""
    if spec is None or not (spec.price_in_per_mtok or spec.price_out_per_mtok):
        return None
    return round(spec.cost_usd(prompt_tokens, completion_tokens), 6)


def _generation_stats(gens: Sequence[Generation], spec: Any) -> dict[str, Any]:
    made = [g for g in gens if not g.cached]
    p_in = sum(g.prompt_tokens for g in gens)
    p_out = sum(g.completion_tokens for g in gens)
    return {
        "generations": len(made),
        "cache_hits": len(gens) - len(made),
        "prompt_tokens": p_in,
        "completion_tokens": p_out,
        # Model time and cost of all the method's generations (cached ones keep the time and
        # tokens of their original run), so configurations compare whatever the cache held;
        # llm_time_new_s is what this run itself spent.
        "llm_time_s": round(sum(g.latency_s for g in gens), 4),
        "llm_time_new_s": round(sum(g.latency_s for g in made), 4),
        "cost_usd": _cost_usd(spec, p_in, p_out),
    }


def _add_rerank_stats(stats: dict[str, Any], rerank: dict[str, Any], reranker_llm: Any) -> None:
    """An LLM reranker's tokens, time and cost join the task's totals (what ``compare --cost``
    sums); its own numbers stay apart under ``rerank``."""
    rerank = dict(rerank)
    rerank["cost_usd"] = _cost_usd(reranker_llm, rerank["prompt_tokens"], rerank["completion_tokens"])
    for key in ("generations", "cache_hits", "prompt_tokens", "completion_tokens"):
        stats[key] = stats.get(key, 0) + rerank[key]
    for key in ("llm_time_s", "llm_time_new_s"):
        stats[key] = round(stats.get(key, 0.0) + rerank[key], 4)
    if rerank["cost_usd"] is not None:
        stats["cost_usd"] = round((stats.get("cost_usd") or 0.0) + rerank["cost_usd"], 6)
    stats["rerank"] = rerank


def cut_run(run: Run, k: int) -> Run:
    """Each query's ``k`` best documents (score order; equal scores keep the run's order)."""
    return {
        qid: dict(sorted(docs.items(), key=lambda kv: -kv[1])[:k]) for qid, docs in run.items()
    }


def _task_stats(gens, traces, spec: Any) -> dict[str, Any]:
    if gens is not None:
        return _generation_stats(gens, spec)
    if traces is not None:
        p_in = sum(s.prompt_tokens for t in traces for s in t.steps)
        p_out = sum(s.completion_tokens for t in traces for s in t.steps)
        extra = [t.extra or {} for t in traces]
        return {
            "generations": sum(int(e.get("generations", 0)) for e in extra),
            "cache_hits": sum(int(e.get("cache_hits", 0)) for e in extra),
            "prompt_tokens": p_in,
            "completion_tokens": p_out,
            "llm_time_s": round(sum(float(e.get("llm_time_s", 0.0)) for e in extra), 4),
            "llm_time_new_s": round(sum(float(e.get("llm_time_new_s", 0.0)) for e in extra), 4),
            "cost_usd": _cost_usd(spec, p_in, p_out),
        }
    return {"generations": 0, "cache_hits": 0, "prompt_tokens": 0, "completion_tokens": 0,
            "llm_time_s": 0.0, "llm_time_new_s": 0.0, "cost_usd": None}


def run_experiment(cfg: RunConfig, llm: Any | None = None) -> ExperimentResult:
    """Run one configuration over its tasks and write every result file; see module docstring.

    An LLM the run builds itself is closed when the run ends, also on an error or Ctrl-C (a
    vLLM engine shuts down, so the process can exit); one passed in stays open.

    Args:
        cfg: the configuration.
        llm: an LLM to use instead of building ``cfg.llm`` from the registry (tests, notebooks);
            its generations still go through whatever wrapper it has.
    """
    from r2med_agent import progress

    owned: list[Any] = []
    was_enabled = progress.enabled()
    progress.configure(enabled=cfg.show_progress)
    try:
        return _run_experiment(cfg, llm, owned)
    finally:
        progress.configure(enabled=was_enabled)
        for made in owned:
            try:
                made.close()
            except Exception as e:  # noqa: BLE001 - never mask the run's own outcome
                log.warning("closing the LLM failed: %s", e)


def _run_experiment(cfg: RunConfig, llm: Any | None, owned: list[Any]) -> ExperimentResult:
    from r2med_agent.data import load_task
    from r2med_agent.data.load import generic_prompt_note
    from r2med_agent.prompts.sources import check_tasks, run_prompts

    method = cfg.plan.method()
    if cfg.plan.generates:  # released texts need no registry entry
        cfg.plan.llm_entry()  # a misspelt name, before any fetch
    if cfg.plan.released is not None:
        cfg.plan.released.check(cfg.plan, cfg.tasks, cfg.data_dir)
    # The authors' prompts first: fetched, or refused with one message, before any other work.
    prompts = run_prompts(cfg, cfg.prompts_dir, folders=cfg.plan.prompt_folders)
    tasks = [load_task(name, cfg.data_dir, allow_missing_qrels_docs=cfg.allow_missing_qrels_docs,
                       allow_count_mismatch=cfg.allow_count_mismatch, qrels_split=cfg.split,
                       all_queries=cfg.all_queries)
             for name in cfg.tasks]
    beyond = [m for m in cfg.metrics if m not in cfg.scored_metrics]
    if beyond:
        log.info("scoring the top %d: %s left out (their cut-off is beyond the depth)",
                 cfg.top_k, ", ".join(beyond))
    check_tasks(prompts, cfg.method, tasks)
    ctx = _Context(cfg, method, cfg.spec(), cfg.store, prompts=prompts)
    _check_models(ctx)
    entry = ctx.reranker_entry
    if cfg.plan.generates or (entry is not None and cfg.plan.reranker_kind.uses_llm):
        for note in filter(None, (generic_prompt_note(t.name, cfg.data_dir) for t in tasks)):
            log.warning("%s", note)  # the prompts name the task's domain: say which one it gets
    released = _load_released(ctx, tasks)
    out_dir = ctx.store.prepare(ctx.spec)
    runs = _build_retrievers(ctx, tasks)
    for name, (gens, source) in released.items():
        runs[name].output = ctx.method.from_generations(runs[name].task, gens)
        runs[name].released_source = source
    if not released:
        ctx.llm = _make_llm(ctx, llm, owned)
        _run_method(ctx, runs)
    _search(ctx, runs)
    outcomes: list[TaskOutcome] = []
    for r in runs.values():
        outcomes.append(_finish_task(ctx, out_dir, r, outcomes))
    return ExperimentResult(ctx.cfg, outcomes, _average(outcomes), out_dir, _llm_stats(ctx))


def _check_models(ctx: _Context) -> None:
    """Everything that can fail cheaply (names, models) before any LLM work and any index: the
    LLM's name, then the reranker's model (tokenizer, config; its weights load when reranking
    starts: loaded now, they would hold GPU memory an in-process vLLM engine expects to have)."""
    cfg = ctx.cfg
    ctx.llm_spec = cfg.plan.llm_entry()  # None where no entry is needed (BRIGHT's reasoning LLMs)
    if cfg.reranker:
        from r2med_agent.retrieval import make_reranker

        # the plan's entry (None where the registry has none: make_reranker says so by name)
        ctx.reranker_entry = cfg.plan.reranker
        ctx.reranker = make_reranker(
            cfg.reranker, entry=ctx.reranker_entry, precision=cfg.precision, max_length=cfg.rerank_max_length,
            cache_path=cfg.cache_path, use_cache=cfg.use_cache,
            refresh=cfg.refresh_cache, chunk_size="auto" if cfg.chunk_size is None else cfg.chunk_size,
            prompts_dir=ctx.prompts.reranker_dir if ctx.prompts is not None else cfg.prompts_dir,
        )
        ctx.reranker.check()


def _load_released(ctx: _Context, tasks: Sequence[Task]) -> dict[str, tuple[list[Generation], str]]:
    """The released generations of every task from the plan's registered source
    (:mod:`r2med_agent.data.sources`), found and checked before any index is built; {} when the
    run generates its own."""
    cfg = ctx.cfg
    source = cfg.plan.released
    if source is None:
        return {}
    out = {task.name: source.load(task, cfg.plan, cfg.data_dir) for task in tasks}
    log.info("scoring %s (%s, %s): no LLM is built", source.about, cfg.method, cfg.llm)
    return out


def _build_retrievers(ctx: _Context, tasks: Sequence[Task]) -> dict[str, _TaskRun]:
    from r2med_agent.retrieval import make_retriever

    options = ctx.cfg.retriever_options()
    out = {}
    for task in tasks:
        t0 = time.perf_counter()
        retriever = make_retriever(ctx.cfg.retriever, task, options=options)
        out[task.name] = _TaskRun(task, retriever, index_time=time.perf_counter() - t0)
    return out


def _make_llm(ctx: _Context, llm: Any | None, owned: list[Any]) -> Any:
    """The run's LLM: the one passed in, or the registry entry's (closed when the run ends)."""
    cfg = ctx.cfg
    if ctx.llm_spec is None:
        return None
    if llm is not None:
        return llm
    from r2med_agent.llm import make_llm

    # A method may change entry fields for its LLM (Search-o1 sends no system prompt).
    made = make_llm(
        cfg.llm,  # type: ignore[arg-type]
        cache_path=cfg.cache_path,
        use_cache=cfg.use_cache,
        refresh=cfg.refresh_cache,
        overrides={**ctx.method.llm_overrides, **_prompt_path(cfg)} or None,
        chunk_size="auto" if cfg.chunk_size is None else cfg.chunk_size,
        entry=ctx.llm_spec,
    )
    owned.append(made)
    return made


def _prompt_path(cfg: RunConfig) -> dict[str, Any]:
    """The entry field ``llm_prompt`` sets (``prompt_path``), when it is not the default."""
    return {"prompt_path": cfg.llm_prompt} if cfg.llm_prompt != "chat" else {}


def _run_method(ctx: _Context, runs: dict[str, _TaskRun]) -> None:
    """The method's one call over every task (the Method protocol)."""
    from r2med_agent.methods.base import MethodJob, MethodSettings

    cfg = ctx.cfg
    loop_spec = cfg.loop_retriever or cfg.retriever
    jobs = []
    for r in runs.values():
        searched = r.retriever if loop_spec == cfg.retriever else _other_retriever(cfg, loop_spec, r.task)
        depth = ctx.method.first_pass_depth
        first_pass = (lambda r=r: _first_pass(cfg, r, depth)) if ctx.method.needs_first_pass else None
        jobs.append(MethodJob(r.task, searched, r.retriever, first_pass))
    settings = MethodSettings(params=cfg.plan.sampling, sampling=dict(cfg.sampling), llm_spec=ctx.llm_spec,
                              samples=cfg.samples, final=cfg.final, top_k=cfg.top_k,
                              prompts_dir=ctx.prompts.method_dir if ctx.prompts is not None else cfg.prompts_dir)
    result = ctx.method.run_tasks(jobs, ctx.llm, settings)
    ctx.loop_steps = result.loop_steps
    for name, output in result.tasks.items():
        runs[name].output = output


def _other_retriever(cfg: RunConfig, spec: str, task: Task) -> Any:
    from r2med_agent.retrieval import make_retriever

    return make_retriever(spec, task, options=cfg.retriever_options(fused=False))


def _first_pass(cfg: RunConfig, r: _TaskRun, depth: int) -> Run:
    """The top ``depth`` of ``cfg.first_pass`` for every query (the method's declared
    ``first_pass_depth``: LameR's prompt shows its top 10; the run's own index is reused when it
    is the same retriever)."""
    first = r.retriever if cfg.retriever == cfg.first_pass else _other_retriever(cfg, cfg.first_pass, r.task)
    return first.search([SearchRequest(q.query_id, q.text) for q in r.task.queries], depth)


def _search(ctx: _Context, runs: dict[str, _TaskRun]) -> None:
    """Search every task with all its queries at once, then rerank: a reranker that takes every
    task at once (an LLM reranker: one generate call per window position) gets them together.

    A task whose benchmark ranks deeper than the run's depth (BRIGHT: 1000) is searched and cut
    as that benchmark cuts, then the first ``depth`` of that list in trec_eval's order are kept:
    so the top 100 is always the first 100 of the top 1000, ties included."""
    cfg, reranker = ctx.cfg, ctx.reranker
    per_task = reranker is not None and not reranker.batches_tasks
    depth = max(cfg.top_k, cfg.rerank_k if reranker else 0)
    identical = 1 if cfg.exclude_identical_ids else 0
    for r in runs.values():
        t0 = time.perf_counter()
        if cfg.empty_generation == "keep":
            r.output.requests = [replace(q, keep_empty=True) for q in r.output.requests]
        requests = r.output.requests
        pool = max(depth, ranking_depth(r.task))
        if r.output.fused_run is not None:
            r.run = r.output.fused_run
        else:
            r.run = r.retriever.search(requests, pool + excluded_depth(r.task.excluded) + identical)
        if r.task.excluded is not None:  # BRIGHT: each query's excluded ids leave before the cut
            r.run, r.excluded_removed = remove_excluded(r.run, r.task.excluded, pool + identical)
        if cfg.exclude_identical_ids:
            r.run, r.identical_ids_removed = drop_identical_ids(r.run, pool)
        if pool > depth:
            r.run = truncate(r.run, depth)
        if per_task:
            corpus = {d.doc_id: d.full_text for d in r.task.corpus}
            r.run = reranker.rerank(requests, r.run, corpus, cfg.rerank_k)
        r.retrieval_time = time.perf_counter() - t0
    if reranker is not None and not per_task:
        _rerank_all(ctx, list(runs.values()))


def _rerank_all(ctx: _Context, runs: list[_TaskRun]) -> None:
    """A reranker that batches tasks (the LLM rerankers) over every task at once; the run's own
    LLM is shared when the reranker's kind uses an LLM and its entry names the run's."""
    from r2med_agent.retrieval.base import keeps_order
    from r2med_agent.rerank.base import RerankJob

    cfg, reranker, entry = ctx.cfg, ctx.reranker, ctx.reranker_entry
    if ctx.llm is not None and entry is not None and cfg.plan.reranker_kind.uses_llm and cfg.llm == entry.llm:
        reranker.share_llm(ctx.llm)
    jobs = [RerankJob(r.task, r.output.requests, r.run, {d.doc_id: d.full_text for d in r.task.corpus},
                      ordered=keeps_order(r.retriever) and r.output.fused_run is None)
            for r in runs]
    t0 = time.perf_counter()
    outputs = reranker.rerank_tasks(jobs, cfg.rerank_k)
    log.info("%s reranked %d tasks in %.1f s", reranker.name, len(runs), time.perf_counter() - t0)
    share = (time.perf_counter() - t0) / max(len(runs), 1)
    for r, out in zip(runs, outputs):
        r.rerank = out
        r.run = out.run
        r.retrieval_time += share


def _finish_task(ctx: _Context, out_dir: Path, r: _TaskRun, done: list[TaskOutcome]) -> TaskOutcome:
    """Cut, evaluate and write one task's files, with the folder's summary as it is once they
    are written (after the tasks ``done`` before it in this run)."""
    cfg = ctx.cfg
    t0 = time.perf_counter()
    run = r.run
    if ctx.reranker is not None and cfg.rerank_cut:
        run = cut_run(run, cfg.rerank_k)
    unscored = _not_scored(cfg, r.task)
    if unscored:
        log.warning("%s: not scored: %s; the run, generations and traces are written", r.task.name, unscored)
        ev = Evaluation({}, {}, 0, tuple(q.query_id for q in r.task.queries if not run.get(q.query_id)))
    else:
        ev = evaluate(run, r.task.qrels, metrics_within_depth(task_metrics(cfg.scored_metrics, r.task), cfg.top_k),
                      depth=cfg.top_k)
    # R2MED's evaluation_time: seconds the task's evaluation took (indexing, search, scoring)
    evaluation_s = r.index_time + r.retrieval_time + (time.perf_counter() - t0)
    stats = _stats(ctx, r)
    data = data_fingerprint(r.task)
    r.task = replace(r.task, name=ctx.store.result_name(ctx.spec, r.task.name, data, r.task.fingerprint))
    ctx.store.note_replacement(ctx.spec, r.task.name)
    outcome = TaskOutcome(r.task.name, ev, [], stats, unscored, len(r.task.queries))
    outcome.files = _write_task_files(cfg, out_dir, r, run, ev, stats, evaluation_s, unscored, data,
                                      summary=lambda: _summary(ctx, out_dir, [*done, outcome]))
    if ev.missing and not unscored:
        log.warning("%s: %d of %d queries have no results and score 0", r.task.name,
                    len(ev.missing), ev.num_queries)
    return outcome


def _not_scored(cfg: RunConfig, task: Task) -> str:
    """Why a task's run is not scored ("" when it is)."""
    if cfg.no_eval:
        return "--no-eval"
    return "" if task.qrels else "no relevance judgments (qrels) in its folder"


def _stats(ctx: _Context, r: _TaskRun) -> dict[str, Any]:
    out = r.output
    every = out.samples
    gens_for_stats = [g for s in every for g in s] if every else out.generations
    stats = _task_stats(gens_for_stats, out.traces, ctx.llm_spec)
    if r.released_source is not None:
        stats.update(generations=0, cache_hits=0, released_generations=len(out.generations),
                     llm_time_s=0.0, llm_time_new_s=0.0, cost_usd=None, released_source=r.released_source)
    if ctx.cfg.samples > 1:
        stats["samples"] = ctx.cfg.samples
    if any(q.combine != "none" for q in out.requests):
        stats["empty_generations"] = sum(q.empty_generations for q in out.requests)
    if r.identical_ids_removed is not None:
        stats["identical_ids_removed"] = r.identical_ids_removed
    if r.excluded_removed is not None:
        stats["excluded_removed"] = r.excluded_removed
    stats["retrieval_time_s"] = round(r.retrieval_time, 4)
    stats["index_time_s"] = round(r.index_time, 4)
    if r.rerank is not None:
        _add_rerank_stats(stats, r.rerank.stats, ctx.cfg.plan.reranker_llm)
    return stats


def _average(outcomes: list[TaskOutcome]) -> dict[str, float]:
    return average_over_tasks([o.evaluation.mean for o in outcomes if not o.not_scored])


def _llm_stats(ctx: _Context) -> dict[str, Any]:
    llm = ctx.llm
    llm_stats = asdict(llm.stats) if llm is not None and hasattr(llm, "stats") else {}
    from r2med_agent.rerank.base import built_llm

    rerank_llm = built_llm(ctx.reranker)
    if rerank_llm is not None and rerank_llm is not llm and hasattr(rerank_llm, "stats"):
        llm_stats = {**llm_stats, "reranker": asdict(rerank_llm.stats)}
    return llm_stats


def _summary(ctx: _Context, out_dir: Path, outcomes: list[TaskOutcome]) -> str:
    """The folder's ``summary.json`` once ``outcomes`` are written: every task result in it (a
    second --task run adds to it) and the "run" block, this run's own tasks so far. It goes into
    the last outcome's set of files (made under the folder's lock), so it always matches them."""
    cfg = ctx.cfg
    scores = folder_scores(out_dir, {o.task: o.evaluation.mean for o in outcomes})
    extra = {
        "run": {"tasks": [o.task for o in outcomes], "average": _average(outcomes)},
        "llm_stats": _llm_stats(ctx),
        **({"loop_steps": ctx.loop_steps} if ctx.loop_steps is not None else {}),
        "config": _config_record(cfg),
        **({"plugins": dict(cfg.plan.plugins)} if cfg.plan.plugins else {}),
        "precision": model_precisions(cfg),
    }
    return summary_text(scores, ctx.spec, extra)


def _write_task_files(cfg: RunConfig, out_dir: Path, r: _TaskRun, run: Run, ev: Evaluation,
                      stats: dict[str, Any], evaluation_s: float, unscored: str, data: str, *,
                      summary: Any = None) -> list[Path]:
    from r2med_agent.evaluation import write_trec_run

    task, out = r.task, r.output
    tag = f"r2med-agent.{cfg.method}.{cfg.llm_label}.{cfg.leaf}"
    files = {".run": write_trec_run(run, tag, cfg.top_k)}
    record = {
        "dataset_name": task.name,
        "model_name": cfg.folder(),
        "evaluation_time": round(evaluation_s, 4),  # a duration in seconds, as R2MED's
        "evaluated_at": _now(),
        "generations": cfg.generations,
        "test": ev.mean,
        **({"not_scored": unscored} if unscored else {}),
        "depth": cfg.top_k,
        "num_queries": ev.num_queries,
        "queries_run": len(task.queries),
        "missing_queries": len(ev.missing),
        "missing_query_ids": list(ev.missing),
        "per_query": ev.per_query,
        "stats": stats,
        "config": _config_record(cfg),
        **({"plugins": dict(cfg.plan.plugins)} if cfg.plan.plugins else {}),  # who made its components
        "spec_key": cfg.key(),
        "precision": model_precisions(cfg),
        "source": task.source,
        "data": task.origin.record() if task.origin is not None else None,
        "corpus_fingerprint": task.fingerprint,
        "data_fingerprint": data,
        "family": task.family,
        "domain": task.domain,
    }
    files[".json"] = json.dumps(record, indent=2, ensure_ascii=False) + "\n"
    if out.generations is not None:
        files[".generations.jsonl"] = _generations_jsonl(task, out.generations, out.requests, out.samples)
    files.update(out.artifacts())  # the method's own files (a loop's traces)
    if r.rerank is not None:
        files.update(r.rerank.artifacts())  # the reranker's own (its logs)
    # one set (with the folder's summary): a reader never mixes two runs' files
    return write_task_set(out_dir, task.name, files, summary=summary)


def _generations_jsonl(task: Task, gens: Sequence[Generation], requests: Sequence[SearchRequest],
                       samples: Sequence[Sequence[Generation]] | None) -> str:
    by_id = {r.query_id: r for r in requests}
    lines = []
    for n, (q, g) in enumerate(zip(task.queries, gens)):
        more = {"samples": [s.final for s in samples[n]]} if samples else {}
        lines.append(json.dumps({
            "id": q.query_id,
            "text": q.text,
            "hy_doc": g.text,  # the raw output, as in R2MED's own files
            "doc_id": sorted(task.qrels.get(q.query_id, {})),
            "final": g.final,
            "reasoning": g.reasoning,
            "finish_reason": g.finish_reason,
            "query_used": by_id[q.query_id].combine if q.query_id in by_id else "none",
            **more,
        }, ensure_ascii=False))
    return "\n".join(lines) + "\n"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
