"""The result store: the only code that knows how results are laid out on disk.

Layout under an output root::

    <root>/<method>/<llm>/<leaf>/          one folder per run spec (RunSpec.folder())
        spec.json                          the spec: its key, digest and every setting
        summary.json                       scores of every task in the folder
        <Task>.json                        R2MED-style result (test, per_query, stats, config)
        <Task>.run                         TREC run
        <Task>.generations.jsonl           generation-augmented methods
        <Task>.traces.jsonl                agentic methods
        <Task>.rerank.jsonl                LLM rerankers

A folder holds one spec's results for any number of tasks (a second ``--task`` run adds to it).
Writing a spec into a folder that holds another spec's results is refused; re-running a spec on a
task replaces that task's files and says so. Folders written by versions before ``spec.json``
existed are read through the ``config`` each result file records, and :meth:`ResultStore.migrate`
moves each of their task results into the folder of its own spec.

A task's files are one set, replaced as a whole (:func:`write_task_set`): they are written into a
hidden staging folder, which one rename turns into ``.<Task>.set/`` (the commit: from then on the
new set is the task's result), and then moved into place one by one, ``<Task>.json`` last, files
of the old set that the new one lacks removed. A run's set also holds the folder's
``summary.json`` (made under the folder's lock with the new scores, moved in just before
``<Task>.json``), so a kill never leaves a summary of other scores than the task files beside it. A kill before the commit leaves the old set (and
a staging folder the next write removes); a kill after it leaves ``.<Task>.set/``, which readers
read through (:func:`task_set_files`) and the next write of the folder finishes. A reader thus
never mixes two runs' files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from r2med_agent.errors import ConfigError, DataError
from r2med_agent.experiment.spec import DEFAULT_TOP_K, RunSpec
from r2med_agent.io import (
    atomic_write_json,
    atomic_write_text,
    build_lock,
    inside,
    raise_if_disk_full,
    read_json,
    remove_stale_temps,
    set_default_mode,
    temp_prefix,
)

log = logging.getLogger(__name__)

SPEC_FILE = "spec.json"
SUMMARY_FILE = "summary.json"
TASK_SUFFIXES = (".json", ".run", ".generations.jsonl", ".traces.jsonl", ".rerank.jsonl")
"""Every file a task leaves in its spec's folder (``<Task><suffix>``)."""
DATA_MARK = "@data-"
"""What a task's result name adds when the folder holds that task on other data
(``pydocs@data-1a2b3c4d``, :meth:`ResultStore.result_name`)."""
_SET_MANIFEST = "set.json"
_LOCK = ".lock"


def _pending(folder: Path, task: str) -> Path:
    """The committed set of ``task`` not yet moved into place."""
    return folder / f".{task}.set"


def _set_members(pending: Path) -> list[str] | None:
    """The file names of a committed set (None: no set pending, or its moves are all done)."""
    try:
        names = json.loads((pending / _SET_MANIFEST).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return [str(n) for n in names] if isinstance(names, list) else None


def task_set_files(folder: Path, task: str) -> dict[str, Path]:
    """Where each of ``task``'s files is (``suffix -> path``; the path need not exist).

    While a committed set is pending, its members are read from ``.<Task>.set/`` or, once moved,
    from the folder; a file of the old set that the new one lacks is absent (its path points into
    the pending folder, where it is not). Otherwise the folder's own files.
    """
    pending = _pending(folder, task)
    members = _set_members(pending)
    out: dict[str, Path] = {}
    for suffix in TASK_SUFFIXES:
        name = task + suffix
        if members is None:
            out[suffix] = folder / name
        elif name in members and not (pending / name).exists():
            out[suffix] = folder / name
        else:
            out[suffix] = pending / name
    return out


def pending_tasks(folder: Path) -> list[str]:
    """Tasks of ``folder`` whose committed set is still being moved into place."""
    return sorted(p.name[1:-len(".set")] for p in folder.glob(".*.set") if _set_members(p) is not None)


def _finish_set(folder: Path, task: str) -> None:
    """Move a committed set of ``task`` into place and remove the files of the set it replaces
    that it lacks; every step can be repeated after a kill.

    ``<Task>.json`` marks a whole set on disk too: the old one is removed before any file moves,
    the new one moved last, so a kill in between leaves a folder whose ``<Task>.json``, when there
    is one, sits beside its own files (and the library's readers read the pending set meanwhile)."""
    pending = _pending(folder, task)
    if not pending.is_dir():
        return
    members = _set_members(pending)
    if members is not None:
        if (pending / f"{task}{TASK_SUFFIXES[0]}").exists():
            (folder / f"{task}{TASK_SUFFIXES[0]}").unlink(missing_ok=True)
            _fsync_dir(folder)
        for suffix in (*TASK_SUFFIXES[1:], TASK_SUFFIXES[0]):
            name = task + suffix
            if suffix == ".json" and (pending / SUMMARY_FILE).exists():
                os.replace(pending / SUMMARY_FILE, folder / SUMMARY_FILE)
            if (pending / name).exists():
                os.replace(pending / name, folder / name)
            elif name not in members:
                (folder / name).unlink(missing_ok=True)
        _fsync_dir(folder)
    shutil.rmtree(pending, ignore_errors=True)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finish_pending_sets(folder: Path) -> None:
    """Finish every committed set of ``folder`` and remove the staging folders of dead writers
    (what a killed write leaves); a folder that is not writable is left as it is."""
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        return
    with build_lock(folder / _LOCK):
        for task in [p.name[1:-len(".set")] for p in folder.glob(".*.set")]:
            _finish_set(folder, task)
        remove_stale_temps(folder)


def write_task_set(folder: Path, task: str, files: Mapping[str, str],
                   summary: Callable[[], str] | None = None) -> list[Path]:
    """Replace ``task``'s files in ``folder`` by ``files`` (``suffix -> text``) as one set.

    Args:
        summary: makes the folder's ``summary.json`` text, which joins the set; called under the
            folder's lock, once the set's files are final (see :func:`folder_scores`).

    Returns:
        the paths of the new files.

    Raises:
        DiskFullError: the set does not fit; the old set is intact and no temporary is left.
    """
    unknown = set(files) - set(TASK_SUFFIXES)
    if unknown or ".json" not in files:
        raise ValueError(f"a task's set is <Task>.json and files of {TASK_SUFFIXES[1:]}, got {sorted(files)}")
    inside(folder, task)  # a task name that would lead elsewhere: refused
    folder.mkdir(parents=True, exist_ok=True)
    with build_lock(folder / _LOCK):
        _finish_set(folder, task)
        remove_stale_temps(folder)
        stage = Path(tempfile.mkdtemp(dir=folder, prefix=temp_prefix(folder / task), suffix=".tmp"))
        contents = {task + suffix: text.encode("utf-8") for suffix, text in files.items()}
        if summary is not None:
            contents[SUMMARY_FILE] = summary().encode("utf-8")
        manifest = {"task": task, "files": list(contents)}
        contents[_SET_MANIFEST] = (json.dumps(manifest) + "\n").encode("utf-8")
        size = sum(len(data) for data in contents.values())
        try:
            for name, data in contents.items():
                with open(stage / name, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                set_default_mode(stage / name)
            _fsync_dir(stage)
            os.rename(stage, _pending(folder, task))  # the commit
        except BaseException as e:
            shutil.rmtree(stage, ignore_errors=True)
            raise_if_disk_full(e, folder / f"{task}.json", size)
            raise
        _fsync_dir(folder)
        _finish_set(folder, task)
    return [folder / (task + suffix) for suffix in files]


@dataclass(frozen=True)
class StoredResult:
    """One task result found in a store: its file, record and the spec it was made with."""

    path: Path
    record: dict[str, Any]
    spec: RunSpec | None
    """None when the file records no config (very old results): ``compare`` then names it by its folder."""
    files: dict[str, Path] = field(default_factory=dict)
    """Where each of the task's files is (:func:`task_set_files`)."""
    where: Path | None = None
    """The result folder (None: the file's own folder)."""

    @property
    def task(self) -> str:
        return self.path.stem

    @property
    def folder(self) -> Path:
        return self.where if self.where is not None else self.path.parent


def legacy_leaf(spec: RunSpec) -> str:
    """The folder name versions before spec.json gave ``spec``'s results (many specs shared one)."""
    label = spec.retriever_name
    if spec.final == "fuse":
        label += "__fuse"
    if spec.precision is not None:
        label += f"__{spec.precision}"
    if spec.top_k != DEFAULT_TOP_K:
        label += f"__k{spec.top_k}"
    if spec.samples > 1:
        label += f"__n{spec.samples}"
    if spec.reranker:
        if spec.rerank_cut:
            label += f"__top{spec.rerank_k}"
        label += f"__{spec.reranker}"
    return label


def spec_of_record(record: Mapping[str, Any]) -> RunSpec | None:
    """The spec a result record was made with (None when it records no usable config)."""
    config = record.get("config")
    if not isinstance(config, Mapping):
        return None
    from r2med_agent.experiment.resolve import spec_of_config

    try:
        return spec_of_config(config)
    except (ConfigError, TypeError, ValueError) as e:
        log.debug("config of a result record not understood: %s", e)
        return None


def read_task_record(path: Path) -> dict[str, Any] | None:
    """The task result in ``path``, or None when the JSON is not one (no ``test`` block)."""
    obj = read_json(path, "result file")
    if not isinstance(obj, dict) or "test" not in obj:
        return None
    if not isinstance(obj["test"], dict):
        raise DataError("'test' must be an object of metric -> score", path)
    return obj


class ResultStore:
    """Result folders under one output root."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def folder(self, spec: RunSpec) -> Path:
        return inside(self.root, *spec.folder().split("/"))

    def task_file(self, spec: RunSpec, task: str) -> Path:
        return inside(self.folder(spec), f"{task}.json")

    # -- writing -----------------------------------------------------------------------------

    def prepare(self, spec: RunSpec) -> Path:
        """Create the spec's folder (an unusable root fails now, before any work), check that it
        holds no other spec's results, and write its ``spec.json``."""
        folder = self.folder(spec)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{folder}: cannot create the result folder ({e.strerror}); check --output-dir") from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ConfigError(f"{folder}: the result folder is not writable; check --output-dir")
        self._check_owner(folder, spec)
        finish_pending_sets(folder)
        atomic_write_json(folder / SPEC_FILE, spec_file(spec))
        return folder

    def _check_owner(self, folder: Path, spec: RunSpec) -> None:
        """Refuse a folder whose ``spec.json`` or task results are another spec's. Both are read
        as specs, not compared as key texts: a setting added since they were written (a record
        without ``loop_rules``) makes them another spec even where the key text is the same."""
        marker = folder / SPEC_FILE
        if marker.exists():
            try:
                have = read_json(marker, "spec file")
            except DataError as e:
                raise ConfigError(f"{marker}: unreadable ({e}); move the folder away or repair it") from None
            owner = _owner_spec(have)
            have_key = owner.key() if owner is not None else have.get("key") if isinstance(have, dict) else None
            if owner is not None and have_key != spec.key() and self.folder(owner) != folder:
                raise ConfigError(
                    f"{folder} holds another spec's results ({owner.label}), filed by an earlier version; "
                    f"nothing was written. Run `r2med-agent results migrate {self.root}` to move them to "
                    "their own folder, then run again"
                )
            if have_key != spec.key():
                raise ConfigError(
                    f"{folder} holds results of another run spec ({marker}); nothing was written. "
                    "Use another --output-dir or move that folder"
                )
        others = []
        for found in self._task_results(folder):
            if found.spec is None or found.spec.key() != spec.key():
                what = found.spec.label if found.spec is not None else "no recorded settings"
                others.append(f"{found.path.name} ({what})")
        if others:
            raise ConfigError(
                f"{folder} holds results written by an earlier version for other settings: "
                f"{', '.join(others)}; nothing was written. Run `r2med-agent results migrate {self.root}` "
                "to move each result to its own folder, then run again"
            )

    def note_replacement(self, spec: RunSpec, task: str) -> None:
        """Say that ``task``'s result of ``spec`` is about to be replaced by a new run of it."""
        path = self.task_file(spec, task)
        if path.exists():
            try:
                made = read_json(path, "result file").get("evaluated_at", "an earlier run")
            except (DataError, AttributeError):
                made = "an earlier run"
            log.info("replacing %s (the same run spec, made %s)", path, made)

    def result_name(self, spec: RunSpec, task: str, data: str, corpus: str) -> str:
        """The name ``task``'s new result of ``spec`` is filed under: ``task``, unless the folder's
        result of that name was made on other data (``data``: :func:`~r2med_agent.data.data_fingerprint`;
        a record older than it is compared by its ``corpus_fingerprint``, one with neither is taken
        as the same data); then ``<task>@data-<8 hex of data>``, kept beside it. Another data set
        is another result, never a replacement: ``results list`` and ``compare`` show both."""
        path = task_set_files(self.folder(spec), task)[".json"]
        try:
            record = read_task_record(path) if path.exists() else None
        except DataError:
            record = None  # unreadable: replaced as before (its error is not this run's)
        if record is None or _same_data(record, data, corpus):
            return task
        name = f"{task}{DATA_MARK}{data[:8]}"
        log.warning("%s holds %s on other data (%s); this run's result is %s, kept beside it", path.parent, task,
                    record.get("source", "its source is not recorded"), name)
        return name

    # -- reading -----------------------------------------------------------------------------

    def _task_results(self, folder: Path) -> Iterator[StoredResult]:
        for task in task_names(folder):
            files = task_set_files(folder, task)
            record = read_task_record(files[".json"])
            if record is not None:
                yield StoredResult(files[".json"], record, spec_of_record(record), files, folder)

    def results(self) -> Iterator[StoredResult]:
        """Every task result under the root (any depth), in path order.

        Raises:
            DataError: the root does not exist, or a result file is malformed.
        """
        if not self.root.is_dir():
            raise DataError("results directory does not exist", self.root)
        found = {p.parent for p in self.root.rglob("*.json")}
        found |= {p.parent for p in self.root.rglob(".*.set")}
        folders = sorted(f for f in found if not f.name.startswith("."))  # not a set's own folder
        for folder in folders:
            yield from self._task_results(folder)

    def places(self, spec: RunSpec) -> tuple[Path, Path]:
        """Where ``spec``'s results can be: its own folder, and the folder versions before
        ``spec.json`` gave it (the same folder for a spec of default settings)."""
        return self.folder(spec), inside(self.root, spec.method, spec.llm_label, legacy_leaf(spec))

    def find(self, spec: RunSpec, task: str) -> Path | None:
        """The result file of ``spec`` on ``task``: in the spec's folder, or in the folder an
        earlier version wrote it to (when its recorded config is this spec), else None."""
        for folder in self.places(spec):
            path = task_set_files(folder, task)[".json"]
            if not path.exists():
                continue
            try:
                record = read_task_record(path)
            except DataError:
                return path  # unreadable: the caller reports it
            if record is None:
                continue
            found = spec_of_record(record)
            if found is not None and found.key() == spec.key():
                return path
        return None

    # -- migrating ---------------------------------------------------------------------------

    def migrate(self, dry_run: bool = False) -> list[tuple[Path, Path]]:
        """Move every task result that is not in its own spec's folder there, with its run,
        generation, trace and rerank files; write ``spec.json`` into each folder it fills.

        Nothing is overwritten: a task whose target already holds a result of that task is left
        where it is (and reported). Each file moves by one rename (atomic on one file system).

        Returns:
            ``(from, to)`` of every task result moved (or, with ``dry_run``, to be moved).
        """
        moves: list[tuple[Path, Path]] = []
        touched: set[Path] = set()
        for found in list(self.results()):
            if found.spec is None:
                log.warning("%s records no run config; left where it is", found.path)
                continue
            target = self.folder(found.spec)
            if target.resolve() == found.folder.resolve():
                touched.add(target)
                continue
            dest = target / found.path.name
            if os.path.lexists(dest):
                log.warning("%s: %s already holds this task's result; left where it is", found.path, target)
                continue
            moves.append((found.path, dest))
            if dry_run:
                continue
            finish_pending_sets(found.folder)
            finish_pending_sets(target)
            target.mkdir(parents=True, exist_ok=True)
            for suffix in TASK_SUFFIXES:
                src = found.folder / f"{found.task}{suffix}"
                if src.is_file() and not src.is_symlink() and not os.path.lexists(target / src.name):
                    os.rename(src, target / src.name)
            touched.update({target, found.folder})
        if not dry_run:
            for folder in touched:
                self._refresh_folder(folder)
        return moves

    def _refresh_folder(self, folder: Path) -> None:
        """Rewrite a folder's spec.json and summary.json from the task results it now holds."""
        found = list(self._task_results(folder))
        specs = {f.spec.key(): f.spec for f in found if f.spec is not None}
        if len(specs) == 1 and all(f.spec is not None for f in found):
            spec = next(iter(specs.values()))
            if self.folder(spec).resolve() == folder.resolve():
                atomic_write_json(folder / SPEC_FILE, spec_file(spec))
        summary = folder / SUMMARY_FILE
        if not found:
            if summary.is_file() and not summary.is_symlink():
                summary.unlink()
            owner = _owner_spec(_read_or_none(folder / SPEC_FILE))
            if owner is not None and self.folder(owner).resolve() != folder.resolve():
                (folder / SPEC_FILE).unlink()  # its results moved to their own folder; it no longer owns this one
            return
        scores = {f.task: {k: float(v) for k, v in f.record["test"].items() if isinstance(v, (int, float))}
                  for f in found}
        write_summary(folder, scores, found[0].spec)


def _same_data(record: Mapping[str, Any], data: str, corpus: str) -> bool:
    """Whether a stored result was made on the data of this fingerprint (see
    :meth:`ResultStore.result_name`)."""
    if record.get("data_fingerprint"):
        return record["data_fingerprint"] == data
    if record.get("corpus_fingerprint"):
        return record["corpus_fingerprint"] == corpus
    return True


def _read_or_none(path: Path) -> Any:
    """The JSON in ``path``, or None when it is missing or unreadable."""
    try:
        return read_json(path, "spec file") if path.is_file() else None
    except DataError:
        return None


def _owner_spec(have: Any) -> RunSpec | None:
    """The spec a ``spec.json`` names, read from its full record (None: not understood)."""
    record = have.get("spec") if isinstance(have, dict) else None
    if not isinstance(record, Mapping):
        return None
    from r2med_agent.experiment.resolve import spec_of_config

    try:
        return spec_of_config(record)
    except (ConfigError, TypeError, ValueError):
        return None


def spec_file(spec: RunSpec) -> dict[str, Any]:
    """The contents of a folder's ``spec.json``."""
    return {"key": spec.key(), "digest": spec.digest(), "label": spec.label, "folder": spec.folder(),
            "spec": spec.record()}


def write_summary(folder: Path, scores: Mapping[str, Mapping[str, float]], spec: RunSpec | None,
                  extra: Mapping[str, Any] | None = None) -> Path:
    """``summary.json``: every task's mean scores in the folder and their average."""
    return atomic_write_text(folder / SUMMARY_FILE, summary_text(scores, spec, extra))


def summary_text(scores: Mapping[str, Mapping[str, float]], spec: RunSpec | None,
                 extra: Mapping[str, Any] | None = None) -> str:
    """The text of a ``summary.json`` (:func:`write_summary`)."""
    from datetime import datetime, timezone

    from r2med_agent.evaluation import average_over_tasks

    ordered = dict(sorted((t, dict(s)) for t, s in scores.items()))
    body: dict[str, Any] = {}
    if spec is not None:
        body.update(method=spec.method, llm=spec.llm_label, generations=spec.generations,
                    retriever=spec.leaf, depth=spec.top_k, label=spec.label, spec=spec.record())
    body.update(tasks=list(ordered), average=average_over_tasks(list(ordered.values())), per_task=ordered)
    body.update(extra or {})
    body.setdefault("evaluated_at", datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return json.dumps(body, indent=2, ensure_ascii=False) + "\n"


def folder_scores(folder: Path, this_run: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Mean scores of every ``<Task>.json`` in ``folder`` (this run's own where it made one),
    sorted by task name; files that cannot be read are skipped with a warning."""
    scores: dict[str, dict[str, float]] = {}
    for task in task_names(folder):
        path = task_set_files(folder, task)[".json"]
        if task in this_run:
            continue
        try:
            rec = read_json(path, "result file")
        except DataError as e:
            log.warning("summary.json leaves out %s: %s", path.name, e)
            continue
        test = rec.get("test") if isinstance(rec, dict) else None
        if isinstance(test, dict) and rec.get("dataset_name") == task:
            scores[task] = {k: float(v) for k, v in test.items() if isinstance(v, (int, float))}
    scores.update({k: dict(v) for k, v in this_run.items()})
    return dict(sorted(scores.items()))


def task_names(folder: Path) -> list[str]:
    """The tasks with a result file in ``folder`` (or a committed set pending there)."""
    names = {p.stem for p in folder.glob("*.json")
             if p.name not in (SUMMARY_FILE, SPEC_FILE) and not p.name.startswith(".")}
    return sorted(names | set(pending_tasks(folder)))
