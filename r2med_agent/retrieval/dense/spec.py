"""What an encoder is: its registry entry (:class:`EncoderSpec`, ``configs/encoders.yaml`` plus a
user config's ``encoders:`` section), the options a run builds it with (:class:`EncoderOptions`)
and the :class:`Encoder` protocol every backend implements.

An encoder turns texts into one float32 row each. The caller decides what goes before the text
(the task instruction, resolved per task by
:func:`~r2med_agent.retrieval.dense.instructions.instruction_prefixes`); the encoder only knows
which *side* it encodes (``query`` or ``doc``, since MedCPT uses two models) and the prefix, which
some models leave out of pooling (Instructor, GritLM).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from r2med_agent.config import build, load_registry
from r2med_agent.errors import ConfigError

Side = Literal["query", "doc"]


Precision = Literal["auto", "float32", "float16", "bfloat16", "autocast-float16"]
PRECISIONS: tuple[str, ...] = ("auto", "float32", "float16", "bfloat16", "autocast-float16")
"""The values of an encoder's or reranker's ``precision`` (see :attr:`EncoderSpec.precision`)."""


def weights_dtype_name(precision: str) -> str:
    """The dtype the weights load in under ``precision`` (``autocast-float16``: float32)."""
    return "float32" if precision == "autocast-float16" else precision


BACKENDS = ("auto", "transformers", "vllm")
"""Values of an entry's ``backend`` and of ``run --encoder-backend``."""

DEFAULT_SHARD_SIZE = 8192
"""Documents per embedding-cache shard (:class:`EncoderOptions.shard_size`)."""

BRIGHT_FIXED = frozenset({"name", "kind", "bright", "model", "query_model", "doc_model", "encoder_rules"})
"""Fields an entry's ``bright`` block cannot set (:attr:`EncoderSpec.bright`)."""


@dataclass(frozen=True)


class EncoderSpec:
    """One entry of ``configs/encoders.yaml`` (or a user config's ``encoders:`` section)."""

    name: str
    """Registry key; also the retriever's name in result paths."""
    kind: Literal["hf", "api"] = "hf"
    """``hf``: a transformers model run locally; ``api``: an OpenAI-compatible ``/embeddings`` API."""
    backend: Literal["auto", "transformers", "vllm"] = "auto"
    """Engine for an ``hf`` entry: ``transformers`` (the batch loop of :class:`~r2med_agent.retrieval.dense.hf.HFEncoder`),
    ``vllm`` (vLLM's pooling engine, :mod:`r2med_agent.retrieval.dense.vllm`; the same tokens,
    pooling, precision and normalisation), or ``auto``: vLLM when it is installed, a GPU is present
    and vLLM can express the entry's pooling, else transformers (the choice is logged).
    ``run --encoder-backend`` overrides it."""
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for ``vllm.LLM`` on the vLLM backend (e.g.
    ``gpu_memory_utilization``, default 0.5 on a GPU and 0.05 of RAM on CPU; ``enforce_eager``;
    ``tensor_parallel_size``)."""
    model: str = ""
    """HF hub id, local folder, ``resource:<package>/<folder>`` (a model shipped inside an installed
    Python package), or the API's model name."""
    query_model: str | None = None
    """Model for the query side when it differs from ``model`` (MedCPT's query encoder)."""
    doc_model: str | None = None
    """Model for the document side when it differs from ``model`` (MedCPT's article encoder)."""
    pooling: Literal["cls", "mean", "last-token", "model"] = "mean"
    """How token states become one vector: first token, masked mean, last non-padding token, or
    ``model``: the model's own ``encode(texts, instruction=..., max_length=...)`` (NV-Embed's remote
    code, which pools with its latent-attention layer)."""
    normalize: bool = True
    """L2-normalise each embedding as it is produced. This decides how the two halves weigh in the
    HyDE/LameR mean; search always scores by cosine (final vectors are normalised)."""
    max_length: int = 512
    """Token limit per text (documents, and queries unless ``query_max_length`` is set)."""
    query_max_length: int | None = None
    """Token limit for queries when it differs from documents (GritLM: 512 vs 2048)."""
    precision: Precision = "auto"
    """Numeric precision on a GPU (on a CPU always float32). ``float32``, ``float16``,
    ``bfloat16``: weights and activations in that type; ``autocast-float16``: float32 weights and
    the forward pass under ``torch.autocast`` in float16 (what BMRetriever's reference code does);
    ``auto``: bfloat16 where the GPU supports it, else float16 (the fastest choice). The entries of
    the paper's models set the precision R2MED's reference ran them at; ``run --precision``
    overrides it for one run, and the results record it."""
    query_prefix: str = ""
    """Fixed text put before every query when no per-task instruction applies (bge's prompt)."""
    doc_prefix: str = ""
    """Fixed text put before every document when no per-task doc instruction applies."""
    query_instructions: Mapping[str, str] = field(default_factory=dict)
    """Task instruction per task name, task family (``qa``, ``exam``, ``treatment``, ``case``) or
    ``default``, looked up in that order. ``{domain}`` is replaced by the task's domain."""
    doc_instructions: Mapping[str, str] = field(default_factory=dict)
    """Document-side instructions, same keys as ``query_instructions`` (Instructor)."""
    instruction_format: str = "{instruction}{text}"
    """How a query instruction joins the text; must end with ``{text}``. e5-mistral:
    ``"Instruct: {instruction}\\nQuery: {text}"``; GritLM: ``"<|user|>\\n{instruction}\\n<|embed|>\\n{text}"``."""
    doc_instruction_format: str = "{instruction}{text}"
    """How a document instruction joins the text; must end with ``{text}``."""
    instruction_on: Literal["query", "both"] = "query"
    """Where the query instruction goes for HyDE/LameR/reasoning means: the original query only
    (most encoders) or both halves, query and generated text (Instructor, GritLM, NV-Embed)."""
    pool_exclude_prefix: bool = False
    """Leave the prefix tokens out of mean pooling (Instructor pairs, GritLM): the prefix's tokens
    and any special token put before them (``[CLS]``, ``<s>``), not one appended after the text
    (see :func:`prefix_token_count`)."""
    append_eos: bool = False
    """Truncate to ``max_length - 1`` tokens and append the EOS token (BMRetriever)."""
    truncation: Literal["tokens", "decoded-text"] = "tokens"
    """How a text over ``max_length`` tokens is cut (the prefix counts as part of the text).
    ``tokens``: the tokenizer's own truncation on the right, its special tokens counted in the
    limit (FlagEmbedding, sentence-transformers, R2MED's scripts). ``decoded-text``: DIVER's
    (``Qwen3EmbeddingModel.truncate_text`` in AQ-MedAI/Diver ``Retriever/retrievers.py``): the
    string is tokenized without special tokens, and only when that gives more than
    ``max_length`` tokens it is replaced by the decoded first ``max_length`` of them; the
    resulting string is then tokenized as the model's tokenizer does by default (special tokens
    added, nothing more cut), so the model can see a few tokens more than ``max_length`` (see
    :data:`~r2med_agent.retrieval.dense.tokens.DECODED_TEXT_SLACK`)."""
    reference: str = ""
    """Where the entry's settings come from (repository at a commit, file and function), as
    ``reproduce --dry-run`` shows it. A description only: it changes no vector."""
    encoder_rules: int = 1
    """The version of the shipped entries' behaviour (the run spec's ``encoder_rules``,
    :data:`~r2med_agent.experiment.spec.ENCODER_RULES`) at which this entry's settings last
    changed: a result recorded before it, with the entry's earlier settings, reads back as another
    run (``diver-4b``: 2, since its queries are DIVER's raw ones)."""
    doc_title_pair: bool = False
    """Encode documents as a (title, text) token pair (MedCPT's article encoder; empty titles)."""
    trust_remote_code: bool = False
    """Allow the model repo's own modelling code (NV-Embed, GritLM)."""
    transformers: str = ""
    """PEP 440 version specifier the installed transformers must satisfy for this model, e.g.
    ``==4.42.4`` (NV-Embed-v2's own code imports names later releases removed). Checked before the
    model loads; a mismatch is a ConfigError naming the version to install. Empty: any version."""
    forward_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the model's forward call (GritLM: ``is_causal: false``)."""
    batch_size: int = 64
    """Texts per forward pass at ``max_length``; shorter texts are batched more densely (the same
    token budget), never more than 8x this many."""
    provider: Literal["openai", "voyage"] = "openai"
    """API flavour (``kind: api``): ``voyage`` adds ``input_type`` query/document to requests."""
    base_url: str = ""
    """API base URL (``kind: api``), e.g. ``https://api.openai.com/v1``."""
    api_key_env: str = ""
    """Environment variable holding the API key (``kind: api``); the key itself is never stored."""
    max_chars: int | None = None
    """API inputs are cut to this many characters (APIs reject over-long inputs)."""
    max_tokens: int | None = None
    """API inputs are cut to this many tokens (OpenAI rejects inputs over 8,191 with a 400): exactly,
    with tiktoken's ``tiktoken_encoding``, when tiktoken is installed (``pip install tiktoken``) and
    the encoding can be loaded; otherwise to this many *characters*, which keeps every input within
    the limit whenever a token covers at least one character (English text averages about four)."""
    tiktoken_encoding: str = ""
    """tiktoken encoding of the API's tokenizer for ``max_tokens`` (OpenAI's v3 embeddings:
    ``cl100k_base``)."""
    hf_tokenizer: str = ""
    """A transformers tokenizer (hub id or folder) other than the model's own. An ``api`` entry
    counts ``max_tokens`` with it when no ``tiktoken_encoding`` is set (Voyage:
    ``voyageai/voyage-3``): an input longer than the limit becomes the decoded first
    ``max_tokens`` token ids, and when it cannot be loaded, inputs are cut to ``max_tokens``
    characters instead (with a warning). A local (``hf``) entry's texts go through it instead of
    the model's tokenizer, its special tokens and EOS included (RaDeR's BRIGHT code tokenizes with
    ``Qwen/Qwen2.5-14B-Instruct``'s)."""
    json_inputs: bool = False
    """Send each input as R2MED's reference does (``utils.py``): after the ``max_tokens`` cut,
    newlines become spaces and the text is JSON-encoded (``json.dumps``: in double quotes,
    non-ASCII characters as ``\\uXXXX`` escapes), and that string is what the API embeds."""

    bright: Mapping[str, Any] = field(default_factory=dict)
    """Settings that replace the entry's own on BRIGHT's tasks (``bright-*``, both settings), where
    the model's authors ran it on BRIGHT otherwise than on R2MED: any field but ``name``, ``kind``,
    ``bright`` and the model ids, e.g. ``{max_length: 8192, query_instructions: {bright-biology:
    ...}}``. A field it does not name keeps the entry's value. The model is the same, so the entry
    keeps one name on both benchmarks (a task is of one benchmark, so a run's task and retriever
    name still say which settings ran; :meth:`on_bright`)."""

    def __post_init__(self) -> None:
        self._check_bright()
        for attr in ("instruction_format", "doc_instruction_format"):
            fmt = getattr(self, attr)
            if not fmt.endswith("{text}") or "{instruction}" not in fmt:
                raise ValueError(
                    f"{attr} must contain '{{instruction}}' and end with '{{text}}', got {fmt!r}"
                )
        if self.kind == "hf" and not (self.model or (self.query_model and self.doc_model)):
            raise ValueError("an 'hf' encoder needs 'model' (or both 'query_model' and 'doc_model')")
        if self.kind == "api" and not (self.model and self.base_url and self.api_key_env):
            raise ValueError("an 'api' encoder needs 'model', 'base_url' and 'api_key_env'")
        if self.kind == "api" and self.backend == "vllm":
            raise ValueError("backend 'vllm' applies to 'hf' encoders; an 'api' encoder calls its API")
        if self.max_length < 2 or self.batch_size < 1:
            raise ValueError("max_length must be >= 2 and batch_size >= 1")
        if (self.max_tokens is not None and self.max_tokens < 1) or (self.max_chars is not None and self.max_chars < 1):
            raise ValueError("max_tokens and max_chars must be >= 1")
        if self.transformers:
            _specifier(self.transformers)  # a malformed specifier fails when the registry loads
        if self.truncation == "decoded-text" and (self.append_eos or self.doc_title_pair or self.kind != "hf"):
            raise ValueError("truncation 'decoded-text' applies to a local model's single texts: not with "
                             "append_eos, doc_title_pair or an API entry")

    def _check_bright(self) -> None:
        """Validate the ``bright`` block as the registry validates an entry (its keys, their types,
        the settings it makes): a bad one fails when the registry loads, not on a BRIGHT task."""
        if not self.bright:
            return
        if not isinstance(self.bright, Mapping):
            raise ValueError(f"bright must be a mapping of settings, got {self.bright!r}")
        fixed = sorted(set(self.bright) & BRIGHT_FIXED)
        if fixed:
            raise ValueError(f"bright cannot change {', '.join(fixed)} (the entry is one model under one name)")
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "bright"}
        try:
            resolved = build(EncoderSpec, {**own, **self.bright}, "bright")
        except ConfigError as e:
            raise ValueError(str(e)) from None
        object.__setattr__(self, "bright", {k: getattr(resolved, k) for k in self.bright})

    def on_bright(self) -> EncoderSpec:
        """The entry as it runs on BRIGHT's tasks: its ``bright`` settings in place of its own."""
        if not self.bright:
            return self
        return dataclasses.replace(self, **self.bright, bright={})

    @property
    def dtype(self) -> str:
        """The weights' dtype name ``precision`` implies (``autocast-float16``: float32)."""
        return weights_dtype_name(self.precision)

    def model_for(self, side: Side) -> str:
        """The model id used for ``side``."""
        if side == "query":
            return self.query_model or self.model
        return self.doc_model or self.model

    def max_length_for(self, side: Side) -> int:
        if side == "query" and self.query_max_length:
            return self.query_max_length
        return self.max_length


def encoder_registry() -> dict[str, EncoderSpec]:
    """All encoder entries (package file plus the user config's ``encoders:`` section)."""
    return load_registry("encoders", EncoderSpec)


def get_encoder_spec(name: str) -> EncoderSpec:
    """One encoder entry by name; an unknown name lists the known ones."""
    reg = encoder_registry()
    if name not in reg:
        raise ConfigError(
            f"unknown encoder '{name}'; known: {', '.join(sorted(reg))} "
            "(add your own under 'encoders:' in a user config file)"
        )
    return reg[name]

def _specifier(text: str) -> Any:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        return SpecifierSet(text)
    except InvalidSpecifier:
        raise ValueError(
            f"transformers: {text!r} is not a version specifier (write e.g. '==4.42.4' or '>=4.37,<5')"
        ) from None


@runtime_checkable


class Encoder(Protocol):
    """Texts in, one float32 row per text out, in input order."""

    name: str
    spec: EncoderSpec

    def encode(
        self,
        texts: Sequence[str],
        *,
        side: Side,
        prefix: str = "",
        titles: Sequence[str] | None = None,
    ) -> np.ndarray:
        """Encode ``prefix + text`` for each text; ``titles`` pair with texts where the spec asks."""
        ...


@dataclass(frozen=True)


class EncoderOptions:
    """How a run builds its dense encoders and their document embeddings: one typed value from
    :func:`~r2med_agent.retrieval.make_retriever` down to
    :func:`~r2med_agent.retrieval.dense.factory.make_encoder` and
    :class:`~r2med_agent.retrieval.dense.index.DenseRetriever`. A new option is a field here,
    read where it applies."""

    device: str | None = None
    """``None`` (all GPUs, else the CPU), ``"cpu"``, ``"cuda"``, ``"cuda:1"``."""
    precision: str | None = None
    """Overrides an ``hf`` entry's ``precision`` (``run --precision``); None: the entry's."""
    backend: str | None = None
    """Engine of ``hf`` entries: ``auto``, ``transformers``, ``vllm`` (``run --encoder-backend``);
    None: each entry's ``backend``."""
    show_progress: bool = True
    """tqdm bars while encoding."""
    use_cache: bool = True
    """Read and write the document-embedding cache."""
    shard_size: int = DEFAULT_SHARD_SIZE
    """Documents per cache shard (a killed run resumes from its last shard)."""
    use_gpu: bool | None = None
    """faiss index on the GPUs (None: when faiss sees one)."""
    cache_root: Path | None = None
    """Folder of the embedding cache (default ``cache_dir()/"embeddings"``)."""

    def apply_to(self, spec: EncoderSpec) -> EncoderSpec:
        """``spec`` with these options' precision (local ``hf`` entries only; an API has none)."""
        if self.precision is None or spec.kind != "hf":
            return spec
        return dataclasses.replace(spec, precision=self.precision)  # type: ignore[arg-type]
