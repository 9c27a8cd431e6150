"""Record parsing and validation shared by the task readers: rows of ``.jsonl`` and ``.parquet``
files, ids, texts, queries and documents.

Every problem raises :class:`~r2med_agent.errors.DataError` naming the file and line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from r2med_agent.errors import DataError, MissingExtraError
from r2med_agent.io import iter_jsonl
from r2med_agent.types import Doc, Query


_INNER_SPACE = re.compile(r"[\s\u180e\u200b-\u200d\u2060\ufeff]")
"""Whitespace in an id (inside it, leading or trailing): a TREC run or qrels line is split on it,
so such an id cannot be written into the run file (a newline would even add lines), and one
stripped silently would not be the id the other files name; also the zero-width characters
(U+200B-U+200D, U+2060, U+FEFF, U+180E), which make two ids that look the same differ. Refused
where it is read."""


def id_problem(text: str) -> tuple[str, str] | None:
    """What makes ``text`` unusable as an id (:data:`_INNER_SPACE`) and what to do, or None."""
    m = _INNER_SPACE.search(text)
    if m is None:
        return None
    ch = m.group()
    if not ch.isspace():
        import unicodedata

        return (f"holds an invisible character (U+{ord(ch):04X} {unicodedata.name(ch, 'FORMAT CHARACTER')})",
                "which makes it differ from the same id without it; remove it")
    where = "leading " if m.start() == 0 else "trailing " if not text[m.end():].strip() else ""
    return f"holds {where}whitespace", "which a TREC run file cannot hold; use ids without spaces, tabs or line breaks"


def _check_unique(ids: list[tuple[str, Path]], paths: list[Path], what: str) -> None:
    if len(paths) < 2:
        return  # single files are checked with line numbers while parsing
    seen: set[str] = set()
    for item_id, path in ids:
        if item_id in seen:
            raise DataError(f"duplicate {what} id {item_id!r} across shards", path)
        seen.add(item_id)


def _iter_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number, record) from a .jsonl or .parquet file."""
    if path.suffix == ".jsonl":
        yield from iter_jsonl(path)
        return
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise MissingExtraError("pyarrow", "hub") from None
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
        raise DataError(f"unreadable parquet file: {e}", path) from None
    yield from enumerate(table.to_pylist(), start=1)


def _require(path: Path) -> Path:
    if not path.is_file():
        raise DataError(f"missing file {path.name}", path.parent)
    return path


def _get_id(obj: dict[str, Any], keys: Sequence[str], path: Path, line: int, what: str) -> str:
    for key in keys:
        if key in obj and obj[key] is not None:
            value = obj[key]
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                raise DataError(f"{what} field '{key}' must be a string, got {value!r}", path, line)
            text = str(value)
            if not text.strip():
                raise DataError(f"empty {what} field '{key}'", path, line)
            problem = id_problem(text)
            if problem:
                raise DataError(f"{what} id {text!r} {problem[0]} (field '{key}'), {problem[1]}", path, line)
            return text
    raise DataError(f"missing field '{keys[0]}' (the {what} id)", path, line)


def _get_text(obj: dict[str, Any], path: Path, line: int, what: str, *, allow_empty: bool) -> str:
    if "text" not in obj or obj["text"] is None:
        if allow_empty:
            return ""
        raise DataError(f"missing field 'text' of the {what}", path, line)
    value = obj["text"]
    if not isinstance(value, str):
        raise DataError(f"{what} field 'text' must be a string, got {type(value).__name__}", path, line)
    if not allow_empty and not value.strip():
        raise DataError(f"empty {what} text", path, line)
    return value


def _parse_queries(
    records: Iterable[tuple[int, dict[str, Any]]], path: Path, id_keys: Sequence[str]
) -> list[Query]:
    out: list[Query] = []
    seen: dict[str, int] = {}
    for line, obj in records:
        qid = _get_id(obj, id_keys, path, line, "query")
        if qid in seen:
            raise DataError(f"duplicate query id {qid!r} (first on line {seen[qid]})", path, line)
        seen[qid] = line
        text = _get_text(obj, path, line, "query", allow_empty=False)
        answer = obj.get("answer")
        answer = "" if answer is None else answer if isinstance(answer, str) else str(answer)
        out.append(Query(query_id=qid, text=text, answer=answer))
    if not out:
        raise DataError("no queries", path)
    return out


def _parse_docs(
    records: Iterable[tuple[int, dict[str, Any]]], path: Path, id_keys: Sequence[str]
) -> list[Doc]:
    out: list[Doc] = []
    seen: dict[str, int] = {}
    key = id_keys[0]
    for line, obj in records:
        # Fast path for the common well-formed record; anything unusual goes through the checks.
        doc_id = obj.get(key)
        if not (type(doc_id) is str and doc_id and not _INNER_SPACE.search(doc_id)):
            doc_id = _get_id(obj, id_keys, path, line, "document")
        if doc_id in seen:
            raise DataError(f"duplicate document id {doc_id!r} (first on line {seen[doc_id]})", path, line)
        seen[doc_id] = line
        title = obj.get("title") or ""
        text = obj.get("text")
        if not (type(text) is str and title == "" and text and not text.isspace()):
            if not isinstance(title, str):
                raise DataError(f"document field 'title' must be a string, got {title!r}", path, line)
            text = _get_text(obj, path, line, "document", allow_empty=bool(title.strip()))
            if not text.strip() and not title.strip():
                raise DataError("empty document text", path, line)
        out.append(Doc(doc_id, text, title))
    if not out:
        raise DataError("empty corpus", path)
    return out
