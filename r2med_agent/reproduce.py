"""Reproduction grids: each published R2MED configuration beside the command that reproduces it.

In the spirit of pyserini's ``2cr/*.yaml``: ``configs/reproduce/<table>.yaml`` lists the run
arguments of every configuration of one of the paper's tables beside the per-task nDCG@10 it must
reproduce (``ndcg_at_10``). A package grid must give all its tasks (``tasks:``, default ``all``, the
8 R2MED tasks; ``nano.yaml``: ``nano-all``, the NanoR2MED card's numbers), equal to the packaged
published CSV (loading checks both; the comparison table reads the CSV). ``--dry-run`` prints each command
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

TABLES: tuple[str, ...] = ("retrievers", "gar", "agentic", "rerank", "nano", "beyond")
"""Grid names: ``configs/reproduce/<name>.yaml``."""

GPU_GIB = 80.0
"""Memory of one GPU assumed by the estimates (A100/H100 80 GB)."""

BYTES_PER_PARAM = 2
"""bf16/fp16 weights."""

STALE_KEYS: tuple[str, ...] = (
    "method", "llm", "retriever", "loop_retriever", "reranker", "rerank_k", "rerank_cut", "top_k", "final",
    "sampling", "generations", "first_pass",
)
"""RunConfig fields that decide a run's scores: a result file whose recorded ``config`` differs in
one of them from the entry's is stale (the result folder's name holds only some of them). Fields
that do not apply are not compared: ``loop_retriever`` and ``final`` outside the agentic methods
(an unset loop retriever is the final one), ``rerank_k`` and ``rerank_cut`` without a reranker,
``first_pass`` outside LameR's fresh runs, ``sampling`` for released generations. A record written
before a setting existed counts as that setting's default (``generations`` fresh, ``first_pass``
bm25, ``rerank_cut`` false), which is what such runs did."""

RECORD_DEFAULTS: dict[str, Any] = {"generations": "fresh", "first_pass": "bm25", "rerank_cut": False}
"""Settings recorded only by later versions, with the behaviour of the versions before them."""

RUN_ARGS: tuple[str, ...] = ("loop_retriever", "final", "rerank_k", "rerank_cut", "first_pass", "top_k", "samples")
"""Run options a grid entry may set in ``args``: RunConfig fields that are also ``run`` flags
(``rerank_k`` -> ``--rerank-k``; a true boolean is the bare flag, ``--rerank-cut``)."""

RELEASED_FILE = "released.yaml"
"""``configs/reproduce/released.yaml``: per method, the LLMs whose generations R2MED released."""


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
        generations: ``auto`` (R2MED's released generations when ``configs/reproduce/released.yaml``
            lists the entry's method and LLM and ``reproduce`` is not told ``--generations fresh``)
            or ``fresh`` (always generate).
    """

    method: str
    retriever: str
    llm: str = ""
    reranker: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    published: PublishedName = field(default_factory=PublishedName)
    ndcg_at_10: dict[str, float] = field(default_factory=dict)
    note: str = ""
    generations: str = "auto"

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

    def run_config(
        self, tasks: Sequence[str], output_dir: Path, data_dir: Path | None = None, generations: str = "fresh",
        allow_count_mismatch: bool = False,
    ):
        """The runner's RunConfig for this entry (``r2med_agent.runner.RunConfig``); ``generations``
        is the entry's resolved mode (:meth:`generations_mode`)."""
        from r2med_agent.runner import RunConfig

        return RunConfig(
            tasks=tuple(tasks),
            method=self.method,
            llm=self.llm or None,
            retriever=self.retriever,
            reranker=self.reranker or None,
            output_dir=Path(output_dir),
            data_dir=data_dir,
            generations=generations,
            allow_count_mismatch=allow_count_mismatch,
            **self.args,
        )

    def row_keys(self) -> list[tuple[str, str, str, str]]:
        """``(method, llm, retriever, reranker)`` as compare names this entry's result rows: its
        own names and those of its result folders (fresh and released generations; a variant
        such as ``nv__top10`` in the retriever part)."""
        from r2med_agent.compare import split_leaf

        keys = [(self.method, self.llm or NO_LLM, self.retriever, self.reranker)]
        for mode in ("fresh", "r2med") if self.method != "none" else ("fresh",):
            cfg = self.run_config((), Path("."), generations=mode)
            keys.append((self.method, cfg.llm_label, *split_leaf(cfg.retriever_label)))
        return list(dict.fromkeys(keys))

    def generations_mode(self, wanted: str = "r2med") -> str:
        """``r2med`` when R2MED released this entry's generations and ``wanted`` is ``r2med``
        (reproduce's default), else ``fresh``."""
        if wanted != "r2med" or self.generations == "fresh" or self.method == "none":
            return "fresh"
        return "r2med" if self.llm in released_llms().get(self.method, ()) else "fresh"

    def command(
        self, task: str, output_dir: Path, data_dir: Path | None = None, generations: str = "fresh",
        allow_count_mismatch: bool = False,
    ) -> str:
        """The equivalent ``r2med-agent run`` command line (``task``: its ``--task`` value)."""
        parts = ["r2med-agent", "run", "--method", self.method]
        if self.llm:
            parts += ["--llm", self.llm]
        if generations == "r2med":
            parts += ["--generations", "r2med"]
        parts += ["--retriever", self.retriever]
        if self.reranker:
            parts += ["--reranker", self.reranker]
        for key, value in self.args.items():
            if key == "first_pass" and generations == "r2med":
                continue  # the released generations already embody LameR's first pass
            flag = f"--{key.replace('_', '-')}"
            if isinstance(value, bool):
                parts += [flag] if value else []
            else:
                parts += [flag, str(value)]
        parts += ["--task", task, "--output-dir", str(output_dir)]
        if data_dir is not None:
            parts += ["--data-dir", str(data_dir)]
        if allow_count_mismatch:
            parts += ["--allow-count-mismatch"]
        return " ".join(parts)


@dataclass(frozen=True)
class _GridFile:
    title: str
    entries: tuple[GridEntry, ...]
    description: str = ""
    tasks: str = "all"
    """The tasks the grid's scores are for (a ``--task`` selection: ``all``, ``nano-all``, a list)."""


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
    tasks: tuple[str, ...] = ()
    """The grid's tasks (its ``tasks:`` selection expanded; the 8 R2MED tasks by default)."""


def load_grid(name_or_path: str | Path, *, strict: bool | None = None) -> Grid:
    """Load a grid by table name (``retrievers``, ``gar``, ``agentic``, ``rerank``) or file path.

    Args:
        name_or_path: a name in TABLES or a YAML file in the same format.
        strict: every entry must give ``ndcg_at_10`` for each of the grid's tasks (``tasks:``,
            default the 8 R2MED tasks), equal to the published CSV's row of its published name
            (default: True for the package's grids, False for other files).

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
    from r2med_agent.data import task_names

    grid_tasks = tuple(task_names(spec.tasks))
    all_tasks = set(grid_tasks)
    for i, entry in enumerate(spec.entries):
        where = f"{path}: entries[{i}] ({entry.label})"
        if entry.method != "none" and not entry.llm:
            raise ConfigError(f"{where}: method {entry.method} needs an llm")
        unknown = sorted(set(entry.args) - set(RUN_ARGS))
        if unknown:
            raise ConfigError(f"{where}: unknown args {', '.join(unknown)}; allowed: {', '.join(RUN_ARGS)}")
        if entry.generations not in ("auto", "fresh"):
            raise ConfigError(f"{where}: generations must be auto or fresh, got {entry.generations!r}")
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
                    f"{where}: ndcg_at_10 must give the published score of each of the "
                    f"{len(grid_tasks)} tasks ({', '.join(grid_tasks)}); wrong or missing: {', '.join(missing)}"
                )
            differ = [t for t in sorted(all_tasks) if float(entry.ndcg_at_10[t]) != csv_scores[t]]
            if differ:
                raise ConfigError(
                    f"{where}: ndcg_at_10 differs from {pub.path.name} on "
                    + ", ".join(f"{t} ({entry.ndcg_at_10[t]} vs {csv_scores[t]})" for t in differ)
                )
        scores.append({t: float(v) for t, v in entry.ndcg_at_10.items()} if entry.ndcg_at_10 else csv_scores)
    return Grid(name, spec.title, spec.description, path, spec.entries, tuple(scores), grid_tasks)


@lru_cache(maxsize=1)
def released_llms() -> dict[str, tuple[str, ...]]:
    """``configs/reproduce/released.yaml``: method -> LLM registry names whose generations R2MED
    released in its hub repos (``<method>/<llm>/query_with_hydoc.jsonl``)."""
    path = configs_dir() / "reproduce" / RELEASED_FILE
    doc = load_yaml(path) or {}
    if not isinstance(doc, Mapping) or not all(
        isinstance(v, list) and all(isinstance(x, str) for x in v) for v in doc.values()
    ):
        raise ConfigError(f"{path}: expected a mapping of method -> list of LLM names")
    return {str(k): tuple(v) for k, v in doc.items()}


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
    setup: tuple[str, ...] = ()
    """How the row runs: where its generations come from, each model's precision and the
    environment it needs, the reranking depth, LameR's first pass."""
    split: tuple[str, ...] = ()
    """The recipe, line by line, when the LLM and a retriever or reranker need transformers
    versions no single environment has (:func:`split_recipe`)."""
    tokens: tuple[str, ...] = ()
    """LLM calls and tokens of the LLM stages (:func:`token_estimate`), where an entry has them."""

    def lines(self) -> list[str]:
        out = list(self.setup)
        out.append(f"GPU: {'; '.join(self.gpu) if self.gpu else 'none (CPU only)'}")
        out += [f"tokens: {t}" for t in self.tokens]
        out.append(f"API keys: {', '.join(self.api_keys) if self.api_keys else 'none'}")
        out.append(f"hub access: {'; '.join(self.hub) if self.hub else 'none'}")
        out += [f"PROBLEM: {p}" for p in self.problems]
        out += self.split
        return out


VLLM_TRANSFORMERS = "5.16"
"""The oldest transformers the vLLM releases this project is tested with accept (vLLM 0.32
pins >= 5.16.1); an encoder or reranker whose ``transformers`` specifier excludes it cannot
share an environment with the vLLM engine."""


def split_recipe(entry: GridEntry, llm_spec: Any, pins: Mapping[str, str]) -> tuple[str, ...]:
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
    if entry.method not in AGENTIC_METHODS:
        lines.append(
            f"  or generate first in env 1 (r2med-agent + vllm): the same command with "
            f"--retriever bm25 fills the generation cache; this command in env 2 (same "
            f"R2MED_CACHE_DIR) then makes no LLM call and never loads vLLM"
        )
    return tuple(lines)


AGENTIC_METHODS = frozenset({"search-r1", "search-o1"})


def _excludes_vllm(spec: str) -> bool:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    if not spec:
        return False
    try:
        return not SpecifierSet(spec).contains(f"{VLLM_TRANSFORMERS}.1", prereleases=True)
    except InvalidSpecifier:
        return False


_GATED = " [gated: accept its licence on the hub, set HF_TOKEN]"


_PRECISIONS = {"float32": ("fp32", 4), "float16": ("fp16", 2), "bfloat16": ("bf16", 2),
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
        from r2med_agent.retrieval.dense.spec import encoder_registry
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
    generations: str = "fresh",
    n_queries: int = 0,
) -> Needs:
    """How an entry runs and the GPU memory, API keys and hub access it needs.

    Backends, hub ids, API key variables and tensor parallelism come from the registries
    (configs/llms.yaml, encoders.yaml, rerankers.yaml); sizes and gating from
    configs/reproduce/models.yaml. Names missing from either are reported as problems.

    Args:
        entry: the grid entry.
        datasets: hub dataset repos its tasks load from (:func:`dataset_repos`).
        gpu_gib: memory of one GPU.
        registries: the registries (read here when not given).
        generations: ``r2med`` when the entry scores R2MED's released generations (no LLM).
        n_queries: queries of the planned tasks, for the token estimate (0: none).
    """
    from r2med_agent.released import released_path
    from r2med_agent.retrieval import BM25_SPECS
    from r2med_agent.retrieval.candidates import DENSE_ENCODER, REBUILT, SHIPPED

    reg = registries or Registries.load()
    gpu: list[str] = []
    keys: list[str] = []
    hub: list[str] = []
    problems: list[str] = []
    setup: list[str] = []
    per_gpu: dict[str, float] = {}  # role -> GiB of weights on one GPU

    def weights(role: str, name: str, repos: Sequence[str], tp: int = 1,
                precision: tuple[str, int] = ("bf16", BYTES_PER_PARAM)) -> None:
        info = reg.models.get(name)
        if info is None:
            problems.append(f"no size for {role} '{name}' in configs/reproduce/models.yaml")
        else:
            gpu.append(_gpu_line(role, name, info, tp, gpu_gib, precision))
            per_gpu[role] = per_gpu.get(role, 0.0) + weights_gib(info.params_b) * precision[1] / BYTES_PER_PARAM / tp
        gated = _GATED if info is not None and info.gated else ""
        hub.append(f"{', '.join(repos)} (weights){gated}")

    if entry.llm and generations == "r2med":
        setup.append(
            f"generations: released by R2MED ({released_path(entry.method, entry.llm)} of each task, from "
            "its hub repo at the pinned revision or --data-dir); no LLM runs"
        )
    elif entry.llm:
        released = entry.llm in released_llms().get(entry.method, ())
        setup.append(f"generations: fresh with {entry.llm}"
                     + (" (--generations fresh)" if released else " (R2MED released none for this row)"))
        if entry.method == "lamer":
            setup.append(f"LameR first pass: {entry.args.get('first_pass', 'bm25')} top 10")
    def llm_needs(role: str, name: str, spec: Any) -> bool:
        """An API LLM's key or a vLLM model's weights; False for another backend."""
        if spec.backend == "openai":
            if spec.api_key_env:
                keys.append(spec.api_key_env)
        elif spec.backend == "vllm":
            weights(role, name, [spec.model], spec.tensor_parallel_size)
        else:
            return False
        return True

    if entry.llm and generations != "r2med":
        spec = reg.llms.get(entry.llm)
        if spec is None:
            problems.append(f"unknown LLM '{entry.llm}' (not in configs/llms.yaml or the user config)")
        elif not llm_needs("LLM", entry.llm, spec):
            problems.append(f"LLM '{entry.llm}' runs on the {spec.backend} backend (no GPU estimate)")
    for part in entry.retriever.split("+"):
        if part in BM25_SPECS or part in SHIPPED:
            continue
        if part in REBUILT:  # the shipped BM25 list fused with the dense encoder's ranking
            part = DENSE_ENCODER
        enc = reg.encoders.get(part)
        if enc is None:
            problems.append(f"unknown retriever '{part}' (not bm25 and not in configs/encoders.yaml)")
        elif enc.kind == "api":
            if enc.api_key_env:
                keys.append(enc.api_key_env)
        else:
            repos = list(dict.fromkeys(m for m in (enc.model, enc.query_model, enc.doc_model) if m))
            precision = model_precision(enc)
            line = f"retriever {part}: {', '.join(repos)} in {precision[0]}"
            if getattr(enc, "transformers", ""):
                line += (f"; needs transformers{enc.transformers}, best in a separate environment "
                         "(the run stops with the pip command otherwise)")
            setup.append(line)
            weights("encoder", part, repos, precision=precision)
    if entry.reranker:
        rr = reg.rerankers.get(entry.reranker)
        if rr is None:
            problems.append(f"unknown reranker '{entry.reranker}' (not in configs/rerankers.yaml)")
        elif rr.kind != "cross-encoder":
            rspec = reg.llms.get(rr.llm)
            if rspec is None:
                problems.append(f"reranker '{entry.reranker}': unknown LLM '{rr.llm}'")
            elif rr.llm != entry.llm or rspec.backend != "vllm":
                # A vLLM reranker LLM loads after the method's LLM is done with (the same engine
                # when it is the same model).
                llm_needs("reranker LLM", rr.llm, rspec)
        else:
            precision = model_precision(rr)
            k = entry.args.get("rerank_k", 100)
            kept = f"keeps only those {k}" if entry.args.get("rerank_cut") else "keeps the rest below them"
            setup.append(f"reranker {entry.reranker} in {precision[0]}: re-scores the top {k} of "
                         f"{entry.retriever} and {kept}")
            weights("reranker", entry.reranker, [m for m in (rr.model, rr.base_model) if m], precision=precision)
    llm_spec = reg.llms.get(entry.llm) if entry.llm else None
    others = sum(v for role, v in per_gpu.items() if role not in ("LLM", "reranker LLM"))
    if "LLM" in per_gpu and others > 0 and llm_spec is not None:
        gpu.append(_together_line(per_gpu["LLM"], others, llm_spec.gpu_memory_utilization, gpu_gib))
    if datasets:
        hub.append(f"datasets {', '.join(datasets)}")
    split: tuple[str, ...] = ()
    if llm_spec is not None and llm_spec.backend == "vllm":
        pins = {}
        for part in entry.retriever.split("+"):
            enc = reg.encoders.get(part)
            if enc is not None and _excludes_vllm(getattr(enc, "transformers", "")):
                pins[part] = enc.transformers
        rr = reg.rerankers.get(entry.reranker) if entry.reranker else None
        if rr is not None and _excludes_vllm(getattr(rr, "transformers", "")):
            pins[entry.reranker] = rr.transformers
        if pins:
            split = split_recipe(entry, llm_spec, pins)
    tokens = tuple(token_estimate(entry, n_queries, reg, released=generations == "r2med")) if n_queries else ()
    return Needs(tuple(gpu), tuple(dict.fromkeys(keys)), tuple(hub), tuple(problems), tuple(setup), split, tokens)


TOKENS_PER_WORD = 1.4
"""English and medical text: about 1.3-1.5 subword tokens per whitespace-separated word."""

EXPANSION_PROMPT_TOKENS = 300
"""A HyDE/Query2Doc/LameR prompt, roughly (LameR's ten documents: about 4,000 more)."""


def token_estimate(entry: GridEntry, n_queries: int, registries: Registries, released: bool = False) -> list[str]:
    """Upper-bound LLM calls and tokens of an entry's LLM stages over ``n_queries`` queries:
    prompts from the reranker's document cut (``max_doc_words`` x TOKENS_PER_WORD), outputs at
    the entries' ``max_tokens`` (reasoning models often use far fewer). Dollars where the LLM
    entry has prices."""
    out: list[str] = []
    samples = int(entry.args.get("samples", 1))
    if entry.method in ("hyde", "query2doc", "lamer") and entry.llm in registries.llms and not released:
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
        generations: ``r2med``: R2MED's released generations for every entry that has them
            (:meth:`GridEntry.generations_mode`); ``fresh``: generate every LLM row.
        allow_count_mismatch: use ``data_dir`` copies whose query or document counts differ
            from the registry's (as ``run --allow-count-mismatch``).
    """

    output_dir: Path = Path("results")
    data_dir: Path | None = None
    tasks: tuple[str, ...] = field(default_factory=r2med_tasks)
    gpu_gib: float = GPU_GIB
    generations: str = "r2med"
    allow_count_mismatch: bool = False

    def __post_init__(self) -> None:
        from r2med_agent.released import check_generations

        check_generations(self.generations)


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
    generations: str = "fresh"

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
    rec = {**RECORD_DEFAULTS, **rec}
    out = {k: rec[k] for k in STALE_KEYS if k in rec}
    if method == "none":
        out.pop("llm", None)
        out.pop("generations", None)
    if method != "lamer" or out.get("generations") == "r2med":
        out.pop("first_pass", None)
    if out.get("generations") == "r2med":
        out.pop("sampling", None)
    if getattr(METHODS.get(str(method)), "agentic", False):
        if out.get("loop_retriever") is None and "retriever" in out:
            out["loop_retriever"] = out["retriever"]
    else:
        out.pop("loop_retriever", None)
        out.pop("final", None)
    if not rec.get("reranker"):
        out.pop("rerank_k", None)
        out.pop("rerank_cut", None)
        out["reranker"] = None
    if "sampling" in out:
        out["sampling"] = dict(out["sampling"] or {})
    return out


class _ExpectedData:
    """Per task, where the entry's data comes from and (local and package data) its corpus
    fingerprint; tasks are read at most once per plan, and only those with result files."""

    def __init__(self, data_dir: Path | None, allow_count_mismatch: bool = False) -> None:
        self.data_dir = data_dir
        self.allow_count_mismatch = allow_count_mismatch
        self._known: dict[str, tuple[str, str | None]] = {}

    def __call__(self, task: str) -> tuple[str, str | None]:
        if task not in self._known:
            from r2med_agent.data import get_task_spec, load_task

            spec = get_task_spec(task)
            if self.data_dir is None and spec.source != "package":
                # Hub data at the registry's pinned revision: the source names the content.
                self._known[task] = (spec.provenance, None)
            else:
                loaded = load_task(task, self.data_dir,
                                   allow_count_mismatch=self.allow_count_mismatch)
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
    elif rec.get("source") != source and not str(rec.get("source") or "").startswith(f"{source} (commit "):
        # A task that follows a branch (NanoR2MED: main) records the commit it loaded after its
        # source; any commit of that branch is the entry's data.
        diffs.append(f"data from {rec.get('source') or 'an unrecorded source'}, the entry loads {source}")
    return "; ".join(diffs) or None


def task_option(tasks: Sequence[str]) -> str:
    """``run --task`` for ``tasks``: ``all`` for the 8 R2MED tasks, ``nano-all`` for the 8
    NanoR2MED splits, else a comma list."""
    from r2med_agent.data import task_names

    if tuple(tasks) == r2med_tasks():
        return "all"
    return "nano-all" if tuple(tasks) == tuple(task_names("nano-all")) else ",".join(tasks)


def plan(grid: Grid, opts: ReproduceOptions) -> list[PlannedRun]:
    """Every entry of ``grid`` with its command, finished/pending tasks and needs."""
    from dataclasses import asdict

    registries = Registries.load()
    repos: dict[tuple[str, ...], list[str]] = {}
    task_arg = task_option(opts.tasks)
    expected_data = _ExpectedData(opts.data_dir, opts.allow_count_mismatch)
    out = []
    for entry, scores in zip(grid.entries, grid.published):
        mode = entry.generations_mode(opts.generations)
        cfg = entry.run_config(opts.tasks, opts.output_dir, opts.data_dir, mode, opts.allow_count_mismatch)
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
                command=entry.command(task_arg, opts.output_dir, opts.data_dir, mode, opts.allow_count_mismatch),
                result_dir=rdir,
                done=done,
                pending=pending,
                needs=entry_needs(entry, repos[needed], opts.gpu_gib, registries, generations=mode,
                                  n_queries=_queries(needed)),
                stale=stale,
                generations=mode,
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

    mode = entry.generations_mode(opts.generations)
    run_experiment(entry.run_config(tasks, opts.output_dir, opts.data_dir, mode, opts.allow_count_mismatch))


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
    aliases = {key: e.published_key for e in grid.entries for key in e.row_keys()}
    return build_table(
        rows, "ndcg_at_10", tasks=tasks, published=any(grid.published), published_aliases=aliases
    )
