"""Scoring with pytrec_eval (trec_eval semantics), as R2MED does, with every qrels query counted.

Pure functions over Run and Qrels. Two pitfalls of the usual wrappers are fixed here:

* pytrec_eval evaluates only the queries present in both the run and the qrels, so a query the
  system returned nothing for silently disappears from the mean. Here every qrels query counts: one
  that is missing from the run (or has an empty ranking) scores 0 on every measure, and their
  number is reported.
* The run is cut to the top ``depth`` documents (100, as R2MED does) in trec_eval's own order
  (score descending, then document id descending), so the cut keeps exactly the documents trec_eval
  would rank first.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from r2med_agent.errors import ConfigError
from r2med_agent.types import Qrels, Run

CUTOFFS: tuple[int, ...] = (1, 10, 25, 50, 100)
"""Cut-offs of docs/protocol.md: nDCG, MAP, Recall and P at 1/10/25/50/100."""

_FAMILIES = {"ndcg": "ndcg_cut", "map": "map_cut", "recall": "recall", "precision": "P"}

DEFAULT_METRICS: tuple[str, ...] = tuple(
    f"{fam}_at_{k}" for fam in _FAMILIES for k in CUTOFFS
) + ("mrr",)
"""Metric keys as R2MED's result JSON names them (``ndcg_at_10``, ..., ``mrr``)."""


_METRIC_NAME = re.compile(
    r"(ndcg|map|recall|p|precision)(?:@|_at_|_cut_|_cut\.|_|\.)(\d+)", re.IGNORECASE
)
_FAMILY_KEYS = {"ndcg": "ndcg", "map": "map", "recall": "recall", "p": "precision",
                "precision": "precision"}
_MRR_NAMES = {"mrr", "recip_rank", "mrr@100", "mrr_at_100", "rr"}


def metric_key(name: str) -> str:
    """The result files' key for a metric as trec_eval, pyserini, BEIR or MTEB users type it.

    ``ndcg@10``, ``NDCG@10``, ``ndcg_cut_10``, ``ndcg_cut.10`` and ``ndcg_at_10`` are all
    ``ndcg_at_10``; ``P_10``/``P@10`` -> ``precision_at_10``; ``recall_100``/``recall.100``/
    ``R@100``-style names with the family spelt out -> ``recall_at_100``; ``map_cut_10`` ->
    ``map_at_10``; ``recip_rank``/``MRR`` -> ``mrr``. A name none of these match comes back
    unchanged (the caller then says which names exist).
    """
    text = name.strip()
    if text.lower() in _MRR_NAMES:
        return "mrr"
    m = _METRIC_NAME.fullmatch(text)
    if m is None:
        return text
    return f"{_FAMILY_KEYS[m.group(1).lower()]}_at_{int(m.group(2))}"


def _trec_measure(metric: str) -> tuple[str, str]:
    """Map ``ndcg_at_10`` -> (``ndcg_cut``, ``ndcg_cut_10``): the pytrec_eval measure to request
    and the key it reports (other spellings go through :func:`metric_key` first)."""
    metric = metric_key(metric)
    if metric == "mrr":
        return "recip_rank", "recip_rank"
    fam, sep, k = metric.partition("_at_")
    if not sep or fam not in _FAMILIES or not k.isdigit() or int(k) < 1:
        raise ConfigError(
            f"unknown metric '{metric}'; use mrr or <ndcg|map|recall|precision>_at_<k>, e.g. ndcg_at_10"
        )
    trec = _FAMILIES[fam]
    return trec, f"{trec}_{int(k)}"


def metric_cutoff(metric: str) -> int | None:
    """The rank cut-off of a metric key (``ndcg_at_10`` -> 10; ``mrr`` -> None: it reads the
    whole ranking)."""
    _, key = _trec_measure(metric)
    return None if metric == "mrr" else int(key.rsplit("_", 1)[1])


def metrics_within_depth(metrics: Sequence[str], depth: int) -> tuple[str, ...]:
    """The metrics whose cut-off is at most ``depth``.

    A run cut to its top ``depth`` documents has no rank beyond it: its ``recall_at_100`` at
    depth 10 would be recall at 10 under another name, so such metrics are left out rather than
    reported under a cut-off the run does not reach.
    """
    return tuple(m for m in metrics if (metric_cutoff(m) or 0) <= depth)


def trec_sorted(ranking: Mapping[str, float]) -> list[tuple[str, float]]:
    """Documents in trec_eval's order: score descending, ties by document id descending."""
    by_doc = sorted(ranking.items(), key=lambda kv: kv[0], reverse=True)
    return sorted(by_doc, key=lambda kv: kv[1], reverse=True)  # stable: ties keep doc-desc order


def truncate(run: Run, depth: int = 100) -> Run:
    """Keep the top ``depth`` documents per query in trec_eval's order (scores as Python floats)."""
    return {
        qid: {d: float(s) for d, s in trec_sorted(ranking)[:depth]} for qid, ranking in run.items()
    }


@dataclass(frozen=True)
class Evaluation:
    """Scores of one run against one qrels.

    Attributes:
        mean: metric -> mean over every qrels query (missing ones count as 0).
        per_query: query id -> metric -> score, for every qrels query.
        num_queries: number of qrels queries evaluated.
        missing: ids of qrels queries absent from the run or with an empty ranking (scored 0).
    """

    mean: dict[str, float]
    per_query: dict[str, dict[str, float]]
    num_queries: int
    missing: tuple[str, ...] = field(default_factory=tuple)


def evaluate(
    run: Run,
    qrels: Qrels,
    metrics: Sequence[str] = DEFAULT_METRICS,
    depth: int = 100,
    relevance_level: int = 1,
) -> Evaluation:
    """Score ``run`` against ``qrels`` with pytrec_eval over the top ``depth`` documents.

    Args:
        run: ``{qid: {doc_id: score}}``; queries not in the qrels are ignored (as trec_eval does).
        qrels: ``{qid: {doc_id: grade}}``; every query here is scored.
        metrics: metric keys (see DEFAULT_METRICS).
        depth: documents per query kept before scoring (R2MED: 100).
        relevance_level: smallest grade that counts as relevant for binary measures.

    Returns:
        An Evaluation whose means are Python floats over all qrels queries.
    """
    import pytrec_eval

    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ConfigError(f"evaluation depth must be an integer >= 1, got {depth!r}")
    measures = {m: _trec_measure(m) for m in metrics}
    judged = {qid: {d: int(g) for d, g in docs.items()} for qid, docs in qrels.items() if docs}
    cut = truncate({q: r for q, r in run.items() if q in judged and r}, depth)
    missing = tuple(sorted(q for q in judged if q not in cut))
    per_query: dict[str, dict[str, float]] = {q: {m: 0.0 for m in metrics} for q in judged}
    if cut:
        cutoffs: dict[str, set[int]] = {}
        for trec, key in measures.values():
            ks = cutoffs.setdefault(trec, set())
            if key != trec:
                ks.add(int(key.rsplit("_", 1)[1]))
        requested = {
            f"{trec}.{','.join(map(str, sorted(ks)))}" if ks else trec for trec, ks in cutoffs.items()
        }
        evaluator = pytrec_eval.RelevanceEvaluator(
            judged, requested, relevance_level=relevance_level
        )
        for qid, values in evaluator.evaluate(cut).items():
            per_query[qid] = {m: float(values[key]) for m, (_, key) in measures.items()}
    n = len(judged)
    mean = {m: (sum(per_query[q][m] for q in judged) / n if n else 0.0) for m in metrics}
    return Evaluation(mean=mean, per_query=per_query, num_queries=n, missing=missing)


def average_over_tasks(results: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Unweighted mean of per-task means (the paper's headline averages the tasks, not queries)."""
    results = list(results)
    if not results:
        return {}
    keys = set(results[0])
    for r in results[1:]:
        keys &= set(r)
    return {k: sum(float(r[k]) for r in results) / len(results) for k in sorted(keys)}


def _format_score(score: float) -> str:
    """Six decimals when that is exact, else every digit (``repr``): trec_eval ranks by the
    score column, so rounding two close scores to one value would reorder them on reading."""
    score = float(score)
    fixed = f"{score:.6f}"
    return fixed if float(fixed) == score else repr(score)


def write_trec_run(run: Run, tag: str, depth: int = 100) -> str:
    """A TREC run file's text (``qid Q0 docid rank score tag``), top ``depth`` in trec_eval order.

    Scores are written exactly, so reading the file back ranks as the run did.
    """
    lines = []
    for qid in sorted(run):
        for rank, (doc, score) in enumerate(trec_sorted(run[qid])[:depth], start=1):
            lines.append(f"{qid} Q0 {doc} {rank} {_format_score(score)} {tag}")
    return "\n".join(lines) + ("\n" if lines else "")


def read_trec_run(path) -> Run:
    """Read a TREC run file (6 columns, UTF-8).

    Raises:
        DataError: with file:line for text that is not UTF-8, a line without 6 columns, a score
            that is not a finite number, a document listed twice for one query, or an id that
            :func:`~r2med_agent.data.records.check_run_ids` refuses (a NUL, an invisible character,
            two documents of a query that are one after Unicode normalisation).
    """
    from r2med_agent.data.records import check_run_ids
    from r2med_agent.errors import DataError
    from r2med_agent.io import iter_lines

    run: Run = {}
    folded: dict[str, dict[str, str]] = {}
    for lineno, line in iter_lines(path, "run file"):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 6:
            raise DataError(
                f"expected 6 columns 'qid Q0 docid rank score tag', got {len(parts)}", path, lineno
            )
        qid, _, doc, _, score, _ = parts
        try:
            value = float(score)
        except ValueError:
            raise DataError(f"score '{score}' is not a number", path, lineno) from None
        if not math.isfinite(value):
            raise DataError(
                f"score '{score}' is not finite; trec_eval cannot rank nan or inf", path, lineno
            )
        if doc in run.setdefault(qid, {}):
            raise DataError(f"document '{doc}' listed twice for query '{qid}'", path, lineno)
        check_run_ids(qid, doc, run[qid], folded, path, lineno)
        run[qid][doc] = value
    return run


def drop_identical_ids(run: Run, k: int) -> tuple[Run, int]:
    """``run`` without any document whose id is its query's id, each ranking cut to ``k``; and
    how many such hits there were.

    BEIR's exact dense search, which R2MED's dense evaluation runs, skips a corpus id equal to the
    query id while it collects the top ``k`` (and its evaluation drops such hits again,
    ``ignore_identical_ids``): searched ``k + 1`` deep, this gives the same ``k`` documents. It
    matters where queries and documents share an id scheme (the case-retrieval tasks). Each
    ranking keeps its order (score descending, ties as the retriever gave them).
    """
    out: Run = {}
    removed = 0
    for query_id, ranking in run.items():
        if query_id in ranking:
            removed += 1
        kept = sorted(((d, s) for d, s in ranking.items() if d != query_id), key=lambda ds: -ds[1])
        out[query_id] = dict(kept[:k])
    return out, removed
