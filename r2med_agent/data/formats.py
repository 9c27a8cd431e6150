"""Reading a task from one folder: the R2MED, BEIR, Nano and BRIGHT layouts, validated, through the task cache.

On-disk layouts read here:

* **R2MED**: ``query.jsonl`` (``id``, ``text``, optional ``answer``, ``doc_id``, ``body_system``),
  ``corpus.jsonl`` (``id``, ``text``) and ``qrels.jsonl`` (``q_id``, ``p_id``, ``score``) or
  ``qrels.txt`` (TREC ``qid 0 docid rel`` or three columns ``qid docid rel``, tab or space
  separated, optional header line). This is also the layout of the hub repos ``R2MED/<task>``.
* **BEIR**: ``queries.jsonl`` (``_id``, ``text``), ``corpus.jsonl`` (``_id``, ``title``, ``text``) and
  ``qrels/<split>.tsv`` (header ``query-id corpus-id score``; split ``test`` unless another is
  asked for). As BEIR's own loader does, only the queries named in that split's qrels are kept
  (``queries.jsonl`` often holds the train and dev queries too); the number left out is logged,
  and ``all_queries`` keeps them all.
* **Nano** (hub repo ``hakari-bench/NanoR2MED``): folders ``corpus/``, ``queries/``, ``qrels/`` each
  holding ``<split>.parquet`` or ``<split>-NNNNN-of-NNNNN.parquet`` (``_id``/``text``; qrels
  ``query-id``/``corpus-id``, optional ``score``); ``.jsonl`` files with the same stem work too.
  Parquet needs ``pyarrow``. The same repo ships candidate rankings per split (HAKARI-Bench's
  candidate subsets, :data:`~r2med_agent.data.nano.NANO_CANDIDATE_SUBSETS`): folders ``bm25/``,
  ``harrier_oss_v1_270m/`` and ``reranking_hybrid/`` with ``query-id``/``corpus-ids`` rows, read by
  :func:`~r2med_agent.data.nano.read_nano_candidates`.

* **BRIGHT** (hub repo ``xlangai/BRIGHT``): folders ``examples/``, ``documents/`` and
  ``long_documents/`` holding ``<split>.parquet`` or shards (or ``.jsonl``), read by
  :mod:`~r2med_agent.data.bright` (which describes them); each query's ``excluded_ids`` go on
  the task (:attr:`~r2med_agent.types.Task.excluded`).

A folder in R2MED or BEIR layout without qrels (no ``qrels.jsonl``/``qrels.txt``; no ``qrels/``
folder) is a task of unjudged queries: it loads with empty qrels, every query kept, and a run over
it is written but not scored.

Every problem in the files raises :class:`~r2med_agent.errors.DataError` naming the file and line.
Only qrels with a positive grade are kept (trec_eval counts ``rel <= 0`` as non-relevant anyway).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from r2med_agent.data import bright as _bright
from r2med_agent.data.bright import BrightSplit
from r2med_agent.data.qrels import _build_qrels, _qrels_from_json, _qrels_from_text
from r2med_agent.data.records import _check_unique, _iter_records, _parse_docs, _parse_queries, _require
from r2med_agent.data.snapshot import _TaskSnapshot
from r2med_agent.errors import DataError
from r2med_agent.io import iter_jsonl
from r2med_agent.types import Corpus, DataOrigin, Doc, Family, Qrels, Query, Task

logger = logging.getLogger(__name__)

R2MED_HUB_FILES = ("query.jsonl", "corpus.jsonl", "qrels.jsonl", "qrels.txt")
DEFAULT_SPLIT = "test"
"""The qrels split of a BEIR folder read unless another is asked for (``qrels/test.tsv``)."""
NANO_CONFIGS = ("corpus", "queries", "qrels")

_Read = tuple[list[Query], list[Doc], Qrels, list[str], "dict[str, tuple[str, ...]] | None"]
"""What a layout reader returns: queries, corpus, qrels, warnings about the qrels, and each query's
excluded document ids (BRIGHT's layout; None for the others)."""


def load_task_dir(
    folder: str | Path,
    *,
    name: str,
    family: Family,
    domain: str,
    split: str | None = None,
    source: str | None = None,
    allow_missing_qrels_docs: bool = False,
    use_task_cache: bool = True,
) -> Task:
    """Load a task from one folder in R2MED, BEIR or Nano layout (no registry lookup).

    A validated task is remembered in the task cache (``cache_dir()/tasks/``) under a SHA-256 of
    its files' bytes (and the layout and options that decide how they are read): its queries,
    qrels, document ids and corpus fingerprint. Loading the same files again hashes them (about
    0.1 s for R2MED's largest corpus) instead of parsing and validating them (about 0.8 s), and the
    task's corpus is a :class:`~r2med_agent.types.Corpus` that parses the corpus file only when
    its texts are first needed (checked against the fingerprint), so a re-run over a saved index
    never reads it. Changed bytes are a different key: nothing stale is ever served.

    Args:
        folder: the task's folder.
        name, family, domain: copied into the Task.
        split: the split to read when the folder is in Nano layout.
        source: provenance string for the Task (default: the folder's absolute path).
        allow_missing_qrels_docs: keep qrels naming documents missing from the corpus (warned);
            see :func:`~r2med_agent.data.load.load_task`.
        use_task_cache: read and write the task cache.

    A BEIR folder is read with its ``test`` split here; :func:`~r2med_agent.data.load.load_task`
    chooses another (and can keep every query).
    """
    return _load_task_dir(Path(folder), name=name, family=family, domain=domain, split=split, source=source,
                          allow_missing_qrels_docs=allow_missing_qrels_docs, use_task_cache=use_task_cache,
                          beir=BeirSplit())


def _load_task_dir(
    folder: Path,
    *,
    name: str,
    family: Family,
    domain: str,
    split: str | None,
    source: str | None,
    allow_missing_qrels_docs: bool,
    use_task_cache: bool,
    beir: BeirSplit,
    bright: BrightSplit | None = None,
) -> Task:
    """:func:`load_task_dir` with the split of a BEIR folder to read, and the split and setting of a
    BRIGHT-layout folder (default: the split the task is named after, ``<split>-long`` for its long
    documents; any other name is refused)."""
    started = time.perf_counter()
    if bright is None and _detect_layout(folder, split) == "bright":
        bright = _own_bright_split(folder, name)
    layout, read = _layout_reader(folder, split, allow_missing_qrels_docs, beir, bright)
    if layout != "beir" and beir != BeirSplit():
        logger.warning("%s: --split and --all-queries apply to BEIR folders (qrels/<split>.tsv); this "
                       "%s folder has one set of qrels, read as it is", folder, layout)
    snapshot = None
    if use_task_cache:
        key = beir.key if layout == "beir" else bright.key if bright is not None else split
        files = _bright.layout_files(folder, bright) if bright is not None else _layout_files(folder, layout, split, beir)
        snapshot = _TaskSnapshot.for_files(files, layout, key, allow_missing_qrels_docs)
    contents = _read_contents(read, snapshot, folder)
    for note in contents.notes:
        logger.warning("%s", note)
    task = Task(
        name=name + (beir.suffix if layout == "beir" else ""),
        family=family,
        domain=domain,
        queries=tuple(contents.queries),
        corpus=contents.corpus,
        qrels=contents.qrels,
        source=(source or str(folder.resolve())) + (beir.source_note if layout == "beir" else ""),
        fingerprint=contents.fingerprint,
        excluded=contents.excluded,
        origin=DataOrigin(
            folder=str(folder.resolve()), layout=layout, name=name,
            split=beir.split if layout == "beir" else split, all_queries=layout == "beir" and beir.all_queries,
        ),
    )
    _log_loaded(task, layout, contents.how, started)
    return task


@dataclass(frozen=True)
class BeirSplit:
    """Which qrels of a BEIR folder are read (``qrels/<split>.tsv``), and whether the queries they do
    not name are kept (``all_queries``) or left out as BEIR's loader leaves them out."""

    split: str = DEFAULT_SPLIT
    all_queries: bool = False

    def __post_init__(self) -> None:
        if not self.split or "/" in self.split or "\\" in self.split or self.split.startswith("."):
            raise DataError(f"--split '{self.split}' cannot name a qrels file (qrels/<split>.tsv)")

    @property
    def key(self) -> str:
        """Part of the task cache key: the same files read with another split load differently."""
        return f"beir:{self.split}:{'all' if self.all_queries else 'judged'}"

    @property
    def suffix(self) -> str:
        """What the task's name gets for a split other than the default (``mybeir@dev``,
        ``mybeir@test-all``): another query set is another task, so its results are files of their
        own and never replace the default split's."""
        if self == BeirSplit():
            return ""
        return f"@{self.split}" + ("-all" if self.all_queries else "")

    @property
    def source_note(self) -> str:
        """What the task's ``source`` records of it (the split is a fact of the data, as the folder is)."""
        return f" (split {self.split}" + (", all queries)" if self.all_queries else ")")

    def qrels_file(self, folder: Path) -> Path:
        return folder / "qrels" / f"{self.split}.tsv"


def _own_bright_split(folder: Path, name: str) -> BrightSplit:
    """The split of a BRIGHT-layout folder a task of your own reads: the one the task is named
    after (any case), its short documents; ``<split>-long``, its long documents. Any other name is
    refused, even on a folder of one split: a result is named by what ran."""
    found = _bright.own_split(folder, name)
    if found is None:
        splits = _bright.bright_splits(folder)
        raise DataError(
            f"this BRIGHT-layout folder holds the split{'s' if len(splits) != 1 else ''} "
            f"{', '.join(splits) or '(none)'}; task {name!r} is none of them: pass --task SPLIT (its documents/) "
            f"or --task SPLIT{_bright.LONG_SUFFIX} (its long_documents/), e.g. --task {splits[0] if splits else 'SPLIT'}, "
            "or give your task entry 'split: SPLIT' in a user config", folder / _bright.EXAMPLES)
    return found


def _layout_reader(
    folder: Path, split: str | None, allow_missing_docs: bool, beir: BeirSplit, bright: BrightSplit | None = None
) -> tuple[str, Callable[[], _Read]]:
    """The folder's layout and a call that reads and validates its files.

    Raises:
        DataError: the folder holds no task files of any layout.
    """
    if bright is not None:
        if not (folder / _bright.EXAMPLES).is_dir():
            raise DataError(f"no {_bright.EXAMPLES}/ folder: expected BRIGHT's layout ({_bright.EXAMPLES}/, "
                            f"{bright.documents}/ with {bright.split} files)", folder)
        return "bright", functools.partial(_bright.read_bright, folder, bright, allow_missing_docs)
    layout = _detect_layout(folder, split)
    if layout == "r2med":
        return layout, functools.partial(_read_r2med, folder, allow_missing_docs)
    if layout == "beir":
        return layout, functools.partial(_read_beir, folder, allow_missing_docs, beir)
    if layout == "nano" and split:
        return layout, functools.partial(_read_nano, folder, split, allow_missing_docs)
    raise DataError(
        "no task files found: expected query.jsonl, corpus.jsonl and qrels.jsonl/qrels.txt "
        "(R2MED), queries.jsonl, corpus.jsonl and qrels/<split>.tsv (BEIR)"
        + (f", or corpus/ queries/ qrels/ with {split} files (Nano)" if split else "")
        + ", or examples/ and documents/ (BRIGHT)",
        folder,
    )


@dataclass(frozen=True)
class _Contents:
    """A task's queries, corpus, qrels, corpus fingerprint and warnings about the qrels, and how
    they were obtained (for the log)."""

    queries: Sequence[Query]
    corpus: Sequence[Doc]
    qrels: Qrels
    fingerprint: str
    notes: Sequence[str]
    how: str
    excluded: dict[str, tuple[str, ...]] | None = None


def _read_contents(read: Callable[[], _Read], snapshot: _TaskSnapshot | None, folder: Path) -> _Contents:
    """The task from the task cache (its corpus parsed on first use), else read and validated by
    ``read`` (and then stored in the task cache)."""
    found = snapshot.load() if snapshot is not None else None
    if found is not None:
        queries, doc_ids, qrels, fingerprint, notes, excluded = found
        corpus = Corpus(doc_ids, functools.partial(_reread_corpus, read, fingerprint, folder))
        how = "from the task cache; corpus read on first use"
        return _Contents(queries, corpus, qrels, fingerprint, notes, how, excluded)
    queries, docs, qrels, notes, excluded = read()
    fingerprint = corpus_fingerprint(docs)
    if snapshot is not None:
        snapshot.save(queries, [d.doc_id for d in docs], qrels, fingerprint, notes, excluded)
    return _Contents(queries, tuple(docs), qrels, fingerprint, notes, "parsed", excluded)


def _log_loaded(task: Task, layout: str, how: str, started: float) -> None:
    logger.info(
        "loaded %s (%s layout, %s; %s): %d queries, %d docs, %d positive qrels in %.2f s",
        task.name,
        layout,
        task.source,
        how,
        len(task.queries),
        len(task.corpus),
        sum(len(v) for v in task.qrels.values()),
        time.perf_counter() - started,
    )


def _reread_corpus(read: Callable[[], _Read], fingerprint: str, folder: Path) -> list[Doc]:
    """The corpus of a task loaded from the task cache, parsed on first use."""
    docs = read()[1]
    if corpus_fingerprint(docs) != fingerprint:
        raise DataError("the corpus changed on disk while this run was using it; run again", folder)
    return docs


def _layout_files(folder: Path, layout: str, split: str | None, beir: BeirSplit) -> list[Path] | None:
    """Every file the layout's reader reads, in a fixed order (no qrels file for an unjudged
    folder); None when one is missing (the reader then says which)."""
    if layout == "r2med":
        qrels = [p for p in (folder / "qrels.jsonl", folder / "qrels.txt") if p.is_file()][:1]
        files = [folder / "query.jsonl", folder / "corpus.jsonl", *qrels]
    elif layout == "beir":
        qrels_file = beir.qrels_file(folder)
        files = [folder / "queries.jsonl", folder / "corpus.jsonl",
                 *([qrels_file] if (folder / "qrels").is_dir() else [])]
    else:
        files = []
        for cfg in NANO_CONFIGS:
            found = _nano_files(folder, cfg, split or "")
            if not found:
                return None
            files += found
    return files if all(f.is_file() for f in files) else None


def corpus_fingerprint(corpus: Iterable[Doc]) -> str:
    """SHA-256 (hex) over the corpus content in corpus order: every id, title and text.

    Order matters on purpose: caches that store per-row data (embedding matrices) stay valid only for
    the same documents in the same order. Fields are length-prefixed, so no two corpora collide by
    shifting text between fields.
    """
    h = hashlib.sha256(b"r2med-agent corpus v1\n")
    for d in corpus:
        h.update(
            f"{len(d.doc_id)}:{d.doc_id}|{len(d.title)}:{d.title}|{len(d.text)}:{d.text}\n".encode()
        )
    return h.hexdigest()


def data_fingerprint(task: Task) -> str:
    """SHA-256 (hex) of what a task's scores are computed on: its corpus fingerprint, its queries
    (ids and texts, in order), its qrels and its excluded ids. Two copies of a task that differ in
    any of them are two data sets, whose results never replace each other (:meth:`~r2med_agent.
    experiment.store.ResultStore.result_name`)."""
    import json

    body = {
        "corpus": task.fingerprint,
        "queries": [[q.query_id, q.text] for q in task.queries],
        "qrels": {q: dict(sorted(d.items())) for q, d in sorted(task.qrels.items())},
        "excluded": None if task.excluded is None else {q: list(v) for q, v in sorted(task.excluded.items())},
    }
    h = hashlib.sha256(b"r2med-agent data v1\n")
    h.update(json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode())
    return h.hexdigest()


def _detect_layout(folder: Path, split: str | None) -> str | None:
    if (folder / "query.jsonl").is_file():
        return "r2med"
    if (folder / "queries.jsonl").is_file():
        return "beir"
    if _bright.is_bright_folder(folder, split):
        return "bright"
    if split and any(_nano_files(folder, cfg, split) for cfg in NANO_CONFIGS):
        return "nano"
    if (folder / "corpus.jsonl").is_file():
        # A corpus without a query file: report the missing file rather than "no data".
        return "r2med"
    return None


# --- R2MED layout -------------------------------------------------------------------------------


def _read_r2med(folder: Path, allow_missing_docs: bool) -> _Read:
    query_path = _require(folder / "query.jsonl")
    corpus_path = _require(folder / "corpus.jsonl")
    queries = _parse_queries(iter_jsonl(query_path), query_path, id_keys=("id", "_id"))
    corpus = _parse_docs(iter_jsonl(corpus_path), corpus_path, id_keys=("id", "_id"))
    jsonl, txt = folder / "qrels.jsonl", folder / "qrels.txt"
    if jsonl.is_file():
        rows = _qrels_from_json(iter_jsonl(jsonl), jsonl, score_required=True)
        qrels_path = jsonl
    elif txt.is_file():
        rows = _qrels_from_text(txt)
        qrels_path = txt
    else:
        return queries, corpus, {}, [_unjudged_note(folder, "no qrels.jsonl or qrels.txt")], None
    qrels, notes = _build_qrels(rows, qrels_path, queries, query_path, corpus, corpus_path, allow_missing_docs)
    return queries, corpus, qrels, notes, None


# --- BEIR layout --------------------------------------------------------------------------------


def _unjudged_note(folder: Path, why: str) -> str:
    return (f"{folder}: no relevance judgments ({why}): every stage runs and the run is written, "
            "but nothing is scored")


def _read_beir(folder: Path, allow_missing_docs: bool, beir: BeirSplit) -> _Read:
    query_path = _require(folder / "queries.jsonl")
    corpus_path = _require(folder / "corpus.jsonl")
    qrels_path = beir.qrels_file(folder)
    if (folder / "qrels").is_dir() and not qrels_path.is_file():
        held = sorted(p.stem for p in (folder / "qrels").glob("*.tsv"))
        raise DataError(f"no qrels for split '{beir.split}': expected {qrels_path.name} here"
                        + (f"; this folder has qrels for {', '.join(held)} (pass --split NAME)" if held else ""),
                        folder / "qrels")
    queries = _parse_queries(iter_jsonl(query_path), query_path, id_keys=("_id", "id"))
    corpus = _parse_docs(iter_jsonl(corpus_path), corpus_path, id_keys=("_id", "id"))
    if not qrels_path.is_file():
        return queries, corpus, {}, [_unjudged_note(folder, "no qrels/ folder")], None
    rows = _qrels_from_text(qrels_path)
    notes: list[str] = []
    if not beir.all_queries:
        named = {row[2] for row in rows}
        kept = [q for q in queries if q.query_id in named]
        if len(kept) < len(queries):
            notes.append(f"{query_path}: {len(queries) - len(kept)} of {len(queries)} queries have no row in "
                         f"qrels/{qrels_path.name} and are left out, as BEIR's loader does (--all-queries "
                         "keeps them, unscored)")
        queries = kept
    qrels, more = _build_qrels(rows, qrels_path, queries, query_path, corpus, corpus_path, allow_missing_docs)
    return queries, corpus, qrels, notes + more, None


# --- Nano layout --------------------------------------------------------------------------------


def _nano_files(folder: Path, config: str, split: str) -> list[Path]:
    """``<config>/<split>.<ext>`` or its shards ``<config>/<split>-NNNNN-of-NNNNN.<ext>``, sorted."""
    directory = folder / config
    if not directory.is_dir():
        return []
    pattern = re.compile(re.escape(split) + r"(-\d+-of-\d+)?\.(parquet|jsonl)")
    return sorted(p for p in directory.iterdir() if p.is_file() and pattern.fullmatch(p.name))


def _read_nano(folder: Path, split: str, allow_missing_docs: bool) -> _Read:
    files = {}
    for cfg in NANO_CONFIGS:
        found = _nano_files(folder, cfg, split)
        if not found:
            raise DataError(f"missing {cfg}/{split}.parquet (or .jsonl) for split {split}", folder)
        files[cfg] = found
    queries: list[Query] = []
    corpus: list[Doc] = []
    for path in files["queries"]:
        queries += _parse_queries(_iter_records(path), path, id_keys=("_id", "id"))
    _check_unique([(q.query_id, path) for q in queries], files["queries"], "query")
    for path in files["corpus"]:
        corpus += _parse_docs(_iter_records(path), path, id_keys=("_id", "id"))
    _check_unique([(d.doc_id, path) for d in corpus], files["corpus"], "document")
    rows: list[tuple[Path, int, str, str, int]] = []
    for path in files["qrels"]:
        rows += _qrels_from_json(_iter_records(path), path, score_required=False)
    qrels, notes = _build_qrels(
        rows, files["qrels"][0], queries, files["queries"][0], corpus, files["corpus"][0],
        allow_missing_docs,
    )
    return queries, corpus, qrels, notes, None

