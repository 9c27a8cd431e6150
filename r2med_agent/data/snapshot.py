"""The task cache: validated tasks under ``cache_dir()/tasks/`` (``$R2MED_CACHE_DIR/tasks/``),
keyed by a SHA-256 of the bytes of the files they were read from."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from r2med_agent.errors import DiskFullError
from r2med_agent.io import atomic_write_json, remove_stale_temps
from r2med_agent.paths import cache_dir
from r2med_agent.types import Qrels, Query

logger = logging.getLogger(__name__)


class _TaskSnapshot:
    """A validated task's queries, qrels, document ids and fingerprint in the task cache, stored
    under a SHA-256 of the bytes of every file it was read from."""

    FORMAT = 3  # 2: ids holding whitespace refused, BEIR splits, folders without qrels; 3: leading or trailing whitespace and zero-width characters in ids refused; raise when reading or validation rules change what a set of files loads as

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def for_files(
        cls, files: Sequence[Path] | None, layout: str, split: str | None, allow_missing: bool
    ) -> _TaskSnapshot | None:
        if files is None:
            return None
        h = hashlib.sha256(
            f"r2med-agent task v{cls.FORMAT}|{layout}|{split}|{allow_missing}\n".encode()
        )
        try:
            for path in files:
                h.update(f"{path.name}|{path.stat().st_size}\n".encode())
                with path.open("rb") as f:
                    while chunk := f.read(1 << 23):
                        h.update(chunk)
        except OSError:
            return None  # the reader reports it
        return cls(cache_dir() / "tasks" / f"{h.hexdigest()}.json")

    def load(self) -> tuple[list[Query], list[str], Qrels, str, list[str], dict[str, tuple[str, ...]] | None] | None:
        """The stored task, or None when there is none (or it is unreadable: then it is redone)."""
        try:
            rec = json.loads(self.path.read_bytes())
            queries = [Query(q[0], q[1], q[2]) for q in rec["queries"]]
            doc_ids, qrels, fingerprint, notes = rec["doc_ids"], rec["qrels"], rec["fingerprint"], rec["notes"]
            raw = rec.get("excluded")  # BRIGHT's layout only
            excluded = None if raw is None else {q: tuple(ids) for q, ids in raw.items()}
            ok = (rec["format"] == self.FORMAT and isinstance(fingerprint, str)
                  and all(isinstance(d, str) for d in doc_ids))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            logger.warning("ignoring unreadable task cache file %s (%s)", self.path, e)
            return None
        if not ok:
            logger.warning("ignoring task cache file %s (other format)", self.path)
            return None
        return queries, doc_ids, qrels, fingerprint, notes, excluded

    def save(self, queries: Sequence[Query], doc_ids: Sequence[str], qrels: Qrels,
             fingerprint: str, notes: Sequence[str],
             excluded: dict[str, tuple[str, ...]] | None = None) -> None:
        rec = {
            "format": self.FORMAT,
            "fingerprint": fingerprint,
            "queries": [[q.query_id, q.text, q.answer] for q in queries],
            "qrels": qrels,
            "notes": list(notes),
            "doc_ids": list(doc_ids),
        }
        if excluded is not None:
            rec["excluded"] = {q: list(ids) for q, ids in excluded.items()}
        remove_stale_temps(self.path.parent)  # what killed saves left
        try:
            atomic_write_json(self.path, rec, indent=None)
        except OSError as e:  # a read-only cache only costs speed
            logger.warning("cannot write the task cache file %s (%s)", self.path, e.strerror)
        except DiskFullError as e:  # so does a full one
            logger.warning("cannot write the task cache file (%s)", e)
