"""``run``, ``evaluate``, ``tasks`` and ``llms``: thin commands over runner, evaluation and registries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from r2med_agent.cli.app import app
from r2med_agent.experiment.spec import field_help as _field_help


def field_help(name: str) -> str:
    """A spec field's help, with the registries' names where it names them."""
    from r2med_agent.methods import METHODS

    return _field_help(name).replace("{methods}", " | ".join(METHODS))

console = Console(stderr=False)

_HEADLINE = ("ndcg_at_10", "recall_at_100", "mrr")


def print_listing(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """A listing whose cells are never cut: a table on a terminal (the first column kept on one
    line, the others folded when the terminal is narrow), plain aligned columns otherwise, so a
    pipe (``| grep``) gets every name whole whatever the width."""
    if console.is_terminal:
        table = Table(title=title)
        for i, c in enumerate(columns):
            table.add_column(c, no_wrap=i == 0, overflow="fold")
        for r in rows:
            table.add_row(*(Text(cell) for cell in r))  # plain text: names may hold [brackets]
        console.print(table)
        return
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    for r in [columns, *rows]:
        line = "  ".join(cell.ljust(w) for cell, w in zip(r, widths))
        console.print(line.rstrip(), markup=False, highlight=False, soft_wrap=True)
_SHORT = {"ndcg_at_10": "nDCG@10", "recall_at_100": "R@100", "mrr": "MRR"}


# The run's options. Every run spec field's option takes its help from the spec
# (r2med_agent.experiment.spec.field_help); the others are where and how the run happens.
_SPEC_OPTIONS = {
    "method": typer.Option("none", "--method", "-m", help=field_help("method")),
    "llm": typer.Option(None, "--llm", "-l", help=field_help("llm")),
    "retriever": typer.Option("bm25", "--retriever", "-r", help=field_help("retriever")),
    "loop_retriever": typer.Option(None, "--loop-retriever", help=field_help("loop_retriever")),
    "final": typer.Option("default", "--final", help=field_help("final")),
    "fusion": typer.Option("rrf", "--fusion", help=field_help("fusion")),
    "fusion_weights": typer.Option(None, "--fusion-weights", help=field_help("fusion_weights")),
    "fusion_depth": typer.Option(None, "--fusion-depth", help=field_help("fusion_depth")),
    "rrf_k": typer.Option(60, "--rrf-k", help=field_help("rrf_k")),
    "precision": typer.Option(None, "--precision", help=field_help("precision")),
    "reranker": typer.Option(None, "--reranker", help=field_help("reranker")),
    "rerank_k": typer.Option(100, "--rerank-k", help=field_help("rerank_k")),
    "rerank_cut": typer.Option(False, "--rerank-cut", help=field_help("rerank_cut")),
    "first_pass": typer.Option("bm25", "--first-pass", help=field_help("first_pass")),
    "generations": typer.Option("fresh", "--generations", help=field_help("generations")),
    "top_k": typer.Option(100, "--top-k", "-k", help=field_help("top_k")),
    "samples": typer.Option(1, "--samples", help=field_help("samples")),
    "encoder_backend": typer.Option(None, "--encoder-backend", help=field_help("encoder_backend")),
    "bm25_k1": typer.Option(None, "--k1", help=field_help("bm25_k1")),
    "bm25_b": typer.Option(None, "--b", help=field_help("bm25_b")),
    "exclude_identical_ids": typer.Option(False, "--exclude-identical-ids", help=field_help("exclude_identical_ids")),
    "empty_generation": typer.Option("query", "--empty-generation", help=field_help("empty_generation")),
    "llm_prompt": typer.Option("chat", "--llm-prompt", help=field_help("llm_prompt")),
    "rerank_max_length": typer.Option(None, "--rerank-max-length", help=field_help("rerank_max_length")),
    "prompts_from": typer.Option(None, "--prompts", show_default=False, help=field_help("prompts_from")),
    # sampling overrides: the spec's ``sampling`` mapping
    "temperature": typer.Option(None, "--temperature", help="Override the LLM's default sampling temperature."),
    "top_p": typer.Option(None, "--top-p", help="Override top_p."),
    "max_tokens": typer.Option(None, "--max-tokens", help="Override the most tokens generated per call."),
    "seed": typer.Option(None, "--seed", help="Override the sampling seed: an integer, or 'none' to send no seed (unseeded sampling; the loops too)."),
}
_RUN_OPTIONS = {
    "task": typer.Option(
        None, "--task", "-t", show_default=False,
        help="Task name, a comma list, 'all' (the 8 R2MED tasks), 'nano-all' (NanoR2MED), 'bright-all' (BRIGHT's 12 tasks, bright-<task>), 'bright-long-all' (its 8 long-document tasks), or 'list' to print the registry. Old reference-code names (PMC-Treat, PMCPatients, ...) are accepted. Default: sample; with --data-dir, the task(s) in that folder, named after their folders (a name the registry does not know is a task of your own).",
    ),
    "data_dir": typer.Option(None, "--data-dir", "-d", help="Local data: a task folder or a folder of task folders, in R2MED layout (query.jsonl, corpus.jsonl, qrels.jsonl|qrels.txt), BEIR layout or BRIGHT's layout (examples/, documents/, long_documents/, <llm>_reason/). Default: the Hugging Face hub."),
    "allow_missing_qrels_docs": typer.Option(False, "--allow-missing-qrels-docs", help="Keep qrels that name documents missing from the corpus (R2MED's demo files have them) with a warning, instead of stopping; they still count as relevant, so scores cannot reach 1."),
    "allow_count_mismatch": typer.Option(False, "--allow-count-mismatch", help="Use a --data-dir copy of a registered task (e.g. Biology) whose numbers of queries or documents differ from the registry's (refused otherwise); recorded in the results."),
    "output_dir": typer.Option(Path("results"), "--output-dir", "-o", help="Root of the result tree: <output>/<method>/<llm>/<leaf>/<Task>.json|.run, one folder per run spec (docs/results.md)."),
    "no_cache": typer.Option(False, "--no-cache", help="Neither read nor write the generation cache."),
    "refresh_cache": typer.Option(False, "--refresh-cache", help="Regenerate every text and overwrite the cached one."),
    "cache_path": typer.Option(None, "--cache-path", help="Generation cache file (default: $R2MED_CACHE_DIR/generations.sqlite)."),
    "chunk_size": typer.Option(None, "--chunk-size", help="LLM cache misses per backend call (each generation is committed to the cache as it finishes); 0 = all in one call (one vLLM engine call). Default: the LLM entry's chunk_size (auto: vllm all, openai 256, local 4)."),
    "candidates": typer.Option(None, "--candidates", help="First-stage TREC run files to rerank exactly as given, in place of --retriever: a run file (one task), or a folder with <Task>.run|.trec|.txt, <Task>/<file> or ReasonRank's r2med_<Task>/<file> per task. Results record the files' hash."),
    "split": typer.Option("test", "--split", help="The qrels split of a BEIR folder (qrels/<split>.tsv); only the queries it names run, as BEIR's loader keeps them. Recorded in each result's source."),
    "all_queries": typer.Option(False, "--all-queries", help="Also run a BEIR folder's queries that the split's qrels do not name (unscored)."),
    "no_eval": typer.Option(False, "--no-eval", help="Run every stage and write the run, generations and traces, but score nothing (what a folder without qrels gets)."),
    "allow_missing_candidates": typer.Option(False, "--allow-missing-candidates", help="Leave out (with a warning giving their number) candidate documents the task's corpus lacks, instead of stopping."),
    "config": typer.Option(None, "--config", help="User config YAML adding or replacing entries of the registries: 'llms:', 'encoders:', 'rerankers:' (cross-encoders and LLM rerankers) and 'tasks:'."),
    "progress": typer.Option(True, "--progress/--no-progress", show_default=False, help="Progress of generation, encoding, indexing and reranking (default on): a bar when standard error is a terminal, else (a log file) a timestamped line every --progress-interval seconds, never a bar. --no-progress shows none."),
    "progress_interval": typer.Option(30.0, "--progress-interval", min=0.0, help="Seconds between the plain progress lines written when standard error is not a terminal."),
}
_O = {**_SPEC_OPTIONS, **_RUN_OPTIONS}


@app.command("run")
def run_command(
    task: Optional[str] = _O["task"],
    method: str = _O["method"],
    llm: Optional[str] = _O["llm"],
    retriever: str = _O["retriever"],
    loop_retriever: Optional[str] = _O["loop_retriever"],
    final: str = _O["final"],
    fusion: str = _O["fusion"],
    fusion_weights: Optional[str] = _O["fusion_weights"],
    fusion_depth: Optional[str] = _O["fusion_depth"],
    rrf_k: int = _O["rrf_k"],
    precision: Optional[str] = _O["precision"],
    reranker: Optional[str] = _O["reranker"],
    rerank_k: int = _O["rerank_k"],
    rerank_cut: bool = _O["rerank_cut"],
    first_pass: str = _O["first_pass"],
    generations: str = _O["generations"],
    top_k: int = _O["top_k"],
    data_dir: Optional[Path] = _O["data_dir"],
    allow_missing_qrels_docs: bool = _O["allow_missing_qrels_docs"],
    allow_count_mismatch: bool = _O["allow_count_mismatch"],
    split: str = _O["split"],
    all_queries: bool = _O["all_queries"],
    no_eval: bool = _O["no_eval"],
    output_dir: Path = _O["output_dir"],
    no_cache: bool = _O["no_cache"],
    refresh_cache: bool = _O["refresh_cache"],
    cache_path: Optional[Path] = _O["cache_path"],
    chunk_size: Optional[int] = _O["chunk_size"],
    samples: int = _O["samples"],
    temperature: Optional[float] = _O["temperature"],
    top_p: Optional[float] = _O["top_p"],
    max_tokens: Optional[int] = _O["max_tokens"],
    seed: Optional[str] = _O["seed"],
    encoder_backend: Optional[str] = _O["encoder_backend"],
    bm25_k1: Optional[float] = _O["bm25_k1"],
    bm25_b: Optional[float] = _O["bm25_b"],
    exclude_identical_ids: bool = _O["exclude_identical_ids"],
    empty_generation: str = _O["empty_generation"],
    llm_prompt: str = _O["llm_prompt"],
    rerank_max_length: Optional[int] = _O["rerank_max_length"],
    prompts_from: Optional[str] = _O["prompts_from"],
    candidates: Optional[Path] = _O["candidates"],
    allow_missing_candidates: bool = _O["allow_missing_candidates"],
    config: Optional[Path] = _O["config"],
    progress: bool = _O["progress"],
    progress_interval: float = _O["progress_interval"],
) -> None:
    """Run a method over one or more tasks, write TREC runs and R2MED-style JSON, print scores."""
    from r2med_agent import progress as progress_display
    from r2med_agent.config import set_user_config
    from r2med_agent.data import local_task_names, task_names
    from r2med_agent.runner import RunConfig, run_experiment

    if config is not None:
        set_user_config(config)
    progress_display.configure(interval_s=progress_interval)
    if task == "list" or reranker == "list":  # the --config above is already in force
        (tasks_command if task == "list" else rerankers_command)(config=None)
        return
    if task is None:
        names = local_task_names(data_dir) if data_dir is not None else ["sample"]
    else:
        names = task_names(task, data_dir)
    cfg = RunConfig(
        method=method, llm=llm, retriever=retriever, loop_retriever=loop_retriever, final=final, fusion=fusion,
        fusion_weights=_parse_weights(fusion_weights), fusion_depth=_parse_depths(fusion_depth), rrf_k=rrf_k,
        precision=precision, reranker=reranker, sampling=_sampling(temperature, top_p, max_tokens, seed),
        rerank_k=rerank_k, rerank_cut=rerank_cut, first_pass=first_pass, generations=generations, top_k=top_k,
        samples=samples, encoder_backend=encoder_backend, bm25_k1=bm25_k1, bm25_b=bm25_b,
        exclude_identical_ids=exclude_identical_ids, empty_generation=empty_generation, llm_prompt=llm_prompt,
        rerank_max_length=rerank_max_length, prompts_from=prompts_from, tasks=tuple(names), data_dir=data_dir,
        allow_missing_qrels_docs=allow_missing_qrels_docs, allow_count_mismatch=allow_count_mismatch,
        split=split, all_queries=all_queries, no_eval=no_eval,
        output_dir=output_dir, use_cache=not no_cache, refresh_cache=refresh_cache, cache_path=cache_path,
        chunk_size=chunk_size, show_progress=progress,
        candidates_path=candidates, allow_missing_candidates=allow_missing_candidates,
    )
    print_summary(run_experiment(cfg))


def _sampling(temperature: Optional[float], top_p: Optional[float], max_tokens: Optional[int],
              seed: Optional[str]) -> dict:
    """The sampling overrides the options give (those left unset are not overrides)."""
    sampling = {k: v for k, v in {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens}.items()
                if v is not None}
    if seed is not None:
        sampling["seed"] = parse_seed(seed)
    return sampling


def _score(means: dict[str, float], metric: str) -> str:
    """A mean to four decimals; "-" for a metric not scored (its cut-off is beyond --top-k)."""
    return f"{means[metric]:.4f}" if metric in means else "-"


def _parse_weights(text: Optional[str]) -> Optional[tuple[float, ...]]:
    """``"0.3,0.7"`` -> ``(0.3, 0.7)``; anything else is a ConfigError naming the option."""
    from r2med_agent.errors import ConfigError

    if text is None:
        return None
    try:
        return tuple(float(w) for w in text.split(","))
    except ValueError:
        raise ConfigError(
            f"--fusion-weights: '{text}' is not a comma-separated list of numbers (e.g. 0.3,0.7)"
        ) from None


def _parse_depths(text: Optional[str]) -> Optional[tuple[int, ...]]:
    """``"1000,200"`` -> ``(1000, 200)``; anything else is a ConfigError naming the option."""
    from r2med_agent.errors import ConfigError

    if text is None:
        return None
    try:
        return tuple(int(d) for d in text.split(","))
    except ValueError:
        raise ConfigError(f"--fusion-depth: '{text}' is not a comma-separated list of whole numbers (e.g. 1000,200)") from None


def print_summary(result) -> None:
    """The closing table: headline metrics per task and their average, plus LLM work done."""
    from r2med_agent.console import figure_column, label_column, print_table

    table = Table(title=Text(result.config.label))
    uses_llm = result.config.method != "none"
    label_column(table, "task")
    for m in _HEADLINE:
        figure_column(table, _SHORT[m])
    figure_column(table, "queries")
    figure_column(table, "empty")
    # Blank generated texts get a column when a task had some (the common case, none, leaves
    # room for the figures at 80 columns).
    blanks = uses_llm and any(o.stats.get("empty_generations", 0) for o in result.outcomes)
    if uses_llm:
        figure_column(table, "new\ngens")
        figure_column(table, "cached")
    if blanks:
        figure_column(table, "empty\ngens")
    for o in result.outcomes:
        cells = [
            o.task,
            *(_score(o.evaluation.mean, m) for m in _HEADLINE),
            str(o.queries_run if o.not_scored else o.evaluation.num_queries),
            str(len(o.evaluation.missing)),
        ]
        if uses_llm:
            cells += [str(o.stats.get("generations", 0)), str(o.stats.get("cache_hits", 0))]
        if blanks:
            cells.append(str(o.stats.get("empty_generations", 0)))
        table.add_row(*cells)
    if len(result.outcomes) > 1:
        table.add_row(
            "average", *(_score(result.average, m) for m in _HEADLINE), *[""] * (len(table.columns) - 4),
            style="bold",
        )
    print_table(console, table)
    console.print("empty = queries with no retrieved document (they score 0)"
                  + ("; empty gens = blank generated texts (--empty-generation)" if blanks else ""), style="dim")
    for o in result.outcomes:
        if o.not_scored:
            console.print(f"{o.task}: not scored ({o.not_scored}); its {o.queries_run} queries ran and their run, "
                          "generations and traces are written", markup=False, highlight=False)
    gens = sum(o.stats.get("generations", 0) for o in result.outcomes)
    hits = sum(o.stats.get("cache_hits", 0) for o in result.outcomes)
    released = sum(o.stats.get("released_generations", 0) for o in result.outcomes)
    if result.config.method != "none":
        console.print(f"LLM generations: {gens} new, {hits} from cache"
                      + (f", {released} released by {result.config.generations.upper()} (no LLM built)"
                         if result.config.generations in ("r2med", "bright") else ""))
    console.print(f"results: {result.result_dir}", markup=False, highlight=False, soft_wrap=True)


@app.command("evaluate")
def evaluate_command(
    run: Path = typer.Option(..., "--run", help="TREC run file (qid Q0 docid rank score tag)."),
    qrels: Path = typer.Option(..., "--qrels", help="Qrels: TREC format (qid 0 docid grade), 3 columns, or R2MED qrels.jsonl."),
    depth: int = typer.Option(100, "--depth", help="Documents per query scored (R2MED: 100)."),
    per_query: bool = typer.Option(False, "--per-query", help="Also print every query's scores."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Score a TREC run file against qrels with trec_eval semantics; every qrels query counts."""
    from r2med_agent.data import read_qrels_file
    from r2med_agent.errors import ConfigError
    from r2med_agent.evaluation import evaluate, read_trec_run

    if depth < 1:
        raise ConfigError(f"--depth must be at least 1 (R2MED scores the top 100), got {depth}")
    run_data = read_trec_run(run)
    qrels_data = read_qrels_file(qrels)
    ev = evaluate(run_data, qrels_data, depth=depth)
    if as_json:
        out = {"test": ev.mean, "num_queries": ev.num_queries, "missing_queries": len(ev.missing)}
        if per_query:
            out["per_query"] = ev.per_query
        console.print_json(json.dumps(out))
        return
    from r2med_agent.console import figure_column, label_column, print_table

    table = Table(title=f"{run.name} ({ev.num_queries} queries, {len(ev.missing)} with no results)")
    label_column(table, "metric")
    figure_column(table, "mean")
    for m, v in ev.mean.items():
        table.add_row(m, f"{v:.4f}")
    print_table(console, table)
    if per_query:
        for qid, scores in ev.per_query.items():
            console.print(qid, " ".join(f"{m}={scores[m]:.4f}" for m in _HEADLINE if m in scores))


@app.command("tasks")
def tasks_command(
    config: Optional[Path] = typer.Option(None, "--config", help="User config YAML with extra 'tasks:' entries."),
) -> None:
    """List the task registry: the 8 R2MED tasks, NanoR2MED splits, BRIGHT's 12 tasks and 8 long-document tasks, and the embedded samples."""
    from r2med_agent.config import set_user_config
    from r2med_agent.data import list_tasks

    if config is not None:
        set_user_config(config)

    cols = ["name", "family", "group", "repo", "revision", "queries", "docs"]
    rows = []
    for r in list_tasks():
        row = dict(r)
        if row.get("revision") and len(str(row["revision"])) == 40:
            row["revision"] = str(row["revision"])[:12]
        rows.append(["" if row.get(c) in (None, "") else str(row[c]) for c in cols])
    print_listing("tasks", cols, rows)


@app.command("llms")
def llms_command(
    config: Optional[Path] = typer.Option(None, "--config", help="User config YAML with extra 'llms:' entries."),
) -> None:
    """List the LLM registry (short name, backend, model, reasoning format)."""
    from r2med_agent.config import load_registry, set_user_config
    from r2med_agent.llm.registry import LLMSpec

    if config is not None:
        set_user_config(config)
    rows = [[name, spec.backend, spec.model, spec.reasoning_format]
            for name, spec in sorted(load_registry("llms", LLMSpec).items())]
    print_listing("LLMs", ["name", "backend", "model", "reasoning format"], rows)


@app.command("rerankers")
def rerankers_command(
    config: Optional[Path] = typer.Option(None, "--config", help="User config YAML with extra 'rerankers:' entries."),
) -> None:
    """List the reranker registry: kind (cross-encoder, listwise, pointwise-reasoning, groupwise,
    setwise), model (a cross-encoder's checkpoint, an LLM reranker's LLM) and input format."""
    from r2med_agent.config import set_user_config
    from r2med_agent.retrieval.rerank.spec import reranker_registry

    if config is not None:
        set_user_config(config)
    rows = []
    for name, spec in sorted(reranker_registry().items()):
        kind = spec.kind_of
        if kind.has_model:
            model = spec.model + (f" (LoRA on {spec.base_model})" if spec.base_model else "")
            fmt = "(query, document) pairs" + (f", logit {spec.score_index}" if spec.score_index else "")
        elif kind.uses_llm:
            model, fmt = f"LLM {spec.llm}", spec.format
        else:
            model, fmt = "-", spec.format
        rows.append([name, spec.kind, model, fmt])
    print_listing("rerankers", ["name", "kind", "model", "format"], rows)


@app.command("encoders")
def encoders_command(
    config: Optional[Path] = typer.Option(None, "--config", help="User config YAML with extra 'encoders:' entries."),
) -> None:
    """List the encoder registry: model, pooling, backend, and whether vLLM can run it (or why not)."""
    from r2med_agent.config import set_user_config
    from r2med_agent.retrieval.dense.spec import encoder_registry
    from r2med_agent.retrieval.dense.vllm import vllm_unsupported_reason

    if config is not None:
        set_user_config(config)
    rows = []
    for name, spec in sorted(encoder_registry().items()):
        if spec.kind == "api":
            rows.append([name, f"api ({spec.provider})", spec.model, "-", "-", "-"])
            continue
        model = spec.model or f"{spec.query_model} / {spec.doc_model}"
        reason = vllm_unsupported_reason(spec)
        rows.append([name, spec.backend, model, spec.pooling, "yes" if reason is None else "no", reason or ""])
    print_listing("encoders", ["name", "backend", "model", "pooling", "vLLM", "why not"], rows)


def parse_seed(value: str) -> int | None:
    """``--seed``: an integer, or ``none``/``null`` for no seed; anything else exits with code 2."""
    from r2med_agent.errors import ConfigError

    text = value.strip().lower()
    if text in ("none", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--seed must be an integer or 'none', got {value!r}") from None
