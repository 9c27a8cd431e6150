"""Cross-encoder rerankers: re-score the top-k documents of a run with a cross-encoder
(bge-reranker, monoBERT) or RankLLaMA (a LoRA adapter on Llama-2 with a one-logit classification
head), as :class:`PairwiseReranker`.

Every reranker takes the whole run of a task at once: all (query, document) pairs of all queries
are tokenised, sorted by length and scored in batches, then put back in order. The reranked head
(top ``k`` by the run's order) carries the reranker's scores; the rest of each list keeps its
original order below it. The query text is the request's original query (``SearchRequest.query``).

Backends: transformers (``AutoModelForSequenceClassification``; peft for adapters) or vLLM's
scoring API (``LLM.score``), which needs a merged checkpoint: adapters are merged once into the
cache. Heavy imports are lazy; a missing package raises MissingExtraError with the extra to install.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from r2med_agent.errors import ConfigError, DataError, MissingExtraError
from r2med_agent.io import inside
from r2med_agent.paths import cache_dir
from r2med_agent.retrieval.dense.hf import _batches_by_budget
from r2med_agent.retrieval.dense.models import (
    _import_transformers,
    check_transformers_version,
    dtype_kwarg,
    load_pretrained,
    resolve_model_path,
)
from r2med_agent.retrieval.dense.tokens import bounded_token_ids
from r2med_agent.retrieval.dense.torch_utils import _import_torch, resolve_autocast, resolve_devices, resolve_dtype
from r2med_agent.retrieval.fusion import ranked
from r2med_agent.rerank.spec import RerankerSpec
from r2med_agent.types import Run, SearchRequest

__all__ = ["PairwiseReranker", "check_model_files", "merge_adapter"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- scorers


class _TransformersScorer:
    """Pairs -> scores with a transformers sequence-classification model (peft for adapters)."""

    def __init__(self, spec: RerankerSpec, device: str | None, show_progress: bool) -> None:
        self.spec = spec
        self.device = device
        self.show_progress = show_progress
        self._state: tuple[Any, list[tuple[str, Any]], int] | None = None
        self._lock = threading.Lock()

    def _load(self) -> tuple[Any, list[tuple[str, Any]], int]:
        with self._lock:
            if self._state is not None:
                return self._state
            torch = _import_torch()
            _import_transformers()  # a missing extra fails here, with the install command
            spec = self.spec
            t0 = time.perf_counter()
            tokenizer = _load_tokenizer(spec)
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
            dev = resolve_devices(self.device)[0]
            dtype = resolve_dtype(spec.precision, dev)
            model = _load_classifier(spec, dtype)
            if getattr(model.config, "pad_token_id", None) is None:
                model.config.pad_token_id = tokenizer.pad_token_id
            model.eval()
            model.to(torch.device(dev))
            logger.info("loaded reranker %s on %s in %.1f s", spec.name, dev, time.perf_counter() - t0)
            self._state = (tokenizer, [(dev, model)], int(tokenizer.pad_token_id))
            return self._state

    def check(self) -> None:
        _import_torch()
        check_model_files(self.spec)

    def score(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        if not pairs:
            return np.zeros(0, dtype=np.float32)
        torch = _import_torch()
        tokenizer, replicas, pad_id = self._load()
        dev, model = replicas[0]
        spec = self.spec
        ids, types = pair_token_ids(tokenizer, pairs, spec.max_length)
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        order = np.argsort(-lengths, kind="stable")
        batches = _batches_by_budget(lengths[order].tolist(), spec.batch_size, spec.max_length)
        out = np.empty(len(pairs), dtype=np.float32)
        bar = None
        if self.show_progress:
            from r2med_agent.progress import stage_bar

            bar = stage_bar(total=len(pairs), desc=f"rerank {spec.name}", unit="pair", leave=False)
        try:
            with torch.inference_mode():
                for s, e in batches:
                    rows = order[s:e]
                    width = int(lengths[rows[0]])
                    arr = np.full((len(rows), width), pad_id, dtype=np.int64)
                    mask = np.zeros((len(rows), width), dtype=np.int64)
                    tt = np.zeros((len(rows), width), dtype=np.int64)
                    for r, i in enumerate(rows):
                        n = len(ids[i])
                        arr[r, :n] = ids[i]
                        mask[r, :n] = 1
                        if types is not None:
                            tt[r, :n] = types[i]
                    inputs = {
                        "input_ids": torch.from_numpy(arr).to(dev),
                        "attention_mask": torch.from_numpy(mask).to(dev),
                    }
                    if types is not None:
                        inputs["token_type_ids"] = torch.from_numpy(tt).to(dev)
                    autocast = resolve_autocast(spec.precision, dev)
                    with torch.autocast("cuda", dtype=autocast) if autocast is not None else contextlib.nullcontext():
                        logits = model(**inputs).logits.float()
                    if spec.score_index >= logits.shape[-1]:
                        raise ConfigError(
                            f"reranker '{spec.name}': score_index {spec.score_index} but the model "
                            f"has {logits.shape[-1]} logit(s)"
                        )
                    out[rows] = logits[:, spec.score_index].cpu().numpy()
                    if bar is not None:
                        bar.update(len(rows))
        finally:
            if bar is not None:
                bar.close()
        return out


def pair_token_ids(
    tokenizer: Any, pairs: Sequence[tuple[str, str]], max_length: int
) -> tuple[list[list[int]], list[list[int]] | None]:
    """The (query, document) pairs' token ids (and segment ids where the tokenizer makes them),
    cut together to ``max_length`` (``longest_first``), each query and document cut first
    (:func:`~r2med_agent.retrieval.dense.tokens.bounded_token_ids`), so that a huge one costs no
    more than ``max_length`` allows."""

    def ids_of(docs: list[str], queries: list[str] | None) -> Any:
        enc = tokenizer(queries, docs, truncation="longest_first", max_length=max_length, padding=False)
        return enc["input_ids"], enc.get("token_type_ids")

    bounded = bounded_token_ids(tokenizer, [d for _, d in pairs], max_length, ids_of, titles=[q for q, _ in pairs])
    return bounded.ids, bounded.types


def _load_tokenizer(spec: RerankerSpec) -> Any:
    model = spec.base_model or spec.model
    return load_pretrained(
        _import_transformers().AutoTokenizer.from_pretrained, resolve_model_path(model),
        kind="reranker", name=spec.name, model=model, trust_remote_code=spec.trust_remote_code,
    )


def _import_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise MissingExtraError("peft", "rerank") from None
    return peft


def check_model_files(spec: RerankerSpec) -> None:
    """Raise now (ConfigError, MissingExtraError) if the reranker's model cannot be loaded: its
    tokenizer and config, and for a LoRA adapter peft and the adapter's config. No weights are
    read and nothing goes to a GPU, so this can run before an LLM takes the GPU's memory."""
    transformers = _import_transformers()
    check_transformers_version(spec.name, spec.model, spec.transformers)
    _load_tokenizer(spec)
    model = spec.base_model or spec.model
    kw = dict(kind="reranker", name=spec.name, trust_remote_code=spec.trust_remote_code)
    config = load_pretrained(transformers.AutoConfig.from_pretrained, resolve_model_path(model), model=model, **kw)
    architectures = list(getattr(config, "architectures", None) or [])
    if spec.base_model is None and architectures and not any(_classifies(a) for a in architectures):
        raise ConfigError(_no_head_message(spec, f"its config names the architecture {architectures[0]}, "
                                                 "not a sequence classifier"))
    if spec.base_model is not None:
        peft = _import_peft()
        load_pretrained(peft.PeftConfig.from_pretrained, resolve_model_path(spec.model), kind="reranker",
                        name=spec.name, model=spec.model)


def _load_classifier(spec: RerankerSpec, dtype: Any) -> Any:
    transformers = _import_transformers()
    check_transformers_version(spec.name, spec.model, spec.transformers)
    kw = dict(kind="reranker", name=spec.name, trust_remote_code=spec.trust_remote_code, **dtype_kwarg(dtype))
    auto = transformers.AutoModelForSequenceClassification
    if spec.base_model is None:
        with _quiet_load_report(transformers):
            model, info = load_pretrained(auto.from_pretrained, resolve_model_path(spec.model), model=spec.model,
                                          output_loading_info=True, **kw)
        prefix = f"{getattr(model, 'base_model_prefix', '')}."
        head = sorted(k for k in info.get("missing_keys", ()) if prefix == "." or not k.startswith(prefix))
        if head:
            raise ConfigError(_no_head_message(spec, f"its weights have no {', '.join(head[:4])}"))
        return model
    peft = _import_peft()
    base = load_pretrained(
        auto.from_pretrained, resolve_model_path(spec.base_model), model=spec.base_model, num_labels=1, **kw
    )
    adapter = load_pretrained(
        peft.PeftModel.from_pretrained, base, kind="reranker", name=spec.name, model=spec.model,
        model_id=resolve_model_path(spec.model),
    )
    return adapter.merge_and_unload()


def _classifies(architecture: str) -> bool:
    return architecture.endswith("ForSequenceClassification")


def _no_head_message(spec: RerankerSpec, why: str) -> str:
    """Why a checkpoint cannot be a cross-encoder: no trained classification head (a bi-encoder
    such as a sentence embedder would be scored by a randomly initialised head)."""
    return (
        f"reranker '{spec.name}': {spec.model} has no trained classification head ({why}), so a "
        "cross-encoder would score pairs with random weights. Point 'model' at a cross-encoder "
        "checkpoint (a *ForSequenceClassification model trained for relevance, e.g. "
        "BAAI/bge-reranker-v2-m3); a sentence embedder belongs under 'encoders:' as a --retriever"
    )


@contextlib.contextmanager
def _quiet_load_report(transformers: Any) -> Any:
    """transformers' own report of missing weights (in terminal colours) is left out: a missing
    head is refused with the reranker's name instead."""
    logging_ = getattr(transformers, "logging", None)
    if logging_ is None or not hasattr(logging_, "get_verbosity"):
        yield
        return
    before = logging_.get_verbosity()
    logging_.set_verbosity_error()
    try:
        yield
    finally:
        logging_.set_verbosity(before)


def merge_adapter(spec: RerankerSpec, out_dir: Path) -> Path:
    """Merge a LoRA reranker into its base model and save it (for vLLM, which loads full models)."""
    torch = _import_torch()
    transformers = _import_transformers()
    model = _load_classifier(spec, torch.float16)
    if getattr(model.config, "pad_token_id", None) is None:
        tok = transformers.AutoTokenizer.from_pretrained(resolve_model_path(spec.base_model or spec.model))
        model.config.pad_token_id = tok.unk_token_id if tok.unk_token_id is not None else tok.eos_token_id
    tmp = out_dir.with_name(out_dir.name + ".partial")
    model.save_pretrained(tmp)
    transformers.AutoTokenizer.from_pretrained(
        resolve_model_path(spec.base_model or spec.model)
    ).save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError:
        raise MissingExtraError("vllm", "vllm") from None
    return vllm


class _VLLMScorer:
    """Pairs -> scores through vLLM's offline scoring API (``LLM.score``): one score per pair,
    so one-logit heads only (``PairwiseReranker`` routes other heads to transformers).

    Not exercised on machines without a GPU and vLLM; the transformers path is the tested one.
    """

    def __init__(self, spec: RerankerSpec) -> None:
        self.spec = spec
        self._llm: Any = None

    def check(self) -> None:
        _import_vllm()
        check_model_files(self.spec)

    def _load(self) -> Any:
        if self._llm is not None:
            return self._llm
        vllm = _import_vllm()
        path = resolve_model_path(self.spec.model)
        if self.spec.base_model is not None:
            merged = inside(cache_dir() / "merged", self.spec.name)
            if not merged.exists():
                logger.info("merging %s into %s once, for vLLM", self.spec.model, merged)
                merged.parent.mkdir(parents=True, exist_ok=True)
                merge_adapter(self.spec, merged)
            path = str(merged)
        kwargs: dict[str, Any] = dict(
            model=path, max_model_len=self.spec.max_length, trust_remote_code=self.spec.trust_remote_code
        )
        if self.spec.precision != "auto":  # vLLM has no autocast: the weights' dtype
            kwargs["dtype"] = self.spec.dtype
        try:
            self._llm = vllm.LLM(runner="pooling", **kwargs)
        except TypeError:  # vLLM < 0.10 names it task="score"
            self._llm = vllm.LLM(task="score", **kwargs)
        return self._llm

    def score(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        if not pairs:
            return np.zeros(0, dtype=np.float32)
        llm = self._load()
        outputs = llm.score([q for q, _ in pairs], [d for _, d in pairs], truncate_prompt_tokens=self.spec.max_length)
        return np.asarray([o.outputs.score for o in outputs], dtype=np.float32)


# --------------------------------------------------------------------------- reranker


class PairwiseReranker:
    """A pointwise reranker over (query, document) pairs: cross-encoders and RankLLaMA.

    Args:
        spec: the registry entry.
        device: as for encoders (the first device is used).
        backend: override the entry's backend.
        show_progress: a tqdm bar over pairs.
    """

    batches_tasks = False

    def __init__(
        self,
        spec: RerankerSpec,
        *,
        device: str | None = None,
        backend: str | None = None,
        show_progress: bool = False,
    ) -> None:
        self.spec = spec
        self.name = spec.name
        chosen = backend or spec.backend
        if chosen not in ("auto", "transformers", "vllm"):
            raise ConfigError(f"reranker backend '{chosen}' is not one of: auto, transformers, vllm")
        # vLLM's score API gives one number per pair (a one-logit head); a head whose relevance is
        # another logit (monoBERT's two-way head, score_index 1) is scored with transformers.
        if chosen == "vllm" and spec.score_index != 0:
            raise ConfigError(
                f"reranker '{spec.name}' scores with logit {spec.score_index} of a multi-logit head, "
                "which vLLM's score API does not expose; set 'backend: transformers' (or 'auto') in its entry"
            )
        if chosen == "auto":
            chosen = "vllm" if spec.score_index == 0 and _vllm_usable() else "transformers"
        self.backend = chosen
        self._scorer: _TransformersScorer | _VLLMScorer = (
            _VLLMScorer(spec) if chosen == "vllm" else _TransformersScorer(spec, device, show_progress)
        )

    def check(self) -> None:
        """Fail now, with a ConfigError or MissingExtraError, if the model cannot be loaded
        (tokenizer, config, adapter; no weights read). The runner calls it before any LLM work."""
        self._scorer.check()

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """Relevance score of each (query text, document text) pair, templates applied here."""
        spec = self.spec
        formatted = [
            (spec.query_template.replace("{query}", q), spec.doc_template.replace("{text}", d))
            for q, d in pairs
        ]
        return self._scorer.score(formatted)

    def rerank(
        self, requests: Sequence[SearchRequest], run: Run, corpus: Mapping[str, str], k: int
    ) -> Run:
        heads: list[tuple[str, list[tuple[str, float]], list[tuple[str, float]]]] = []
        pairs: list[tuple[str, str]] = []
        for req in requests:
            items = ranked(run.get(req.query_id, {}))
            head, tail = items[:k], items[k:]
            for doc_id, _ in head:
                if doc_id not in corpus:
                    raise DataError(f"query {req.query_id}: document '{doc_id}' of the run is not in the corpus")
                pairs.append((req.query, corpus[doc_id]))
            heads.append((req.query_id, head, tail))
        t0 = time.perf_counter()
        scores = self.score_pairs(pairs)
        logger.info("%s: %d pairs scored in %.1f s", self.name, len(pairs), time.perf_counter() - t0)
        out: Run = {}
        pos = 0
        for qid, head, tail in heads:
            s = scores[pos : pos + len(head)]
            pos += len(head)
            order = sorted(range(len(head)), key=lambda i: (-float(s[i]), i))
            new = {head[i][0]: float(s[i]) for i in order}
            floor = min(new.values()) if new else 0.0
            for j, (doc_id, _) in enumerate(tail, start=1):
                new[doc_id] = floor - j
            out[qid] = new
        return out


def _vllm_usable() -> bool:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        torch = _import_torch()
    except MissingExtraError:
        return False
    return bool(torch.cuda.is_available())
