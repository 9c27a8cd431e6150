"""Rich tables whose figures are never cut.

A figure column (:func:`figure_column`) never wraps: its cells are printed whole. A label column
(:func:`label_column`) folds its text onto more lines. :func:`print_table` prints a table at the
console's width when its figures fit there with each label column at least
:data:`LABEL_FLOOR` characters wide; otherwise at the width it needs, wider than the console (a
file or a pipe gets longer lines, a terminal wraps them), rather than let rich shorten every
column and cut numbers (``0.73…``, ``5…``).
"""

from __future__ import annotations

import re
from typing import Any

LABEL_FLOOR = 20
"""The narrowest a label column is folded to before a table is printed wider than the console."""


def figure_column(table: Any, header: str, **options: Any) -> None:
    """A right-aligned column of figures that never wraps; a header longer than ``options``'
    ``min_width`` may be given on several lines (:func:`stacked`)."""
    table.add_column(header, justify=options.pop("justify", "right"), no_wrap=True, **options)


def label_column(table: Any, header: str, **options: Any) -> None:
    """A column of names and labels, folded onto more lines when the table is narrow."""
    table.add_column(header, overflow="fold", **options)


def stacked(header: str, width: int) -> str:
    """``header`` on lines of about ``width`` characters, broken after a space, ``-``, ``/`` or
    ``_`` (``MedXpertQA-Exam`` -> ``MedXpertQA-`` / ``Exam``), for a figure column whose figures
    are narrower than its name; a header without such a break stays on one line."""
    if len(header) <= width:
        return header
    parts = re.findall(r"[^ /_-]+[ /_-]*", header)
    lines, line = [], ""
    for part in parts:
        if line and len(line) + len(part.rstrip()) > width:
            lines.append(line.rstrip())
            line = ""
        line += part
    lines.append(line.rstrip())
    return "\n".join(lines)


def table_width(console: Any, table: Any) -> int:
    """The narrowest width at which ``table``'s figure columns keep every cell whole and its
    label columns are at least :data:`LABEL_FLOOR` characters (or their widest cell) wide."""
    from rich.measure import Measurement

    options = console.options.update(max_width=1 << 16)
    whole = Measurement.get(console, options, table).maximum
    widest = [max(Measurement.get(console, options, c).maximum for c in [col.header, *col.cells])
              for col in table.columns]
    floors = [w if col.no_wrap else max(min(w, LABEL_FLOOR), col.min_width or 0)
              for col, w in zip(table.columns, widest)]
    return whole - sum(widest) + sum(floors)


def print_table(console: Any, table: Any) -> None:
    """Print ``table`` on ``console`` with no figure cut (module docstring)."""
    needed = table_width(console, table)
    if needed <= console.width:
        console.print(table)
        return
    from rich.segment import Segments

    segments = list(console.render(table, console.options.update(width=needed)))
    console.print(Segments(segments), crop=False, soft_wrap=True, end="")
