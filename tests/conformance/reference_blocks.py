"""Running pieces of the authors' scripts without running the scripts: functions compiled from a
file's syntax tree (:func:`reference_functions`), and a run of inline statements of a long
function as a function of its inputs (:func:`reference_block`). The conformance tests use them
where a module cannot be imported, or where what is compared lives inline in a ``main``."""

from __future__ import annotations

import ast
import re
import typing
from pathlib import Path
from typing import Any


def reference_functions(path: Path, names: set[str], scope: dict[str, Any] | None = None) -> dict[str, Any]:
    """The authors' functions ``names`` (module level, methods or nested), compiled from the
    file's syntax tree alone: the rest of the file does not run."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {d.name for d in defs} == names, f"{path.name} lacks {names - {d.name for d in defs}}"
    ns: dict[str, Any] = {"re": re, **{k: getattr(typing, k) for k in ("List", "Dict", "Any", "Tuple", "Optional")},
                          **(scope or {})}
    exec(compile(ast.Module(defs, type_ignores=[]), str(path), "exec"), ns)  # noqa: S102 - the authors' code, pinned
    return ns


def reference_block(path: Path, first: str, last: str, inputs: tuple[str, ...], output: str | tuple[str, ...],
                    scope: dict[str, Any], *, prefix: bool = False) -> Any:
    """The statements of ``path`` from the one that reads ``first`` to the one that reads ``last``
    (inline code of a long function), as a function of ``inputs`` returning ``output`` (a tuple
    of values for a tuple of names). ``prefix``: a statement matches when its text starts with
    ``first`` or ``last`` (a compound statement named by its first line)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))

    def matches(text: str, wanted: str) -> bool:
        return text.startswith(wanted) if prefix else text == wanted

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        text = [ast.unparse(s) for s in body]
        i = next((k for k, t in enumerate(text) if matches(t, first)), None)
        if i is None:
            continue
        j = next(k for k in range(i, len(text)) if matches(text[k], last))
        names = (output,) if isinstance(output, str) else output
        value: ast.expr = ast.Name(names[0], ast.Load()) if isinstance(output, str) else ast.Tuple(
            [ast.Name(n, ast.Load()) for n in names], ast.Load())
        func = ast.FunctionDef(name="block", args=ast.arguments(
            posonlyargs=[], args=[ast.arg(a) for a in inputs], kwonlyargs=[], kw_defaults=[], defaults=[]),
            body=[*body[i:j + 1], ast.Return(value)], decorator_list=[], type_params=[])
        ns = dict(scope)
        exec(compile(ast.fix_missing_locations(ast.Module([func], type_ignores=[])), str(path), "exec"), ns)  # noqa: S102
        return ns["block"]
    raise AssertionError(f"{path.name} has no statement {first!r}")
