"""The on-disk BM25 index: its folder name (cache key), and how it is saved and loaded.

The index of a (corpus, mode, k1, b, analyzer) combination is built once and saved under
``paths.cache_dir()/"bm25"/<key>`` (or ``index_root``), written to a temporary folder and renamed
into place; later runs load it memory-mapped. A folder holds ``meta.json`` (the key, the format,
the counts; written last), ``doc_ids.json``, ``terms.txt`` (the vocabulary), ``params.json`` and
one ``.npy`` file per array of the scoring (:mod:`~r2med_agent.retrieval.bm25.lucene`,
:mod:`~r2med_agent.retrieval.bm25.compat`).

Processes that build the same index at once each write their own temporary folder (named with
their pid); the first rename wins and the others keep its index. A save removes the temporary
folders of dead writers beside it (a killed save's), and a full disk is a DiskFullError naming
the folder, its temporary removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from r2med_agent.io import atomic_write_json, raise_if_disk_full, remove_stale_temps, temp_prefix
from r2med_agent.retrieval.bm25.analysis import AnalyzedTexts
from r2med_agent.types import Task

__all__ = ["OpenedIndex", "SavedArrays", "ScoringIndex", "index_key", "load_saved", "save_index"]

logger = logging.getLogger(__name__)

_FORMAT = 5  # bump when the on-disk layout or the scoring code changes
_META = "meta.json"
_DOC_IDS = "doc_ids.json"
_TERMS = "terms.txt"  # the vocabulary, one term per line in id order (faster to load than JSON)


def _save_terms(folder: Path, vocab: dict[str, int]) -> None:
    terms = sorted(vocab, key=vocab.__getitem__)
    if any(vocab[t] != i for i, t in enumerate(terms)):
        raise ValueError("vocabulary ids are not 0..V-1")
    (folder / _TERMS).write_text("\n".join(terms), encoding="utf-8")


def _load_terms(folder: Path) -> dict[str, int]:
    terms = (folder / _TERMS).read_text(encoding="utf-8").split("\n")
    return dict(zip(terms, range(len(terms))))


def index_key(task: Task, mode: str, k1: float, b: float, analyzer_id: str) -> str:
    """The folder name of a task's index: task name, mode and a hash of everything it depends on."""
    backend = _backend_version(mode)
    payload = json.dumps(
        {
            "format": _FORMAT,
            "corpus": task.fingerprint,
            "n_docs": len(task.corpus),
            "mode": mode,
            "k1": float(k1),
            "b": float(b),
            "analyzer": analyzer_id,
            "backend": backend,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(payload.encode()).hexdigest()[:20]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", task.name).strip("-.") or "task"
    return f"{slug}-{mode}-{digest}"


def _backend_version(mode: str) -> str:
    return "numpy"


class ScoringIndex(Protocol):
    """A scoring's index (:class:`~r2med_agent.retrieval.bm25.lucene._LuceneIndex`,
    :class:`~r2med_agent.retrieval.bm25.compat._CompatIndex`): its vocabulary, saving, search."""

    vocab: dict[str, int]

    def save(self, folder: Path, show_progress: bool) -> None: ...

    def top_k(
        self, queries: AnalyzedTexts, k: int, tie_rank: np.ndarray, show_progress: bool,
        n_threads: int,
    ) -> list[tuple[np.ndarray, np.ndarray]]: ...


@dataclass(frozen=True)
class OpenedIndex:
    """A task's index as a retriever holds it."""

    index: ScoringIndex
    """The scoring's index, loaded or just built."""
    doc_ids: list[str]
    """The corpus's document ids, in index order."""
    folder: Path
    """The folder of the saved index."""
    built: bool
    """True when this process built the index, False when it loaded a saved one."""


_Saved = TypeVar("_Saved", bound="SavedArrays")


class SavedArrays:
    """An index saved as named numpy arrays (``<name>.npy``, loaded memory-mapped), its
    parameters (``params.json``) and its vocabulary (``terms.txt``): the ``load`` and ``save`` of
    both scorings' indexes. A subclass lists its arrays in ``_ARRAYS``."""

    _ARRAYS: tuple[str, ...] = ()

    def __init__(self, arrays: dict[str, np.ndarray], params: dict[str, Any],
                 vocab: dict[str, int]) -> None:
        self.arrays, self.params, self.vocab = arrays, params, vocab

    @classmethod
    def load(cls: type[_Saved], folder: Path, show_progress: bool) -> _Saved:
        arrays = {n: np.load(folder / f"{n}.npy", mmap_mode="r") for n in cls._ARRAYS}
        params = json.loads((folder / "params.json").read_text(encoding="utf-8"))
        return cls(arrays, params, _load_terms(folder))

    def save(self, folder: Path, show_progress: bool) -> None:
        for n, a in self.arrays.items():
            np.save(folder / f"{n}.npy", a)
        (folder / "params.json").write_text(json.dumps(self.params), encoding="utf-8")
        _save_terms(folder, self.vocab)


def load_saved(
    folder: Path, backend: Any, key: str, doc_ids: list[str], show_progress: bool
) -> ScoringIndex | None:
    """The saved index in ``folder`` if it is complete and belongs to this corpus, else None."""
    meta_path = folder / _META
    if not meta_path.is_file():
        if folder.exists():
            logger.warning("BM25 index folder %s is incomplete; rebuilding it", folder)
            shutil.rmtree(folder, ignore_errors=True)
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        saved_ids = json.loads((folder / _DOC_IDS).read_text(encoding="utf-8"))
        if meta.get("key") != key or saved_ids != doc_ids:
            logger.warning("saved BM25 index %s does not match this corpus; rebuilding it", folder)
            shutil.rmtree(folder, ignore_errors=True)
            return None
        t0 = time.perf_counter()
        index = backend.load(folder, show_progress)
    except (OSError, ValueError, KeyError) as e:
        logger.warning("cannot read saved BM25 index %s (%s); rebuilding it", folder, e)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    logger.info("loaded BM25 index from %s in %.2fs", folder, time.perf_counter() - t0)
    return index


def save_index(folder: Path, index: ScoringIndex, key: str, doc_ids: list[str], show_progress: bool) -> None:
    """Write the index into a temporary sibling folder, then rename it into place."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale_temps(folder.parent):
        logger.info("removed %s, left by a killed save", stale)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=temp_prefix(folder), suffix=".tmp"))
    try:
        index.save(tmp, show_progress)
        (tmp / _DOC_IDS).write_text(json.dumps(doc_ids, ensure_ascii=False), encoding="utf-8")
        atomic_write_json(tmp / _META, {"key": key, "format": _FORMAT, "num_docs": len(doc_ids),
                                        "num_terms": len(index.vocab)})
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / _META).is_file():
                raise
            # another process saved the same index first; keep theirs
            logger.info("BM25 index %s was saved by another process meanwhile", folder)
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        arrays = getattr(index, "arrays", {})
        raise_if_disk_full(e, folder, sum(int(getattr(a, "nbytes", 0)) for a in arrays.values()))
        raise
