"""Renderers of a comparison table: Markdown, CSV and a rich terminal table."""

from __future__ import annotations

import csv
import io
import logging
from typing import Any

from r2med_agent.errors import ConfigError
from r2med_agent.analysis.stats import OVERALL, PairedTest

logger = logging.getLogger(__name__)
from r2med_agent.analysis.results import STATS_HEADERS, STATS_KEYS
from r2med_agent.analysis.tables import (
    BETTER_MARK,
    MISSING,
    PARTIAL_MARK,
    ComparisonTable,
    TableRow,
)

# ----------------------------------------------------------------------------------------------
# Rendering


def _fmt(value: float | None, digits: int = 4) -> str:
    return MISSING if value is None else f"{value:.{digits}f}"


def _fmt_diff(ours: float | None, paper: float | None) -> str:
    return MISSING if ours is None or paper is None else f"{ours - paper:+.4f}"


def _fmt_stat(key: str, value: float | None) -> str:
    if value is None:
        return MISSING
    if key == "cost_usd":
        return f"{value:.4f}"
    if key.endswith("_s"):
        return f"{value:.2f}"
    return f"{int(round(value)):,}"


def _fmt_p(p: float | None) -> str:
    if p is None:
        return MISSING
    return "<0.0001" if p < 1e-4 else f"{p:.4f}"


def key_headers(table: ComparisonTable) -> list[str]:
    return ["#", "method", "llm", "retriever", "reranker", "settings"] + (["results"] if table.show_source else [])


def key_cells(table: ComparisonTable, r: TableRow) -> list[str]:
    idx = f"{r.index} (base)" if r.index == table.baseline else str(r.index)
    cells = [idx, r.row.method, r.row.llm, r.row.retriever, r.row.reranker or MISSING, r.row.settings_label or MISSING]
    return cells + ([r.row.source] if table.show_source else [])


def text_grid(table: ComparisonTable) -> tuple[list[str], list[list[str]]]:
    """Headers and cell strings shared by the Markdown and HTML renderings."""
    headers = key_headers(table)
    for t in [*table.tasks, "Avg"]:
        headers.append(t)
        if table.with_published:
            headers += [f"{t} paper", f"{t} Δ"]
    if table.baseline is not None:
        headers += ["W/T/L", "p"]
    if table.with_cost:
        headers += [STATS_HEADERS[k] for k in STATS_KEYS]
    body = []
    for r in table.rows:
        cells = key_cells(table, r)
        for t in table.tasks:
            cells.append(_fmt(r.values[t]) + table.marker(r, t))
            if table.with_published:
                cells += [_fmt(r.published.get(t)), _fmt_diff(r.values[t], r.published.get(t))]
        avg = _fmt(r.average) + (PARTIAL_MARK if r.partial and r.average is not None else "")
        cells.append(avg + table.marker(r, OVERALL))
        if table.with_published:
            cells += [_fmt(r.published_average), _fmt_diff(r.average, r.published_average)]
        if table.baseline is not None:
            t = r.tests.get(OVERALL)
            cells += [f"{t.wins}/{t.ties}/{t.losses}" if t else MISSING, _fmt_p(t.p_value if t else None)]
        if table.with_cost:
            cells += [_fmt_stat(k, r.totals.get(k)) for k in STATS_KEYS]
        body.append(cells)
    return headers, body


def _fmt_test(t: PairedTest | None) -> str:
    """``Δ +0.0500 [+0.0100, +0.0900], p 0.0312, W/T/L 4/1/1`` (the interval with bootstrap only)."""
    if t is None:
        return MISSING
    ci = f" [{t.ci_low:+.4f}, {t.ci_high:+.4f}]" if t.ci_low is not None and t.ci_high is not None else ""
    return f"Δ {t.mean_diff:+.4f}{ci}, p {_fmt_p(t.p_value)}, W/T/L {t.wins}/{t.ties}/{t.losses}"


def significance_grid(table: ComparisonTable) -> tuple[list[str], list[list[str]]]:
    """Per row and task (and Avg) the test against the baseline: difference of means (with the
    bootstrap's 95% interval), p-value and win/tie/loss counts. Empty without a baseline; no Avg
    column with one task (it would repeat the task's)."""
    if table.baseline is None:
        return [], []
    with_avg = len(table.tasks) > 1
    headers = ["#", "configuration", *table.tasks, *(["Avg"] if with_avg else [])]
    body = []
    for r in table.rows:
        if r.index == table.baseline:
            continue
        cells = [str(r.index), r.row.label]
        cells += [_fmt_test(r.tests.get(t)) for t in table.tasks]
        if with_avg:
            cells.append(_fmt_test(r.tests.get(OVERALL)))
        body.append(cells)
    return headers, body


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(table: ComparisonTable) -> str:
    """A GitHub-flavoured Markdown table, then its footnotes."""
    headers, body = text_grid(table)
    lines = [f"Metric: {table.metric}", ""]
    lines.append("| " + " | ".join(map(_md_escape, headers)) + " |")
    n_keys = len(key_headers(table))
    lines.append("|" + "|".join("---" if i < n_keys else "---:" for i in range(len(headers))) + "|")
    for cells in body:
        lines.append("| " + " | ".join(map(_md_escape, cells)) + " |")
    sig_headers, sig_body = significance_grid(table)
    if sig_body:
        lines += ["", f"Against the baseline, row {table.baseline} ({table.rows[table.baseline].row.label}):", ""]
        lines.append("| " + " | ".join(map(_md_escape, sig_headers)) + " |")
        lines.append("|---|---|" + "|".join("---:" for _ in sig_headers[2:]) + "|")
        for cells in sig_body:
            lines.append("| " + " | ".join(map(_md_escape, cells)) + " |")
    notes = table.footnotes()
    if notes:
        lines.append("")
        lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _csv_num(value: float | None) -> str:
    return "" if value is None else repr(float(value))


COUNT_KEYS = ("generations", "cache_hits", "prompt_tokens", "completion_tokens")
"""Stats that are counts: written as integers (``12``, not ``12.0``)."""


def _csv_stat(key: str, value: float | None) -> str:
    if value is not None and key in COUNT_KEYS and float(value).is_integer():
        return str(int(value))
    return _csv_num(value)


def render_csv(table: ComparisonTable) -> str:
    """CSV with full-precision numbers (empty cells where there is no value).

    Columns: index, method, llm, retriever, reranker, [results], per task ``<task>`` (and
    ``<task>_published``, ``<task>_diff``; against a baseline ``<task>_p``, ``<task>_wins``,
    ``<task>_ties``, ``<task>_losses`` and, with the bootstrap test, ``<task>_ci_low`` and
    ``<task>_ci_high``: the 95% interval of the difference of means), ``avg``, ``avg_tasks``
    (how many tasks the average covers), ``avg_missing`` (``;``-joined), the published/diff
    columns of the average, ``avg_p``, ``wins``, ``ties``, ``losses`` (queries over all tested
    tasks), ``avg_ci_low``/``avg_ci_high`` (bootstrap), and the summed stats.
    """
    pub, base = table.with_published, table.baseline is not None
    ci = base and table.test == "bootstrap"
    headers = ["index", "method", "llm", "retriever", "reranker", "settings"] + (["results"] if table.show_source else [])
    for t in table.tasks:
        headers.append(t)
        headers += [f"{t}_published", f"{t}_diff"] if pub else []
        headers += [f"{t}_p", f"{t}_wins", f"{t}_ties", f"{t}_losses"] if base else []
        headers += [f"{t}_ci_low", f"{t}_ci_high"] if ci else []
    headers += ["avg", "avg_tasks", "avg_missing"]
    headers += ["avg_published", "avg_diff"] if pub else []
    headers += ["avg_p", "wins", "ties", "losses"] if base else []
    headers += ["avg_ci_low", "avg_ci_high"] if ci else []
    headers += list(STATS_KEYS) if table.with_cost else []
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(headers)

    def diff(a: float | None, b: float | None) -> str:
        return "" if a is None or b is None else repr(a - b)

    def test_cells(test: PairedTest | None) -> list[str]:
        """p, wins, ties, losses (and the interval with the bootstrap), empty without a test."""
        if test is None:
            return [""] * (6 if ci else 4)
        cells = [_csv_num(test.p_value), str(test.wins), str(test.ties), str(test.losses)]
        return cells + ([_csv_num(test.ci_low), _csv_num(test.ci_high)] if ci else [])

    for r in table.rows:
        rec = [str(r.index), r.row.method, r.row.llm, r.row.retriever, r.row.reranker, r.row.settings_label]
        rec += [r.row.source] if table.show_source else []
        for t in table.tasks:
            rec.append(_csv_num(r.values[t]))
            if pub:
                rec += [_csv_num(r.published.get(t)), diff(r.values[t], r.published.get(t))]
            if base:
                rec += test_cells(r.tests.get(t))
        rec += [_csv_num(r.average), str(len(table.tasks) - len(r.missing_tasks)), ";".join(r.missing_tasks)]
        if pub:
            rec += [_csv_num(r.published_average), diff(r.average, r.published_average)]
        if base:
            rec += test_cells(r.tests.get(OVERALL))
        if table.with_cost:
            rec += [_csv_stat(k, r.totals.get(k)) for k in STATS_KEYS]
        w.writerow(rec)
    return buf.getvalue()


def render_rich(table: ComparisonTable):  # -> rich.table.Table
    """A rich terminal table: one configuration column (``method/llm/retriever[/reranker]``);
    with published scores each task cell shows ours over the paper's and the difference.
    The footnotes are not part of it (:func:`print_rich` prints both)."""
    from rich.table import Table
    from rich.text import Text

    from r2med_agent.console import figure_column, label_column, stacked

    title = f"{table.metric}" + (f" (baseline: row {table.baseline})" if table.baseline is not None else "")
    out = Table(title=title, show_lines=table.with_published)
    figure_column(out, "#", justify="left")
    label_column(out, "configuration", min_width=12)
    if table.show_source:
        label_column(out, "results")
    sub = "\npaper (Δ)" if table.with_published else ""
    for t in [*table.tasks, "Avg"]:
        width = 9 if table.with_published else 7
        figure_column(out, stacked(t, width) + sub, min_width=width)
    if table.baseline is not None:
        figure_column(out, "W/T/L")
        figure_column(out, "p", min_width=6)
    if table.with_cost:
        for k in STATS_KEYS:
            figure_column(out, stacked(STATS_HEADERS[k], 6))

    def cell(ours: float | None, mark: str, paper: float | None, partial: bool = False) -> Text:
        text = Text(_fmt(ours) + (PARTIAL_MARK if partial else ""))
        if mark:
            text.append(mark, style="green" if mark == BETTER_MARK else "red")
        if table.with_published:
            text.append(f"\n{_fmt(paper)}\n({_fmt_diff(ours, paper)})", style="dim")
        return text

    for r in table.rows:
        # the label as plain text: its settings are in brackets, which rich would read as markup
        cells: list[Any] = [f"{r.index}*" if r.index == table.baseline else str(r.index), Text(r.row.label)]
        if table.show_source:
            cells.append(r.row.source)
        for t in table.tasks:
            cells.append(cell(r.values[t], table.marker(r, t), r.published.get(t)))
        partial = r.partial and r.average is not None
        cells.append(cell(r.average, table.marker(r, OVERALL), r.published_average, partial))
        if table.baseline is not None:
            t = r.tests.get(OVERALL)
            cells += [f"{t.wins}/{t.ties}/{t.losses}" if t else MISSING, _fmt_p(t.p_value if t else None)]
        if table.with_cost:
            cells += [_fmt_stat(k, r.totals.get(k)) for k in STATS_KEYS]
        out.add_row(*cells, style="bold" if r.index == table.baseline else None)
    return out


def print_rich(table: ComparisonTable, console=None) -> None:
    """Print the rich table and its footnotes; a table wider than the console gets a hint."""
    from rich.console import Console

    from r2med_agent.console import print_table, table_width

    console = console or Console()
    rich_table = render_rich(table)
    if table_width(console, rich_table) > console.width:
        logger.warning(
            "the table is wider than the terminal (%d columns): printed wider, no figure cut; use --format md "
            "or --out FILE", console.width
        )
    print_table(console, rich_table)
    for note in table.footnotes():
        console.print(note, style="dim", highlight=False, markup=False)


FORMATS: tuple[str, ...] = ("rich", "md", "csv")


def render(table: ComparisonTable, fmt: str) -> str:
    """``md`` or ``csv`` text, or the rich table as plain text (``rich``)."""
    if fmt == "md":
        return render_markdown(table)
    if fmt == "csv":
        return render_csv(table)
    if fmt == "rich":
        from rich.console import Console

        console = Console(file=io.StringIO(), width=240, color_system=None)
        print_rich(table, console)
        return console.file.getvalue()  # type: ignore[attr-defined]
    raise ConfigError(f"unknown format '{fmt}'; allowed: {', '.join(FORMATS)}")

