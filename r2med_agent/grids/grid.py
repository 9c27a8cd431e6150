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
A grid's top-level ``args`` are every entry's defaults (an entry's own ``args`` win); the package
grids set there how R2MED's scripts ran (``exclude_identical_ids``, ``empty_generation``,
``llm_prompt``), which each entry's run spec keeps only where it applies, and ``--dry-run`` shows
per entry (:func:`reference_line`).

:func:`reproduce` runs each entry through :func:`_run_one` (the runner, in-process), skipping
tasks whose result files exist and were made with the entry's run spec, then returns the
side-by-side comparison table. A result file made otherwise is *stale* and is run again: the run
spec its ``config`` records differs from the entry's (an earlier version's folder shared by
several settings), or its data differs (local and package data: the ``corpus_fingerprint`` of the
corpus the entry would load; hub data: the ``source``, a pinned ``repo@revision``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from r2med_agent.analysis.published import PublishedKey, benchmark_of, published_results
from r2med_agent.analysis.results import NO_LLM
from r2med_agent.config import build, load_yaml
from r2med_agent.errors import ConfigError, did_you_mean
from r2med_agent.experiment.spec import VERSION_MARKERS, RunSpec
from r2med_agent.paths import configs_dir

logger = logging.getLogger(__name__)

TABLES: tuple[str, ...] = ("retrievers", "gar", "agentic", "rerank", "nano", "beyond", "frontier", "bright",
                           "bright-long", "bright-frontier")
"""Grid names: ``configs/reproduce/<name>.yaml``."""

GPU_GIB = 80.0
"""Memory of one GPU assumed by the estimates (A100/H100 80 GB)."""

BYTES_PER_PARAM = 2
"""bf16/fp16 weights."""

RUN_ARGS: tuple[str, ...] = tuple(
    f.name for f in fields(RunSpec)
    if f.name not in ("method", "llm", "retriever", "reranker", "generations", "prompts", "candidates", "entries",
                      *VERSION_MARKERS)
)
SCORE_SOURCES = ("entries", "published")
"""Where a grid file's published scores come from: each entry's ``ndcg_at_10`` (checked against
the packaged CSV), or the packaged CSVs alone (``scores: published``; the frontier grid, whose
systems were often published as an average only)."""
"""Run settings a grid entry may set in ``args``: every run spec field the entry's own keys do not
name (``rerank_k`` -> ``--rerank-k``; a true boolean is the bare flag, ``--rerank-cut``;
``sampling: {temperature: 0}`` -> ``--temperature 0``)."""

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
            lists the entry's method and LLM and ``reproduce`` is not told ``--generations fresh``),
            ``fresh`` (always generate) or ``bright`` (BRIGHT's released reasoning queries of the
            entry's LLM, always: BRIGHT's reasoning LLMs have no registry entry that could regenerate
            them).
        candidates: for retriever ``candidates``, the hash of the first-stage run files the
            published row reranked (:func:`~r2med_agent.retrieval.run_files.candidates_fingerprint`
            over the grid's tasks); ``reproduce --candidates PATH`` gives the files, and other
            files are refused.
        candidates_from: where a user gets those files (shown by ``--dry-run``).
        differences: what the entry's run still does otherwise than the published row's authors'
            code (docs/protocol.md); empty: as the authors ran it; None: not reviewed. Shown by
            ``--dry-run`` and beside the row's results (:func:`status_line`).
        candidates_dir: the folder they are in once fetched so (``ReasonRank/runs`` after the
            clone): the ``--candidates`` of the entry's command until ``reproduce --candidates``
            names another.
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
    candidates: str = ""
    candidates_from: str = ""
    differences: tuple[str, ...] | None = None
    candidates_dir: str = ""

    @property
    def status(self) -> str:
        """The row's status: ``as the authors ran it``, its differences, or not reviewed."""
        if self.differences is None:
            return "not reviewed against the authors' code"
        if not self.differences:
            return "as the authors ran it"
        return "differs from the authors' run: " + "; ".join(self.differences)

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
        allow_count_mismatch: bool = False, candidates_path: Path | None = None,
    ):
        """The runner's RunConfig for this entry (:class:`~r2med_agent.experiment.runner.RunConfig`); ``generations``
        is the entry's resolved mode (:meth:`generations_mode`); ``candidates_path``: the run files
        of a ``candidates`` entry (without them the spec carries the entry's hash, for planning)."""
        from r2med_agent.experiment.runner import RunConfig

        if self.candidates:
            args = {"prompts_from": None, **self.args}
            if candidates_path is None:
                return RunConfig(tasks=tuple(tasks), retriever=self.retriever, candidates=self.candidates,
                                 reranker=self.reranker or None, output_dir=Path(output_dir), data_dir=data_dir,
                                 allow_count_mismatch=allow_count_mismatch, **args)
            cfg = RunConfig(tasks=tuple(tasks), retriever=self.retriever, candidates_path=Path(candidates_path),
                            reranker=self.reranker or None, output_dir=Path(output_dir), data_dir=data_dir,
                            allow_count_mismatch=allow_count_mismatch, **args)
            if cfg.candidates != self.candidates:
                raise ConfigError(
                    f"--candidates {candidates_path}: these run files (hash {cfg.candidates}) are not the ones "
                    f"the published row reranked (hash {self.candidates}, over the 8 tasks); "
                    f"get them from {self.candidates_where()}"
                )
            return cfg
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
            **{"prompts_from": None, **self.args},  # the authors' prompts unless the entry says otherwise
        )

    def candidates_where(self) -> str:
        """Where a ``candidates`` entry's run files come from and the folder to pass."""
        where = self.candidates_from or "the source the entry names"
        return where + (f", then --candidates {self.candidates_dir}" if self.candidates_dir else "")

    @property
    def uses_llm(self) -> bool:
        """The entry's method generates text (what it declares; the plain query does not)."""
        from r2med_agent.methods import get_method
        from r2med_agent.methods.base import capabilities

        return capabilities(get_method(self.method)).uses_llm

    def row_keys(self) -> list[Any]:
        """What names this entry's result rows: the run spec key of each of its runs (fresh and
        released generations), and ``(method, llm, retriever, reranker)`` when its other settings
        are all defaults."""
        keys: list[Any] = []
        modes = ("bright",) if self.generations == "bright" else ("fresh", "r2med")
        for mode in modes if self.uses_llm else ("fresh",):
            spec = self.run_config((), Path("."), generations=mode).spec()
            keys.append(spec.key())
            if not spec.settings():
                keys.append((self.method, spec.llm_label, spec.retriever_name, self.reranker))
        if not self.args:
            keys.append((self.method, self.llm or NO_LLM, self.retriever, self.reranker))
        return list(dict.fromkeys(keys))

    def generations_mode(self, wanted: str = "r2med") -> str:
        """``r2med`` when R2MED released this entry's generations and ``wanted`` is ``r2med``
        (reproduce's default), else ``fresh``; ``bright`` for an entry that scores BRIGHT's released
        reasoning queries. An entry with several samples per query is always ``fresh``: R2MED
        released one text per query, and ``run`` refuses ``--samples`` above 1 with them."""
        if self.generations == "bright" and self.uses_llm:
            return "bright"
        if wanted != "r2med" or self.generations == "fresh" or not self.uses_llm:
            return "fresh"
        if int(self.args.get("samples", 1)) > 1:
            return "fresh"
        return "r2med" if self.llm in released_llms().get(self.method, ()) else "fresh"

    def command(
        self, task: str, output_dir: Path, data_dir: Path | None = None, generations: str = "fresh",
        allow_count_mismatch: bool = False, candidates_path: Path | None = None,
    ) -> str:
        """The equivalent ``r2med-agent run`` command line (``task``: its ``--task`` value), built
        from the entry's run spec (:func:`~r2med_agent.experiment.command.cli_args`); a
        ``candidates`` entry names ``candidates_path`` (else the folder its files come in,
        ``candidates_dir``; ``<run files>`` for an entry that names none)."""
        from r2med_agent.experiment.command import cli_args

        spec = self.run_config((), Path(output_dir), data_dir, generations).spec()
        where = str(candidates_path) if candidates_path is not None else (self.candidates_dir or "<run files>")
        args = cli_args(spec, where if self.candidates else None)
        parts = ["r2med-agent", "run", *args, "--task", task, "--output-dir", str(output_dir)]
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
    scores: str = "entries"
    """SCORE_SOURCES: ``entries`` or ``published``."""
    args: dict[str, Any] = field(default_factory=dict)
    """Run settings every entry gets unless its own ``args`` give another value."""


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
    averages: tuple[float | None, ...] = ()
    """Per entry, the published average where the source gives one (frontier rows), else None."""


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
            f"unknown table '{name_or_path}'{did_you_mean(str(name_or_path), TABLES)}; allowed: "
            f"{', '.join(TABLES)} (or a .yaml grid file)"
        )
    doc = load_yaml(path)
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{path}: expected a mapping with 'title' and 'entries'")
    spec = _with_grid_args(build(_GridFile, doc, str(path)), path)
    if spec.scores not in SCORE_SOURCES:
        raise ConfigError(f"{path}: scores must be one of {', '.join(SCORE_SOURCES)}, got {spec.scores!r}")
    pub = published_results()
    scores: list[dict[str, float]] = []
    averages: list[float | None] = []
    seen: dict[tuple[str, ...], int] = {}
    from r2med_agent.data import task_names

    grid_tasks = tuple(task_names(spec.tasks))
    benchmark = benchmark_of(grid_tasks[0]) if grid_tasks else ""
    for i, entry in enumerate(spec.entries):
        where = f"{path}: entries[{i}] ({entry.label})"
        if entry.uses_llm and not entry.llm:
            raise ConfigError(f"{where}: method {entry.method} needs an llm")
        unknown = sorted(set(entry.args) - set(RUN_ARGS))
        if unknown:
            raise ConfigError(f"{where}: unknown args {', '.join(unknown)}; allowed: {', '.join(RUN_ARGS)}")
        if entry.generations not in ("auto", "fresh", "bright"):
            raise ConfigError(f"{where}: generations must be auto, fresh or bright, got {entry.generations!r}")
        if bool(entry.candidates) != (entry.retriever == "candidates"):
            raise ConfigError(f"{where}: retriever candidates and a candidates hash go together")
        ident = (entry.method, entry.llm, entry.retriever, entry.reranker, repr(sorted(entry.args.items())),
                 entry.candidates)
        if ident in seen:
            raise ConfigError(f"{where}: duplicate of entries[{seen[ident]}]")
        seen[ident] = i
        for task, value in entry.ndcg_at_10.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{where}: ndcg_at_10.{task} must be a number, got {value!r}")
        csv_scores = {t: v for t, v in pub.scores(entry.published_key, "ndcg_at_10").items() if t in grid_tasks}
        average = pub.average(entry.published_key, benchmark=benchmark)
        averages.append(average)
        if spec.scores == "published":
            _check_published_only(where, entry, csv_scores, average, strict)
            scores.append(csv_scores)
            continue
        if strict:
            _check_entry_scores(where, entry, csv_scores, grid_tasks, pub)
        scores.append({t: float(v) for t, v in entry.ndcg_at_10.items()} if entry.ndcg_at_10 else csv_scores)
    return Grid(name, spec.title, spec.description, path, spec.entries, tuple(scores), grid_tasks, tuple(averages))


def _check_entry_scores(where: str, entry: GridEntry, csv_scores: Mapping[str, float],
                        grid_tasks: Sequence[str], pub: Any) -> None:
    """(strict) ``entry`` gives the published score of each of the grid's tasks, equal to the CSV's."""
    all_tasks = set(grid_tasks)
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


def _check_published_only(where: str, entry: GridEntry, csv_scores: Mapping[str, float], average: float | None,
                          strict: bool) -> None:
    """An entry of a ``scores: published`` grid gives no scores of its own; (strict) the packaged
    CSVs have its published name on the grid's tasks, per task or as an average."""
    if entry.ndcg_at_10:
        raise ConfigError(f"{where}: a grid with 'scores: published' takes its scores from the packaged "
                          "CSVs; remove ndcg_at_10")
    if strict and not csv_scores and average is None:
        from r2med_agent.analysis.published import DEFAULT_FILES

        raise ConfigError(f"{where}: no published row for {entry.published_key} on the grid's tasks in "
                          f"{', '.join(DEFAULT_FILES)}")


def _with_grid_args(grid: _GridFile, path: Path) -> _GridFile:
    """``grid`` with its top-level ``args`` given to every entry (an entry's own win)."""
    unknown = sorted(set(grid.args) - set(RUN_ARGS))
    if unknown:
        raise ConfigError(f"{path}: unknown args {', '.join(unknown)}; allowed: {', '.join(RUN_ARGS)}")
    if not grid.args:
        return grid
    return replace(grid, entries=tuple(replace(e, args={**grid.args, **e.args}) for e in grid.entries))


def reference_line(spec: RunSpec) -> str:
    """How a run handles what R2MED's scripts did their own way: documents whose id is the
    query's (BEIR's exact search excludes them), empty generations (R2MED uses them as they are),
    and the prompt's way into a vLLM engine (R2MED renders it for ``LLM.generate``)."""
    parts = ["identical ids " + ("excluded" if spec.exclude_identical_ids else "kept")]
    if not spec.llm:  # a resolved spec has an LLM only where its method generates
        parts.append("no generations")
    else:
        parts.append("empty generations " + ("kept" if spec.empty_generation == "keep" else "-> the query"))
    if spec.llm_prompt != "chat":
        parts.append(f"vLLM prompt {spec.llm_prompt}")
    return "; ".join(parts)


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


