"""``compare``, ``report`` and ``reproduce``: thin commands over compare, report and reproduce."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import typer

from r2med_agent.cli.common import app
from r2med_agent.errors import ConfigError

_RESULTS_HELP = "Result directories (the runner's --output-dir, or any folder inside it). Default: results."


def _tasks_option(spec: Optional[str], found: Sequence[str] = ()) -> list[str] | None:
    """The tasks of ``--tasks``: registry names, groups and aliases as ``run`` takes them, and
    the names of tasks of your own (``run --data-dir``) that the loaded results hold."""
    if not spec:
        return None
    from r2med_agent.data import task_names

    try:
        return task_names(spec, extra=found)
    except ConfigError as e:
        raise ConfigError(f"--tasks: {e}") from None


def _load_table(
    results: Optional[list[Path]],
    metric: str,
    tasks: Optional[str],
    published: bool,
    baseline: Optional[str],
    test: str,
    alpha: float,
    resamples: int,
    seed: int,
    cost: bool,
):
    from r2med_agent.api import build_table, load_results

    rows = load_results(results or [Path("results")], require_scored=True)
    found = sorted({name for row in rows for name in row.tasks})
    return build_table(
        rows,
        metric,
        tasks=_tasks_option(tasks, found),
        published=published,
        baseline=baseline,
        alpha=alpha,
        test=test,
        n_resamples=resamples,
        seed=seed,
        cost=cost,
    )


def _format_for(fmt: Optional[str], out: Optional[Path]) -> str:
    from r2med_agent.api import FORMATS

    if fmt is None:
        if out is None or str(out) == "-":
            return "rich"
        return "csv" if out.suffix.lower() == ".csv" else "md"
    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, got '{fmt}'")
    return fmt


def _emit(table, fmt: str, out: Optional[Path]) -> None:
    from r2med_agent.api import print_rich, render
    from r2med_agent.io import write_output

    if out is not None and str(out) != "-":
        write_output(out, render(table, fmt))
        typer.echo(f"wrote {out}", err=True)
    elif out is not None:
        write_output(out, render(table, "md" if fmt == "rich" else fmt))
    elif fmt == "rich":
        print_rich(table)
    else:
        typer.echo(render(table, fmt), nl=False)


@app.command("compare")
def compare_command(
    results: Optional[list[Path]] = typer.Argument(None, help=_RESULTS_HELP, show_default=False),
    metric: str = typer.Option("ndcg_at_10", "--metric", help="Metric: ndcg_at_10, recall_at_100, mrr, ... or as trec_eval, pyserini and BEIR write them (ndcg_cut_10, ndcg@10, NDCG@10, P_10, recip_rank)."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="Only these task columns: a comma list, 'all', 'nano-all', 'bright-all' or 'bright-long-all' (default: every task found)."),
    published: bool = typer.Option(False, "--published", help="Add the published score beside ours (R2MED's paper; NanoR2MED's card; BRIGHT's paper on the bright- tasks; the systems published since, each with its source), and the difference ('—' where there is none)."),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="Row to test the others against: its index, or method/llm/retriever (plus /reranker if it has one). Marks ▲/▼ where p < --alpha and adds W/T/L and p."),
    test: str = typer.Option("permutation", "--test", help="Significance test: permutation (paired randomisation, exact when 2^n is small) or bootstrap."),
    alpha: float = typer.Option(0.05, "--alpha", help="Significance level of the ▲/▼ markers."),
    resamples: int = typer.Option(10_000, "--resamples", help="Random permutations or bootstrap resamples."),
    seed: int = typer.Option(0, "--seed", help="Seed of the significance tests."),
    cost: bool = typer.Option(False, "--cost", help="Add generations, cache hits, tokens, LLM/retrieval seconds and dollars, summed over tasks."),
    fmt: Optional[str] = typer.Option(None, "--format", help="rich (terminal), md or csv. Default: rich, or from --out's suffix (.csv -> csv, else md)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the table to this file instead of the terminal (atomically; a symlink is written through; '-' is standard output)."),
) -> None:
    """One table of results: tasks as columns, one row per configuration (method, llm, retriever, reranker), and the average."""
    fmt = _format_for(fmt, out)
    table = _load_table(results, metric, tasks, published, baseline, test, alpha, resamples, seed, cost)
    _emit(table, fmt, out)


@app.command("report")
def report_command(
    results: Optional[list[Path]] = typer.Argument(None, help=_RESULTS_HELP, show_default=False),
    out: Path = typer.Option(..., "--out", help="Folder for report.html, per_task.png and quality_vs_cost.png."),
    metric: str = typer.Option("ndcg_at_10", "--metric", help="Metric of the table and plots (ndcg_at_10, ndcg@10, ndcg_cut_10, ... as for compare)."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="Only these tasks: a comma list, 'all', 'nano-all', 'bright-all' or 'bright-long-all' (default: every task found)."),
    data_dir: Optional[list[Path]] = typer.Option(None, "--data-dir", "-d", help="Local task data (as `run --data-dir`) for query texts, qrels and document texts in the drill-down; repeat it for several folders (each task comes from the first that holds it). Default: the folder each task's results record as their data source, else the package/hub copy."),
    allow_missing_qrels_docs: bool = typer.Option(
        False, "--allow-missing-qrels-docs",
        help="Load tasks whose qrels name documents missing from the corpus (as `run --allow-missing-qrels-docs`).",
    ),
    allow_count_mismatch: bool = typer.Option(
        False, "--allow-count-mismatch",
        help="Load --data-dir copies whose query or document counts differ from the registry's (as `run --allow-count-mismatch`).",
    ),
    texts: bool = typer.Option(True, "--texts/--no-texts", help="Load the tasks for texts and qrels; --no-texts shows ids only (query text and positives from the generations file where there is one)."),
    published: bool = typer.Option(False, "--published", help="Add R2MED's published scores to the table."),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="Row index, or method/llm/retriever (plus /reranker), to test the others against."),
    test: str = typer.Option("permutation", "--test", help="permutation or bootstrap."),
    alpha: float = typer.Option(0.05, "--alpha", help="Significance level."),
    resamples: int = typer.Option(10_000, "--resamples", help="Random permutations or bootstrap resamples."),
    seed: int = typer.Option(0, "--seed", help="Seed of the significance tests."),
    cost: bool = typer.Option(False, "--cost", help="Add generations, cache hits, tokens, LLM/retrieval seconds and dollars, summed over tasks, to the table."),
    cost_axis: str = typer.Option("auto", "--cost-axis", help="x axis of the quality/cost plot: auto, usd, tokens, llm-time, time."),
    title: str = typer.Option("r2med-agent report", "--title", help="Page title."),
    config: Optional[Path] = typer.Option(None, "--config", help="User config YAML (for the tasks, LLMs, encoders and rerankers defined there)."),
) -> None:
    """Plots and one self-contained HTML page: the table, the plots and a per-query drill-down."""
    from r2med_agent.analysis.report import load_report_tasks, task_data, write_report
    from r2med_agent.config import set_user_config

    if config is not None:
        set_user_config(config)
    table = _load_table(results, metric, tasks, published, baseline, test, alpha, resamples, seed, cost)
    loaded = {}
    if texts:
        where = task_data(table, data_dir or (), allow_missing_qrels_docs=allow_missing_qrels_docs,
                          allow_count_mismatch=allow_count_mismatch)
        loaded = load_report_tasks(where)
    path = write_report(table, out, tasks=loaded, cost_axis=cost_axis, title=title)
    typer.echo(str(path))


@app.command("reproduce")
def reproduce_command(
    table_name: Optional[str] = typer.Option(None, "--table", help="Grid to reproduce: retrievers, gar, agentic, rerank, nano, beyond, frontier, bright, bright-long or bright-frontier (configs/reproduce/<table>.yaml)."),
    grid_file: Optional[Path] = typer.Option(None, "--grid", help="A grid YAML of your own instead of --table (same format)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List each command, its published scores, done/stale/pending tasks and what it needs (GPU memory, API keys, hub access); run nothing."),
    output_dir: Path = typer.Option(Path("results"), "--output-dir", "-o", help="Root of the result tree; tasks whose result files exist and were made with the entry's settings and data are skipped, stale ones run again."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", "-d", help="Local task data (as `run --data-dir`); default: the hub."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="Tasks to run: 'all' (the 8 R2MED tasks), 'nano-all', 'bright-all', 'bright-long-all' or a comma list (default: the grid's tasks: the 8 R2MED tasks, the 8 NanoR2MED splits for nano, BRIGHT's 12 or 8 long-document tasks for the bright tables)."),
    gpu_gib: float = typer.Option(80.0, "--gpu-gib", help="Memory of one GPU for the --dry-run estimates."),
    generations: str = typer.Option("r2med", "--generations", help="r2med (default): rows whose generations R2MED released (configs/reproduce/released.yaml) score those, with no LLM; the others generate. fresh: every LLM row generates."),
    allow_count_mismatch: bool = typer.Option(False, "--allow-count-mismatch", help="Use --data-dir copies whose query or document counts differ from the registry's (as `run --allow-count-mismatch`)."),
    candidates: Optional[Path] = typer.Option(None, "--candidates", help="First-stage run files for the grid's entries that rerank given runs (frontier: ReasonRank's runs/ folder); checked against the hash each entry holds."),
    fmt: str = typer.Option("rich", "--format", help="Closing table: rich, md or csv."),
    ray: Optional[str] = typer.Option(None, "--ray", help="Run the pending rows as tasks on a Ray cluster: an address (ray://... or host:port), 'auto' (the running cluster), 'env' ($RAY_ADDRESS) or 'local' (starts one on this machine); docs/cluster.md."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="With --dry-run --ray: the GPUs to schedule on instead of the cluster's."),
) -> None:
    """Run every configuration of one of the paper's tables and compare it with the published scores."""
    from r2med_agent.data import task_names
    from r2med_agent.grids.planner import unlisted_published
    from r2med_agent.api import TABLES, ReproduceOptions, format_plan, load_grid, plan, reproduce

    if (table_name is None) == (grid_file is None):
        raise ConfigError(f"give exactly one of --table ({', '.join(TABLES)}) or --grid FILE")
    grid = load_grid(table_name if table_name is not None else grid_file)  # type: ignore[arg-type]
    opts = ReproduceOptions(
        output_dir=output_dir,
        data_dir=data_dir,
        tasks=tuple(task_names(tasks)) if tasks else (grid.tasks or tuple(task_names("all"))),
        gpu_gib=gpu_gib,
        generations=generations,
        allow_count_mismatch=allow_count_mismatch,
        candidates=candidates,
    )
    if dry_run:
        typer.echo(f"{grid.title} ({grid.path.name})")
        planned = plan(grid, opts)
        typer.echo(format_plan(planned), nl=False)
        typer.echo(unlisted_published(grid), nl=False)
        if ray is not None:
            from r2med_agent.grids.cluster import schedule_text

            typer.echo(schedule_text(planned, opts, ray, gpus))
        return
    _emit(reproduce(grid, opts, ray=ray), _format_for(fmt, None), None)
