"""Reproduction grids: each published R2MED configuration beside the command that reproduces it.

In the spirit of pyserini's ``2cr/*.yaml``: ``configs/reproduce/<table>.yaml`` lists the run
arguments of every configuration of one of the paper's tables beside the per-task nDCG@10 it must
reproduce (``ndcg_at_10``). A package grid must give all 8 tasks, equal to the packaged published
CSV (loading checks both; the comparison table reads the CSV). ``--dry-run`` prints each command
with its scores and what it needs: GPU memory (sizes from ``configs/reproduce/models.yaml``), API
keys and hub access (from the LLM, encoder and reranker registries).

Grid file::

    title: Generation-augmented retrieval (HyDE, Query2Doc, LameR)
    entries:
      - {method: hyde, llm: qwen-7b, retriever: bm25-compat, published: {retriever: bm25},
         ndcg_at_10: {Biology: 0.21817, Bioinformatics: 0.26437, ...}}
      - {method: none, retriever: nv, reranker: monobert, args: {rerank_k: 100}, ndcg_at_10: {...}}

``published`` names the CSV row where the run's names differ from it. A grid of your own may leave
``ndcg_at_10`` out: the CSV's scores of the entry's published name are used (none when it has none).

:func:`reproduce` runs each entry through :func:`_run_one` (the runner, in-process), skipping
tasks whose result files exist and were made with the entry's settings, then returns the
side-by-side comparison table. A result file made otherwise is *stale* and is run again: its
recorded ``config`` differs from the entry's run config in a setting that decides the scores
(STALE_KEYS), or its data differs (local and package data: the ``corpus_fingerprint`` of the
corpus the entry would load; hub data: the ``source``, a pinned ``repo@revision``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from r2med_agent.compare import (
    NO_LLM,
    ComparisonTable,
    PublishedKey,
    build_table,
    load_results,
    published_results,
    r2med_tasks,
)
from r2med_agent.config import build, load_yaml
from r2med_agent.errors import ConfigError, DataError
from r2med_agent.io import read_json
from r2med_agent.paths import configs_dir

logger = logging.getLogger(__name__)

TABLES: tuple[str, ...] = ("retrievers", "gar", "agentic", "rerank", "beyond")
"""Grid names: ``configs/reproduce/<name>.yaml``."""

GPU_GIB = 80.0
"""Memory of one GPU assumed by the estimates (A100/H100 80 GB)."""

BYTES_PER_PARAM = 2
"""bf16/fp16 weights."""

STALE_KEYS: tuple[str, ...] = (
    "method", "llm", "retriever", "loop_retriever", "reranker", "rerank_k", "top_k", "final", "sampling",
)
"""RunConfig fields that decide a run's scores: a result file whose recorded ``config`` differs in
one of them from the entry's is stale (the result folder's name holds only some of them). Fields
that do not apply are not compared: ``loop_retriever`` and ``final`` outside the agentic methods
(an unset loop retriever is the final one), ``rerank_k`` without a reranker."""

RUN_ARGS: tuple[str, ...] = ("loop_retriever", "final", "rerank_k", "top_k", "samples")
"""Run options a grid entry may set in ``args``: RunConfig fields that are also ``run`` flags
(``rerank_k`` -> ``--rerank-k``)."""


@dataclass(frozen=True)
class PublishedName:
    """Override of the names an entry has in the published CSV (fields left empty: as the run's)."""

    method: str | None = None
    llm: str | None = None
    retriever: str | None = None
    reranker: str | None = None


@dataclass(frozen=True)
class GridEntry:
    """One configuration of a grid: the run's arguments.

    Attributes:
        method: ``none``, ``hyde``, ``query2doc``, ``lamer``, ``search-r1``, ``search-o1``.
        retriever: retriever spec (``bm25``, an encoder name).
        llm: LLM registry name ("" for method ``none``).
        reranker: reranker registry name ("" for none).
        args: further run options (RUN_ARGS: ``loop_retriever``, ``final``, ``rerank_k``, ``top_k``).
        published: the names this configuration has in the published CSV, where they differ.
        ndcg_at_10: the published nDCG@10 per task this entry must reproduce.
        note: free text shown by ``--dry-run``.
    """

    method: str
    retriever: str
    llm: str = ""
    reranker: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    published: PublishedName = field(default_factory=PublishedName)
    ndcg_at_10: dict[str, float] = field(default_factory=dict)
    note: str = ""

    @property
    def label(self) -> str:
        """``method/llm/retriever[/reranker]``, the label compare gives its result row."""
        parts = [self.method, self.llm or NO_LLM, self.retriever]
        return "/".join(parts + [self.reranker] if self.reranker else parts)

    @property
    def published_key(self) -> PublishedKey:
        p = self.published
        return PublishedKey(
            method=p.method if p.method is not None else self.method,
            llm=p.llm if p.llm is not None else self.llm,
            retriever=p.retriever if p.retriever is not None else self.retriever,
            reranker=p.reranker if p.reranker is not None else self.reranker,
        )

    def run_config(self, tasks: Sequence[str], output_dir: Path, data_dir: Path | None = None):
        """The runner's RunConfig for this entry (``r2med_agent.runner.RunConfig``)."""
        from r2med_agent.runner import RunConfig

        return RunConfig(
            tasks=tuple(tasks),
            method=self.method,
            llm=self.llm or None,
            retriever=self.retriever,
            reranker=self.reranker or None,
            output_dir=Path(output_dir),
            data_dir=data_dir,
            **self.args,
        )

    def command(self, task: str, output_dir: Path, data_dir: Path | None = None) -> str:
        """The equivalent ``r2med-agent run`` command line (``task``: its ``--task`` value)."""
        parts = ["r2med-agent", "run", "--method", self.method]
        if self.llm:
            parts += ["--llm", self.llm]
        parts += ["--retriever", self.retriever]
        if self.reranker:
            parts += ["--reranker", self.reranker]
        for key, value in self.args.items():
            parts += [f"--{key.replace('_', '-')}", str(value)]
        parts += ["--task", task, "--output-dir", str(output_dir)]
        if data_dir is not None:
            parts += ["--data-dir", str(data_dir)]
        return " ".join(parts)


@dataclass(frozen=True)
class _GridFile:
    title: str
    entries: tuple[GridEntry, ...]
    description: str = ""


@dataclass(frozen=True)
class Grid:
    """A loaded grid: its entries and, per entry, the published scores (task -> nDCG@10: the
    entry's ``ndcg_at_10``, else the published CSV's)."""

    name: str
    title: str
    description: str
    path: Path
    entries: tuple[GridEntry, ...]
    published: tuple[dict[str, float], ...]
    """Per entry (same order), ``{task: published ndcg_at_10}`` (empty for an unpublished entry)."""


def load_grid(name_or_path: str | Path, *, strict: bool | None = None) -> Grid:
    """Load a grid by table name (``retrievers``, ``gar``, ``agentic``, ``rerank``) or file path.

    Args:
        name_or_path: a name in TABLES or a YAML file in the same format.
        strict: every entry must give ``ndcg_at_10`` for all 8 tasks, equal to the published CSV's
            row of its published name (default: True for the package's grids, False for other files).

    Raises:
        ConfigError: unknown table, malformed file, unknown keys, duplicate entries, scores that
            are not numbers, or (strict) scores missing or different from the published CSV.
    """
    if isinstance(name_or_path, str) and name_or_path in TABLES:
        path = configs_dir() / "reproduce" / f"{name_or_path}.yaml"
        name = name_or_path
        strict = True if strict is None else strict
    elif isinstance(name_or_path, Path) or name_or_path.endswith((".yaml", ".yml")):
        path = Path(name_or_path)
        name = path.stem
        strict = False if strict is None else strict
        if not path.exists():
            raise ConfigError(f"{path}: grid file does not exist")
    else:
        raise ConfigError(
            f"unknown table '{name_or_path}'; allowed: {', '.join(TABLES)} (or a .yaml grid file)"
        )
    doc = load_yaml(path)
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{path}: expected a mapping with 'title' and 'entries'")
    spec = build(_GridFile, doc, str(path))
    pub = published_results()
    scores: list[dict[str, float]] = []
    seen: dict[tuple[str, ...], int] = {}
    all_tasks = set(r2med_tasks())
    for i, entry in enumerate(spec.entries):
        where = f"{path}: entries[{i}] ({entry.label})"
        if entry.method != "none" and not entry.llm:
            raise ConfigError(f"{where}: method {entry.method} needs an llm")
        unknown = sorted(set(entry.args) - set(RUN_ARGS))
        if unknown:
            raise ConfigError(f"{where}: unknown args {', '.join(unknown)}; allowed: {', '.join(RUN_ARGS)}")
        ident = (entry.method, entry.llm, entry.retriever, entry.reranker, repr(sorted(entry.args.items())))
        if ident in seen:
            raise ConfigError(f"{where}: duplicate of entries[{seen[ident]}]")
        seen[ident] = i
        for task, value in entry.ndcg_at_10.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{where}: ndcg_at_10.{task} must be a number, got {value!r}")
        csv_scores = pub.scores(entry.published_key, "ndcg_at_10")
        if strict:
            if set(csv_scores) != all_tasks:
                has = "only " + ", ".join(sorted(csv_scores)) if csv_scores else f"no row for {entry.published_key}"
                raise ConfigError(
                    f"{where}: the published scores ({pub.path.name}) have {has}; "
                    "fix the names or add published: {retriever: <CSV name>, ...}"
                )
            if set(entry.ndcg_at_10) != all_tasks:
                missing = sorted(all_tasks - set(entry.ndcg_at_10)) or sorted(set(entry.ndcg_at_10) - all_tasks)
                raise ConfigError(
                    f"{where}: ndcg_at_10 must give the published score of each of the 8 tasks "
                    f"({', '.join(r2med_tasks())}); wrong or missing: {', '.join(missing)}"
                )
            differ = [t for t in sorted(all_tasks) if float(entry.ndcg_at_10[t]) != csv_scores[t]]
            if differ:
                raise ConfigError(
                    f"{where}: ndcg_at_10 differs from {pub.path.name} on "
                    + ", ".join(f"{t} ({entry.ndcg_at_10[t]} vs {csv_scores[t]})" for t in differ)
                )
        scores.append({t: float(v) for t, v in entry.ndcg_at_10.items()} if entry.ndcg_at_10 else csv_scores)
    return Grid(name, spec.title, spec.description, path, spec.entries, tuple(scores))


@lru_cache(maxsize=1)
def load_grids() -> dict[str, Grid]:
    """Every package grid by table name."""
    return {t: load_grid(t) for t in TABLES}


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
    """

    name: str
    params_b: float
    gated: bool = False
    note: str = ""


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
    tokens: tuple[str, ...] = ()
    """LLM calls and tokens of the LLM stages (:func:`token_estimate`), where an entry has them."""

    def lines(self) -> list[str]:
        out = [f"GPU: {'; '.join(self.gpu) if self.gpu else 'none (CPU only)'}"]
        out += [f"tokens: {t}" for t in self.tokens]
        out.append(f"API keys: {', '.join(self.api_keys) if self.api_keys else 'none'}")
        out.append(f"hub access: {'; '.join(self.hub) if self.hub else 'none'}")
        out += [f"PROBLEM: {p}" for p in self.problems]
        return out


_GATED = " [gated: accept its licence on the hub, set HF_TOKEN]"


def _gpu_line(role: str, name: str, info: ModelInfo, tp: int, gpu_gib: float) -> str:
    """``≈X GiB bf16 weights`` (over ``tp`` GPUs), flagged when a share does not fit one GPU
    with a fifth more for activations and KV cache."""
    w = weights_gib(info.params_b)
    per_gpu = w / tp
    line = f"{role} {name} ≈{w:.1f} GiB bf16 weights"
    if tp > 1:
        line += f", tensor-parallel {tp} -> ≈{per_gpu:.1f} GiB/GPU"
    if role == "LLM":
        line += " + KV cache"
    if per_gpu * 1.2 > gpu_gib:
        line += f" (does not fit one {gpu_gib:.0f} GiB GPU)"
    return line


@dataclass(frozen=True)
class Registries:
    """The registries ``--dry-run`` consults, read once per plan."""

    llms: Mapping[str, Any]
    encoders: Mapping[str, Any]
    rerankers: Mapping[str, Any]
    models: Mapping[str, ModelInfo]

    @classmethod
    def load(cls) -> Registries:
        from r2med_agent.llm.registry import load_llm_specs
        from r2med_agent.retrieval.encoders import encoder_registry
        from r2med_agent.retrieval.rerank import reranker_registry

        return cls(load_llm_specs(), encoder_registry(), reranker_registry(), load_models())


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
    datasets: Sequence[str] = (),
    gpu_gib: float = GPU_GIB,
    registries: Registries | None = None,
    n_queries: int = 0,
) -> Needs:
    """GPU memory, API keys and hub access one entry needs.

    Backends, hub ids, API key variables and tensor parallelism come from the registries
    (configs/llms.yaml, encoders.yaml, rerankers.yaml); sizes and gating from
    configs/reproduce/models.yaml. Names missing from either are reported as problems.

    Args:
        entry: the grid entry.
        datasets: hub dataset repos its tasks load from (:func:`dataset_repos`).
        gpu_gib: memory of one GPU.
        registries: the registries (read here when not given).
        n_queries: queries of the planned tasks, for the token estimate (0: none).
    """
    from r2med_agent.retrieval import BM25_SPECS

    reg = registries or Registries.load()
    gpu: list[str] = []
    keys: list[str] = []
    hub: list[str] = []
    problems: list[str] = []
    per_gpu: dict[str, float] = {}  # role -> GiB of weights on one GPU

    def weights(role: str, name: str, repos: Sequence[str], tp: int = 1) -> None:
        info = reg.models.get(name)
        if info is None:
            problems.append(f"no size for {role} '{name}' in configs/reproduce/models.yaml")
        else:
            gpu.append(_gpu_line(role, name, info, tp, gpu_gib))
            per_gpu[role] = per_gpu.get(role, 0.0) + weights_gib(info.params_b) / tp
        gated = _GATED if info is not None and info.gated else ""
        hub.append(f"{', '.join(repos)} (weights){gated}")

    if entry.llm:
        spec = reg.llms.get(entry.llm)
        if spec is None:
            problems.append(f"unknown LLM '{entry.llm}' (not in configs/llms.yaml or the user config)")
        elif spec.backend == "openai":
            if spec.api_key_env:
                keys.append(spec.api_key_env)
        elif spec.backend == "vllm":
            weights("LLM", entry.llm, [spec.model], spec.tensor_parallel_size)
        else:
            problems.append(f"LLM '{entry.llm}' runs on the {spec.backend} backend (no GPU estimate)")
    for part in entry.retriever.split("+"):
        if part in BM25_SPECS:
            continue
        enc = reg.encoders.get(part)
        if enc is None:
            problems.append(f"unknown retriever '{part}' (not bm25 and not in configs/encoders.yaml)")
        elif enc.kind == "api":
            if enc.api_key_env:
                keys.append(enc.api_key_env)
        else:
            repos = [m for m in (enc.model, enc.query_model, enc.doc_model) if m]
            weights("encoder", part, list(dict.fromkeys(repos)))
    if entry.reranker:
        rr = reg.rerankers.get(entry.reranker)
        if rr is None:
            problems.append(f"unknown reranker '{entry.reranker}' (not in configs/rerankers.yaml)")
        elif rr.kind != "cross-encoder":
            rspec = reg.llms.get(rr.llm)
            if rspec is None:
                problems.append(f"reranker '{entry.reranker}': unknown LLM '{rr.llm}'")
            elif rspec.backend == "openai":
                if rspec.api_key_env:
                    keys.append(rspec.api_key_env)
            elif rspec.backend == "vllm" and rr.llm != entry.llm:
                # Loaded after the method's LLM is done with (the same engine when it is the same).
                weights("reranker LLM", rr.llm, [rspec.model], rspec.tensor_parallel_size)
        else:
            weights("reranker", entry.reranker, [m for m in (rr.model, rr.base_model) if m])
    llm_spec = reg.llms.get(entry.llm) if entry.llm else None
    others = sum(v for role, v in per_gpu.items() if role not in ("LLM", "reranker LLM"))
    if "LLM" in per_gpu and others > 0 and llm_spec is not None:
        gpu.append(_together_line(per_gpu["LLM"], others, llm_spec.gpu_memory_utilization, gpu_gib))
    if datasets:
        hub.append(f"datasets {', '.join(datasets)}")
    tokens = tuple(token_estimate(entry, n_queries, reg)) if n_queries else ()
    return Needs(tuple(gpu), tuple(dict.fromkeys(keys)), tuple(hub), tuple(problems), tokens)


TOKENS_PER_WORD = 1.4
"""English and medical text: about 1.3-1.5 subword tokens per whitespace-separated word."""

EXPANSION_PROMPT_TOKENS = 300
"""A HyDE/Query2Doc/LameR prompt, roughly (LameR's ten documents: about 4,000 more)."""


def token_estimate(entry: GridEntry, n_queries: int, registries: Registries) -> list[str]:
    """Upper-bound LLM calls and tokens of an entry's LLM stages over ``n_queries`` queries:
    prompts from the reranker's document cut (``max_doc_words`` x TOKENS_PER_WORD), outputs at
    the entries' ``max_tokens`` (reasoning models often use far fewer). Dollars where the LLM
    entry has prices."""
    out: list[str] = []
    samples = int(entry.args.get("samples", 1))
    if entry.method in ("hyde", "query2doc", "lamer") and entry.llm in registries.llms:
        spec = registries.llms[entry.llm]
        calls = n_queries * samples
        p_in = calls * (EXPANSION_PROMPT_TOKENS + (4000 if entry.method == "lamer" else 0))
        out.append(_token_line(f"{entry.method} {entry.llm} x{samples}", spec, calls, p_in, calls * spec.max_tokens))
    rr = registries.rerankers.get(entry.reranker) if entry.reranker else None
    if rr is not None and rr.kind != "cross-encoder" and rr.llm in registries.llms:
        from r2med_agent.retrieval.llm_rerank import window_positions

        spec = registries.llms[rr.llm]
        k = int(entry.args.get("rerank_k", 100))
        doc = rr.max_doc_words * TOKENS_PER_WORD
        answer = rr.max_tokens or spec.max_tokens
        if rr.kind == "listwise":
            windows = window_positions(k, rr.window, rr.step)
            calls = n_queries * len(windows)
            p_in = int(sum(end - start for start, end in windows) * doc * n_queries + calls * 200)
            label = f"{rr.name} ({len(windows)} windows of {rr.window} per query)"
        else:
            calls = n_queries * k
            p_in = int(calls * (doc + 300))
            label = f"{rr.name} ({k} pairs per query, + 1-token judgments)"
        out.append(_token_line(label, spec, calls, p_in, calls * answer))
    return out


def _token_line(label: str, spec: Any, calls: int, p_in: int, p_out: int) -> str:
    line = f"{label}: {calls:,} calls, ≈{p_in / 1e6:.1f}M prompt tokens, ≤{p_out / 1e6:.1f}M output tokens"
    if spec.price_in_per_mtok or spec.price_out_per_mtok:
        line += f", ≤${spec.cost_usd(p_in, p_out):,.0f}"
    return line


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


# ----------------------------------------------------------------------------------------------
# Planning and running


@dataclass(frozen=True)
class ReproduceOptions:
    """Options of one ``reproduce`` call.

    Attributes:
        output_dir: root of the result tree (as ``run --output-dir``).
        data_dir: local data (None: the hub).
        tasks: tasks to run (default: the 8 R2MED tasks).
        gpu_gib: memory of one GPU for the estimates.
    """

    output_dir: Path = Path("results")
    data_dir: Path | None = None
    tasks: tuple[str, ...] = field(default_factory=r2med_tasks)
    gpu_gib: float = GPU_GIB


@dataclass(frozen=True)
class PlannedRun:
    """One grid entry, its command, which tasks are done, and what it needs.

    Attributes:
        done: tasks whose result files exist and match the entry (skipped).
        pending: tasks to run: no result file, or a stale one.
        stale: the pending tasks whose result file was made otherwise, with why.
    """

    entry: GridEntry
    published: dict[str, float]
    command: str
    result_dir: Path
    done: tuple[str, ...]
    pending: tuple[str, ...]
    needs: Needs
    stale: dict[str, str] = field(default_factory=dict)

    @property
    def published_average(self) -> float | None:
        """The paper's mean over the planned tasks (None when it lacks any of them)."""
        tasks = self.done + self.pending
        if not tasks or any(t not in self.published for t in tasks):
            return None
        return sum(self.published[t] for t in tasks) / len(tasks)


def _settings(rec: Mapping[str, Any]) -> dict[str, Any]:
    """The STALE_KEYS of a run config record, with what does not apply left out."""
    from r2med_agent.methods import METHODS

    method = rec.get("method")
    out = {k: rec[k] for k in STALE_KEYS if k in rec}
    if method == "none":
        out.pop("llm", None)
    if getattr(METHODS.get(str(method)), "agentic", False):
        if out.get("loop_retriever") is None and "retriever" in out:
            out["loop_retriever"] = out["retriever"]
    else:
        out.pop("loop_retriever", None)
        out.pop("final", None)
    if not rec.get("reranker"):
        out.pop("rerank_k", None)
        out["reranker"] = None
    if "sampling" in out:
        out["sampling"] = dict(out["sampling"] or {})
    return out


class _ExpectedData:
    """Per task, where the entry's data comes from and (local and package data) its corpus
    fingerprint; tasks are read at most once per plan, and only those with result files."""

    def __init__(self, data_dir: Path | None) -> None:
        self.data_dir = data_dir
        self._known: dict[str, tuple[str, str | None]] = {}

    def __call__(self, task: str) -> tuple[str, str | None]:
        if task not in self._known:
            from r2med_agent.data import get_task_spec, load_task

            spec = get_task_spec(task)
            if self.data_dir is None and spec.source != "package":
                # Hub data at the registry's pinned revision: the source names the content.
                self._known[task] = (spec.provenance, None)
            else:
                loaded = load_task(task, self.data_dir)
                self._known[task] = (loaded.source, loaded.fingerprint)
        return self._known[task]


def stale_reason(path: Path, expected: Mapping[str, Any], data: tuple[str, str | None]) -> str | None:
    """Why the result file ``path`` does not belong to a run with config record ``expected`` on
    data ``(source, fingerprint)``, or None when it does.

    Settings are compared over STALE_KEYS; the data by corpus fingerprint when the expected one is
    known (local and package data), else by source (hub ``repo@revision``).
    """
    try:
        rec = read_json(path, "result file")
    except DataError as e:
        return f"unreadable result file ({e})"
    if not isinstance(rec, Mapping) or not isinstance(rec.get("config"), Mapping):
        return "no run config recorded"
    have, want = _settings(rec["config"]), _settings(expected)
    diffs = []
    for key in STALE_KEYS:
        if key not in want:
            continue
        if key not in have:
            diffs.append(f"{key} not recorded")
        elif have[key] != want[key]:
            diffs.append(f"{key} {have[key]!r}, the entry {want[key]!r}")
    source, fingerprint = data
    if fingerprint is not None:
        if rec.get("corpus_fingerprint") != fingerprint:
            recorded = rec.get("corpus_fingerprint")
            diffs.append(
                "no corpus fingerprint recorded" if not recorded
                else f"corpus changed (fingerprint {str(recorded)[:12]}, now {fingerprint[:12]})"
            )
    elif rec.get("source") != source:
        diffs.append(f"data from {rec.get('source') or 'an unrecorded source'}, the entry loads {source}")
    return "; ".join(diffs) or None


def task_option(tasks: Sequence[str]) -> str:
    """``run --task`` for ``tasks``: ``all`` for the 8 R2MED tasks, else a comma list."""
    return "all" if tuple(tasks) == r2med_tasks() else ",".join(tasks)


def plan(grid: Grid, opts: ReproduceOptions) -> list[PlannedRun]:
    """Every entry of ``grid`` with its command, finished/pending tasks and needs."""
    from dataclasses import asdict

    registries = Registries.load()
    repos: dict[tuple[str, ...], list[str]] = {}
    task_arg = task_option(opts.tasks)
    expected_data = _ExpectedData(opts.data_dir)
    out = []
    for entry, scores in zip(grid.entries, grid.published):
        cfg = entry.run_config(opts.tasks, opts.output_dir, opts.data_dir)
        rdir = cfg.result_dir()
        want = asdict(cfg)
        stale: dict[str, str] = {}
        existing = [t for t in opts.tasks if (rdir / f"{t}.json").exists()]
        for t in existing:
            reason = stale_reason(rdir / f"{t}.json", want, expected_data(t))
            if reason is not None:
                stale[t] = reason
        done = tuple(t for t in existing if t not in stale)
        pending = tuple(t for t in opts.tasks if t not in done)
        needed = pending or opts.tasks
        if needed not in repos:
            repos[needed] = dataset_repos(needed, opts.data_dir)
        out.append(
            PlannedRun(
                entry=entry,
                published=scores,
                command=entry.command(task_arg, opts.output_dir, opts.data_dir),
                result_dir=rdir,
                done=done,
                pending=pending,
                needs=entry_needs(entry, repos[needed], opts.gpu_gib, registries, _queries(needed)),
                stale=stale,
            )
        )
    return out


def _queries(tasks: Sequence[str]) -> int:
    """Queries of the tasks, from the task registry's counts (0 when one is unknown)."""
    from r2med_agent.data import task_registry

    registry = task_registry()
    counts = [getattr(registry.get(t), "queries", None) for t in tasks]
    return 0 if any(not c for c in counts) else sum(counts)  # type: ignore[misc]


def format_plan(planned: Sequence[PlannedRun]) -> str:
    """The ``--dry-run`` listing: per entry its status, command, published scores (per task and
    their average), stale results and needs."""
    lines = []
    for i, p in enumerate(planned):
        if p.stale:
            status = "stale"
        else:
            status = "done" if not p.pending else ("partial" if p.done else "to run")
        avg = p.published_average
        paper = f"paper nDCG@10 avg {avg:.4f}" if avg is not None else "no published score"
        lines.append(f"[{i}] {p.entry.label}  ({status}; {paper})")
        lines.append(f"    {p.command}")
        scores = [f"{t} {p.published[t]}" for t in (*p.done, *p.pending) if t in p.published]
        if scores:
            lines.append(f"    paper nDCG@10: {', '.join(scores)}")
        if p.done and p.pending:
            lines.append(f"    done: {', '.join(p.done)}; runs: {', '.join(p.pending)}")
        for task, reason in p.stale.items():
            lines.append(f"    stale {task} (runs again): {reason}")
        lines += [f"    {line}" for line in p.needs.lines()]
        if p.entry.note:
            lines.append(f"    note: {p.entry.note}")
    todo = sum(1 for p in planned if p.pending)
    stale = sum(1 for p in planned if p.stale)
    lines.append(
        f"{len(planned)} configuration(s): {todo} to run"
        + (f" ({stale} with stale results)" if stale else "")
        + f", {len(planned) - todo} already done"
    )
    return "\n".join(lines) + "\n"


def _run_one(entry: GridEntry, opts: ReproduceOptions, tasks: Sequence[str]) -> None:
    """Run one entry on ``tasks`` in-process through the runner (the one call to wire)."""
    from r2med_agent.runner import run_experiment

    run_experiment(entry.run_config(tasks, opts.output_dir, opts.data_dir))


def reproduce(grid: Grid, opts: ReproduceOptions) -> ComparisonTable:
    """Run every entry's pending tasks, then compare the grid's results with the paper.

    Returns:
        The comparison table (rows in grid order, published scores beside ours).
    """
    planned = plan(grid, opts)
    for i, p in enumerate(planned):
        if not p.pending:
            logger.info("[%d/%d] %s: results exist, skipped", i + 1, len(planned), p.entry.label)
            continue
        for task, reason in p.stale.items():
            logger.warning("%s %s: stale result (%s); running it again", p.entry.label, task, reason)
        logger.info("[%d/%d] %s on %s", i + 1, len(planned), p.entry.label, ", ".join(p.pending))
        _run_one(p.entry, opts, p.pending)
    return results_table(grid, opts, planned)


def results_table(
    grid: Grid, opts: ReproduceOptions, planned: Sequence[PlannedRun] | None = None
) -> ComparisonTable:
    """The grid's finished results beside the published scores (rows in grid order)."""
    planned = plan(grid, opts) if planned is None else planned
    order = {p.result_dir.resolve(): i for i, p in enumerate(planned)}
    root = Path(opts.output_dir)
    rows = load_results([root]) if root.is_dir() else []
    rows = sorted((r for r in rows if r.directory in order), key=lambda r: order[r.directory])
    if not rows:
        raise ConfigError(f"no results of grid '{grid.name}' under {root} yet; run without --dry-run")
    tasks = [t for t in opts.tasks if any(t in r.tasks for r in rows)]
    aliases = {
        (e.method, e.llm or NO_LLM, e.retriever, e.reranker): e.published_key for e in grid.entries
    }
    return build_table(
        rows, "ndcg_at_10", tasks=tasks, published=any(grid.published), published_aliases=aliases
    )
