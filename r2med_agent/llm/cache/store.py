"""The on-disk generation cache: one SQLite file, safe to share between processes.

Every LLM output is stored under a key that hashes the whole request (``request_key``): the model
id, the messages exactly as sent (system prompt included), every sampling parameter, the chat
template options, the sample index and a prompt-template version supplied by the caller. Nothing
secret (API keys, base URLs) is part of the key or of the stored request.

Durability: the database runs in WAL mode with ``synchronous=NORMAL``; each ``put_many`` is one
transaction, so a process killed mid-run (even by SIGKILL) loses at most the batch it had not
committed, and the file stays consistent. Two processes can share a file: writers take the lock
with ``BEGIN IMMEDIATE`` and wait up to ``busy_timeout_s`` for each other.

Leases: runs that share a file do not send the same request twice. Before calling its backend, a
run claims the keys it is missing in a ``leases`` table (one short ``BEGIN IMMEDIATE``
transaction); keys another live run holds are waited for, not generated. A lease names its owner
(host, pid, the pid's start time, and a token per claim) and carries a heartbeat the owner
refreshes; it is released when its row is written, or when the owner's call ends in an error. A
run killed even by SIGKILL leaves its leases behind, and they count as dead at once on the same
host (the pid is gone, or now belongs to a process started at another time) and, from another
host, when the heartbeat is older than the lease's time to live. The table is created in place in
older files; readers that do not know it ignore it.

Besides the generations table, a ``uses`` table links a key to the (task, query id, method) that
asked for it, so a cache can be exported in R2MED's ``query_with_hydoc.jsonl`` layout. One
generation may serve several queries (identical prompts share one key); uses are not part of the key.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from r2med_agent.errors import DataError, DiskFullError
from r2med_agent.io import free_bytes
from r2med_agent.llm.cache.damage import CacheDamagedError, is_damage, keep_unsaved, reports_damage, warn_if_emptied
from r2med_agent.llm.cache.leases import LEASE_TTL_S, LeaseClaim, LeaseOwner, lease_live
from r2med_agent.llm.cache.records import KEY_VERSION, CacheRecord, ModelStats, Use, build_request, canonical_json, request_key

__all__ = [
    "KEY_VERSION", "LEASE_TTL_S", "SCHEMA_VERSION", "CacheRecord", "GenerationCache", "LeaseClaim", "LeaseOwner",
    "ModelStats", "Use", "build_request", "canonical_json", "request_key",
]
"""The cache's names; the records and leases it stores live in :mod:`~r2med_agent.llm.cache.records`
and :mod:`~r2med_agent.llm.cache.leases`."""

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 3
"""2 added ``api_reasoning``, 3 ``logprobs``; older files are upgraded in place when opened (their
rows read as before, with no log-probabilities)."""

_SQL_BATCH = 500  # parameters per IN (...) query; below SQLite's oldest limit of 999

_SCHEMA = """
CREATE TABLE IF NOT EXISTS generations (
    key TEXT PRIMARY KEY,
    model_id TEXT NOT NULL,
    sample_index INTEGER NOT NULL,
    text TEXT NOT NULL,
    reasoning TEXT NOT NULL,
    final TEXT NOT NULL,
    finish_reason TEXT NOT NULL,
    stop_reason TEXT,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    latency_s REAL NOT NULL,
    created REAL NOT NULL,
    request TEXT NOT NULL,
    api_reasoning TEXT NOT NULL DEFAULT '',
    logprobs TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS generations_model ON generations (model_id);
CREATE TABLE IF NOT EXISTS uses (
    key TEXT NOT NULL,
    task TEXT NOT NULL,
    query_id TEXT NOT NULL,
    method TEXT NOT NULL,
    extra TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (key, task, query_id, method)
);
CREATE INDEX IF NOT EXISTS uses_task ON uses (task, method);
CREATE TABLE IF NOT EXISTS info (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    key TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    pid_start TEXT NOT NULL,
    heartbeat REAL NOT NULL
);
"""

_COLUMNS = (
    "key, model_id, sample_index, text, reasoning, final, finish_reason, stop_reason, "
    "prompt_tokens, completion_tokens, latency_s, created, request, api_reasoning, logprobs"
)



LOW_SPACE_BYTES = 1 << 20
"""Free space below which an SQLite I/O error counts as a full disk: SQLite reports a write or
a shared-memory file (32 kB) that did not fit as ``disk I/O error``, not as ``SQLITE_FULL``."""


def _is_full(e: BaseException, path: Path | None = None) -> bool:
    """Whether an error means the file system (or quota) ran out of space: ENOSPC/EDQUOT,
    ``SQLITE_FULL``, or an SQLite I/O error where the file system of ``path`` has less than
    :data:`LOW_SPACE_BYTES` free."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(e, sqlite3.Error):
        code = getattr(e, "sqlite_errorcode", None)
        if code == getattr(sqlite3, "SQLITE_FULL", 13) or "database or disk is full" in str(e):
            return True
        io_error = (code is not None and code & 0xFF == getattr(sqlite3, "SQLITE_IOERR", 10)) or "disk I/O error" in str(e)
        if io_error and path is not None:
            free = free_bytes(path)
            return free is not None and free < LOW_SPACE_BYTES
    return False


class GenerationCache:
    """Generation cache on one SQLite file (WAL mode), shareable between processes.

    Args:
        path: the database file; its folder is created when missing.
        busy_timeout_s: how long a writer waits for another process's transaction.

    The connection opens lazily and is reopened after a fork, so a cache object may be created
    before worker processes start. Methods are safe to call from several threads.
    """

    def __init__(self, path: str | os.PathLike[str], busy_timeout_s: float = 60.0) -> None:
        self.path = Path(path)
        self.busy_timeout_s = busy_timeout_s
        self._conn: sqlite3.Connection | None = None
        self._pid = -1
        self._lock = threading.RLock()

    # -- connection ---------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self._conn is not None and self._pid == os.getpid():
            return self._conn
        self.path.parent.mkdir(parents=True, exist_ok=True)
        warn_if_emptied(self.path)
        # Two processes opening a new cache at once can get "database is locked" at once, without
        # the busy timeout: switching a fresh file to WAL and taking the schema lock can deadlock,
        # which SQLite answers by failing one side. That side closes and tries again.
        deadline = time.monotonic() + self.busy_timeout_s
        delay = 0.05
        while True:
            try:
                conn = self._open()
            except sqlite3.OperationalError as e:
                if _is_full(e, self.path):
                    raise DiskFullError(self.path) from None
                if "locked" not in str(e) or time.monotonic() + delay > deadline:
                    raise DataError(f"cannot open generation cache: {e}", self.path) from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            self._conn, self._pid = conn, os.getpid()
            return conn

    def _open(self) -> sqlite3.Connection:
        """A connection in WAL mode with the schema in place (upgraded from versions 1 and 2)."""
        conn = None
        try:
            conn = sqlite3.connect(
                self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                logger.warning("generation cache %s: journal_mode is %s, not wal", self.path, mode)
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("BEGIN IMMEDIATE")
            for stmt in filter(None, (s.strip() for s in _SCHEMA.split(";"))):
                conn.execute(stmt)
            row = conn.execute("SELECT value FROM info WHERE name = 'schema_version'").fetchone()
            if row is None:
                conn.execute(
                    "INSERT INTO info (name, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
                )
            elif int(row[0]) in (1, 2):
                # Version 1 lacked api_reasoning, 2 logprobs: add them (empty for the old rows).
                if int(row[0]) == 1:
                    conn.execute(
                        "ALTER TABLE generations ADD COLUMN api_reasoning TEXT NOT NULL DEFAULT ''"
                    )
                conn.execute("ALTER TABLE generations ADD COLUMN logprobs TEXT NOT NULL DEFAULT ''")
                conn.execute(
                    "UPDATE info SET value = ? WHERE name = 'schema_version'", (str(SCHEMA_VERSION),)
                )
            elif int(row[0]) != SCHEMA_VERSION:
                conn.execute("ROLLBACK")
                raise DataError(
                    f"generation cache schema version {row[0]} is not the supported {SCHEMA_VERSION}; "
                    "use another cache file (--cache-path) or delete this one",
                    self.path,
                )
            conn.execute("COMMIT")
        except sqlite3.OperationalError:
            if conn is not None:
                conn.close()
            raise
        except sqlite3.DatabaseError as e:
            if conn is not None:
                conn.close()
            if is_damage(e):
                raise CacheDamagedError(self.path, str(e), opening=True) from None
            raise DataError(f"cannot open generation cache: {e}", self.path) from None
        except DataError:
            conn.close()  # type: ignore[union-attr]
            raise
        return conn

    def close(self) -> None:
        """Close the connection (a later call reopens it)."""
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None

    def __enter__(self) -> GenerationCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reads --------------------------------------------------------------------------------

    @reports_damage
    def get_many(self, keys: Iterable[str]) -> dict[str, CacheRecord]:
        """The stored records of those ``keys`` that are in the cache, keyed by key."""
        keys = list(dict.fromkeys(keys))
        out: dict[str, CacheRecord] = {}
        with self._lock:
            conn = self._connect()
            for i in range(0, len(keys), _SQL_BATCH):
                chunk = keys[i : i + _SQL_BATCH]
                marks = ",".join("?" * len(chunk))
                for row in conn.execute(
                    f"SELECT {_COLUMNS} FROM generations WHERE key IN ({marks})", chunk
                ):
                    rec = _record(row)
                    out[rec.key] = rec
        return out

    def get(self, key: str) -> CacheRecord | None:
        return self.get_many([key]).get(key)

    @reports_damage
    def __len__(self) -> int:
        with self._lock:
            return int(self._connect().execute("SELECT COUNT(*) FROM generations").fetchone()[0])

    def iter_records(self, model_id: str | None = None) -> Iterator[CacheRecord]:
        """All records (of one model when given), oldest first."""
        for row in self._record_rows(model_id):
            yield _record(row)

    @reports_damage
    def _record_rows(self, model_id: str | None) -> list[Any]:
        with self._lock:
            conn = self._connect()
            if model_id is None:
                rows = conn.execute(f"SELECT {_COLUMNS} FROM generations ORDER BY created, key").fetchall()
            else:
                rows = conn.execute(
                    f"SELECT {_COLUMNS} FROM generations WHERE model_id = ? ORDER BY created, key",
                    (model_id,),
                ).fetchall()
        return rows

    @reports_damage
    def uses(
        self,
        *,
        model_id: str | None = None,
        task: str | None = None,
        method: str | None = None,
        sample_index: int | None = None,
    ) -> list[tuple[Use, CacheRecord]]:
        """(use, record) pairs matching every given filter, ordered by task, method, query id."""
        where, args = [], []
        for col, val in (
            ("g.model_id", model_id),
            ("u.task", task),
            ("u.method", method),
            ("g.sample_index", sample_index),
        ):
            if val is not None:
                where.append(f"{col} = ?")
                args.append(val)
        sql = (
            "SELECT u.task, u.query_id, u.method, u.extra, "
            + ", ".join(f"g.{c.strip()}" for c in _COLUMNS.split(","))
            + " FROM uses u JOIN generations g ON g.key = u.key"
            + (" WHERE " + " AND ".join(where) if where else "")
            + " ORDER BY u.task, u.method, u.query_id, g.sample_index"
        )
        with self._lock:
            rows = self._connect().execute(sql, args).fetchall()
        out = []
        for row in rows:
            rec = _record(row[4:])
            out.append((Use(rec.key, row[0], row[1], row[2], json.loads(row[3])), rec))
        return out

    @reports_damage
    def stats(self) -> list[ModelStats]:
        """Rows, tokens and backend seconds per model id."""
        with self._lock:
            rows = self._connect().execute(
                "SELECT model_id, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens), "
                "SUM(latency_s), MIN(created), MAX(created) FROM generations "
                "GROUP BY model_id ORDER BY model_id"
            ).fetchall()
        return [ModelStats(r[0], r[1], r[2] or 0, r[3] or 0, r[4] or 0.0, r[5], r[6]) for r in rows]

    def size_bytes(self) -> int:
        """Bytes on disk: the database file plus its WAL and shared-memory files."""
        total = 0
        for suffix in ("", "-wal", "-shm"):
            p = Path(str(self.path) + suffix)
            if p.exists():
                total += p.stat().st_size
        return total

    @reports_damage
    def integrity_check(self) -> str:
        """SQLite's ``PRAGMA integrity_check`` result (``"ok"`` for a sound file)."""
        with self._lock:
            return str(self._connect().execute("PRAGMA integrity_check").fetchone()[0])

    # -- writes -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self, needed_bytes: int | None = None) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` ... ``COMMIT`` (under the object's lock), rolled back on any
        error, so what earlier transactions wrote stays intact.

        Raises:
            DiskFullError: the file system ran out of space (with the cache's path and
                ``needed_bytes``, the size of what was being written).
        """
        with self._lock:
            conn = self._connect()
            try:
                conn.execute("BEGIN IMMEDIATE")
                yield conn
                conn.execute("COMMIT")
            except BaseException as e:
                if conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                if _is_full(e, self.path):
                    raise DiskFullError(self.path, needed_bytes) from None
                raise

    @reports_damage
    def put_many(
        self, records: Iterable[CacheRecord], uses: Iterable[Use] = (), release: LeaseOwner | None = None
    ) -> None:
        """Store records (replacing rows with the same key) and uses, in ONE transaction; with
        ``release``, that owner's leases on the records' keys are dropped in the same transaction.

        Raises:
            DiskFullError: the disk is full; nothing of this call is stored, earlier rows are.
        """
        grows = [
            (
                r.key, r.model_id, r.sample_index, r.text, r.reasoning, r.final, r.finish_reason,
                r.stop_reason, r.prompt_tokens, r.completion_tokens, r.latency_s, r.created,
                canonical_json(r.request), r.api_reasoning, _logprobs_json(r.logprobs),
            )
            for r in records
        ]
        now = time.time()
        urows = [(u.key, u.task, u.query_id, u.method, canonical_json(u.extra), now) for u in uses]
        if not grows and not urows:
            return
        try:
            self._put_rows(grows, urows, release)
        except (sqlite3.DatabaseError, CacheDamagedError) as e:  # the rows just made are kept for `cache repair`
            if not (isinstance(e, CacheDamagedError) or is_damage(e)):
                raise
            reason = e.reason if isinstance(e, CacheDamagedError) else str(e)
            raise CacheDamagedError(self.path, reason, unsaved=keep_unsaved(self.path, grows, urows)) from None

    def _put_rows(self, grows: list[tuple[Any, ...]], urows: list[tuple[Any, ...]], release: LeaseOwner | None) -> None:
        with self._transaction(_row_bytes(grows) + _row_bytes(urows)) as conn:
            conn.executemany(
                f"INSERT OR REPLACE INTO generations ({_COLUMNS}) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                grows,
            )
            conn.executemany(
                "INSERT OR IGNORE INTO uses (key, task, query_id, method, extra, created) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                urows,
            )
            if release is not None:
                conn.executemany(
                    "DELETE FROM leases WHERE key = ? AND owner = ?", [(g[0], release.token) for g in grows]
                )

    # -- leases -------------------------------------------------------------------------------

    @reports_damage
    def claim(
        self, keys: Sequence[str], owner: LeaseOwner, *, ttl_s: float = LEASE_TTL_S, force: bool = False
    ) -> LeaseClaim:
        """Lease to ``owner`` every key of ``keys`` that has no row and no live lease of another
        owner, in one short transaction; see :class:`LeaseClaim` for what comes back.

        Args:
            keys: the keys the caller is missing.
            owner: the claiming owner.
            ttl_s: a lease of another host whose heartbeat is older than this is dead.
            force: take live leases of others too (a caller that waited long enough).
        """
        keys = list(dict.fromkeys(keys))
        claimed: list[str] = []
        done: list[str] = []
        held: dict[str, LeaseOwner] = {}
        now = time.time()
        with self._transaction() as conn:
            rows, leases = self._rows_and_leases(conn, keys)
            for key in keys:
                other = leases.get(key)
                if key in rows:
                    done.append(key)
                elif other is not None and not force and other[0].token != owner.token and lease_live(other, now, ttl_s):
                    held[key] = other[0]
                else:
                    claimed.append(key)
            conn.executemany(
                "INSERT OR REPLACE INTO leases (key, owner, host, pid, pid_start, heartbeat) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [(k, owner.token, owner.host, owner.pid, owner.pid_start, now) for k in claimed],
            )
        return LeaseClaim(claimed, done, held)

    @reports_damage
    def held_by_others(
        self, keys: Sequence[str], owner: LeaseOwner, *, ttl_s: float = LEASE_TTL_S
    ) -> dict[str, LeaseOwner]:
        """Those ``keys`` without a row that another live owner holds, with that owner."""
        now = time.time()
        with self._lock:
            rows, leases = self._rows_and_leases(self._connect(), list(keys))
        return {
            k: lease[0]
            for k, lease in leases.items()
            if k not in rows and lease[0].token != owner.token and lease_live(lease, now, ttl_s)
        }

    @reports_damage
    def heartbeat(self, owner: LeaseOwner) -> None:
        """Mark ``owner``'s leases as still worked on (an owner on another host is judged by it)."""
        with self._transaction() as conn:
            conn.execute("UPDATE leases SET heartbeat = ? WHERE owner = ?", (time.time(), owner.token))

    @reports_damage
    def release(self, owner: LeaseOwner) -> None:
        """Drop every lease ``owner`` still holds (its call ended, by success or error)."""
        with self._transaction() as conn:
            conn.execute("DELETE FROM leases WHERE owner = ?", (owner.token,))

    def _rows_and_leases(
        self, conn: sqlite3.Connection, keys: Sequence[str]
    ) -> tuple[set[str], dict[str, tuple[LeaseOwner, float]]]:
        """Which ``keys`` have a row, and the leases (owner, heartbeat) on them."""
        rows: set[str] = set()
        leases: dict[str, tuple[LeaseOwner, float]] = {}
        for i in range(0, len(keys), _SQL_BATCH):
            chunk = keys[i : i + _SQL_BATCH]
            marks = ",".join("?" * len(chunk))
            rows.update(r[0] for r in conn.execute(f"SELECT key FROM generations WHERE key IN ({marks})", chunk))
            for key, token, host, pid, start, beat in conn.execute(
                f"SELECT key, owner, host, pid, pid_start, heartbeat FROM leases WHERE key IN ({marks})", chunk
            ):
                leases[key] = (LeaseOwner(host, int(pid), start, token), float(beat))
        return rows, leases

    @reports_damage
    def add_uses(self, uses: Iterable[Use]) -> None:
        """Record uses only (for cache hits), in one transaction."""
        self.put_many((), uses)



def _row_bytes(rows: Sequence[Sequence[Any]]) -> int:
    """About how many bytes ``rows`` take in the file: their values' sizes, twice (once in the
    write-ahead log, once when it is copied into the database)."""
    size = sum(len(v.encode("utf-8")) if isinstance(v, str) else 8 for row in rows for v in row)
    return 2 * size


def _record(row: Sequence[Any]) -> CacheRecord:
    return CacheRecord(
        key=row[0],
        model_id=row[1],
        sample_index=row[2],
        text=row[3],
        reasoning=row[4],
        final=row[5],
        finish_reason=row[6],
        stop_reason=row[7],
        prompt_tokens=row[8],
        completion_tokens=row[9],
        latency_s=row[10],
        created=row[11],
        request=json.loads(row[12]),
        api_reasoning=row[13],
        logprobs=_logprobs_from_json(row[14]),
    )


def _logprobs_json(logprobs: Sequence[Sequence[tuple[str, float]]] | None) -> str:
    if logprobs is None:
        return ""
    return json.dumps([[[t, lp] for t, lp in pos] for pos in logprobs], ensure_ascii=False)


def _logprobs_from_json(text: str) -> tuple[tuple[tuple[str, float], ...], ...] | None:
    if not text:
        return None
    return tuple(tuple((str(t), float(lp)) for t, lp in pos) for pos in json.loads(text))
