"""The run spec: every setting that can change a result, typed, documented, and nothing else.

A :class:`RunSpec` is the identity of a run, and pure data: making one, reading one back
(:meth:`RunSpec.from_key`, :meth:`RunSpec.from_record`) and naming it (:meth:`RunSpec.folder`,
:attr:`RunSpec.label`) look nothing up in any registry, read no file and test no component's name,
so a result reads back, labels and moves the same in every process, whatever is installed or
registered there. Everything that names, files, labels or checks a run is derived from it:

- :meth:`RunSpec.key` is a canonical text (compact JSON of the settings that differ from their
  defaults); :meth:`RunSpec.from_key` reads it back, and :meth:`RunSpec.record` /
  :meth:`RunSpec.from_record` do the same with the dict written into every result file;
- :meth:`RunSpec.digest` is a short hash of the key; :meth:`RunSpec.folder` is the result folder
  relative to the output root, ``<method>/<llm>/<retriever>[__<tokens>][__<reranker>][__<digest>]``,
  whose tokens show the non-default settings (``t0.9``, ``mt24``, ``k10``, ``bfloat16``, ...) and
  whose digest covers all of them, so two specs that differ in any setting never share a folder;
- :meth:`RunSpec.settings` lists the non-default settings beyond method, LLM, retriever and
  reranker; ``compare`` labels its rows with them;
- the CLI's options and help and the Python API's keyword documentation come from the fields'
  metadata (:func:`field_help`).

What a user asks for becomes a run's spec in one step, :func:`r2med_agent.experiment.resolve.resolve`,
at build time: it reads the registries once (a method's name in any case, what each component
declares), sets settings that do not apply and explicit defaults back to their defaults, hashes
prompt folders and run files, and refuses a bad combination with a message naming the option.
Settings that cannot change a result (the tasks, where the data and caches live, progress bars,
chunking of LLM calls, which metrics are printed) are not part of the spec: they belong to
:class:`~r2med_agent.experiment.run_config.RunConfig`, which extends the spec with them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from r2med_agent.errors import ConfigError
from r2med_agent.names import DEFAULT_RERANK_K, DEFAULT_RRF_K, DEFAULT_TOP_K, fusion_label, released_label
from r2med_agent.types import SAMPLING_KNOBS, canonical_sampling

__all__ = ["DEFAULT_RERANK_K", "DEFAULT_TOP_K", "EMPTY_GENERATION", "FINAL_MODES", "GENERATION_SOURCES",
           "ENCODER_RULES", "LLM_PROMPTS", "LOOP_RULES", "NAMED_FIELDS", "RELEASED_SOURCES", "RERANK_RULES",
           "REQUEST_RULES", "RunSpec", "SAMPLING_FLAGS", "VERSION_MARKERS",
           "SPEC_FLAGS", "OPTION_GROUPS", "field_help", "spec_options"]

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

LOOP_RULES = 3
"""The version of the agentic loops' behaviour this code runs: 1 before Search-R1 and Search-o1
followed their originals' code (docs/protocol.md), 2 while Search-o1 gave its single-QA instruction
with 10 searches (a pair its code never runs), 3 since it runs the multi-hop QA setting (the
multi-hop instruction, 10 searches, 15 turns). Records of agentic runs that lack the setting were
written by version 1 (:func:`r2med_agent.experiment.resolve.spec_of_config`); a record holds the
version it was made with, so results of version 2 read back as ``loop_rules=2``."""

RERANK_RULES = 3
"""The version of the published LLM rerankers' behaviour this code runs (GroupRank's, ReasonRank's,
Rank-R1's and Rank1's entries, the ``groupwise``/``setwise`` kinds and the ``reasonrank``/``rank1``
formats): 1 before they followed their authors' code (docs/protocol.md, "Rerankers as their
authors ran them"), 2 while Rank-R1's imported prompt wrote documents ``[i] text`` and GroupRank's
shared shuffles ran through the task's query order, 3 since (the prompt file's ``[i]: text``; the
first stage's query order). Records of such runs that lack the setting were written by version 1
(:func:`r2med_agent.experiment.resolve.spec_of_config`); results of version 2 read back as
``rerank_rules=2``."""

REQUEST_RULES = 2
"""The version of the requests this code sends to an LLM entry that declares ``request_rules``
(the shipped GPT-4o entry, ``gpt4``): 1 while they carried ``max_tokens`` 10240 and ``seed`` 42,
which R2MED's ``generate_hypothetical_doc.py`` does not send, 2 since they carry what it sends
(temperature and top_p). Records of such runs that lack the setting were written by version 1
(:func:`r2med_agent.experiment.resolve.spec_of_config`)."""

ENCODER_RULES = 2
"""The version of the shipped encoder entries' behaviour this code runs: 1 before ``diver-4b``
embedded DIVER's raw queries (it prepended the web-search instruction of DIVER's later code, now
``diver-4b-instructed``), 2 since. An entry states the version at which its settings last changed
(``EncoderSpec.encoder_rules``); records of runs with such an entry that lack the setting were
written by version 1 (:func:`r2med_agent.experiment.resolve.spec_of_config`)."""

VERSION_MARKERS: dict[str, tuple[int, str, str]] = {
    "loop_rules": (LOOP_RULES, "loop", "loops"),
    "rerank_rules": (RERANK_RULES, "reranker", "rerankers"),
    "request_rules": (REQUEST_RULES, "request", "requests"),
    "encoder_rules": (ENCODER_RULES, "encoder", "encoder entries"),
}
"""The version markers: name -> (the version this code runs, what it versions, in the plural).
A record without one was written before it existed (version 1); only the current version runs."""

OWN_PROMPTS = "own"
"""``prompts_from`` of a run that renders the project's own wording (the identity's default)."""

NAMED_FIELDS = ("method", "llm", "generations", "retriever", "fusion", "rrf_k", "fusion_weights", "reranker")
"""Settings shown by the folder path itself (method, LLM, retriever with its fusion, reranker)."""


SAMPLING_FLAGS = {name: knob["flag"] for name, knob in SAMPLING_KNOBS.items() if knob["flag"]}
"""The ``run`` options that set sampling overrides (the knobs' own, :data:`~r2med_agent.types.SAMPLING_KNOBS`)."""

OPTION_GROUPS = ("Method and LLM", "Sampling", "Retrieval", "Reranking", "Data", "Output, cache and progress")
"""The panels of ``run --help``, in order; each spec field with a ``run`` option names its own."""


def _help(text: str) -> dict[str, Any]:
    """The metadata of a spec field that no ``run`` option sets (a hash or a version marker)."""
    return {"help": text}


def _option(text: str, group: str, *flags: str) -> dict[str, Any]:
    """The metadata of a spec field set by a ``run`` option: its help, its panel in ``run --help``
    (:data:`OPTION_GROUPS`) and its option names (default: ``--<field-with-dashes>``; the CLI
    generates the option from these, the field's type and the field's default)."""
    assert group in OPTION_GROUPS, group
    return {"help": text, "group": group, "flags": flags}


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
            ``owner/repo@<12 hex>`` joined by ``+`` (:mod:`r2med_agent.prompts.sources`); given as
            ``authors``, or None for the run's default (:func:`~r2med_agent.prompts.sources.natural`).
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
        encoder_rules: the version of the shipped encoder entries' behaviour
            (:data:`ENCODER_RULES`); as ``loop_rules``.
        kind_options: the settings retriever kinds declare for themselves (a kind's ``options``
            dataclass), by kind name, where not the default (``short.depth=3`` in a label).
    """

    method: str = field(default="none", metadata=_option(
        "{methods} (the method registry; any case: HyDE works).", "Method and LLM", "--method", "-m"))
    llm: str | None = field(default=None, metadata=_option(
        "LLM registry name (see `r2med-agent llms`), e.g. qwen-32b, gpt4, or the offline default smollm2.", "Method and LLM", "--llm", "-l"))
    generations: str = field(default="fresh", metadata=_option(
        "fresh: generate with --llm (through the cache). r2med: score R2MED's released generations of "
        "--method/--llm (<Task>/<method>/<llm>/query_with_hydoc.jsonl from the hub at the task's pinned "
        "revision, from --data-dir, or from a packaged task); no LLM is built. Results go to "
        "<method>/<llm>@r2med/. bright: score BRIGHT's released reasoning queries of --llm (gpt4, "
        "claude-3-opus, llama3-70b, Gemini-1.0, grit: its <llm>_reason configuration, from the hub at the "
        "task's pinned revision or from --data-dir) on a BRIGHT task, with --method reason; no LLM is built. "
        "Results go to <method>/<llm>@bright/.", "Method and LLM"))
    sampling: Mapping[str, Any] = field(default_factory=dict, metadata=_help(
        "Overrides of the LLM's default sampling (temperature, top_p, max_tokens, seed, ...)."))
    samples: int = field(default=1, metadata=_option(
        "Generations per query for hyde, query2doc and lamer (vLLM/OpenAI n): dense retrieval searches "
        "with the mean of the query's and the samples' embeddings, BM25 with the samples joined.", "Method and LLM"))
    prompts: str | None = field(default=None, metadata=_help(
        "Hash of the prompt templates in use when they are not the shipped ones ($R2MED_PROMPTS_DIR)."))
    prompts_from: str | None = field(default="own", metadata=_option(
        "Whose prompt wording the run renders: authors (the authors' own prompts, fetched once from their "
        "repository at the commit configs/pinned/prompt_sources.yaml pins: R2MED's HyDE/Query2Doc/LameR, Search-R1, "
        "Search-o1, ReasonRank, Rank1, GroupRank, Rank-R1) or own (the project's wording, with "
        "$R2MED_PROMPTS_DIR over it). Default: authors, unless the LLM that reads the prompt is the local smoke "
        "model (smollm2). Recorded as the repositories and commits used, e.g. R2MED/R2MED@62b707460040.", "Method and LLM", "--prompts"))
    first_pass: str = field(default="bm25", metadata=_option(
        "LameR's first-pass retriever, whose top 10 the prompt shows: bm25 (default), bm25-compat (the "
        "reference's gensim BM25, what the paper's LameR rows read) or an encoder name.", "Method and LLM"))
    retriever: str = field(default="bm25", metadata=_option(
        "bm25 | bm25-compat (R2MED's gensim scoring) | an encoder name (minilm, bge, nv, harrier, ...) | a "
        "'+'-joined fusion such as bm25+minilm | on NanoR2MED splits, the candidate lists they ship: "
        "nano-bm25, nano-dense, nano-hybrid[-safeguard], or hakari-hybrid[-safeguard] (the hybrid list "
        "rebuilt from nano-bm25 and harrier).", "Retrieval", "--retriever", "-r"))
    candidates: str | None = field(default=None, metadata=_help(
        "Hash of the first-stage run files the run reranks as given (--candidates), which replace "
        "--retriever; None: the retriever searches."))
    fusion: str = field(default="rrf", metadata=_option(
        "How a '+'-joined --retriever fuses its members: rrf (reciprocal rank fusion) or weighted "
        "(weighted sum of per-query min-max normalised scores).", "Retrieval"))
    rrf_k: int = field(default=DEFAULT_RRF_K, metadata=_option(
        "The RRF constant k for --fusion rrf (score = sum of 1/(k + rank)).", "Retrieval"))
    fusion_weights: tuple[float, ...] | None = field(default=None, metadata=_option(
        "Comma-separated weights, one per '+'-joined retriever, for --fusion weighted (default: all 1), "
        "e.g. 0.3,0.7.", "Retrieval"))
    bm25_k1: float | None = field(default=None, metadata=_option(
        "BM25's k1 (term-frequency saturation) for every BM25 retriever of the run, bm25 and "
        "bm25-compat alike. Default: 0.9, as R2MED (and pyserini) run BM25.", "Retrieval", "--k1"))
    bm25_b: float | None = field(default=None, metadata=_option(
        "BM25's b (document-length normalisation, 0 to 1) for every BM25 retriever of the run. "
        "Default: 0.4, as R2MED (and pyserini) run BM25.", "Retrieval", "--b"))
    loop_retriever: str | None = field(default=None, metadata=_option(
        "Retriever that Search-R1/Search-o1 query while they reason (default: --retriever; the final "
        "ranking uses --retriever).", "Method and LLM"))
    final: str = field(default="default", metadata=_option(
        "Agentic final ranking: 'default' (final response as the query, as R2MED) or 'fuse' (RRF of the "
        "searches the loop ran for the trajectory, each distinct query once, plus the final query; "
        "queries answered with a notice or issued in Search-R1's final turn were not run and are left "
        "out). Both rank with --retriever.", "Method and LLM"))
    precision: str | None = field(default=None, metadata=_option(
        "Numeric precision of the run's encoders and reranker on a GPU: float32, float16, bfloat16, "
        "autocast-float16 (float32 weights, fp16 autocast) or auto (bf16 where supported, else fp16; the "
        "fastest). Default: each model's registry precision, the one R2MED's reference ran it at. On a "
        "CPU everything runs in float32.", "Retrieval"))
    encoder_backend: str | None = field(default=None, metadata=_option(
        "Engine of the local dense encoders: transformers | vllm (vLLM's pooling engine, same vectors) | "
        "auto (vLLM when installed with a GPU and the encoder's pooling is supported, else "
        "transformers). Default: each encoder entry's 'backend'.", "Retrieval"))
    top_k: int = field(default=DEFAULT_TOP_K, metadata=_option(
        "Documents kept per query and the depth they are scored at (R2MED: 100); metrics cut off beyond "
        "it are left out.", "Retrieval", "--top-k", "-k"))
    reranker: str | None = field(default=None, metadata=_option(
        "Reranker registry name (`r2med-agent rerankers` or --reranker list shows them): a cross-encoder "
        "(kind cross-encoder: bge-reranker, monobert, rankllama) or an LLM reranker of kind listwise "
        "(qwen3-32b-listwise, reasonrank-7b), pointwise-reasoning (r1-qwen-32b-pointwise, rank1-7b), "
        "groupwise (grouprank-32b) or setwise (rank-r1-14b); add your own under 'rerankers:' in a --config file.", "Reranking"))
    rerank_k: int = field(default=DEFAULT_RERANK_K, metadata=_option(
        "How many top documents the reranker re-scores (the paper uses 10 or 100).", "Reranking"))
    rerank_cut: bool = field(default=False, metadata=_option(
        "Keep only the --rerank-k reranked documents per query, as R2MED's reranker runs did "
        "(NV-Embed-v2's top 10 reranked and kept); scored at --top-k all the same.", "Reranking"))
    fusion_depth: tuple[int, ...] | None = field(default=None, metadata=_option(
        "How deep each member of a '+'-joined --retriever searches before the fusion: one number for "
        "all or one per member, e.g. 1000,200, each at least --top-k (default: --top-k). Deeper member "
        "lists let the fusion lift a document one member ranks low.", "Retrieval"))
    entries: str | None = field(default=None, metadata=_help(
        "Hash of the registry entries the run uses that come from a user config (LLMs, encoders, "
        "rerankers of the same name as a shipped one, or your own); None: every entry it uses is shipped."))
    exclude_identical_ids: bool = field(default=False, metadata=_option(
        "Drop a document whose id equals the query's id from the final ranking (the next one moves up), as "
        "BEIR's exact search does in R2MED's dense evaluation; each task's result counts the hits removed. "
        "Applies to runs with a dense retriever.", "Retrieval"))
    empty_generation: str = field(default="query", metadata=_option(
        "What an empty generated text becomes: query (search with the plain query instead) or keep (use it as "
        "it is, as R2MED's scripts did: BM25 ranks with an empty query, dense retrieval averages in the "
        "embedding of ''). Each task's result counts its empty generations either way.", "Method and LLM"))
    llm_prompt: str = field(default="chat", metadata=_option(
        "How a prompt reaches a vLLM engine: chat (LLM.chat) or rendered (the chat template rendered to a "
        "string and given to LLM.generate, as R2MED's generation script did; tokenizers that add a BOS, such "
        "as Llama-3.1's and the DeepSeek-R1 distills', then send it twice). Applies to fresh generations of "
        "vllm entries.", "Method and LLM"))
    rerank_max_length: int | None = field(default=None, metadata=_option(
        "Tokens of a cross-encoder reranker's (query, document) input, longest part cut first (default: the "
        "entry's max_length; rankllama 1024, the value of the script that produced R2MED's RankLLaMA rows, "
        "while the released eval_reranker.py would give it 512).", "Reranking"))
    loop_rules: int = field(default=LOOP_RULES, metadata=_help(
        "Version of the Search-R1/Search-o1 loop behaviour: 3 follows the originals' code, Search-o1 in its "
        "multi-hop QA setting (this version runs only it); 2 (Search-o1's single-QA instruction with 10 "
        "searches) and 1 (before the loops followed the originals' code) name fresh agentic results of "
        "earlier versions."))
    rerank_rules: int = field(default=RERANK_RULES, metadata=_help(
        "Version of the published LLM rerankers' behaviour (GroupRank, ReasonRank, Rank-R1, Rank1): 3 follows "
        "their authors' code (this version runs only it); 2 (Rank-R1's imported prompt without the colon of "
        "its file's doc_prefix, GroupRank's shuffles in the task's query order) and 1 (before they followed "
        "their authors' code) name results of earlier versions."))

    request_rules: int = field(default=REQUEST_RULES, metadata=_help(
        "Version of the requests sent to an LLM entry that declares request_rules (GPT-4o, gpt4): 2 sends "
        "what R2MED's generation script sends, temperature and top_p (this version runs only it); 1 names "
        "results of earlier versions, whose requests also carried max_tokens 10240 and seed 42."))
    encoder_rules: int = field(default=ENCODER_RULES, metadata=_help(
        "Version of the shipped encoder entries' behaviour: 2 runs diver-4b on DIVER's raw queries, as its code "
        "stood when its numbers were made (this version runs only it); 1 names results of earlier versions, made "
        "with diver-4b's instructed queries (now diver-4b-instructed)."))
    kind_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, metadata=_help(
        "The settings retriever kinds declare for themselves (a kind's ``options`` dataclass), by kind name: "
        "the values that differ from the kind's defaults, for the kinds the run searches with, e.g. "
        '{"toy": {"depth": 3}}, shown as toy.depth=3.'))

    def __post_init__(self) -> None:
        _canonical(self)
        _check_own_values(self)

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
        """The spec whose :meth:`key` is ``key`` (a key leaves the defaults out)."""
        try:
            data = json.loads(key)
        except json.JSONDecodeError as e:
            raise ConfigError(f"not a run spec key: {key!r} ({e.msg})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"not a run spec key: {key!r}")
        return cls.from_record(data)

    def digest(self) -> str:
        """Eight hex digits of SHA-256 over :meth:`key`: stable across runs, machines, versions."""
        return hashlib.sha256(self.key().encode("utf-8")).hexdigest()[:8]

    def record(self) -> dict[str, Any]:
        """Every setting, JSON-ready, as written into result files (no secrets: names only)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(RunSpec)}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> RunSpec:
        """The spec of a recorded config, as it was recorded: this version's :meth:`record`, or
        the ``config`` block an earlier version wrote (keys that are not settings are ignored; a
        setting an earlier version did not record has its default, which is what such runs did).
        Nothing is looked up: a record whose version markers (``loop_rules``, ``rerank_rules``,
        ``encoder_rules``) are missing is upgraded by :func:`r2med_agent.experiment.resolve.spec_of_config`."""
        names = {f.name for f in fields(RunSpec)}
        kwargs = {k: v for k, v in record.items() if k in names}
        for key in ("fusion_weights", "fusion_depth"):
            if kwargs.get(key) is not None:
                kwargs[key] = tuple(kwargs[key])
        for key in ("sampling", "kind_options", "rerank_k", "top_k", "samples", "rrf_k", *VERSION_MARKERS,
                    "prompts_from", "generations", "first_pass", "final", "fusion", "retriever", "method"):
            if kwargs.get(key) is None:
                kwargs.pop(key, None)  # an earlier version's null: the default
        if kwargs.get("generations") in RELEASED_SOURCES:
            kwargs.pop("sampling", None)  # earlier versions recorded overrides that played no part
        return cls(**kwargs)

    def spec(self) -> RunSpec:
        """The spec part alone (for a :class:`RunConfig`, its identity without run options)."""
        return RunSpec(**{f.name: getattr(self, f.name) for f in fields(RunSpec)})

    # -- names derived from the spec -----------------------------------------------------------

    @property
    def llm_label(self) -> str:
        """The LLM part of the folder: its name, ``<name>@r2med`` or ``<name>@bright`` for released
        generations, ``none`` without an LLM."""
        if not self.llm:
            return "none"
        if self.generations in RELEASED_SOURCES:
            return released_label(self.llm, self.generations)
        return self.llm

    @property
    def retriever_name(self) -> str:
        """The retriever with its fusion settings (``bm25+minilm-weighted-0.3-0.7``)."""
        if "+" not in self.retriever:
            return self.retriever
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
            elif name == "kind_options":
                out.update({f"{kind}.{k}": v for kind, values in value.items() for k, v in values.items()})
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


def spec_options() -> dict[str, tuple[str, ...]]:
    """The spec fields that ``run`` options set, each with its option names (the long one first),
    in field order; the CLI generates the options from these fields' types, defaults, help and
    panels (:data:`OPTION_GROUPS`)."""
    return {f.name: f.metadata["flags"] or ("--" + f.name.replace("_", "-"),)
            for f in fields(RunSpec) if "group" in f.metadata}


def field_help(name: str) -> str:
    """The documented help of a spec field: the CLI option's ``--help`` and the API's keyword
    docs. Placeholders in braces (``{methods}``) name registry contents that the caller fills in."""
    for f in fields(RunSpec):
        if f.name == name:
            return str(f.metadata["help"])
    raise KeyError(name)


SPEC_FLAGS = {name: flags[0] for name, flags in spec_options().items()}
"""Spec field -> the long name of the ``run`` option that sets it (``bm25_k1`` -> ``--k1``)."""


def _canonical(spec: RunSpec) -> None:
    """Canonical types, so equal settings compare (and key) equal: sampling values by their
    knob's type (1 and 1.0 are the same temperature), tuples for the lists."""
    _set(spec, "sampling", canonical_sampling(spec.sampling))
    _set(spec, "kind_options", {str(k): dict(sorted(v.items())) for k, v in sorted(spec.kind_options.items()) if v})
    if spec.fusion_weights is not None:
        _set(spec, "fusion_weights", tuple(float(w) for w in spec.fusion_weights))
    if spec.fusion_depth is not None:
        _set(spec, "fusion_depth", tuple(spec.fusion_depth))
    if spec.rerank_max_length is not None and not isinstance(spec.rerank_max_length, bool):
        _set(spec, "rerank_max_length", int(spec.rerank_max_length))


def _check_own_values(spec: RunSpec) -> None:
    """The spec's own value sets (not any component's), checked whatever the rest says."""
    own = (("generations", GENERATION_SOURCES), ("final", FINAL_MODES), ("empty_generation", EMPTY_GENERATION),
           ("llm_prompt", LLM_PROMPTS))
    for name, allowed in own:
        if getattr(spec, name) not in allowed:
            raise ConfigError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, got '{getattr(spec, name)}'")
    for name, (current, what, _) in VERSION_MARKERS.items():
        value = getattr(spec, name)
        if value not in range(1, current + 1) or isinstance(value, bool):
            raise ConfigError(f"{name} must be {'an' if what[0] in 'aeiou' else 'a'} {what} version from 1 to {current}, got {value!r}")


def _set(spec: RunSpec, name: str, value: Any) -> None:
    object.__setattr__(spec, name, value)


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


def _prompts_token(value: Any, spec: RunSpec) -> str:
    """The folder token of a list of the authors' sources: ``authors-R2MED@62b70746`` (each
    repository's name and 8 hex of its commit)."""
    parts = []
    for part in str(value).split("+"):
        name, _, commit = part.split("/", 1)[-1].partition("@")
        parts.append(f"{name}@{commit[:8]}")
    return "authors-" + "-".join(parts)


def _rerank_k_token(value: Any, spec: RunSpec) -> str:
    return f"top{value}" if spec.rerank_cut else f"rk{value}"


_TOKENS: dict[str, Any] = {
    "sampling.temperature": lambda v, s: f"t{_fmt(v)}",
    "sampling.top_p": lambda v, s: f"p{_fmt(v)}",
    "sampling.max_tokens": lambda v, s: f"mt{v}",
    "sampling.seed": lambda v, s: f"seed{_fmt(v)}",
    "samples": lambda v, s: f"n{v}",
    "prompts": lambda v, s: f"prompts-{str(v)[:6]}",
    "prompts_from": _prompts_token,
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
    "rerank_cut": lambda v, s: "" if s.rerank_k != DEFAULT_RERANK_K else f"top{DEFAULT_RERANK_K}",
    "fusion_depth": lambda v, s: "fd" + "-".join(str(d) for d in v),
    "entries": lambda v, s: f"entries-{str(v)[:6]}",
    "exclude_identical_ids": lambda v, s: "noself",
    "empty_generation": lambda v, s: f"empty-{v}",
    "llm_prompt": lambda v, s: f"prompt-{v}",
    "rerank_max_length": lambda v, s: f"rml{v}",
    "loop_rules": lambda v, s: f"loops-v{v}",
    "rerank_rules": lambda v, s: f"rerank-v{v}",
    "request_rules": lambda v, s: f"request-v{v}",
    "encoder_rules": lambda v, s: f"encoders-v{v}",
}
