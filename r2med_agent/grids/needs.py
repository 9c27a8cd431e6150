"""What a grid entry needs to run: GPU memory, API keys, hub access, separate environments, tokens."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from r2med_agent.config import build, load_yaml
from r2med_agent.errors import ConfigError
from r2med_agent.experiment.plan import RunPlan
from r2med_agent.methods.base import capabilities
from r2med_agent.paths import configs_dir
from r2med_agent.retrieval.fusion import member_names

logger = logging.getLogger(__name__)
from r2med_agent.grids.estimates import EncodeEstimate, TokenEstimate, encode_estimate, token_estimate
from r2med_agent.grids.grid import BYTES_PER_PARAM, GPU_GIB, GridEntry, released_llms

# ----------------------------------------------------------------------------------------------
# What an entry needs


@dataclass(frozen=True)
class ModelInfo:
    """Size and access of one model a grid names (``configs/reproduce/models.yaml``).

    Hub ids, API key variables and tensor parallelism come from the registries (llms.yaml,
    encoders.yaml, rerankers.yaml); this adds what they do not record.

    Attributes:
        name: the registry name (``qwen-72b``, ``nv``, ``monobert``).
        params_b: parameters in billions (for the bf16 weight estimate).
        gated: a hub repo it needs is gated (accept the licence on the hub, set ``HF_TOKEN``).
        note: shown by ``--dry-run``.
        dtype: the weights' type where the checkpoint ships in another than bf16 (``fp8``):
            the memory estimate uses it.
        price_per_mtok: an embedding API's USD per million input tokens (0: none known), for
            the encoding estimate (:func:`~r2med_agent.grids.estimates.encode_estimate`).
    """

    name: str
    params_b: float
    gated: bool = False
    note: str = ""
    dtype: str = ""
    price_per_mtok: float = 0.0


def load_models() -> dict[str, ModelInfo]:
    """``configs/reproduce/models.yaml`` as ``{name: ModelInfo}``."""
    path = configs_dir() / "reproduce" / "models.yaml"
    doc = load_yaml(path) or {}
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{path}: expected a mapping of model name -> fields")
    return {str(k): build(ModelInfo, {"name": str(k), **(v or {})}, f"{path}: {k}") for k, v in doc.items()}


def weights_gib(params_b: float) -> float:
    """bf16 weight memory in GiB of a model with ``params_b`` billion parameters."""
    return params_b * 1e9 * BYTES_PER_PARAM / 2**30


@dataclass(frozen=True)
class Needs:
    """What running one entry needs, for ``--dry-run``."""

    gpu: tuple[str, ...]
    api_keys: tuple[str, ...]
    hub: tuple[str, ...]
    problems: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    """How the row runs: where its generations come from, each model's precision and the
    environment it needs, the reranking depth, LameR's first pass."""
    split: tuple[str, ...] = ()
    """The recipe, line by line, when the LLM and a retriever or reranker need transformers
    versions no single environment has (:func:`split_recipe`)."""
    estimates: tuple[TokenEstimate, ...] = ()
    """LLM calls and tokens of the LLM stages (:func:`token_estimate`), where an entry has them."""
    encoding: tuple[EncodeEstimate, ...] = ()
    """The dense encoders' documents and queries (:func:`encode_estimate`), where the tasks'
    counts are known."""

    @property
    def tokens(self) -> tuple[str, ...]:
        """Each of :attr:`estimates` as its ``--dry-run`` line."""
        return tuple(e.line() for e in self.estimates)

    def lines(self) -> list[str]:
        out = list(self.setup)
        out.append(f"GPU: {'; '.join(self.gpu) if self.gpu else 'none (CPU only)'}")
        out += [f"tokens: {t}" for t in self.tokens]
        out += [f"encoding: {e.line()}" for e in self.encoding]
        out.append(f"API keys: {', '.join(self.api_keys) if self.api_keys else 'none'}")
        out.append(f"hub access: {'; '.join(self.hub) if self.hub else 'none'}")
        out += [f"PROBLEM: {p}" for p in self.problems]
        out += self.split
        return out


VLLM_TRANSFORMERS = "5.16"
"""The oldest transformers the vLLM releases this project is tested with accept (vLLM 0.32
pins >= 5.16.1); an encoder or reranker whose ``transformers`` specifier excludes it cannot
share an environment with the vLLM engine."""


def split_recipe(entry: GridEntry, plan: RunPlan, llm_spec: Any, pins: Mapping[str, str]) -> tuple[str, ...]:
    """How to run ``entry`` when its vLLM LLM and the models in ``pins`` (name -> transformers
    specifier, each excluding vLLM's) need separate environments: vLLM serves the model in its
    own environment, r2med-agent runs beside NV-Embed/GritLM in another and reaches it over
    HTTP (loops included: turns are continued as raw text rendered by the model's own chat
    template). Expansion methods can instead generate in the vLLM environment first: the
    generation cache then serves every text to the second environment, which never loads vLLM."""
    which = ", ".join(f"'{n}' needs transformers{spec}" for n, spec in pins.items())
    served = f"{entry.llm}-served"
    tp = getattr(llm_spec, "tensor_parallel_size", 1)
    lines = [
        f"SPLIT ENVIRONMENTS: vLLM needs transformers >= {VLLM_TRANSFORMERS}, {which}; one "
        f"environment cannot hold both:",
        f"  env 1 (pip install vllm): python -m vllm.entrypoints.openai.api_server --model "
        f"{llm_spec.model} --tensor-parallel-size {tp} --host 127.0.0.1 --port 8000",
        f"  env 2 (r2med-agent with those pins): a user-config entry {served}: {{backend: openai, "
        f"server: vllm, model: {llm_spec.model}, base_urls: [http://127.0.0.1:8000/v1]}} plus "
        f"{entry.llm}'s reasoning_format, system_prompt and sampling fields, then this command "
        f"with --llm {served}",
    ]
    if not capabilities(plan.method).agentic:
        lines.append(
            "  or generate first in env 1 (r2med-agent + vllm): the same command with "
            "--retriever bm25 fills the generation cache; this command in env 2 (same "
            "R2MED_CACHE_DIR) then makes no LLM call and never loads vLLM"
        )
    return tuple(lines)



def _excludes_vllm(spec: str) -> bool:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    if not spec:
        return False
    try:
        return not SpecifierSet(spec).contains(f"{VLLM_TRANSFORMERS}.1", prereleases=True)
    except InvalidSpecifier:
        return False


_GATED = " [gated: accept its licence on the hub, set HF_TOKEN]"


_PRECISIONS = {"float32": ("fp32", 4), "float16": ("fp16", 2), "bfloat16": ("bf16", 2), "fp8": ("fp8", 1),
               "auto": ("bf16/fp16 (auto: bf16 where the GPU has it)", 2)}


def model_precision(spec: Any) -> tuple[str, int]:
    """``(label, bytes per parameter)`` of an encoder or reranker entry: its ``precision`` field
    where the registry has one (the reference's precision), else its ``dtype``."""
    value = str(getattr(spec, "precision", "") or getattr(spec, "dtype", "auto") or "auto")
    if value in _PRECISIONS:
        return _PRECISIONS[value]
    return value, 4 if "32" in value else 2


def _gpu_line(
    role: str, name: str, info: ModelInfo, tp: int, gpu_gib: float, precision: tuple[str, int] = ("bf16", 2)
) -> str:
    """``≈X GiB <precision> weights`` (over ``tp`` GPUs), flagged when a share does not fit one
    GPU with a fifth more for activations and KV cache."""
    w = weights_gib(info.params_b) * precision[1] / BYTES_PER_PARAM
    per_gpu = w / tp
    line = f"{role} {name} ≈{w:.1f} GiB {precision[0].split(' ')[0]} weights"
    if tp > 1:
        line += f", tensor-parallel {tp} -> ≈{per_gpu:.1f} GiB/GPU"
    if role == "LLM":
        line += " + KV cache"
    if per_gpu * 1.2 > gpu_gib:
        line += f" (does not fit one {gpu_gib:.0f} GiB GPU)"
    if info.note:
        line += f" [{info.note}]"
    return line


def dataset_repos(tasks: Sequence[str], data_dir: Path | None = None) -> list[str]:
    """Hub dataset repos the tasks load from (none with a local ``data_dir``)."""
    if data_dir is not None:
        return []
    from r2med_agent.data import get_task_spec, task_registry

    registry = task_registry()
    specs = [registry.get(t) or get_task_spec(t) for t in tasks]
    return list(dict.fromkeys(s.repo for s in specs if s.source != "package"))


def entry_needs(
    entry: GridEntry,
    plan: RunPlan,
    datasets: Sequence[str] = (),
    gpu_gib: float = GPU_GIB,
    models: Mapping[str, ModelInfo] | None = None,
    generations: str = "fresh",
    n_queries: int = 0,
    tasks: Sequence[str] = (),
) -> Needs:
    """How an entry runs and the GPU memory, API keys and hub access it needs. An entry scored
    from R2MED's released generations runs no LLM: no LLM weights, keys, tokens or
    split-environment recipe are listed for it.

    Backends, hub ids, API key variables and tensor parallelism come from the row's plan (its
    LLM, encoder and reranker entries, looked up once in resolution); sizes and gating from
    configs/reproduce/models.yaml. Names missing from either are reported as problems.

    Args:
        entry: the grid entry.
        plan: the entry's run plan (:func:`~r2med_agent.experiment.resolve.resolve`).
        datasets: hub dataset repos its tasks load from (:func:`dataset_repos`).
        gpu_gib: memory of one GPU.
        models: ``configs/reproduce/models.yaml`` (:func:`load_models`; read here when not given).
        generations: ``r2med`` when the entry scores R2MED's released generations (no LLM).
        n_queries: queries of the planned tasks, for the token estimate (0: none).
        tasks: the planned tasks: an encoder runs its BRIGHT settings (``EncoderSpec.bright``:
            precision, tokenizer) when they are BRIGHT's.
    """
    if entry.generations == "bright" and entry.uses_llm:
        generations = "bright"  # BRIGHT's released reasoning queries, always (GridEntry.generations_mode)
    models = load_models() if models is None else models
    found = _NeedsFinder(entry, plan, models, gpu_gib, tasks)
    found.generations(generations)
    found.retrievers()
    found.reranker()
    llm_spec = plan.llm if entry.llm else None
    others = sum(v for role, v in found.per_gpu.items() if role not in ("LLM", "reranker LLM"))
    if "LLM" in found.per_gpu and others > 0 and llm_spec is not None:
        found.gpu.append(_together_line(found.per_gpu["LLM"], others, llm_spec.gpu_memory_utilization, gpu_gib))
    if datasets:
        found.hub.append(f"datasets {', '.join(datasets)}")
    # Released generations: the method's LLM never runs, so nothing is served or split off.
    released = generations in ("r2med", "bright")
    split = found.split_environments(llm_spec if not released else None)
    estimates = tuple(token_estimate(entry, n_queries, plan, models, released=released)) if n_queries else ()
    return Needs(tuple(found.gpu), tuple(dict.fromkeys(found.keys)), tuple(found.hub), tuple(found.problems),
                 tuple(found.setup), split, estimates, tuple(found.encoding))


class _NeedsFinder:
    """Collects an entry's needs, one part of the entry at a time."""

    def __init__(self, entry: GridEntry, plan: RunPlan, models: Mapping[str, ModelInfo], gpu_gib: float,
                 tasks: Sequence[str] = ()) -> None:
        from r2med_agent.retrieval.dense.instructions import is_bright_task

        self.entry, self.plan, self.models, self.gpu_gib = entry, plan, models, gpu_gib
        self.on_bright = any(is_bright_task(t) for t in tasks)
        self.tasks = tuple(tasks)
        self.encoding: list[EncodeEstimate] = []
        self.gpu: list[str] = []
        self.keys: list[str] = []
        self.hub: list[str] = []
        self.problems: list[str] = []
        self.setup: list[str] = []
        self.per_gpu: dict[str, float] = {}  # role -> GiB of weights on one GPU

    def weights(self, role: str, name: str, repos: Sequence[str], tp: int = 1,
                precision: tuple[str, int] = ("bf16", BYTES_PER_PARAM)) -> None:
        info = self.models.get(name)
        if info is None:
            self.problems.append(f"no size for {role} '{name}' in configs/reproduce/models.yaml")
        else:
            if info.dtype:
                precision = _PRECISIONS.get(info.dtype, (info.dtype, BYTES_PER_PARAM))
            self.gpu.append(_gpu_line(role, name, info, tp, self.gpu_gib, precision))
            share = weights_gib(info.params_b) * precision[1] / BYTES_PER_PARAM / tp
            self.per_gpu[role] = self.per_gpu.get(role, 0.0) + share
        gated = _GATED if info is not None and info.gated else ""
        self.hub.append(f"{', '.join(repos)} (weights){gated}")

    def llm_needs(self, role: str, name: str, spec: Any) -> bool:
        """An API LLM's key or a vLLM model's weights; False for another backend."""
        if spec.backend == "openai":
            if spec.api_key_env:
                self.keys.append(spec.api_key_env)
            if getattr(spec, "server", "") == "vllm" and name in self.models:
                # An entry served by the user's own `vllm serve` (a LoRA adapter on its base model).
                self.setup.append(f"{role} {name}: served by your own `vllm serve` (the command is in "
                                  "its configs/llms.yaml entry)")
                self.weights(role, name, [m for m in (getattr(spec, "tokenizer", None), spec.model) if m][:1])
        elif spec.backend == "vllm":
            self.weights(role, name, [spec.model], spec.tensor_parallel_size)
        else:
            return False
        return True

    def generations(self, generations: str) -> None:
        from r2med_agent.data.released import released_path

        entry = self.entry
        if entry.llm and generations == "bright":
            from r2med_agent.data.bright import reasoning_config

            self.setup.append(
                f"generations: BRIGHT's released reasoning queries of {entry.llm} ({reasoning_config(entry.llm)}/ "
                "of its hub repo at the task's pinned revision, or --data-dir); no LLM runs"
            )
            return
        if entry.llm and generations == "r2med":
            self.setup.append(
                f"generations: released by R2MED ({released_path(entry.method, entry.llm)} of each task, from "
                "its hub repo at the pinned revision or --data-dir); no LLM runs"
            )
            return
        if not entry.llm:
            return
        released = entry.llm in released_llms().get(entry.method, ())
        self.setup.append(f"generations: fresh with {entry.llm}"
                          + (" (--generations fresh)" if released else " (R2MED released none for this row)"))
        if capabilities(self.plan.method).needs_first_pass:
            self.setup.append(f"LameR first pass: {entry.args.get('first_pass', 'bm25')} top 10")
        spec = self.plan.llm
        if spec is None:
            self.problems.append(f"unknown LLM '{entry.llm}' (not in configs/llms.yaml or the user config)")
        elif not self.llm_needs("LLM", entry.llm, spec):
            self.problems.append(f"LLM '{entry.llm}' runs on the {spec.backend} backend (no GPU estimate)")

    def retrievers(self) -> None:
        from r2med_agent.retrieval import BM25_SPECS
        from r2med_agent.retrieval.candidates import DENSE_ENCODER, REBUILT, SHIPPED

        for part in member_names(self.entry.retriever):
            if part in BM25_SPECS or part in SHIPPED or part == "candidates":  # given run files: no model
                continue
            if part in REBUILT:  # the shipped BM25 list fused with the dense encoder's ranking
                part = DENSE_ENCODER
            enc = self.plan.encoder(part)
            if enc is None:
                self.problems.append(f"unknown retriever '{part}' (not bm25 and not in configs/encoders.yaml)")
            elif enc.kind == "api":
                if enc.api_key_env:
                    self.keys.append(enc.api_key_env)
                self.encodes(part, enc)
            else:
                if self.on_bright and enc.bright:
                    enc = enc.on_bright()  # its settings on BRIGHT's tasks
                repos = list(dict.fromkeys(m for m in (enc.model, enc.query_model, enc.doc_model) if m))
                precision = model_precision(enc)
                line = f"retriever {part}: {', '.join(repos)} in {precision[0]}"
                if enc.hf_tokenizer:
                    line += f", texts through {enc.hf_tokenizer}'s tokenizer"
                    self.hub.append(f"{enc.hf_tokenizer} (tokenizer)")
                if getattr(enc, "transformers", ""):
                    line += (f"; needs transformers{enc.transformers}, best in a separate environment "
                             "(the run stops with the pip command otherwise)")
                self.setup.append(line)
                self.weights("encoder", part, repos, precision=precision)
                self.encodes(part, enc)

    def encodes(self, name: str, spec: Any) -> None:
        """The encoder's work over the planned tasks, where their counts are known."""
        estimate = encode_estimate(name, spec, self.tasks, self.models.get(name))
        if estimate is not None:
            self.encoding.append(estimate)

    def reranker(self) -> None:
        entry = self.entry
        if not entry.reranker:
            return
        rr = self.plan.reranker
        if rr is None:
            self.problems.append(f"unknown reranker '{entry.reranker}' (not in configs/rerankers.yaml)")
        elif rr.kind_of.uses_llm:
            rspec = self.plan.reranker_llm
            if rspec is None:
                self.problems.append(f"reranker '{entry.reranker}': unknown LLM '{rr.llm}'")
            elif rr.llm != entry.llm or rspec.backend != "vllm":
                # A vLLM reranker LLM loads after the method's LLM is done with (the same engine
                # when it is the same model).
                self.llm_needs("reranker LLM", rr.llm, rspec)
        elif rr.kind_of.has_model:
            precision = model_precision(rr)
            k = entry.args.get("rerank_k", 100)
            kept = f"keeps only those {k}" if entry.args.get("rerank_cut") else "keeps the rest below them"
            self.setup.append(f"reranker {entry.reranker} in {precision[0]}: re-scores the top {k} of "
                              f"{entry.retriever} and {kept}")
            self.weights("reranker", entry.reranker, [m for m in (rr.model, rr.base_model) if m], precision=precision)

    def split_environments(self, llm_spec: Any) -> tuple[str, ...]:
        """The split-environment recipe when a model pins a transformers vLLM cannot take."""
        entry, plan = self.entry, self.plan
        if llm_spec is None or llm_spec.backend != "vllm":
            return ()
        pins = {}
        for part in member_names(entry.retriever):
            enc = plan.encoder(part)
            if enc is not None and _excludes_vllm(getattr(enc, "transformers", "")):
                pins[part] = enc.transformers
        rr = plan.reranker if entry.reranker else None
        if rr is not None and _excludes_vllm(getattr(rr, "transformers", "")):
            pins[entry.reranker] = rr.transformers
        return split_recipe(entry, plan, llm_spec, pins) if pins else ()


def _together_line(llm_gib: float, others_gib: float, utilization: float, gpu_gib: float) -> str:
    """The estimate for a vLLM LLM and GPU encoders/rerankers sharing a GPU: weights plus a fifth
    for activations and KV cache, and whether vLLM's reservation leaves the others room."""
    total = (llm_gib + others_gib) * 1.2
    line = (
        f"together (estimate, if resident at once): ≈{llm_gib:.1f} GiB LLM share + ≈{others_gib:.1f} GiB "
        f"encoder/reranker weights, ≈{total:.1f} GiB with a fifth for activations and KV cache"
    )
    if total > gpu_gib:
        return line + f" (does not fit one {gpu_gib:.0f} GiB GPU)"
    room = (1.0 - utilization) * gpu_gib
    if others_gib * 1.2 > room:
        most = (gpu_gib - others_gib * 1.2) / gpu_gib
        line += (
            f"; vLLM reserves {utilization:.0%} of the GPU (gpu_memory_utilization), leaving ≈{room:.1f} GiB: "
            f"set it to at most {most:.2f} in the LLM's registry entry"
        )
    return line


