"""The retriever registry: what each word of a retriever spec (``--retriever``) builds.

``make_retriever(spec, task)`` splits ``spec`` at ``+``; one word is one retriever, several are
fused (:class:`~r2med_agent.retrieval.fusion.FusionRetriever`). Each word is built by the kind of
:data:`RETRIEVER_KINDS` whose ``names()`` list it (the kinds' names never overlap):

============ ============================================== =========================================
kind         names                                          builds
============ ============================================== =========================================
bm25         ``bm25``, ``bm25-compat`` (:data:`BM25_SPECS`)  :class:`~r2med_agent.retrieval.bm25.retriever.BM25Retriever`
dense        the encoder registry (``configs/encoders.yaml``  :class:`~r2med_agent.retrieval.dense.index.DenseRetriever`
             and a user config's ``encoders:``)
candidates   NanoR2MED's lists (``nano-bm25``, ...,          :mod:`~r2med_agent.retrieval.candidates`
             ``hakari-hybrid``)
python       :func:`register_retriever` (this process)      the registered factory
============ ============================================== =========================================

A new kind of retriever is one module (a class with ``name`` and ``search(requests, k)``, the
:class:`~r2med_agent.retrieval.base.Retriever` protocol) plus one line in :data:`RETRIEVER_KINDS`:
``"mine": RetrieverKind(names, build)``, where ``names()`` lists its words and
``build(word, task, options)`` makes the retriever of one word over a task's corpus, reading what
it needs from the :class:`RetrieverOptions`. Modules are imported inside ``build``, so listing
the names stays cheap.

Options travel typed: :class:`RetrieverOptions` holds the dense encoders'
:class:`~r2med_agent.retrieval.dense.spec.EncoderOptions`, the
:class:`~r2med_agent.retrieval.bm25.retriever.BM25Options` and the
:class:`~r2med_agent.retrieval.fusion.FusionOptions` of '+'-joined specs. ``make_retriever``
also takes them as keywords (``show_progress``, ``precision``, ``encoder_backend``, ``fusion``,
``rrf_k``, ``weights``, ...: :meth:`RetrieverOptions.from_keywords`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from r2med_agent.errors import ConfigError, did_you_mean
from r2med_agent.retrieval.base import Retriever
from r2med_agent.retrieval.bm25.retriever import BM25Options
from r2med_agent.retrieval.dense.spec import EncoderOptions
from r2med_agent.retrieval.fusion import ORIGINAL_QUERY, FusionOptions, OriginalQueryRetriever

if TYPE_CHECKING:  # pragma: no cover
    from r2med_agent.types import Task

__all__ = [
    "BM25_SPECS", "RETRIEVER_KINDS", "RetrieverKind", "RetrieverOptions", "make_retriever",
    "register_retriever", "retriever_names", "unregister_retriever",
]

BM25_SPECS = {"bm25": "lucene", "bm25-compat": "r2med-compat"}
"""Spec word -> BM25Retriever mode."""


@dataclass(frozen=True)
class RetrieverOptions:
    """Everything :func:`make_retriever` passes on, one typed group per kind of retriever."""

    encoder: EncoderOptions = field(default_factory=EncoderOptions)
    """Dense retrievers (and the dense member of ``hakari-hybrid``)."""
    bm25: BM25Options = field(default_factory=BM25Options)
    """BM25 retrievers."""
    fusion: FusionOptions | None = None
    """How a '+'-joined spec fuses (None: the defaults; set only for such a spec)."""

    @classmethod
    def from_keywords(cls, **keywords: Any) -> RetrieverOptions:
        """The options of ``make_retriever``'s keywords: BM25 ``k1``, ``b``, ``index_root``,
        ``n_threads``; dense ``device``, ``use_cache``, ``shard_size``, ``use_gpu``,
        ``cache_root``, ``precision`` (overrides the encoder entry's), ``encoder_backend``
        (``auto``, ``transformers``, ``vllm``; None: each entry's ``backend``); both
        ``show_progress``; fusion ``fusion`` (``rrf`` or ``weighted``), ``rrf_k``, ``weights``,
        ``depth``. A BM25 or dense keyword given as None keeps its default.

        Raises:
            ConfigError: an unknown keyword.
        """
        unknown = sorted(set(keywords) - set(_BM25_KEYWORDS) - set(_ENCODER_KEYWORDS) - set(_FUSION_KEYWORDS))
        if unknown:
            allowed = sorted({*_BM25_KEYWORDS, *_ENCODER_KEYWORDS, *_FUSION_KEYWORDS})
            raise ConfigError(f"unknown retriever option(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")

        def given(table: dict[str, str], keep_none: bool = False) -> dict[str, Any]:
            return {table[k]: v for k, v in keywords.items() if k in table and (keep_none or v is not None)}

        fusion = given(_FUSION_KEYWORDS, keep_none=True)
        return cls(
            encoder=EncoderOptions(**given(_ENCODER_KEYWORDS)),
            bm25=BM25Options(**given(_BM25_KEYWORDS)),
            fusion=FusionOptions(**fusion) if fusion else None,
        )


_BM25_KEYWORDS = {k: k for k in ("k1", "b", "index_root", "n_threads", "show_progress")}
_ENCODER_KEYWORDS = {
    **{k: k for k in ("device", "show_progress", "use_cache", "shard_size", "use_gpu", "cache_root", "precision")},
    "encoder_backend": "backend",
}
_FUSION_KEYWORDS = {"fusion": "method", "rrf_k": "rrf_k", "weights": "weights", "depth": "depth"}
"""make_retriever keyword -> field of the options it sets."""


@dataclass(frozen=True)
class RetrieverKind:
    """One kind of retriever: the spec words it answers to and how it builds one."""

    names: Callable[[], Iterable[str]]
    """The words of this kind, read on every call (registries can change within a process)."""
    build: Callable[[str, Task, RetrieverOptions], Retriever]
    """``build(word, task, options)``: the retriever ``word`` over ``task``'s corpus."""


def _build_bm25(word: str, task: Task, options: RetrieverOptions) -> Retriever:
    from r2med_agent.retrieval.bm25.retriever import BM25Retriever

    bm25 = options.bm25
    return BM25Retriever.for_task(
        task, mode=BM25_SPECS[word], k1=bm25.k1, b=bm25.b, index_root=bm25.index_root,
        show_progress=bm25.show_progress, n_threads=bm25.n_threads,
    )


def _encoder_names() -> list[str]:
    from r2med_agent.retrieval.dense.spec import encoder_registry

    return sorted(encoder_registry())


def _build_dense(word: str, task: Task, options: RetrieverOptions) -> Retriever:
    from r2med_agent.retrieval.dense.index import DenseRetriever

    return DenseRetriever.for_task(task, word, options.encoder)


def _candidate_names() -> list[str]:
    from r2med_agent.retrieval.candidates import candidate_names

    return candidate_names()


def _build_candidates(word: str, task: Task, options: RetrieverOptions) -> Retriever:
    from r2med_agent.retrieval.candidates import make_candidate_retriever

    return make_candidate_retriever(word, task, options.encoder)


_REGISTERED: dict[str, Callable[[Task], Retriever]] = {}
"""Retrievers registered from Python (:func:`register_retriever`): name -> factory over a task."""

RETRIEVER_KINDS: dict[str, RetrieverKind] = {
    "bm25": RetrieverKind(lambda: list(BM25_SPECS), _build_bm25),
    "dense": RetrieverKind(_encoder_names, _build_dense),
    "candidates": RetrieverKind(_candidate_names, _build_candidates),
    "python": RetrieverKind(lambda: sorted(_REGISTERED), lambda word, task, options: _REGISTERED[word](task)),
}
"""Kind -> its names and builder, in the order :func:`retriever_names` lists them."""


def retriever_names() -> list[str]:
    """Every single-retriever spec word, kind by kind: the BM25 variants, the encoder registry's
    names, NanoR2MED's candidate rankings and the retrievers registered from Python."""
    return [name for kind in RETRIEVER_KINDS.values() for name in kind.names()]


def register_retriever(name: str, factory: Callable[[Task], Retriever]) -> None:
    """Make ``name`` a retriever spec word in this process: ``factory(task)`` builds it for a
    task (the Python API's own encoders and retrievers go through this). A name of another kind
    (bm25, an encoder, a candidate list) cannot be taken."""
    if not name or "+" in name or "/" in name:
        raise ConfigError(f"retriever name {name!r} must be non-empty, without '+' or '/'")
    if any(name in kind.names() for key, kind in RETRIEVER_KINDS.items() if key != "python"):
        raise ConfigError(f"retriever name '{name}' is taken by the registry; choose another")
    _REGISTERED[name] = factory


def unregister_retriever(name: str) -> None:
    """Forget a name of :func:`register_retriever` (nothing happens for an unknown name)."""
    _REGISTERED.pop(name, None)


def make_retriever(spec: str, task: Task, *, options: RetrieverOptions | None = None, **keywords: Any) -> Retriever:
    """Build the retriever named by ``spec`` over ``task``'s corpus.

    Args:
        spec: ``bm25`` (Lucene 9 BM25, to the bit), ``bm25-compat`` (R2MED's reference analyzer),
            an encoder name from ``configs/encoders.yaml``, another word of
            :func:`retriever_names`, or several joined by ``+`` (fused).
        task: the loaded task.
        options: the typed options (default: the defaults, or ``keywords``).
        **keywords: instead of ``options``, as :meth:`RetrieverOptions.from_keywords` takes them
            (``show_progress``, ``precision``, ``encoder_backend``, ``fusion``, ``rrf_k``,
            ``weights``, ...).

    Raises:
        ConfigError: an unknown word or keyword, a malformed spec, fusion options for one
            retriever or out of range; all checked before any retriever is built.
    """
    if options is not None and keywords:
        raise ConfigError(f"make_retriever takes options= or keywords, not both (got {', '.join(sorted(keywords))})")
    if options is None:
        options = RetrieverOptions.from_keywords(**keywords)
    parts = _spec_words(spec)
    if len(parts) == 1:
        if options.fusion is not None:
            raise ConfigError(f"fusion options need a '+'-joined spec, got '{spec}'")
        return _single(parts[0], task, options)
    fusion = options.fusion or FusionOptions()
    fusion.check(len(parts))
    return fusion.retriever([_single(p, task, options) for p in parts])


def _spec_words(spec: str) -> list[str]:
    """The words of ``spec``, checked (none empty, none twice, each known) before any member is
    built (a dense member may encode a corpus)."""
    parts = [p.strip() for p in spec.split("+")]
    if not spec.strip() or any(not p for p in parts):
        raise ConfigError(f"retriever spec '{spec}' has an empty part; write e.g. 'bm25+minilm'")
    if len(set(parts)) != len(parts):
        raise ConfigError(f"retriever spec '{spec}' names a retriever twice")
    known = retriever_names()
    for part in parts:
        word = part.removesuffix(ORIGINAL_QUERY)
        if word != part and len(parts) == 1:
            raise ConfigError(f"'{part}': the {ORIGINAL_QUERY} suffix marks a fused member that searches with "
                              "the original query; write e.g. 'bm25+minilm:query'")
        if word not in known:
            raise ConfigError(
                f"unknown retriever '{word}'{did_you_mean(word, known)}; allowed: {', '.join(known)}, "
                "or several joined by '+'"
            )
    return parts


def _single(word: str, task: Task, options: RetrieverOptions) -> Retriever:
    name = word.removesuffix(ORIGINAL_QUERY)
    kind = next(k for k in RETRIEVER_KINDS.values() if name in k.names())  # _spec_words checked it
    built = kind.build(name, task, options)
    return OriginalQueryRetriever(built) if name != word else built

