"""Document embeddings and their cache (:func:`encode_corpus`).

Document embeddings are cached per (encoder settings that shape them, resolved document
instruction, corpus fingerprint) under ``cache_dir()/embeddings/<encoder>__<key>/``. Encoding writes
shards of ``shard_size`` documents, each atomically, so a killed run resumes from its last shard;
the shards are then merged into one float32 ``embeddings.npy`` (memory-mapped when reused) and a
``meta.json``, both written atomically. ``meta.json`` holds the SHA-256 of ``embeddings.npy``; a
matrix whose bytes no longer match it (a flipped bit on disk, a file copied in part or edited) is
named in a warning and encoded again, checked once per process and file, never used as it is.

Concurrent runs that need the same embeddings take the folder's ``.lock`` (``build_lock``) before
encoding: one encodes, the others wait and then load its result (or resume its shards when it
was killed). Temporaries carry their writer's pid and those of dead writers are removed. The merge
checks the free space and reserves the whole file before writing it through a memory map, so a
full disk is a DiskFullError naming the path, never a SIGBUS.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from r2med_agent.errors import ConfigError
from r2med_agent.io import (
    atomic_write_json,
    build_lock,
    check_space,
    inside,
    preallocate,
    raise_if_disk_full,
    remove_stale_temps,
    set_default_mode,
    temp_prefix,
)
from r2med_agent.paths import cache_dir
from r2med_agent.retrieval.dense.models import model_fingerprint
from r2med_agent.retrieval.dense.spec import DEFAULT_SHARD_SIZE, Encoder, EncoderSpec
from r2med_agent.types import Doc

logger = logging.getLogger(__name__)

CACHE_FORMAT = 2
"""2: documents are encoded as ``Doc.full_text`` (title + " " + text), no longer the text alone."""

# Fields of EncoderSpec that do not change document embeddings (query side, batching, API access,
# the transformers version check, engine settings, the entry's description of its source and the
# version of its behaviour, which its results record). The
# backend enters the key as resolved at run time (``doc_runtime_fields``), not as the entry's ``auto``;
# the ``bright`` block as the settings it makes (a BRIGHT task's documents are encoded with the
# entry's BRIGHT settings, whose fields are in the key).
_QUERY_ONLY_FIELDS = frozenset(
    {
        "name", "query_model", "query_max_length", "query_prefix", "query_instructions",
        "instruction_format", "instruction_on", "batch_size", "base_url", "api_key_env",
        "doc_instructions", "doc_instruction_format", "doc_prefix", "transformers",
        "backend", "engine_kwargs", "reference", "bright", "encoder_rules",
    }
)
# Fields added after caches were first written, with the value every earlier entry had: at that
# value a field stays out of the key, so the embeddings cached before it existed stay valid.
_LATER_FIELD_DEFAULTS = {"truncation": "tokens"}



def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Row-wise L2 normalisation in float32 (zero rows stay zero)."""
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def corpus_fingerprint(docs: Sequence[Doc]) -> str:
    """Hash of document ids, titles and texts in order (for corpora that come without one)."""
    h = hashlib.sha256()
    for d in docs:
        for part in (d.doc_id, d.title, d.text):
            b = part.encode("utf-8")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    return h.hexdigest()


def doc_cache_fields(
    spec: EncoderSpec, doc_prefix: str, runtime: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What decides a corpus's embeddings: the document-side encoder settings and prefix, and
    what the encoder resolves at run time (``runtime``: the precision actually used, e.g.
    ``{"dtype": "bfloat16"}`` on a GPU for ``dtype: auto``; how API inputs are truncated)."""
    fields = {
        k: v for k, v in dataclasses.asdict(spec).items()
        if k not in _QUERY_ONLY_FIELDS and _LATER_FIELD_DEFAULTS.get(k, object()) != v
    }
    fields.update(runtime or {})
    fields["doc_model"] = model_fingerprint(spec.model_for("doc"))
    fields["model"] = None  # covered by doc_model
    fields["resolved_doc_prefix"] = doc_prefix
    fields["unit_norm"] = True  # stored rows are L2-normalised for cosine search
    return fields


def embedding_cache_key(
    spec: EncoderSpec,
    doc_prefix: str,
    fingerprint: str,
    n_docs: int,
    runtime: dict[str, Any] | None = None,
) -> str:
    blob = json.dumps(
        {
            "format": CACHE_FORMAT,
            "encoder": doc_cache_fields(spec, doc_prefix, runtime),
            "corpus": fingerprint,
            "n_docs": n_docs,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:20]


def _atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr)
            f.flush()
            os.fsync(f.fileno())
        set_default_mode(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        raise_if_disk_full(e, path, arr.nbytes + 128)
        raise



class EmbeddingCache:
    """One corpus's document embeddings for one encoder setting, on disk.

    Layout: ``<dir>/embeddings.npy`` + ``<dir>/meta.json`` when complete; while encoding,
    ``<dir>/shards/progress.json`` (the shard size) and ``<dir>/shards/NNNNN.npy``.
    """

    def __init__(self, directory: Path, key: str, meta: dict[str, Any]) -> None:
        self.dir = Path(directory)
        self.key = key
        self.meta = meta

    @property
    def embeddings_path(self) -> Path:
        return self.dir / "embeddings.npy"

    @property
    def meta_path(self) -> Path:
        return self.dir / "meta.json"

    def load(self) -> np.ndarray | None:
        """The cached matrix (read-only memory map), or None when absent or not matching."""
        if not (self.meta_path.exists() and self.embeddings_path.exists()):
            return None
        try:
            meta = json.loads(self.meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # ValueError: malformed JSON, not UTF-8
            return None
        if not isinstance(meta, dict) or meta.get("key") != self.key or meta.get("n_docs") != self.meta["n_docs"]:
            return None
        if not _matches_checksum(self.embeddings_path, meta.get("sha256")):
            return None
        arr = _load_npy(self.embeddings_path)
        if arr is None or arr.dtype != np.float32 or arr.ndim != 2 or arr.shape[0] != self.meta["n_docs"]:
            return None
        return arr

    def build(
        self,
        encode_chunk: Callable[[int, int], np.ndarray],
        n_docs: int,
        *,
        shard_size: int = DEFAULT_SHARD_SIZE,
        show_progress: bool = False,
    ) -> np.ndarray:
        """Encode the corpus shard by shard (resuming), then merge; returns the memory map.

        ``encode_chunk(start, end)`` returns the float32 rows of documents ``[start, end)``.
        Runs under the folder's build lock: a process that waited for another one's build loads
        its result instead of encoding again.
        """
        if shard_size < 1:
            raise ConfigError(f"shard_size must be >= 1, got {shard_size}")
        self.dir.mkdir(parents=True, exist_ok=True)
        with build_lock(self.dir / ".lock"):
            done = self.load()
            if done is not None:
                logger.info("embeddings in %s were built by another process meanwhile", self.dir)
                return done
            remove_stale_temps(self.dir)
            remove_stale_temps(self.dir / "shards")
            return self._build_locked(encode_chunk, n_docs, shard_size, show_progress)

    def _build_locked(self, encode_chunk: Callable[[int, int], np.ndarray], n_docs: int,
                      shard_size: int, show_progress: bool) -> np.ndarray:
        t0 = time.perf_counter()
        shards = self._shards_for(shard_size, n_docs)
        dim, encoded = shards.encode(encode_chunk, show_progress)
        self._merge(shards, dim)
        logger.info(
            "encoded %d docs in %.1f s (%d loaded from shards); saved to %s",
            encoded, time.perf_counter() - t0, n_docs - encoded, self.dir,
        )
        loaded = self.load()
        if loaded is None:  # pragma: no cover - we just wrote it
            raise RuntimeError(f"cannot read back {self.embeddings_path}")
        return loaded

    def _shards_for(self, shard_size: int, n_docs: int) -> _Shards:
        """The shard folder for this layout; shards of another key or shard size are discarded."""
        shard_dir = self.dir / "shards"
        shard_dir.mkdir(parents=True, exist_ok=True)
        progress = shard_dir / "progress.json"
        if progress.exists():
            try:
                prev = json.loads(progress.read_text(encoding="utf-8"))
            except (OSError, ValueError):  # ValueError: malformed JSON, not UTF-8
                prev = {}
            if not isinstance(prev, dict) or prev.get("shard_size") != shard_size or prev.get("key") != self.key:
                logger.info("discarding shards of a different layout in %s", shard_dir)
                shutil.rmtree(shard_dir)
                shard_dir.mkdir(parents=True)
        atomic_write_json(progress, {"key": self.key, "shard_size": shard_size, "n_docs": n_docs})
        return _Shards(shard_dir, shard_size, n_docs)

    def _merge(self, shards: _Shards, dim: int) -> None:
        """Merge the shards into ``embeddings.npy`` and write ``meta.json`` (each atomically),
        then remove the shards.

        The free space is checked first and the whole file is reserved (``posix_fallocate``)
        before any row is written through the memory map: a page write into a sparse file on a
        full disk would kill the process with SIGBUS and leave the temporary behind.
        """
        size = shards.n_docs * dim * 4 + 128  # rows + the .npy header (at most 128 bytes here)
        check_space(self.embeddings_path, size)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=temp_prefix(self.embeddings_path), suffix=".tmp")
        os.close(fd)
        try:
            self._write_rows(tmp, shards, dim)
            set_default_mode(tmp)
            digest = file_sha256(Path(tmp))
            os.replace(tmp, self.embeddings_path)
        except BaseException as e:
            Path(tmp).unlink(missing_ok=True)
            raise_if_disk_full(e, self.embeddings_path, size)
            raise
        _CHECKED.add(_stamp(self.embeddings_path))  # just written: its checksum is its own
        atomic_write_json(
            self.meta_path,
            {**self.meta, "key": self.key, "dim": dim, "sha256": digest,
             "created": time.strftime("%Y-%m-%dT%H:%M:%S")},
        )
        shutil.rmtree(shards.dir, ignore_errors=True)

    def _write_rows(self, tmp: str, shards: _Shards, dim: int) -> None:
        """Write every shard's rows into the ``.npy`` file ``tmp`` through a memory map, its
        space reserved first."""
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(shards.n_docs, dim))
        try:
            with open(tmp, "r+b") as f:
                preallocate(f.fileno(), os.path.getsize(tmp), self.embeddings_path)
            for i, (start, end) in enumerate(shards.bounds()):
                out[start:end] = np.load(shards.path(i))
            out.flush()
        finally:
            del out  # unmapped now, also on an error (whose traceback would keep it mapped)


_CHECKED: set[tuple[str, int, int]] = set()
"""``(path, size, mtime)`` of the matrices whose checksum this process has checked (or written)."""


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _stamp(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return str(path), st.st_size, st.st_mtime_ns


def _matches_checksum(path: Path, expected: Any) -> bool:
    """Whether the matrix at ``path`` has the SHA-256 its ``meta.json`` recorded (True without one:
    written by an earlier version); False with a warning naming the file, which is then encoded
    again. Each file is read once per process (again only when its size or time changes)."""
    if not isinstance(expected, str):
        return True
    try:
        stamp = _stamp(path)
        if stamp in _CHECKED:
            return True
        actual = file_sha256(path)
    except OSError as e:
        logger.warning("%s is damaged (%s); its embeddings are encoded again", path, e)
        return False
    if actual != expected:
        logger.warning("%s is damaged (its SHA-256 is not the one meta.json recorded when it was written); "
                       "its embeddings are encoded again", path)
        return False
    _CHECKED.add(stamp)
    return True


def _load_npy(path: Path) -> np.ndarray | None:
    """The ``.npy`` file at ``path`` as a read-only memory map; None, with a warning naming the
    file, when it cannot be read as one (a damaged header, a file shorter than its header says):
    it is encoded again, as an absent one would be."""
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        logger.warning("%s is damaged (%s); its embeddings are encoded again", path, e)
        return None


@dataclass(frozen=True)
class _Shards:
    """The shard files of one corpus being encoded: ``<dir>/NNNNN.npy``, ``size`` documents each."""

    dir: Path
    size: int
    n_docs: int

    def bounds(self) -> list[tuple[int, int]]:
        """``[start, end)`` of each shard's documents."""
        return [(s, min(self.n_docs, s + self.size)) for s in range(0, self.n_docs, self.size)]

    def path(self, i: int) -> Path:
        return self.dir / f"{i:05d}.npy"

    def _saved(self, i: int, rows: int, dim: int | None) -> int | None:
        """The dimension of shard ``i`` when it is saved whole (``rows`` rows of ``dim``); a
        partial or mismatched file is removed."""
        path = self.path(i)
        if not path.exists():
            return None
        arr = _load_npy(path)
        if arr is not None and arr.ndim == 2 and arr.shape[0] == rows and (dim is None or arr.shape[1] == dim):
            return int(arr.shape[1])
        path.unlink()
        return None

    def encode(self, encode_chunk: Callable[[int, int], np.ndarray], show_progress: bool) -> tuple[int, int]:
        """Encode and save every shard not saved yet; returns (dimension, documents encoded)."""
        dim: int | None = None
        done = 0
        encoded = 0
        bounds = self.bounds()
        bar = None
        if show_progress and len(bounds) > 1:
            from r2med_agent.progress import stage_bar

            bar = stage_bar(total=self.n_docs, desc="corpus shards", unit="doc")
        try:
            for i, (start, end) in enumerate(bounds):
                saved = self._saved(i, end - start, dim)
                if saved is not None:
                    dim = saved
                    done += 1
                else:
                    rows = l2_normalize(encode_chunk(start, end))
                    if rows.shape[0] != end - start:
                        raise RuntimeError(f"encoder returned {rows.shape[0]} rows for {end - start} texts")
                    if dim is not None and rows.shape[1] != dim:
                        raise RuntimeError(f"shard {i}: dimension {rows.shape[1]} != {dim}")
                    dim = rows.shape[1]
                    _atomic_save_npy(self.path(i), rows)
                    encoded += end - start
                if bar is not None:
                    bar.update(end - start)
        finally:
            if bar is not None:
                bar.close()
        if done:
            logger.info("resumed embeddings from %d saved shard(s) in %s", done, self.dir)
        return dim or 0, encoded


def encode_corpus(
    encoder: Encoder,
    docs: Sequence[Doc],
    *,
    doc_prefix: str = "",
    fingerprint: str | None = None,
    use_cache: bool = True,
    shard_size: int = DEFAULT_SHARD_SIZE,
    show_progress: bool = False,
    root: Path | None = None,
) -> np.ndarray:
    """Document embeddings (unit rows, float32), from the cache when it holds them."""
    spec = encoder.spec

    def encode_chunk(start: int, end: int) -> np.ndarray:
        chunk = docs[start:end]
        if spec.doc_title_pair:  # MedCPT-style: title and text as a pair
            return encoder.encode([d.text for d in chunk], side="doc", prefix=doc_prefix,
                                  titles=[d.title for d in chunk])
        return encoder.encode([d.full_text for d in chunk], side="doc", prefix=doc_prefix)

    if not docs:
        return np.zeros((0, 0), dtype=np.float32)
    if not use_cache:
        return l2_normalize(
            np.concatenate(
                [encode_chunk(s, min(len(docs), s + shard_size)) for s in range(0, len(docs), shard_size)]
            )
        )
    fp = fingerprint or corpus_fingerprint(docs)
    runtime_of = getattr(encoder, "doc_runtime_fields", None)
    runtime = runtime_of() if runtime_of is not None else {}
    key = embedding_cache_key(spec, doc_prefix, fp, len(docs), runtime)
    directory = inside(root or cache_dir() / "embeddings", f"{spec.name}__{key}")
    cache = EmbeddingCache(
        directory,
        key,
        {"encoder": spec.name, "n_docs": len(docs), "corpus_fingerprint": fp, "doc_prefix": doc_prefix,
         **runtime},
    )
    arr = cache.load()
    if arr is not None:
        logger.info("loaded embeddings from %s (%d docs)", directory, arr.shape[0])
        return arr
    directory.mkdir(parents=True, exist_ok=True)
    return cache.build(encode_chunk, len(docs), shard_size=shard_size, show_progress=show_progress)
