"""Comparing results from Python: the public names of :mod:`r2med_agent.analysis` behind
``r2med-agent compare``.

:func:`load_results` reads result trees into rows (one per run spec), :func:`build_table` lays
them out against the tasks beside the published scores, and :func:`render` writes the table as
Markdown, CSV or plain text. See docs/python-api.md.
"""

from __future__ import annotations

from r2med_agent.analysis.published import PublishedKey, PublishedResults, published_results
from r2med_agent.analysis.render import FORMATS, print_rich, render
from r2med_agent.analysis.results import ResultRow, TaskResult, load_results
from r2med_agent.analysis.tables import ComparisonTable, TableOptions, TableRow, build_table, find_row

__all__ = [
    "FORMATS", "ComparisonTable", "PublishedKey", "PublishedResults", "ResultRow", "TableOptions", "TableRow",
    "TaskResult", "build_table", "find_row", "load_results", "print_rich", "published_results", "render",
]
