"""Loading a task by name: from a local ``data_dir``, the package (``sample``, ``r2med-demo``) or the
Hugging Face hub, checked against the registry's counts."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from r2med_agent.data.formats import (
    DEFAULT_SPLIT,
    NANO_CONFIGS,
    R2MED_HUB_FILES,
    BeirSplit,
    _detect_layout,
    _load_task_dir,
)
from r2med_agent.data.bright import EXAMPLES
from r2med_agent.data.registry import (
    OWN_TASK,
    TaskSpec,
    _aliases,
    _own_split_clash,
    get_task_spec,
    local_task_spec,
    own_bright_task,
    task_registry,
)
from r2med_agent.errors import ConfigError, DataError
from r2med_agent.paths import resources_dir
from r2med_agent.types import Task

logger = logging.getLogger(__name__)


def load_task(
    name: str,
    data_dir: str | Path | None = None,
    *,
    allow_missing_qrels_docs: bool = False,
    allow_count_mismatch: bool = False,
    qrels_split: str = DEFAULT_SPLIT,
    all_queries: bool = False,
) -> Task:
    """Load and validate one task.

    Args:
        name: a task name, alias or Nano split name (see :func:`~r2med_agent.data.registry.task_names`).
        data_dir: a local copy: either the task's folder itself (R2MED, BEIR, Nano or BRIGHT
            layout) or a parent folder holding ``<Task>/`` (the task name, one of its aliases, or its
            Nano split name). A BRIGHT task reads a BRIGHT-layout folder only. Without it, package tasks load from the package and the others from the hub at
            the registry's pinned revision.
        allow_missing_qrels_docs: keep qrels that name documents absent from the corpus (with a
            warning giving their number) instead of failing; they stay relevant documents, so
            they count in the ideal DCG as pytrec_eval scores them. Registry entries known to
            ship such qrels (``r2med-demo``) set it themselves.
        allow_count_mismatch: load a ``data_dir`` copy of a registered task whose numbers of
            queries or documents differ from the registry's (refused otherwise: a 12-query
            folder labelled Biology would be compared with the paper's 103-query scores). The
            difference is recorded in the task's ``source``.
        qrels_split: the qrels split of a BEIR folder (``qrels/<qrels_split>.tsv``; recorded in
            the task's ``source``).
        all_queries: keep a BEIR folder's queries that the split's qrels do not name.

    Raises:
        ConfigError: unknown task name (without ``data_dir``; with it, an unknown name is a
            task of your own).
        DataError: missing or malformed files (the message names file and line); a copy whose
            counts contradict the registry's.
        HubUnavailableError: no ``data_dir`` and the hub cannot be reached (fails within seconds).
        MissingExtraError: parquet files but no pyarrow.
    """
    spec = task_spec(name, data_dir)
    folder, source = _task_folder(spec, data_dir)
    task = _load_task_dir(
        folder,
        name=spec.name,
        family=spec.family,
        domain=spec.domain,
        split=spec.split or None,
        source=source,
        allow_missing_qrels_docs=allow_missing_qrels_docs or spec.allow_missing_qrels_docs,
        use_task_cache=True,
        beir=BeirSplit(qrels_split, all_queries),
        bright=spec.bright,
    )
    if data_dir is None and spec.source != "local" and not task.qrels:
        # A release always has qrels: a folder without them is a broken download, not new queries.
        raise DataError(f"missing qrels: {spec.name}'s release has relevance judgments, this copy has none",
                        folder)
    if data_dir is not None or spec.source == "local":
        task = _check_counts(task, spec, folder, allow_count_mismatch)
    elif task.origin is not None:
        # The hub's and the package's tasks load by name: no folder of this machine to record.
        task = dataclasses.replace(task, origin=dataclasses.replace(task.origin, folder=None))
    return task


def task_spec(name: str, data_dir: str | Path | None) -> TaskSpec:
    """The registry entry of ``name``; with a ``data_dir``, an unknown name is a task of your own
    (in a BRIGHT-layout folder, the split and setting it names, :func:`own_bright_task`)."""
    try:
        spec = get_task_spec(name)
    except ConfigError:
        if data_dir is None:
            raise
        return own_bright_task(name, data_dir) or local_task_spec(name)
    _own_split_clash(name, spec.name, task_registry(), data_dir)
    return spec


def prompt_facts(name: str, data_dir: str | Path | None) -> tuple[str, str, bool]:
    """The family and domain the task's prompts are rendered with, and whether a registry entry
    gives them (False: a task of your own that no entry describes, which gets the generic Q&A
    prompts of a medical post, :data:`~r2med_agent.data.registry.LOCAL_DOMAIN`)."""
    spec = task_spec(name, data_dir)
    return spec.family, spec.domain, spec.description != OWN_TASK


def generic_prompt_note(name: str, data_dir: str | Path | None) -> str | None:
    """One line for a task of your own that no entry describes, rendered into prompts: it gets
    the generic Q&A prompts of a medical post, and the line says how to give it its own domain.
    None for a task an entry describes."""
    family, domain, described = prompt_facts(name, data_dir)
    if described:
        return None
    return (f"task {name} has no task entry, so its prompts are the generic ones of a {domain} post (family "
            f"{family}); if it is not {domain}, describe it in a user config (tasks: {{{name}: {{source: local, "
            f"family: qa, domain: YOUR DOMAIN}}}}) and pass --config FILE")


def _task_folder(spec: TaskSpec, data_dir: str | Path | None) -> tuple[Path, str]:
    """The folder holding the task's files and the provenance to record for them."""
    if data_dir is not None:
        folder = _locate(Path(data_dir).expanduser(), spec)
        return folder, str(folder.resolve())
    if spec.source == "local":
        if not spec.path:
            raise ConfigError(f"task {spec.name} is a local task: pass --data-dir FOLDER "
                              "(or give its entry a 'path:')")
        folder = Path(spec.path).expanduser()
        return folder, str(folder.resolve())
    if spec.source == "package":
        return resources_dir() / spec.path, spec.provenance
    return _hub_folder(spec)


def _hub_folder(spec: TaskSpec) -> tuple[Path, str]:
    """The hub snapshot holding a ``hub`` or ``nano`` task's files (downloaded when not cached) and
    its provenance."""
    from r2med_agent.data.hub import fetch_snapshot

    if spec.source == "nano":
        patterns = [f"{cfg}/{spec.split}{sep}*" for cfg in NANO_CONFIGS for sep in (".", "-")]
        hint = (
            f"corpus/, queries/ and qrels/ folders with {spec.split} files (a copy of "
            f"{spec.repo}), or a folder {spec.name}/ in R2MED layout"
        )
    elif spec.source == "bright":
        split = spec.bright
        patterns = [f"{cfg}/{spec.split}{sep}*" for cfg in (EXAMPLES, split.documents) for sep in (".", "-")]
        hint = (f"{EXAMPLES}/ and {split.documents}/ folders with {spec.split} files (a copy of {spec.repo}), "
                f"or a folder {spec.name}/ in that layout")
    else:
        patterns = list(R2MED_HUB_FILES)
        hint = (
            "corpus.jsonl, query.jsonl and qrels.jsonl (a copy of "
            f"{spec.repo}), or a parent folder holding {spec.name}/"
        )
    from r2med_agent.data.hub import is_commit

    folder = fetch_snapshot(spec.repo, spec.revision, patterns, hint=hint)
    source = spec.provenance
    if not is_commit(spec.revision) and is_commit(folder.name):
        # A branch (NanoR2MED follows main): record the commit the files came from, so a
        # result says which data it was computed on. (Snapshot folders are named by commit.)
        source += f" (commit {folder.name})"
    return folder, source


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


def _locate(data_dir: Path, spec: TaskSpec) -> Path:
    """The folder under ``data_dir`` that holds ``spec``'s files (see :func:`load_task`)."""
    if not data_dir.is_dir():
        raise DataError("--data-dir is not a directory", data_dir)
    wanted = [spec.name, *_aliases(spec.name, spec), *([spec.split] if spec.split else [])]
    children = {p.name.lower(): p for p in data_dir.iterdir() if p.is_dir()}

    def fits(layout: str | None) -> bool:  # a BRIGHT task reads BRIGHT's layout only (R2MED has a Biology/)
        return layout is not None and (spec.bright is None or layout == "bright")

    for candidate in wanted:
        child = data_dir / candidate
        if not child.is_dir():
            child = children.get(candidate.lower(), child)
        if child.is_dir() and fits(_detect_layout(child, spec.split or None)):
            return child
    layout = _detect_layout(data_dir, spec.split or None)
    if fits(layout):
        names = {w.lower() for w in wanted}
        if layout not in ("nano", "bright") and data_dir.resolve().name.lower() not in names:
            logger.warning(
                "loading task %s from %s, whose folder name is not the task's; "
                "point --data-dir at a parent holding %s/ to load several tasks",
                spec.name,
                data_dir,
                spec.name,
            )
        return data_dir
    from r2med_agent.errors import did_you_mean

    held = [p.name for p in children.values() if _detect_layout(p, spec.split or None) is not None]
    raise DataError(
        f"no data for task {spec.name}{did_you_mean(spec.name, held)}: expected {data_dir / spec.name}/ "
        "or this folder itself to "
        "hold query.jsonl, corpus.jsonl and qrels.jsonl (R2MED layout) or queries.jsonl, "
        "corpus.jsonl and qrels/<split>.tsv (BEIR layout)"
        + (f", or {EXAMPLES}/ and {spec.bright.documents}/ with {spec.split} files (BRIGHT layout)" if spec.bright
           else f", or corpus/ queries/ qrels/ with {spec.split} files (Nano layout)" if spec.split else ""),
        data_dir,
    )
