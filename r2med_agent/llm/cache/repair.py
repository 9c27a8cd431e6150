"""``r2med-agent cache repair``: keep what a damaged generation cache still holds.

SQLite keeps no checksums, and a file damaged past its header (a disk fault, a copy overwritten in
the middle) fails only on the pages that were hit; the rest can still be read. :func:`repair` reads
every row of ``generations`` and ``uses`` it can through SQLite, in rowid order: where a read
fails, it probes further ahead (2, 4, 8 ... rowids) for the next readable row and reads the rows of
the gap one range at a time, halving a range that fails down to single rows. Then it reads the
file's table leaf pages itself, for the rows whose way down from the table's root went through a
damaged page (zeros over the root lose every row to SQLite, none to this); a row read both ways is
taken once, and so are the generations a run made but could not write into the damaged file
(``<name>.unsaved-*.jsonl`` beside it, renamed ``*.added`` once in). The rows go into a new file at the cache's path (written beside it, then renamed into
place); the damaged file is renamed aside, never deleted (``<name>.damaged-<UTC time>``, its
write-ahead log beside it), for whoever wants to try other tools on it.

A row whose bytes were changed but whose page still reads is taken as it is: SQLite cannot tell.
Run it when no run is using the cache.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from r2med_agent.errors import DataError
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.damage import is_damage, read_unsaved

__all__ = ["RepairReport", "repair"]

_TABLES = ("generations", "uses")


@dataclass(frozen=True)
class RepairReport:
    """What :func:`repair` did.

    Attributes:
        path: the cache file (now the repaired one).
        damaged: where the damaged file went.
        kept: rows kept per table.
        counted: rows the damaged file counted per table (None where it could not count them).
        unreadable: rows (or, where the rowids are unknown, ranges) that could not be read.
        unsaved: generations added from the files of those a run could not write into the cache.
    """

    path: Path
    damaged: Path
    kept: dict[str, int]
    counted: dict[str, int | None]
    unreadable: int
    unsaved: int = 0


def _columns(conn: sqlite3.Connection, table: str, wanted: list[str]) -> list[str]:
    """The columns of ``table`` in the damaged file that the new one has too ([] if unreadable)."""
    try:
        have = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
    except sqlite3.DatabaseError:
        return []
    return [c for c in wanted if c in have]


def _count(conn: sqlite3.Connection, table: str) -> int | None:
    try:
        return int(conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])
    except sqlite3.DatabaseError:
        return None


def _span(conn: sqlite3.Connection, sql: str, lo: int, hi: int, out: list[tuple], lost: list[int]) -> None:
    """Rows of rowids ``lo..hi``, halving a range that cannot be read down to single rows."""
    stack = [(lo, hi)]
    while stack:
        a, b = stack.pop()
        try:
            rows = conn.execute(f"{sql} WHERE rowid BETWEEN ? AND ? ORDER BY rowid", (a, b)).fetchall()
        except sqlite3.DatabaseError as e:
            if not is_damage(e):
                raise
            if a == b:
                lost[0] += 1
            else:
                mid = (a + b) // 2
                stack += [(mid + 1, b), (a, mid)]
            continue
        out.extend(r[1:] for r in rows)


def _next_readable(conn: sqlite3.Connection, table: str, after: int) -> int | None:
    """The first rowid past ``after + 1`` that can be found (probing 2, 4, 8 ... ahead); None: none."""
    for k in range(1, 63):
        try:
            row = conn.execute(f"SELECT rowid FROM {table} WHERE rowid >= ? ORDER BY rowid LIMIT 1",
                               (after + 2**k,)).fetchone()
        except sqlite3.DatabaseError as e:
            if not is_damage(e):
                raise
            continue
        return None if row is None else int(row[0])
    return None


def _readable_rows(conn: sqlite3.Connection, table: str, cols: list[str], lost: list[int]) -> list[tuple]:
    """Every row of ``table`` that can be read, in rowid order."""
    sql = f"SELECT rowid, {', '.join(cols)} FROM {table}"
    out: list[tuple] = []
    after = 0
    while True:
        try:
            for row in conn.execute(f"{sql} WHERE rowid > ? ORDER BY rowid", (after,)):
                out.append(row[1:])
                after = row[0]
            return out
        except sqlite3.DatabaseError as e:
            if not is_damage(e):
                raise
        nxt = _next_readable(conn, table, after)
        if nxt is None:  # nothing found beyond: what is left of the table cannot be reached
            lost[0] += 1
            return out
        _span(conn, sql, after + 1, nxt - 1, out, lost)
        after = nxt - 1


# -- the pages themselves ------------------------------------------------------------------------
# Where a damaged page was the root of a table (or an inner page), the rows below it cannot be
# reached through SQLite. Its leaf pages are still there: each is read as the file format says
# (https://www.sqlite.org/fileformat2.html: a table leaf page, type 13; its cells: payload length,
# rowid, payload, the first overflow page), and a record is kept only when its columns have the
# types of a generation (15 columns, or the 13 and 14 of older files) or of a use (6).


def _varint(b: bytes, i: int) -> tuple[int, int]:
    """SQLite's variable-length integer at ``b[i:]``: (value, the index after it)."""
    v = 0
    for k in range(9):
        c = b[i + k]
        if k == 8:
            return (v << 8) | c, i + 9
        v = (v << 7) | (c & 0x7F)
        if c < 0x80:
            return v, i + k + 1
    raise IndexError  # pragma: no cover - the loop returns


def _record(payload: bytes) -> list[object]:
    """The values of a record (its header of serial types, then the values)."""
    size, i = _varint(payload, 0)
    types = []
    while i < size:
        t, i = _varint(payload, i)
        types.append(t)
    out: list[object] = []
    at = size
    for t in types:
        if t == 0:
            out.append(None)
        elif 1 <= t <= 6:
            n = (1, 2, 3, 4, 6, 8)[t - 1]
            out.append(int.from_bytes(payload[at:at + n], "big", signed=True))
            at += n
        elif t == 7:
            out.append(struct.unpack(">d", payload[at:at + 8])[0])
            at += 8
        elif t in (8, 9):
            out.append(t - 8)
        elif t >= 12:
            n = (t - 12) // 2
            out.append(payload[at:at + n].decode("utf-8") if t % 2 else bytes(payload[at:at + n]))
            at += n
        else:
            raise ValueError("reserved serial type")
    if at != len(payload):
        raise ValueError("record length")
    return out


_GENERATION_TYPES = (str, str, int, str, str, str, str, (str, type(None)), int, int, (int, float), (int, float), str,
                     str, str)
_USE_TYPES = (str, str, str, str, str, (int, float))


def _kind(values: list[object]) -> str | None:
    """``generations`` or ``uses`` when ``values`` have that table's column types (None: neither)."""
    for table, types, sizes in (("generations", _GENERATION_TYPES, (13, 14, 15)), ("uses", _USE_TYPES, (6,))):
        if len(values) in sizes and all(isinstance(v, t) and not isinstance(v, bool)
                                        for v, t in zip(values, types)):
            return table
    return None


def _leaf_cells(data: bytes, page: int, size: int, usable: int) -> Iterator[tuple[int, bytes]]:
    """(rowid, payload) of each cell of page ``page`` when it is a table leaf page."""
    base = (page - 1) * size
    head = base + (100 if page == 1 else 0)
    if data[head] != 13:
        return
    cells = int.from_bytes(data[head + 3:head + 5], "big")
    pages = len(data) // size
    for c in range(cells):
        try:
            at = base + int.from_bytes(data[head + 8 + 2 * c:head + 10 + 2 * c], "big")
            length, at = _varint(data, at)
            rowid, at = _varint(data, at)
            high, low = usable - 35, ((usable - 12) * 32 // 255) - 23
            local = length if length <= high else (low + (length - low) % (usable - 4))
            local = local if local <= high else low
            payload = bytearray(data[at:at + local])
            nxt = int.from_bytes(data[at + local:at + local + 4], "big") if local < length else 0
            while len(payload) < length and 1 <= nxt <= pages:  # the overflow chain
                o = (nxt - 1) * size
                nxt = int.from_bytes(data[o:o + 4], "big")
                payload += data[o + 4:o + min(usable, 4 + length - len(payload))]
            if len(payload) == length:
                yield rowid, bytes(payload)
        except (IndexError, ValueError):
            continue


def _page_rows(path: Path) -> dict[str, list[tuple]]:
    """The rows of generations and uses found on the table leaf pages of the file at ``path``,
    in the column order of the schema (for generations, the newest row of each key)."""
    data = path.read_bytes()
    size = int.from_bytes(data[16:18], "big") if data[:16] == b"SQLite format 3\x00" else 4096
    size = 65536 if size == 1 else size if size and not size & (size - 1) and size >= 512 else 4096
    usable = size - (data[20] if len(data) > 20 and data[:16] == b"SQLite format 3\x00" else 0)
    found: dict[str, list[tuple]] = {"generations": [], "uses": []}
    for page in range(1, len(data) // size + 1):
        for _, payload in _leaf_cells(data, page, size, usable):
            try:
                values = _record(payload)
            except (IndexError, ValueError, UnicodeDecodeError, struct.error):
                continue
            table = _kind(values)
            if table is not None:
                found[table].append(tuple(values))
    newest: dict[str, tuple] = {}
    for row in found["generations"]:
        if row[0] not in newest or row[11] > newest[row[0]][11]:
            newest[row[0]] = row
    found["generations"] = list(newest.values())
    return found


def _new_columns(table: str) -> list[str]:
    with contextlib.closing(sqlite3.connect(":memory:")) as mem:
        from r2med_agent.llm.cache.store import _SCHEMA

        mem.executescript(_SCHEMA)
        return [r[1] for r in mem.execute(f"PRAGMA table_info({table})")]


def repair(path: str | os.PathLike[str]) -> RepairReport:
    """Copy every readable row of the damaged cache ``path`` into a new file at ``path`` and move
    the damaged one aside (see the module's docstring).

    Raises:
        DataError: no such file, or a sound one (nothing to repair).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError("no generation cache file here", path)
    unsaved, kept_apart = read_unsaved(path)  # the newest rows: what a run could not write into it
    batches = [(table, _new_columns(table), rows) for table, rows in kept_apart.items()]
    lost = [0]  # (table, columns, rows) in batches: a row of an earlier batch wins
    with contextlib.closing(sqlite3.connect(path)) as old:  # read only; closing it removes its log files
        try:
            sound = old.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        except sqlite3.DatabaseError:
            sound = False
        if sound:
            raise DataError("the generation cache is sound (SQLite's integrity check: ok); nothing to repair", path)
        for table in _TABLES:
            cols = _columns(old, table, _new_columns(table))
            if cols:
                batches.append((table, cols, _readable_rows(old, table, cols, lost)))
        counted = {table: _count(old, table) for table in _TABLES}
    for table, found in _page_rows(path).items():  # what the tables' trees no longer reach
        cols = _new_columns(table)
        batches.append((table, cols, [r + ("",) * (len(cols) - len(r)) for r in found]))
    kept, damaged = _replace(path, batches)
    for f in unsaved:  # in the cache now: not to be added again by a later repair
        os.rename(f, f.with_name(f.name + ".added"))
    return RepairReport(path, damaged, kept, counted, lost[0], len(kept_apart["generations"]))


def _replace(path: Path, batches: list[tuple[str, list[str], list[tuple]]]) -> tuple[dict[str, int], Path]:
    """Write ``batches`` into a new cache file and put it in place of ``path``, which is renamed
    aside; returns the rows kept per table and where the damaged file went."""
    from r2med_agent.io import temp_prefix

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp")
    os.close(fd)
    os.unlink(tmp)
    fresh = GenerationCache(tmp)
    try:
        with fresh._transaction() as conn:
            for table, cols, got in batches:
                conn.executemany(f"INSERT OR IGNORE INTO {table} ({', '.join(cols)}) "
                                 f"VALUES ({', '.join('?' * len(cols))})", got)
        kept = {table: int(fresh._connect().execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])
                for table in _TABLES}
        fresh.close()  # the last connection: its log is checkpointed into the file and removed
        damaged = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        for suffix in ("-wal", "-shm", ""):  # the file last: until then the path is the old cache
            if os.path.lexists(f"{path}{suffix}"):
                os.rename(f"{path}{suffix}", f"{damaged}{suffix}")
        os.rename(tmp, path)
    except BaseException:
        fresh.close()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{tmp}{suffix}").unlink(missing_ok=True)
        raise
    return kept, damaged
