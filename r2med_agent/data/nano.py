"""NanoR2MED's candidate rankings (HAKARI-Bench's candidate subsets), shipped beside each split's
task files: folders ``bm25/``, ``harrier_oss_v1_270m/`` and ``reranking_hybrid/`` with
``query-id``/``corpus-ids`` rows."""

from __future__ import annotations

import re
from pathlib import Path

from r2med_agent.data.formats import _nano_files
from r2med_agent.data.records import _get_id, _iter_records
from r2med_agent.data.registry import get_task_spec
from r2med_agent.errors import ConfigError, DataError
from r2med_agent.types import Task

NANO_CANDIDATE_SUBSETS = ("bm25", "harrier_oss_v1_270m", "reranking_hybrid")
"""The candidate rankings a NanoR2MED split ships beside its task files (HAKARI-Bench's configs):
its BM25 top-500, its dense top-500 (``microsoft/harrier-oss-v1-270m``) and their reciprocal-rank
fusion top-100 (plus, where that misses every positive, one positive appended at rank 101)."""


def read_nano_candidates(task: Task, subset: str) -> tuple[dict[str, list[str]], Path]:
    """The candidate ranking ``subset`` (one of :data:`NANO_CANDIDATE_SUBSETS`) that a NanoR2MED
    split ships, as ``{query id: [doc id, ...]}`` in rank order, and the file it came from.

    The files sit beside the task's own: ``<subset>/<split>.parquet`` (or shards, or ``.jsonl``)
    in the folder the task was loaded from (``--data-dir``), else in the same hub snapshot (the
    commit the task recorded in its source). Every query of the task must have one row, listing
    document ids of its corpus, each once.

    Raises:
        ConfigError: the task is not a split of a Nano-layout repo.
        DataError: the subset's file is missing or malformed (file and row named).
    """
    if subset not in NANO_CANDIDATE_SUBSETS:
        raise ConfigError(f"unknown candidate subset '{subset}'; allowed: {', '.join(NANO_CANDIDATE_SUBSETS)}")
    spec = get_task_spec(task.name)
    if spec.source != "nano" or not spec.split:
        raise ConfigError(
            f"task {task.name} ships no candidate rankings: they come with the NanoR2MED splits "
            "(task group nano-all) only"
        )
    # A copy used despite other counts carries " (counts differ: ...)" after its folder.
    local = Path(task.source.split(" (counts differ: ", 1)[0])
    if not task.source.startswith("hf://") and local.is_dir():
        folder = local
    else:
        from r2med_agent.data.hub import fetch_snapshot

        commit = re.search(r"\(commit ([0-9a-f]{40})\)", task.source)
        folder = fetch_snapshot(
            spec.repo,
            commit.group(1) if commit else spec.revision,
            [f"{subset}/{spec.split}{sep}*" for sep in (".", "-")],
            hint=f"a folder {subset}/ with {spec.split} files beside corpus/, queries/ and qrels/",
        )
    files = _nano_files(folder, subset, spec.split)
    if not files:
        raise DataError(
            f"missing {subset}/{spec.split}.parquet (or .jsonl): the candidate ranking '{subset}' of "
            f"split {spec.split} (copy it from {spec.repo} beside corpus/, queries/ and qrels/)",
            folder,
        )
    query_ids = {q.query_id for q in task.queries}
    doc_ids = set(task.doc_ids)
    out: dict[str, list[str]] = {}
    for path in files:
        for row, obj in _iter_records(path):
            qid = _get_id(obj, ("query-id", "query_id", "qid"), path, row, "candidate query")
            if qid not in query_ids:
                raise DataError(f"candidate row names query {qid!r}, which the task does not have", path, row)
            if qid in out:
                raise DataError(f"second candidate row for query {qid!r}", path, row)
            ids = obj.get("corpus-ids", obj.get("corpus_ids"))
            if not isinstance(ids, list) or not all(isinstance(d, (str, int)) and not isinstance(d, bool) for d in ids):
                raise DataError("field 'corpus-ids' must be a list of document ids", path, row)
            ranking = [str(d) for d in ids]
            unknown = [d for d in ranking if d not in doc_ids]
            if unknown:
                raise DataError(
                    f"candidate document {unknown[0]!r} of query {qid!r} is not in the task's corpus", path, row
                )
            if len(set(ranking)) != len(ranking):
                raise DataError(f"a document is listed twice for query {qid!r}", path, row)
            out[qid] = ranking
    missing = [q.query_id for q in task.queries if q.query_id not in out]
    if missing:
        raise DataError(
            f"no candidate row for {len(missing)} of the task's {len(task.queries)} queries "
            f"({', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''})",
            files[0],
        )
    return out, files[0]
