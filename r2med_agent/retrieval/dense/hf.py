"""The transformers backend (:class:`HFEncoder`): length-sorted batches on a token budget, one
model replica per visible GPU, sentence-transformers Dense layers after pooling.

torch and transformers are imported inside functions; a missing one raises
:class:`~r2med_agent.errors.MissingExtraError` naming the ``cpu`` extra (``gpu`` on CUDA machines).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from r2med_agent.errors import ConfigError
from r2med_agent.retrieval.dense.models import (
    _import_transformers,
    check_transformers_version,
    dtype_kwarg,
    load_pretrained,
    resolve_model_path,
)
from r2med_agent.retrieval.dense.spec import EncoderSpec, Side
from r2med_agent.retrieval.dense.tokens import (  # noqa: F401 - the bounds, re-exported
    CHARS_PER_TOKEN_BOUND,
    MAX_CHARS_PER_TOKEN,
    bounded_token_ids,
    encoder_token_ids,
    prefix_token_count,
)
from r2med_agent.retrieval.dense.torch_utils import (
    _import_torch,
    pool,
    precision_record,
    resolve_autocast,
    resolve_devices,
    resolve_dtype,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger(__name__)


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


@dataclass


class _Loaded:
    tokenizer: Any
    replicas: list[tuple[str, Any]]  # (device, model)
    dense: list[_DenseLayer]
    pad_id: int
    eos_id: int | None
    uses_token_types: bool


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
            own = self.spec.hf_tokenizer  # another model's tokenizer (RaDeR's BRIGHT code)
            tokenizer = load_pretrained(transformers.AutoTokenizer.from_pretrained,
                                        resolve_model_path(own) if own else path, **kw)
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
        """Token ids per text, unpadded (plus segment ids for (title, text) pairs); each text and
        title cut first (:func:`~r2med_agent.retrieval.dense.tokens.bounded_token_ids`), so the
        cost is bounded by ``max_length`` whatever a text holds."""

        def ids_of(cut: list[str], cut_titles: list[str] | None) -> Any:
            return encoder_token_ids(self.spec, lo.tokenizer, cut, max_length, titles=cut_titles,
                                     token_types=lo.uses_token_types, eos_id=lo.eos_id)

        bounded = bounded_token_ids(lo.tokenizer, texts, max_length, ids_of, titles=titles)
        return bounded.ids, bounded.types

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
        # A text of no tokens at all (an empty document under a tokenizer that adds no special
        # tokens) has nothing to pool: it embeds as the zero vector, whatever else is in the batch
        # (one padding position keeps the model's input non-empty when the whole batch is such).
        width = max(1, max(len(x) for x in ids))
        empty = [r for r, x in enumerate(ids) if not x]
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
        out = vec.cpu().numpy().astype(np.float32, copy=False)
        if empty:
            out = out.copy()
            out[empty] = 0.0
        return out

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
            from r2med_agent.progress import stage_bar

            bar = stage_bar(total=len(texts), desc=f"encode {self.name} ({side})", unit="text", leave=False)
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
