"""Dense retrieval: cached document embeddings and exact cosine search with faiss.

Document embeddings are cached per (encoder settings that shape them, resolved document
instruction, corpus fingerprint) under ``cache_dir()/embeddings/<encoder>__<key>/``. Encoding writes
shards of ``shard_size`` documents, each atomically, so a killed run resumes from its last shard;
the shards are then merged into one float32 ``embeddings.npy`` (memory-mapped when reused) and a
``meta.json``, both written atomically.

Queries follow ``SearchRequest.combine`` (docs/protocol.md, dense column of its query table):

=========== ======================================================================
none        emb(prefix + query)
hyde        mean(emb(prefix + query), emb(expansion_prefix + expansion))
query2doc   emb(prefix + query + "[SEP]" + expansion)
lamer       mean(emb(prefix + query), emb(expansion_prefix + expansion))
reasoning   same as lamer (the expansion is the reasoning model's final response)
N samples   (``run --samples N``) mean of emb(query) and the N expansions' embeddings (HyDE's way);
            query2doc: mean of the N emb(prefix + query + "[SEP]" + sample)
=========== ======================================================================

``expansion_prefix`` is the query instruction for encoders that put it on both halves
(Instructor, GritLM, NV-Embed) and empty otherwise. An empty expansion falls back to the query
embedding alone. Scores are exact cosine similarities.
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
from pathlib import Path
from typing import Any

import numpy as np

from r2med_agent.errors import ConfigError, MissingExtraError
from r2med_agent.io import atomic_write_json, set_default_mode
from r2med_agent.paths import cache_dir
from r2med_agent.retrieval.encoders import (
    GPU_ALTERNATIVE,
    Encoder,
    EncoderSpec,
    Prefixes,
    get_encoder_spec,
    instruction_prefixes,
    make_encoder,
    model_fingerprint,
)
from r2med_agent.types import Doc, Run, SearchRequest, Task, doc_ids_of

logger = logging.getLogger(__name__)

SEP = "[SEP]"
"""Joins query and passage for Query2Doc (as R2MED's reference code does)."""

CACHE_FORMAT = 2
"""2: documents are encoded as ``Doc.full_text`` (title + " " + text), no longer the text alone."""
DEFAULT_SHARD_SIZE = 8192

# Fields of EncoderSpec that do not change document embeddings (query side, batching, API access,
# the transformers version check, engine settings). The backend enters the key as resolved at run
# time (``doc_runtime_fields``), not as the entry's ``auto``.
_QUERY_ONLY_FIELDS = frozenset(
    {
        "name", "query_model", "query_max_length", "query_prefix", "query_instructions",
        "instruction_format", "instruction_on", "batch_size", "base_url", "api_key_env",
        "doc_instructions", "doc_instruction_format", "doc_prefix", "transformers",
        "backend", "engine_kwargs",
    }
)


# --------------------------------------------------------------------------- helpers


def _import_faiss() -> Any:
    try:
        import faiss
    except ImportError:
        raise MissingExtraError("faiss", "cpu", GPU_ALTERNATIVE) from None
    return faiss


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
        k: v for k, v in dataclasses.asdict(spec).items() if k not in _QUERY_ONLY_FIELDS
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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, np.ascontiguousarray(arr, dtype=np.float32))
            f.flush()
            os.fsync(f.fileno())
        set_default_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- embedding cache


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
        except (OSError, json.JSONDecodeError):
            return None
        if meta.get("key") != self.key or meta.get("n_docs") != self.meta["n_docs"]:
            return None
        arr = np.load(self.embeddings_path, mmap_mode="r")
        if arr.dtype != np.float32 or arr.ndim != 2 or arr.shape[0] != self.meta["n_docs"]:
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
        """
        if shard_size < 1:
            raise ConfigError(f"shard_size must be >= 1, got {shard_size}")
        shard_dir = self.dir / "shards"
        shard_dir.mkdir(parents=True, exist_ok=True)
        progress = shard_dir / "progress.json"
        if progress.exists():
            try:
                prev = json.loads(progress.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                prev = {}
            if prev.get("shard_size") != shard_size or prev.get("key") != self.key:
                logger.info("discarding shards of a different layout in %s", shard_dir)
                shutil.rmtree(shard_dir)
                shard_dir.mkdir(parents=True)
        atomic_write_json(progress, {"key": self.key, "shard_size": shard_size, "n_docs": n_docs})

        n_shards = (n_docs + shard_size - 1) // shard_size
        dim: int | None = None
        done = 0
        encoded = 0
        t0 = time.perf_counter()
        bar = None
        if show_progress and n_shards > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=n_docs, desc="corpus shards", unit="doc")
        try:
            for i in range(n_shards):
                start, end = i * shard_size, min(n_docs, (i + 1) * shard_size)
                path = shard_dir / f"{i:05d}.npy"
                if path.exists():
                    arr = np.load(path, mmap_mode="r")
                    if arr.ndim == 2 and arr.shape[0] == end - start and (dim is None or arr.shape[1] == dim):
                        dim = arr.shape[1]
                        done += 1
                        if bar is not None:
                            bar.update(end - start)
                        continue
                    path.unlink()
                rows = l2_normalize(encode_chunk(start, end))
                if rows.shape[0] != end - start:
                    raise RuntimeError(f"encoder returned {rows.shape[0]} rows for {end - start} texts")
                if dim is not None and rows.shape[1] != dim:
                    raise RuntimeError(f"shard {i}: dimension {rows.shape[1]} != {dim}")
                dim = rows.shape[1]
                _atomic_save_npy(path, rows)
                encoded += end - start
                if bar is not None:
                    bar.update(end - start)
        finally:
            if bar is not None:
                bar.close()
        if done:
            logger.info("resumed embeddings from %d saved shard(s) in %s", done, shard_dir)

        # Merge the shards into one file, atomically.
        dim = dim or 0
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".embeddings.npy.", suffix=".tmp")
        os.close(fd)
        try:
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n_docs, dim))
            for i in range(n_shards):
                start, end = i * shard_size, min(n_docs, (i + 1) * shard_size)
                out[start:end] = np.load(shard_dir / f"{i:05d}.npy")
            out.flush()
            del out
            set_default_mode(tmp)
            os.replace(tmp, self.embeddings_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        atomic_write_json(
            self.meta_path,
            {**self.meta, "key": self.key, "dim": dim, "created": time.strftime("%Y-%m-%dT%H:%M:%S")},
        )
        shutil.rmtree(shard_dir, ignore_errors=True)
        logger.info(
            "encoded %d docs in %.1f s (%d loaded from shards); saved to %s",
            encoded, time.perf_counter() - t0, n_docs - encoded, self.dir,
        )
        loaded = self.load()
        if loaded is None:  # pragma: no cover - we just wrote it
            raise RuntimeError(f"cannot read back {self.embeddings_path}")
        return loaded


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
    directory = (root or cache_dir() / "embeddings") / f"{spec.name}__{key}"
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


# --------------------------------------------------------------------------- queries


def query_embeddings(
    encoder: Encoder, requests: Sequence[SearchRequest], prefixes: Prefixes
) -> np.ndarray:
    """One unit vector per request, built by its ``combine`` rule (module docstring).

    All primary texts go through the encoder in one call, all expansions in a second one.
    """
    primary: list[str] = []
    mean_rows: list[int] = []
    expansions: list[str] = []
    q2d_rows: list[int] = []  # further samples of query2doc requests: query[SEP]sample
    q2d_texts: list[str] = []
    fallback = 0
    for i, r in enumerate(requests):
        samples = r.expansions if r.more_expansions else ((r.expansion,) if r.expansion.strip() else ())
        if r.combine == "query2doc":
            if samples:
                primary.append(r.query + SEP + samples[0])
                q2d_rows.extend([i] * (len(samples) - 1))
                q2d_texts.extend(r.query + SEP + x for x in samples[1:])
            else:
                primary.append(r.query)
                fallback += 1
        elif r.combine in ("hyde", "lamer", "reasoning"):
            primary.append(r.query)
            if samples:
                mean_rows.extend([i] * len(samples))
                expansions.extend(samples)
            else:
                fallback += 1
        elif r.combine == "none":
            primary.append(r.query)
        else:
            raise ConfigError(
                f"query {r.query_id}: unknown combine '{r.combine}'; "
                "allowed: none, hyde, query2doc, lamer, reasoning"
            )
    if fallback:
        logger.warning("%d request(s) had an empty expansion; their query embedding is used alone", fallback)
    if not primary:
        return np.zeros((0, 0), dtype=np.float32)
    base = np.asarray(encoder.encode(primary, side="query", prefix=prefixes.query), dtype=np.float32)
    counts = np.ones(len(primary), dtype=np.float32)
    if expansions or q2d_texts:
        base = base.copy()
    if expansions:
        ext = np.asarray(
            encoder.encode(expansions, side="query", prefix=prefixes.expansion), dtype=np.float32
        )
        np.add.at(base, mean_rows, ext)
        np.add.at(counts, mean_rows, 1.0)
    if q2d_texts:
        more = np.asarray(encoder.encode(q2d_texts, side="query", prefix=prefixes.query), dtype=np.float32)
        np.add.at(base, q2d_rows, more)
        np.add.at(counts, q2d_rows, 1.0)
    if expansions or q2d_texts:
        base /= counts[:, None]
    return l2_normalize(base)


# --------------------------------------------------------------------------- exact search


class FlatIndex:
    """Exact inner-product search (faiss ``IndexFlatIP``) with deterministic top-k.

    faiss may order equal scores arbitrarily and cut a tie group at k. ``search`` therefore asks
    for ``k + margin`` results, widens the search for any query whose tie group reaches the end of
    what came back, and orders by (score descending, document index ascending).
    With ``use_gpu`` (faiss built with GPU support and a GPU present, the ``[gpu]`` extra) the index
    lives on the GPUs; searches deeper than faiss-GPU's 2048 limit use a CPU copy.
    """

    GPU_MAX_K = 2048

    def __init__(self, vectors: np.ndarray, *, use_gpu: bool | None = None) -> None:
        faiss = _import_faiss()
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2:
            raise ValueError(f"expected a 2-D matrix, got shape {vectors.shape}")
        self.ntotal, self.dim = int(vectors.shape[0]), int(vectors.shape[1])
        self._cpu = faiss.IndexFlatIP(max(self.dim, 1))
        if self.ntotal:
            self._cpu.add(vectors)
        self._gpu = None
        gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
        if use_gpu is None:
            use_gpu = gpus > 0
        if use_gpu:
            if not hasattr(faiss, "StandardGpuResources"):
                raise MissingExtraError(
                    "faiss with GPU support", "gpu", "after removing faiss-cpu: pip uninstall faiss-cpu"
                )
            if gpus == 0:
                raise ConfigError("a GPU faiss index was requested (use_gpu) but faiss sees no GPU")
            self._gpu = faiss.index_cpu_to_all_gpus(self._cpu)
            logger.info("faiss index on %d GPU(s)", gpus)

    def _raw(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        index = self._gpu if (self._gpu is not None and k <= self.GPU_MAX_K) else self._cpu
        return index.search(q, k)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` ``(scores, doc_indices)`` per query row, exact and deterministic.

        Both arrays have ``min(k, ntotal)`` columns.
        """
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        nq = queries.shape[0]
        k = min(k, self.ntotal)
        if nq == 0 or k <= 0:
            return np.zeros((nq, 0), dtype=np.float32), np.zeros((nq, 0), dtype=np.int64)
        kp = min(self.ntotal, k + max(16, k // 4))
        D, I = self._raw(queries, kp)
        rows: list[tuple[np.ndarray, np.ndarray]] = [(D[r], I[r]) for r in range(nq)]
        pending = [r for r in range(nq) if kp < self.ntotal and D[r, kp - 1] >= D[r, k - 1]]
        while pending:
            kp = min(self.ntotal, kp * 4)
            D2, I2 = self._raw(queries[pending], kp)
            still = []
            for j, r in enumerate(pending):
                rows[r] = (D2[j], I2[j])
                if kp < self.ntotal and D2[j, kp - 1] >= D2[j, k - 1]:
                    still.append(r)
            pending = still
        scores = np.empty((nq, k), dtype=np.float32)
        idx = np.empty((nq, k), dtype=np.int64)
        for r, (d, i) in enumerate(rows):
            valid = i >= 0
            d, i = d[valid], i[valid]
            order = np.lexsort((i, -d))[:k]
            scores[r], idx[r] = d[order], i[order]
        return scores, idx


# --------------------------------------------------------------------------- retriever


class DenseRetriever:
    """Exact cosine retrieval over one corpus with one encoder.

    Build it with :meth:`for_task` (instructions resolved for the task, embeddings cached) or
    :meth:`from_docs`. ``search`` embeds all requests of a call and runs one batched search.
    """

    def __init__(
        self,
        encoder: Encoder,
        doc_ids: Sequence[str],
        doc_embeddings: np.ndarray,
        prefixes: Prefixes,
        *,
        name: str | None = None,
        use_gpu: bool | None = None,
    ) -> None:
        if len(doc_ids) != doc_embeddings.shape[0]:
            raise ValueError(f"{len(doc_ids)} doc ids for {doc_embeddings.shape[0]} embeddings")
        self.encoder = encoder
        self.name = name or encoder.name
        self.doc_ids = list(doc_ids)
        self.prefixes = prefixes
        self.index = FlatIndex(doc_embeddings, use_gpu=use_gpu)

    @classmethod
    def from_docs(
        cls,
        docs: Sequence[Doc],
        encoder: str | EncoderSpec | Encoder = "minilm",
        *,
        task_name: str = "",
        family: str = "",
        domain: str = "",
        fingerprint: str | None = None,
        device: str | None = None,
        show_progress: bool = True,
        use_cache: bool = True,
        shard_size: int = DEFAULT_SHARD_SIZE,
        use_gpu: bool | None = None,
        cache_root: Path | None = None,
        precision: str | None = None,
        encoder_backend: str | None = None,
    ) -> DenseRetriever:
        enc = _as_encoder(encoder, device=device, show_progress=show_progress, precision=precision,
                          backend=encoder_backend)
        check = getattr(enc, "check", None)
        if check is not None:  # the model (or API key) must be there even when embeddings are cached
            check()
        prefixes = instruction_prefixes(enc.spec, task_name, family, domain)
        emb = encode_corpus(
            enc,
            docs,
            doc_prefix=prefixes.doc,
            fingerprint=fingerprint,
            use_cache=use_cache,
            shard_size=shard_size,
            show_progress=show_progress,
            root=cache_root,
        )
        return cls(enc, doc_ids_of(docs), emb, prefixes, use_gpu=use_gpu)

    @classmethod
    def for_task(
        cls,
        task: Task,
        encoder: str | EncoderSpec | Encoder = "minilm",
        device: str | None = None,
        show_progress: bool = True,
        **opts: Any,
    ) -> DenseRetriever:
        """A retriever over ``task.corpus`` with the encoder's instructions for this task.

        Args:
            task: the loaded task (its fingerprint keys the embedding cache).
            encoder: registry name, spec, or a ready encoder.
            device: ``None`` (all GPUs, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:1"``.
            show_progress: tqdm bars while encoding.
            **opts: ``use_cache``, ``shard_size``, ``use_gpu`` (faiss on GPU), ``cache_root``,
                ``precision`` (overrides the encoder entry's), ``encoder_backend`` (``auto``,
                ``transformers``, ``vllm``; default: the entry's).
        """
        return cls.from_docs(
            task.corpus,
            encoder,
            task_name=task.name,
            family=task.family,
            domain=task.domain,
            fingerprint=task.fingerprint,
            device=device,
            show_progress=show_progress,
            **opts,
        )

    def search(self, requests: Sequence[SearchRequest], k: int) -> Run:
        run: Run = {r.query_id: {} for r in requests}
        if not requests or not self.doc_ids or k <= 0:
            return run
        t0 = time.perf_counter()
        q = query_embeddings(self.encoder, requests, self.prefixes)
        if q.shape[1] != self.index.dim:
            raise RuntimeError(
                f"query dimension {q.shape[1]} != document dimension {self.index.dim} "
                f"(encoder {self.name})"
            )
        scores, idx = self.index.search(q, k)
        for r, req in enumerate(requests):
            run[req.query_id] = {self.doc_ids[j]: float(s) for s, j in zip(scores[r], idx[r])}
        logger.debug("%s: %d queries searched in %.2f s", self.name, len(requests), time.perf_counter() - t0)
        return run


def _as_encoder(
    encoder: str | EncoderSpec | Encoder, *, device: str | None, show_progress: bool,
    precision: str | None = None, backend: str | None = None,
) -> Encoder:
    if isinstance(encoder, str):
        encoder = get_encoder_spec(encoder)
    if isinstance(encoder, EncoderSpec):
        if precision is not None and encoder.kind == "hf":
            encoder = dataclasses.replace(encoder, precision=precision)
        return make_encoder(encoder, device=device, show_progress=show_progress, backend=backend)
    return encoder
