"""BRIGHT (Su et al., ICLR 2025; hub dataset ``xlangai/BRIGHT``, code ``xlang-ai/BRIGHT``): its
layout, read and validated as BRIGHT's own ``run.py`` reads it.

The hub repo is one folder per configuration, each holding one file per BRIGHT task (the
configuration's split): ``<config>/<split>-NNNNN-of-NNNNN.parquet`` (``.parquet`` or ``.jsonl``
files of the same stem work too, so a folder of your own can be JSON lines):

* ``examples/``: ``id``, ``query``, ``gold_ids`` (ids of ``documents``), ``gold_ids_long`` (ids of
  ``long_documents``), ``excluded_ids`` (ids never scored for that query; ``["N/A"]`` where there
  are none), plus ``reasoning`` and ``gold_answer``, which no experiment reads;
* ``documents/`` and ``long_documents/``: ``id``, ``content`` (long documents exist for the seven
  StackExchange tasks and Pony);
* ``<model>_reason/``: the examples with ``query`` replaced by that LLM's reasoning about it
  (``gpt4``, ``claude-3-opus``, ``llama3-70b``, ``Gemini-1.0``, ``grit``), read by
  ``run --generations bright`` (:mod:`~r2med_agent.data.bright_released`).

A task is one split in one setting: the short documents with ``gold_ids`` as its qrels, or the long
documents with ``gold_ids_long``. Every gold id is relevant with grade 1, as ``run.py`` builds its
ground truth. Each query's ``excluded_ids`` (all but ``"N/A"``) are kept on the task
(:attr:`~r2med_agent.types.Task.excluded`); the runner removes them from every ranking before it is
cut and scored, as BRIGHT's retrievers do.

Every problem raises :class:`~r2med_agent.errors.DataError` naming the file and row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from r2med_agent.data.qrels import _build_qrels
from r2med_agent.data.records import _get_id, _iter_records, nfkc_twin, twin_message
from r2med_agent.errors import DataError
from r2med_agent.types import Doc, Query

BRIGHT_REPO = "xlangai/BRIGHT"
"""The hub dataset BRIGHT's ``run.py`` loads (``load_dataset('xlangai/bright', ...)``)."""

BRIGHT_TASKS = (
    "biology", "earth_science", "economics", "psychology", "robotics", "stackoverflow",
    "sustainable_living", "leetcode", "pony", "aops", "theoremqa_questions", "theoremqa_theorems",
)
"""BRIGHT's 12 task keys (its splits), in its paper's table order."""

LONG_TASKS = BRIGHT_TASKS[:7] + ("pony",)
"""The tasks with a long-document setting (``long_documents``)."""

EXAMPLES = "examples"
DOCUMENTS = "documents"
LONG_DOCUMENTS = "long_documents"
REASON_SUFFIX = "_reason"

REASONING_MODELS = ("gpt4", "claude-3-opus", "llama3-70b", "Gemini-1.0", "grit")
"""The LLMs whose reasoning queries BRIGHT released, as its ``<model>_reason`` configurations
name them (``run.py --reasoning gpt4``)."""

LONG_SUFFIX = "-long"
"""What a task name adds for a split's long-document setting (``bright-biology-long``; a folder
of your own: ``pydocs-long``)."""

BRIGHT_DEPTH = 1000
"""How deep BRIGHT ranks each query: ``get_scores`` and ``retrieval_bm25`` keep the first 1000 of
a stable sort by score, and its metrics (cut-offs up to 100) are computed over that list."""

NO_EXCLUSION = "N/A"
"""What ``excluded_ids`` holds where a query excludes nothing; BRIGHT's retrievers skip it."""


@dataclass(frozen=True)
class BrightSplit:
    """Which part of a BRIGHT-layout folder a task is: the split (BRIGHT's task key) and the
    setting (short documents and ``gold_ids``, or long documents and ``gold_ids_long``)."""

    split: str
    long: bool = False

    @property
    def documents(self) -> str:
        return LONG_DOCUMENTS if self.long else DOCUMENTS

    @property
    def gold_field(self) -> str:
        return "gold_ids_long" if self.long else "gold_ids"

    @property
    def key(self) -> str:
        """Part of the task cache key: the same files read in the other setting load differently."""
        return f"bright:{self.split}:{'long' if self.long else 'short'}"


def split_files(folder: Path, config: str, split: str) -> list[Path]:
    """``<config>/<split>.<ext>`` or its shards ``<config>/<split>-NNNNN-of-NNNNN.<ext>``, sorted."""
    import re

    directory = folder / config
    if not directory.is_dir():
        return []
    pattern = re.compile(re.escape(split) + r"(-\d+-of-\d+)?\.(parquet|jsonl)")
    return sorted(p for p in directory.iterdir() if p.is_file() and pattern.fullmatch(p.name))


def is_bright_folder(folder: Path, split: str | None = None) -> bool:
    """Whether ``folder`` is in BRIGHT's layout: an ``examples/`` folder (with ``split``'s files
    when a split is given) beside ``documents/`` or ``long_documents/``."""
    if not (folder / EXAMPLES).is_dir():
        return False
    if not ((folder / DOCUMENTS).is_dir() or (folder / LONG_DOCUMENTS).is_dir()):
        return False
    return split is None or bool(split_files(folder, EXAMPLES, split))


def bright_splits(folder: Path) -> list[str]:
    """The splits whose examples a BRIGHT-layout folder holds, sorted."""
    import re

    names = set()
    directory = folder / EXAMPLES
    if directory.is_dir():
        for p in directory.iterdir():
            m = re.fullmatch(r"(.+?)(-\d+-of-\d+)?\.(parquet|jsonl)", p.name)
            if p.is_file() and m:
                names.add(m.group(1))
    return sorted(names)


def own_split(folder: Path, name: str) -> BrightSplit | None:
    """The split and setting a task name means in a BRIGHT-layout folder of your own: a split's
    name (any case) is its short documents, the name plus ``-long`` its long documents; None when
    the name is neither. The setting's files are not checked here (the reader says which is
    missing)."""
    low = name.strip().lower()
    splits = bright_splits(folder)
    for split in splits:  # a split's own name first: a split may itself end in -long
        if split.lower() == low:
            return BrightSplit(split, False)
    for split in splits:
        if (split + LONG_SUFFIX).lower() == low:
            return BrightSplit(split, True)
    return None


def own_task_name(split: BrightSplit) -> str:
    """The name of a task of your own that reads ``split``: the split, plus ``-long`` for its long
    documents (so a result says which documents it ran on)."""
    return split.split + (LONG_SUFFIX if split.long else "")


def has_setting(folder: Path, split: BrightSplit) -> bool:
    """Whether the folder holds the split's documents in that setting."""
    return bool(split_files(folder, split.documents, split.split))


def layout_files(folder: Path, split: BrightSplit) -> list[Path] | None:
    """Every file the task's reader reads (examples, then documents), or None when one is missing."""
    examples = split_files(folder, EXAMPLES, split.split)
    docs = split_files(folder, split.documents, split.split)
    return examples + docs if examples and docs else None


# ----------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class _Example:
    """One validated row of ``examples``: where it is, its query, gold ids and excluded ids."""

    path: Path
    row: int
    query: Query
    gold: tuple[str, ...]
    excluded: tuple[str, ...]


def _id_list(obj: Mapping[str, Any], key: str, path: Path, row: int, why: str) -> list[str]:
    """A list-of-ids field; missing or of another shape is an error naming ``why`` it is needed."""
    if key not in obj or obj[key] is None:
        raise DataError(f"missing field '{key}' ({why})", path, row)
    value = obj[key]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in value):
        raise DataError(f"field '{key}' must be a list of document ids (strings), got {value!r}"[:300], path, row)
    return [v.strip() for v in value]


def _parse_example(obj: Mapping[str, Any], path: Path, row: int, split: BrightSplit) -> _Example:
    qid = _get_id(obj, ("id",), path, row, "query")
    text = obj.get("query")
    if not isinstance(text, str) or not text.strip():
        raise DataError("missing or empty field 'query' (the query text)", path, row)
    gold = _id_list(obj, split.gold_field, path, row,
                    "a long-document task's relevant documents" if split.long else "the query's relevant documents")
    excluded = _id_list(obj, "excluded_ids", path, row,
                        'BRIGHT\'s run.py reads it for every query; ["N/A"] where none is excluded')
    if split.long:  # run.py asserts against gold_ids; its scoring loop against the setting's gold
        short_gold = obj.get("gold_ids") or []
        gold_sets = [gold, [g for g in short_gold if isinstance(g, str)]]
    else:
        gold_sets = [gold]
    for doc_id in excluded:
        if any(doc_id in g for g in gold_sets):
            raise DataError(
                f"excluded id {doc_id!r} of query {qid!r} is also one of its gold ids: a document cannot be "
                "both left out and relevant (BRIGHT's run.py stops on this too)", path, row)
    kept = tuple(dict.fromkeys(d for d in excluded if d != NO_EXCLUSION))
    return _Example(path, row, Query(query_id=qid, text=text), tuple(dict.fromkeys(gold)), kept)


def read_examples(files: list[Path], split: BrightSplit) -> list[_Example]:
    """The validated examples of a split, in file order (ids unique across shards)."""
    out: list[_Example] = []
    seen: dict[str, tuple[Path, int]] = {}
    folded: dict[str, str] = {}
    for path in files:
        for row, obj in _iter_records(path):
            example = _parse_example(obj, path, row, split)
            qid = example.query.query_id
            if qid in seen:
                first = seen[qid]
                raise DataError(f"duplicate query id {qid!r} (first in {first[0].name} row {first[1]})", path, row)
            _check_twin("query", qid, seen, folded, path, row)
            seen[qid] = (path, row)
            out.append(example)
    if not out:
        raise DataError("no examples", files[0])
    return out


def _check_twin(what: str, item_id: str, seen: dict[str, tuple[Path, int]], folded: dict[str, str], path: Path,
                row: int) -> None:
    """Refuse an id that is one of ``seen`` after NFKC (:func:`~r2med_agent.data.records.nfkc_twin`)."""
    twin = nfkc_twin(item_id, seen, folded)
    if twin is not None:
        first = seen[twin]
        raise DataError(twin_message(what, item_id, twin) + f" (in {first[0].name} row {first[1]})", path, row)


def _read_docs(files: list[Path]) -> list[Doc]:
    """``id``/``content`` rows as documents (BRIGHT's documents have no title)."""
    docs: list[Doc] = []
    seen: dict[str, tuple[Path, int]] = {}
    folded: dict[str, str] = {}
    for path in files:
        for row, obj in _iter_records(path):
            doc_id = _get_id(obj, ("id",), path, row, "document")
            content = obj.get("content")
            if not isinstance(content, str):
                raise DataError("missing field 'content' (the document text) or not a string", path, row)
            if doc_id in seen:
                first = seen[doc_id]
                raise DataError(f"duplicate document id {doc_id!r} (first in {first[0].name} row {first[1]})",
                                path, row)
            _check_twin("document", doc_id, seen, folded, path, row)
            seen[doc_id] = (path, row)
            docs.append(Doc(doc_id, content))
    if not docs:
        raise DataError("empty corpus", files[0])
    return docs


def read_bright(folder: Path, split: BrightSplit, allow_missing_docs: bool):
    """A BRIGHT task from one folder: queries, documents, qrels, notes and excluded ids.

    Raises:
        DataError: a missing file, or a malformed row (file and row named).
    """
    examples_files = split_files(folder, EXAMPLES, split.split)
    if not examples_files:
        raise DataError(f"missing {EXAMPLES}/{split.split}.parquet (or its shards, or .jsonl): the "
                        f"examples of BRIGHT task {split.split}", folder)
    doc_files = split_files(folder, split.documents, split.split)
    if not doc_files:
        other = BrightSplit(split.split, not split.long)
        hint = (f"; this folder has its {'long ' if other.long else 'short '}documents "
                f"({other.documents}/): that setting runs as --task {own_task_name(other)}"
                if has_setting(folder, other) else "")
        raise DataError(f"missing {split.documents}/{split.split}.parquet (or its shards, or .jsonl): the "
                        f"{'long ' if split.long else ''}documents of BRIGHT task {split.split}{hint}", folder)
    examples = read_examples(examples_files, split)
    corpus = _read_docs(doc_files)
    queries = [e.query for e in examples]
    rows = [(e.path, e.row, e.query.query_id, doc_id, 1) for e in examples for doc_id in e.gold]
    notes: list[str] = []
    if rows:
        qrels, notes = _build_qrels(rows, examples_files[0], queries, examples_files[0], corpus, doc_files[0],
                                    allow_missing_docs)
    else:
        qrels = {}
        notes.append(f"{examples_files[0]}: no query has a {split.gold_field} entry; nothing is scored")
    excluded = {e.query.query_id: e.excluded for e in examples}
    notes += _excluded_notes(examples, {d.doc_id for d in corpus}, doc_files[0])
    return queries, corpus, qrels, notes, excluded


def _excluded_notes(examples: list[_Example], doc_ids: set[str], corpus_path: Path) -> list[str]:
    """A warning for excluded ids that are not documents of the corpus: removing them changes no
    ranking (BRIGHT's ``get_scores`` would stop on them with a KeyError)."""
    absent = [(e.query.query_id, d) for e in examples for d in e.excluded if d not in doc_ids]
    if not absent:
        return []
    shown = ", ".join(f"{d!r} (query {q})" for q, d in absent[:5]) + (" ..." if len(absent) > 5 else "")
    return [f"{corpus_path}: {len(absent)} excluded ids are not in the corpus, so there is nothing to remove: "
            f"{shown}"]


# ----------------------------------------------------------------------------------------------
# Released reasoning queries (``<model>_reason``)


def reasoning_config(model: str) -> str:
    """The configuration holding ``model``'s reasoning queries (``gpt4`` -> ``gpt4_reason``)."""
    return model + REASON_SUFFIX


def read_reasoning_queries(files: list[Path]) -> dict[str, str]:
    """``{query id: reasoning query}`` of a ``<model>_reason`` split (its ``id`` and ``query``).

    Raises:
        DataError: a row without ``id`` or a string ``query``, a repeated id (file and row named).
    """
    out: dict[str, str] = {}
    for path in files:
        for row, obj in _iter_records(path):
            qid = _get_id(obj, ("id",), path, row, "query")
            text = obj.get("query")
            if not isinstance(text, str):
                raise DataError("missing field 'query' (the reasoning query) or not a string", path, row)
            if qid in out:
                raise DataError(f"query id {qid!r} appears twice", path, row)
            out[qid] = text
    return out


# ----------------------------------------------------------------------------------------------
# Excluded ids and BRIGHT's metrics


def excluded_depth(excluded: Mapping[str, tuple[str, ...]] | None) -> int:
    """How many more documents to retrieve so that, once a query's excluded ids are removed, the
    ranking still has the depth asked for (the most any query excludes)."""
    return max((len(ids) for ids in (excluded or {}).values()), default=0)


def ranking_depth(task: Any) -> int:
    """How deep the task's benchmark ranks each query before it scores: :data:`BRIGHT_DEPTH` for a
    BRIGHT-layout task, 0 (the run's own depth) for the others. A run at a smaller depth keeps the
    first documents of that list in trec_eval's order, so every depth agrees on its ties."""
    return BRIGHT_DEPTH if getattr(task, "excluded", None) is not None else 0


def remove_excluded(run: dict[str, dict[str, float]], excluded: Mapping[str, tuple[str, ...]] | None,
                    depth: int) -> tuple[dict[str, dict[str, float]], int]:
    """``run`` without each query's excluded documents, cut to ``depth``; and how many were removed.

    As BRIGHT's ``get_scores`` and ``retrieval_bm25`` do: the excluded ids leave the scored list
    before it is sorted (stably, highest first) and cut, so the cut keeps ``depth`` other documents
    and ties keep the retriever's order. A run whose rankings were searched to ``depth`` plus
    :func:`excluded_depth` therefore keeps exactly BRIGHT's top ``depth``.
    """
    if not excluded:
        return run, 0
    out: dict[str, dict[str, float]] = {}
    removed = 0
    for qid, ranking in run.items():
        drop = set(excluded.get(qid, ()))
        kept = [(d, s) for d, s in ranking.items() if d not in drop]
        removed += len(ranking) - len(kept)
        out[qid] = dict(sorted(kept, key=lambda kv: kv[1], reverse=True)[:depth])
    return out, removed


BRIGHT_CUTOFFS = (1, 5, 10, 25, 50, 100)
"""The cut-offs of BRIGHT's ``calculate_retrieval_metrics`` (its ``k_values``)."""

BRIGHT_METRICS = tuple(f"{fam}_at_{k}" for fam in ("ndcg", "map", "recall", "precision") for k in BRIGHT_CUTOFFS) + ("mrr",)
"""What BRIGHT scores, as the result files name it: pytrec_eval's ``ndcg_cut``, ``map_cut``,
``recall`` and ``P`` at BRIGHT's cut-offs, and ``recip_rank``."""


def task_metrics(metrics: tuple[str, ...], task: Any) -> tuple[str, ...]:
    """The metrics a task is scored with: the run's, plus BRIGHT's own for a BRIGHT-layout task
    (cut-off 5 besides the run's), in BRIGHT's order first."""
    if getattr(task, "excluded", None) is None:
        return metrics
    return tuple(dict.fromkeys([*BRIGHT_METRICS, *metrics]))
