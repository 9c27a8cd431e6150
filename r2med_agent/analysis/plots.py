"""The report's plots: grouped bars of the table's metric per task (and the average), and the
average score against cost (dollars, tokens or model time); each as a PNG file and as inline SVG
for the HTML page (:mod:`~r2med_agent.analysis.report`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from r2med_agent.analysis.tables import PARTIAL_MARK, ComparisonTable, TableRow
from r2med_agent.errors import ConfigError

COST_AXES: tuple[str, ...] = ("auto", "usd", "tokens", "llm-time", "time")
"""x axis of the quality/cost plot: dollars, prompt+completion tokens, LLM seconds, LLM+retrieval
seconds; ``auto`` takes the first of usd, tokens, time that any row has above zero."""

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


def row_colors(n: int) -> list[Any]:
    """One colour per row, no two alike: matplotlib's ``tab10`` up to 10 rows; beyond, ``tab20``
    (its pairs of a dark and a light shade) up to 20, and past 20, where ``tab20`` would start
    over, ``n`` evenly spaced hues of ``hsv`` in three shades (the plots' legends tell them
    apart by number too)."""
    plt = _pyplot()
    if n <= 20:
        cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
        return [cmap(i) for i in range(n)]
    import matplotlib.colors as mcolors

    out = []
    for i in range(n):
        value = (1.0, 0.75, 0.5)[i % 3]  # neighbours differ in shade as well as hue
        out.append((*mcolors.hsv_to_rgb((i / n, 0.85, value)), 1.0))
    return out


def per_task_figure(table: ComparisonTable) -> Any:
    """The per-task bars (a matplotlib Figure, :func:`plot_per_task`)."""
    plt = _pyplot()
    with_avg = len(table.tasks) > 1  # with one task the average is that task's bar again
    groups = [*table.tasks, "Avg"] if with_avg else list(table.tasks)
    n = len(table.rows)
    width = 0.8 / max(n, 1)
    fig = plt.figure(figsize=(max(7.0, 1.1 * len(groups) + 0.25 * n), 4.2), dpi=110, layout="constrained")
    ax = fig.subplots()
    colors = row_colors(n)
    handles = []
    for i, r in enumerate(table.rows):
        xs, ys = [], []
        for g, task in enumerate(table.tasks):
            v = r.values[task]
            if v is not None:
                xs.append(g - 0.4 + width * (i + 0.5))
                ys.append(v)
        color = colors[i]
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
    return save_png(per_task_figure(table), path)


def save_png(fig: Any, path: str | Path) -> Path:
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
    colors = row_colors(max((r.index for r in table.rows), default=-1) + 1)
    handles, labels = [], []
    for r, x in shown:
        color = colors[r.index]
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
    return save_png(quality_figure(table, axis), path)


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
