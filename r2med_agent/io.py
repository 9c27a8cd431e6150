"""Small file helpers: atomic writes (a killed process never leaves a half-written file), shared
caches under concurrency and faults (writer-named temporaries, stale-temporary cleanup, build
locks, full-disk errors), and reading UTF-8 text and JSONL with ``file:line`` errors (never a
UnicodeDecodeError or a RecursionError from a deeply nested line).

Every temporary file or folder this package writes is named ``.<target>.<host>~<pid>.<random>.tmp``
(:func:`temp_prefix`): :func:`remove_stale_temps` removes one only when its writer is known dead
(same host, no such process) or, for a name without a writer, when it is old."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from r2med_agent.errors import ConfigError, DataError, DiskFullError


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` (UTF-8) so that a killed process never leaves a half-written
    file (:func:`atomic_write_bytes`)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` so that a killed process never leaves a half-written file.

    A regular file (or a new one) is written through a temporary file in the same folder and
    ``os.replace``. A symlink is followed: its target is written the same way, the link stays. A
    path that exists but is no regular file (a device such as ``/dev/stdout``, a FIFO) cannot be
    replaced atomically and must not be replaced at all: it is opened and written in place.
    Nothing but the named path (or its link target) and its temporary file is touched.

    Returns:
        the path as given.
    """
    given = Path(path)
    target = Path(os.path.realpath(given)) if given.is_symlink() else given
    if target.exists() and not target.is_file():
        if target.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(given))
        with open(target, "wb") as f:  # a device or FIFO: written in place
            f.write(data)
        return given
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=temp_prefix(target), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        set_default_mode(tmp)
        os.replace(tmp, target)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        raise_if_disk_full(e, target, len(data))
        raise
    return given


# -- concurrency and faults -------------------------------------------------------------------

_HOST = re.sub(r"[^A-Za-z0-9-]+", "-", socket.gethostname()) or "host"
_WRITER = re.compile(r"\.(?P<host>[A-Za-z0-9-]+)~(?P<pid>[0-9]+)\.[^.]*\.tmp$")
STALE_AFTER_S = 24 * 3600
"""A temporary whose writer cannot be checked (another host, an older version's name) is removed
only when it has not changed for this long."""


def inside(root: str | os.PathLike[str], *parts: str) -> Path:
    """``root / parts``, each part one plain file or folder name: a part that is empty, ``.`` or
    ``..`` or holds a slash, a backslash, a NUL or a line break (what would lead outside ``root``,
    or make a name other tools cannot read) is refused with ConfigError before anything is
    written."""
    for part in parts:
        if part in ("", ".", "..") or any(c in part for c in "/\\\0\n\r"):
            raise ConfigError(f"{root}: refused to use {part!r} as a name in it: it would lead outside the folder "
                              "or make a name other tools cannot read")
    return Path(root).joinpath(*parts)


def temp_prefix(target: str | os.PathLike[str]) -> str:
    """The name prefix of a temporary for ``target`` written by this process:
    ``.<target name>.<host>~<pid>.`` (``tempfile`` adds a random part; the suffix is ``.tmp``)."""
    return f".{Path(target).name}.{_HOST}~{os.getpid()}."


def _writer_alive(name: str, age_s: float) -> bool:
    """Whether the writer of the temporary ``name`` may still be writing it."""
    m = _WRITER.search(name)
    if m is None or m["host"] != _HOST:
        return age_s < STALE_AFTER_S
    pid = int(m["pid"])
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a live process of another user
        return True
    return True


def remove_stale_temps(folder: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporaries (``.*.tmp`` files and folders) in ``folder`` whose writer is dead.

    A temporary named by :func:`temp_prefix` on this host is removed when no process has its pid
    (a pid reused by a live process keeps it: never a live writer's file); one of another host or
    without a writer in its name when it has not changed for :data:`STALE_AFTER_S`. Returns what
    was removed; a folder that cannot be listed removes nothing.
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        if not (entry.name.startswith(".") and entry.name.endswith(".tmp")):
            continue
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        if _writer_alive(entry.name, age):
            continue
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


@contextlib.contextmanager
def build_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (made if absent) while the block runs.

    Processes that build the same shared artifact take its lock first; the second waits for the
    first and then finds its result. The kernel drops the lock when its holder dies (even by
    SIGKILL), so a killed builder never blocks later runs.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666 & ~_UMASK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


_FULL = (errno.ENOSPC, errno.EDQUOT)
_SHORT_WRITE = re.compile(r"^[0-9]+ requested and [0-9]+ written$")


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes an unprivileged writer can still use on the file system of ``path`` (or of its
    nearest existing parent); None when it cannot be asked."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def raise_if_disk_full(exc: BaseException, path: str | os.PathLike[str], size: int | None) -> None:
    """Raise DiskFullError for ``path`` (``size`` bytes were being written; None: not known)
    when ``exc`` is a full disk or quota; the caller has already removed its temporaries. Other
    errors return.

    numpy's ``tofile`` (under ``np.save`` to a path) reports a full disk as a short write
    ("N requested and M written") without an errno; that counts too."""
    short_write = isinstance(exc, OSError) and exc.errno is None and _SHORT_WRITE.search(str(exc))
    if isinstance(exc, OSError) and (exc.errno in _FULL or short_write):
        free = free_bytes(path)
        raise DiskFullError(path, None if size is None else max(size - (free or 0), 1)) from None


def check_space(path: str | os.PathLike[str], size: int) -> None:
    """Raise DiskFullError when the file system of ``path`` has fewer than ``size`` bytes free
    (checked before a large write, whose own ENOSPC is still handled where it happens)."""
    free = free_bytes(path)
    if free is not None and free < size:
        raise DiskFullError(path, size - free)


def preallocate(fd: int, size: int, path: str | os.PathLike[str]) -> None:
    """Reserve ``size`` bytes for the open file ``fd`` before it is written through a memory map:
    a full disk then fails here with DiskFullError, never later as a SIGBUS on a page write."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without fallocate
            return
        raise_if_disk_full(e, path, size)
        raise


def write_output(path: str | os.PathLike[str], text: str, option: str = "--out") -> None:
    """Write a user-named output: ``-`` is standard output, anything else goes through
    :func:`atomic_write_text`. A path that cannot be written (its parent is a file, no
    permission, a folder) raises ConfigError naming the option and the reason, not a traceback."""
    if str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        atomic_write_text(path, text)
    except OSError as e:
        reason = e.strerror or str(e)
        if isinstance(e, (FileExistsError, NotADirectoryError)):
            reason = "a part of its folder path is a file, not a folder"
        raise ConfigError(f"{option} {path}: cannot write there ({reason}); choose another path") from None


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


_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def iter_lines(path: str | os.PathLike[str], what: str = "file") -> Iterator[tuple[int, str]]:
    """Yield ``(line_number, line)`` of a UTF-8 text file (a leading byte-order mark is skipped).

    Lines break where Python's universal newlines break them (``\\n``, ``\\r\\n`` or ``\\r``)
    and end with ``\\n`` (except perhaps the last). Bytes that are not UTF-8 raise DataError
    naming the line and column.

    Args:
        path: the file.
        what: what the file is, for the message when it cannot be opened ("run file", ...).
    """
    path = Path(path)
    try:
        f = path.open(encoding="utf-8-sig")
    except OSError as e:
        raise DataError(f"cannot read {what}: {e.strerror}", path) from None
    with f:
        try:
            yield from enumerate(f, start=1)
        except UnicodeDecodeError:
            raise _decode_error(path) from None
        except OSError as e:
            raise DataError(f"cannot read {what}: {e.strerror}", path) from None


def _decode_error(path: Path) -> DataError:
    """The line and column of the first byte of ``path`` that is not UTF-8.

    The text reader decodes in chunks, so its exception does not say which line failed; the file
    is scanned again line by line (``bytes.splitlines`` breaks lines where universal newlines do).
    """
    advice = "save it as UTF-8"
    try:
        raw = path.read_bytes()
    except OSError as e:
        return DataError(f"cannot read file: {e.strerror}", path)
    if raw.startswith(_UTF16_BOMS):
        return DataError(f"not UTF-8 text: the file starts with a UTF-16 byte-order mark; {advice}",
                         path, 1)
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    for lineno, line in enumerate(raw.splitlines(), start=1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as e:
            return DataError(
                f"not UTF-8 text: byte 0x{line[e.start]:02x} at column {e.start + 1} "
                f"({e.reason}); {advice}",
                path,
                lineno,
            )
    return DataError(f"not UTF-8 text; {advice}", path)


_DECODER = json.JSONDecoder()
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def loads_json_line(line: str, path: str | os.PathLike[str], lineno: int) -> Any:
    """``json.loads`` of one line; anything that is not JSON raises DataError with file:line.

    So does a string holding an unpaired surrogate (a ``\\ud800`` escape without its partner):
    JSON lets it through, but it is no Unicode text and could not be written back as UTF-8.
    """
    obj = _loads(line, path, lineno)
    # (a backslash test first: one memchr, where the pattern search would read every line)
    if "\\" in line and _SURROGATE_ESCAPE.search(line) and not _encodable(obj):
        raise DataError(
            "a string holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), which is not "
            "Unicode text; fix or drop it",
            path,
            lineno,
        )
    return obj


def _encodable(obj: Any) -> bool:
    """Every string in ``obj`` (keys too) encodes as UTF-8 (escaped surrogate pairs have been
    joined by the parser; only unpaired ones fail)."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def _loads(text: str, path: str | os.PathLike[str], lineno: int | None) -> Any:
    """``json.loads`` of ``text`` (one line ``lineno`` of a file, or a whole file when None: the
    error then names the line the parser stopped at); errors raise DataError."""
    try:
        # raw_decode skips json.loads's two whitespace scans (about 15% of parsing a corpus);
        # a text it does not take whole (leading blanks, an error) goes through json.loads.
        obj, end = _DECODER.raw_decode(text)
        if end == len(text) or text[end:].isspace():
            return obj
    except RecursionError:
        raise DataError("malformed JSON (nested too deeply)", path, lineno) from None
    except ValueError:  # json.JSONDecodeError and others: json.loads below says what is wrong
        pass
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        where = lineno if lineno is not None else e.lineno
        # json's own message for a control character already ends in "at" ("... character at")
        what = e.msg[: -len(" at")] if e.msg.endswith(" at") else e.msg
        raise DataError(f"malformed JSON ({what} at column {e.colno})", path, where) from None
    except RecursionError:
        raise DataError("malformed JSON (nested too deeply)", path, lineno) from None
    except ValueError as e:  # e.g. an integer literal beyond Python's digit limit
        raise DataError(f"malformed JSON ({e})", path, lineno) from None


def read_json(path: str | os.PathLike[str], what: str = "file") -> Any:
    """Parse a whole JSON file; unreadable, non-UTF-8 or malformed files raise DataError with
    file:line."""
    return _loads("".join(line for _, line in iter_lines(path, what)), path, None)


def iter_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, object)`` for each non-blank line of a UTF-8 JSONL file.

    Not UTF-8, malformed JSON (including nesting too deep to parse) and lines that are not JSON
    objects raise DataError naming the file and line.
    """
    for lineno, line in iter_lines(path):
        if line.isspace():  # (never "": every line but the last ends with "\n")
            continue
        obj = loads_json_line(line, path, lineno)
        if not isinstance(obj, dict):
            raise DataError(f"expected a JSON object, got {type(obj).__name__}", path, lineno)
        yield lineno, obj
