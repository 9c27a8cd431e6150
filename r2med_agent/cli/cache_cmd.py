"""``cache stats|export|import|repair``: inspect the generation cache, move generations between it and
R2MED's published ``query_with_hydoc.jsonl`` files, keep what a damaged cache file still holds."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from r2med_agent.cli.common import app
from r2med_agent.errors import ConfigError, DataError

cache_app = typer.Typer(
    help="Inspect the generation cache; export it as, or import it from, R2MED's query_with_hydoc.jsonl.",
    no_args_is_help=True,
)
app.add_typer(cache_app, name="cache")

console = Console(stderr=False)

_CACHE_PATH_HELP = "Generation cache file (default: $R2MED_CACHE_DIR/generations.sqlite)."


def _open_cache(cache_path: Optional[Path], must_exist: bool):
    from r2med_agent.llm import GenerationCache, default_cache_path

    path = cache_path or default_cache_path()
    if must_exist and not path.exists():
        raise DataError("no generation cache here (run a method first, or pass --cache-path)", path)
    return GenerationCache(path)


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


@cache_app.command("stats")
def stats_command(
    cache_path: Optional[Path] = typer.Option(None, "--cache-path", help=_CACHE_PATH_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Rows, tokens and model seconds per model, the tasks/methods they serve, and the size on disk."""
    cache = _open_cache(cache_path, must_exist=True)
    per_model = cache.stats()
    # One query can be served by several generations (samples, settings, loop steps): count
    # distinct queries and the generations apart, as the columns say.
    per_use: dict[tuple[str, str, str], tuple[set[str], set[str]]] = {}
    for use, rec in cache.uses():
        queries, keys = per_use.setdefault((rec.model_id, use.task, use.method), (set(), set()))
        queries.add(use.query_id)
        keys.add(use.key)
    if as_json:
        out = {
            "path": str(cache.path),
            "size_bytes": cache.size_bytes(),
            "models": [
                {
                    "model_id": s.model_id,
                    "rows": s.rows,
                    "prompt_tokens": s.prompt_tokens,
                    "completion_tokens": s.completion_tokens,
                    "model_time_s": round(s.latency_s, 3),
                }
                for s in per_model
            ],
            "uses": [{"model_id": m, "task": t, "method": me, "queries": len(q), "generations": len(g)}
                     for (m, t, me), (q, g) in sorted(per_use.items())],
        }
        typer.echo(json.dumps(out, indent=2))
        return
    from r2med_agent.console import figure_column, label_column, print_table

    table = Table(title=f"{cache.path} ({_human_bytes(cache.size_bytes())})")
    label_column(table, "model")
    for col in ("rows", "prompt\ntokens", "completion\ntokens", "model s"):
        figure_column(table, col)
    for s in per_model:
        table.add_row(s.model_id, str(s.rows), f"{s.prompt_tokens:,}", f"{s.completion_tokens:,}", f"{s.latency_s:.1f}")
    print_table(console, table)
    if per_use:
        uses = Table(title="queries served, by task and method")
        for col in ("model", "task", "method"):
            label_column(uses, col)
        for col in ("queries", "generations"):
            figure_column(uses, col)
        for (m, t, me), (q, g) in sorted(per_use.items()):
            uses.add_row(m, t or "-", me or "-", str(len(q)), str(len(g)))
        print_table(console, uses)


@cache_app.command("repair")
def repair_command(
    cache_path: Optional[Path] = typer.Option(None, "--cache-path", help=_CACHE_PATH_HELP),
) -> None:
    """Keep what a damaged cache file still holds: every readable generation (and its uses) goes
    into a new file at its path, the damaged file is renamed aside (<name>.damaged-<time>), nothing
    is deleted. Run it when no run is using the cache."""
    from r2med_agent.llm import default_cache_path
    from r2med_agent.llm.cache.repair import repair

    report = repair(cache_path or default_cache_path())
    counted = report.counted["generations"]
    of = f" of the {counted} the damaged file counts" if counted is not None else ""
    added = f" (with the {report.unsaved} a run could not write into it)" if report.unsaved else ""
    typer.echo(f"kept {report.kept['generations']} generations{of}{added} and {report.kept['uses']} uses in "
               f"{report.path}; {report.unreadable} unreadable rows or ranges left out")
    typer.echo(f"the damaged file is now {report.damaged} (delete it when you no longer need it)")


def _model_ids(model: str) -> list[str]:
    """A registry name resolves to its model id; anything else is taken as a model id."""
    from r2med_agent.llm import load_llm_specs

    ids = [model]
    spec = load_llm_specs().get(model)
    if spec is not None:
        ids.insert(0, spec.model)
    return ids


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    from r2med_agent.io import iter_jsonl

    return [obj for _, obj in iter_jsonl(path)]


@cache_app.command("export")
def export_command(
    model: str = typer.Option(..., "--model", help="LLM registry name (e.g. qwen-7b) or the model id stored in the cache."),
    out: Path = typer.Option(..., "--out", "-o", help="File to write (atomically; a symlink is written through, '-' is standard output), e.g. Biology/hyde/qwen-7b/query_with_hydoc.jsonl."),
    task: Optional[str] = typer.Option(None, "--task", "-t", help="Task name the generations were made for (needed when the cache holds several)."),
    method: Optional[str] = typer.Option(None, "--method", "-m", help="Method name (hyde, query2doc, lamer, ...; needed when the cache holds several)."),
    fmt: str = typer.Option("r2med", "--format", help="Output layout; 'r2med' writes query_with_hydoc.jsonl rows: id, text, hy_doc, doc_id."),
    queries: Optional[Path] = typer.Option(None, "--queries", help="The task's query.jsonl: gives row order, text and doc_id (recommended; without it text/doc_id are empty unless stored with the rows)."),
    sample: int = typer.Option(0, "--sample", help="Which sample index to export."),
    partial: bool = typer.Option(False, "--partial", help="With --queries, skip queries that have no cached generation instead of failing."),
    settings: Optional[str] = typer.Option(None, "--settings", help="Export only the request-settings group with this hash (or prefix), as listed when the selection holds several configurations."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Export only generations made with this temperature."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Export only generations made with this top_p."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Export only generations made with this top_k."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Export only generations made with this max_tokens."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Export only generations made with this seed."),
    cache_path: Optional[Path] = typer.Option(None, "--cache-path", help=_CACHE_PATH_HELP),
    config: Optional[Path] = typer.Option(None, "--config", help="User config YAML (for LLM names defined there)."),
) -> None:
    """Write one model's generations for one task, method and configuration as R2MED's
    query_with_hydoc.jsonl.

    A file holds one configuration: when the selection has generations made with different
    request settings (sampling, prompt template, system prompt, ...), the command lists the
    groups and stops; pick one with --settings or the sampling filters.
    """
    from r2med_agent.config import set_user_config
    from r2med_agent.io import write_output
    from r2med_agent.llm.cache.transfer import ExportSelection, export_r2med

    if fmt != "r2med":
        raise ConfigError(f"--format {fmt!r} is not supported; allowed: r2med")
    if config is not None:
        set_user_config(config)
    cache = _open_cache(cache_path, must_exist=True)
    selection = ExportSelection(
        _model_ids(model),
        task=task,
        method=method,
        sample_index=sample,
        settings=settings,
        params=_sampling_overrides(
            temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed
        ),
    )
    rows = export_r2med(
        cache, selection, queries=_read_jsonl(queries) if queries is not None else None, partial=partial
    )
    write_output(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    typer.echo(f"wrote {len(rows)} rows to {'standard output' if str(out) == '-' else out}", err=True)


def _sampling_overrides(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


@cache_app.command("import")
def import_command(
    file: Path = typer.Argument(..., help="An R2MED query_with_hydoc.jsonl (id, text, hy_doc, doc_id)."),
    task: str = typer.Option(..., "--task", "-t", help="The task the file belongs to (its queries and prompts are rebuilt)."),
    method: str = typer.Option(..., "--method", "-m", help="The expansion method that produced it: hyde | query2doc | lamer."),
    llm: str = typer.Option(..., "--llm", "-l", help="LLM registry name the rows stand for (e.g. qwen-7b); a later run with this --llm and --method finds them."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", "-d", help="Local task data (as for `run`); default: the Hugging Face hub."),
    allow_missing_qrels_docs: bool = typer.Option(False, "--allow-missing-qrels-docs", help="As in `run`: keep qrels naming documents missing from the corpus, with a warning."),
    allow_count_mismatch: bool = typer.Option(False, "--allow-count-mismatch", help="As in `run`: use a --data-dir copy whose query or document counts differ from the registry's (e.g. R2MED's 2-query demo as Biology)."),
    sample: int = typer.Option(0, "--sample", help="Sample index to store the rows under."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="As in `run`: the sampling override the matching run will use."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="As in `run`."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="As in `run`."),
    seed: Optional[int] = typer.Option(None, "--seed", help="As in `run`."),
    prompts_from: Optional[str] = typer.Option(None, "--prompts", show_default=False, help="As in `run`: the wording the matching run renders, authors or own (default: the run's default, the authors' prompts for the paper's LLMs)."),
    cache_path: Optional[Path] = typer.Option(None, "--cache-path", help=_CACHE_PATH_HELP),
    config: Optional[Path] = typer.Option(None, "--config", help="User config YAML (for LLM names defined there)."),
) -> None:
    """Store published generations as this framework's own, so they score without any LLM.

    Each hy_doc is stored under the key of the exact request `run --task T --method M --llm L`
    would send for that query (same prompt, system prompt, sampling settings and template hash).
    """
    from r2med_agent.config import set_user_config

    if config is not None:
        set_user_config(config)
    overrides = _sampling_overrides(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
    cache = _open_cache(cache_path, must_exist=False)
    target = ImportTarget(task=task, method=method, llm=llm, data_dir=data_dir, sample_index=sample,
                          sampling_overrides=overrides, allow_missing_qrels_docs=allow_missing_qrels_docs,
                          allow_count_mismatch=allow_count_mismatch, prompts_from=prompts_from)
    report = import_for_method(cache, file, target)
    typer.echo(
        f"imported {report.imported} generations into {cache.path}"
        + (f"; {len(report.missing)} queries had no row" if report.missing else "")
        + (f"; {len(report.unknown)} rows matched no query" if report.unknown else "")
    )


@dataclass(frozen=True)
class ImportTarget:
    """The run whose requests imported generations are stored under (as ``run`` would send them)."""

    task: str
    method: str
    llm: str
    data_dir: Path | None = None
    sample_index: int = 0
    sampling_overrides: dict[str, Any] | None = None
    allow_missing_qrels_docs: bool = False
    allow_count_mismatch: bool = False
    prompts_from: str | None = None
    """``authors`` or ``own``; None: the run's default (r2med_agent.prompts.sources.natural)."""


def import_for_method(cache, file: Path, target: ImportTarget):
    """Rebuild the requests ``target.method`` sends for ``target.task`` with ``target.llm`` and
    import ``file`` under them.

    Returns the :class:`~r2med_agent.llm.cache.transfer.ImportReport`.
    """
    task, method, llm = target.task, target.method, target.llm
    sampling_overrides, sample_index = target.sampling_overrides, target.sample_index
    from dataclasses import replace

    from r2med_agent.data import load_task
    from r2med_agent.llm import default_sampling, get_llm_spec
    from r2med_agent.llm.cache.transfer import import_r2med
    from r2med_agent.llm.cache.keys import RequestBuilder
    from r2med_agent.methods import METHODS, get_method
    from r2med_agent.types import SearchRequest

    spec = get_llm_spec(llm)
    params = default_sampling(spec)
    if sampling_overrides:
        allowed = set(params.to_dict())
        unknown = sorted(set(sampling_overrides) - allowed)
        if unknown:
            raise ConfigError(f"unknown sampling option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
        params = replace(params, **sampling_overrides)
    from r2med_agent.experiment.resolve import resolve_spec
    from r2med_agent.experiment.spec import RunSpec
    from r2med_agent.prompts.sources import check_tasks, run_prompts

    cls = get_method(method)
    if cls.agentic or not cls.uses_llm:
        takers = [n for n, c in METHODS.items() if c.uses_llm and not c.agentic]
        raise ConfigError(f"--method {method}: only single-shot expansion methods ({', '.join(takers)}) can be imported")
    # The prompts the matching run renders: the authors' are had (fetched) before any work.
    wording = run_prompts(resolve_spec(RunSpec(method=method, llm=llm, prompts_from=target.prompts_from)))
    the_task = load_task(task, target.data_dir, allow_missing_qrels_docs=target.allow_missing_qrels_docs,
                         allow_count_mismatch=target.allow_count_mismatch)
    check_tasks(wording, method, [the_task])
    m = cls(prompts_dir=wording.method_dir)
    first_pass = None
    if m.needs_first_pass:
        from r2med_agent.retrieval import make_retriever

        bm25 = make_retriever("bm25", the_task)
        first_pass = bm25.search([SearchRequest(q.query_id, q.text) for q in the_task.queries], 10)
    prompts = m.build_prompts(the_task, first_pass)
    requests = [
        (p, params, {"task": the_task.name, "query_id": q.query_id, "method": method})
        for p, q in zip(prompts, the_task.queries)
    ]
    return import_r2med(
        cache,
        RequestBuilder.from_spec(spec),
        _read_jsonl(file),
        requests,
        template_hash=m.template_hash(the_task),
        sample_index=sample_index,
        source=file.name,
    )
