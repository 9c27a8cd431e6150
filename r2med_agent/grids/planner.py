"""Planning and running a reproduction grid: which tasks are done or stale, the commands, the table."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from r2med_agent.analysis.results import load_results, r2med_tasks
from r2med_agent.errors import ConfigError, DataError
from r2med_agent.experiment.spec import RunSpec
from r2med_agent.methods.base import capabilities
from r2med_agent.experiment.store import (
    ResultStore,
    read_task_record,
    spec_of_record,
)

logger = logging.getLogger(__name__)
from r2med_agent.grids.first_stage import first_stage_lines
from r2med_agent.grids.grid import GPU_GIB, Grid, GridEntry, reference_line
from r2med_agent.grids.needs import Needs, dataset_repos, entry_needs, load_models
from r2med_agent.analysis.tables import ComparisonTable, build_table

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
        candidates: the first-stage run files of the grid's ``candidates`` entries (as ``run
            --candidates``; checked against the hash each entry holds).
    """

    output_dir: Path = Path("results")
    data_dir: Path | None = None
    tasks: tuple[str, ...] = field(default_factory=r2med_tasks)
    gpu_gib: float = GPU_GIB
    generations: str = "r2med"
    allow_count_mismatch: bool = False
    candidates: Path | None = None

    def __post_init__(self) -> None:
        from r2med_agent.data.released import check_generations

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
    spec_key: str = ""
    source_average: float | None = None
    """The published average over the grid's tasks where the source gives one (frontier rows,
    BRIGHT's averages)."""
    source_tasks: tuple[str, ...] = ()
    """The tasks ``source_average`` covers (default: R2MED's 8)."""
    prompts: str = ""
    """Whose prompts the row renders (the authors' at a pinned commit, and whether they are at
    hand; imported ones; or the project's own); "none ..." when it renders none."""
    plan: Any = field(default=None, compare=False, repr=False)
    """The row's run plan (:class:`~r2med_agent.experiment.plan.RunPlan`): the entries its
    estimates, first stage and cluster resources read."""

    @property
    def published_average(self) -> float | None:
        """The published mean over the planned tasks (None when it lacks any of them); over the 8
        R2MED tasks, the source's own average where it gives one (frontier rows)."""
        tasks = self.done + self.pending
        if self.source_average is not None and set(tasks) == set(self.source_tasks or r2med_tasks()):
            return self.source_average
        if tasks and all(t in self.published for t in tasks):
            return sum(self.published[t] for t in tasks) / len(tasks)
        return None


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


def stale_reason(path: Path, expected: RunSpec, data: tuple[str, str | None]) -> str | None:
    """Why the result file ``path`` does not belong to a run of spec ``expected`` on data
    ``(source, fingerprint)``, or None when it does.

    Settings are compared as run specs (every result-changing setting); the data by corpus
    fingerprint when the expected one is known (local and package data), else by source (hub
    ``repo@revision``).
    """
    try:
        rec = read_task_record(path)
    except DataError as e:
        return f"unreadable result file ({e})"
    if rec is None or not isinstance(rec.get("config"), Mapping):
        return "no run config recorded"
    have = spec_of_record(rec)
    diffs = spec_differences(have, expected) if have is not None else ["run config not understood"]
    if have is not None and not diffs and have.key() != expected.key():
        diffs.append(f"run spec {have.label}, the entry {expected.label}")
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


def spec_differences(have: RunSpec, want: RunSpec) -> list[str]:
    """``"<setting> <recorded>, the entry <wanted>"`` for every setting that differs."""
    from r2med_agent.experiment.resolve import applicable

    a, b = _shown(have), _shown(want)
    return [f"{k} {a[k]!r}, the entry {b[k]!r}" for k in applicable(want) if a[k] != b[k]]


def _shown(spec: RunSpec) -> dict[str, Any]:
    """A spec's record with an unset loop retriever shown as the one it stands for."""
    rec = spec.record()
    if rec["loop_retriever"] is None and capabilities(_method_class(spec.method)).agentic:
        rec["loop_retriever"] = rec["retriever"]
    return rec


def _method_class(name: str) -> Any:
    from r2med_agent.methods import get_method

    return get_method(name)


def task_option(tasks: Sequence[str]) -> str:
    """``run --task`` for ``tasks``: ``all`` for the 8 R2MED tasks, ``nano-all`` for the 8
    NanoR2MED splits, else a comma list."""
    from r2med_agent.data import task_names

    if tuple(tasks) == r2med_tasks():
        return "all"
    for group in ("nano-all", "bright-all", "bright-long-all"):
        if tuple(tasks) == tuple(task_names(group)):
            return group
    return ",".join(tasks)


def plan(grid: Grid, opts: ReproduceOptions) -> list[PlannedRun]:
    """Every entry of ``grid`` with its command, finished/pending tasks and needs."""
    models = load_models()
    repos: dict[tuple[str, ...], list[str]] = {}
    task_arg = task_option(opts.tasks)
    expected_data = _ExpectedData(opts.data_dir, opts.allow_count_mismatch)
    store = ResultStore(opts.output_dir)
    out = []
    averages = grid.averages or (None,) * len(grid.entries)
    for entry, scores, average in zip(grid.entries, grid.published, averages):
        mode = entry.generations_mode(opts.generations)
        cfg = entry.run_config(opts.tasks, opts.output_dir, opts.data_dir, mode, opts.allow_count_mismatch)
        spec = cfg.spec()
        stale: dict[str, str] = {}
        done = []
        for t in opts.tasks:
            path = _result_file(store, spec, t)
            reason = None if path is None else stale_reason(path, spec, expected_data(t))
            if reason is not None:
                stale[t] = reason
            elif path is not None:
                done.append(t)
        pending = tuple(t for t in opts.tasks if t not in done)
        needed = pending or opts.tasks
        if needed not in repos:
            repos[needed] = dataset_repos(needed, opts.data_dir)
        out.append(
            PlannedRun(
                entry=entry,
                published=scores,
                command=entry.command(task_arg, opts.output_dir, opts.data_dir, mode, opts.allow_count_mismatch,
                                      opts.candidates),
                result_dir=store.folder(spec),
                done=tuple(done),
                pending=pending,
                needs=entry_needs(entry, cfg.plan, repos[needed], opts.gpu_gib, models, generations=mode,
                                  n_queries=_queries(needed), tasks=needed),
                stale=stale,
                generations=mode,
                spec_key=spec.key(),
                source_average=average,
                source_tasks=grid.tasks,
                prompts=_prompts_line(cfg.plan),
                plan=cfg.plan,
            )
        )
    return out


def _prompts_line(plan: Any) -> str:
    """Whose prompts a row renders: the authors' (each source's repo@commit, its files, and
    whether they are at hand), the imports or the user's own files in $R2MED_PROMPTS_DIR, or the
    project's; "none" when it renders none (no LLM, or released generations only)."""
    from r2med_agent.prompts.sources import describe

    return describe(plan) or "none (no LLM reads a prompt in this row)"


def _result_file(store: ResultStore, spec: RunSpec, task: str) -> Path | None:
    """The task's result of ``spec`` (its own folder, or where an earlier version wrote it), else
    a file another spec left where this one's would be (reported stale), else None."""
    found = store.find(spec, task)
    if found is not None:
        return found
    for folder in store.places(spec):
        if (folder / f"{task}.json").exists():
            return folder / f"{task}.json"
    return None


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
        who = "published" if p.source_average is not None else "paper"
        paper = f"{who} nDCG@10 avg {avg:.4f}" if avg is not None else "no published score"
        lines.append(f"[{i}] {p.entry.label}  ({status}; {paper})")
        lines.append(f"    {p.command}")
        lines.append(f"    {reference_line(RunSpec.from_key(p.spec_key))}")
        scores = [f"{t} {p.published[t]}" for t in (*p.done, *p.pending) if t in p.published]
        if scores:
            lines.append(f"    {who} nDCG@10: {', '.join(scores)}")
        if p.done and p.pending:
            lines.append(f"    done: {', '.join(p.done)}; runs: {', '.join(p.pending)}")
        for task, reason in p.stale.items():
            lines.append(f"    stale {task} (runs again): {reason}")
        if p.prompts:
            lines.append(f"    prompts: {p.prompts}")
        lines += [f"    {line}" for line in first_stage_lines(p.plan, p.done + p.pending)]
        lines += [f"    {line}" for line in p.needs.lines()]
        if p.entry.candidates:
            lines.append(f"    first-stage run files: {p.entry.candidates_where()} (hash {p.entry.candidates})")
        lines += [f"    {line}" for line in _source_lines(p.entry, p.done + p.pending)]
        if p.entry.differences is not None:
            lines.append(f"    status: {p.entry.status}")
        if p.entry.note:
            lines.append(f"    note: {p.entry.note}")
    todo = sum(1 for p in planned if p.pending)
    stale = sum(1 for p in planned if p.stale)
    lines.append(
        f"{len(planned)} configuration(s): {todo} to run"
        + (f" ({stale} with stale results)" if stale else "")
        + f", {len(planned) - todo} already done"
    )
    total = _total_line([p for p in planned if p.pending])
    if total:
        lines.append(total)
    if stale:
        lines.append("A stale result made by another run spec is never replaced: `r2med-agent results migrate` "
                     "files it under its own folder before the re-run.")
    return "\n".join(lines) + "\n"


def _total_line(planned: Sequence[PlannedRun]) -> str:
    """The grand total of the LLM and encoding work of the configurations still to run ("" when
    they have none): calls, tokens, GPU-hours of self-hosted models and dollars of priced APIs (the
    per-entry estimates added up, each corpus's embeddings once per encoder; upper bounds, as they
    are)."""
    from r2med_agent.grids.estimates import format_hours

    estimates = [e for p in planned for e in p.needs.estimates]
    encoding = [e for p in planned for e in p.needs.encoding]
    if not estimates and not encoding:
        return ""
    calls = sum(e.calls for e in estimates)
    p_in = sum(e.prompt_tokens for e in estimates)
    p_out = sum(e.output_tokens for e in estimates)
    hours = [e.gpu_hours for e in estimates if e.gpu_hours is not None]
    usd = [e.usd for e in estimates if e.usd is not None]
    unpriced = sorted({e.label.split(" ")[0] for e in estimates if e.api and e.usd is None}
                      | {e.encoder for e in encoding if e.api and e.doc_usd is None})
    parts = [f"{calls:,} LLM calls", f"≤{p_in / 1e6:,.1f}M prompt tokens", f"≤{p_out / 1e6:,.1f}M output tokens"] \
        if estimates else []
    if encoding:  # a corpus is embedded once per encoder (the embedding cache), its queries per row
        docs = {e.doc_key: e for e in encoding}.values()
        tokens = sum(e.doc_tokens for e in docs) + sum(e.query_tokens for e in encoding)
        parts.append(f"≤{tokens / 1e6:,.1f}M tokens to embed ({len(docs)} corpus encoding(s))")
        hours += [e.doc_hours for e in docs if e.doc_hours is not None]
        hours += [e.query_hours for e in encoding if e.query_hours is not None]
        usd += [e.doc_usd for e in docs if e.doc_usd is not None]
        usd += [e.query_usd for e in encoding if e.query_usd is not None]
    if hours:
        total = format_hours(sum(hours))
        parts.append(f"{'' if total.startswith('<') else '≤'}{total} GPU-hours (self-hosted models)")
    if usd:
        parts.append(f"≤${sum(usd):,.0f} (priced APIs)")
    line = f"total of the {len(planned)} configuration(s) to run: " + ", ".join(parts)
    if unpriced:
        line += f"; no price for: {', '.join(unpriced)}"
    return line


def unlisted_published(grid: Grid) -> str:
    """For a BRIGHT grid, the published rows of its tables that no entry runs (an embedding API or
    a reranking prompt this project does not have): each with its numbers, source and why, so that
    ``--dry-run`` lists every row of BRIGHT's tables. Empty for the other grids."""
    from r2med_agent.analysis.published import benchmark_of, published_results

    bench = benchmark_of(grid.tasks[0]) if grid.tasks else ""
    if not bench:
        return ""
    pub = published_results()
    keys = {e.published_key for e in grid.entries}
    kinds = {pub.kind(k, bench) for k in keys} - {None}
    if "bright" in kinds:
        kinds.add("bright-rerank")
    lines = []
    for key in pub.keys():
        if key in keys or pub.kind(key, bench) not in kinds:
            continue
        info = pub.info(key, bench)
        scores = {t: v for t, v in pub.scores(key).items() if t in grid.tasks}
        average = pub.average(key, benchmark=bench)
        shown = f"avg {average:.4f}" if average is not None else "no average"
        lines.append(f"[-] {info.system or key}  ({shown}; published, no command here)")
        if scores:
            lines.append(f"    published nDCG@10: {', '.join(f'{t} {v}' for t, v in scores.items())}")
        lines.append(f"    published as: {info.system}" + (f" over {info.first_stage}" if info.first_stage else "")
                     + f"; {info.source}")
        if info.note:
            lines.append(f"    note: {info.note}")
    if not lines:
        return ""
    return f"{sum(1 for line in lines if line.startswith('[-]'))} published row(s) of these tables with no command here:\n" \
        + "\n".join(lines) + "\n"


def _source_lines(entry: GridEntry, tasks: Sequence[str] = ()) -> list[str]:
    """Where an entry's published numbers on ``tasks`` come from (none for R2MED's paper rows)."""
    from r2med_agent.analysis.published import PAPER_SOURCE, benchmark_of, published_results

    pub = published_results()
    key = entry.published_key
    bench = benchmark_of(tasks[0]) if tasks else ""
    info = pub.info(key, bench)
    if pub.kind(key, bench) != "frontier" and info.source == PAPER_SOURCE:
        return []
    out = [f"published as: {info.system}" + (f" over {info.first_stage}" if info.first_stage else "")
           + f"; {info.source}"]
    if info.checked:
        out.append(f"checked: {info.checked}")
    if info.note:
        out.append(f"note: {info.note}")
    return out


def _run_one(entry: GridEntry, opts: ReproduceOptions, tasks: Sequence[str]) -> None:
    """Run one entry on ``tasks`` in-process through the runner (the one call to wire)."""
    from r2med_agent.experiment.runner import run_experiment

    mode = entry.generations_mode(opts.generations)
    if entry.candidates and opts.candidates is None:
        raise ConfigError(f"{entry.label} reranks given run files: pass them with --candidates PATH "
                          f"({entry.candidates_where()})")
    run_experiment(entry.run_config(tasks, opts.output_dir, opts.data_dir, mode, opts.allow_count_mismatch,
                                    opts.candidates))


def reproduce(grid: Grid, opts: ReproduceOptions, ray: str | None = None) -> ComparisonTable:
    """Run every entry's pending tasks, then compare the grid's results with the paper.

    Args:
        ray: run the pending rows as tasks on the Ray cluster at this address
            (:mod:`r2med_agent.grids.cluster`); None: one after another in this process.

    Returns:
        The comparison table (rows in grid order, published scores beside ours).
    """
    planned = plan(grid, opts)
    _have_prompts(planned)
    if ray is not None:
        from r2med_agent.grids.cluster import run_grid

        run_grid(planned, opts, ray)
        return results_table(grid, opts, plan(grid, opts))
    for i, p in enumerate(planned):
        if not p.pending:
            logger.info("[%d/%d] %s: results exist, skipped", i + 1, len(planned), p.entry.label)
            continue
        for task, reason in p.stale.items():
            logger.warning("%s %s: stale result (%s); running it again", p.entry.label, task, reason)
        logger.info("[%d/%d] %s on %s", i + 1, len(planned), p.entry.label, ", ".join(p.pending))
        _run_one(p.entry, opts, p.pending)
    return results_table(grid, opts, planned)


def _have_prompts(planned: Sequence[PlannedRun]) -> None:
    """The authors' prompts of every row that will run, fetched (or refused) before the first
    row starts: a grid never stops hours in for want of a prompt file."""
    from r2med_agent.prompts.sources import ensure, plan_folders

    needed = {}
    for p in planned:
        if p.pending:
            folders = plan_folders(p.plan.prompt_folders)
            needed.update({s.name: s for _, _, s in folders if s is not None})
    for source in needed.values():
        ensure(source)


def results_table(
    grid: Grid, opts: ReproduceOptions, planned: Sequence[PlannedRun] | None = None
) -> ComparisonTable:
    """The grid's finished results beside the published scores (rows in grid order)."""
    planned = plan(grid, opts) if planned is None else planned
    order = {p.spec_key: i for i, p in enumerate(planned)}
    root = Path(opts.output_dir)
    rows = load_results([root]) if root.is_dir() else []
    rows = sorted((r for r in rows if r.spec is not None and r.spec.key() in order),
                  key=lambda r: order[r.spec.key()])  # type: ignore[union-attr]
    if not rows:
        raise ConfigError(f"no results of grid '{grid.name}' under {root} yet; run without --dry-run")
    tasks = [t for t in opts.tasks if any(t in r.tasks for r in rows)]
    aliases = {key: e.published_key for e in grid.entries for key in e.row_keys()}
    table = build_table(
        rows, "ndcg_at_10", tasks=tasks, published=any(grid.published) or any(a is not None for a in grid.averages),
        published_aliases=aliases
    )
    statuses = {i: planned[order[r.spec.key()]].entry.status for i, r in enumerate(rows)  # type: ignore[union-attr]
                if planned[order[r.spec.key()]].entry.differences is not None}  # type: ignore[union-attr]
    return dataclasses.replace(table, statuses=statuses) if statuses else table

