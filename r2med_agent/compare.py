"""Comparison tables of results (the code lives in :mod:`r2med_agent.analysis`: ``results``,
``published``, ``tables`` and ``render``); this module keeps their names importable from one place."""

from __future__ import annotations

from r2med_agent.analysis.published import (  # noqa: F401
    PUBLISHED_METRICS,
    PUBLISHED_RETRIEVERS,
    PublishedKey,
    PublishedResults,
    published_results,
)
from r2med_agent.analysis.render import (  # noqa: F401
    FORMATS,
    key_cells,
    key_headers,
    print_rich,
    render,
    render_csv,
    render_markdown,
    render_rich,
    significance_grid,
    text_grid,
)
from r2med_agent.analysis.results import (  # noqa: F401
    NO_LLM,
    STATS_HEADERS,
    STATS_KEYS,
    VARIANTS,
    ResultRow,
    TaskResult,
    load_results,
    method_order,
    r2med_tasks,
    split_leaf,
    task_order,
)
from r2med_agent.analysis.tables import (  # noqa: F401
    BETTER_MARK,
    MISSING,
    PARTIAL_MARK,
    WORSE_MARK,
    ComparisonTable,
    RowAliases,
    TableRow,
    build_table,
    find_row,
    grid_aliases,
    published_key,
)

__all__ = ['BETTER_MARK', 'ComparisonTable', 'FORMATS', 'MISSING', 'NO_LLM', 'PARTIAL_MARK', 'PUBLISHED_METRICS', 'PUBLISHED_RETRIEVERS', 'PublishedKey', 'PublishedResults', 'ResultRow', 'RowAliases', 'STATS_HEADERS', 'STATS_KEYS', 'TableRow', 'TaskResult', 'VARIANTS', 'WORSE_MARK', 'build_table', 'find_row', 'grid_aliases', 'key_cells', 'key_headers', 'load_results', 'method_order', 'print_rich', 'published_key', 'published_results', 'r2med_tasks', 'render', 'render_csv', 'render_markdown', 'render_rich', 'significance_grid', 'split_leaf', 'task_order', 'text_grid']
