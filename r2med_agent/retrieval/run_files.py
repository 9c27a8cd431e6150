"""First-stage candidates read from TREC run files (``run --candidates``), reranked as given.

Published rerankers are scored on their authors' own first-stage lists (ReasonRank releases
E5-mistral's top 100 per R2MED task as ``runs/r2med_<Task>/e5-mistral-7b-instruct_top100.txt``).
:func:`find_candidate_files` finds each task's file under a path, :func:`read_ranked_run` reads one
(each query's documents in the file's rank order), and :class:`CandidateRunRetriever` answers a
task's own queries with them, cut at the depth asked. A document the task's corpus lacks is an
error naming the file and the count (or, allowed, a counted warning and the document left out).

Layouts of ``PATH``:

* a file: the run of the one task being run;
* a folder with ``<Task>.run``, ``<Task>.trec`` or ``<Task>.txt`` per task;
* a folder with one run file per task folder: ``<Task>/`` or ReasonRank's ``r2med_<Task>/``.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from r2med_agent.errors import ConfigError, DataError
from r2med_agent.types import Run, SearchRequest, Task

log = logging.getLogger(__name__)

RUN_SUFFIXES = (".run", ".trec", ".txt")


@dataclass(frozen=True)
class RunFiles:
    """The first-stage run files of a run (``run --candidates``), one per task, as the
    ``candidates`` retriever reads them.

    Attributes:
        files: task name -> its run file (:func:`find_candidate_files`).
        allow_missing: leave out (warned, counted) documents the task's corpus lacks instead of
            stopping.
    """

    files: Mapping[str, Path]
    allow_missing: bool = False

    def for_task(self, task: str) -> Path | None:
        """The run file of ``task``; a BEIR split's task (``name@split``) takes its folder's."""
        return self.files.get(task) or self.files.get(task.split("@")[0])


def find_candidate_files(path: str | Path, tasks: Sequence[str]) -> dict[str, Path]:
    """Each task's run file under ``path`` (see the module docstring for the layouts).

    Raises:
        ConfigError: ``path`` does not exist, a file given for several tasks, a task without a
            file or with several candidates for one.
    """
    root = Path(path)
    if root.is_file():
        if len(tasks) != 1:
            raise ConfigError(f"--candidates {root}: one run file serves one task; give a folder for "
                              f"{', '.join(tasks)}")
        return {tasks[0]: root}
    if not root.is_dir():
        raise ConfigError(f"--candidates {root}: no such file or folder")
    return {task: _task_file(root, task) for task in tasks}


def _task_file(root: Path, task: str) -> Path:
    found = [root / f"{task}{s}" for s in RUN_SUFFIXES if (root / f"{task}{s}").is_file()]
    for folder in (root / task, root / f"r2med_{task}"):
        if folder.is_dir():
            found += sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in RUN_SUFFIXES)
    if len(found) != 1:
        looked = (f"{task}.run|.trec|.txt, {task}/<one run file>, r2med_{task}/<one run file>")
        what = "no run file" if not found else f"{len(found)} run files ({', '.join(p.name for p in found)})"
        raise ConfigError(f"--candidates {root}: {what} for task {task}; expected one of {looked}")
    return found[0]


def candidates_fingerprint(files: Mapping[str, Path]) -> str:
    """SHA-256 (16 hex digits) of the tasks' run files: names of the tasks and file bytes, so the
    same lists give the same run spec wherever they are."""
    h = hashlib.sha256()
    for task in sorted(files):
        h.update(f"{task}\0".encode())
        h.update(files[task].read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


def read_ranked_run(path: str | Path) -> Run:
    """A TREC run (``qid Q0 docid rank score tag``), each query's documents in rank order (the
    file's order where ranks tie), with the file's scores. A document listed again for the same
    query keeps its first listing; the repeats are counted in a warning (ReasonRank's released runs
    repeat 337 lines in four tasks; its own reranking reads both listings, which a run holding each
    document once cannot: docs/protocol.md).

    Raises:
        DataError: with file:line for a line without 6 columns, a rank or score that is not a
            number, or an id :func:`~r2med_agent.data.records.check_run_ids` refuses.
    """
    from r2med_agent.data.records import check_run_ids
    from r2med_agent.io import iter_lines

    rows: dict[str, list[tuple[int, int, str, float]]] = {}
    docs_of: dict[str, set[str]] = {}
    folded: dict[str, dict[str, str]] = {}
    repeats: list[int] = []
    for lineno, line in iter_lines(path, "run file"):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 6:
            raise DataError(f"expected 6 columns 'qid Q0 docid rank score tag', got {len(parts)}", path, lineno)
        qid, _, doc, rank, score, _ = parts
        try:
            r, s = int(rank), float(score)
        except ValueError:
            raise DataError(f"rank '{rank}' or score '{score}' is not a number", path, lineno) from None
        if not math.isfinite(s):
            raise DataError(f"score '{score}' is not finite", path, lineno)
        docs = docs_of.setdefault(qid, set())
        if doc in docs:
            repeats.append(lineno)
            continue
        check_run_ids(qid, doc, docs, folded, path, lineno)
        docs.add(doc)
        rows.setdefault(qid, []).append((r, lineno, doc, s))
    if repeats:
        log.warning("%s:%d: %d lines list a document again for the same query; each keeps its first listing",
                    path, repeats[0], len(repeats))
    return {qid: {doc: s for _, _, doc, s in sorted(docs)} for qid, docs in rows.items()}


class CandidateRunRetriever:
    """A task's queries answered from a run file, in its order, cut at the depth asked.

    Build with :meth:`for_task`, which checks the file against the task.
    """

    name = "candidates"
    keeps_order = True
    """Each query's documents come in the file's order, which rerankers keep (tied scores
    included), as the published rerankers read their run files; see ``RerankJob.ordered``."""

    def __init__(self, run: Run, source: Path) -> None:
        self.run = run
        self.source = source

    @classmethod
    def for_task(cls, task: Task, path: Path, allow_missing: bool = False) -> CandidateRunRetriever:
        """Read ``path`` and check it against ``task``'s corpus and queries.

        Raises:
            DataError: documents the corpus lacks (unless ``allow_missing``: warned, left out).
        """
        run = read_ranked_run(path)
        corpus = {d.doc_id for d in task.corpus}
        missing = {(q, d) for q, docs in run.items() for d in docs if d not in corpus}
        if missing:
            example = ", ".join(sorted(d for _, d in missing)[:3])
            message = (f"{len(missing)} candidate documents ({len({q for q, _ in missing})} queries) are not in "
                       f"{task.name}'s corpus, e.g. {example}")
            if not allow_missing:
                raise DataError(message + "; --allow-missing-candidates leaves them out", path)
            log.warning("%s: %s; left out (--allow-missing-candidates)", path, message)
            run = {q: {d: s for d, s in docs.items() if d in corpus} for q, docs in run.items()}
        queries = {q.query_id for q in task.queries}
        unknown = sorted(set(run) - queries)
        if unknown:
            log.warning("%s: %d queries are not %s's (e.g. %s); not used", path, len(unknown), task.name,
                        ", ".join(unknown[:3]))
        without = sorted(queries - set(run))
        if without:
            log.warning("%s: %d of %d %s queries have no candidates and score 0", path, len(without),
                        len(queries), task.name)
        return cls(run, path)

    def search(self, requests: Sequence[SearchRequest], k: int) -> Run:
        """Each request's query's candidates, the first ``k`` in the file's order (the request's
        text plays no part: the list was made for the task's own query). The queries come in the
        order the file lists them (requests it lacks after them), the order GroupRank's shuffles
        run through (:mod:`~r2med_agent.rerank.groupwise`)."""
        asked = {r.query_id for r in requests}
        order = [q for q in self.run if q in asked] + [r.query_id for r in requests if r.query_id not in self.run]
        return {q: dict(list(self.run.get(q, {}).items())[:k]) for q in dict.fromkeys(order)}
