"""Task registry (R2MED, NanoR2MED, the shipped samples) and task loading with validation.

The registry is ``configs/tasks.yaml`` (one :class:`TaskSpec` per entry; a user config file can add or
replace entries under ``tasks:``). :func:`load_task` reads a task from, in order of preference, a
local ``data_dir``, the package (``sample``, ``r2med-demo``) or the Hugging Face hub.

On-disk layouts read here:

* **R2MED**: ``query.jsonl`` (``id``, ``text``, optional ``answer``, ``doc_id``, ``body_system``),
  ``corpus.jsonl`` (``id``, ``text``) and ``qrels.jsonl`` (``q_id``, ``p_id``, ``score``) or
  ``qrels.txt`` (TREC ``qid 0 docid rel`` or three columns ``qid docid rel``, tab or space
  separated, optional header line). This is also the layout of the hub repos ``R2MED/<task>``.
* **BEIR**: ``queries.jsonl`` (``_id``, ``text``), ``corpus.jsonl`` (``_id``, ``title``, ``text``) and
  ``qrels/test.tsv`` (header ``query-id corpus-id score``).
* **Nano** (hub repo ``hakari-bench/NanoR2MED``): folders ``corpus/``, ``queries/``, ``qrels/`` each
  holding ``<split>.parquet`` or ``<split>-NNNNN-of-NNNNN.parquet`` (``_id``/``text``; qrels
  ``query-id``/``corpus-id``, optional ``score``); ``.jsonl`` files with the same stem work too.
  Parquet needs ``pyarrow``. The same repo ships candidate rankings per split (HAKARI-Bench's
  candidate subsets, :data:`NANO_CANDIDATE_SUBSETS`): folders ``bm25/``, ``harrier_oss_v1_270m/``
  and ``reranking_hybrid/`` with ``query-id``/``corpus-ids`` rows, read by
  :func:`read_nano_candidates`.

Every problem in the files raises :class:`~r2med_agent.errors.DataError` naming the file and line.
Only qrels with a positive grade are kept (trec_eval counts ``rel <= 0`` as non-relevant anyway).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from r2med_agent.config import load_registry
from r2med_agent.errors import ConfigError, DataError, MissingExtraError
from r2med_agent.io import atomic_write_json, iter_jsonl, iter_lines
from r2med_agent.paths import cache_dir, resources_dir
from r2med_agent.types import Corpus, Doc, Family, Qrels, Query, Task

logger = logging.getLogger(__name__)

__all__ = [
    "TaskSpec",
    "base_task_name",
    "corpus_fingerprint",
    "get_task_spec",
    "list_tasks",
    "local_task_names",
    "local_task_spec",
    "load_task",
    "load_task_dir",
    "read_nano_candidates",
    "read_qrels_file",
    "read_qrels_jsonl",
    "reference_name",
    "task_names",
    "task_registry",
]

GROUPS = {"all": "r2med", "nano-all": "nano"}
"""Spec words that expand to a registry group: ``all`` (the 8 R2MED tasks) and ``nano-all``."""

REFERENCE_NAMES = {
    "Stack-Biology": "Biology",
    "Stack-Bioinformatics": "Bioinformatics",
    "Stack-Medical": "Medical-Sciences",
    "MedXpertQA-Exam": "MedXpertQA-Exam",
    "MedQA-Diag": "MedQA-Diag",
    "PMC-Treat": "PMC-Treatment",
    "PMCPatients": "PMC-Clinical",
    "IIYiPatients-EN": "IIYi-Clinical",
}
"""The R2MED reference code's task keys (its prompts and instructions use them) -> task names.

The released ``run.py`` passes the new names, so lookups in the reference's tables need this map;
:func:`reference_name` goes the other way. Old names are accepted wherever a task name is.
"""

R2MED_HUB_FILES = ("query.jsonl", "corpus.jsonl", "qrels.jsonl", "qrels.txt")
NANO_CONFIGS = ("corpus", "queries", "qrels")
NANO_CANDIDATE_SUBSETS = ("bm25", "harrier_oss_v1_270m", "reranking_hybrid")
"""The candidate rankings a NanoR2MED split ships beside its task files (HAKARI-Bench's configs):
its BM25 top-500, its dense top-500 (``microsoft/harrier-oss-v1-270m``) and their reciprocal-rank
fusion top-100 (plus, where that misses every positive, one positive appended at rank 101)."""


@dataclass(frozen=True)
class TaskSpec:
    """One registry entry (``configs/tasks.yaml``).

    Attributes:
        name: canonical task name (the YAML key).
        family: prompt family: ``qa``, ``exam``, ``treatment`` or ``case``.
        domain: subject used by Q&A prompts ("biology", "medical sciences", ...).
        source: where the data lives without ``--data-dir``: ``hub`` (an R2MED-layout dataset repo),
            ``nano`` (one split of a Nano-layout repo), ``package`` (inside r2med_agent/resources)
            or ``local`` (a folder of your own: ``path``, or ``--data-dir``; no hub repo needed).
        group: ``r2med`` or ``nano`` puts the task in ``all`` / ``nano-all``; empty for none.
        repo: hub dataset repo id (``source`` hub or nano).
        revision: hub revision to download: a 40-hex commit (immutable, cached copy used offline) or a
            branch/tag (resolved online; the cached copy is used when the hub is unreachable).
        split: the task's split in a Nano repo (``NanoR2MEDBiology``).
        path: folder under the package's resources (``source`` package), or the task's own
            folder (``source`` local; optional: without it the task needs ``--data-dir``).
        base: the full R2MED task a Nano task is drawn from.
        aliases: more names accepted for this task (the reference code's keys in
            :data:`REFERENCE_NAMES` are accepted without being listed here).
        queries: number of queries, where known. A local copy (``--data-dir``) with another
            number is refused unless ``allow_count_mismatch`` is given.
        docs: number of corpus documents, where known; checked as ``queries``.
        allow_missing_qrels_docs: accept qrels naming documents absent from the corpus (logged as a
            warning). Only for releases known to ship such qrels (R2MED's demo).
        description: one line for listings.
    """

    name: str
    family: Family
    domain: str
    source: Literal["hub", "nano", "package", "local"]
    group: str = ""
    repo: str = ""
    revision: str = "main"
    split: str = ""
    path: str = ""
    base: str = ""
    aliases: tuple[str, ...] = ()
    queries: int | None = None
    docs: int | None = None
    allow_missing_qrels_docs: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if self.source in ("hub", "nano") and not self.repo:
            raise ValueError(f"source {self.source!r} needs 'repo' (a hub dataset id)")
        if self.source == "nano" and not self.split:
            raise ValueError("source 'nano' needs 'split' (the task's split in the Nano repo)")
        if self.source == "package" and not self.path:
            raise ValueError("source 'package' needs 'path' (a folder under r2med_agent/resources)")
        if not self.revision:
            raise ValueError("'revision' must not be empty (use a commit hash, a tag or 'main')")

    @property
    def provenance(self) -> str:
        """Where the data comes from when no ``data_dir`` is given."""
        if self.source == "package":
            return f"package:{self.path}"
        if self.source == "local":
            return f"local:{self.path}" if self.path else "local"
        ref = f"hf://datasets/{self.repo}@{self.revision}"
        return f"{ref}#{self.split}" if self.source == "nano" else ref


# --------------------------------------------------------------------------------------------------
# Registry and names
# --------------------------------------------------------------------------------------------------


def task_registry() -> dict[str, TaskSpec]:
    """All registered tasks, package entries first, then the user config's ``tasks:`` section."""
    return load_registry("tasks", TaskSpec)


def _name_index(registry: dict[str, TaskSpec]) -> dict[str, str]:
    """Lower-cased name/alias/split -> canonical name; a clash is a config error."""
    index: dict[str, str] = {}

    def add(key: str, name: str) -> None:
        low = key.lower()
        if low in GROUPS:
            raise ConfigError(f"task name or alias '{key}' of '{name}' clashes with the group '{low}'")
        other = index.get(low)
        if other is not None and other != name:
            raise ConfigError(f"task name or alias '{key}' is used by both '{other}' and '{name}'")
        index[low] = name

    for name, spec in registry.items():
        add(name, name)
        for alias in spec.aliases:
            add(alias, name)
        if spec.split:
            add(spec.split, name)
    for old, new in REFERENCE_NAMES.items():
        if new in registry:
            index.setdefault(old.lower(), new)
    # "nano-<old name>" reaches the Nano split of the task the old name means.
    for name, spec in registry.items():
        if spec.base and spec.base in registry:
            for alias in _aliases(spec.base, registry[spec.base]):
                index.setdefault(f"nano-{alias}".lower(), name)
    return index


def _aliases(name: str, spec: TaskSpec) -> list[str]:
    """Every other name of a task: its reference-code key(s) and its listed aliases."""
    old = [k for k, v in REFERENCE_NAMES.items() if v == name and k != name]
    return old + [a for a in spec.aliases if a not in old]


def reference_name(name: str) -> str:
    """The R2MED reference code's key for a task (``PMC-Clinical`` -> ``PMCPatients``).

    Nano tasks map through their full task; names the reference does not know map to themselves.
    """
    spec = get_task_spec(name)
    base = spec.base or spec.name
    return next((old for old, new in REFERENCE_NAMES.items() if new == base), base)


LOCAL_FAMILY: Family = "qa"
LOCAL_DOMAIN = "medical"
"""Family and domain of a task of your own that no registry entry describes: the generic Q&A
prompts ("... the following medical post"), and no encoder instruction unless one is configured
for the task's name (see :func:`local_task_spec`)."""


def local_task_spec(name: str) -> TaskSpec:
    """The entry of a task of your own that the registry does not know (a ``--data-dir`` folder
    named after itself): family ``qa``, domain ``medical``, no counts to check."""
    clean = name.strip()
    if not clean or clean.lower() in GROUPS or clean.lower() == "list" or "/" in clean or clean in (".", ".."):
        raise ConfigError(f"'{name}' cannot name a task; pass --task NAME")
    return TaskSpec(name=clean, family=LOCAL_FAMILY, domain=LOCAL_DOMAIN, source="local",
                    description="a local task")


def local_task_names(data_dir: str | Path) -> list[str]:
    """The tasks a ``--data-dir`` folder holds when no ``--task`` is given: the folder itself
    when it holds task files (named by the registry task of that name, else by the folder), or
    every sub-folder that does (sorted by name).

    Raises:
        DataError: not a folder, or no task files in it or its sub-folders.
    """
    folder = Path(data_dir).expanduser()
    if not folder.is_dir():
        raise DataError("--data-dir is not a directory", folder)
    index = _name_index(task_registry())

    def named(p: Path) -> str:
        return index.get(p.resolve().name.lower(), p.resolve().name)

    if _detect_layout(folder, None) is not None:
        return [named(folder)]
    children = sorted(p for p in folder.iterdir() if p.is_dir() and _detect_layout(p, None) is not None)
    if not children:
        raise DataError(
            "no task files here or in its sub-folders: expected query.jsonl, corpus.jsonl and "
            "qrels.jsonl or qrels.txt (R2MED layout), or queries.jsonl, corpus.jsonl and "
            "qrels/test.tsv (BEIR layout)",
            folder,
        )
    return [named(p) for p in children]


def get_task_spec(name: str) -> TaskSpec:
    """The registry entry for a task name, alias or Nano split name (case-insensitive).

    Raises:
        ConfigError: unknown name; the message lists the known tasks.
    """
    registry = task_registry()
    canonical = _name_index(registry).get(name.strip().lower())
    if canonical is None:
        raise ConfigError(_unknown_task_message(name, registry))
    return registry[canonical]


def base_task_name(name: str) -> str:
    """The full R2MED task behind a name (``nano-Biology`` -> ``Biology``; others map to themselves)."""
    spec = get_task_spec(name)
    return spec.base or spec.name


def task_names(spec: str, data_dir: str | Path | None = None, extra: Iterable[str] = ()) -> list[str]:
    """Expand a task selection into canonical task names, in order, without duplicates.

    ``spec`` is one or more items separated by commas and/or whitespace; each item is ``all`` (the 8
    R2MED tasks), ``nano-all`` (their NanoR2MED splits), a task name, an old reference-code name
    (``Stack-Biology``, ``PMC-Treat``, ``PMCPatients``, ...), or a Nano split name
    (``NanoR2MEDBiology``). Matching ignores case.

    With ``data_dir``, a name the registry does not know is a task of your own, loaded from
    that folder (see :func:`local_task_spec`). ``extra`` names tasks known elsewhere (e.g. those
    a results folder holds): an item matching one of them (any case) is taken as that name.

    Raises:
        ConfigError: an empty selection or an unknown name (the message lists the known ones).
    """
    registry = task_registry()
    index = _name_index(registry)
    items = [item for item in re.split(r"[,\s]+", spec.strip()) if item]
    if not items:
        raise ConfigError(f"empty task selection {spec!r}; {_known_tasks_text(registry)}")
    extra_index = {name.lower(): name for name in extra}
    out: list[str] = []
    for item in items:
        low = item.lower()
        if low in GROUPS:
            names = [n for n, s in registry.items() if s.group == GROUPS[low]]
            if not names:
                raise ConfigError(f"task group '{low}' is empty; {_known_tasks_text(registry)}")
        elif low in index:
            names = [index[low]]
        elif low in extra_index:
            names = [extra_index[low]]
        elif data_dir is not None:
            names = [local_task_spec(item).name]
        else:
            known = f"; the results hold: {', '.join(sorted(extra_index.values()))}" if extra_index else ""
            raise ConfigError(_unknown_task_message(item, registry) + known)
        out.extend(n for n in names if n not in out)
    return out


def list_tasks() -> list[dict[str, Any]]:
    """Rows for a ``tasks`` listing: one dict per registered task, in registry order.

    Keys: ``name``, ``family``, ``domain``, ``group``, ``source`` (hub repo@revision, or the package
    folder), ``repo``, ``revision``, ``split``, ``queries``, ``docs`` (counts from R2MED's paper and
    the NanoR2MED card; None when unknown), ``aliases``, ``description``.
    """
    rows = []
    for spec in task_registry().values():
        rows.append(
            {
                "name": spec.name,
                "family": spec.family,
                "domain": spec.domain,
                "group": spec.group,
                "source": spec.provenance,
                "repo": spec.repo,
                "revision": spec.revision if spec.source != "package" else "",
                "split": spec.split,
                "queries": spec.queries,
                "docs": spec.docs,
                "aliases": _aliases(spec.name, spec),
                "description": spec.description,
            }
        )
    return rows


def _known_tasks_text(registry: dict[str, TaskSpec]) -> str:
    old = sorted({a for n, s in registry.items() if not s.base for a in _aliases(n, s)})
    return (
        f"known tasks: {', '.join(registry)}; groups: {', '.join(GROUPS)}"
        + (f"; old names: {', '.join(old)}" if old else "")
    )


def _unknown_task_message(name: str, registry: dict[str, TaskSpec]) -> str:
    from r2med_agent.errors import did_you_mean

    return (
        f"unknown task '{name}'{did_you_mean(name, _name_index(registry).values())}; "
        f"{_known_tasks_text(registry)} "
        "(add your own under 'tasks:' in a user config file)"
    )


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def load_task(
    name: str,
    data_dir: str | Path | None = None,
    *,
    allow_missing_qrels_docs: bool = False,
    allow_count_mismatch: bool = False,
) -> Task:
    """Load and validate one task.

    Args:
        name: a task name, alias or Nano split name (see :func:`task_names`).
        data_dir: a local copy: either the task's folder itself (R2MED, BEIR or Nano layout) or a
            parent folder holding ``<Task>/`` (the task name, one of its aliases, or its Nano split
            name). Without it, package tasks load from the package and the others from the hub at
            the registry's pinned revision.
        allow_missing_qrels_docs: keep qrels that name documents absent from the corpus (with a
            warning giving their number) instead of failing; they stay relevant documents, so
            they count in the ideal DCG as pytrec_eval scores them. Registry entries known to
            ship such qrels (``r2med-demo``) set it themselves.
        allow_count_mismatch: load a ``data_dir`` copy of a registered task whose numbers of
            queries or documents differ from the registry's (refused otherwise: a 12-query
            folder labelled Biology would be compared with the paper's 103-query scores). The
            difference is recorded in the task's ``source``.

    Raises:
        ConfigError: unknown task name (without ``data_dir``; with it, an unknown name is a
            task of your own).
        DataError: missing or malformed files (the message names file and line); a copy whose
            counts contradict the registry's.
        HubUnavailableError: no ``data_dir`` and the hub cannot be reached (fails within seconds).
        MissingExtraError: parquet files but no pyarrow.
    """
    try:
        spec = get_task_spec(name)
    except ConfigError:
        if data_dir is None:
            raise
        spec = local_task_spec(name)
    if data_dir is not None:
        folder = _locate(Path(data_dir).expanduser(), spec)
        source = str(folder.resolve())
    elif spec.source == "local":
        if not spec.path:
            raise ConfigError(f"task {spec.name} is a local task: pass --data-dir FOLDER "
                              "(or give its entry a 'path:')")
        folder = Path(spec.path).expanduser()
        source = str(folder.resolve())
    elif spec.source == "package":
        folder = resources_dir() / spec.path
        source = spec.provenance
    else:
        from r2med_agent.hub import fetch_snapshot

        if spec.source == "nano":
            patterns = [f"{cfg}/{spec.split}{sep}*" for cfg in NANO_CONFIGS for sep in (".", "-")]
            hint = (
                f"corpus/, queries/ and qrels/ folders with {spec.split} files (a copy of "
                f"{spec.repo}), or a folder {spec.name}/ in R2MED layout"
            )
        else:
            patterns = list(R2MED_HUB_FILES)
            hint = (
                "corpus.jsonl, query.jsonl and qrels.jsonl (a copy of "
                f"{spec.repo}), or a parent folder holding {spec.name}/"
            )
        from r2med_agent.hub import is_commit

        folder = fetch_snapshot(spec.repo, spec.revision, patterns, hint=hint)
        source = spec.provenance
        if not is_commit(spec.revision) and is_commit(folder.name):
            # A branch (NanoR2MED follows main): record the commit the files came from, so a
            # result says which data it was computed on. (Snapshot folders are named by commit.)
            source += f" (commit {folder.name})"
    task = load_task_dir(
        folder,
        name=spec.name,
        family=spec.family,
        domain=spec.domain,
        split=spec.split or None,
        source=source,
        allow_missing_qrels_docs=allow_missing_qrels_docs or spec.allow_missing_qrels_docs,
    )
    if data_dir is not None or spec.source == "local":
        task = _check_counts(task, spec, folder, allow_count_mismatch)
    return task


def _check_counts(task: Task, spec: TaskSpec, folder: Path, allow: bool) -> Task:
    """Refuse a local copy whose numbers of queries or documents contradict the registry's."""
    diffs = [
        f"{have} {what} where the registry's {spec.name} has {want}"
        for what, have, want in (("queries", len(task.queries), spec.queries),
                                 ("documents", len(task.corpus), spec.docs))
        if want is not None and have != want
    ]
    if not diffs:
        return task
    text = "; ".join(diffs)
    if not allow:
        raise DataError(
            f"this copy of {spec.name} has {text}: scores on it are not comparable with "
            f"{spec.name}'s. Name it as your own task (--task MYNAME, or a folder of another "
            "name), or pass --allow-count-mismatch to use it under this name anyway (recorded "
            "in the results)",
            folder,
        )
    logger.warning("%s: %s (--allow-count-mismatch)", spec.name, text)
    return dataclasses.replace(task, source=f"{task.source} (counts differ: {text})")


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
            see :func:`load_task`.
        use_task_cache: read and write the task cache.
    """
    folder = Path(folder)
    started = time.perf_counter()
    layout = _detect_layout(folder, split)
    if layout == "r2med":
        read = functools.partial(_read_r2med, folder, allow_missing_qrels_docs)
    elif layout == "beir":
        read = functools.partial(_read_beir, folder, allow_missing_qrels_docs)
    elif layout == "nano" and split:
        read = functools.partial(_read_nano, folder, split, allow_missing_qrels_docs)
    else:
        raise DataError(
            "no task files found: expected query.jsonl, corpus.jsonl and qrels.jsonl/qrels.txt "
            "(R2MED), queries.jsonl, corpus.jsonl and qrels/test.tsv (BEIR)"
            + (f", or corpus/ queries/ qrels/ with {split} files (Nano)" if split else ""),
            folder,
        )
    snapshot = None
    if use_task_cache:
        snapshot = _TaskSnapshot.for_files(
            _layout_files(folder, layout, split), layout, split, allow_missing_qrels_docs
        )
    found = snapshot.load() if snapshot is not None else None
    if found is not None:
        queries, doc_ids, qrels, fingerprint, notes = found
        corpus: Sequence[Doc] = Corpus(doc_ids, functools.partial(_reread_corpus, read, fingerprint, folder))
        how = "from the task cache; corpus read on first use"
    else:
        queries, docs, qrels, notes = read()
        fingerprint = corpus_fingerprint(docs)
        corpus = tuple(docs)
        if snapshot is not None:
            snapshot.save(queries, [d.doc_id for d in docs], qrels, fingerprint, notes)
        how = "parsed"
    for note in notes:
        logger.warning("%s", note)
    task = Task(
        name=name,
        family=family,
        domain=domain,
        queries=tuple(queries),
        corpus=corpus,
        qrels=qrels,
        source=source or str(folder.resolve()),
        fingerprint=fingerprint,
    )
    logger.info(
        "loaded %s (%s layout, %s; %s): %d queries, %d docs, %d positive qrels in %.2f s",
        name,
        layout,
        task.source,
        how,
        len(task.queries),
        len(task.corpus),
        sum(len(v) for v in qrels.values()),
        time.perf_counter() - started,
    )
    return task


_Read = tuple[list[Query], list[Doc], Qrels, list[str]]
"""What a layout reader returns: queries, corpus, qrels and warnings about the qrels."""


def _reread_corpus(read: Callable[[], _Read], fingerprint: str, folder: Path) -> list[Doc]:
    """The corpus of a task loaded from the task cache, parsed on first use."""
    docs = read()[1]
    if corpus_fingerprint(docs) != fingerprint:
        raise DataError("the corpus changed on disk while this run was using it; run again", folder)
    return docs


def _layout_files(folder: Path, layout: str, split: str | None) -> list[Path] | None:
    """Every file the layout's reader reads, in a fixed order; None when one is missing (the reader
    then says which)."""
    if layout == "r2med":
        qrels = folder / "qrels.jsonl"
        files = [folder / "query.jsonl", folder / "corpus.jsonl",
                 qrels if qrels.is_file() else folder / "qrels.txt"]
    elif layout == "beir":
        files = [folder / "queries.jsonl", folder / "corpus.jsonl", folder / "qrels" / "test.tsv"]
    else:
        files = []
        for cfg in NANO_CONFIGS:
            found = _nano_files(folder, cfg, split or "")
            if not found:
                return None
            files += found
    return files if all(f.is_file() for f in files) else None


class _TaskSnapshot:
    """A validated task's queries, qrels, document ids and fingerprint in the task cache, stored
    under a SHA-256 of the bytes of every file it was read from."""

    FORMAT = 1  # raise when reading or validation rules change what a set of files loads as

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def for_files(
        cls, files: Sequence[Path] | None, layout: str, split: str | None, allow_missing: bool
    ) -> _TaskSnapshot | None:
        if files is None:
            return None
        h = hashlib.sha256(
            f"r2med-agent task v{cls.FORMAT}|{layout}|{split}|{allow_missing}\n".encode()
        )
        try:
            for path in files:
                h.update(f"{path.name}|{path.stat().st_size}\n".encode())
                with path.open("rb") as f:
                    while chunk := f.read(1 << 23):
                        h.update(chunk)
        except OSError:
            return None  # the reader reports it
        return cls(cache_dir() / "tasks" / f"{h.hexdigest()}.json")

    def load(self) -> tuple[list[Query], list[str], Qrels, str, list[str]] | None:
        """The stored task, or None when there is none (or it is unreadable: then it is redone)."""
        try:
            rec = json.loads(self.path.read_bytes())
            queries = [Query(q[0], q[1], q[2]) for q in rec["queries"]]
            doc_ids, qrels, fingerprint, notes = rec["doc_ids"], rec["qrels"], rec["fingerprint"], rec["notes"]
            ok = (rec["format"] == self.FORMAT and isinstance(fingerprint, str)
                  and all(isinstance(d, str) for d in doc_ids))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            logger.warning("ignoring unreadable task cache file %s (%s)", self.path, e)
            return None
        if not ok:
            logger.warning("ignoring task cache file %s (other format)", self.path)
            return None
        return queries, doc_ids, qrels, fingerprint, notes

    def save(self, queries: Sequence[Query], doc_ids: Sequence[str], qrels: Qrels,
             fingerprint: str, notes: Sequence[str]) -> None:
        rec = {
            "format": self.FORMAT,
            "fingerprint": fingerprint,
            "queries": [[q.query_id, q.text, q.answer] for q in queries],
            "qrels": qrels,
            "notes": list(notes),
            "doc_ids": list(doc_ids),
        }
        try:
            atomic_write_json(self.path, rec, indent=None)
        except OSError as e:  # a read-only cache only costs speed
            logger.warning("cannot write the task cache file %s (%s)", self.path, e.strerror)


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


def _locate(data_dir: Path, spec: TaskSpec) -> Path:
    """The folder under ``data_dir`` that holds ``spec``'s files (see :func:`load_task`)."""
    if not data_dir.is_dir():
        raise DataError("--data-dir is not a directory", data_dir)
    wanted = [spec.name, *_aliases(spec.name, spec), *([spec.split] if spec.split else [])]
    children = {p.name.lower(): p for p in data_dir.iterdir() if p.is_dir()}
    for candidate in wanted:
        child = data_dir / candidate
        if not child.is_dir():
            child = children.get(candidate.lower(), child)
        if child.is_dir() and _detect_layout(child, spec.split or None) is not None:
            return child
    layout = _detect_layout(data_dir, spec.split or None)
    if layout is not None:
        names = {w.lower() for w in wanted}
        if layout != "nano" and data_dir.resolve().name.lower() not in names:
            logger.warning(
                "loading task %s from %s, whose folder name is not the task's; "
                "point --data-dir at a parent holding %s/ to load several tasks",
                spec.name,
                data_dir,
                spec.name,
            )
        return data_dir
    raise DataError(
        f"no data for task {spec.name}: expected {data_dir / spec.name}/ or this folder itself to "
        "hold query.jsonl, corpus.jsonl and qrels.jsonl (R2MED layout) or queries.jsonl, "
        "corpus.jsonl and qrels/test.tsv (BEIR layout)"
        + (f", or corpus/ queries/ qrels/ with {spec.split} files (Nano layout)" if spec.split else ""),
        data_dir,
    )


def _detect_layout(folder: Path, split: str | None) -> str | None:
    if (folder / "query.jsonl").is_file():
        return "r2med"
    if (folder / "queries.jsonl").is_file():
        return "beir"
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
        raise DataError("missing qrels: expected qrels.jsonl or qrels.txt beside query.jsonl", folder)
    qrels, notes = _build_qrels(rows, qrels_path, queries, query_path, corpus, corpus_path, allow_missing_docs)
    return queries, corpus, qrels, notes


# --- BEIR layout --------------------------------------------------------------------------------


def _read_beir(folder: Path, allow_missing_docs: bool) -> _Read:
    query_path = _require(folder / "queries.jsonl")
    corpus_path = _require(folder / "corpus.jsonl")
    qrels_path = _require(folder / "qrels" / "test.tsv")
    queries = _parse_queries(iter_jsonl(query_path), query_path, id_keys=("_id", "id"))
    corpus = _parse_docs(iter_jsonl(corpus_path), corpus_path, id_keys=("_id", "id"))
    rows = _qrels_from_text(qrels_path)
    qrels, notes = _build_qrels(rows, qrels_path, queries, query_path, corpus, corpus_path, allow_missing_docs)
    return queries, corpus, qrels, notes


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
    return queries, corpus, qrels, notes


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
        from r2med_agent.hub import fetch_snapshot

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


def _check_unique(ids: list[tuple[str, Path]], paths: list[Path], what: str) -> None:
    if len(paths) < 2:
        return  # single files are checked with line numbers while parsing
    seen: set[str] = set()
    for item_id, path in ids:
        if item_id in seen:
            raise DataError(f"duplicate {what} id {item_id!r} across shards", path)
        seen.add(item_id)


def _iter_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number, record) from a .jsonl or .parquet file."""
    if path.suffix == ".jsonl":
        yield from iter_jsonl(path)
        return
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise MissingExtraError("pyarrow", "hub") from None
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
        raise DataError(f"unreadable parquet file: {e}", path) from None
    yield from enumerate(table.to_pylist(), start=1)


# --- record parsing and validation --------------------------------------------------------------


def _require(path: Path) -> Path:
    if not path.is_file():
        raise DataError(f"missing file {path.name}", path.parent)
    return path


def _get_id(obj: dict[str, Any], keys: Sequence[str], path: Path, line: int, what: str) -> str:
    for key in keys:
        if key in obj and obj[key] is not None:
            value = obj[key]
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                raise DataError(f"{what} field '{key}' must be a string, got {value!r}", path, line)
            text = str(value).strip()
            if not text:
                raise DataError(f"empty {what} field '{key}'", path, line)
            return text
    raise DataError(f"missing field '{keys[0]}' (the {what} id)", path, line)


def _get_text(obj: dict[str, Any], path: Path, line: int, what: str, *, allow_empty: bool) -> str:
    if "text" not in obj or obj["text"] is None:
        if allow_empty:
            return ""
        raise DataError(f"missing field 'text' of the {what}", path, line)
    value = obj["text"]
    if not isinstance(value, str):
        raise DataError(f"{what} field 'text' must be a string, got {type(value).__name__}", path, line)
    if not allow_empty and not value.strip():
        raise DataError(f"empty {what} text", path, line)
    return value


def _parse_queries(
    records: Iterable[tuple[int, dict[str, Any]]], path: Path, id_keys: Sequence[str]
) -> list[Query]:
    out: list[Query] = []
    seen: dict[str, int] = {}
    for line, obj in records:
        qid = _get_id(obj, id_keys, path, line, "query")
        if qid in seen:
            raise DataError(f"duplicate query id {qid!r} (first on line {seen[qid]})", path, line)
        seen[qid] = line
        text = _get_text(obj, path, line, "query", allow_empty=False)
        answer = obj.get("answer")
        answer = "" if answer is None else answer if isinstance(answer, str) else str(answer)
        out.append(Query(query_id=qid, text=text, answer=answer))
    if not out:
        raise DataError("no queries", path)
    return out


def _parse_docs(
    records: Iterable[tuple[int, dict[str, Any]]], path: Path, id_keys: Sequence[str]
) -> list[Doc]:
    out: list[Doc] = []
    seen: dict[str, int] = {}
    key = id_keys[0]
    for line, obj in records:
        # Fast path for the common well-formed record; anything unusual goes through the checks.
        doc_id = obj.get(key)
        if not (type(doc_id) is str and doc_id and not doc_id[0].isspace()
                and not doc_id[-1].isspace()):
            doc_id = _get_id(obj, id_keys, path, line, "document")
        if doc_id in seen:
            raise DataError(f"duplicate document id {doc_id!r} (first on line {seen[doc_id]})", path, line)
        seen[doc_id] = line
        title = obj.get("title") or ""
        text = obj.get("text")
        if not (type(text) is str and title == "" and text and not text.isspace()):
            if not isinstance(title, str):
                raise DataError(f"document field 'title' must be a string, got {title!r}", path, line)
            text = _get_text(obj, path, line, "document", allow_empty=bool(title.strip()))
            if not text.strip() and not title.strip():
                raise DataError("empty document text", path, line)
        out.append(Doc(doc_id, text, title))
    if not out:
        raise DataError("empty corpus", path)
    return out


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
        rows.append((path, line_no, qid, doc_id, _parse_score(score, path, line_no)))
    return rows


def read_qrels_jsonl(path: str | Path) -> Qrels:
    """Read an R2MED ``qrels.jsonl`` (``q_id``, ``p_id``, ``score``) on its own, keeping grades > 0.

    Unlike :func:`load_task` it cannot check ids against queries and corpus; the format checks
    (fields, integer grades, conflicting duplicates) still raise DataError with file and line.
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
