"""The retriever registry: what each word of a retriever spec (``--retriever``) builds, and what
each kind of retriever declares.

``make_retriever(spec, task)`` splits ``spec`` at ``+``; one word is one retriever, several are
fused (:class:`~r2med_agent.retrieval.fusion.FusionRetriever`). Each word is built by the kind of
:data:`RETRIEVER_KINDS` whose ``names()`` list it (the kinds' names never overlap):

============ ============================================ ======= ========= ==========================
kind         names                                        combine has_model settings that apply
============ ============================================ ======= ========= ==========================
bm25         ``bm25``, ``bm25-compat`` (:data:`BM25_SPECS`) own     no        ``bm25_k1``, ``bm25_b``
dense        the encoder registry (``configs/encoders``    own     yes       ``exclude_identical_ids``
             ``.yaml`` and a user config's ``encoders:``)
candidates   NanoR2MED's shipped lists (``nano-bm25``, ...) fixed   no
hybrid       ``hakari-hybrid[-safeguard]``, rebuilt with    fixed   yes
             the ``harrier`` encoder
run-files    ``candidates``: TREC run files (``run         fixed   no
             --candidates``), reranked as given
encoders     :data:`ENCODERS`: encoders registered from Python   own     no
             or a plugin (``register("encoders", ...)``)
NAME         ``register("retrievers", NAME, kind)`` or    as registered
             :func:`register_retriever` (a plugin, Python)
============ ============================================ ======= ========= ==========================

Every kind declares how it combines a request's query with an LLM's expansion (``combine``):

- ``text``: the registry turns each request into its query text by the BM25 column of the query
  table (:func:`~r2med_agent.retrieval.query.bm25_query_text`) and the retriever searches that text
  (so a retriever of this kind cannot ignore an expansion);
- ``own``: the retriever applies the combine rules itself (BM25's reference variant, the dense
  retrievers' embedding mean; docs/protocol.md);
- ``fixed``: it holds one ranking per task query and answers nothing else; a method that writes
  queries cannot use it (refused before any work).

``has_model`` says whether it loads a neural model (``--precision`` and ``--encoder-backend``
apply); ``settings`` names the other run settings that apply to it. The run spec reads these
declarations to set settings that do not apply back to their defaults, never a retriever's name.

A new kind of retriever is one module (a class with ``name`` and ``search(requests, k)``, the
:class:`~r2med_agent.retrieval.base.Retriever` protocol) registered from your own package,
``register("retrievers", "mine", RetrieverKind(names, build, combine="text"))``
(:mod:`r2med_agent.plugins`; a built-in kind is one line in :data:`RETRIEVER_KINDS`), where ``names()`` lists its words and
``build(word, task, options)`` makes the retriever of one word over a task's corpus, reading what
it needs from the :class:`RetrieverOptions`. Modules are imported inside ``build``, so listing
the names stays cheap.

Options travel typed: :class:`RetrieverOptions` holds the dense encoders'
:class:`~r2med_agent.retrieval.dense.spec.EncoderOptions`, the
:class:`~r2med_agent.retrieval.bm25.retriever.BM25Options`, the
:class:`~r2med_agent.retrieval.fusion.FusionOptions` of '+'-joined specs and the
:class:`~r2med_agent.retrieval.run_files.RunFiles` of ``--candidates``. ``make_retriever`` also
takes them as keywords (``show_progress``, ``precision``, ``encoder_backend``, ``fusion``,
``rrf_k``, ``weights``, ...: :meth:`RetrieverOptions.from_keywords`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from r2med_agent.errors import ConfigError, did_you_mean
from r2med_agent.plugins import PluginError, Registry
from r2med_agent.retrieval.base import Retriever
from r2med_agent.retrieval.bm25.retriever import BM25Options
from r2med_agent.retrieval.dense.spec import EncoderOptions
from r2med_agent.retrieval.fusion import ORIGINAL_QUERY, FusionOptions, OriginalQueryRetriever
from r2med_agent.retrieval.run_files import RunFiles
from r2med_agent.types import Run, SearchRequest

if TYPE_CHECKING:  # pragma: no cover
    from r2med_agent.types import Task

__all__ = [
    "BM25_SPECS", "COMBINES", "ENCODERS", "RETRIEVER_KINDS", "RUN_FILES", "RetrieverKind", "RetrieverOptions", "make_retriever",
    "register_retriever", "retriever_kind", "retriever_names", "unregister_retriever",
]

BM25_SPECS = {"bm25": "lucene", "bm25-compat": "r2med-compat"}
"""Spec word -> BM25Retriever mode."""

RUN_FILES = "candidates"
"""The retriever word of first-stage TREC run files reranked as given (``run --candidates``)."""

Combine = Literal["text", "own", "fixed"]
COMBINES: tuple[str, ...] = ("text", "own", "fixed")
"""How a kind combines a request's query and expansion (see the module docstring)."""


@dataclass(frozen=True)
class RetrieverOptions:
    """Everything :func:`make_retriever` passes on, one typed group per kind of retriever."""

    encoder: EncoderOptions = field(default_factory=EncoderOptions)
    """Dense retrievers (and the dense member of ``hakari-hybrid``)."""
    bm25: BM25Options = field(default_factory=BM25Options)
    """BM25 retrievers."""
    fusion: FusionOptions | None = None
    """How a '+'-joined spec fuses (None: the defaults; set only for such a spec)."""
    run_files: RunFiles | None = None
    """The first-stage run files of the ``candidates`` word (``run --candidates``)."""
    kinds: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Kind name -> the non-default values of its declared ``options`` (the spec's ``kind_options``)."""
    own: Any = None
    """The building kind's ``options`` dataclass, filled from :attr:`kinds` (None: it declares none)."""

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
    """One kind of retriever: the spec words it answers to, how it builds one, and what it declares."""

    names: Callable[[], Iterable[str]]
    """The words of this kind, read on every call (registries can change within a process)."""
    build: Callable[[str, Task, RetrieverOptions], Retriever]
    """``build(word, task, options)``: the retriever ``word`` over ``task``'s corpus."""
    combine: Combine
    """How a request's query and expansion become what it searches: ``text``, ``own`` or ``fixed``
    (the module docstring). Required: a kind must say what it does with an LLM's expansion."""
    has_model: bool = False
    """It loads a neural model: ``--precision`` and ``--encoder-backend`` apply to it."""
    settings: tuple[str, ...] = ()
    """Other run-spec settings that apply to it (``bm25_k1``, ``bm25_b``, ``exclude_identical_ids``)."""
    encoders: Callable[[str], Sequence[str]] = lambda word: ()
    """The encoder registry entries a word loads (what ``reproduce --dry-run`` sizes)."""
    options: type | None = None
    """A dataclass of the kind's own settings, each field with a default and :func:`kind_option`
    metadata: ``run`` gets an option per field, a run that searches with the kind holds the values
    that differ from the defaults under ``kind_options[<kind name>]`` (its identity), and the
    builder reads the filled dataclass as ``options.own``."""

    def __post_init__(self) -> None:
        if self.combine not in COMBINES:
            raise ConfigError(f"a retriever kind's combine must be one of {', '.join(COMBINES)}, got {self.combine!r}")


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


def _shipped_names() -> list[str]:
    from r2med_agent.retrieval.candidates import SHIPPED

    return list(SHIPPED)


def _rebuilt_names() -> list[str]:
    from r2med_agent.retrieval.candidates import REBUILT

    return list(REBUILT)


def _build_candidates(word: str, task: Task, options: RetrieverOptions) -> Retriever:
    from r2med_agent.retrieval.candidates import make_candidate_retriever

    return make_candidate_retriever(word, task, options.encoder)


def _hybrid_encoders(word: str) -> list[str]:
    from r2med_agent.retrieval.candidates import DENSE_ENCODER

    return [DENSE_ENCODER]


def _build_run_files(word: str, task: Task, options: RetrieverOptions) -> Retriever:
    from r2med_agent.retrieval.run_files import CandidateRunRetriever

    files = options.run_files
    given = files.for_task(task.name) if files is not None else None
    if given is None:
        raise ConfigError(f"--retriever {RUN_FILES} is what --candidates PATH sets; give the run files"
                          + (f" (none for task {task.name})" if files is not None else ""))
    return CandidateRunRetriever.for_task(task, given, files.allow_missing)  # type: ignore[union-attr]


def _word_owner(word: str, but: str | None = None) -> str | None:
    """The kind (other than ``but``) whose names list ``word``, read without loading plugins."""
    return next((key for key, kind in RETRIEVER_KINDS.registered().items() if key != but and word in kind.names()), None)


def _check_word(name: str, but: str | None = None) -> None:
    if not name or "+" in name or "/" in name:
        raise PluginError(f"retriever name {name!r} must be non-empty, without '+' or '/'")
    owner = _word_owner(name, but)
    if owner is not None:
        raise PluginError(f"retriever name '{name}' is taken by the registry (kind {owner}); choose another")


def _check_kind(registry: Registry[RetrieverKind], key: str, kind: RetrieverKind) -> RetrieverKind:
    if not isinstance(kind, RetrieverKind):
        raise PluginError(f"retriever kind '{key}' must be a RetrieverKind, got {type(kind).__name__}")
    if kind.options is not None and (not is_dataclass(kind.options) or any(
            f.default is MISSING and f.default_factory is MISSING for f in fields(kind.options))):
        raise PluginError(f"retriever kind '{key}': options must be a dataclass whose every field has a default")
    for word in kind.names():
        _check_word(word, but=key)
    return kind


def _check_encoder(registry: Registry[Callable[[], Any]], name: str, factory: Callable[[], Any]) -> Callable[[], Any]:
    if not callable(factory):
        raise PluginError(f"encoder '{name}' must be a function of no arguments returning an encoder, got {factory!r}")
    _check_word(name, but="encoders")
    return factory


ENCODERS: Registry[Callable[[], Any]] = Registry("encoders", prepare=_check_encoder)
"""Encoder name -> a function of no arguments that returns the encoder (an object with ``spec`` and
``encode(texts, side=, prefix=, titles=)``, :class:`~r2med_agent.retrieval.dense.spec.Encoder`);
each name is a ``--retriever`` word, a dense retriever over that encoder (its embeddings are not
cached: the registry cannot tell when its weights change)."""


def _build_registered_encoder(word: str, task: Task, options: RetrieverOptions) -> Retriever:
    from r2med_agent.retrieval.dense.index import DenseRetriever

    encoder_options = EncoderOptions(use_cache=False, show_progress=options.encoder.show_progress)
    return DenseRetriever.for_task(task, ENCODERS[word](), encoder_options)


RETRIEVER_KINDS: Registry[RetrieverKind] = Registry("retrievers", {
    "bm25": RetrieverKind(lambda: list(BM25_SPECS), _build_bm25, combine="own", settings=("bm25_k1", "bm25_b")),
    "dense": RetrieverKind(_encoder_names, _build_dense, combine="own", has_model=True,
                           settings=("exclude_identical_ids",), encoders=lambda word: [word]),
    "candidates": RetrieverKind(_shipped_names, _build_candidates, combine="fixed"),
    "hybrid": RetrieverKind(_rebuilt_names, _build_candidates, combine="fixed", has_model=True,
                            encoders=_hybrid_encoders),
    "run-files": RetrieverKind(lambda: [RUN_FILES], _build_run_files, combine="fixed"),
    "encoders": RetrieverKind(lambda: list(ENCODERS), _build_registered_encoder, combine="own"),
}.items(), _check_kind)
"""Kind -> its names, builder and declarations, in the order :func:`retriever_names` lists them;
``register("retrievers", ...)`` and :func:`register_retriever` add kinds."""


def retriever_names() -> list[str]:
    """Every single-retriever spec word, kind by kind: the BM25 variants, the encoder registry's
    names, NanoR2MED's candidate rankings and the retrievers registered from Python."""
    return [name for kind in RETRIEVER_KINDS.values() for name in kind.names()]


def retriever_kind(word: str) -> RetrieverKind | None:
    """The kind whose names list ``word`` (a ``:query`` suffix is ignored); None: unknown."""
    name = word.strip().removesuffix(ORIGINAL_QUERY)
    return next((k for k in RETRIEVER_KINDS.values() if name in k.names()), None)


def register_retriever(name: str, factory: Callable[[Task], Retriever], *, combine: Combine = "text",
                       has_model: bool = False, settings: Sequence[str] = ("exclude_identical_ids",)) -> None:
    """Make ``name`` a retriever spec word in this process: ``factory(task)`` builds it for a
    task (the Python API's own encoders and retrievers go through this). A name of another kind
    (bm25, an encoder, a candidate list) cannot be taken.

    Args:
        name: the spec word.
        factory: builds the retriever over a task.
        combine: how it takes an LLM's expansion (the module docstring): ``text`` (default: it
            searches the query text the BM25 column of the query table gives), ``own`` (it
            reads each request's ``combine`` rule itself) or ``fixed``.
        has_model: ``--precision`` and ``--encoder-backend`` change what it does.
        settings: other run settings that apply to it.
    """
    RETRIEVER_KINDS.register(name, RetrieverKind(
        lambda: [name], lambda word, task, options: factory(task), combine=combine, has_model=has_model,
        settings=tuple(settings)), replace=True)


def unregister_retriever(name: str) -> None:
    """Forget a name of :func:`register_retriever` (nothing happens for an unknown or a built-in name)."""
    if RETRIEVER_KINDS.origin(name) not in (None, "built in"):
        del RETRIEVER_KINDS[name]


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


def kind_option(text: str, *flags: str) -> dict[str, Any]:
    """The metadata of a field of a retriever kind's ``options`` dataclass: its ``run --help``
    text and option names (default: ``--<kind>-<field>``, dashes for underscores)."""
    return {"help": text, "flags": flags}


def kind_option_fields() -> list[tuple[str, Any, tuple[str, ...], Any]]:
    """``(kind name, field, option names, type)`` of every field the registered kinds' ``options`` declare."""
    from typing import get_type_hints

    return [(name, f, f.metadata.get("flags") or (f"--{name}-{f.name}".replace("_", "-"),),
             get_type_hints(kind.options)[f.name])
            for name, kind in RETRIEVER_KINDS.items() if kind.options is not None for f in fields(kind.options)]


def kind_name(kind: RetrieverKind) -> str:
    """The name ``kind`` is registered under."""
    return next(name for name, known in RETRIEVER_KINDS.items() if known is kind)


def kind_options(name: str, values: Mapping[str, Any]) -> Any:
    """Kind ``name``'s ``options`` dataclass filled with ``values`` (its own checks run).

    Raises:
        ConfigError: ``name`` declares no options, or ``values`` names a field it lacks.
    """
    kind = RETRIEVER_KINDS.get(name)
    if kind is None or kind.options is None:
        raise ConfigError(f"retriever kind '{name}' declares no options")
    known = [f.name for f in fields(kind.options)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"retriever kind '{name}' has no option {', '.join(unknown)}; allowed: {', '.join(known)}")
    return kind.options(**values)


def non_default_options(options: Any) -> dict[str, Any]:
    """The fields of a kind's filled ``options`` dataclass that differ from its defaults."""
    default = type(options)()
    return {f.name: getattr(options, f.name) for f in fields(options) if getattr(options, f.name) != getattr(default, f.name)}


def _single(word: str, task: Task, options: RetrieverOptions) -> Retriever:
    name = word.removesuffix(ORIGINAL_QUERY)
    kind = retriever_kind(name)  # _spec_words checked it is known
    if kind.options is not None:  # type: ignore[union-attr]
        own = kind_name(kind)  # type: ignore[arg-type]
        options = replace(options, own=kind_options(own, options.kinds.get(own, {})))
    built = kind.build(name, task, options)  # type: ignore[union-attr]
    if kind.combine == "text":  # type: ignore[union-attr]
        built = TextQueryRetriever(built)
    return OriginalQueryRetriever(built) if name != word else built


class TextQueryRetriever:
    """A retriever of a ``text`` kind, given each request as its query text (the BM25 column of
    the query table): what it searches always holds the expansion its rule asks for."""

    def __init__(self, inner: Retriever) -> None:
        self.inner = inner
        self.name = inner.name

    def search(self, requests: Sequence[SearchRequest], k: int) -> Run:
        from r2med_agent.retrieval.query import bm25_query_text

        return self.inner.search([SearchRequest(r.query_id, bm25_query_text(r)) for r in requests], k)
