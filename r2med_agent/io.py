"""Small file helpers: atomic writes (a killed process never leaves a half-written file) and
JSONL reading with file:line errors."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from r2med_agent.errors import DataError


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        set_default_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once: os.umask is process-wide and not thread-safe to toggle


def set_default_mode(path: str | os.PathLike[str]) -> None:
    """Give a file made by ``tempfile.mkstemp`` (mode 0600) the mode ``open()`` would have
    given it (0666 less the umask), before it is renamed into place."""
    os.chmod(path, 0o666 & ~_UMASK)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, indent: int | None = 2) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent, ensure_ascii=False) + "\n")


def iter_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, object)`` for each non-blank line; malformed lines raise DataError."""
    path = Path(path)
    try:
        f = path.open(encoding="utf-8")
    except OSError as e:
        raise DataError(f"cannot read file: {e.strerror}", path) from None
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"malformed JSON ({e.msg} at column {e.colno})", path, lineno) from None
            if not isinstance(obj, dict):
                raise DataError(f"expected a JSON object, got {type(obj).__name__}", path, lineno)
            yield lineno, obj
