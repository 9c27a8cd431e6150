"""The run spec: every setting that can change a result, typed, documented, and nothing else.

A :class:`RunSpec` is the identity of a run. Everything that names, files, labels or checks a run
is derived from it and from nothing else:

- :meth:`RunSpec.key` is a canonical text (compact JSON of the settings that differ from their
  defaults); :meth:`RunSpec.from_key` reads it back, and :meth:`RunSpec.record` /
  :meth:`RunSpec.from_record` do the same with the dict written into every result file;
- :meth:`RunSpec.digest` is a short hash of the key; :meth:`RunSpec.folder` is the result folder
  relative to the output root, ``<method>/<llm>/<retriever>[__<tokens>][__<reranker>][__<digest>]``,
  whose tokens show the non-default settings (``t0.9``, ``mt24``, ``k10``, ``bfloat16``, ...) and
  whose digest covers all of them, so two specs that differ in any setting never share a folder;
- :meth:`RunSpec.settings` lists the non-default settings beyond method, LLM, retriever and
  reranker; ``compare`` labels its rows with them;
- the CLI's help text and the Python API's keyword documentation come from :func:`field_help`.

Settings that cannot change a result (the tasks, where the data and caches live, progress bars,
chunking of LLM calls, which metrics are printed) are not part of the spec: they belong to
:class:`~r2med_agent.runner.RunConfig`, which extends the spec with them. A spec is normalised
when it is made: a setting that does not apply (``rerank_k`` without a reranker, ``final`` for a
method that has no final-fuse mode, a loop retriever equal to the retriever) is set back to its
default, so it neither splits nor merges folders.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from r2med_agent.errors import ConfigError

DEFAULT_TOP_K = 100
"""R2MED's depth: the top 100 documents per query are kept and scored."""

FINAL_MODES = ("default", "fuse")
GENERATION_SOURCES = ("fresh", "r2med", "bright")
RELEASED_SOURCES = ("r2med", "bright")
"""Generations read from a benchmark's release instead of made by an LLM: R2MED's
(``<method>/<llm>/query_with_hydoc.jsonl``) and BRIGHT's reasoning queries (``<llm>_reason``)."""
EMPTY_GENERATION = ("query", "keep")
"""What an empty generated text becomes: the plain query (``query``) or itself (``keep``, R2MED)."""
LLM_PROMPTS = ("chat", "rendered")
"""How a prompt reaches a vLLM engine: ``LLM.chat`` (``chat``) or the chat template rendered to a
string and given to ``LLM.generate`` (``rendered``, R2MED's generation script)."""

FLOAT_SAMPLING = ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                  "min_p")
INT_SAMPLING = ("max_tokens", "top_k")
"""Sampling overrides coerced to one type, so 1 and 1.0 are the same setting."""

BM25_NAMES = frozenset({"bm25", "bm25-compat"})
"""The BM25 retrievers (k1 and b apply to them)."""

CANDIDATES = "candidates"
"""The retriever of a run over given first-stage run files (``run --candidates``)."""

LOOP_RULES = 2
"""The version of the agentic loops' behaviour this code runs: 1 before Search-R1 and Search-o1
followed their originals' code (docs/protocol.md), 2 since. Records of agentic runs that lack the
setting were written by version 1 (:meth:`RunSpec.from_record`)."""

RERANK_RULES = 2
"""The version of the published LLM rerankers' behaviour this code runs (GroupRank's, ReasonRank's,
Rank-R1's and Rank1's entries, the ``groupwise``/``setwise`` kinds and the ``reasonrank``/``rank1``
formats): 1 before they followed their authors' code (docs/protocol.md, "Rerankers as their
authors ran them"), 2 since. Records of such runs that lack the setting were written by version 1
(:meth:`RunSpec.from_record`)."""

NO_MODEL = BM25_NAMES | {CANDIDATES}
"""Retrievers with no neural model: precision and encoder backend do not apply to them."""

NAMED_FIELDS = ("method", "llm", "generations", "retriever", "fusion", "rrf_k", "fusion_weights", "reranker")
"""Settings shown by the folder path itself (method, LLM, retriever with its fusion, reranker)."""


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class RunSpec:
    """Every setting that can change a run's result.

    Attributes:
        method: ``none`` (the plain query) or a registered method (``r2med-agent`` lists them).
        llm: LLM registry name; needed by every method but ``none``.
        generations: ``fresh`` or ``r2med`` (R2MED's released generations; no LLM runs).
        sampling: overrides of the LLM's default sampling (``temperature``, ``top_p``,
            ``max_tokens``, ``seed`` (None: send no seed), ``repetition_penalty``, ...).
        samples: generations per query (methods that support samples).
        prompts: hash of the prompt templates in use when they are not the shipped ones.
        prompts_from: ``own`` (the project's wording) or the authors' sources the run renders,
            ``owner/repo@<12 hex>`` joined by ``+`` (:mod:`r2med_agent.prompt_sources`); given as
            ``authors``, or None for the run's default (:func:`~r2med_agent.prompt_sources.natural`).
        first_pass: the first-pass retriever of methods that show a first pass in their prompt.
        retriever: ``bm25``, ``bm25-compat``, an encoder name, or a '+'-joined fusion
            (``candidates`` when ``candidates`` is set).
        candidates: hash of the first-stage run files reranked as given (``run --candidates``).
        fusion, rrf_k, fusion_weights: how a '+'-joined retriever fuses its members.
        bm25_k1, bm25_b: BM25's parameters for every BM25 retriever of the run (None: 0.9, 0.4).
        loop_retriever: what the agentic loops search while they reason (None: ``retriever``).
        final: agentic final ranking, ``default`` or ``fuse``.
        precision: numeric precision of the run's encoders and reranker on a GPU.
        encoder_backend: engine of the local dense encoders (None: each entry's own).
        top_k: documents kept per query and the depth they are scored at.
        reranker: reranker registry name.
        rerank_k: how many top documents the reranker re-scores.
        rerank_cut: keep only the ``rerank_k`` reranked documents per query.
        exclude_identical_ids: drop a document whose id is the query's id from the final ranking
            (BEIR's exact search, which R2MED's dense evaluation ran).
        empty_generation: what an empty generated text becomes, ``query`` or ``keep``.
        llm_prompt: how a prompt reaches a vLLM engine, ``chat`` or ``rendered``.
        rerank_max_length: tokens of a cross-encoder's (query, document) input (None: the entry's).
        loop_rules: the version of the agentic loops' behaviour (:data:`LOOP_RULES`); only the
            current one runs, an earlier one names results an earlier version made.
        rerank_rules: the version of the published LLM rerankers' behaviour
            (:data:`RERANK_RULES`); as ``loop_rules``.
    """

    method: str = field(default="none", metadata=_help(
        "{methods} (the method registry; any case: HyDE works)."))
    llm: str | None = field(default=None, metadata=_help(
        "LLM registry name (see `r2med-agent llms`), e.g. qwen-32b, gpt4, or the offline default smollm2."))
    generations: str = field(default="fresh", metadata=_help(
        "fresh: generate with --llm (through the cache). r2med: score R2MED's released generations of "
        "--method/--llm (<Task>/<method>/<llm>/query_with_hydoc.jsonl from the hub at the task's pinned "
        "revision, from --data-dir, or from a packaged task); no LLM is built. Results go to "
        "<method>/<llm>@r2med/. bright: score BRIGHT's released reasoning queries of --llm (gpt4, "
        "claude-3-opus, llama3-70b, Gemini-1.0, grit: its <llm>_reason configuration, from the hub at the "
        "task's pinned revision or from --data-dir) on a BRIGHT task, with --method reason; no LLM is built. "
        "Results go to <method>/<llm>@bright/."))
    sampling: Mapping[str, Any] = field(default_factory=dict, metadata=_help(
        "Overrides of the LLM's default sampling (temperature, top_p, max_tokens, seed, ...)."))
    samples: int = field(default=1, metadata=_help(
        "Generations per query for hyde, query2doc and lamer (vLLM/OpenAI n): dense retrieval searches "
        "with the mean of the query's and the samples' embeddings, BM25 with the samples joined."))
    prompts: str | None = field(default=None, metadata=_help(
        "Hash of the prompt templates in use when they are not the shipped ones ($R2MED_PROMPTS_DIR)."))
    prompts_from: str | None = field(default="own", metadata=_help(
        "Whose prompt wording the run renders: authors (the authors' own prompts, fetched once from their "
        "repository at the commit configs/pinned/prompt_sources.yaml pins: R2MED's HyDE/Query2Doc/LameR, Search-R1, "
        "Search-o1, ReasonRank, Rank1, GroupRank, Rank-R1) or own (the project's wording, with "
        "$R2MED_PROMPTS_DIR over it). Default: authors, unless the LLM that reads the prompt is the local smoke "
        "model (smollm2). Recorded as the repositories and commits used, e.g. R2MED/R2MED@62b707460040."))
    first_pass: str = field(default="bm25", metadata=_help(
        "LameR's first-pass retriever, whose top 10 the prompt shows: bm25 (default), bm25-compat (the "
        "reference's gensim BM25, what the paper's LameR rows read) or an encoder name."))
    retriever: str = field(default="bm25", metadata=_help(
        "bm25 | bm25-compat (R2MED's gensim scoring) | an encoder name (minilm, bge, nv, harrier, ...) | a "
        "'+'-joined fusion such as bm25+minilm | on NanoR2MED splits, the candidate lists they ship: "
        "nano-bm25, nano-dense, nano-hybrid[-safeguard], or hakari-hybrid[-safeguard] (the hybrid list "
        "rebuilt from nano-bm25 and harrier)."))
    candidates: str | None = field(default=None, metadata=_help(
        "Hash of the first-stage run files the run reranks as given (--candidates), which replace "
        "--retriever; None: the retriever searches."))
    fusion: str = field(default="rrf", metadata=_help(
        "How a '+'-joined --retriever fuses its members: rrf (reciprocal rank fusion) or weighted "
        "(weighted sum of per-query min-max normalised scores)."))
    rrf_k: int = field(default=60, metadata=_help(
        "The RRF constant k for --fusion rrf (score = sum of 1/(k + rank))."))
    fusion_weights: tuple[float, ...] | None = field(default=None, metadata=_help(
        "Comma-separated weights, one per '+'-joined retriever, for --fusion weighted (default: all 1), "
        "e.g. 0.3,0.7."))
    bm25_k1: float | None = field(default=None, metadata=_help(
        "BM25's k1 (term-frequency saturation) for every BM25 retriever of the run, bm25 and "
        "bm25-compat alike. Default: 0.9, as R2MED (and pyserini) run BM25."))
    bm25_b: float | None = field(default=None, metadata=_help(
        "BM25's b (document-length normalisation, 0 to 1) for every BM25 retriever of the run. "
        "Default: 0.4, as R2MED (and pyserini) run BM25."))
    loop_retriever: str | None = field(default=None, metadata=_help(
        "Retriever that Search-R1/Search-o1 query while they reason (default: --retriever; the final "
        "ranking uses --retriever)."))
    final: str = field(default="default", metadata=_help(
        "Agentic final ranking: 'default' (final response as the query, as R2MED) or 'fuse' (RRF of the "
        "searches the loop ran for the trajectory, each distinct query once, plus the final query; "
        "queries answered with a notice or issued in Search-R1's final turn were not run and are left "
        "out). Both rank with --retriever."))
    precision: str | None = field(default=None, metadata=_help(
        "Numeric precision of the run's encoders and reranker on a GPU: float32, float16, bfloat16, "
        "autocast-float16 (float32 weights, fp16 autocast) or auto (bf16 where supported, else fp16; the "
        "fastest). Default: each model's registry precision, the one R2MED's reference ran it at. On a "
        "CPU everything runs in float32."))
    encoder_backend: str | None = field(default=None, metadata=_help(
        "Engine of the local dense encoders: transformers | vllm (vLLM's pooling engine, same vectors) | "
        "auto (vLLM when installed with a GPU and the encoder's pooling is supported, else "
        "transformers). Default: each encoder entry's 'backend'."))
    top_k: int = field(default=DEFAULT_TOP_K, metadata=_help(
        "Documents kept per query and the depth they are scored at (R2MED: 100); metrics cut off beyond "
        "it are left out."))
    reranker: str | None = field(default=None, metadata=_help(
        "Reranker registry name (`r2med-agent rerankers` or --reranker list shows them): a cross-encoder "
        "(kind cross-encoder: bge-reranker, monobert, rankllama) or an LLM reranker of kind listwise "
        "(qwen3-32b-listwise, reasonrank-7b), pointwise-reasoning (r1-qwen-32b-pointwise, rank1-7b), "
        "groupwise (grouprank-32b) or setwise (rank-r1-14b); add your own under 'rerankers:' in a --config file."))
    rerank_k: int = field(default=100, metadata=_help(
        "How many top documents the reranker re-scores (the paper uses 10 or 100)."))
    rerank_cut: bool = field(default=False, metadata=_help(
        "Keep only the --rerank-k reranked documents per query, as R2MED's reranker runs did "
        "(NV-Embed-v2's top 10 reranked and kept); scored at --top-k all the same."))
    fusion_depth: tuple[int, ...] | None = field(default=None, metadata=_help(
        "How deep each member of a '+'-joined --retriever searches before the fusion: one number for "
        "all or one per member, e.g. 1000,200, each at least --top-k (default: --top-k). Deeper member "
        "lists let the fusion lift a document one member ranks low."))
    entries: str | None = field(default=None, metadata=_help(
        "Hash of the registry entries the run uses that come from a user config (LLMs, encoders, "
        "rerankers of the same name as a shipped one, or your own); None: every entry it uses is shipped."))
    exclude_identical_ids: bool = field(default=False, metadata=_help(
        "Drop a document whose id equals the query's id from the final ranking (the next one moves up), as "
        "BEIR's exact search does in R2MED's dense evaluation; each task's result counts the hits removed. "
        "Applies to runs with a dense retriever."))
    empty_generation: str = field(default="query", metadata=_help(
        "What an empty generated text becomes: query (search with the plain query instead) or keep (use it as "
        "it is, as R2MED's scripts did: BM25 ranks with an empty query, dense retrieval averages in the "
        "embedding of ''). Each task's result counts its empty generations either way."))
    llm_prompt: str = field(default="chat", metadata=_help(
        "How a prompt reaches a vLLM engine: chat (LLM.chat) or rendered (the chat template rendered to a "
        "string and given to LLM.generate, as R2MED's generation script did; tokenizers that add a BOS, such "
        "as Llama-3.1's and the DeepSeek-R1 distills', then send it twice). Applies to fresh generations of "
        "vllm entries."))
    rerank_max_length: int | None = field(default=None, metadata=_help(
        "Tokens of a cross-encoder reranker's (query, document) input, longest part cut first (default: the "
        "entry's max_length; rankllama 1024, the value of the script that produced R2MED's RankLLaMA rows, "
        "while the released eval_reranker.py would give it 512)."))
    loop_rules: int = field(default=LOOP_RULES, metadata=_help(
        "Version of the Search-R1/Search-o1 loop behaviour: 2 follows the originals' code (this version "
        "runs only it); 1 names fresh agentic results of earlier versions, made before that change."))
    rerank_rules: int = field(default=RERANK_RULES, metadata=_help(
        "Version of the published LLM rerankers' behaviour (GroupRank, ReasonRank, Rank-R1, Rank1): 2 follows "
        "their authors' code (this version runs only it); 1 names results of earlier versions, made before."))

    def __post_init__(self) -> None:
        _check_choices(self)  # a misspelt value is an error even where the setting plays no part
        _normalise(self)
        _validate(self)

    # -- identity ---------------------------------------------------------------------------

    def non_default(self) -> dict[str, Any]:
        """The settings that differ from their defaults, JSON-ready (tuples as lists)."""
        out: dict[str, Any] = {}
        for f in fields(RunSpec):
            value = getattr(self, f.name)
            default = f.default_factory() if f.default_factory is not MISSING else f.default  # type: ignore[misc]
            if _plain(value) != _plain(default):
                out[f.name] = _plain(value)
        return out

    def key(self) -> str:
        """The canonical text of this spec: compact JSON of its non-default settings, keys sorted.
        Equal specs have equal keys; :meth:`from_key` reads it back."""
        return json.dumps(self.non_default(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)

    @classmethod
    def from_key(cls, key: str) -> RunSpec:
        """The spec whose :meth:`key` is ``key``."""
        try:
            data = json.loads(key)
        except json.JSONDecodeError as e:
            raise ConfigError(f"not a run spec key: {key!r} ({e.msg})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"not a run spec key: {key!r}")
        return cls.from_record({"loop_rules": LOOP_RULES, "rerank_rules": RERANK_RULES, **data})  # a key leaves defaults out

    def digest(self) -> str:
        """Eight hex digits of SHA-256 over :meth:`key`: stable across runs, machines, versions."""
        return hashlib.sha256(self.key().encode("utf-8")).hexdigest()[:8]

    def record(self) -> dict[str, Any]:
        """Every setting, JSON-ready, as written into result files (no secrets: names only)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(RunSpec)}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> RunSpec:
        """The spec of a recorded config: this version's :meth:`record`, or the ``config`` block an
        earlier version wrote (keys that are not settings are ignored; a setting an earlier version
        did not record has its default, which is what such runs did; only the loops changed since:
        a record without ``loop_rules`` is of version 1's loops)."""
        names = {f.name for f in fields(RunSpec)}
        kwargs = {k: v for k, v in record.items() if k in names}
        for key in ("fusion_weights", "fusion_depth"):
            if kwargs.get(key) is not None:
                kwargs[key] = tuple(kwargs[key])
        if kwargs.get("sampling") is None:
            kwargs.pop("sampling", None)
        for key in ("rerank_k", "top_k", "samples", "rrf_k"):
            if kwargs.get(key) is None:
                kwargs.pop(key, None)
        for key, default in (("generations", "fresh"), ("first_pass", "bm25"), ("final", "default"),
                             ("fusion", "rrf"), ("retriever", "bm25"), ("method", "none")):
            if kwargs.get(key) is None:
                kwargs[key] = default
        if kwargs["generations"] in RELEASED_SOURCES:
            kwargs.pop("sampling", None)  # earlier versions recorded overrides that played no part
        kwargs.setdefault("loop_rules", 1)  # every record of this version has it; set back where no loop ran
        kwargs.setdefault("prompts_from", "own")  # earlier versions rendered the project's wording
        kwargs.setdefault("rerank_rules", 1)  # the same; set back where no published LLM reranker ran
        return cls(**kwargs)

    def applicable(self) -> list[str]:
        """The settings that play a part in this spec's run (a released generation has no
        sampling, prompts or first pass; a run without a reranker no rerank depth; a method
        without a loop no loop retriever or final mode)."""
        from r2med_agent.methods import METHODS

        caps = capabilities(METHODS[self.method])
        skip = set()
        if self.generations in RELEASED_SOURCES:
            skip |= {"sampling", "prompts", "first_pass"}
            if not self.reranker:
                skip.add("prompts_from")
        if not caps.needs_first_pass:
            skip.add("first_pass")
        if not self.reranker:
            skip |= {"rerank_k", "rerank_cut"}
        if not caps.agentic:
            skip |= {"loop_retriever", "final", "loop_rules"}
        if not _published_llm_reranker(self.reranker):
            skip.add("rerank_rules")
        return [f.name for f in fields(RunSpec) if f.name not in skip]

    def spec(self) -> RunSpec:
        """The spec part alone (for a :class:`RunConfig`, its identity without run options)."""
        return RunSpec(**{f.name: getattr(self, f.name) for f in fields(RunSpec)})

    # -- names derived from the spec -----------------------------------------------------------

    @property
    def llm_label(self) -> str:
        """The LLM part of the folder: its name, ``<name>@r2med`` or ``<name>@bright`` for released
        generations."""
        if self.method == "none" or not self.llm:
            return "none"
        if self.generations in RELEASED_SOURCES:
            from r2med_agent.data.released import released_label

            return released_label(self.llm, self.generations)
        return self.llm

    @property
    def retriever_name(self) -> str:
        """The retriever with its fusion settings (``bm25+minilm-weighted-0.3-0.7``)."""
        if "+" not in self.retriever:
            return self.retriever
        from r2med_agent.retrieval.fusion import fusion_label

        return fusion_label(self.retriever, self.fusion, self.rrf_k, self.fusion_weights)

    def settings(self) -> dict[str, Any]:
        """Non-default settings beyond the ones the folder path names (method, LLM, generations,
        retriever and fusion, reranker), in field order: what tells apart two runs of the same
        configuration (``{"sampling.temperature": 0.9, "top_k": 10}``)."""
        out: dict[str, Any] = {}
        for name, value in self.non_default().items():
            if name in NAMED_FIELDS:
                continue
            if name == "sampling":
                out.update({f"sampling.{k}": v for k, v in sorted(value.items())})
            else:
                out[name] = value
        return out

    def tokens(self) -> list[str]:
        """Short, file-name-safe words for :meth:`settings` (``t0.9``, ``mt24``, ``k10``)."""
        out = []
        for name, value in self.settings().items():
            maker = _TOKENS.get(name)
            if maker is None and name.startswith("sampling."):
                text = f"{name[len('sampling.'):]}{_fmt(value)}"
            else:
                text = maker(value, self) if maker is not None else f"{name}-{_fmt(value)}"
            if text:
                out.append(_safe(text))
        return out

    @property
    def leaf(self) -> str:
        """The result folder's last part: ``<retriever>[__<tokens>][__<reranker>][__<digest>]``;
        the digest is there whenever any setting beyond the named ones differs from its default,
        or the name had to be cut at 150 characters."""
        parts = [_safe(self.retriever_name)]
        tokens = self.tokens()
        parts += tokens
        if self.reranker:
            parts.append(_safe(self.reranker))
        name = "__".join(parts)
        cut = len(name) > 150  # long fusion weights: the digest keeps a cut name unique
        if cut:
            name = name[:150].rstrip("_")
        if cut or self.settings():
            name += f"__{self.digest()}"
        return name

    def folder(self) -> str:
        """The result folder relative to the output root: ``<method>/<llm>/<leaf>``."""
        return f"{self.method}/{self.llm_label}/{self.leaf}"

    @property
    def label(self) -> str:
        """``method/llm/retriever[/reranker]`` then the other non-default settings in brackets."""
        base = "/".join([self.method, self.llm_label, self.retriever_name] + ([self.reranker] if self.reranker else []))
        extra = self.settings_label
        return f"{base} [{extra}]" if extra else base

    @property
    def settings_label(self) -> str:
        """:meth:`settings` as ``name=value`` pairs (``sampling.temperature=0.9, top_k=10``)."""
        return ", ".join(f"{k}={_fmt(v)}" for k, v in self.settings().items())


def field_help(name: str) -> str:
    """The documented help of a spec field: the CLI option's ``--help`` and the API's keyword
    docs (the method's names come from the method registry)."""
    for f in fields(RunSpec):
        if f.name == name:
            text = f.metadata["help"]
            if "{methods}" in text:
                from r2med_agent.methods import METHODS

                text = text.replace("{methods}", " | ".join(METHODS))
            return text
    raise KeyError(name)


def _plain(value: Any) -> Any:
    """JSON-ready form: tuples as lists, mappings as sorted dicts."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in sorted(value.items())}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _fmt(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "-".join(_fmt(v) for v in value)
    return str(value)


_UNSAFE = re.compile(r"[^A-Za-z0-9._+@=-]+")


def _safe(text: str) -> str:
    """A folder-name-safe form of ``text`` (other characters become '-')."""
    return _UNSAFE.sub("-", text).strip("-") or "-"


def _prompts_token(value: Any) -> str:
    from r2med_agent.prompt_sources import label_token

    return label_token(str(value))


def _rerank_k_token(value: Any, spec: RunSpec) -> str:
    return f"top{value}" if spec.rerank_cut else f"rk{value}"


_TOKENS: dict[str, Any] = {
    "sampling.temperature": lambda v, s: f"t{_fmt(v)}",
    "sampling.top_p": lambda v, s: f"p{_fmt(v)}",
    "sampling.max_tokens": lambda v, s: f"mt{v}",
    "sampling.seed": lambda v, s: f"seed{_fmt(v)}",
    "samples": lambda v, s: f"n{v}",
    "prompts": lambda v, s: f"prompts-{str(v)[:6]}",
    "prompts_from": lambda v, s: _prompts_token(v),
    "candidates": lambda v, s: f"cand-{str(v)[:8]}",
    "first_pass": lambda v, s: f"fp-{v}",
    "bm25_k1": lambda v, s: f"k1-{_fmt(v)}",
    "bm25_b": lambda v, s: f"b{_fmt(v)}",
    "loop_retriever": lambda v, s: f"loop-{v}",
    "final": lambda v, s: str(v),
    "precision": lambda v, s: str(v),
    "encoder_backend": lambda v, s: f"eb-{v}",
    "top_k": lambda v, s: f"k{v}",
    "rerank_k": _rerank_k_token,
    # rerank_cut shows through rerank_k's token (top<k>); with the default depth it is its own.
    "rerank_cut": lambda v, s: "" if s.rerank_k != 100 else "top100",
    "fusion_depth": lambda v, s: "fd" + "-".join(str(d) for d in v),
    "entries": lambda v, s: f"entries-{str(v)[:6]}",
    "exclude_identical_ids": lambda v, s: "noself",
    "empty_generation": lambda v, s: f"empty-{v}",
    "llm_prompt": lambda v, s: f"prompt-{v}",
    "rerank_max_length": lambda v, s: f"rml{v}",
    "loop_rules": lambda v, s: f"loops-v{v}",
    "rerank_rules": lambda v, s: f"rerank-v{v}",
}


# -- normalising and validating ----------------------------------------------------------------


def _set(spec: RunSpec, name: str, value: Any) -> None:
    object.__setattr__(spec, name, value)


def _normalise(spec: RunSpec) -> None:
    """Canonical forms, and settings that do not apply set back to their defaults."""
    from r2med_agent.methods import get_method, method_name

    method_cls = get_method(spec.method)  # an unknown name fails here, before any work
    _set(spec, "method", method_name(spec.method))
    caps = capabilities(method_cls)
    _set(spec, "sampling", _canonical_sampling(spec.sampling))
    if spec.fusion_weights is not None:
        _set(spec, "fusion_weights", tuple(float(w) for w in spec.fusion_weights))
    _normalise_fusion_depth(spec)
    if not caps.agentic or spec.loop_retriever == spec.retriever:
        _set(spec, "loop_retriever", None)
    if not caps.agentic or spec.generations in RELEASED_SOURCES:
        _set(spec, "loop_rules", LOOP_RULES)  # no loop ran
    if not caps.final_fuse and spec.final in FINAL_MODES:
        _set(spec, "final", "default")
    if caps.needs_first_pass and spec.generations in RELEASED_SOURCES:
        _set(spec, "first_pass", "bm25")  # the released generations already hold their first pass
    if not spec.reranker:
        _set(spec, "reranker", None)
        _set(spec, "rerank_k", 100)
    if not _published_llm_reranker(spec.reranker):
        _set(spec, "rerank_rules", RERANK_RULES)  # no published LLM reranker ran
    if spec.method == "none" or spec.generations in RELEASED_SOURCES:
        _set(spec, "prompts", None)
    for name, default in (("bm25_k1", 0.9), ("bm25_b", 0.4)):
        value = getattr(spec, name)
        _set(spec, name, None if value is None or float(value) == default else float(value))
    if spec.candidates is not None and spec.retriever in ("bm25", CANDIDATES):
        _set(spec, "retriever", CANDIDATES)  # the files are the first stage
    from r2med_agent.retrieval.fusion import member_names

    models = [m for p in (spec.retriever, spec.loop_retriever or "") for m in member_names(p)]
    searched = models + ([spec.first_pass] if capabilities(method_cls).needs_first_pass else [])
    if not any(m in BM25_NAMES for m in searched):
        _set(spec, "bm25_k1", None)
        _set(spec, "bm25_b", None)
    if not spec.reranker and all(m in NO_MODEL for m in models):
        _set(spec, "precision", None)
        _set(spec, "encoder_backend", None)
    _normalise_reference_options(spec, caps)
    _normalise_prompts_from(spec)


def _normalise_prompts_from(spec: RunSpec) -> None:
    """``authors`` (or None, the run's default) becomes the sources the run renders; a run that
    renders none of them renders its own wording (r2med_agent.prompt_sources.resolve)."""
    from r2med_agent.prompt_sources import resolve

    _set(spec, "prompts_from", resolve(spec.prompts_from, spec.method, spec.llm, spec.generations, spec.reranker))


def _normalise_reference_options(spec: RunSpec, caps: Capabilities) -> None:
    """The options that follow R2MED's scripts, set back where they do not apply: the identical-id
    exclusion without a dense retriever, the empty-generation policy without an LLM, the prompt
    path without fresh generations of a vLLM entry."""
    from r2med_agent.retrieval.candidates import candidate_names

    fixed = NO_MODEL | set(candidate_names())
    if all(p.strip() in fixed for p in spec.retriever.split("+")):
        _set(spec, "exclude_identical_ids", False)
    if not caps.uses_llm:
        _set(spec, "empty_generation", "query")
    if not caps.uses_llm or spec.generations in RELEASED_SOURCES or _llm_backend(spec.llm) not in (None, "vllm"):
        _set(spec, "llm_prompt", "chat")
    if spec.rerank_max_length is not None:
        _set(spec, "rerank_max_length", int(spec.rerank_max_length))
        if _entry_max_length(spec.reranker) in (None, spec.rerank_max_length):
            _set(spec, "rerank_max_length", None)


def _entry_max_length(reranker: str | None) -> int | None:
    """The ``max_length`` of a reranker entry whose kind has a model (None: no reranker, a kind
    without a model, or an entry that cannot be looked up)."""
    if not reranker:
        return None
    from r2med_agent.retrieval.rerank.spec import get_reranker_spec

    try:
        entry = get_reranker_spec(reranker)
    except Exception:  # noqa: BLE001 - an unknown entry is reported where the reranker is built
        return None
    return entry.max_length if entry.kind_of.has_model else None


def _published_llm_reranker(reranker: str | None) -> bool:
    """Whether ``reranker`` is an entry whose behaviour follows a published LLM reranker's code
    (:func:`~r2med_agent.retrieval.rerank.spec.follows_published_code`); False for none, a
    cross-encoder, the project's own LLM prompts, or an entry that cannot be looked up."""
    if not reranker:
        return False
    from r2med_agent.retrieval.rerank.spec import follows_published_code, get_reranker_spec

    try:
        return follows_published_code(get_reranker_spec(reranker))
    except Exception:  # noqa: BLE001 - an unknown entry is reported where the reranker is built
        return False


def _llm_backend(name: str | None) -> str | None:
    """The registry backend of LLM ``name``, or None when it cannot be looked up."""
    if not name:
        return None
    from r2med_agent.llm.registry import get_llm_spec

    try:
        return get_llm_spec(name).backend
    except Exception:  # noqa: BLE001 - an unknown entry is reported where the LLM is built
        return None


def _canonical_sampling(sampling: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in sorted((sampling or {}).items()):
        if value is not None and name in FLOAT_SAMPLING and not isinstance(value, bool):
            value = float(value)
        elif value is not None and name in INT_SAMPLING and not isinstance(value, bool):
            value = int(value)
        out[str(name)] = value
    return out


@dataclass(frozen=True)
class Capabilities:
    """What a method declares about itself; validation, ``reproduce``, ``compare`` and the CLI
    read these instead of the method's name.

    Attributes:
        uses_llm: it generates text (False only for the plain query).
        agentic: it searches while it reasons (a loop over turns).
        supports_samples: several generations per query can be averaged (``--samples``).
        needs_first_pass: its prompt shows a first-pass ranking (``--first-pass``).
        final_fuse: it can rank with every search of its trajectory (``--final fuse``).
    """

    uses_llm: bool = True
    agentic: bool = False
    supports_samples: bool = False
    needs_first_pass: bool = False
    final_fuse: bool = False


def capabilities(method_cls: Any) -> Capabilities:
    """A method class's declared capabilities (attributes of the same names)."""
    return Capabilities(**{f.name: bool(getattr(method_cls, f.name, f.default)) for f in fields(Capabilities)})


def _validate(spec: RunSpec) -> None:
    """Errors a user can make, each a ConfigError naming the option and the fix."""
    from r2med_agent.methods import METHODS

    caps = capabilities(METHODS[spec.method])
    using = [n for n, c in METHODS.items() if capabilities(c).uses_llm]
    if not caps.uses_llm and spec.llm:
        raise ConfigError(
            f"--llm {spec.llm} is only used by a method; add --method ({', '.join(using)}), or leave --llm "
            "out for plain retrieval"
        )
    if caps.uses_llm and not spec.llm:
        raise ConfigError(f"--method {spec.method} needs --llm (see `r2med-agent llms`)")
    if spec.final not in FINAL_MODES:
        raise ConfigError(f"--final must be one of {', '.join(FINAL_MODES)}, got '{spec.final}'")
    if spec.final == "fuse" and spec.loop_retriever not in (None, spec.retriever):
        raise ConfigError(
            "--final fuse ranks with the loop's own searches: --loop-retriever must be the same "
            f"as --retriever (got {spec.loop_retriever} and {spec.retriever})"
        )
    _validate_generations(spec, caps, using)
    if spec.rerank_cut and not spec.reranker:
        raise ConfigError("--rerank-cut needs --reranker")
    _validate_candidates(spec)
    if spec.first_pass != "bm25" and not caps.needs_first_pass:
        raise ConfigError(f"--first-pass is LameR's first-pass retriever; --method {spec.method} has none")
    if "+" in spec.first_pass:
        raise ConfigError(f"--first-pass takes one retriever (bm25, bm25-compat, an encoder), got '{spec.first_pass}'")
    if spec.top_k < 1 or spec.rerank_k < 1:
        raise ConfigError("--top-k and --rerank-k must be at least 1")
    if spec.rerank_max_length is not None and spec.rerank_max_length < 8:
        raise ConfigError(f"--rerank-max-length must be at least 8, got {spec.rerank_max_length}")
    _validate_samples(spec, caps)
    _validate_sampling_values(spec.sampling)
    _validate_models(spec)


def _validate_generations(spec: RunSpec, caps: Capabilities, using: list[str]) -> None:
    if spec.generations not in GENERATION_SOURCES:
        raise ConfigError(f"--generations must be one of {', '.join(GENERATION_SOURCES)}, got '{spec.generations}'")
    if spec.generations not in RELEASED_SOURCES:
        return
    whose = "R2MED's released generations" if spec.generations == "r2med" else "BRIGHT's released reasoning queries"
    if not caps.uses_llm:
        raise ConfigError(f"--generations {spec.generations} needs a --method that generates ({', '.join(using)})")
    if spec.sampling:
        raise ConfigError(f"sampling options ({', '.join(sorted(spec.sampling))}) do not apply to {whose}; "
                          "drop them or use --generations fresh")
    if spec.final == "fuse":
        raise ConfigError("--final fuse needs the loop's own searches, which released generations do "
                          "not have; use --generations fresh")


def _validate_candidates(spec: RunSpec) -> None:
    if spec.candidates is None:
        if spec.retriever == CANDIDATES:
            raise ConfigError("--retriever candidates is what --candidates PATH sets; give the run files")
        return
    if spec.retriever != CANDIDATES:
        raise ConfigError(f"--candidates replaces --retriever (got --retriever {spec.retriever}); give one of them")
    if spec.method != "none":
        raise ConfigError(f"--candidates hold one ranking per task query and cannot search for what --method "
                          f"{spec.method} generates; use --method none (and a --reranker)")


def _validate_samples(spec: RunSpec, caps: Capabilities) -> None:
    from r2med_agent.methods import METHODS

    if spec.samples < 1:
        raise ConfigError(f"--samples must be at least 1, got {spec.samples}")
    if spec.samples > 1 and not caps.supports_samples:
        takers = [n for n, c in METHODS.items() if capabilities(c).supports_samples]
        raise ConfigError(f"--samples applies to {', '.join(takers[:-1])} and {takers[-1]}, not --method {spec.method}")


def _validate_sampling_values(overrides: Mapping[str, Any]) -> None:
    """Reject sampling overrides out of range before any work (llama.cpp reads a
    ``max_tokens`` below 1 as "until the context is full"; vLLM fails mid-run)."""
    problems = []
    if overrides.get("max_tokens") is not None and overrides["max_tokens"] < 1:
        problems.append(f"--max-tokens must be at least 1, got {overrides['max_tokens']}")
    if overrides.get("temperature") is not None and overrides["temperature"] < 0:
        problems.append(f"--temperature must be >= 0 (0 = greedy), got {overrides['temperature']}")
    if overrides.get("top_p") is not None and not 0 < overrides["top_p"] <= 1:
        problems.append(f"--top-p must be in (0, 1], got {overrides['top_p']}")
    if problems:
        raise ConfigError("; ".join(problems))


def _check_choices(spec: RunSpec) -> None:
    """Settings with a fixed set of values: precision and encoder backend."""
    from r2med_agent.retrieval.dense.spec import BACKENDS, PRECISIONS

    if spec.precision is not None and spec.precision not in PRECISIONS:
        raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got '{spec.precision}'")
    if spec.encoder_backend is not None and spec.encoder_backend not in BACKENDS:
        raise ConfigError(f"--encoder-backend must be one of {', '.join(BACKENDS)}, got '{spec.encoder_backend}'")
    if spec.bm25_k1 is not None and not spec.bm25_k1 >= 0:
        raise ConfigError(f"--k1 must be >= 0, got {spec.bm25_k1}")
    if spec.bm25_b is not None and not 0 <= spec.bm25_b <= 1:
        raise ConfigError(f"--b must be between 0 and 1, got {spec.bm25_b}")
    if spec.empty_generation not in EMPTY_GENERATION:
        raise ConfigError(f"--empty-generation must be one of {', '.join(EMPTY_GENERATION)}, got '{spec.empty_generation}'")
    if spec.llm_prompt not in LLM_PROMPTS:
        raise ConfigError(f"--llm-prompt must be one of {', '.join(LLM_PROMPTS)}, got '{spec.llm_prompt}'")
    from r2med_agent.prompt_sources import check_value

    check_value(spec.prompts_from)
    if spec.loop_rules not in range(1, LOOP_RULES + 1) or isinstance(spec.loop_rules, bool):
        raise ConfigError(f"loop_rules must be a loop version from 1 to {LOOP_RULES}, got {spec.loop_rules!r}")
    if spec.rerank_rules not in range(1, RERANK_RULES + 1) or isinstance(spec.rerank_rules, bool):
        raise ConfigError(f"rerank_rules must be a reranker version from 1 to {RERANK_RULES}, got {spec.rerank_rules!r}")


def _normalise_fusion_depth(spec: RunSpec) -> None:
    """One depth per member (a single number stands for all); depths all equal to top_k are the
    default (None), so they neither split nor merge folders."""
    if spec.fusion_depth is None:
        return
    depths = tuple(spec.fusion_depth)
    n = len(spec.retriever.split("+"))
    if n == 1:
        raise ConfigError(f"--fusion-depth needs a '+'-joined --retriever (e.g. bm25+minilm), got '{spec.retriever}'")
    if len(depths) == 1:
        depths = depths * n
    if len(depths) != n:
        raise ConfigError(f"--fusion-depth: {len(depths)} depth(s) for {n} fused retriever(s); give one or one per retriever")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < spec.top_k for d in depths):
        raise ConfigError(f"--fusion-depth must be whole numbers of at least --top-k ({spec.top_k}), got {list(depths)}")
    _set(spec, "fusion_depth", None if all(d == spec.top_k for d in depths) else depths)


def _validate_models(spec: RunSpec) -> None:
    """Fusion and fixed candidate lists, checked by name."""
    from r2med_agent.retrieval.fusion import DEFAULT_RRF_K, ORIGINAL_QUERY, check_fusion_options

    n = len(spec.retriever.split("+"))
    if n == 1 and spec.retriever.endswith(ORIGINAL_QUERY):
        raise ConfigError(f"--retriever {spec.retriever}: the {ORIGINAL_QUERY} suffix marks a fused member that "
                          "searches with the original query; write e.g. bm25+minilm:query")
    if n == 1 and (spec.fusion != "rrf" or spec.fusion_weights is not None or spec.rrf_k != DEFAULT_RRF_K):
        raise ConfigError(
            f"--fusion, --fusion-weights and --rrf-k need a '+'-joined --retriever (e.g. bm25+minilm), "
            f"got '{spec.retriever}'"
        )
    check_fusion_options(n, spec.fusion, spec.rrf_k, spec.fusion_weights)
    _validate_fixed_rankings(spec)


def _validate_fixed_rankings(spec: RunSpec) -> None:
    """NanoR2MED's shipped candidate lists hold one ranking per task query: refuse, before any LLM
    work, a method whose queries are an LLM's (``--method`` other than none, ``--loop-retriever``)."""
    from r2med_agent.retrieval.candidates import candidate_names
    from r2med_agent.retrieval.fusion import member_names

    fixed = set(candidate_names())
    used = [("--retriever", spec.retriever)] + ([("--loop-retriever", spec.loop_retriever)] if spec.loop_retriever else [])
    for option, name in used:
        names = [p for p in member_names(name) if p in fixed]
        if names and spec.method != "none":
            raise ConfigError(
                f"{option} {name}: {', '.join(names)} answer the task's own queries from a fixed list "
                f"and cannot search for what --method {spec.method} generates; use --method none"
            )


SAMPLING_FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "max_tokens": "--max-tokens", "seed": "--seed"}
"""The ``run`` options that set sampling overrides."""

SPEC_FLAGS = {"top_k": "--top-k", "loop_retriever": "--loop-retriever", "bm25_k1": "--k1", "bm25_b": "--b",
              "prompts_from": "--prompts"}
"""Spec fields whose ``run`` option is not simply ``--<field-with-dashes>``."""


def cli_args(spec: RunSpec, candidates_path: str | None = None) -> list[str]:
    """The ``r2med-agent run`` options that give ``spec`` (its non-default settings; the prompts
    in use come from ``$R2MED_PROMPTS_DIR``, not from an option). A run over ``--candidates``
    needs ``candidates_path``, the files its hash was made from.

    Raises:
        ConfigError: a sampling override has no ``run`` option (set it in the LLM's entry); a
            run over candidates without their path.
    """
    out = ["--method", spec.method]
    if spec.llm:
        out += ["--llm", spec.llm]
    if spec.generations != "fresh":
        out += ["--generations", spec.generations]
    if spec.candidates is not None and candidates_path is not None:
        out += ["--candidates", candidates_path]
    else:
        out += ["--retriever", spec.retriever]
    if spec.reranker:
        out += ["--reranker", spec.reranker]
    out += _prompts_args(spec)
    for name, value in spec.non_default().items():
        if name in ("method", "llm", "generations", "retriever", "reranker", "prompts", "entries", "prompts_from"):
            continue
        if name == "candidates" and candidates_path is not None:
            continue
        if name == "candidates":
            raise ConfigError("a run over --candidates is given by the files' path, which its spec (their hash) "
                              "does not hold")
        if name == "sampling":
            out += _sampling_args(value)
            continue
        if name == "loop_rules":
            raise ConfigError(f"loop_rules {value} names results of an earlier version's loops, which this "
                              "version does not run")
        if name == "rerank_rules":
            raise ConfigError(f"rerank_rules {value} names results of an earlier version's rerankers, which this "
                              "version does not run")
        flag = SPEC_FLAGS.get(name, "--" + name.replace("_", "-"))
        if isinstance(value, bool):
            out += [flag] if value else []
        else:
            out += [flag, _fmt(value).replace("-", ",") if name in ("fusion_weights", "fusion_depth") else str(value)]
    return out


def _prompts_args(spec: RunSpec) -> list[str]:
    """``--prompts own|authors`` where the spec's wording is not the run's default.

    Raises:
        ConfigError: the spec names the authors' prompts at commits this version does not pin.
    """
    from r2med_agent.prompt_sources import AUTHORS, OWN, resolve

    if spec.prompts_from == resolve(None, spec.method, spec.llm, spec.generations, spec.reranker):
        return []
    if spec.prompts_from == OWN:
        return ["--prompts", OWN]
    if spec.prompts_from == resolve(AUTHORS, spec.method, spec.llm, spec.generations, spec.reranker):
        return ["--prompts", AUTHORS]
    raise ConfigError(f"prompts_from {spec.prompts_from} names results made with the authors' prompts at other "
                      "commits, which this version does not fetch")


def _sampling_args(sampling: Mapping[str, Any]) -> list[str]:
    out = []
    for name, value in sampling.items():
        if name not in SAMPLING_FLAGS:
            raise ConfigError(f"sampling override '{name}' has no `run` option; set it in the LLM's registry entry")
        out += [SAMPLING_FLAGS[name], _fmt(value)]
    return out
