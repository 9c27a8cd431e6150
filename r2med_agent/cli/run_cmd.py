"""``run``, ``evaluate``, ``tasks`` and ``llms``: thin commands over runner, evaluation and registries."""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from types import UnionType
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from r2med_agent.cli.common import app
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


# The run's options. Every run spec field that a `run` option sets, and every sampling knob with
# an option, is generated from its declaration (name, type, default, help and panel stated once, on
# RunSpec and SamplingParams); the options below are where and how the run happens, and each takes
# its default from the RunConfig field it sets.
_RUN_OPTIONS: dict[str, tuple[Any, tuple[str, ...], str, str]] = {
    # parameter: (type, option names, panel, help)
    "task": (Optional[str], ("--task", "-t"), "Data",
             "Task name, a comma list, 'all' (the 8 R2MED tasks), 'nano-all' (NanoR2MED), 'bright-all' (BRIGHT's 12 tasks, bright-<task>), 'bright-long-all' (its 8 long-document tasks), or 'list' to print the registry. Old reference-code names (PMC-Treat, PMCPatients, ...) are accepted. Default: sample; with --data-dir, the task(s) in that folder, named after their folders (a name the registry does not know is a task of your own)."),
    "data_dir": (Optional[Path], ("--data-dir", "-d"), "Data",
                 "Local data: a task folder or a folder of task folders, in R2MED layout (query.jsonl, corpus.jsonl, qrels.jsonl|qrels.txt), BEIR layout or BRIGHT's layout (examples/, documents/, long_documents/, <llm>_reason/). Default: the Hugging Face hub."),
    "allow_missing_qrels_docs": (bool, ("--allow-missing-qrels-docs",), "Data",
                                 "Keep qrels that name documents missing from the corpus (R2MED's demo files have them) with a warning, instead of stopping; they still count as relevant, so scores cannot reach 1."),
    "allow_count_mismatch": (bool, ("--allow-count-mismatch",), "Data",
                             "Use a --data-dir copy of a registered task (e.g. Biology) whose numbers of queries or documents differ from the registry's (refused otherwise); recorded in the results."),
    "split": (str, ("--split",), "Data",
              "The qrels split of a BEIR folder (qrels/<split>.tsv); only the queries it names run, as BEIR's loader keeps them. Recorded in each result's source."),
    "all_queries": (bool, ("--all-queries",), "Data",
                    "Also run a BEIR folder's queries that the split's qrels do not name (unscored)."),
    "no_eval": (bool, ("--no-eval",), "Data",
                "Run every stage and write the run, generations and traces, but score nothing (what a folder without qrels gets)."),
    "candidates_path": (Optional[Path], ("--candidates",), "Retrieval",
                        "First-stage TREC run files to rerank exactly as given, in place of --retriever: a run file (one task), or a folder with <Task>.run|.trec|.txt, <Task>/<file> or ReasonRank's r2med_<Task>/<file> per task. Results record the files' hash."),
    "allow_missing_candidates": (bool, ("--allow-missing-candidates",), "Retrieval",
                                 "Leave out (with a warning giving their number) candidate documents the task's corpus lacks, instead of stopping."),
    "output_dir": (Path, ("--output-dir", "-o"), "Output, cache and progress",
                   "Root of the result tree: one folder per run spec below it (method, llm, then a leaf), with <Task>.json and <Task>.run in it (docs/results.md)."),
    "use_cache": (bool, ("--cache/--no-cache",), "Output, cache and progress",
                  "Read and write the generation cache (default on); --no-cache does neither."),
    "refresh_cache": (bool, ("--refresh-cache",), "Output, cache and progress",
                      "Regenerate every text and overwrite the cached one."),
    "cache_path": (Optional[Path], ("--cache-path",), "Output, cache and progress",
                   "Generation cache file (default: generations.sqlite in $R2MED_CACHE_DIR)."),
    "chunk_size": (Optional[int], ("--chunk-size",), "Output, cache and progress",
                   "LLM cache misses per backend call (each generation is committed to the cache as it finishes); 0 = all in one call (one vLLM engine call). Default: the LLM entry's chunk_size (auto: vllm all, openai 256, local 4)."),
    "config": (Optional[Path], ("--config",), "Output, cache and progress",
               "User config YAML adding or replacing entries of the registries: 'llms:', 'encoders:', 'rerankers:' (cross-encoders and LLM rerankers) and 'tasks:'."),
    "show_progress": (bool, ("--progress/--no-progress",), "Output, cache and progress",
                      "Progress of generation, encoding, indexing and reranking (default on): a bar when standard error is a terminal, else (a log file) a timestamped line every --progress-interval seconds, never a bar. --no-progress shows none."),
    "progress_interval": (float, ("--progress-interval",), "Output, cache and progress",
                          "Seconds between the plain progress lines written when standard error is not a terminal."),
}
_CLI_DEFAULTS = {"task": None, "config": None, "progress_interval": 30.0}
"""The defaults of the options that set no RunConfig field."""


def _option_type(hint: Any) -> tuple[Any, Any]:
    """The option type of a spec field's type, and the item type of a comma-separated list
    (None for a single value): ``str | None`` -> ``Optional[str]``, ``tuple[int, ...] | None``
    -> ``Optional[str]`` of ints."""
    args = [a for a in get_args(hint) if a is not type(None)] if get_origin(hint) in (Union, UnionType) else [hint]
    base = args[0]
    optional = base is not hint
    if get_origin(base) is tuple:
        return Optional[str], get_args(base)[0]
    return (Optional[base] if optional else base), None


_LIMITS: dict[str, dict[str, Any]] = {}
"""Bounds that click checks on an option (a usage error, exit code 2)."""


def _parameter(name: str, annotation: Any, default: Any, flags: Sequence[str], panel: str, text: str) -> inspect.Parameter:
    shown = default is not None and not isinstance(default, bool)  # an on/off flag's help says its default
    option = typer.Option(default, *flags, help=text, rich_help_panel=panel, show_default=shown, **_LIMITS.get(name, {}))
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


def run_parameters() -> list[inspect.Parameter]:
    """The ``run`` command's parameters, in the panels' order: the spec's options (from its
    fields), the sampling knobs' (from :data:`~r2med_agent.types.SAMPLING_KNOBS`) and the run options."""
    from r2med_agent.experiment.run_config import RunConfig
    from r2med_agent.experiment.spec import OPTION_GROUPS, RunSpec, spec_options
    from r2med_agent.types import SAMPLING_KNOBS

    hints, defaults = get_type_hints(RunSpec), {f.name: f.default for f in fields(RunConfig)}
    meta = {f.name: f.metadata for f in fields(RunSpec)}
    params = [_parameter(name, _option_type(hints[name])[0], defaults[name], flags, meta[name]["group"], field_help(name))
              for name, flags in spec_options().items()]
    params += [_parameter(name, Optional[str] if knob["optional"] else Optional[knob["type"]], None, (knob["flag"],),
                          "Sampling", knob["help"]) for name, knob in SAMPLING_KNOBS.items() if knob["flag"]]
    params += _kind_parameters()
    params += [_parameter(name, annotation, _CLI_DEFAULTS[name] if name in _CLI_DEFAULTS else defaults[name], flags,
                          panel, text) for name, (annotation, flags, panel, text) in _RUN_OPTIONS.items()]
    first = {p.name: i for i, p in enumerate(params)}
    return sorted(params, key=lambda p: (OPTION_GROUPS.index(p.default.rich_help_panel), p.name != "task", first[p.name]))


def _kind_parameters() -> list[inspect.Parameter]:
    """One option per field of the registered retriever kinds' ``options`` dataclasses; None (the
    kind's default, shown) leaves it out of the spec."""
    from r2med_agent.retrieval.registry import kind_option_fields

    params = []
    for kind, f, flags, hint in kind_option_fields():
        annotation = _option_type(hint)[0]
        option = typer.Option(None, *flags, help=f"{f.metadata.get('help', '')} Default: {f.default}.",
                              rich_help_panel="Retrieval", show_default=False)
        params.append(inspect.Parameter(_kind_param(kind, f.name), inspect.Parameter.KEYWORD_ONLY,
                                        default=option, annotation=Optional[annotation]))
    return params


def _kind_param(kind: str, name: str) -> str:
    """The ``run`` parameter of a kind's option (an identifier whatever the kind's name)."""
    return "kind__" + "".join(c if c.isalnum() else "_" for c in kind) + "__" + name


def spec_values(options: Mapping[str, Any]) -> dict[str, Any]:
    """The spec settings that the ``run`` options give (``sampling`` with the knobs that are set);
    a malformed comma-separated list or seed is a ConfigError naming its option."""
    from r2med_agent.experiment.spec import RunSpec, spec_options
    from r2med_agent.types import SAMPLING_KNOBS

    hints = get_type_hints(RunSpec)
    out: dict[str, Any] = {}
    for name, flags in spec_options().items():
        item = _option_type(hints[name])[1]
        out[name] = options[name] if item is None else _parse_list(options[name], item, flags[0])
    out["sampling"] = {name: _knob_value(knob, options[name]) for name, knob in SAMPLING_KNOBS.items()
                       if knob["flag"] and options.get(name) is not None}
    from r2med_agent.retrieval.registry import kind_option_fields

    for kind, f, _, _ in kind_option_fields():
        if options.get(_kind_param(kind, f.name)) is not None:
            out.setdefault("kind_options", {}).setdefault(kind, {})[f.name] = options[_kind_param(kind, f.name)]
    return out


def _knob_value(knob: Mapping[str, Any], value: Any) -> Any:
    return parse_seed(value, knob["flag"]) if knob["optional"] else value


def run_command(**options: Any) -> None:
    """Run a method over one or more tasks, write TREC runs and R2MED-style JSON, print scores."""
    from r2med_agent import progress as progress_display
    from r2med_agent.config import set_user_config
    from r2med_agent.data import local_task_names, task_names
    from r2med_agent.api import RunConfig, run_experiment

    task, data_dir, config = options["task"], options["data_dir"], options["config"]
    if config is not None:
        set_user_config(config)
    progress_display.configure(interval_s=options["progress_interval"])
    if task == "list" or options["reranker"] == "list":  # the --config above is already in force
        (tasks_command if task == "list" else rerankers_command)(config=None)
        return
    if task is None:
        names = local_task_names(data_dir) if data_dir is not None else ["sample"]
    else:
        names = task_names(task, data_dir)
    run_options = {name: options[name] for name in _RUN_OPTIONS if name not in _CLI_DEFAULTS}
    cfg = RunConfig(**spec_values(options), **run_options, tasks=tuple(names))
    print_summary(run_experiment(cfg))


run_command.__signature__ = inspect.Signature(run_parameters())  # type: ignore[attr-defined]
app.command("run")(run_command)


def _parse_list(text: Optional[str], item: type, flag: str) -> Optional[tuple[Any, ...]]:
    """``"0.3,0.7"`` -> ``(0.3, 0.7)`` (``"1000,200"`` -> ``(1000, 200)`` for whole numbers);
    anything else is a ConfigError naming the option."""
    from r2med_agent.errors import ConfigError

    if text is None:
        return None
    try:
        return tuple(item(w) for w in text.split(","))
    except ValueError:
        what, example = ("numbers", "0.3,0.7") if item is float else ("whole numbers", "1000,200")
        raise ConfigError(f"{flag}: '{text}' is not a comma-separated list of {what} (e.g. {example})") from None


def _score(means: dict[str, float], metric: str) -> str:
    """A mean to four decimals; "-" for a metric not scored (its cut-off is beyond --top-k)."""
    return f"{means[metric]:.4f}" if metric in means else "-"


def print_summary(result) -> None:
    """The closing table: headline metrics per task and their average, plus LLM work done."""
    from r2med_agent.console import figure_column, label_column, print_table

    table = Table(title=Text(result.config.label))
    uses_llm = bool(result.config.llm)  # a spec has an LLM only where its method uses one
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
    if uses_llm:
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
    """List the LLM registry (short name, backend, model, reasoning format) and each entry's
    default sampling: what a run gets without --temperature, --top-p, --max-tokens or --seed (giving
    one of these values is the same run, in the same folder)."""
    from r2med_agent.config import load_registry, set_user_config
    from r2med_agent.llm.registry import LLMSpec
    from r2med_agent.types import SAMPLING_KNOBS

    if config is not None:
        set_user_config(config)
    knobs = [name for name, knob in SAMPLING_KNOBS.items() if knob["flag"]]
    rows = [[name, spec.backend, spec.model, spec.reasoning_format,
             *(_default_text(spec.default_sampling()[k]) for k in knobs)]
            for name, spec in sorted(load_registry("llms", LLMSpec).items())]
    print_listing("LLMs", ["name", "backend", "model", "reasoning format", *knobs], rows)


def _default_text(value: Any) -> str:
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


@app.command("rerankers")
def rerankers_command(
    config: Optional[Path] = typer.Option(None, "--config", help="User config YAML with extra 'rerankers:' entries."),
) -> None:
    """List the reranker registry: kind (cross-encoder, listwise, pointwise-reasoning, groupwise,
    setwise), model (a cross-encoder's checkpoint, an LLM reranker's LLM) and input format."""
    from r2med_agent.config import set_user_config
    from r2med_agent.rerank.spec import reranker_registry

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


def parse_seed(value: str, flag: str = "--seed") -> int | None:
    """``--seed``: an integer, or ``none``/``null`` for no seed; anything else exits with code 2."""
    from r2med_agent.errors import ConfigError

    text = value.strip().lower()
    if text in ("none", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{flag} must be an integer or 'none', got {value!r}") from None
