"""Reproducing the paper's tables from Python: the public names of :mod:`r2med_agent.analysis`
behind ``r2med-agent reproduce``.

A :class:`Grid` (:func:`load_grid`, by table name or file) lists the runs of one table beside
their published scores; :func:`plan` says what each run needs and which of its tasks are done,
:func:`reproduce` runs what is missing and returns the comparison table. See docs/python-api.md.
"""

from __future__ import annotations

from r2med_agent.grids.grid import TABLES, Grid, GridEntry, load_grid, load_grids
from r2med_agent.grids.planner import PlannedRun, ReproduceOptions, format_plan, plan, reproduce, results_table

__all__ = [
    "TABLES", "Grid", "GridEntry", "PlannedRun", "ReproduceOptions", "format_plan", "load_grid", "load_grids", "plan",
    "reproduce", "results_table",
]
