"""Plots and a self-contained HTML report of compared results.

:func:`write_report` writes into one folder:

* ``per_task.png``: grouped bars, one group per task (and the average over several tasks), one
  bar per result row;
* ``quality_vs_cost.png``: average score against cost (dollars, tokens or model time);
* ``report.html``: one static file with no network access: the comparison table, both plots
  (the same figures, as inline SVG), and a per-query drill-down: pick a row, a task and a query to see the
  query text, the generated text or agent trace, and the top-10 documents of the run with the
  relevant ones marked. ``report.html#row=0&task=Biology&query=q1`` opens that drill-down.

Query texts, relevance judgements and document texts come from the loaded tasks (``tasks``), kept
to the documents shown and cut to ``doc_chars`` characters. Without tasks the drill-down falls back
to what the result files hold: the query text and positive ids the generations file records.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from r2med_agent.analysis.render import (
    key_headers,
    render_markdown,
    significance_grid,
    text_grid,
)
from r2med_agent.analysis.results import TaskResult
from r2med_agent.analysis.tables import MISSING, PARTIAL_MARK, ComparisonTable, TableRow
from r2med_agent.errors import ConfigError
from r2med_agent.evaluation import read_trec_run, trec_sorted
from r2med_agent.io import atomic_write_text, iter_jsonl
from r2med_agent.paths import resources_dir
from r2med_agent.data.formats import DEFAULT_SPLIT
from r2med_agent.types import DataOrigin, Task

logger = logging.getLogger(__name__)

COST_AXES: tuple[str, ...] = ("auto", "usd", "tokens", "llm-time", "time")
"""x axis of the quality/cost plot: dollars, prompt+completion tokens, LLM seconds, LLM+retrieval
seconds; ``auto`` takes the first of usd, tokens, time that any row has above zero."""

DRILL_METRICS: tuple[str, ...] = ("ndcg_at_10", "ndcg_at_100", "recall_at_100", "map_at_10", "mrr")
"""Per-query metrics shown in the drill-down (beside the table's own metric)."""

TOP_K = 10


# ----------------------------------------------------------------------------------------------
# Plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    return plt


def _short(r: TableRow) -> str:
    return f"{r.index}: {r.row.label}"


LEGEND_FONT = 8
"""Font size of the plots' legends (points)."""

_WRAPS = (None, 90, 70, 55, 42, 32, 24, 16)
"""Widths (characters) the legend's labels are wrapped to, tried in turn until they fit."""


def _wrap(label: str, width: int | None) -> str:
    """``label`` over lines of at most ``width`` characters (at spaces where it can, inside a
    long word where it must), continuation lines indented."""
    if width is None or len(label) <= width:
        return label
    import textwrap

    return "\n".join(textwrap.wrap(label, width, break_long_words=True, break_on_hyphens=False,
                                   subsequent_indent="   "))


def _legend_below(fig: Any, handles: Sequence[Any], labels: Sequence[str], max_cols: int) -> Any:
    """A figure legend under the axes whose labels all fit the figure's width: the most columns
    (at most ``max_cols``) that fit with the labels whole, else one column of labels wrapped to
    the widest width that fits; the figure then grows by the legend's height, so the axes keep
    theirs (constrained layout places the legend outside them). No label is ever cut."""
    renderer = fig.canvas.get_renderer()
    room = fig.bbox.width - 2 * 0.08 * fig.dpi  # a margin of 0.08 in on each side
    legend = None
    for width in _WRAPS:
        shown = [_wrap(label, width) for label in labels]
        for ncol in range(min(max_cols, max(len(labels), 1)), 0, -1) if width is None else (1,):
            if legend is not None:
                legend.remove()
            legend = fig.legend(handles, shown, loc="outside lower center", ncol=ncol, fontsize=LEGEND_FONT,
                                frameon=False)
            if legend.get_window_extent(renderer).width <= room:
                break
        else:
            continue
        break
    height = legend.get_window_extent(renderer).height / fig.dpi
    fig.set_figheight(fig.get_figheight() + height + 0.1)
    return legend


def per_task_figure(table: ComparisonTable) -> Any:
    """The per-task bars (a matplotlib Figure, :func:`plot_per_task`)."""
    plt = _pyplot()
    with_avg = len(table.tasks) > 1  # with one task the average is that task's bar again
    groups = [*table.tasks, "Avg"] if with_avg else list(table.tasks)
    n = len(table.rows)
    width = 0.8 / max(n, 1)
    fig = plt.figure(figsize=(max(7.0, 1.1 * len(groups) + 0.25 * n), 4.2), dpi=110, layout="constrained")
    ax = fig.subplots()
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    handles = []
    for i, r in enumerate(table.rows):
        xs, ys = [], []
        for g, task in enumerate(table.tasks):
            v = r.values[task]
            if v is not None:
                xs.append(g - 0.4 + width * (i + 0.5))
                ys.append(v)
        color = cmap(i % cmap.N)
        handles.append(ax.bar(xs, ys, width=width, color=color))
        if with_avg and r.average is not None:
            ax.bar(
                [len(table.tasks) - 0.4 + width * (i + 0.5)],
                [r.average],
                width=width,
                color=color,
                hatch="//" if r.partial else None,
                edgecolor="black" if r.partial else color,
            )
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=25, ha="right")
    ax.set_ylabel(table.metric)
    hatched = with_avg and any(r.partial for r in table.rows)
    ax.set_title(f"{table.metric} per task" + (" (hatched: average over fewer tasks)" if hatched else ""))
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    _legend_below(fig, handles, [_short(r) for r in table.rows], max_cols=3)
    return fig


def plot_per_task(table: ComparisonTable, path: str | Path) -> Path:
    """Grouped bars: one group per task plus the average (left out when there is one task), one
    bar per row (hatched: partial average); the legend below names the rows, every label whole."""
    return _save_png(per_task_figure(table), path)


def _save_png(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    fig.savefig(path)
    _pyplot().close(fig)
    return path


def _cost_values(table: ComparisonTable, axis: str) -> tuple[str, list[float | None]]:
    """The x label and per-row x values of the quality/cost plot; on the dollar axis a row
    without a price (self-hosted model, no LLM: ``cost_usd`` null) has None, never $0."""
    totals = [r.row.totals(table.tasks) for r in table.rows]

    def series(name: str) -> list[float | None]:
        if name == "usd":
            return [t.get("cost_usd") for t in totals]
        if name == "tokens":
            return [t.get("prompt_tokens", 0.0) + t.get("completion_tokens", 0.0) for t in totals]
        if name == "llm-time":
            return [t.get("llm_time_s", 0.0) for t in totals]
        return [t.get("llm_time_s", 0.0) + t.get("retrieval_time_s", 0.0) for t in totals]

    labels = {
        "usd": "cost (USD, summed over tasks)",
        "tokens": "LLM tokens (prompt + completion, summed over tasks)",
        "llm-time": "LLM time (s, summed over tasks)",
        "time": "LLM + retrieval time (s, summed over tasks)",
    }
    if axis == "auto":
        for name in ("usd", "tokens", "time"):
            if any(v is not None and v > 0 for v in series(name)):
                return labels[name], series(name)
        return labels["time"], series("time")
    if axis not in labels:
        raise ConfigError(f"unknown cost axis '{axis}'; allowed: {', '.join(COST_AXES)}")
    return labels[axis], series(axis)


def _clusters(points: Sequence[tuple[float, float]], dx: float, dy: float) -> list[list[int]]:
    """Indices of ``points`` grouped greedily: a point joins the first group whose first point is
    within ``dx`` and ``dy`` of it (points drawn on top of each other share one label)."""
    groups: list[list[int]] = []
    for i, (x, y) in enumerate(points):
        for g in groups:
            gx, gy = points[g[0]]
            if abs(x - gx) <= dx and abs(y - gy) <= dy:
                g.append(i)
                break
        else:
            groups.append([i])
    return groups


def quality_figure(table: ComparisonTable, axis: str = "auto") -> Any:
    """The quality/cost scatter (a matplotlib Figure, :func:`plot_quality_vs_cost`)."""
    plt = _pyplot()
    xlabel, xs = _cost_values(table, axis)
    shown = [(r, x) for r, x in zip(table.rows, xs) if r.average is not None and x is not None]
    unpriced = [r.index for r, x in zip(table.rows, xs) if r.average is not None and x is None]
    if unpriced:
        xlabel += f"\nrows without a price left out: {', '.join(map(str, unpriced))}"
    fig = plt.figure(figsize=(7.5, 4.2), dpi=110, layout="constrained")
    ax = fig.subplots()
    cmap = plt.get_cmap("tab10" if len(table.rows) <= 10 else "tab20")
    handles, labels = [], []
    for r, x in shown:
        color = cmap(r.index % cmap.N)
        handles.append(ax.scatter(
            [x],
            [r.average],
            s=60,
            color="white" if r.partial else color,
            edgecolors=color,
            linewidths=2,
            zorder=3,
        ))
        labels.append(f"{r.index}: {r.row.label}" + (PARTIAL_MARK if r.partial else ""))
    if shown:
        _annotate_points(ax, shown)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"average {table.metric}")
    ax.set_title(f"average {table.metric} against cost")
    ax.grid(alpha=0.3)
    ax.margins(x=0.15, y=0.15)
    if shown and min(x for _, x in shown) >= 0:  # costs are never negative: no axis below 0
        ax.set_xlim(left=-0.04 * (max(x for _, x in shown) or 1.0))
    if shown:
        _legend_below(fig, handles, labels, max_cols=2)
    return fig


def _annotate_points(ax: Any, shown: Sequence[tuple[TableRow, float]]) -> None:
    """Each point's row number beside it (points that nearly coincide share one label, ``0, 1``)."""
    px = [float(x) for _, x in shown]
    py = [float(r.average) for r, _ in shown]  # type: ignore[arg-type]
    dx = 0.03 * ((max(px) - min(px)) or 1.0)
    dy = 0.04 * ((max(py) - min(py)) or 1.0)
    for group in _clusters(list(zip(px, py)), dx, dy):
        first = group[0]
        ax.annotate(
            ", ".join(str(shown[i][0].index) for i in group),
            (px[first], py[first]),
            textcoords="offset points",
            xytext=(7, 5),
            fontsize=9,
            fontweight="bold",
        )


def plot_quality_vs_cost(table: ComparisonTable, path: str | Path, axis: str = "auto") -> Path:
    """Average score (y) against cost (x), one point per row (hollow: partial average).

    Points carry their row numbers (points that nearly coincide share one label, ``0, 1``) and
    the legend below names the rows, every label whole. On the dollar axis rows without a price
    are left out, and the axis label says which.
    """
    return _save_png(quality_figure(table, axis), path)


def inline_svg(fig: Any, prefix: str) -> str:
    """``fig`` as an ``<svg>`` element for the HTML page, its text drawn as paths (so it looks the
    same in every browser) and its legend's labels, ``legend-label-<n>`` groups, measurable in
    the page. The XML prologue and comments (which repeat the labels' text) are left out, and
    every id gets ``prefix`` so that two figures on one page never share one."""
    import io
    import re

    import matplotlib

    for n, text in enumerate(t for legend in fig.legends for t in legend.get_texts()):
        text.set_gid(f"legend-label-{n}")
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": prefix}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<!--.*?-->", "", svg, flags=re.S)
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    svg = re.sub(r'\s+xmlns(:xlink)?="[^"]*"', "", svg)
    svg = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{prefix}-{m.group(1)}"', svg)
    svg = re.sub(r'\b(?:xlink:)?href="#([^"]+)"', lambda m: f'href="#{prefix}-{m.group(1)}"', svg)
    return re.sub(r"url\(#([^)]+)\)", lambda m: f"url(#{prefix}-{m.group(1)})", svg)


# ----------------------------------------------------------------------------------------------
# Drill-down data


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


# ----------------------------------------------------------------------------------------------
# HTML


def _json_for_script(obj: Any) -> str:
    """JSON safe inside ``<script type="application/json">`` (no ``</script>`` can close it)."""
    text = json.dumps(obj, ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_html(
    table: ComparisonTable,
    plots: Mapping[str, str],
    data: Mapping[str, Any],
    *,
    title: str = "r2med-agent report",
) -> str:
    """The report page: inline CSS and JS, plots as inline SVG (``plots``: caption -> the
    ``<svg>`` element, :func:`inline_svg`), the drill-down data as JSON."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(resources_dir())),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    import markupsafe

    template = env.get_template("report.html.j2")
    headers, body = text_grid(table)
    sig_headers, sig_body = significance_grid(table)
    return template.render(
        title=title,
        generated=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        metric=table.metric,
        headers=headers,
        n_keys=len(key_headers(table)),
        body=[(r.index, cells) for r, cells in zip(table.rows, body)],
        baseline=table.baseline,
        baseline_label=table.rows[table.baseline].row.label if table.baseline is not None else "",
        sig_headers=sig_headers,
        sig_body=sig_body,
        footnotes=table.footnotes(),
        plots=[(name, markupsafe.Markup(svg)) for name, svg in plots.items()],
        data_json=_json_for_script(data),
        missing=MISSING,
        markdown=render_markdown(table),
    )


def _write_plot(draw: Any, path: Path) -> Path:
    """``draw(file)`` into a temporary folder named for its writer, then moved to ``path`` by
    one rename: a full disk leaves the old plot as it was and no temporary (DiskFullError)."""
    import shutil
    import tempfile

    from r2med_agent.io import raise_if_disk_full, temp_prefix

    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp"))
    try:
        draw(tmp / path.name)
        os.replace(tmp / path.name, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise_if_disk_full(e, path, None)
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    return path


def write_report(
    table: ComparisonTable,
    out_dir: str | Path,
    *,
    tasks: Mapping[str, Task] | None = None,
    cost_axis: str = "auto",
    title: str = "r2med-agent report",
    doc_chars: int = 700,
) -> Path:
    """Write the plots and ``report.html`` into ``out_dir``; returns the HTML file.

    Args:
        table: the comparison (see :func:`r2med_agent.compare.build_table`).
        out_dir: folder to write into (created).
        tasks: loaded tasks by name, for query texts, qrels and document texts in the drill-down.
        cost_axis: x axis of the quality/cost plot (COST_AXES).
        title: page title.
        doc_chars: characters of each document text kept.
    """
    if cost_axis not in COST_AXES:
        raise ConfigError(f"unknown cost axis '{cost_axis}'; allowed: {', '.join(COST_AXES)}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: is a file; the report needs a folder (it writes "
                          "report.html and two PNG plots into it)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot create the report folder ({e.strerror}); "
                          "choose another path") from None
    plots = {}
    for n, (name, file, fig) in enumerate((
        (f"{table.metric} per task", "per_task.png", per_task_figure(table)),
        ("quality against cost", "quality_vs_cost.png", quality_figure(table, cost_axis)),
    )):
        plots[name] = inline_svg(fig, f"plot{n}")  # the same figure as the PNG beside the page
        _write_plot(lambda path, fig=fig: _save_png(fig, path), out / file)
    data = drilldown_data(table, tasks, doc_chars=doc_chars)
    page = render_html(table, plots, data, title=title)
    path = atomic_write_text(out / "report.html", page)
    logger.info("wrote %s (%d KiB) and %d plots", path, len(page) // 1024, len(plots))
    return path


# ----------------------------------------------------------------------------------------------
# Where the drill-down's texts come from


@dataclass(frozen=True)
class TaskData:
    """Where the report loads one task from, and how.

    Attributes:
        data_dir: a task folder or a folder of task folders (None: the package or the hub).
        allow_missing_qrels_docs: as the run that made the results (or ``report``'s option).
        allow_count_mismatch: likewise.
        origin: how it was chosen, for messages: ``--data-dir``, ``recorded`` or ``registry``.
        name: the name to load it by (a BEIR split's task, ``mine@dev``, loads as ``mine``).
        split: the BEIR qrels split its results were made on.
        all_queries: its results kept the queries that split does not judge.
    """

    data_dir: Path | None
    allow_missing_qrels_docs: bool = False
    allow_count_mismatch: bool = False
    origin: str = "registry"
    name: str | None = None
    split: str = DEFAULT_SPLIT
    all_queries: bool = False


_SOURCE_NOTES = re.compile(r"( \(split [^()]*\)| \(counts differ: .*\)| \(commit [0-9a-f]{40}\))+$")
"""What a result's ``source`` adds after the folder (results of earlier versions, which record no
``data`` block): a BEIR split, a count mismatch, a hub commit."""


def _recorded_data(result: TaskResult) -> DataOrigin | None:
    """Where a result file's task was read from, when that was a local folder that still exists:
    its ``data`` block, or for results written before there was one, the folder its ``source``
    names (with the split and options of its config). Hub and package data record no folder:
    they are loaded by name."""
    try:
        rec = json.loads(result.path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict):
        return None
    data = rec.get("data")
    if isinstance(data, dict):
        try:
            origin = DataOrigin(folder=data.get("folder"), layout=str(data.get("layout") or ""),
                                name=str(data.get("name") or ""), split=data.get("split"),
                                all_queries=bool(data.get("all_queries")))
        except TypeError:
            return None
    else:
        source = rec.get("source")
        if not isinstance(source, str) or not source:
            return None
        cfg = rec.get("config") if isinstance(rec.get("config"), dict) else {}
        origin = DataOrigin(folder=_SOURCE_NOTES.sub("", source), split=cfg.get("split") or None,
                            all_queries=bool(cfg.get("all_queries")))
    if not isinstance(origin.folder, str) or not origin.folder:
        return None
    folder = Path(origin.folder)
    return origin if folder.is_absolute() and folder.is_dir() else None


def _holds(data_dir: Path, name: str) -> bool:
    """Whether a ``--data-dir`` folder holds task ``name`` (itself or a sub-folder)."""
    from r2med_agent.data import local_task_names
    from r2med_agent.errors import DataError

    try:
        return name in local_task_names(data_dir)
    except DataError:
        return False


def task_data(
    table: ComparisonTable, data_dirs: Sequence[Path] = (), *, allow_missing_qrels_docs: bool = False,
    allow_count_mismatch: bool = False,
) -> dict[str, TaskData]:
    """Where to load each task of ``table`` from: the first of ``data_dirs`` that holds it; else
    the folder its result files record (with the run's own ``allow_*`` settings); else the
    package or the hub. Several recorded folders for one task name: the first row's is used, with
    a warning naming the others. A BEIR task is loaded with the split its results record, by its
    name before the split's suffix.
    """
    out: dict[str, TaskData] = {}
    for name in table.tasks:
        results = [r for r in (t.row.tasks.get(name) for t in table.rows) if r is not None]
        recorded = [(r, origin) for r in results for origin in [_recorded_data(r)] if origin is not None]
        how = _split_of(name, results, recorded)
        base = how["name"] or name
        given = next((d for d in data_dirs if _holds(d, base)), None)
        if given is None and len(data_dirs) == 1:
            given = data_dirs[0]  # load_task says what the folder lacks
        if given is not None:
            out[name] = TaskData(given, allow_missing_qrels_docs, allow_count_mismatch, "--data-dir", **how)
            continue
        if not recorded:
            out[name] = TaskData(None, allow_missing_qrels_docs, allow_count_mismatch, **how)
            continue
        first, origin = recorded[0]
        folder = Path(str(origin.folder))
        others = sorted({str(o.folder) for _, o in recorded} - {str(folder)})
        if others:
            logger.warning("task %s: results record data in several folders; the report shows texts from "
                           "%s (not %s); pass --data-dir to choose", name, folder, ", ".join(others))
        cfg = first.config
        out[name] = TaskData(
            folder,
            allow_missing_qrels_docs or bool(cfg.get("allow_missing_qrels_docs")),
            allow_count_mismatch or bool(cfg.get("allow_count_mismatch")),
            "recorded",
            **how,
        )
    return out


def _split_of(name: str, results: Sequence[TaskResult], recorded: Sequence[tuple[TaskResult, DataOrigin]]
              ) -> dict[str, Any]:
    """The name, BEIR split and query choice to load task ``name`` with, as its results recorded
    them (a ``data`` block, or an earlier version's config)."""
    for _, origin in recorded:
        if origin.layout == "beir":
            return {"name": origin.name or None, "split": origin.split or DEFAULT_SPLIT,
                    "all_queries": origin.all_queries}
        if origin.layout:
            return {"name": origin.name or None}
    for r in results:
        cfg = r.config
        split, every = cfg.get("split"), bool(cfg.get("all_queries"))
        if isinstance(split, str) and split:
            suffix = "" if (split, every) == (DEFAULT_SPLIT, False) else f"@{split}" + ("-all" if every else "")
            base = name[: -len(suffix)] if suffix and name.endswith(suffix) else name
            return {"name": base if base != name else None, "split": split, "all_queries": every}
    return {}


def load_report_tasks(where: Mapping[str, TaskData]) -> dict[str, Task]:
    """Load the tasks of ``where`` for the drill-down.

    Raises:
        R2MedError: a task that cannot be loaded, with what to pass instead (its exit code kept).
    """
    from r2med_agent.data import load_task
    from r2med_agent.errors import R2MedError

    loaded: dict[str, Task] = {}
    for name, data in where.items():
        try:
            loaded[name] = load_task(data.name or name, data.data_dir,
                                     allow_missing_qrels_docs=data.allow_missing_qrels_docs,
                                     allow_count_mismatch=data.allow_count_mismatch, qrels_split=data.split,
                                     all_queries=data.all_queries)
        except R2MedError as e:
            where_from = {"recorded": f" from {data.data_dir}, the folder its results record",
                          "--data-dir": f" from --data-dir {data.data_dir}"}.get(data.origin, "")
            err = R2MedError(f"{e}\n(the report loads task '{name}'{where_from} for its texts; pass "
                             "--data-dir DIR (several allowed), or --no-texts for ids only)")
            err.exit_code = e.exit_code
            raise err from None
    return loaded
