"""The one place that orchestrates stages and writes files.

CLI -> RunConfig -> run_experiment: load tasks -> build retrievers -> method (one LLM batch over all
tasks) -> search per task (all queries in one call) -> optional rerank -> evaluate -> files.
Methods never write files; this module never parses LLM text.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from r2med_agent.errors import ConfigError
from r2med_agent.evaluation import (
    DEFAULT_METRICS,
    Evaluation,
    average_over_tasks,
    evaluate,
    metrics_within_depth,
)
from r2med_agent.io import atomic_write_json, atomic_write_text
from r2med_agent.types import Generation, Run, SamplingParams, SearchRequest, Task

log = logging.getLogger(__name__)

FINAL_MODES = ("default", "fuse")
DEFAULT_TOP_K = 100
"""R2MED's depth: the top 100 documents per query are kept and scored."""


@dataclass(frozen=True)
class RunConfig:
    """One experiment: a method with an LLM over a retriever, on one or more tasks.

    Attributes:
        tasks: task names (already resolved from specs such as ``all``).
        method: ``none``, ``hyde``, ``query2doc``, ``lamer``, ``search-r1``, ``search-o1``.
        llm: LLM registry name; required by every method but ``none``.
        retriever: retriever spec (``bm25``, ``bm25-compat``, an encoder name, ``bm25+minilm``).
        loop_retriever: retriever the agentic loops search while reasoning (None: the same as
            ``retriever``). With ``final="fuse"`` the fused ranking comes from the loop's own
            searches, so the two must be the same.
        fusion: how a '+'-joined ``retriever`` fuses its members: ``rrf`` (reciprocal rank
            fusion) or ``weighted`` (weighted sum of per-query min-max normalised scores).
        fusion_weights: one weight per member for ``weighted`` (None: all 1.0).
        rrf_k: the RRF constant (60, as Cormack et al.).
        precision: numeric precision of every encoder and reranker of the run on a GPU
            (``float32``, ``float16``, ``bfloat16``, ``autocast-float16``, ``auto``); None: each
            model's registry ``precision`` (the reference's). Another precision gets its own
            result folder (``<retriever>__<precision>``) and is recorded with the results.
        reranker: reranker registry name, or None.
        rerank_k: how many top documents the reranker re-scores.
        rerank_cut: keep only the ``rerank_k`` reranked documents per query (R2MED's reranker
            runs: NV-Embed-v2's top 10 reranked and kept, scored at depth ``top_k`` all the same);
            False keeps the rest of the list below them. The result folder gets ``__top<k>``.
        first_pass: LameR's first-pass retriever, whose top 10 the prompt shows (``bm25``; the
            paper's runs read the reference's gensim BM25, ``bm25-compat``).
        generations: ``fresh`` (generate, through the cache) or ``r2med`` (R2MED's released
            generations of ``method``/``llm``, see :mod:`r2med_agent.released`; no LLM is built,
            and the result folder's LLM part is ``<llm>@r2med``).
        top_k: documents kept per query and the depth they are scored at (R2MED: 100). Any other
            depth gets its own result folder (``<retriever>__k<top_k>``), and metrics whose
            cut-off exceeds it are left out (see :func:`~r2med_agent.evaluation.metrics_within_depth`).
        data_dir: local copy of the data (R2MED or BEIR layout); None loads from the hub.
        allow_missing_qrels_docs: keep qrels naming documents absent from the corpus (warned)
            instead of failing (see :func:`r2med_agent.data.load_task`).
        allow_count_mismatch: use a ``data_dir`` copy of a registered task whose query or
            document count differs from the registry's (recorded in each task's ``source``).
        output_dir: root of the result tree.
        use_cache: read and write the generation cache.
        refresh_cache: regenerate and overwrite cached generations.
        cache_path: the generation cache file (None: the default under the cache directory).
        chunk_size: cache misses per backend call, each committed when it returns (0: all in
            one call; None: the LLM entry's ``chunk_size``).
        final: agentic final ranking: ``default`` (final response as the query, as R2MED does)
            or ``fuse`` (RRF of every search of the trajectory plus the final query).
        sampling: overrides of the LLM's default sampling (temperature, max_tokens, seed, ...).
        samples: generations per query of HyDE, Query2Doc and LameR (vLLM's and OpenAI's ``n``):
            dense retrieval searches with the mean of the query's embedding and the samples',
            BM25 with the samples joined (see :class:`~r2med_agent.types.SearchRequest`). Other
            than 1, the result folder says it (``bm25__n8``).
        metrics: metric keys to compute.
        show_progress: progress bars.
        encoder_backend: engine of the local dense encoders (``auto``, ``transformers``,
            ``vllm``); None: each encoder entry's ``backend``.
    """

    tasks: tuple[str, ...]
    method: str = "none"
    llm: str | None = None
    retriever: str = "bm25"
    loop_retriever: str | None = None
    fusion: str = "rrf"
    fusion_weights: tuple[float, ...] | None = None
    rrf_k: int = 60
    precision: str | None = None
    reranker: str | None = None
    rerank_k: int = 100
    rerank_cut: bool = False
    first_pass: str = "bm25"
    generations: str = "fresh"
    top_k: int = DEFAULT_TOP_K
    data_dir: Path | None = None
    allow_missing_qrels_docs: bool = False
    allow_count_mismatch: bool = False
    output_dir: Path = Path("results")
    use_cache: bool = True
    refresh_cache: bool = False
    cache_path: Path | None = None
    chunk_size: int | None = None
    final: str = "default"
    sampling: dict[str, Any] = field(default_factory=dict)
    samples: int = 1
    metrics: tuple[str, ...] = DEFAULT_METRICS
    show_progress: bool = True
    encoder_backend: str | None = None

    def __post_init__(self) -> None:
        from r2med_agent.methods import get_method, method_name

        get_method(self.method)  # an unknown name fails here, before any work
        object.__setattr__(self, "method", method_name(self.method))  # HyDE -> hyde
        if self.method == "none" and self.llm:
            raise ConfigError(
                f"--llm {self.llm} is only used by a method; add --method (hyde, query2doc, "
                "lamer, search-r1, search-o1), or leave --llm out for plain retrieval"
            )
        if self.method != "none" and not self.llm:
            raise ConfigError(f"--method {self.method} needs --llm (see `r2med-agent llms`)")
        if self.final not in FINAL_MODES:
            raise ConfigError(f"--final must be one of {', '.join(FINAL_MODES)}, got '{self.final}'")
        if self.final == "fuse" and self.loop_retriever not in (None, self.retriever):
            raise ConfigError(
                "--final fuse ranks with the loop's own searches: --loop-retriever must be the same "
                f"as --retriever (got {self.loop_retriever} and {self.retriever})"
            )
        from r2med_agent.released import check_generations

        check_generations(self.generations)
        if self.generations == "r2med" and self.method == "none":
            raise ConfigError("--generations r2med needs a --method that generates (hyde, query2doc, lamer, "
                              "search-r1, search-o1)")
        if self.generations == "r2med" and self.sampling:
            raise ConfigError(f"sampling options ({', '.join(sorted(self.sampling))}) do not apply to R2MED's "
                              "released generations; drop them or use --generations fresh")
        if self.generations == "r2med" and self.final == "fuse":
            raise ConfigError("--final fuse needs the loop's own searches, which released generations do "
                              "not have; use --generations fresh")
        if self.rerank_cut and not self.reranker:
            raise ConfigError("--rerank-cut needs --reranker")
        if self.first_pass != "bm25" and self.method != "lamer":
            raise ConfigError(f"--first-pass is LameR's first-pass retriever; --method {self.method} has none")
        if "+" in self.first_pass:
            raise ConfigError(f"--first-pass takes one retriever (bm25, bm25-compat, an encoder), got '{self.first_pass}'")
        if self.top_k < 1 or self.rerank_k < 1:
            raise ConfigError("--top-k and --rerank-k must be at least 1")
        if self.samples < 1:
            raise ConfigError(f"--samples must be at least 1, got {self.samples}")
        if self.samples > 1 and self.method not in ("hyde", "query2doc", "lamer"):
            raise ConfigError(f"--samples applies to hyde, query2doc and lamer, not --method {self.method}")
        if self.chunk_size is not None and self.chunk_size < 0:
            raise ConfigError(f"--chunk-size must be >= 0 (0 = one backend call), got {self.chunk_size}")
        _check_sampling_values(self.sampling)
        if self.precision is not None:
            from r2med_agent.retrieval.dense.spec import PRECISIONS

            if self.precision not in PRECISIONS:
                raise ConfigError(
                    f"--precision must be one of {', '.join(PRECISIONS)}, got '{self.precision}'"
                )
        _check_fusion(self)
        from r2med_agent.retrieval.dense.spec import BACKENDS

        if self.encoder_backend is not None and self.encoder_backend not in BACKENDS:
            raise ConfigError(
                f"--encoder-backend must be one of {', '.join(BACKENDS)}, got '{self.encoder_backend}'"
            )
        _check_fixed_rankings(self)

    @property
    def llm_label(self) -> str:
        """The LLM part of the result folder: its name, ``<name>@r2med`` for released generations."""
        if self.method == "none" or not self.llm:
            return "none"
        if self.generations == "r2med":
            from r2med_agent.released import released_label

            return released_label(self.llm)
        return self.llm

    @property
    def fusion_options(self) -> dict[str, Any]:
        """``make_retriever`` options for ``retriever`` (none unless it is '+'-joined; plus
        ``precision`` when set)."""
        opts: dict[str, Any] = {"precision": self.precision} if self.precision is not None else {}
        if "+" not in self.retriever:
            return opts
        return {**opts, "fusion": self.fusion, "rrf_k": self.rrf_k, "weights": self.fusion_weights}

    @property
    def retriever_label(self) -> str:
        from r2med_agent.retrieval.fusion import fusion_label

        label = self.retriever
        if "+" in label:  # other fusion settings, other folder
            label = fusion_label(label, self.fusion, self.rrf_k, self.fusion_weights)
        if self.method in ("search-r1", "search-o1") and self.final == "fuse":
            label += "__fuse"
        if self.precision is not None:
            label += f"__{self.precision}"
        if self.top_k != DEFAULT_TOP_K:
            label += f"__k{self.top_k}"
        if self.samples > 1:
            label += f"__n{self.samples}"
        if self.reranker:
            if self.rerank_cut:
                label += f"__top{self.rerank_k}"
            label += f"__{self.reranker}"
        return label

    @property
    def scored_metrics(self) -> tuple[str, ...]:
        """``metrics`` whose cut-off the depth ``top_k`` reaches (all of them at 100)."""
        return metrics_within_depth(self.metrics, self.top_k)

    def result_dir(self) -> Path:
        """``<output>/<method>/<llm>/<retriever>[__fuse][__k<top_k>][__<reranker>]`` (``__k`` only
        when ``top_k`` is not 100, so runs at two depths never overwrite each other); a fusion
        run's retriever part carries its settings when they are not the default
        (``bm25+minilm-weighted-0.3-0.7``)."""
        return Path(self.output_dir) / self.method / self.llm_label / self.retriever_label


@dataclass
class TaskOutcome:
    task: str
    evaluation: Evaluation
    files: list[Path]
    stats: dict[str, Any]


@dataclass
class ExperimentResult:
    config: RunConfig
    outcomes: list[TaskOutcome]
    average: dict[str, float]
    result_dir: Path
    llm_stats: dict[str, Any] = field(default_factory=dict)


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
    from r2med_agent.methods import get_method
    from r2med_agent.retrieval import make_retriever

    method_cls = get_method(cfg.method)
    tasks = [load_task(name, cfg.data_dir, allow_missing_qrels_docs=cfg.allow_missing_qrels_docs,
                       allow_count_mismatch=cfg.allow_count_mismatch)
             for name in cfg.tasks]
    out_dir = cfg.result_dir()
    beyond = [m for m in cfg.metrics if m not in cfg.scored_metrics]
    if beyond:
        log.info("scoring the top %d: %s left out (their cut-off is beyond the depth)",
                 cfg.top_k, ", ".join(beyond))

    # Everything that can fail cheaply (names, models, indexes) comes before any LLM work; the
    # LLM's name is checked before the indexes, which can take hours to build. The reranker's
    # model is checked (tokenizer, config) but its weights load when reranking starts: loaded now,
    # they would hold GPU memory an in-process vLLM engine expects to have.
    spec = None
    released = cfg.generations == "r2med"
    if cfg.method != "none":
        from r2med_agent.llm.registry import get_llm_spec

        spec = get_llm_spec(cfg.llm)  # type: ignore[arg-type]
    reranker = None
    if cfg.reranker:
        from r2med_agent.retrieval import make_reranker

        reranker = make_reranker(
            cfg.reranker, precision=cfg.precision, cache_path=cfg.cache_path, use_cache=cfg.use_cache,
            refresh=cfg.refresh_cache, chunk_size="auto" if cfg.chunk_size is None else cfg.chunk_size,
        )
        reranker.check()
    released_gens: dict[str, list[Generation]] = {}
    released_sources: dict[str, str] = {}
    if released:
        # Every task's file is found and checked before any index is built.
        from r2med_agent.released import load_generations

        for task in tasks:
            released_gens[task.name], released_sources[task.name] = load_generations(
                task, cfg.method, cfg.llm, spec.reasoning_format, cfg.data_dir  # type: ignore[arg-type, union-attr]
            )
        log.info("scoring R2MED's released %s generations of %s: no LLM is built", cfg.method, cfg.llm)

    _check_output_dir(out_dir)
    retrievers: dict[str, Any] = {}
    index_time: dict[str, float] = {}
    for task in tasks:
        t0 = time.perf_counter()
        retrievers[task.name] = make_retriever(
            cfg.retriever, task, show_progress=cfg.show_progress, **cfg.fusion_options,
            **_encoder_options(cfg),
        )
        index_time[task.name] = time.perf_counter() - t0

    params = None
    if spec is not None and not released:
        from r2med_agent.llm import default_sampling, make_llm

        params = _with_overrides(default_sampling(spec), cfg.sampling)
        if llm is None:
            # A method may change entry fields for its LLM (Search-o1 sends no system prompt).
            llm = make_llm(
                cfg.llm,  # type: ignore[arg-type]
                cache_path=cfg.cache_path,
                use_cache=cfg.use_cache,
                refresh=cfg.refresh_cache,
                overrides=dict(getattr(method_cls, "llm_overrides", {})) or None,
                chunk_size="auto" if cfg.chunk_size is None else cfg.chunk_size,
            )
            owned.append(llm)
    else:
        llm = None

    per_task_requests: dict[str, list[SearchRequest]] = {}
    per_task_gens: dict[str, list[Generation]] = {}
    per_task_samples: dict[str, list[list[Generation]]] = {}  # --samples N > 1: all samples per query
    per_task_traces: dict[str, list[Any]] = {}
    per_task_fused: dict[str, Run] = {}
    method = method_cls()
    loop_steps: list[dict[str, int]] | None = None

    if cfg.method == "none":
        for task in tasks:
            per_task_requests[task.name] = [SearchRequest(q.query_id, q.text) for q in task.queries]
    elif released:
        from r2med_agent.released import agentic_requests

        for task in tasks:
            gens = released_gens[task.name]
            per_task_gens[task.name] = gens
            per_task_requests[task.name] = (
                agentic_requests(task, gens) if getattr(method, "agentic", False) else method.to_requests(task, gens)
            )
    elif getattr(method, "agentic", False):
        loop_steps = _run_agentic(cfg, method, llm, spec, tasks, retrievers, per_task_requests,
                                  per_task_traces, per_task_fused)
    else:
        _run_expansion(cfg, method, llm, params, tasks, retrievers, per_task_requests, per_task_gens,
                       per_task_samples)

    runs: dict[str, Run] = {}
    retrieval_time: dict[str, float] = {}
    for task in tasks:
        t0 = time.perf_counter()
        requests = per_task_requests[task.name]
        if task.name in per_task_fused:
            run = per_task_fused[task.name]
        else:
            run = retrievers[task.name].search(requests, max(cfg.top_k, cfg.rerank_k if reranker else 0))
        if reranker is not None and not hasattr(reranker, "rerank_tasks"):
            corpus = {d.doc_id: d.full_text for d in task.corpus}
            run = reranker.rerank(requests, run, corpus, cfg.rerank_k)
        runs[task.name] = run
        retrieval_time[task.name] = time.perf_counter() - t0
    rerank_out: dict[str, Any] = {}
    if reranker is not None and hasattr(reranker, "rerank_tasks"):
        t0 = time.perf_counter()
        rerank_out = _llm_rerank(cfg, reranker, tasks, per_task_requests, runs, llm)
        share = (time.perf_counter() - t0) / max(len(tasks), 1)
        for task in tasks:
            retrieval_time[task.name] += share

    outcomes: list[TaskOutcome] = []
    for task in tasks:
        t0 = time.perf_counter()
        requests = per_task_requests[task.name]
        run = rerank_out[task.name].run if task.name in rerank_out else runs[task.name]
        if reranker is not None and cfg.rerank_cut:
            run = cut_run(run, cfg.rerank_k)
        ev = evaluate(run, task.qrels, cfg.scored_metrics, depth=cfg.top_k)
        # R2MED's evaluation_time: seconds the task's evaluation took (indexing, search, scoring)
        evaluation_s = index_time[task.name] + retrieval_time[task.name] + (time.perf_counter() - t0)
        every = per_task_samples.get(task.name)
        gens_for_stats = [g for s in every for g in s] if every else per_task_gens.get(task.name)
        stats = _task_stats(gens_for_stats, per_task_traces.get(task.name), spec)
        if released:
            stats.update(generations=0, cache_hits=0, released_generations=len(per_task_gens[task.name]),
                         llm_time_s=0.0, llm_time_new_s=0.0, cost_usd=None,
                         released_source=released_sources[task.name])
        if cfg.samples > 1:
            stats["samples"] = cfg.samples
        stats["retrieval_time_s"] = round(retrieval_time[task.name], 4)
        stats["index_time_s"] = round(index_time[task.name], 4)
        if task.name in rerank_out:
            _add_rerank_stats(stats, rerank_out[task.name].stats)
        files = _write_task_files(cfg, out_dir, task, run, ev, stats, per_task_gens.get(task.name),
                                  per_task_traces.get(task.name), requests, evaluation_s, every)
        if task.name in rerank_out:
            from r2med_agent.methods.loop import traces_to_jsonl

            files.append(atomic_write_text(out_dir / f"{task.name}.rerank.jsonl",
                                           traces_to_jsonl(rerank_out[task.name].traces)))
        outcomes.append(TaskOutcome(task.name, ev, files, stats))
        if ev.missing:
            log.warning("%s: %d of %d queries have no results and score 0", task.name,
                        len(ev.missing), ev.num_queries)

    average = average_over_tasks([o.evaluation.mean for o in outcomes])
    llm_stats = asdict(llm.stats) if llm is not None and hasattr(llm, "stats") else {}
    # The folder's summary covers every task result in it (a second --task run adds to it);
    # the "run" block is this run's own.
    folder_scores = _folder_scores(out_dir, {o.task: o.evaluation.mean for o in outcomes})
    rerank_llm = getattr(reranker, "built_llm", None)
    if rerank_llm is not None and rerank_llm is not llm and hasattr(rerank_llm, "stats"):
        llm_stats = {**llm_stats, "reranker": asdict(rerank_llm.stats)}
    summary = {
        "method": cfg.method,
        "llm": cfg.llm_label,
        "generations": cfg.generations,
        "retriever": cfg.retriever_label,
        "tasks": list(folder_scores),
        "average": average_over_tasks(list(folder_scores.values())),
        "depth": cfg.top_k,
        "per_task": folder_scores,
        "run": {"tasks": [o.task for o in outcomes], "average": average},
        "llm_stats": llm_stats,
        **({"loop_steps": loop_steps} if loop_steps is not None else {}),
        "config": _config_record(cfg),
        "precision": model_precisions(cfg),
        "evaluated_at": _now(),
    }
    atomic_write_json(out_dir / "summary.json", summary)
    return ExperimentResult(cfg, outcomes, average, out_dir, llm_stats)


def _folder_scores(out_dir: Path, this_run: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Mean scores of every ``<Task>.json`` in ``out_dir`` (this run's own where it made one),
    sorted by task name; files that cannot be read are skipped with a warning."""
    from r2med_agent.errors import DataError
    from r2med_agent.io import read_json

    scores: dict[str, dict[str, float]] = {}
    for path in sorted(out_dir.glob("*.json")):
        task = path.stem
        if path.name == "summary.json" or path.name.startswith(".") or task in this_run:
            continue
        try:
            rec = read_json(path, "result file")
        except DataError as e:
            log.warning("summary.json leaves out %s: %s", path.name, e)
            continue
        test = rec.get("test") if isinstance(rec, dict) else None
        if isinstance(test, dict) and rec.get("dataset_name") == task:
            scores[task] = {k: float(v) for k, v in test.items() if isinstance(v, (int, float))}
    scores.update(this_run)
    return dict(sorted(scores.items()))


def _llm_rerank(cfg: RunConfig, reranker: Any, tasks: Sequence[Task], per_task_requests: dict[str, list[SearchRequest]],
                runs: dict[str, Run], llm: Any) -> dict[str, Any]:
    """An LLM reranker over every task at once (one generate call per window position, or one
    for all pairs); the run's own LLM is reused when it is the reranker's."""
    from r2med_agent.retrieval.llm_rerank import RerankJob

    if llm is not None and cfg.llm == reranker.spec.llm:
        reranker.share_llm(llm)
    jobs = [
        RerankJob(task, per_task_requests[task.name], runs[task.name], {d.doc_id: d.full_text for d in task.corpus})
        for task in tasks
    ]
    t0 = time.perf_counter()
    outputs = reranker.rerank_tasks(jobs, cfg.rerank_k)
    log.info("%s reranked %d tasks in %.1f s", reranker.name, len(tasks), time.perf_counter() - t0)
    return {task.name: out for task, out in zip(tasks, outputs)}


def _add_rerank_stats(stats: dict[str, Any], rerank: dict[str, Any]) -> None:
    """An LLM reranker's tokens, time and cost join the task's totals (what ``compare --cost``
    sums); its own numbers stay apart under ``rerank``."""
    from r2med_agent.llm.registry import get_llm_spec

    rerank = dict(rerank)
    rerank["cost_usd"] = _cost_usd(get_llm_spec(rerank["llm"]), rerank["prompt_tokens"], rerank["completion_tokens"])
    for key in ("generations", "cache_hits", "prompt_tokens", "completion_tokens"):
        stats[key] = stats.get(key, 0) + rerank[key]
    for key in ("llm_time_s", "llm_time_new_s"):
        stats[key] = round(stats.get(key, 0.0) + rerank[key], 4)
    if rerank["cost_usd"] is not None:
        stats["cost_usd"] = round((stats.get("cost_usd") or 0.0) + rerank["cost_usd"], 6)
    stats["rerank"] = rerank


def _check_output_dir(out_dir: Path) -> None:
    """Create the result folder now, so an unusable ``--output-dir`` fails before any work."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{out_dir}: cannot create the result folder ({e.strerror}); check --output-dir") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"{out_dir}: the result folder is not writable; check --output-dir")


def _check_sampling_values(overrides: dict[str, Any]) -> None:
    """Reject sampling overrides out of range before any work (llama.cpp reads a
    ``max_tokens`` below 1 as "until the context is full"; vLLM fails mid-run)."""
    problems = []
    if "max_tokens" in overrides and overrides["max_tokens"] < 1:
        problems.append(f"--max-tokens must be at least 1, got {overrides['max_tokens']}")
    if "temperature" in overrides and overrides["temperature"] < 0:
        problems.append(f"--temperature must be >= 0 (0 = greedy), got {overrides['temperature']}")
    if "top_p" in overrides and not 0 < overrides["top_p"] <= 1:
        problems.append(f"--top-p must be in (0, 1], got {overrides['top_p']}")
    if problems:
        raise ConfigError("; ".join(problems))


def _check_fusion(cfg: RunConfig) -> None:
    """Fusion options need a '+'-joined --retriever and values in range (checked before any work)."""
    from r2med_agent.retrieval.fusion import DEFAULT_RRF_K, check_fusion_options

    n = len(cfg.retriever.split("+"))
    if n == 1 and (cfg.fusion != "rrf" or cfg.fusion_weights is not None or cfg.rrf_k != DEFAULT_RRF_K):
        raise ConfigError(
            f"--fusion, --fusion-weights and --rrf-k need a '+'-joined --retriever (e.g. bm25+minilm), "
            f"got '{cfg.retriever}'"
        )
    check_fusion_options(n, cfg.fusion, cfg.rrf_k, cfg.fusion_weights)


def _check_fixed_rankings(cfg: RunConfig) -> None:
    """NanoR2MED's shipped candidate lists hold one ranking per task query: refuse, before any LLM
    work, a method whose queries are an LLM's (``--method`` other than none, ``--loop-retriever``)."""
    from r2med_agent.retrieval.candidates import candidate_names

    fixed = set(candidate_names())
    used = [("--retriever", cfg.retriever)] + ([("--loop-retriever", cfg.loop_retriever)] if cfg.loop_retriever else [])
    for option, spec in used:
        names = [p.strip() for p in spec.split("+") if p.strip() in fixed]
        if names and cfg.method != "none":
            raise ConfigError(
                f"{option} {spec}: {', '.join(names)} answer the task's own queries from a fixed list "
                f"and cannot search for what --method {cfg.method} generates; use --method none"
            )


def _with_overrides(params: SamplingParams, overrides: dict[str, Any]) -> SamplingParams:
    """Apply CLI sampling overrides; unknown names are errors naming the allowed ones."""
    allowed = set(params.to_dict())
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ConfigError(f"unknown sampling option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    return replace(params, **overrides)


def _run_expansion(cfg, method, llm, params, tasks, retrievers, per_task_requests, per_task_gens,
                   per_task_samples) -> None:
    """Single-shot methods: render every task's prompts, ONE generate call, then requests."""
    prompts: list[list[dict[str, str]]] = []
    metas: list[dict[str, Any]] = []
    spans: dict[str, tuple[int, int]] = {}
    hashes: list[str] = []  # one per prompt: part of each generation's cache key
    for task in tasks:
        first_pass = None
        if getattr(method, "needs_first_pass", False):
            first_pass = _bm25_first_pass(cfg, task, retrievers)
        task_prompts = method.build_prompts(task, first_pass)
        spans[task.name] = (len(prompts), len(prompts) + len(task_prompts))
        prompts.extend(task_prompts)
        metas.extend(
            {"task": task.name, "query_id": q.query_id, "method": cfg.method, "text": q.text,
             "doc_id": sorted(task.qrels.get(q.query_id, {}))}
            for q in task.queries
        )
        hashes.extend([method.template_hash(task)] * len(task_prompts))
    if cfg.samples > 1:
        samples = llm.generate_samples(prompts, params, cfg.samples, meta=metas, template_hash=hashes)
        gens = [s[0] for s in samples]
    else:
        gens = llm.generate(prompts, params, meta=metas, template_hash=hashes)
        samples = [[g] for g in gens]
    for task in tasks:
        a, b = spans[task.name]
        per_task_gens[task.name] = gens[a:b]
        requests = method.to_requests(task, gens[a:b])
        if cfg.samples > 1:
            # Samples 2..N join the first; a blank first sample leaves the plain query as is.
            requests = [
                replace(r, more_expansions=tuple(g.final.strip() for g in s[1:])) if r.combine != "none" else r
                for r, s in zip(requests, samples[a:b])
            ]
            per_task_samples[task.name] = samples[a:b]
        per_task_requests[task.name] = requests


def _encoder_options(cfg: RunConfig) -> dict[str, Any]:
    """``make_retriever``'s encoder backend option, when ``--encoder-backend`` was given."""
    return {} if cfg.encoder_backend is None else {"encoder_backend": cfg.encoder_backend}


def _bm25_first_pass(cfg: RunConfig, task: Task, retrievers: dict[str, Any]) -> Run:
    """LameR's first pass: the top 10 of ``cfg.first_pass`` for every query (reuses the run's own
    index when it is the same retriever)."""
    from r2med_agent.retrieval import make_retriever

    first = retrievers[task.name] if cfg.retriever == cfg.first_pass else make_retriever(
        cfg.first_pass, task, show_progress=cfg.show_progress
    )
    return first.search([SearchRequest(q.query_id, q.text) for q in task.queries], 10)


def cut_run(run: Run, k: int) -> Run:
    """Each query's ``k`` best documents (score order; equal scores keep the run's order)."""
    return {
        qid: dict(sorted(docs.items(), key=lambda kv: -kv[1])[:k]) for qid, docs in run.items()
    }


def _run_agentic(cfg, method, llm, spec, tasks, retrievers, per_task_requests, per_task_traces,
                 per_task_fused) -> list[dict[str, int]]:
    """Run the loop over all tasks; returns its per-step statistics (calls, backend calls)."""
    from r2med_agent.retrieval import make_retriever

    loop_spec = cfg.loop_retriever or cfg.retriever
    loop_retrievers = {
        t.name: retrievers[t.name] if loop_spec == cfg.retriever
        else make_retriever(loop_spec, t, show_progress=cfg.show_progress,
                            **({"precision": cfg.precision} if cfg.precision else {}),
                            **_encoder_options(cfg))
        for t in tasks
    }
    # The loops fix their own sampling (Search-R1 greedy, Search-o1 0.7/0.8/20), adapted to the
    # model as the original runs it (Search-o1 with QwQ: repetition penalty 1.05, 20,480 tokens);
    # CLI overrides win, then that, then an entry's own repetition penalty. The registry's
    # max_tokens caps each step unless the method set it for the model (a small local model gets
    # its short budget).
    if spec is not None:
        method = method.for_model(spec.model)
    sampling = dict(cfg.sampling)
    for name, value in method.model_sampling.items():
        sampling.setdefault(name, value)
    if spec is not None:
        # The entry's seed (null: none sent) unless --seed overrides it; the loops' own default
        # is the reference's 42, which is what every registry entry has.
        sampling.setdefault("seed", spec.seed)
    if spec is not None and getattr(spec, "repetition_penalty", 1.0) != 1.0:
        sampling.setdefault("repetition_penalty", spec.repetition_penalty)
    if spec is not None and spec.max_tokens < method.params.max_tokens:
        sampling.setdefault("max_tokens", spec.max_tokens)
    results = method.run(
        [(t, loop_retrievers[t.name]) for t in tasks], llm, final=cfg.final, top_k=cfg.top_k,
        sampling=sampling, final_retrievers=[retrievers[t.name] for t in tasks],
    )
    for task in tasks:
        res = results[task.name]
        per_task_requests[task.name] = list(res.requests)
        per_task_traces[task.name] = list(res.traces)
        if res.fused_run is not None:
            per_task_fused[task.name] = res.fused_run
    steps = next((r.steps for r in results.values()), ())
    return [s.to_dict() for s in steps]


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


def _write_task_files(cfg, out_dir, task, run, ev, stats, gens, traces, requests,
                      evaluation_s: float, samples=None) -> list[Path]:
    from r2med_agent.evaluation import write_trec_run

    tag = f"r2med-agent.{cfg.method}.{cfg.llm_label}.{cfg.retriever_label}"
    files = [atomic_write_text(out_dir / f"{task.name}.run", write_trec_run(run, tag, cfg.top_k))]
    record = {
        "dataset_name": task.name,
        "model_name": f"{cfg.method}/{cfg.llm_label}/{cfg.retriever_label}",
        "evaluation_time": round(evaluation_s, 4),  # a duration in seconds, as R2MED's
        "evaluated_at": _now(),
        "generations": cfg.generations,
        "test": ev.mean,
        "depth": cfg.top_k,
        "num_queries": ev.num_queries,
        "missing_queries": len(ev.missing),
        "missing_query_ids": list(ev.missing),
        "per_query": ev.per_query,
        "stats": stats,
        "config": _config_record(cfg),
        "precision": model_precisions(cfg),
        "source": task.source,
        "corpus_fingerprint": task.fingerprint,
    }
    files.append(atomic_write_json(out_dir / f"{task.name}.json", record))
    if gens is not None:
        import json

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
        files.append(atomic_write_text(out_dir / f"{task.name}.generations.jsonl", "\n".join(lines) + "\n"))
    if traces is not None:
        import json

        from r2med_agent.methods.agentic import trace_to_dict

        text = "".join(json.dumps(trace_to_dict(t), ensure_ascii=False) + "\n" for t in traces)
        files.append(atomic_write_text(out_dir / f"{task.name}.traces.jsonl", text))
    return files


def model_precisions(cfg: RunConfig) -> dict[str, str]:
    """The precision each local encoder and reranker of ``cfg`` runs at on a GPU (``--precision``
    or its registry entry's; on a CPU everything runs in float32), by registry name."""
    from r2med_agent.retrieval.dense.spec import encoder_registry
    from r2med_agent.retrieval.rerank import get_reranker_spec

    encoders = encoder_registry()
    names = {p.strip() for spec in (cfg.retriever, cfg.loop_retriever or "") for p in spec.split("+")}
    out = {n: cfg.precision or encoders[n].precision
           for n in sorted(names) if n in encoders and encoders[n].kind == "hf"}
    if cfg.reranker:
        out[cfg.reranker] = cfg.precision or get_reranker_spec(cfg.reranker).precision
    return out


def _config_record(cfg: RunConfig) -> dict[str, Any]:
    """The configuration as written into result files (no secrets: names and settings only)."""
    rec = asdict(cfg)
    rec["tasks"] = list(cfg.tasks)
    rec["metrics"] = list(cfg.scored_metrics)
    for key in ("data_dir", "output_dir", "cache_path"):
        rec[key] = str(rec[key]) if rec[key] is not None else None
    rec.pop("show_progress", None)
    return rec


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
