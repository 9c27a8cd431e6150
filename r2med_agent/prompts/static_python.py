"""Static reading of a reference clone's Python (``prompts import``): its files parsed with
:mod:`ast`, nothing imported or run; string expressions (literals, f-strings, ``+``,
``str.format`` templates) turned into pieces of literal text and Jinja expressions, and pieces
into template source that renders exactly the reference's text."""

from __future__ import annotations

import ast
import json
import string
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from r2med_agent.errors import DataError
from r2med_agent.prompts.templates import EXACT_MARK

Piece = tuple[str, str]
"""One part of a prompt: ``("text", literal)``, ``("expr", Jinja expression)`` or ``("code",
Jinja source spliced as it is)``."""


# ----------------------------------------------------------------------------------------------
# Jinja from literal text and expressions


def jinja_literal(text: str) -> str:
    """``text`` as template source that renders to exactly ``text``: a ``{`` that would open a
    Jinja tag (or ends the piece), a carriage return, and a leading newline (which ``trim_blocks``
    drops after a block tag) are written as expressions."""
    out = []
    for i, ch in enumerate(text):
        nxt = text[i + 1] if i + 1 < len(text) else ""
        if (ch == "{" and nxt in ("{", "%", "#", "")) or ch == "\r" or (ch == "\n" and i == 0):
            out.append("{{ " + json.dumps(ch) + " }}")
        else:
            out.append(ch)
    return "".join(out)


def jinja_source(pieces: Iterable[Piece]) -> str:
    merged: list[Piece] = []
    for piece in pieces:  # adjacent literals as one, so that only real tag openings are escaped
        if merged and piece[0] == merged[-1][0] == "text":
            merged[-1] = ("text", merged[-1][1] + piece[1])
        else:
            merged.append(piece)
    parts = []
    for kind, value in merged:
        parts.append(jinja_literal(value) if kind == "text" else value if kind == "code" else "{{ " + value + " }}")
    return "".join(parts)


def exact_template(origin: str, reference: str, body: str) -> str:
    """A template file: the exact-rendering mark (naming the source), then the body."""
    return f"{EXACT_MARK} {reference}: {origin} #}}\n{body}"


# ----------------------------------------------------------------------------------------------
# Static reading of string expressions


@dataclass
class CloneFile:
    """One parsed file of the clone."""

    path: Path
    rel: str
    tree: ast.Module

    def at(self, node: ast.AST) -> str:
        return f"{self.rel}:{getattr(node, 'lineno', 0)}"

    def error(self, message: str, node: ast.AST | None = None) -> DataError:
        return DataError(message, self.path, getattr(node, "lineno", None))

    def function(self, name: str) -> ast.FunctionDef:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
        raise self.error(f"no function {name}() (the reference's layout)")

    def assigned(self, name: str) -> ast.expr:
        """The value of the module-level ``name = ...``."""
        for node in self.tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return node.value
        raise self.error(f"no module-level {name} = ... (the reference's layout)")


def read_python(path: Path, what: str = "it") -> ast.Module:
    """``path`` parsed with :mod:`ast` (nothing run). ``what`` names the file in the message when
    it cannot be read.

    Raises:
        DataError: unreadable, not UTF-8, or not valid Python (file, and line where known).
    """
    try:
        source = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError("not UTF-8 text", path) from None
    except OSError as e:
        raise DataError(f"cannot read {what} ({e.strerror})", path) from None
    try:
        return ast.parse(source, filename=str(path))
    except SyntaxError as e:
        raise DataError(f"not valid Python: {e.msg}", path, e.lineno) from None


def parse_file(clone: Path, rel: str) -> CloneFile:
    path = clone / rel
    return CloneFile(path, rel, read_python(path))


def string_pieces(mod: CloneFile, node: ast.expr, names: dict[str, Piece]) -> list[Piece]:
    """A string expression as pieces: literals, f-strings whose fields are the names in ``names``
    (Python name -> the piece it stands for), and ``+`` of those. Anything else is an error."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [("text", node.value)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return string_pieces(mod, node.left, names) + string_pieces(mod, node.right, names)
    if isinstance(node, ast.JoinedStr):
        out: list[Piece] = []
        for value in node.values:
            if isinstance(value, ast.FormattedValue):
                inner = value.value
                if not (isinstance(inner, ast.Name) and inner.id in names) or value.conversion != -1 or value.format_spec:
                    raise mod.error(f"an f-string field other than {', '.join(sorted(names)) or 'none'}", node)
                out.append(names[inner.id])
            else:
                out.extend(string_pieces(mod, value, names))
        return out
    raise mod.error(f"expected literal text or an f-string, found {type(node).__name__}", node)


def format_pieces(mod: CloneFile, node: ast.AST, text: str, fields: dict[str, str]) -> list[Piece]:
    """``text`` (a ``str.format`` template) as pieces: each ``{NAME}`` becomes ``fields[NAME]``,
    a Jinja expression, or Jinja code spliced as it is when it starts with ``{%`` (a loop)."""
    out: list[Piece] = []
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as e:
        raise mod.error(f"not a valid format string: {e}", node) from None
    for literal, name, spec, conversion in parsed:
        if literal:
            out.append(("text", literal))
        if name is None:
            continue
        if name not in fields or spec or conversion:
            raise mod.error(f"a format field {{{name}}} other than {', '.join('{' + f + '}' for f in fields)}", node)
        value = fields[name]
        out.append(("code", value) if value.startswith("{%") else ("expr", value))
    return out


def returned_value(mod: CloneFile, func: ast.FunctionDef) -> ast.expr:
    for node in ast.walk(func):
        if isinstance(node, ast.Return) and node.value is not None:
            return node.value
    raise mod.error(f"{func.name}() returns nothing", func)


def param_exprs(func: ast.FunctionDef, exprs: Sequence[str]) -> dict[str, Piece]:
    """The function's first parameters (after ``self``), by position, mapped to Jinja expressions."""
    args = [a for a in func.args.args if a.arg != "self"]
    return {a.arg: ("expr", e) for a, e in zip(args, exprs)}


def str_constants(body: Iterable[ast.stmt]) -> dict[str, Piece]:
    """``NAME = "text"`` assignments among ``body``'s statements, as literal pieces."""
    out: dict[str, Piece] = {}
    for stmt in body:
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)):
            out[stmt.targets[0].id] = ("text", stmt.value.value)
    return out


def clone_commit(clone: Path) -> str | None:
    """The clone's HEAD commit, or None without a ``.git`` (or without git)."""
    if not (clone / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None

