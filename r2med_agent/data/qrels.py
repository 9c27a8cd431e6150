"""Qrels parsing: R2MED ``qrels.jsonl`` (and Nano qrels rows), TREC and 3-column text files, and the
checks of qrels against a task's queries and corpus.

Only qrels with a positive grade are kept (trec_eval counts ``rel <= 0`` as non-relevant anyway).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from r2med_agent.data.records import _get_id, id_problem
from r2med_agent.errors import DataError
from r2med_agent.io import iter_jsonl, iter_lines
from r2med_agent.types import Doc, Qrels, Query

logger = logging.getLogger(__name__)

_SCORE_HEADERS = {"score", "rel", "relevance", "label", "grade", "judgment", "judgement"}
_Q_KEYS = ("q_id", "query-id", "query_id", "qid")
_P_KEYS = ("p_id", "corpus-id", "corpus_id", "doc_id", "docid")


def _parse_score(value: Any, path: Path, line: int) -> int:
    """An integer grade from an int, an integral float (1.0) or such a string."""
    if isinstance(value, bool):
        raise DataError(f"qrels score must be an integer, got {value!r}", path, line)
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        s = value.strip()
        try:
            return int(s)
        except ValueError:
            try:
                value = float(s)
            except ValueError:
                raise DataError(f"qrels score must be an integer, got {value!r}", path, line) from None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise DataError(f"qrels score must be an integer, got {value!r}", path, line)


def _qrels_from_json(
    records: Iterable[tuple[int, dict[str, Any]]], path: Path, *, score_required: bool
) -> list[tuple[Path, int, str, str, int]]:
    """Rows ``(path, line, qid, docid, score)`` from q_id/p_id/score records (Nano: no score = 1).

    A Nano qrels row may hold a list of corpus ids; each becomes one row.
    """
    rows = []
    for line, obj in records:
        qid = _get_id(obj, _Q_KEYS, path, line, "qrels query")
        pkey = next((k for k in _P_KEYS if obj.get(k) is not None), None)
        if pkey is None:
            raise DataError("missing field 'p_id' (the qrels document id)", path, line)
        raw_ids = obj[pkey] if isinstance(obj[pkey], list) else [obj[pkey]]
        if "score" in obj and obj["score"] is not None:
            score = _parse_score(obj["score"], path, line)
        elif score_required:
            raise DataError("missing field 'score' of the qrels entry", path, line)
        else:
            score = 1
        for raw in raw_ids:
            doc_id = _get_id({pkey: raw}, (pkey,), path, line, "qrels document")
            rows.append((path, line, qid, doc_id, score))
    return rows


def _qrels_from_text(path: Path) -> list[tuple[Path, int, str, str, int]]:
    """Rows from a TREC (``qid 0 docid rel``) or 3-column (``qid docid rel``) qrels file.

    Columns are split on tabs when the line has one, else on whitespace. The first non-blank line
    is a header when its last column is a column name (``score``, ``rel``, ``relevance``, ...), as in
    BEIR's ``query-id corpus-id score``.
    """
    rows = []
    width: int | None = None
    first = True
    for line_no, line in iter_lines(path, "qrels file"):
        if not line.strip():
            continue
        line = line.rstrip("\r\n")
        fields = [f.strip() for f in line.split("\t")] if "\t" in line else line.split()
        if first:
            first = False
            if len(fields) in (3, 4) and fields[-1].lower() in _SCORE_HEADERS:
                continue  # header line
        if width is None:
            if len(fields) not in (3, 4):
                raise DataError(
                    f"expected 4 columns 'qid 0 docid rel' or 3 columns 'qid docid rel', got {len(fields)}",
                    path,
                    line_no,
                )
            width = len(fields)
        elif len(fields) != width:
            raise DataError(f"expected {width} columns like the first line, got {len(fields)}", path, line_no)
        qid, doc_id, score = (fields[0], fields[2], fields[3]) if width == 4 else fields
        if not qid or not doc_id:
            raise DataError("empty query or document id", path, line_no)
        for what, value in (("query", qid), ("document", doc_id)):
            problem = id_problem(value)
            if problem:
                raise DataError(f"qrels {what} id {value!r} {problem[0]}, {problem[1]}", path, line_no)
        rows.append((path, line_no, qid, doc_id, _parse_score(score, path, line_no)))
    return rows


def read_qrels_jsonl(path: str | Path) -> Qrels:
    """Read an R2MED ``qrels.jsonl`` (``q_id``, ``p_id``, ``score``) on its own, keeping grades > 0.

    Unlike :func:`~r2med_agent.data.load.load_task` it cannot check ids against queries and corpus;
    the format checks (fields, integer grades, conflicting duplicates) still raise DataError with
    file and line.
    """
    path = Path(path)
    return _collect_qrels(_qrels_from_json(iter_jsonl(path), path, score_required=True), path)


def read_qrels_file(path: str | Path) -> Qrels:
    """Read qrels from ``.jsonl`` (R2MED fields) or text (TREC 4 columns, or 3 columns, optional
    header), keeping grades > 0."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return read_qrels_jsonl(path)
    return _collect_qrels(_qrels_from_text(path), path)


def _collect_qrels(rows: Sequence[tuple[Path, int, str, str, int]], qrels_path: Path) -> Qrels:
    """Positive grades as a Qrels dict; conflicting grades for one pair are an error."""
    if not rows:
        raise DataError("no qrels entries", qrels_path)
    qrels: Qrels = {}
    dropped = 0
    for path, line, qid, doc_id, score in rows:
        if score <= 0:
            dropped += 1
            continue
        grades = qrels.setdefault(qid, {})
        if doc_id in grades and grades[doc_id] != score:
            raise DataError(
                f"conflicting grades for query {qid!r}, document {doc_id!r}: "
                f"{grades[doc_id]} and {score}",
                path,
                line,
            )
        grades[doc_id] = score
    if not qrels:
        raise DataError(
            f"no qrels entry has a positive grade (all {dropped} are <= 0), so no query can be "
            "scored; relevant documents need a grade of 1 or more",
            qrels_path,
        )
    if dropped:
        logger.info("%s: dropped %d qrels entries with grade <= 0", qrels_path, dropped)
    return qrels


def _build_qrels(
    rows: Sequence[tuple[Path, int, str, str, int]],
    qrels_path: Path,
    queries: Sequence[Query],
    query_path: Path,
    corpus: Sequence[Doc],
    corpus_path: Path,
    allow_missing_docs: bool,
) -> tuple[Qrels, list[str]]:
    """Check every qrels row against the queries and the corpus, then collect the positive grades.

    Returns:
        The qrels, and warnings about them (kept so that a task loaded from the task cache
        repeats them).
    """
    query_ids = {q.query_id for q in queries}
    doc_ids = {d.doc_id for d in corpus}
    missing_docs: dict[str, None] = {}
    for path, line, qid, doc_id, _ in rows:
        if qid not in query_ids:
            raise DataError(f"qrels name query {qid!r}, which is not in {query_path.name}", path, line)
        if doc_id not in doc_ids:
            if not allow_missing_docs:
                raise DataError(
                    f"qrels name document {doc_id!r}, which is not in {corpus_path.name}; if the "
                    "release is meant so (R2MED's demo files are), --allow-missing-qrels-docs keeps "
                    "such qrels as relevant documents no retriever can find",
                    path,
                    line,
                )
            missing_docs[doc_id] = None
    qrels = _collect_qrels(rows, qrels_path)
    notes = []
    if missing_docs:
        notes.append(
            f"{qrels_path}: {len(missing_docs)} qrels documents are not in {corpus_path.name}; kept "
            "as relevant documents no retriever can find (they count in the ideal DCG, so no score "
            "can reach 1): "
            + ", ".join(list(missing_docs)[:5]) + (" ..." if len(missing_docs) > 5 else "")
        )
    no_positive = [q.query_id for q in queries if q.query_id not in qrels]
    if no_positive:
        notes.append(
            f"{qrels_path}: {len(no_positive)} of {len(queries)} queries have no positive qrels "
            f"({', '.join(no_positive[:5])}{' ...' if len(no_positive) > 5 else ''}); evaluation "
            "cannot score them"
        )
    return qrels, notes
