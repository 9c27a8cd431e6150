"""The task registry (R2MED, NanoR2MED, the shipped samples) and task names.

The registry is ``configs/tasks.yaml`` (one :class:`TaskSpec` per entry; a user config file can add or
replace entries under ``tasks:``). A name is a task name, an alias, an old reference-code name or a
Nano split name (case-insensitive); ``all`` and ``nano-all`` name groups; with ``--data-dir``, a name
the registry does not know is a task of your own (:func:`local_task_spec`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from r2med_agent.config import load_registry
from r2med_agent.data.formats import _detect_layout
from r2med_agent.errors import ConfigError, DataError
from r2med_agent.names import NAME_RULE, name_problem
from r2med_agent.types import Family

GROUPS = {"all": "r2med", "nano-all": "nano", "bright-all": "bright", "bright-long-all": "bright-long"}
"""Spec words that expand to a registry group: ``all`` (the 8 R2MED tasks), ``nano-all``,
``bright-all`` (BRIGHT's 12 tasks) and ``bright-long-all`` (its 8 long-document tasks)."""

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


@dataclass(frozen=True)
class TaskSpec:
    """One registry entry (``configs/tasks.yaml``).

    Attributes:
        name: canonical task name (the YAML key).
        family: prompt family: ``qa``, ``exam``, ``treatment`` or ``case``.
        domain: subject used by Q&A prompts ("biology", "medical sciences", ...).
        source: where the data lives without ``--data-dir``: ``hub`` (an R2MED-layout dataset repo),
            ``nano`` (one split of a Nano-layout repo), ``bright`` (one split of a BRIGHT-layout
            repo, :mod:`~r2med_agent.data.bright`), ``package`` (inside r2med_agent/resources)
            or ``local`` (a folder of your own: ``path``, or ``--data-dir``; no hub repo needed).
        group: ``r2med``, ``nano``, ``bright`` or ``bright-long`` puts the task in ``all``,
            ``nano-all``, ``bright-all`` or ``bright-long-all``; empty for none.
        repo: hub dataset repo id (``source`` hub or nano).
        revision: hub revision to download: a 40-hex commit (immutable, cached copy used offline) or a
            branch/tag (resolved online; the cached copy is used when the hub is unreachable).
        split: the task's split in a Nano repo (``NanoR2MEDBiology``) or a BRIGHT repo (BRIGHT's task
            key, ``earth_science``).
        long_documents: a BRIGHT task in its long-document setting (``long_documents`` and
            ``gold_ids_long`` in place of ``documents`` and ``gold_ids``).
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
    source: Literal["hub", "nano", "bright", "package", "local"]
    group: str = ""
    repo: str = ""
    revision: str = "main"
    split: str = ""
    long_documents: bool = False
    path: str = ""
    base: str = ""
    aliases: tuple[str, ...] = ()
    queries: int | None = None
    docs: int | None = None
    allow_missing_qrels_docs: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if self.source in ("hub", "nano", "bright") and not self.repo:
            raise ValueError(f"source {self.source!r} needs 'repo' (a hub dataset id)")
        if self.source in ("nano", "bright") and not self.split:
            raise ValueError(f"source '{self.source}' needs 'split' (the task's split in the repo)")
        if self.long_documents and self.source not in ("bright", "local"):
            raise ValueError("'long_documents' applies to BRIGHT tasks (source 'bright' or 'local')")
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
        if self.source == "bright":
            return f"{ref}#{self.split}" + ("(long_documents)" if self.long_documents else "")
        return f"{ref}#{self.split}" if self.source == "nano" else ref

    @property
    def bright(self):
        """The BRIGHT split and setting of a BRIGHT task (:class:`~r2med_agent.data.bright.BrightSplit`),
        None for the others."""
        if self.source != "bright" and not (self.source == "local" and self.split):
            return None
        from r2med_agent.data.bright import BrightSplit

        return BrightSplit(self.split, self.long_documents)


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
        if spec.split and spec.source == "nano":  # BRIGHT's splits name two settings (and Biology)
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


OWN_TASK = "a local task"
"""The description of the entry a task of your own gets when no registry entry describes it."""


def local_task_spec(name: str) -> TaskSpec:
    """The entry of a task of your own that the registry does not know (a ``--data-dir`` folder
    named after itself): family ``qa``, domain ``medical``, no counts to check."""
    clean = name.strip()
    problem = _task_name_problem(clean)
    if problem is not None:
        raise ConfigError(f"--task: {name!r} cannot name a task ({problem}); task names become file names, "
                          f"so use {NAME_RULE}")
    return TaskSpec(name=clean, family=LOCAL_FAMILY, domain=LOCAL_DOMAIN, source="local",
                    description=OWN_TASK)


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
        name = index.get(p.resolve().name.lower(), p.resolve().name)
        return _folder_task_name(name, p.resolve(), "its folder")

    layout = _detect_layout(folder, None)
    if layout == "bright":
        return [_folder_task_name(name, folder / "examples", "a split of its examples")
                for name in _bright_folder_tasks(folder)]
    if layout is not None:
        return [named(folder)]
    children = sorted(p for p in folder.iterdir() if p.is_dir() and _detect_layout(p, None) is not None)
    if not children:
        raise DataError(
            "no task files here or in its sub-folders: expected query.jsonl, corpus.jsonl and "
            "qrels.jsonl or qrels.txt (R2MED layout), queries.jsonl, corpus.jsonl and "
            "qrels/<split>.tsv (BEIR layout), or examples/ and documents/ (BRIGHT layout); "
            "without qrels the queries run unscored",
            folder,
        )
    return [named(p) for p in children]


def _task_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a task of your own (:func:`~r2med_agent.names.name_problem`, or a
    group's name), or None."""
    return name_problem(name) or ("it names a group of tasks" if name.lower() in (*GROUPS, "list") else None)


def _folder_task_name(name: str, where: Path, what: str) -> str:
    """``name``, the task that ``what`` names, unless it cannot be a file name."""
    problem = _task_name_problem(name)
    if problem is not None:
        raise DataError(f"{name!r}, {what}, cannot name a task ({problem}); rename it, or pass --task NAME, "
                        f"using {NAME_RULE}", where)
    return name


def _bright_folder_tasks(folder: Path) -> list[str]:
    """The tasks of a BRIGHT-layout folder: per split of its examples, the registered BRIGHT task
    of that split, else a task of your own named after the split; in the short-document setting
    where the folder has those documents, else the long one (``<split>-long``)."""
    from r2med_agent.data.bright import BrightSplit, bright_splits, has_setting, own_task_name

    registry = task_registry()
    registered = {(s.split, s.long_documents): n for n, s in registry.items() if s.source == "bright"}
    out = []
    for split in bright_splits(folder):
        chosen = BrightSplit(split, not has_setting(folder, BrightSplit(split)))
        out.append(registered.get((chosen.split, chosen.long), own_task_name(chosen)))
    return out


def own_bright_task(name: str, data_dir: str | Path | None) -> TaskSpec | None:
    """The task of your own that ``name`` means in a BRIGHT-layout ``data_dir``: a split of the
    folder (any case), or ``<split>-long`` for its long documents, named by what it reads; None
    when ``data_dir`` is not such a folder or the name is not one of its splits.

    A task entry of your own (``source: local``) named after the split gives it its family and
    domain in both settings (``pydocs-long`` gets ``pydocs``'s domain).
    """
    import dataclasses

    from r2med_agent.data.bright import is_bright_folder, own_split, own_task_name

    if data_dir is None:
        return None
    folder = Path(data_dir).expanduser()
    if not is_bright_folder(folder):
        return None
    split = own_split(folder, name)
    if split is None:
        return None
    registry = task_registry()
    entry = next((s for n, s in registry.items() if n.lower() == split.split.lower() and s.source == "local"), None)
    base = entry or local_task_spec(split.split)
    return dataclasses.replace(base, name=own_task_name(split), split=split.split, long_documents=split.long,
                               aliases=())


def _own_split_clash(item: str, canonical: str, registry: dict[str, TaskSpec],
                     data_dir: str | Path | None) -> None:
    """Refuse a name that is both a registry task and a split of a BRIGHT-layout ``data_dir``
    (``biology``: R2MED's ``Biology`` by name, the folder's ``biology`` split by its files), saying
    exactly what to type for either. A BRIGHT task of that split and an entry of your own are what
    they say and pass."""
    spec = registry[canonical]
    if spec.source == "local" or (spec.source == "bright" and spec.split.lower() == item.lower()):
        return
    own = own_bright_task(item, data_dir)
    if own is None:
        return
    bright = next((n for n, s in registry.items() if s.source == "bright" and s.split == own.split
                   and s.long_documents == own.long_documents), None)
    as_bright = (f"; to run it as BRIGHT's own {own.split} (compared with BRIGHT's published numbers): "
                 f"--task {bright} --allow-count-mismatch") if bright else ""
    raise ConfigError(
        f"task '{item}' is the registry's {canonical}, and this BRIGHT-layout folder's split {own.split} cannot "
        f"run under that name. To run the split as a task of your own, give it a name in a user config "
        f"(tasks: {{my-{own.split}: {{source: local, split: {own.split}, "
        f"{'long_documents: true, ' if own.long_documents else ''}family: qa, domain: YOUR DOMAIN}}}}) and pass "
        f"--config FILE --task my-{own.split}{as_bright}")


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
            _own_split_clash(item, index[low], registry, data_dir)
            names = [index[low]]
        elif low in extra_index:
            names = [extra_index[low]]
        elif data_dir is not None:
            own = own_bright_task(item, data_dir)
            names = [own.name if own is not None else local_task_spec(item).name]
        else:
            known = f"; the results hold: {', '.join(sorted(extra_index.values()))}" if extra_index else ""
            raise ConfigError(_unknown_task_message(item, registry) + known)
        out.extend(n for n in names if n not in out)
    return out


def list_tasks() -> list[dict[str, Any]]:
    """Rows for a ``tasks`` listing: one dict per registered task, in registry order.

    Keys: ``name``, ``family``, ``domain``, ``group``, ``source`` (hub repo@revision, or the package
    folder), ``repo``, ``revision``, ``split``, ``queries``, ``docs`` (counts from R2MED's paper, the
    NanoR2MED card and BRIGHT's dataset card; None when unknown), ``aliases``, ``description``.
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
