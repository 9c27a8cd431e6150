"""Exact cosine search: query embeddings by their ``combine`` rule, the faiss index and
:class:`DenseRetriever` (document embeddings come from :mod:`~r2med_agent.retrieval.dense.cache`).

Queries follow ``SearchRequest.combine`` (docs/protocol.md, dense column of its query table):

=========== ======================================================================
none        emb(prefix + query)
hyde        mean(emb(prefix + query), emb(expansion_prefix + expansion))
query2doc   emb(prefix + query + "[SEP]" + expansion)
lamer       mean(emb(prefix + query), emb(expansion_prefix + expansion))
reasoning   same as lamer (the expansion is the reasoning model's final response)
rewrite     emb(prefix + expansion): the generated text replaces the query (BRIGHT's reasoning
            queries); N samples: the mean of every sample's emb(prefix + sample)
N samples   (``run --samples N``) mean of emb(query) and the N expansions' embeddings (HyDE's way);
            query2doc: mean of the N emb(prefix + query + "[SEP]" + sample)
=========== ======================================================================

``expansion_prefix`` is the query instruction for encoders that put it on both halves
(Instructor, GritLM, NV-Embed) and empty otherwise. An empty expansion falls back to the query
embedding alone, unless the request's ``keep_empty`` says to embed it as it is (R2MED's encoders
average in the embedding of ``prefix + ""``). Scores are exact cosine similarities.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from r2med_agent.evaluation import drop_identical_ids  # noqa: F401 - BEIR's exact search, which dense runs follow
from r2med_agent.errors import ConfigError, MissingExtraError
from r2med_agent.retrieval.dense.cache import encode_corpus, l2_normalize
from r2med_agent.retrieval.dense.factory import make_encoder
from r2med_agent.retrieval.dense.instructions import Prefixes, instruction_prefixes, settings_for_task
from r2med_agent.retrieval.dense.spec import Encoder, EncoderOptions, EncoderSpec, get_encoder_spec
from r2med_agent.retrieval.dense.torch_utils import GPU_ALTERNATIVE
from r2med_agent.types import Doc, Run, SearchRequest, Task, doc_ids_of

logger = logging.getLogger(__name__)

SEP = "[SEP]"
"""Joins query and passage for Query2Doc (as R2MED's reference code does)."""


def _import_faiss() -> Any:
    try:
        import faiss
    except ImportError:
        raise MissingExtraError("faiss", "cpu", GPU_ALTERNATIVE) from None
    return faiss



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
        samples = r.expansions
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
        elif r.combine == "rewrite":
            primary.append(samples[0] if samples else r.query)
            if samples:  # further samples join the mean, each in the query's place
                q2d_rows.extend([i] * (len(samples) - 1))
                q2d_texts.extend(samples[1:])
            else:
                fallback += 1
        else:
            raise ConfigError(
                f"query {r.query_id}: unknown combine '{r.combine}'; "
                "allowed: none, hyde, query2doc, lamer, reasoning, rewrite"
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
        options: EncoderOptions | None = None,
        *,
        task_name: str = "",
        family: str = "",
        domain: str = "",
        fingerprint: str | None = None,
    ) -> DenseRetriever:
        """A retriever over ``docs``.

        Args:
            docs: the corpus.
            encoder: registry name, spec (its settings for ``task_name``,
                :func:`~r2med_agent.retrieval.dense.instructions.settings_for_task`, built by
                :func:`~r2med_agent.retrieval.dense.factory.make_encoder` with ``options``), or a
                ready encoder (used as it is).
            options: device, precision, backend, progress bars, embedding cache and faiss GPU
                settings (None: the defaults).
            task_name, family, domain: pick the encoder's instructions
                (:func:`~r2med_agent.retrieval.dense.instructions.instruction_prefixes`).
            fingerprint: the corpus fingerprint for the cache key (default: hashed from ``docs``).
        """
        options = options or EncoderOptions()
        if isinstance(encoder, str):
            encoder = get_encoder_spec(encoder)
        if isinstance(encoder, EncoderSpec):  # the entry's settings on this task (its BRIGHT ones)
            enc = make_encoder(settings_for_task(encoder, task_name), options)
        else:
            enc = encoder
        check = getattr(enc, "check", None)
        if check is not None:  # the model (or API key) must be there even when embeddings are cached
            check()
        prefixes = instruction_prefixes(enc.spec, task_name, family, domain)
        emb = encode_corpus(
            enc,
            docs,
            doc_prefix=prefixes.doc,
            fingerprint=fingerprint,
            use_cache=options.use_cache,
            shard_size=options.shard_size,
            show_progress=options.show_progress,
            root=options.cache_root,
        )
        return cls(enc, doc_ids_of(docs), emb, prefixes, use_gpu=options.use_gpu)

    @classmethod
    def for_task(
        cls, task: Task, encoder: str | EncoderSpec | Encoder = "minilm", options: EncoderOptions | None = None
    ) -> DenseRetriever:
        """A retriever over ``task.corpus`` with the encoder's instructions for this task (its
        fingerprint keys the embedding cache); ``encoder`` and ``options`` as :meth:`from_docs`."""
        return cls.from_docs(
            task.corpus,
            encoder,
            options,
            task_name=task.name,
            family=task.family,
            domain=task.domain,
            fingerprint=task.fingerprint,
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

