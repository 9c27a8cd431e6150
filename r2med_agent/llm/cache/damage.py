"""A damaged generation cache file: the error that names it, the check of every read and write,
the warning for a file cut to nothing, and the generations that could not be written into it
(kept beside it in ``<name>.unsaved-<UTC time>-<pid>.jsonl``, which ``cache repair`` adds)."""

from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from r2med_agent.errors import DataError

logger = logging.getLogger("r2med_agent.llm.cache.store")

UNSAVED = ".unsaved-"
"""What a file of generations that could not be written has after the cache file's name."""


class CacheDamagedError(DataError):
    """The cache file is damaged (``database disk image is malformed``): the file, what to do."""

    def __init__(self, path: Path, reason: str, opening: bool = False, unsaved: tuple[int, Path] | None = None) -> None:
        what = f"cannot open generation cache: {reason}" if opening else f"the generation cache file is damaged ({reason})"
        kept = (f"; the {unsaved[0]} generations just made could not go into it and are kept in {unsaved[1]}, "
                "which the repair adds" if unsaved else "")
        super().__init__(
            f"{what}{kept}; the generations in it that can still be read "
            f"are kept by 'r2med-agent cache repair --cache-path {path}' (it copies them into a new file here and "
            f"moves the damaged one aside, deleting nothing); or run with another --cache-path", path)
        self.reason = reason


def is_damage(e: BaseException) -> bool:
    """Whether an SQLite error says the file is damaged (``SQLITE_CORRUPT``, ``SQLITE_NOTADB``)."""
    if not isinstance(e, sqlite3.DatabaseError):
        return False
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None and code & 0xFF in (11, 26):
        return True
    return "malformed" in str(e) or "not a database" in str(e)


_F = TypeVar("_F", bound=Callable[..., Any])


def reports_damage(method: _F) -> _F:
    """Raise :class:`CacheDamagedError` where ``method`` meets a damaged file, not SQLite's error."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except sqlite3.DatabaseError as e:
            if not is_damage(e):
                raise
            raise CacheDamagedError(self.path, str(e)) from None

    return wrapper  # type: ignore[return-value]


EMPTY_FILE_AGE_S = 5.0
"""An empty cache file younger than this is another process's new one, not yet written."""


def warn_if_emptied(path: Path) -> None:
    """Warn of a 0-byte cache file without a log, which SQLite would take as new without a word."""
    try:
        st = path.stat()
        wal = Path(f"{path}-wal")
        if st.st_size or (wal.exists() and wal.stat().st_size) or time.time() - st.st_mtime < EMPTY_FILE_AGE_S:
            return
    except OSError:
        return
    logger.warning("generation cache %s is an empty file (0 bytes) and is used as a new cache; if it held "
                   "generations (a copy or a disk that cut it to nothing), they are not in it any more: stop now "
                   "and restore it from a backup", path)


def keep_unsaved(path: Path, grows: Sequence[Sequence[Any]], urows: Sequence[Sequence[Any]]) -> tuple[int, Path]:
    """Write rows a damaged cache at ``path`` refused (in its columns' order) to a JSON-lines file
    beside it, one ``{"generations": row}`` or ``{"uses": row}`` a line; returns how many
    generations and the file. The generations were paid for: never dropped in silence."""
    from r2med_agent.io import atomic_write_text

    out = path.with_name(f"{path.name}{UNSAVED}{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}.jsonl")
    lines = [json.dumps({"generations": list(r)}, ensure_ascii=False) for r in grows]
    lines += [json.dumps({"uses": list(r)}, ensure_ascii=False) for r in urows]
    atomic_write_text(out, "".join(line + "\n" for line in lines))
    return len(grows), out


def read_unsaved(path: Path) -> tuple[list[Path], dict[str, list[tuple[Any, ...]]]]:
    """The files :func:`keep_unsaved` left beside the cache at ``path`` and their rows by table."""
    from r2med_agent.io import iter_jsonl

    files = sorted(path.parent.glob(f"{path.name}{UNSAVED}*.jsonl"))
    rows: dict[str, list[tuple[Any, ...]]] = {"generations": [], "uses": []}
    for f in files:
        for _, obj in iter_jsonl(f):
            for table, row in obj.items():
                if table in rows and isinstance(row, list):
                    rows[table].append(tuple(row))
    return files, rows
