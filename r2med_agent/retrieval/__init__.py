"""Retrievers (BM25, dense, fusion) and rerankers, built from short spec strings.

``make_retriever("bm25", task)``, ``make_retriever("minilm", task)`` or
``make_retriever("bm25+minilm", task)`` (reciprocal rank fusion of the parts);
``make_reranker("bge-reranker")``. NanoR2MED's shipped candidate rankings and the hybrid list
rebuilt from them are :mod:`r2med_agent.retrieval.candidates` (``nano-bm25``, ``hakari-hybrid``, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from r2med_agent.errors import ConfigError, did_you_mean
from r2med_agent.retrieval.base import Retriever

if TYPE_CHECKING:  # pragma: no cover
    from r2med_agent.retrieval.rerank import Reranker
    from r2med_agent.types import Task

__all__ = ["Retriever", "make_retriever", "make_reranker", "register_retriever", "retriever_names"]

BM25_SPECS = {"bm25": "lucene", "bm25-compat": "r2med-compat"}
"""Spec word -> BM25Retriever mode."""

_BM25_OPTS = {"k1", "b", "index_root", "n_threads", "show_progress"}
_DENSE_OPTS = {"device", "show_progress", "use_cache", "shard_size", "use_gpu", "cache_root", "precision",
               "encoder_backend"}
_FUSION_OPTS = {"fusion", "rrf_k", "weights", "depth"}


_REGISTERED: dict[str, Callable[[Task], Retriever]] = {}
"""Retrievers registered from Python (:func:`register_retriever`): name -> factory over a task."""


def register_retriever(name: str, factory: Callable[[Task], Retriever]) -> None:
    """Make ``name`` a retriever spec word in this process: ``factory(task)`` builds it for a
    task (the Python API's own encoders and retrievers go through this). A name of the
    registries (bm25, an encoder) cannot be taken."""
    from r2med_agent.retrieval.dense.spec import encoder_registry

    if not name or "+" in name or "/" in name:
        raise ConfigError(f"retriever name {name!r} must be non-empty, without '+' or '/'")
    if name in BM25_SPECS or name in encoder_registry():
        raise ConfigError(f"retriever name '{name}' is taken by the registry; choose another")
    _REGISTERED[name] = factory


def retriever_names() -> list[str]:
    """Every single-retriever spec word: the BM25 variants, the encoder registry's names and
    NanoR2MED's candidate rankings and the retrievers registered from Python."""
    from r2med_agent.retrieval.candidates import candidate_names
    from r2med_agent.retrieval.dense.spec import encoder_registry

    return [*BM25_SPECS, *sorted(encoder_registry()), *candidate_names(), *sorted(_REGISTERED)]


def make_retriever(spec: str, task: Task, **opts: Any) -> Retriever:
    """Build the retriever named by ``spec`` over ``task``'s corpus.

    Args:
        spec: ``bm25`` (Lucene 9 BM25, to the bit), ``bm25-compat`` (R2MED's reference analyzer), an
            encoder name from ``configs/encoders.yaml``, or several joined by ``+`` (fused).
        task: the loaded task.
        **opts: BM25 ``k1``, ``b``, ``index_root``, ``n_threads``; dense ``device``,
            ``use_cache``, ``shard_size``, ``use_gpu``, ``cache_root``, ``precision`` (overrides
            the encoder entry's), ``encoder_backend`` (``auto``, ``transformers``, ``vllm``: the
            engine of local encoders; None: each entry's ``backend``); both ``show_progress``;
            fusion ``fusion`` (``rrf`` or ``weighted``), ``rrf_k``, ``weights``, ``depth``.
    """
    unknown = sorted(set(opts) - _BM25_OPTS - _DENSE_OPTS - _FUSION_OPTS)
    if unknown:
        allowed = sorted(_BM25_OPTS | _DENSE_OPTS | _FUSION_OPTS)
        raise ConfigError(f"unknown retriever option(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    parts = [p.strip() for p in spec.split("+")]
    if not spec.strip() or any(not p for p in parts):
        raise ConfigError(f"retriever spec '{spec}' has an empty part; write e.g. 'bm25+minilm'")
    if len(set(parts)) != len(parts):
        raise ConfigError(f"retriever spec '{spec}' names a retriever twice")
    from r2med_agent.retrieval.fusion import DEFAULT_RRF_K, FusionRetriever, check_fusion_options

    # Names and options are checked before any member is built (a dense member may encode a corpus).
    known = set(retriever_names())
    for word in parts:
        if word not in known:
            raise ConfigError(
                f"unknown retriever '{word}'{did_you_mean(word, retriever_names())}; "
        f"allowed: {', '.join(retriever_names())}, "
                "or several joined by '+'"
            )
    if len(parts) == 1:
        if any(o in opts for o in _FUSION_OPTS):
            raise ConfigError(f"fusion options need a '+'-joined spec, got '{spec}'")
        return _single(parts[0], task, opts)
    check_fusion_options(
        len(parts), opts.get("fusion", "rrf"), opts.get("rrf_k", DEFAULT_RRF_K), opts.get("weights")
    )
    members = [_single(p, task, opts) for p in parts]
    return FusionRetriever(
        members,
        method=opts.get("fusion", "rrf"),
        rrf_k=opts.get("rrf_k", DEFAULT_RRF_K),
        weights=opts.get("weights"),
        depth=opts.get("depth", 100),
    )


def _single(word: str, task: Task, opts: dict[str, Any]) -> Retriever:
    if word in _REGISTERED:
        return _REGISTERED[word](task)
    if word in BM25_SPECS:
        from r2med_agent.retrieval.bm25 import BM25Retriever

        kw = {k: opts[k] for k in _BM25_OPTS if k in opts}
        return BM25Retriever.for_task(task, mode=BM25_SPECS[word], **kw)
    from r2med_agent.retrieval.candidates import candidate_names, make_candidate_retriever
    from r2med_agent.retrieval.dense.spec import encoder_registry

    from r2med_agent.retrieval.dense.spec import EncoderOptions

    kw = {"backend" if k == "encoder_backend" else k: opts[k] for k in _DENSE_OPTS if opts.get(k) is not None}
    if word in candidate_names():
        return make_candidate_retriever(word, task, EncoderOptions(**kw))
    if word in encoder_registry():
        from r2med_agent.retrieval.dense.index import DenseRetriever

        return DenseRetriever.for_task(task, word, EncoderOptions(**kw))
    raise ConfigError(
        f"unknown retriever '{word}'{did_you_mean(word, retriever_names())}; "
        f"allowed: {', '.join(retriever_names())}, "
        "or several joined by '+'"
    )


def make_reranker(name: str, **opts: Any) -> Reranker:
    """The reranker registered as ``name`` in ``configs/rerankers.yaml`` (options: ``device``,
    ``backend``, ``show_progress``, ``precision``)."""
    from r2med_agent.retrieval.rerank import make_reranker as _make

    return _make(name, **opts)
