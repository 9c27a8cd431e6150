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

from r2med_agent.analysis.drilldown import DRILL_METRICS, TOP_K, drilldown_data
from r2med_agent.analysis.plots import (
    COST_AXES,
    inline_svg,
    per_task_figure,
    plot_per_task,
    plot_quality_vs_cost,
    quality_figure,
    save_png,
)
from r2med_agent.analysis.render import (
    key_headers,
    render_markdown,
    significance_grid,
    text_grid,
)
from r2med_agent.analysis.results import TaskResult
from r2med_agent.analysis.tables import MISSING, ComparisonTable
from r2med_agent.data.formats import DEFAULT_SPLIT
from r2med_agent.errors import ConfigError
from r2med_agent.io import atomic_write_text
from r2med_agent.paths import resources_dir
from r2med_agent.types import DataOrigin, Task

__all__ = [
    "COST_AXES", "DRILL_METRICS", "TOP_K", "TaskData", "drilldown_data", "inline_svg", "load_report_tasks",
    "per_task_figure", "plot_per_task", "plot_quality_vs_cost", "quality_figure", "render_html", "task_data",
    "write_report",
]
"""The report's names; its plots are in :mod:`~r2med_agent.analysis.plots`, its drill-down data in
:mod:`~r2med_agent.analysis.drilldown`."""

logger = logging.getLogger(__name__)

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
        sig_note=significance_note(table),
        footnotes=table.footnotes(),
        plots=[(name, markupsafe.Markup(svg)) for name, svg in plots.items()],
        data_json=_json_for_script(data),
        missing=MISSING,
        markdown=render_markdown(table),
    )


def significance_note(table: ComparisonTable) -> str:
    """What a cell of the significance table shows, naming the test that ran: the difference of
    means (with the bootstrap, its 95% interval, which only that test gives), the p-value and the
    wins/ties/losses over queries."""
    if table.test == "bootstrap":
        return ("Per cell: difference of means against the baseline with its 95% bootstrap interval, the "
                "p-value of the paired bootstrap test and wins/ties/losses over queries")
    return ("Per cell: difference of means against the baseline, the p-value of the paired randomisation "
            "(permutation) test and wins/ties/losses over queries")


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
        table: the comparison (see :func:`r2med_agent.analysis.tables.build_table`).
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
        _write_plot(lambda path, fig=fig: save_png(fig, path), out / file)
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
