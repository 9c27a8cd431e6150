"""Record parsing and validation shared by the task readers: rows of ``.jsonl`` and ``.parquet``
files, ids, texts, queries and documents.

Every problem raises :class:`~r2med_agent.errors.DataError` naming the file and line.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Container, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from r2med_agent.errors import DataError, MissingExtraError
from r2med_agent.io import iter_jsonl
from r2med_agent.types import Doc, Query


_ASCII_BAD = re.compile(r"[\x00-\x20\x7f]")
"""What an ASCII id cannot hold: whitespace (a TREC run or qrels line is split on it, so such an id
cannot be written into a run file, and one stripped silently would not be the id the other files
name) and control characters (NUL among them). An id that is not ASCII is checked character by
character (:func:`id_problem`)."""

_FILLERS = frozenset((0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x2800, 0x3164, 0xFFA0))
"""Characters that show nothing though they are letters or marks: the combining grapheme joiner,
the Hangul fillers, the Khmer inherent vowels, the blank Braille pattern."""


def _invisible(ch: str) -> bool:
    """Whether ``ch`` is invisible or changes the direction of the text around it: a control,
    format or surrogate character (Unicode categories Cc, Cf, Cs: NUL, the soft hyphen, LRM, RLM,
    ALM, the bidirectional embeddings, overrides and isolates, the invisible operators, tag
    characters ...), a variation selector (VS1-VS256, the Mongolian ones) or a filler
    (:data:`_FILLERS`)."""
    cp = ord(ch)
    return (unicodedata.category(ch) in ("Cc", "Cf", "Cs") or cp in _FILLERS or 0xFE00 <= cp <= 0xFE0F
            or 0xE0100 <= cp <= 0xE01EF or 0x180B <= cp <= 0x180F)


_SHOWS_NOTHING = re.compile("[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u2800\u3164\ufe00-\ufe0f\uffa0"
                            "\U000e0100-\U000e01ef]")
"""The characters of :func:`_invisible` that ``str.isprintable`` takes as printable (the fillers and
the variation selectors): with it, one test in C clears the usual id that is not ASCII."""


def usable_id(text: str) -> bool:
    """Whether ``text`` passes :func:`id_problem`."""
    return bool(text) and id_problem(text) is None


def id_problem(text: str) -> tuple[str, str] | None:
    """What makes ``text`` unusable as an id and what to do, or None: whitespace (a TREC line is
    split on it), or an invisible or direction-changing character (:func:`_invisible`), which makes
    two ids that look the same differ, or, a NUL, makes two that differ the same to trec_eval and
    pytrec_eval (they read an id up to its first NUL)."""
    if _ASCII_BAD.search(text) is None if text.isascii() else text.isprintable() and not _SHOWS_NOTHING.search(text):
        return None  # (what str.isprintable refuses: categories C and Z but the space)
    at = next((i for i, c in enumerate(text) if c.isspace() or _invisible(c)), None)
    if at is None:
        return None
    ch = text[at]
    if not ch.isspace():
        name = "NUL" if ch == "\0" else unicodedata.name(ch, "") or "CONTROL CHARACTER"
        why = ("which trec_eval and pytrec_eval read as the end of the id (ids that differ after it "
               "count as the same)" if ch == "\0" else "which makes it differ from the same id without it")
        return f"holds an invisible character (U+{ord(ch):04X} {name})", f"{why}; remove it"
    where = "leading " if at == 0 else "trailing " if not text[at + 1:].strip() else ""
    return f"holds {where}whitespace", "which a TREC run file cannot hold; use ids without spaces, tabs or line breaks"


def nfkc_twin(item_id: str, seen: Container[str], folded: dict[str, str]) -> str | None:
    """An id met before (a key of ``seen``) that is ``item_id`` after Unicode normalisation
    (NFKC: ``ﬁ`` and ``fi``, full-width and ASCII digits, composed and decomposed accents), or
    None. ``item_id`` itself is not in ``seen`` (exact repeats are the caller's check);
    ``folded`` is the caller's memory of the ids that change under NFKC (empty for ASCII ids,
    which none of this costs more than one test)."""
    if item_id.isascii() or unicodedata.is_normalized("NFKC", item_id):
        return folded.get(item_id) if folded else None
    key = unicodedata.normalize("NFKC", item_id)
    if key in seen:
        return key
    twin = folded.setdefault(key, item_id)
    return None if twin == item_id else twin


def check_run_ids(qid: str, doc: str, docs: Container[str], folded: dict[str, dict[str, str]], path: Path,
                  lineno: int) -> None:
    """Refuse the ids of a run file's line as a task's files are refused (:func:`id_problem`), and a
    document that is another of the query's (``docs``) after NFKC; ``folded`` is the reader's
    memory for :func:`nfkc_twin`, per query.

    Raises:
        DataError: with file and line.
    """
    for what, value in (("query", qid), ("document", doc)):
        if not usable_id(value):
            problem = id_problem(value) or ("is empty", "give an id")
            raise DataError(f"{what} id {value!r} {problem[0]}, {problem[1]}", path, lineno)
    twin = nfkc_twin(doc, docs, folded.setdefault(qid, {}))
    if twin is not None:
        raise DataError(twin_message("document", doc, twin) + f" (query {qid!r})", path, lineno)


def twin_message(what: str, item_id: str, twin: str) -> str:
    """The message for an id that is another after NFKC (:func:`nfkc_twin`)."""
    return (f"{what} id {item_id!r} is the same as {twin!r} after Unicode normalisation (NFKC); two ids "
            f"that read the same would be confused: give them distinct ids")


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
    folded: dict[str, str] = {}
    for line, obj in records:
        qid = _get_id(obj, id_keys, path, line, "query")
        if qid in seen:
            raise DataError(f"duplicate query id {qid!r} (first on line {seen[qid]})", path, line)
        twin = nfkc_twin(qid, seen, folded)
        if twin is not None:
            raise DataError(twin_message("query", qid, twin) + f" (line {seen[twin]})", path, line)
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
    folded: dict[str, str] = {}
    key = id_keys[0]
    for line, obj in records:
        # Fast path for the common well-formed record; anything unusual goes through the checks.
        doc_id = obj.get(key)
        if not (type(doc_id) is str and doc_id and doc_id.isascii() and not _ASCII_BAD.search(doc_id)):
            doc_id = _get_id(obj, id_keys, path, line, "document")
        if doc_id in seen:
            raise DataError(f"duplicate document id {doc_id!r} (first on line {seen[doc_id]})", path, line)
        twin = nfkc_twin(doc_id, seen, folded)
        if twin is not None:
            raise DataError(twin_message("document", doc_id, twin) + f" (line {seen[twin]})", path, line)
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
