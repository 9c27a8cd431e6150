"""``r2med-agent trace show FILE|FOLDER``: print agentic trajectories (``<Task>.traces.jsonl``, or
every one of a result folder) for a person."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import typer

from r2med_agent.cli.common import app
from r2med_agent.errors import ConfigError

trace_app = typer.Typer(
    name="trace",
    help="Inspect the trajectories of the agentic methods (search-r1, search-o1).",
    no_args_is_help=True,
)
app.add_typer(trace_app, name="trace")

CUT = 600
"""Characters of each text shown without ``--full``."""


def natural_key(text: str) -> list[Any]:
    """Sort key that orders digit runs by their value: ``q2`` before ``q10``, ``9`` before ``10``."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part)
            for part in re.split(r"(\d+)", text) if part]


def _cut(text: str, full: bool, limit: int = CUT) -> str:
    if full or len(text) <= limit:
        return text
    return text[:limit].rstrip() + f" … [{len(text) - limit} more characters; --full shows all]"


@trace_app.command("show")
def show(
    file: Path = typer.Argument(..., help="a <Task>.traces.jsonl (or <Task>.rerank.jsonl) file written by "
                                          "`r2med-agent run`, or the result folder holding it (every task's "
                                          "trajectories in it)"),
    query: list[str] = typer.Option(None, "--query", "-q", help="show only this query id (repeatable)"),
    task: list[str] = typer.Option(None, "--task", "-t", help="with a result folder: show only this task "
                                                               "(repeatable)"),
    full: bool = typer.Option(False, "--full", help="print every text whole (default: cut to 600 characters)"),
) -> None:
    """Show each step of a trajectory: the reasoning, the query issued, the documents retrieved,
    the text inserted, the tokens, and the finish reason and final response."""
    from rich.console import Console
    from rich.text import Text

    from r2med_agent.methods.loop import read_traces

    files = trace_files(file, task)
    by_file = {f: read_traces(f) for f in files}
    if query:
        wanted = set(query)
        known = {t.query_id for traces in by_file.values() for t in traces}
        unknown = sorted(wanted - known)
        if unknown:
            ordered = sorted(known, key=natural_key)
            sample = ", ".join(ordered[:10]) + (" ..." if len(known) > 10 else "")
            raise ConfigError(f"{file}: no trace for query id(s) {', '.join(unknown)}; ids in the file: {sample}")
        by_file = {f: [t for t in traces if t.query_id in wanted] for f, traces in by_file.items()}
    console = Console(highlight=False)
    shown = [t for traces in by_file.values() for t in traces]
    for f, traces in by_file.items():
        if len(by_file) > 1 and traces:
            console.print(Text(f"{_task_of(f)} ({f})", style="bold underline"), soft_wrap=True)
        for trace in traces:
            _print_trace(console, trace, full)
    if len(shown) > 1:
        counts = Counter(t.finish_reason for t in shown)
        reasons = ", ".join(f"{r} {n}" for r, n in counts.most_common())
        console.print(f"{len(shown)} trajectories; finish reasons: {reasons}", markup=False)


TRACES = ".traces.jsonl"
RERANK_TRACES = ".rerank.jsonl"


def _task_of(path: Path) -> str:
    return path.name.removesuffix(TRACES).removesuffix(RERANK_TRACES)


def trace_files(path: Path, tasks: list[str] | None = None) -> list[Path]:
    """The trace files ``trace show`` reads: ``path`` itself, or the ``<Task>.traces.jsonl`` (an
    agentic method's) and ``<Task>.rerank.jsonl`` (an LLM reranker's) files of the result folder
    ``path``, of ``tasks`` only when given.

    Raises:
        ConfigError: no such file or folder; a folder without trace files (naming the folders
            below it that have some); an unknown task.
    """
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ConfigError(f"{path}: no such trace file or result folder")
    files = sorted((p for suffix in (TRACES, RERANK_TRACES) for p in path.glob(f"*{suffix}")),
                   key=lambda p: (natural_key(_task_of(p)), p.name.endswith(RERANK_TRACES)))
    if not files:
        below = sorted({str(p.parent) for suffix in (TRACES, RERANK_TRACES) for p in path.rglob(f"*{suffix}")})
        hint = (f"; folders below it that have them: {', '.join(below[:5])}" + (" ..." if len(below) > 5 else "")
                if below else "; the agentic methods (search-r1, search-o1) and the LLM rerankers write them")
        raise ConfigError(f"{path}: no <Task>{TRACES} or <Task>{RERANK_TRACES} in this folder{hint}")
    if tasks:
        named = {_task_of(p) for p in files}
        unknown = [t for t in tasks if t not in named]
        if unknown:
            raise ConfigError(f"{path}: no trajectories of task(s) {', '.join(unknown)}; tasks here: "
                              f"{', '.join(sorted(named, key=natural_key))}")
        files = [p for p in files if _task_of(p) in tasks]
    return files


def _print_trace(console: Any, trace: Any, full: bool) -> None:
    from rich.panel import Panel
    from rich.rule import Rule
    from rich.table import Table
    from rich.text import Text

    extra = dict(trace.extra or {})
    p_in = sum(s.prompt_tokens for s in trace.steps)
    p_out = sum(s.completion_tokens for s in trace.steps)
    searches = len(extra["searches"]) if isinstance(extra.get("searches"), list) else sum(
        1 for s in trace.steps if s.doc_ids
    )
    task = f" ({extra['task']})" if extra.get("task") else ""
    title = (
        f"{trace.method} · query {trace.query_id}{task} · finish: {trace.finish_reason} · "
        f"{len(trace.steps)} steps · searches: {searches} · tokens {p_in} in / {p_out} out"
    )
    # A rule, then the header as text that wraps: a title inside the rule is cut to the width
    # (80 columns when the output is not a terminal).
    console.print(Rule())
    console.print(Text(title, style="bold"))
    if extra.get("query"):
        console.print(Text.assemble(("Query: ", "bold"), _cut(str(extra["query"]), full)))
    condensed = {int(c["step"]): c for c in extra.get("condensed", []) if isinstance(c, dict) and "step" in c}
    for i, step in enumerate(trace.steps):
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="bold cyan", no_wrap=True)
        grid.add_column()
        grid.add_row("reasoning", Text(_cut(step.generated.strip(), full) or "(empty)"))
        if step.search_query is not None:
            grid.add_row("query", Text(step.search_query, style="yellow"))
        if step.doc_ids:
            grid.add_row("documents", Text(", ".join(step.doc_ids)))
        if step.inserted.strip():
            grid.add_row("inserted", Text(_cut(step.inserted.strip(), full), style="green"))
        if full and i in condensed:
            grid.add_row("condense raw", Text(str(condensed[i].get("raw", ""))))
        grid.add_row("tokens", Text(f"{step.prompt_tokens} in / {step.completion_tokens} out"))
        console.print(Panel(grid, title=f"step {i + 1}", title_align="left", expand=True))
    console.print(Text.assemble(("Finish reason: ", "bold"), trace.finish_reason))
    console.print(Text.assemble(("Final response: ", "bold"), Text(_cut(trace.final, full) or "(empty)", style="magenta")))
    console.print()
