"""Text encoders for dense retrieval: the registry entry (``configs/encoders.yaml``) and the two
backends, Hugging Face models run with transformers and OpenAI-compatible embedding APIs.

An encoder turns texts into one float32 row each. The caller decides what goes before the text
(the task instruction, resolved per task by :func:`instruction_prefixes`); the encoder only knows
which *side* it encodes (``query`` or ``doc``, since MedCPT uses two models) and the prefix, which
some models leave out of pooling (Instructor, GritLM).

Heavy dependencies (torch, transformers) are imported inside functions; a missing one raises
:class:`~r2med_agent.errors.MissingExtraError` naming the ``cpu`` extra (``gpu`` on CUDA machines).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

from r2med_agent.config import load_registry
from r2med_agent.errors import ConfigError, LLMError, MissingExtraError

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger(__name__)

Side = Literal["query", "doc"]

GPU_ALTERNATIVE = "or 'r2med-agent[gpu]' on a CUDA 12 machine, never both"
"""Said after the ``[cpu]`` install command: the two extras ship different faiss builds."""

_INSTRUCTION_DEFAULT_KEY = "default"


Precision = Literal["auto", "float32", "float16", "bfloat16", "autocast-float16"]
PRECISIONS: tuple[str, ...] = ("auto", "float32", "float16", "bfloat16", "autocast-float16")
"""The values of an encoder's or reranker's ``precision`` (see :attr:`EncoderSpec.precision`)."""


def weights_dtype_name(precision: str) -> str:
    """The dtype the weights load in under ``precision`` (``autocast-float16``: float32)."""
    return "float32" if precision == "autocast-float16" else precision


@dataclass(frozen=True)
class EncoderSpec:
    """One entry of ``configs/encoders.yaml`` (or a user config's ``encoders:`` section)."""

    name: str
    """Registry key; also the retriever's name in result paths."""
    kind: Literal["hf", "api"] = "hf"
    """``hf``: a transformers model run locally; ``api``: an OpenAI-compatible ``/embeddings`` API."""
    backend: Literal["auto", "transformers", "vllm"] = "auto"
    """Engine for an ``hf`` entry: ``transformers`` (the batch loop of :class:`HFEncoder`),
    ``vllm`` (vLLM's pooling engine, :mod:`r2med_agent.retrieval.vllm_encoder`; the same tokens,
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
    """A transformers tokenizer (hub id or folder) that counts ``max_tokens`` when no
    ``tiktoken_encoding`` is set (Voyage: ``voyageai/voyage-3``); an input longer than the limit
    becomes the decoded first ``max_tokens`` token ids. When it cannot be loaded, inputs are cut to
    ``max_tokens`` characters instead (with a warning)."""
    json_inputs: bool = False
    """Send each input as R2MED's reference does (``utils.py``): after the ``max_tokens`` cut,
    newlines become spaces and the text is JSON-encoded (``json.dumps``: in double quotes,
    non-ASCII characters as ``\\uXXXX`` escapes), and that string is what the API embeds."""

    def __post_init__(self) -> None:
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


# --------------------------------------------------------------------------- instructions


def _lookup_instruction(
    table: Mapping[str, str], names: Sequence[str], family: str, domain: str
) -> str | None:
    for key in (*names, family, _INSTRUCTION_DEFAULT_KEY):
        if key and key in table:
            return table[key].replace("{domain}", domain)
    return None


def _task_keys(task_name: str) -> tuple[str, ...]:
    """The task's name, then the R2MED task behind it (``nano-Medical-Sciences`` ->
    ``Medical-Sciences``, the packaged Biology demo -> ``Biology``), so derived tasks get the
    paper's own instruction rather than the family template. Names outside the registry (a
    user's local folder) stand for themselves."""
    from r2med_agent.data import base_task_name

    if not task_name:
        return ()
    try:
        base = base_task_name(task_name)
    except ConfigError:
        return (task_name,)
    return (task_name,) if base == task_name else (task_name, base)


def _registered(task_name: str) -> bool:
    from r2med_agent.data import get_task_spec

    try:
        get_task_spec(task_name)
    except ConfigError:
        return False
    return True


def _prefix_from(fmt: str, instruction: str) -> str:
    # fmt ends with "{text}" (validated), so everything before it is the prefix.
    head = fmt[: -len("{text}")]
    return head.replace("{instruction}", instruction)


@dataclass(frozen=True)
class Prefixes:
    """The resolved text put before each kind of input for one task.

    Attributes:
        query: before the original query (instruction or fixed query prefix).
        expansion: before generated text in the HyDE/LameR/reasoning mean (the query prefix when
            ``instruction_on`` is ``both``, else nothing).
        doc: before every document.
    """

    query: str = ""
    expansion: str = ""
    doc: str = ""


def instruction_prefixes(
    spec: EncoderSpec, task_name: str = "", family: str = "", domain: str = ""
) -> Prefixes:
    """Resolve the encoder's instructions for one task.

    The query instruction is looked up by task name, then the R2MED task it is drawn from (a
    NanoR2MED split, the packaged demo), then family, then ``default``; without one the fixed
    ``query_prefix`` applies. Documents likewise (``doc_instructions`` / ``doc_prefix``).
    """
    keys = _task_keys(task_name)
    if task_name and not _registered(task_name):
        family = ""  # a task of your own: only an instruction configured for its name applies
    q_instr = _lookup_instruction(spec.query_instructions, keys, family, domain)
    query = (
        _prefix_from(spec.instruction_format, q_instr) if q_instr is not None else spec.query_prefix
    )
    d_instr = _lookup_instruction(spec.doc_instructions, keys, family, domain)
    doc = (
        _prefix_from(spec.doc_instruction_format, d_instr) if d_instr is not None else spec.doc_prefix
    )
    expansion = query if spec.instruction_on == "both" else ""
    return Prefixes(query=query, expansion=expansion, doc=doc)


# --------------------------------------------------------------------------- protocol


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


def make_encoder(
    spec: EncoderSpec | str,
    *,
    device: str | None = None,
    show_progress: bool = False,
    backend: str | None = None,
) -> Encoder:
    """Build the encoder of a registry entry (models load lazily, on the first ``encode``).

    ``backend`` (``auto``, ``transformers``, ``vllm``; None: the entry's ``backend``) picks the
    engine of an ``hf`` entry (:func:`~r2med_agent.retrieval.vllm_encoder.resolve_backend`)."""
    from r2med_agent.retrieval.vllm_encoder import VLLMEncoder, resolve_backend

    if isinstance(spec, str):
        spec = get_encoder_spec(spec)
    chosen = resolve_backend(spec, backend, device)
    if chosen == "api":
        return APIEncoder(spec, show_progress=show_progress)
    if chosen == "vllm":
        return VLLMEncoder(spec, device=device, show_progress=show_progress)
    return HFEncoder(spec, device=device, show_progress=show_progress)


# --------------------------------------------------------------------------- model paths


def resolve_model_path(model: str) -> str:
    """Map ``resource:<package>/<folder>`` to the installed folder; other ids pass through."""
    if not model.startswith("resource:"):
        return model
    rest = model[len("resource:") :]
    package, _, sub = rest.partition("/")
    try:
        root = resources.files(package)
    except ModuleNotFoundError:
        raise MissingExtraError(package.replace("_", "-"), "cpu", GPU_ALTERNATIVE) from None
    path = Path(str(root / sub)) if sub else Path(str(root))
    if not (path / "config.json").exists():
        raise ConfigError(f"model '{model}': no config.json under {path}; reinstall the package")
    return str(path)


def model_fingerprint(model: str) -> str:
    """A stable description of a model for cache keys: the id, plus for local folders (and
    packaged models) the names and sizes of its files, so replaced weights invalidate caches.
    Machine paths never enter the key."""
    if model.startswith("resource:") or Path(model).is_dir():
        try:
            path = Path(resolve_model_path(model))
        except (ConfigError, MissingExtraError):
            return model
        files = sorted(
            (p.name, p.stat().st_size) for p in path.iterdir() if p.is_file() and p.name != "README.md"
        )
        label = model if model.startswith("resource:") else path.name
        return f"{label}|{json.dumps(files)}"
    return model


# --------------------------------------------------------------------------- torch helpers


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise MissingExtraError("torch", "cpu", GPU_ALTERNATIVE) from None
    return torch


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise MissingExtraError("transformers", "cpu", GPU_ALTERNATIVE) from None
    return transformers


def _specifier(text: str) -> Any:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        return SpecifierSet(text)
    except InvalidSpecifier:
        raise ValueError(
            f"transformers: {text!r} is not a version specifier (write e.g. '==4.42.4' or '>=4.37,<5')"
        ) from None


def check_transformers_version(
    name: str, model: str, requirement: str, installed: str | None = None
) -> None:
    """Raise a ConfigError when the installed transformers does not satisfy ``requirement``.

    Args:
        name: the registry entry (for the message).
        model: the model id (for the message).
        requirement: a PEP 440 specifier (``==4.42.4``); empty means any version.
        installed: the version to check (default: the installed transformers).
    """
    if not requirement:
        return
    from packaging.version import InvalidVersion, Version

    if installed is None:
        installed = str(_import_transformers().__version__)
    try:
        ok = _specifier(requirement).contains(Version(installed), prereleases=True)
    except InvalidVersion:
        ok = False
    if not ok:
        raise ConfigError(
            f"'{name}' ({model}) needs transformers{requirement}: the model's own code does not run "
            f"on other releases, and transformers {installed} is installed. Install it, best in a "
            f"separate environment: pip install 'transformers{requirement}'"
        )


_LOAD_ERRORS = (OSError, ValueError, ImportError)
"""What ``from_pretrained`` raises for a model it cannot get: OSError (not in the cache and no hub
access, a wrong id or folder), ValueError (not a model folder it knows), ImportError (a package the
model's own code needs)."""


def model_load_error(kind: str, name: str, model: str, err: BaseException) -> ConfigError:
    """The ConfigError for a registry entry whose model cannot be loaded: what failed and the two
    ways out (hub access once, or a local copy through a user config entry)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    detail = f"{type(err).__name__}: {lines[0].rstrip('.')}" if lines else type(err).__name__
    section = f"{kind}s"
    return ConfigError(
        f"cannot load {kind} '{name}' ({model}): {detail}. Either let it download once from the "
        f"Hugging Face hub (network access, HF_HUB_OFFLINE unset; later runs use the cached copy), "
        f"or use a local copy: copy the '{name}' entry of configs/{section}.yaml under '{section}:' "
        f"in a user config file, set its model to the folder, and pass --config FILE"
    )


def load_pretrained(loader: Any, path: str, *, kind: str, name: str, model: str, **kwargs: Any) -> Any:
    """``loader(path, **kwargs)`` (a ``from_pretrained``) with load failures as a ConfigError.

    A hub id (not a local folder) is loaded from the hub cache only when the hub cannot be
    reached (checked once per process), so a model that is not downloaded fails in seconds
    instead of after huggingface_hub's retries."""
    unreachable = None
    if isinstance(path, str) and not Path(path).exists() and "local_files_only" not in kwargs:
        from r2med_agent.data.hub import hub_unreachable

        unreachable = hub_unreachable()
        if unreachable is not None:
            kwargs["local_files_only"] = True
    try:
        return loader(path, **kwargs)
    except _LOAD_ERRORS as e:
        err = model_load_error(kind, name, model, e)
        if unreachable is not None:
            err = ConfigError(f"{err} (the hub is unreachable: {unreachable})")
        raise err from e


def dtype_kwarg(dtype: Any) -> dict[str, Any]:
    """``from_pretrained``'s dtype argument under its name for the installed transformers:
    ``dtype`` since 4.56, ``torch_dtype`` before (NV-Embed-v2 needs 4.42.4)."""
    from packaging.version import Version

    version = Version(str(_import_transformers().__version__))
    return {"dtype": dtype} if version >= Version("4.56.0.dev0") else {"torch_dtype": dtype}


def resolve_devices(device: str | None) -> list[str]:
    """``None``/``"cuda"``: every visible GPU (else the CPU); ``"cuda:1"``/``"cpu"``: that one."""
    torch = _import_torch()
    if device is None or device == "cuda":
        if torch.cuda.is_available():
            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        if device == "cuda":
            raise ConfigError("device 'cuda' requested but torch sees no GPU")
        return ["cpu"]
    return [device]


def resolve_dtype(precision: str, device: str) -> Any:
    """The torch dtype the weights load in on ``device`` under ``precision`` (float32 on a CPU)."""
    torch = _import_torch()
    if device.startswith("cpu"):
        return torch.float32
    if precision == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    name = weights_dtype_name(precision)
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def resolve_autocast(precision: str, device: str) -> Any | None:
    """The ``torch.autocast`` dtype of the forward pass on ``device`` (None: no autocast, e.g. on
    a CPU, where everything runs in float32)."""
    if precision != "autocast-float16" or not device.startswith("cuda"):
        return None
    return _import_torch().float16


def precision_record(precision: str, device: str) -> dict[str, Any]:
    """What a run on ``device`` computes in under ``precision``: ``{"dtype": ...}`` plus
    ``{"autocast": "float16"}`` when the forward pass autocasts (part of embedding cache keys and
    of the results)."""
    rec: dict[str, Any] = {"dtype": str(resolve_dtype(precision, device)).removeprefix("torch.")}
    autocast = resolve_autocast(precision, device)
    if autocast is not None:
        rec["autocast"] = str(autocast).removeprefix("torch.")
    return rec


def pool(hidden: torch.Tensor, mask: torch.Tensor, method: str) -> torch.Tensor:
    """Pool token states ``(B, L, H)`` with attention mask ``(B, L)`` into float32 ``(B, H)``.

    ``mean`` sums in float32 whatever the model's dtype (a bf16 sum over 2,048 tokens keeps about
    three significant digits). ``last-token`` takes the last position whose mask is 1 (right
    padding assumed; with left padding the last position is also the last non-padding token)."""
    torch = _import_torch()
    if method == "cls":
        return hidden[:, 0].float()
    if method == "mean":
        m = mask.to(torch.float32).unsqueeze(-1)
        summed = (hidden.float() * m).sum(dim=1)
        count = m.sum(dim=1).clamp(min=1e-9)
        return summed / count
    if method == "last-token":
        positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
        last = (positions * mask.long()).argmax(dim=1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()
    raise ConfigError(f"unknown pooling '{method}'; allowed: cls, mean, last-token, model")


@dataclass
class _DenseLayer:
    """A sentence-transformers ``Dense`` module (Instructor has one after pooling)."""

    weight: Any
    bias: Any | None
    activation: str


def _read_st_dense_layers(model_path: str) -> list[_DenseLayer]:
    """Dense layers listed in a sentence-transformers ``modules.json``, if the model has any."""
    torch = _import_torch()

    def fetch(rel: str) -> Path | None:
        local = Path(model_path)
        if local.is_dir():
            p = local / rel
            return p if p.exists() else None
        try:
            from huggingface_hub import hf_hub_download
            from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
        except ImportError:
            return None
        try:
            return Path(hf_hub_download(model_path, rel))
        except (EntryNotFoundError, LocalEntryNotFoundError, OSError):
            return None

    modules_file = fetch("modules.json")
    if modules_file is None:
        return []
    layers: list[_DenseLayer] = []
    for module in json.loads(modules_file.read_text(encoding="utf-8")):
        if not str(module.get("type", "")).endswith("models.Dense"):
            continue
        folder = module["path"]
        cfg_file = fetch(f"{folder}/config.json")
        if cfg_file is None:
            raise ConfigError(f"{model_path}: Dense module '{folder}' has no config.json")
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        weights_file = fetch(f"{folder}/model.safetensors") or fetch(f"{folder}/pytorch_model.bin")
        if weights_file is None:
            raise ConfigError(f"{model_path}: Dense module '{folder}' has no weights file")
        if weights_file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(weights_file))
        else:
            state = torch.load(str(weights_file), map_location="cpu", weights_only=True)
        layers.append(
            _DenseLayer(
                weight=state["linear.weight"].float(),
                bias=state["linear.bias"].float() if "linear.bias" in state else None,
                activation=str(cfg.get("activation_function", "torch.nn.modules.linear.Identity")),
            )
        )
    return layers


def _apply_dense(layers: list[_DenseLayer], x: torch.Tensor) -> torch.Tensor:
    torch = _import_torch()
    for layer in layers:
        w = layer.weight.to(x.device, x.dtype)
        b = layer.bias.to(x.device, x.dtype) if layer.bias is not None else None
        x = torch.nn.functional.linear(x, w, b)
        act = layer.activation.rsplit(".", 1)[-1]
        if act == "Tanh":
            x = torch.tanh(x)
        elif act == "ReLU":
            x = torch.relu(x)
        elif act != "Identity":
            raise ConfigError(f"unsupported Dense activation '{layer.activation}'")
    return x


# --------------------------------------------------------------------------- HF encoder


def prefix_token_count(tokenizer: Any, prefix: str) -> int:
    """How many leading tokens of ``prefix + text`` belong to the prefix, special tokens the
    tokenizer puts in front included: ``[CLS]`` (BERT) or ``<s>`` (Llama, Mistral: GritLM masks
    ``len(tokenizer(instruction))`` tokens, BOS included), but not a special token it appends at
    the end (``[SEP]``, T5's ``</s>``), which follows the text, not the prefix.

    The prefix's own tokens are located inside its tokenisation with special tokens; everything
    up to their end counts.
    """
    with_special: list[int] = list(tokenizer(prefix)["input_ids"])
    bare: list[int] = list(tokenizer(prefix, add_special_tokens=False)["input_ids"])
    if not bare:
        return 0
    for lead in range(len(with_special) - len(bare) + 1):
        if with_special[lead : lead + len(bare)] == bare:
            return lead + len(bare)
    # A tokenizer whose template rewrites the prefix's own tokens: count what it adds in front.
    logger.debug("prefix tokens not found inside the prefix's own tokenisation; counting them alone")
    mask = tokenizer(prefix, return_special_tokens_mask=True)["special_tokens_mask"]
    lead = next((i for i, m in enumerate(mask) if not m), 0)
    return lead + len(bare)


@dataclass
class _Loaded:
    tokenizer: Any
    replicas: list[tuple[str, Any]]  # (device, model)
    dense: list[_DenseLayer]
    pad_id: int
    eos_id: int | None
    uses_token_types: bool


def encoder_token_ids(
    spec: EncoderSpec,
    tokenizer: Any,
    texts: Sequence[str],
    max_length: int,
    *,
    titles: Sequence[str] | None = None,
    token_types: bool = False,
    eos_id: int | None = None,
) -> tuple[list[list[int]], list[list[int]] | None]:
    """The token ids an encoder embeds, unpadded: each text (or (title, text) pair) cut on the
    right to ``max_length``, or to ``max_length - 1`` plus EOS with ``append_eos``; with
    ``token_types``, the segment ids of the pairs too. Both backends (transformers, vLLM) embed
    exactly these tokens."""
    limit = max_length - 1 if spec.append_eos else max_length
    kwargs: dict[str, Any] = dict(
        truncation=True if titles is None else "longest_first",
        max_length=limit,
        padding=False,
        return_attention_mask=False,
        return_token_type_ids=titles is not None and token_types,
    )
    enc = tokenizer(list(titles), list(texts), **kwargs) if titles is not None else tokenizer(list(texts), **kwargs)
    ids: list[list[int]] = enc["input_ids"]
    types: list[list[int]] | None = enc.get("token_type_ids") if titles is not None else None
    if spec.append_eos:
        eos = tokenizer.eos_token_id if eos_id is None else eos_id
        if eos is None:
            raise ConfigError(f"encoder '{spec.name}': append_eos set but the tokenizer has no EOS")
        ids = [x + [eos] for x in ids]
        if types is not None:
            types = [t + [t[-1] if t else 0] for t in types]
    return ids, types


def _batches_by_budget(sorted_lengths: Sequence[int], batch_size: int, max_length: int) -> list[tuple[int, int]]:
    """Cut a length-sorted (longest first) sequence into ``[start, end)`` batches whose padded
    size stays within ``batch_size * max_length`` tokens (at most ``8 * batch_size`` texts)."""
    budget = batch_size * max_length
    cap = batch_size * 8
    out: list[tuple[int, int]] = []
    i, n = 0, len(sorted_lengths)
    while i < n:
        longest = max(1, sorted_lengths[i])
        size = max(1, min(cap, budget // longest))
        out.append((i, min(n, i + size)))
        i += size
    return out


def _split_for_replicas(
    batches: list[tuple[int, int]], costs: Sequence[int], n_rep: int
) -> list[list[tuple[int, int]]]:
    """Deal batches to ``n_rep`` replicas as contiguous runs of roughly equal padded-token cost."""
    groups: list[list[tuple[int, int]]] = [[] for _ in range(n_rep)]
    total, acc, g = sum(costs), 0, 0
    for b, c in zip(batches, costs):
        if g < n_rep - 1 and acc >= total * (g + 1) / n_rep:
            g += 1
        groups[g].append(b)
        acc += c
    return groups


def _run_on_replicas(work: Any, n_rep: int) -> None:
    """``work(i)`` for each replica: inline for one, else in one thread per replica."""
    if n_rep == 1:
        work(0)
        return
    with ThreadPoolExecutor(max_workers=n_rep) as executor:
        for f in [executor.submit(work, r) for r in range(n_rep)]:
            f.result()


class HFEncoder:
    """A transformers encoder: length-sorted batches, ``torch.inference_mode``, one model replica
    per visible GPU (sorted batches are split across devices by threads), bf16/fp16 on GPU and
    float32 on CPU.

    Multi-GPU data parallelism cannot be exercised on a machine without GPUs; it shares every code
    path with the single-device case except the split of batches across replicas.
    """

    def __init__(
        self, spec: EncoderSpec, *, device: str | None = None, show_progress: bool = False
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.device = device
        self.show_progress = show_progress
        self._loaded: dict[str, _Loaded] = {}
        self._meta: dict[str, tuple[Any, Any]] = {}  # model id -> (tokenizer, config)
        self._lock = threading.Lock()

    # -- loading -----------------------------------------------------------------------
    def _tokenizer_and_config(self, model_id: str, path: str) -> tuple[Any, Any]:
        if model_id not in self._meta:  # read once (by check() or the first load)
            transformers = _import_transformers()
            kw = dict(kind="encoder", name=self.name, model=model_id, trust_remote_code=self.spec.trust_remote_code)
            tokenizer = load_pretrained(transformers.AutoTokenizer.from_pretrained, path, **kw)
            config = load_pretrained(transformers.AutoConfig.from_pretrained, path, **kw)
            self._meta[model_id] = (tokenizer, config)
        return self._meta[model_id]

    def doc_runtime_fields(self) -> dict[str, Any]:
        """The backend and the precision documents are encoded in (the precision as run on this
        device): part of the embedding cache key, so CPU and GPU embeddings, or those of two
        backends, never mix."""
        return {"backend": "transformers",
                **precision_record(self.spec.precision, resolve_devices(self.device)[0])}

    def check(self) -> None:
        """Fail now, with a ConfigError, if a model of this encoder cannot be loaded: the
        transformers version it needs, and its tokenizer and config (from the hub cache, the hub
        or a folder). Cheap: no weights are read, nothing goes to a GPU. A retriever calls it
        when built, so a model missing at query time fails before any LLM work."""
        _import_torch()
        for side in ("query", "doc"):
            model_id = self.spec.model_for(side)  # type: ignore[arg-type]
            if model_id in self._loaded:
                continue
            check_transformers_version(self.name, model_id, self.spec.transformers)
            self._tokenizer_and_config(model_id, resolve_model_path(model_id))

    def _load(self, side: Side) -> _Loaded:
        model_id = self.spec.model_for(side)
        with self._lock:
            if model_id in self._loaded:
                return self._loaded[model_id]
            torch = _import_torch()
            transformers = _import_transformers()
            check_transformers_version(self.name, model_id, self.spec.transformers)
            if not self.show_progress:  # transformers' own "Loading weights" bar
                transformers.utils.logging.disable_progress_bar()
            path = resolve_model_path(model_id)
            devices = resolve_devices(self.device)
            t0 = time.perf_counter()
            tokenizer, config = self._tokenizer_and_config(model_id, path)
            model_cls = (
                transformers.T5EncoderModel
                if getattr(config, "model_type", "") in ("t5", "mt5")
                else transformers.AutoModel
            )
            replicas = []
            for dev in devices:
                dtype = resolve_dtype(self.spec.precision, dev)
                model = load_pretrained(
                    model_cls.from_pretrained, path, kind="encoder", name=self.name, model=model_id,
                    trust_remote_code=self.spec.trust_remote_code, **dtype_kwarg(dtype),
                )
                model.eval()
                model.to(torch.device(dev))
                replicas.append((dev, model))
            pad_id = tokenizer.pad_token_id
            if pad_id is None:
                pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
            loaded = _Loaded(
                tokenizer=tokenizer,
                replicas=replicas,
                dense=_read_st_dense_layers(path),
                pad_id=int(pad_id),
                eos_id=tokenizer.eos_token_id,
                uses_token_types="token_type_ids" in getattr(tokenizer, "model_input_names", ()),
            )
            logger.info(
                "loaded encoder %s (%s) on %s in %.1f s",
                self.name, model_id, ", ".join(devices), time.perf_counter() - t0,
            )
            self._loaded[model_id] = loaded
            return loaded

    # -- encoding ----------------------------------------------------------------------
    def _tokenize(
        self, lo: _Loaded, texts: list[str], titles: Sequence[str] | None, max_length: int
    ) -> tuple[list[list[int]], list[list[int]] | None]:
        """Token ids per text, unpadded (plus segment ids for (title, text) pairs)."""
        return encoder_token_ids(
            self.spec, lo.tokenizer, texts, max_length, titles=titles, token_types=lo.uses_token_types,
            eos_id=lo.eos_id,
        )

    def _prefix_token_count(self, lo: _Loaded, prefix: str) -> int:
        if not prefix or not self.spec.pool_exclude_prefix:
            return 0
        return prefix_token_count(lo.tokenizer, prefix)

    def _run_batch(
        self,
        lo: _Loaded,
        dev: str,
        model: Any,
        ids: list[list[int]],
        types: list[list[int]] | None,
        n_prefix: int,
    ) -> np.ndarray:
        torch = _import_torch()
        width = max(len(x) for x in ids)
        arr = np.full((len(ids), width), lo.pad_id, dtype=np.int64)
        mask = np.zeros((len(ids), width), dtype=np.int64)
        tt = np.zeros((len(ids), width), dtype=np.int64)
        for r, x in enumerate(ids):
            arr[r, : len(x)] = x
            mask[r, : len(x)] = 1
            if types is not None:
                tt[r, : len(x)] = types[r]
        input_ids = torch.from_numpy(arr).to(dev)
        attention = torch.from_numpy(mask).to(dev)
        inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention}
        if lo.uses_token_types:
            inputs["token_type_ids"] = torch.from_numpy(tt).to(dev)
        autocast = resolve_autocast(self.spec.precision, dev)
        with torch.autocast("cuda", dtype=autocast) if autocast is not None else contextlib.nullcontext():
            out = model(**inputs, **dict(self.spec.forward_kwargs))
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
            pool_mask = attention
            if n_prefix:
                pool_mask = attention.clone()
                pool_mask[:, :n_prefix] = 0
            vec = pool(hidden, pool_mask, self.spec.pooling)
        if lo.dense:
            vec = _apply_dense(lo.dense, vec)
        if self.spec.normalize:
            vec = torch.nn.functional.normalize(vec, dim=-1)
        return vec.cpu().numpy().astype(np.float32, copy=False)

    def _encode_with_model_method(
        self, lo: _Loaded, texts: list[str], prefix: str, max_length: int
    ) -> np.ndarray:
        """``pooling: model``: the repo's own ``encode`` (NV-Embed), longest texts first, batches
        dealt to the replicas (one per GPU) as contiguous runs of similar cost, in threads."""
        torch = _import_torch()
        order = np.argsort([-len(t) for t in texts], kind="stable")
        bs = self.spec.batch_size
        batches = [(s, min(len(order), s + bs)) for s in range(0, len(order), bs)]
        costs = [(e - s) * len(texts[order[s]]) for s, e in batches]  # longest text sets the width
        groups = _split_for_replicas(batches, costs, len(lo.replicas))
        results: dict[tuple[int, int], np.ndarray] = {}

        def work(rep: int) -> None:
            _, model = lo.replicas[rep]
            for s, e in groups[rep]:
                batch = [texts[i] for i in order[s:e]]
                with torch.inference_mode():
                    emb = model.encode(batch, instruction=prefix, max_length=max_length)
                emb = torch.as_tensor(emb).float()
                if self.spec.normalize:
                    emb = torch.nn.functional.normalize(emb, dim=-1)
                results[(s, e)] = emb.cpu().numpy()

        _run_on_replicas(work, len(lo.replicas))
        sorted_out = np.concatenate([results[b] for b in batches]).astype(np.float32, copy=False)
        out = np.empty_like(sorted_out)
        out[order] = sorted_out
        return out

    def encode(
        self,
        texts: Sequence[str],
        *,
        side: Side,
        prefix: str = "",
        titles: Sequence[str] | None = None,
    ) -> np.ndarray:
        torch = _import_torch()
        lo = self._load(side)
        max_length = self.spec.max_length_for(side)
        texts = list(texts)
        if not texts:
            return np.zeros((0, 0), dtype=np.float32)
        if self.spec.pooling == "model":
            return self._encode_with_model_method(lo, texts, prefix, max_length)
        use_titles = titles if (self.spec.doc_title_pair and side == "doc") else None
        if self.spec.doc_title_pair and side == "doc" and use_titles is None:
            use_titles = [""] * len(texts)
        full = [prefix + t for t in texts] if prefix else texts
        ids, types = self._tokenize(lo, full, use_titles, max_length)
        n_prefix = self._prefix_token_count(lo, prefix)
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        order = np.argsort(-lengths, kind="stable")  # longest first: memory peaks early
        batches = _batches_by_budget(lengths[order].tolist(), self.spec.batch_size, max_length)

        groups = _split_for_replicas(
            batches, [(e - s) * int(lengths[order[s]]) for s, e in batches], len(lo.replicas)
        )
        n_rep = len(lo.replicas)

        results: list[np.ndarray | None] = [None] * len(batches)
        index_of = {b: i for i, b in enumerate(batches)}
        bar = None
        if self.show_progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(texts), desc=f"encode {self.name} ({side})", unit="text", leave=False)
        bar_lock = threading.Lock()

        def work(rep: int) -> None:
            dev, model = lo.replicas[rep]
            with torch.inference_mode():
                for s, e in groups[rep]:
                    rows = order[s:e]
                    chunk = [ids[i] for i in rows]
                    chunk_types = [types[i] for i in rows] if types is not None else None
                    results[index_of[(s, e)]] = self._run_batch(lo, dev, model, chunk, chunk_types, n_prefix)
                    if bar is not None:
                        with bar_lock:
                            bar.update(e - s)

        try:
            _run_on_replicas(work, n_rep)
        finally:
            if bar is not None:
                bar.close()
        sorted_out = np.concatenate([r for r in results if r is not None], axis=0)
        out = np.empty_like(sorted_out)
        out[order] = sorted_out
        return out


# --------------------------------------------------------------------------- API encoder


class APIEncoder:
    """An OpenAI-compatible ``POST {base_url}/embeddings`` client (OpenAI, Voyage, vLLM, TEI).

    Batches of ``batch_size`` texts, retried on transport errors, 429 and 5xx. The key is read from
    ``api_key_env`` at call time and never logged or cached.
    """

    def __init__(self, spec: EncoderSpec, *, show_progress: bool = False, timeout_s: float = 120.0) -> None:
        self.spec = spec
        self.name = spec.name
        self.show_progress = show_progress
        self.timeout_s = timeout_s
        self._encoding: Any = False  # not looked up yet
        self._hf: Any = False

    def check(self) -> None:
        """Fail now if the API key is not set (see :meth:`HFEncoder.check`)."""
        self._key()

    def _token_encoding(self) -> Any | None:
        """The tiktoken encoding for ``max_tokens``, or None (tiktoken missing or the encoding
        not loadable, e.g. offline before its first download): inputs are then cut by characters."""
        if self._encoding is not False:
            return self._encoding
        name = self.spec.tiktoken_encoding
        encoding = None
        if name:
            try:
                import tiktoken

                encoding = tiktoken.get_encoding(name)
            except ImportError:
                logger.warning(
                    "encoder '%s': tiktoken is not installed; inputs are cut to %d characters "
                    "instead of %d tokens (pip install tiktoken for exact truncation)",
                    self.name, self.spec.max_tokens, self.spec.max_tokens,
                )
            except (ValueError, OSError) as e:
                logger.warning(
                    "encoder '%s': tiktoken encoding '%s' unavailable (%s); inputs are cut to %d characters",
                    self.name, name, e, self.spec.max_tokens,
                )
        self._encoding = encoding
        return encoding

    def _hf_token_cutter(self) -> Any | None:
        """The ``hf_tokenizer`` (loaded once), or None when unset or not loadable."""
        if self._hf is not False:
            return self._hf
        tokenizer = None
        if self.spec.hf_tokenizer:
            try:
                transformers = _import_transformers()
                tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_path(self.spec.hf_tokenizer))
            except Exception as e:  # noqa: BLE001 - offline, not in the cache, no transformers
                logger.warning(
                    "encoder '%s': tokenizer '%s' unavailable (%s); inputs are cut to %d characters "
                    "instead of %d tokens", self.name, self.spec.hf_tokenizer, str(e).splitlines()[0][:200],
                    self.spec.max_tokens, self.spec.max_tokens,
                )
        self._hf = tokenizer
        return tokenizer

    def _cuts_by_tokens(self) -> bool:
        if self.spec.tiktoken_encoding:
            return self._token_encoding() is not None
        return self._hf_token_cutter() is not None

    def truncate(self, texts: list[str]) -> list[str]:
        """Cut each input to ``max_tokens`` tokens (or characters, see the field) and ``max_chars``."""
        spec = self.spec
        if spec.max_tokens:
            n = spec.max_tokens
            enc = self._token_encoding() if spec.tiktoken_encoding else None
            hf = None if spec.tiktoken_encoding else self._hf_token_cutter()
            cut = []
            for t in texts:
                if enc is not None:
                    ids = enc.encode(t, disallowed_special=())
                    cut.append(enc.decode(ids[:n]) if len(ids) > n else t)
                elif hf is not None:  # as the reference: tokenizer(text), decode(first n ids)
                    ids = hf(t)["input_ids"]
                    cut.append(hf.decode(ids[:n]) if len(ids) > n else t)
                else:
                    cut.append(t[:n])
            texts = cut
        if spec.max_chars:
            texts = [t[: spec.max_chars] for t in texts]
        return texts

    def prepare(self, texts: list[str]) -> list[str]:
        """The strings sent to the API: cut (:meth:`truncate`), then, with ``json_inputs``,
        newlines to spaces and JSON-encoded as R2MED's reference sends them; an empty input
        (which APIs reject) becomes one space."""
        texts = self.truncate(texts)
        if self.spec.json_inputs:
            return [json.dumps(t.replace("\n", " ")) for t in texts]
        return [t if t.strip() else " " for t in texts]

    def doc_runtime_fields(self) -> dict[str, Any]:
        """How inputs were truncated (tokens or characters) changes the embeddings: part of the
        embedding cache key."""
        if not self.spec.max_tokens:
            return {}
        return {"truncation": "tokens" if self._cuts_by_tokens() else "characters"}

    def _key(self) -> str:
        key = os.environ.get(self.spec.api_key_env, "")
        if not key:
            raise ConfigError(
                f"encoder '{self.name}' needs an API key: set the environment variable "
                f"{self.spec.api_key_env}"
            )
        return key

    def _post(self, client: Any, payload: dict[str, Any]) -> list[list[float]]:
        import httpx
        from tenacity import (
            retry,
            retry_if_exception,
            stop_after_attempt,
            wait_exponential,
        )

        def transient(e: BaseException) -> bool:
            if isinstance(e, httpx.TransportError):
                return True
            return isinstance(e, httpx.HTTPStatusError) and (
                e.response.status_code == 429 or e.response.status_code >= 500
            )

        @retry(
            retry=retry_if_exception(transient),
            stop=stop_after_attempt(5),
            wait=wait_exponential(multiplier=0.5, max=20),
            reraise=True,
        )
        def call() -> list[list[float]]:
            r = client.post("/embeddings", json=payload)
            r.raise_for_status()
            data = r.json().get("data")
            if not isinstance(data, list) or len(data) != len(payload["input"]):
                raise LLMError(f"encoder '{self.name}': malformed /embeddings response")
            data = sorted(data, key=lambda d: d.get("index", 0))
            return [d["embedding"] for d in data]

        try:
            return call()
        except httpx.HTTPStatusError as e:
            raise LLMError(
                f"encoder '{self.name}': {self.spec.base_url}/embeddings answered "
                f"{e.response.status_code}: {e.response.text[:300]}"
            ) from None
        except httpx.TransportError as e:
            raise LLMError(f"encoder '{self.name}': cannot reach {self.spec.base_url}: {e}") from None

    def encode(
        self,
        texts: Sequence[str],
        *,
        side: Side,
        prefix: str = "",
        titles: Sequence[str] | None = None,
    ) -> np.ndarray:
        import httpx

        spec = self.spec
        inputs = self.prepare([(prefix + t) for t in texts])
        if not inputs:
            return np.zeros((0, 0), dtype=np.float32)
        rows: list[list[float]] = []
        headers = {"Authorization": f"Bearer {self._key()}"}
        bar = None
        if self.show_progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(inputs), desc=f"embed {self.name} ({side})", unit="text", leave=False)
        try:
            with httpx.Client(base_url=spec.base_url.rstrip("/"), headers=headers, timeout=self.timeout_s) as client:
                for s in range(0, len(inputs), spec.batch_size):
                    payload: dict[str, Any] = {"model": spec.model, "input": inputs[s : s + spec.batch_size]}
                    if spec.provider == "voyage":
                        payload["input_type"] = "query" if side == "query" else "document"
                    rows.extend(self._post(client, payload))
                    if bar is not None:
                        bar.update(len(payload["input"]))
        finally:
            if bar is not None:
                bar.close()
        out = np.asarray(rows, dtype=np.float32)
        if spec.normalize:
            out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out
