"""The comparison table: result rows against tasks, with published scores, significance and cost."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from r2med_agent.errors import ConfigError, did_you_mean
from r2med_agent.analysis.stats import EXACT_MAX_N, TESTS, PairedTest, compare_tasks

logger = logging.getLogger(__name__)

from r2med_agent.analysis.published import (
    PUBLISHED_METRICS,
    PUBLISHED_RETRIEVERS,
    PublishedKey,
    PublishedResults,
    published_results,
)
from r2med_agent.analysis.results import NO_LLM, ResultRow, task_order

PARTIAL_MARK = "†"
BETTER_MARK = "▲"
WORSE_MARK = "▼"
MISSING = "—"


RowAliases = Mapping[Any, PublishedKey]
"""A result row -> its name in the published CSV: keyed by the row's run spec key
(:meth:`RunSpec.key`), or by ``(method, llm, retriever, reranker)`` for a row whose other
settings are all defaults."""


def grid_aliases() -> dict[Any, PublishedKey]:
    """Run specs -> published names of every package reproduction grid entry."""
    from r2med_agent.grids.grid import load_grids

    return {key: e.published_key for grid in load_grids().values() for e in grid.entries for key in e.row_keys()}


def published_key(
    row: ResultRow, published: PublishedResults | None = None, aliases: RowAliases | None = None
) -> PublishedKey | None:
    """The published configuration matching ``row``, or None.

    A row whose settings are all defaults matches by name as the CSV spells them (method ``none``
    for plain retrieval; the CSV's llm is empty where the row's is ``none``), with the retriever
    renamed by PUBLISHED_RETRIEVERS (``bm25-compat`` -> ``bm25``). A row run under other names or
    settings matches through ``aliases`` by its run spec (default: the package reproduction grids,
    whose entries may carry a ``published:`` override).
    """
    from r2med_agent.data.released import base_llm

    published = published or published_results()
    # A row made from R2MED's released generations (<llm>@r2med) stands for the same published row.
    llm = "" if row.llm in (NO_LLM, "", "-") else base_llm(row.llm)
    if not row.settings:
        for retriever in dict.fromkeys([row.retriever, PUBLISHED_RETRIEVERS.get(row.retriever, row.retriever)]):
            key = PublishedKey(row.method, llm, retriever, row.reranker)
            if key in published:
                return key
    aliases = grid_aliases() if aliases is None else aliases
    alias = aliases.get(row.spec.key()) if row.spec is not None else None
    if alias is None and not row.settings:
        alias = aliases.get((row.method, llm or NO_LLM, *row.key[2:]))
    return alias if alias is not None and alias in published else None


# ----------------------------------------------------------------------------------------------
# The comparison table


@dataclass(frozen=True)
class TableRow:
    """One line of a :class:`ComparisonTable`.

    Attributes:
        index: position in the table (what ``--baseline`` accepts as a number).
        row: the loaded results.
        values: task -> mean for the table's metric (None: the row lacks that task).
        average: mean of ``values`` over the tasks the row has (None when it has none).
        missing_tasks: table tasks the row lacks; the average is partial when not empty.
        published: task -> the paper's score (only with published=True; tasks without one absent).
        published_average: the paper's mean over exactly the row's tasks (None when any is missing);
            for a configuration published as an 8-task average only (frontier rows), that average
            when the row has the 8 R2MED tasks.
        published_key: the published configuration matched (None: none).
        tests: task (and ``"all"``) -> paired test against the baseline (empty for the baseline).
        totals: ``stats`` summed over the table's tasks.
    """

    index: int
    row: ResultRow
    values: dict[str, float | None]
    average: float | None
    missing_tasks: tuple[str, ...]
    published: dict[str, float]
    published_average: float | None
    tests: dict[str, PairedTest]
    totals: dict[str, float]
    published_key: PublishedKey | None = None

    @property
    def partial(self) -> bool:
        return bool(self.missing_tasks)


@dataclass(frozen=True)
class ComparisonTable:
    """Rows of results against the tasks; build it with :func:`build_table`."""

    metric: str
    tasks: tuple[str, ...]
    rows: tuple[TableRow, ...]
    show_source: bool = False
    with_published: bool = False
    baseline: int | None = None
    alpha: float = 0.05
    test: str = "permutation"
    n_resamples: int = 10_000
    with_cost: bool = False
    published_scores: PublishedResults | None = None
    """Where the published columns came from (for their sources' footnotes)."""
    statuses: Mapping[int, str] = field(default_factory=dict)
    """Row index -> how the row's run compares with its authors' (a reproduction grid's
    ``differences``: ``as the authors ran it`` or what differs), one footnote each."""

    def marker(self, row: TableRow, task: str) -> str:
        """``▲``/``▼`` when ``row`` differs significantly from the baseline on ``task`` (or ``"all"``)."""
        t = row.tests.get(task)
        if t is None or not t.significant(self.alpha):
            return ""
        return BETTER_MARK if t.mean_diff > 0 else WORSE_MARK

    def footnotes(self) -> list[str]:
        """Legend lines: partial averages, significance markers."""
        notes = [f"row {i} ({self.rows[i].row.label}): {status}" for i, status in sorted(self.statuses.items())]
        for r in self.rows:
            if r.partial and r.average is not None:
                have = len(self.tasks) - len(r.missing_tasks)
                notes.append(
                    f"{PARTIAL_MARK} row {r.index} ({r.row.label}): average over {have} of {len(self.tasks)} "
                    f"tasks; missing: {', '.join(r.missing_tasks)}"
                )
        if self.baseline is not None:
            base = self.rows[self.baseline].row.label
            how = (
                f"paired randomisation test over queries: all 2^n sign flips for n <= {EXACT_MAX_N}, "
                f"else {self.n_resamples} random ones"
                if self.test == "permutation"
                else f"paired bootstrap test over queries, {self.n_resamples} resamples"
            )
            notes.append(
                f"{BETTER_MARK}/{WORSE_MARK}: better/worse than the baseline, row {self.baseline} ({base}), "
                f"with p < {self.alpha:g} ({how}). The Avg column's test is stratified by task: its "
                "statistic is the mean over the tasks both rows have of the per-task mean differences "
                "(every task weighs the same, as in the average), with signs flipped per query or "
                "queries resampled within each task; W/T/L counts queries over those tasks"
            )
        if self.with_published:
            notes.append(
                "paper: R2MED's published score (arXiv 2505.14558; on the nano- tasks, the "
                "NanoR2MED card's, hakari-bench/NanoR2MED; on the bright- tasks, BRIGHT's, arXiv "
                "2407.12883, or the source named below); its average covers the same "
                f"tasks as ours and is {MISSING} when the paper lacks any of them"
            )
            notes += self._source_notes()
        return notes

    def _source_notes(self) -> list[str]:
        """One note per row whose published numbers come from another source than the paper."""
        pub = self.published_scores
        if pub is None:
            return []
        from r2med_agent.analysis.published import PAPER_SOURCE, benchmark_of

        out = []
        for r in self.rows:
            if r.published_key is None:
                continue
            benches = list(dict.fromkeys(benchmark_of(t) for t in r.published))
            for bench in benches or pub.benchmarks(r.published_key)[:1]:
                info = pub.info(r.published_key, bench)
                if pub.kind(r.published_key, bench) != "frontier" and info.source == PAPER_SOURCE:
                    continue  # R2MED's own paper: said once in the legend
                where = {"bright": " on BRIGHT", "bright-long": " on BRIGHT's long documents"}.get(bench, "")
                line = f"row {r.index} ({r.row.label}){where}: published as {info.system or r.row.label}"
                line += f" over {info.first_stage}" if info.first_stage else ""
                line += f", {info.source}"
                out.append(line + (f"; {info.note}" if info.note else ""))
        return out


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def find_row(rows: Sequence[ResultRow], spec: str) -> int:
    """Index of the row ``spec`` names: a row index, a row's whole label
    (``method/llm/retriever[/reranker] [settings]``), or ``method/llm/retriever[/reranker]`` when
    one row alone has those names.

    Raises:
        ConfigError: no row or several rows match (the message lists the rows).
    """
    spec = spec.strip()
    listing = "; ".join(f"{i}: {r.label}" for i, r in enumerate(rows))
    if spec.isdigit():
        i = int(spec)
        if i >= len(rows):
            raise ConfigError(f"--baseline {spec}: there are only {len(rows)} rows ({listing})")
        return i
    exact = [i for i, r in enumerate(rows) if r.label == spec]
    if len(exact) == 1:
        return exact[0]
    parts = spec.split(" [", 1)[0].split("/")
    if len(parts) not in (3, 4):
        raise ConfigError(
            f"--baseline '{spec}': use a row index or method/llm/retriever[/reranker] (rows: {listing})"
        )
    method, llm, retriever = parts[:3]
    reranker = parts[3] if len(parts) == 4 else ""
    llm_names = {NO_LLM, "", "-"} if llm in (NO_LLM, "", "-") else {llm}
    hits = exact or [
        i
        for i, r in enumerate(rows)
        if (r.method, r.retriever, r.reranker) == (method, retriever, reranker) and r.llm in llm_names
    ]
    if not hits:
        raise ConfigError(f"--baseline '{spec}' matches no row; rows: {listing}")
    if len(hits) > 1:
        raise ConfigError(
            f"--baseline '{spec}' matches rows {', '.join(map(str, hits))} (the same configuration with "
            f"other settings, or in several results directories); give the row index or the whole "
            f"label instead. Rows: {listing}"
        )
    return hits[0]


@dataclass(frozen=True)
class TableOptions:
    """How :func:`build_table` lays rows out (every field a keyword of ``build_table``).

    Attributes:
        tasks: columns to show (default: every task any row has, R2MED order first).
        published: add the paper's scores (matched by :func:`published_key`).
        baseline: a row index or a row's label; every other row is tested against it, per task
            and over the tasks (stratified: each task weighs the same).
        alpha: significance level of the markers.
        test: ``permutation`` or ``bootstrap``.
        n_resamples: Monte Carlo permutations / bootstrap resamples.
        seed: seed of the tests.
        cost: sum the result files' ``stats`` into cost columns.
        published_scores: another published CSV (default: the packaged one).
        published_aliases: row specs -> published names (default: the package grids').
    """

    tasks: Sequence[str] | None = None
    published: bool = False
    baseline: str | int | None = None
    alpha: float = 0.05
    test: str = "permutation"
    n_resamples: int = 10_000
    seed: int = 0
    cost: bool = False
    published_scores: PublishedResults | None = None
    published_aliases: RowAliases | None = None


def build_table(rows: Sequence[ResultRow], metric: str = "ndcg_at_10", options: TableOptions | None = None,
                **keywords: Any) -> ComparisonTable:
    """Lay ``rows`` out against the tasks.

    Args:
        rows: loaded results (:func:`load_results`), in display order.
        metric: the metric key shown (``ndcg_at_10``, ``recall_at_100``, ...).
        options: the layout (:class:`TableOptions`); or give its fields as keywords.

    Raises:
        ConfigError: unknown metric (none of the files has it), bad baseline, bad test name,
            an unknown keyword.
    """
    opts = _table_options(options, keywords)
    if not rows:
        raise ConfigError("no results to compare: no <Task>.json found under the given directories")
    if opts.test not in TESTS:
        raise ConfigError(f"unknown significance test '{opts.test}'; allowed: {', '.join(TESTS)}")
    if not 0 < opts.alpha < 1:
        raise ConfigError(f"--alpha must be between 0 and 1, got {opts.alpha}")
    from r2med_agent.evaluation import metric_key

    metric = metric_key(metric)  # ndcg@10, NDCG@10, ndcg_cut_10 -> ndcg_at_10
    known = {m for r in rows for t in r.tasks.values() for m in t.scores}
    if metric not in known:
        spelt = {k.replace("_at_", "@"): k for k in known}
        raise ConfigError(f"no result file has metric '{metric}'{did_you_mean(metric, [*known, *spelt])}; "
                          f"available: {', '.join(sorted(known))}")
    columns = _columns(rows, opts.tasks)
    if opts.tasks is not None:
        rows = _rows_with_results(rows, metric, columns)
    base_index = _baseline_index(rows, opts.baseline)
    pub = (opts.published_scores or published_results()) if opts.published else None
    aliases = opts.published_aliases if opts.published_aliases is not None else (
        grid_aliases() if opts.published else {})
    if pub is not None and metric not in PUBLISHED_METRICS:
        logger.warning("the paper reports no %s; the published columns stay empty", metric)
    base_pq = _per_query_table(rows[base_index], metric, columns) if base_index is not None else None
    out = []
    for i, r in enumerate(rows):
        tests: dict[str, PairedTest] = {}
        if base_pq is not None and i != base_index:
            tests = compare_tasks(base_pq, _per_query_table(r, metric, columns), test=opts.test,
                                  n_resamples=opts.n_resamples, seed=opts.seed)
        out.append(_table_row(i, r, metric, columns, pub, aliases, tests, opts.cost))
    return ComparisonTable(
        metric=metric,
        tasks=columns,
        rows=tuple(out),
        show_source=len({r.source for r in rows}) > 1,
        with_published=opts.published,
        baseline=base_index,
        alpha=opts.alpha,
        test=opts.test,
        n_resamples=opts.n_resamples,
        with_cost=opts.cost,
        published_scores=pub,
    )


def _table_options(options: TableOptions | None, keywords: Mapping[str, Any]) -> TableOptions:
    from dataclasses import fields, replace

    names = {f.name for f in fields(TableOptions)}
    unknown = sorted(set(keywords) - names)
    if unknown:
        raise ConfigError(f"build_table: unknown option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(names))}")
    return replace(options or TableOptions(), **keywords)


def _columns(rows: Sequence[ResultRow], tasks: Sequence[str] | None) -> tuple[str, ...]:
    all_tasks = task_order({t for r in rows for t in r.tasks})
    if tasks is None:
        return tuple(all_tasks)
    unknown = [t for t in tasks if t not in all_tasks]
    if unknown:
        raise ConfigError(f"no results for task(s) {', '.join(unknown)}; tasks found: {', '.join(all_tasks)}")
    return tuple(tasks)


def _rows_with_results(rows: Sequence[ResultRow], metric: str, columns: Sequence[str]) -> Sequence[ResultRow]:
    """The rows with a result on at least one of the chosen task columns (``--tasks``): a row
    with none of them would be a line of dashes; the rows left out are logged."""
    has = [any(r.score(t, metric) is not None for t in columns) for r in rows]
    kept = [r for r, h in zip(rows, has) if h]
    left = [r.label for r, h in zip(rows, has) if not h]
    if left:
        logger.info("%d row(s) without a %s result on %s left out: %s", len(left), metric, ", ".join(columns),
                    "; ".join(left))
    if not kept:
        raise ConfigError(f"no result has {metric} on {', '.join(columns)}")
    return kept


def _baseline_index(rows: Sequence[ResultRow], baseline: str | int | None) -> int | None:
    if baseline is None:
        return None
    index = baseline if isinstance(baseline, int) else find_row(rows, str(baseline))
    if not 0 <= index < len(rows):
        raise ConfigError(f"baseline row {index} out of range (0..{len(rows) - 1})")
    return index


def _per_query_table(r: ResultRow, metric: str, columns: Sequence[str]) -> dict[str, dict[str, float]]:
    return {t: r.per_query(t, metric) for t in columns if r.score(t, metric) is not None}


def _source_average(pub: PublishedResults, key: PublishedKey, metric: str, tasks: Sequence[str]) -> float | None:
    """The average a source gives for ``key`` over one benchmark's tasks (R2MED's 8, BRIGHT's 12,
    BRIGHT's 8 long-document ones) when ``tasks`` are exactly those, else None."""
    from r2med_agent.analysis.published import BENCHMARK_GROUPS
    from r2med_agent.data import task_names

    for bench, group in BENCHMARK_GROUPS.items():
        average = pub.average(key, metric, bench)
        if average is not None and tasks and set(tasks) == set(task_names(group)):
            return average
    return None


def _table_row(i: int, r: ResultRow, metric: str, columns: Sequence[str], pub: PublishedResults | None,
               aliases: RowAliases, tests: dict[str, PairedTest], cost: bool) -> TableRow:
    """One row: its values, average, missing tasks, published scores (``pub``) and tests."""
    values = {t: r.score(t, metric) for t in columns}
    present = [v for v in values.values() if v is not None]
    pub_values: dict[str, float] = {}
    pub_avg = None
    key = published_key(r, pub, aliases) if pub is not None else None
    if pub is not None and key is not None:
        scores = pub.scores(key, metric)
        pub_values = {t: scores[t] for t in columns if t in scores}
        have = [t for t, v in values.items() if v is not None]
        if have and all(t in pub_values for t in have):
            pub_avg = _mean(pub_values[t] for t in have)
        else:  # a configuration published as an average only, over exactly the row's tasks
            pub_avg = _source_average(pub, key, metric, have)
    return TableRow(
        index=i,
        row=r,
        values=values,
        average=_mean(present),
        missing_tasks=tuple(t for t, v in values.items() if v is None),
        published=pub_values,
        published_average=pub_avg,
        tests=tests,
        totals=r.totals(columns) if cost else {},
        published_key=key,
    )



