"""The authors' prompts at pinned commits: which runs render them, where they come from.

A model trained on its authors' prompt (GroupRank, ReasonRank, Rank1, Rank-R1, the Search-R1
checkpoints), and a published row whose numbers came from its authors' prompts (R2MED's HyDE,
Query2Doc and LameR cells, Search-o1, the zero-shot groupwise rows of GroupRank's table), is run
with those prompts by default. The project ships none of their text: ``configs/pinned/prompt_sources.yaml``
names, per reference repository, the commit and the files (each with its SHA-256) its prompts are
read from, and the prompt folders they give (:class:`PromptSource`).

On first use (:func:`ensure`) the files are fetched from ``$R2MED_PROMPTS_BASE_URL/<repo>/<commit>/
<file>`` (default https://raw.githubusercontent.com; a ``file://`` folder or a local server in the
same layout works too) into ``<cache>/reference-prompts/<owner>+<repo>@<commit>/files/``, each
checked against its pinned hash before anything is written, then read by the importer of
``r2med-agent prompts import`` (:data:`~r2med_agent.prompts.importer.READERS`, never running them) into
a templates folder beside them; later runs find them there. :func:`install_clone` does the same from
a user's clone checked out at the commit (``r2med-agent prompts import <clone>``), the way to work
without network. A source is any READERS entry: a new one is an entry of the YAML file.

Which wording a run renders is its spec's ``prompts_from`` (:func:`resolve`): ``own`` (the project's
templates, with ``$R2MED_PROMPTS_DIR`` over them) or the sources it renders, as
``<owner>/<repo>@<commit[:12]>`` joined by ``+``. Left unset (``--prompts`` not given), a run whose
prompt-rendering LLM is anything but the local smoke model (backend ``local``) takes the authors'
(:func:`natural`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from r2med_agent.errors import ConfigError, DataError, PromptSourceError
from r2med_agent.redaction import redact

__all__ = [
    "AUTHORS", "BASE_URL_ENV", "OWN", "PromptSource", "RunPrompts", "at_hand", "base_url", "ensure",
    "install_clone", "natural", "prompt_sources", "resolve", "run_prompts", "source_of_folder",
]

log = logging.getLogger(__name__)

SOURCES_FILE = "pinned/prompt_sources.yaml"
BASE_URL_ENV = "R2MED_PROMPTS_BASE_URL"
"""Environment variable: where the pinned files are fetched from, in raw.githubusercontent's layout
``<base>/<owner>/<repo>/<commit>/<path>`` (``https://``, ``http://`` or ``file://``)."""
DEFAULT_BASE_URL = "https://raw.githubusercontent.com"
CACHE_FOLDER = "reference-prompts"

OWN = "own"
AUTHORS = "authors"
CHOICES = (AUTHORS, OWN)
"""What ``--prompts`` takes."""

FETCH_ATTEMPTS = 3
FETCH_BACKOFF_S = 0.5
"""Seconds before the second attempt; doubled before each further one."""
FETCH_TIMEOUT_S = 30.0

_VALUE = re.compile(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+@[0-9a-f]{7,40}")


@dataclass(frozen=True)
class PromptSource:
    """One reference repository's prompts at a pinned commit.

    Attributes:
        name: the key in ``configs/pinned/prompt_sources.yaml``.
        repo: ``owner/name`` on GitHub.
        commit: the full 40-hex commit.
        reader: the :data:`~r2med_agent.prompts.importer.READERS` entry that reads the files.
        folders: the prompt folders the import gives (``hyde``, ``rerank-groupwise`` ...).
        files: path in the repository -> SHA-256 of the file at ``commit``.
        about: one line for listings.
    """

    name: str
    repo: str
    commit: str
    reader: str
    folders: tuple[str, ...]
    files: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)
    about: str = ""

    @property
    def short(self) -> str:
        """``owner/repo@<12 hex>``: how run specs, records and listings name it."""
        return f"{self.repo}@{self.commit[:12]}"

    @property
    def folder(self) -> Path:
        """Its cache folder: ``<cache>/reference-prompts/<owner>+<repo>@<commit>``."""
        from r2med_agent.paths import cache_dir

        return cache_dir() / CACHE_FOLDER / f"{self.repo.replace('/', '+')}@{self.commit}"

    def url(self, rel: str, base: str | None = None) -> str:
        return f"{(base or base_url()).rstrip('/')}/{self.repo}/{self.commit}/{rel}"

    @property
    def offline_hint(self) -> str:
        """The commands that give a machine without network these prompts."""
        name = self.repo.split("/", 1)[1]
        return (f"git clone https://github.com/{self.repo} (wherever there is network), git -C {name} checkout "
                f"{self.commit}, then r2med-agent prompts import {name}")


def base_url() -> str:
    """Where pinned files are fetched from: ``$R2MED_PROMPTS_BASE_URL`` or raw.githubusercontent."""
    return os.environ.get(BASE_URL_ENV, "").strip() or DEFAULT_BASE_URL


@lru_cache(maxsize=1)
def prompt_sources() -> dict[str, PromptSource]:
    """The pinned sources of ``configs/pinned/prompt_sources.yaml``, by name.

    Raises:
        ConfigError: a malformed entry (named, with the field).
    """
    from r2med_agent.config import read_yaml
    from r2med_agent.paths import configs_dir
    from r2med_agent.prompts.readers import READERS

    path = configs_dir() / SOURCES_FILE
    doc = read_yaml(path)
    entries = doc.get("sources") if isinstance(doc, Mapping) else None
    if not isinstance(entries, Mapping):
        raise ConfigError(f"{path}: expected a mapping 'sources'")
    out: dict[str, PromptSource] = {}
    for name, e in entries.items():
        where = f"{path}: sources.{name}"
        if not isinstance(e, Mapping) or set(e) - {"repo", "commit", "reader", "folders", "files", "about"}:
            raise ConfigError(f"{where}: expected repo, commit, reader, folders, files (and about)")
        if not re.fullmatch(r"[0-9a-f]{40}", str(e.get("commit", ""))):
            raise ConfigError(f"{where}: commit must be the full 40-hex commit")
        if e.get("reader") not in READERS:
            raise ConfigError(f"{where}: reader must be one of {', '.join(READERS)}")
        files = e.get("files")
        if not isinstance(files, Mapping) or not files or not all(
                re.fullmatch(r"[0-9a-f]{64}", str(h)) for h in files.values()):
            raise ConfigError(f"{where}: files must map each path to its SHA-256 (64 hex)")
        out[str(name)] = PromptSource(str(name), str(e["repo"]), str(e["commit"]), str(e["reader"]),
                                      tuple(e.get("folders") or ()), dict(files), str(e.get("about", "")))
    return out


def source_of_folder(folder: str) -> PromptSource | None:
    """The source whose import gives the prompt folder ``folder`` (None: the project's wording only)."""
    return next((s for s in prompt_sources().values() if folder in s.folders), None)


# ----------------------------------------------------------------------------------------------
# Which runs render them


def renderers(method: str, llm: str | None, generations: str, reranker: str | None) -> list[tuple[str, str | None]]:
    """``(prompt folder, LLM that reads it)`` for each prompt folder a run renders: its method's
    when it generates fresh, its reranker's (read by the entry's ``llm``)."""
    from r2med_agent.prompts.importer import run_prompt_folders

    out: list[tuple[str, str | None]] = [(f, llm) for f in run_prompt_folders(method, generations, "")]
    if reranker:
        from r2med_agent.rerank.spec import get_reranker_spec

        try:
            entry = get_reranker_spec(reranker)
        except ConfigError:
            return out
        if entry.prompt_folder is not None:
            out.append((entry.prompt_folder, entry.llm or None))
    return out


def _smoke(llm: str | None) -> bool:
    """Whether ``llm`` keeps the project's wording by default: a local smoke model (registry
    backend ``local``: llama.cpp in-process), or a name the registry does not know (the run
    stops on it with a did-you-mean, not on a fetch)."""
    if not llm:
        return True
    from r2med_agent.llm.registry import get_llm_spec

    try:
        return get_llm_spec(llm).backend == "local"
    except Exception:  # noqa: BLE001 - an unknown entry is reported where the LLM is built
        return True


def natural(method: str, llm: str | None, generations: str, reranker: str | None) -> str:
    """The wording a run renders when ``--prompts`` is not given: :data:`AUTHORS` when one of its
    prompt folders has a pinned source and is read by an LLM other than a local smoke model, else
    :data:`OWN` (the offline first run stays offline)."""
    for folder, reader in renderers(method, llm, generations, reranker):
        if source_of_folder(folder) is not None and not _smoke(reader):
            return AUTHORS
    return OWN


def sources_of(method: str, llm: str | None, generations: str, reranker: str | None) -> list[PromptSource]:
    """The pinned sources of the prompt folders a run renders, each once, in folder order."""
    out: list[PromptSource] = []
    for folder, _ in renderers(method, llm, generations, reranker):
        src = source_of_folder(folder)
        if src is not None and src not in out:
            out.append(src)
    return out


def check_value(value: str | None) -> None:
    """``prompts_from`` must be None, ``authors``, ``own`` or sources joined by ``+``.

    Raises:
        ConfigError: anything else.
    """
    if value is None or value in CHOICES:
        return
    if not all(_VALUE.fullmatch(part) for part in str(value).split("+")):
        raise ConfigError(f"--prompts must be one of {', '.join(CHOICES)}, got {value!r}")


def resolve(value: str | None, method: str, llm: str | None, generations: str, reranker: str | None) -> str:
    """A spec's ``prompts_from``: ``own``, or the sources the run renders (``owner/repo@<12 hex>``
    joined by ``+``) for ``authors`` (None: :func:`natural`). A run that renders no folder with a
    source renders its own wording whatever was asked; a recorded list of sources stays as it is
    (it names results made at those commits)."""
    check_value(value)
    if value is None:
        value = natural(method, llm, generations, reranker)
    if value == OWN:
        return OWN
    used = sources_of(method, llm, generations, reranker)
    if not used:
        return OWN
    return "+".join(s.short for s in used) if value == AUTHORS else value


def label_token(value: str) -> str:
    """The result folder's token for a list of sources: ``authors-R2MED@62b70746`` (each
    repository's name and 8 hex of its commit)."""
    parts = []
    for part in value.split("+"):
        name, _, commit = part.split("/", 1)[-1].partition("@")
        parts.append(f"{name}@{commit[:8]}")
    return "authors-" + "-".join(parts)


# ----------------------------------------------------------------------------------------------
# Having them: the cache, fetching, a clone


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _verified(path: Path, want: str) -> bool:
    """Whether ``path`` is a regular file (not a link), no larger than a fetch may be, with the
    SHA-256 ``want``."""
    from r2med_agent.net import MAX_FETCH_BYTES

    try:
        if path.is_symlink() or path.stat().st_size > MAX_FETCH_BYTES:  # never read a large file whole
            return False
        return _sha256(path.read_bytes()) == want
    except OSError:
        return False


def at_hand(source: PromptSource) -> bool:
    """Whether every pinned file of ``source`` is in the cache with its pinned hash."""
    files = source.folder / "files"
    return all(_verified(files / rel, sha) for rel, sha in source.files.items())


def _download(url: str, source: PromptSource) -> bytes:
    """The bytes at ``url``, with retries and backoff for what may pass (no connection, a timeout,
    a server error); a missing file or a refused request is reported at once.

    Raises:
        PromptSourceError: it could not be had (one line: the URL, why, and how to do without).
    """
    import httpx

    from r2med_agent.net import MAX_FETCH_BYTES, DeadlineError, ReplyTooLarge, get_bytes, read_capped, transport_reason

    why = ""
    for attempt in range(FETCH_ATTEMPTS):
        if attempt:
            time.sleep(FETCH_BACKOFF_S * 2 ** (attempt - 1))
        try:
            if not url.startswith(("http://", "https://")):  # file://: a mirror folder
                with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:  # noqa: S310 - the user's folder
                    return read_capped(response, MAX_FETCH_BYTES, "the file")
            # the whole download within FETCH_TIMEOUT_S (not each read), at most MAX_FETCH_BYTES
            status, reason, data = get_bytes(url, timeout_s=FETCH_TIMEOUT_S, cap=MAX_FETCH_BYTES)
            if status == 200:
                return data
            why = f"HTTP {status} {reason}"
            if status == 404:
                why += f" (no such file at commit {source.commit}: a mirror at another commit?)"
                break
            if status < 500 and status != 429:
                break
        except ReplyTooLarge as e:
            why = str(e)
            break
        except (DeadlineError, httpx.HTTPError) as e:
            why = transport_reason(e)
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            why = str(reason) or type(e).__name__
            if isinstance(reason, FileNotFoundError) or url.startswith("file:"):
                why += f" (no such file at commit {source.commit}: a mirror at another commit?)"
                break
    raise PromptSourceError(redact(
        f"cannot fetch the authors' prompts of {source.repo} at commit {source.commit}: {url}: {why}. "
        f"Without network, import them from a clone: {source.offline_hint}; or fetch them from a mirror of the "
        f"pinned files: {BASE_URL_ENV}=URL (each file at URL/{source.repo}/{source.commit}/PATH); or run with "
        f"--prompts own (the project's wording)"
    ))


def fetch(source: PromptSource) -> list[str]:
    """Fetch the pinned files of ``source`` that the cache lacks; returns their paths.

    Every file is downloaded and checked against its pinned hash before any is written, so a
    failure leaves the cache as it was.

    Raises:
        PromptSourceError: a file could not be fetched, or its hash differs from the pinned one.
    """
    files = source.folder / "files"
    for rel in source.files:
        _drop_links(source.folder, f"files/{rel}")
    missing = [rel for rel, sha in source.files.items() if not _verified(files / rel, sha)]
    got: dict[str, bytes] = {}
    for rel in missing:
        url = source.url(rel)
        data = _download(url, source)
        digest = _sha256(data)
        if digest != source.files[rel]:
            raise PromptSourceError(
                f"{redact(url)}: SHA-256 {digest}, but {rel} of {source.repo} at commit {source.commit} has "
                f"{source.files[rel]}; this is not the authors' file at the pinned commit (a mirror at another "
                f"commit, or a changed file); nothing was written"
            )
        got[rel] = data
    for rel, data in got.items():
        _write_file(files / rel, data)
    if got:
        log.info("fetched the authors' prompts of %s (%s) into %s", source.short, ", ".join(got), files)
    return list(got)


def _drop_links(folder: Path, rel: str) -> None:
    """Remove the links on the way to ``folder / rel`` (its folders below ``folder``, and the file
    itself): the cache holds none of its own, and a write must never land outside it."""
    for part in [*reversed(Path(rel).parents[:-1]), Path(rel)]:
        if (folder / part).is_symlink():
            (folder / part).unlink()


def _write_file(path: Path, data: bytes) -> None:
    from r2med_agent.io import atomic_write_text

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError("not UTF-8 text", path) from None
    atomic_write_text(path, text)


def _templates(source: PromptSource) -> Path:
    """The templates folder of ``source``, imported from its verified files (made once per
    content: ``templates-<hash>``; one already there is checked against the import, and made
    again when it differs: :func:`~r2med_agent.prompts.cache.install`)."""
    from r2med_agent.prompts.cache import install
    from r2med_agent.prompts.importer import READERS

    imported = READERS[source.reader][1](source.folder / "files")
    imported.reference, imported.commit = source.repo, source.commit
    if set(imported.folders) != set(source.folders):
        raise ConfigError(f"{SOURCES_FILE}: {source.name}'s files give the prompt folders "
                          f"{', '.join(imported.folders)}, the entry says {', '.join(source.folders)}")
    h = hashlib.sha256()
    for rel, text in sorted(imported.templates.items()):
        h.update(f"{rel}\0{text}\0".encode())
    return install(imported, source.folder / f"templates-{h.hexdigest()[:12]}", source.short)


def ensure(source: PromptSource) -> Path:
    """The templates folder of ``source``, fetching its pinned files first when the cache lacks them.

    Raises:
        PromptSourceError: the files could not be fetched or are not the pinned ones.
    """
    fetch(source)
    return _templates(source)


def install_clone(clone: str | os.PathLike[str]) -> PromptSource:
    """Put the pinned files of the source a clone holds into the cache (``r2med-agent prompts
    import <clone>`` without ``--out``) and import them.

    Raises:
        ConfigError: the folder holds no pinned source's files.
        PromptSourceError: its git HEAD is another commit, or a file differs from the pinned one.
    """
    from r2med_agent.prompts.static_python import clone_commit

    root = Path(clone).expanduser()
    if not root.is_dir():
        raise ConfigError(f"'{root}' is not a folder (give the root of a clone of a reference repository)")
    found = [s for s in prompt_sources().values() if all((root / rel).is_file() for rel in s.files)]
    if not found:
        known = "; ".join(f"{s.repo}: {', '.join(s.files)}" for s in prompt_sources().values())
        raise ConfigError(f"'{root}' holds none of the pinned prompt files ({known})")
    source = found[0]
    head = clone_commit(root)
    if head is not None and head != source.commit:
        raise PromptSourceError(
            f"{root} is a clone of {source.repo} at commit {head}, but the prompts are pinned at {source.commit}: "
            f"git -C {root} checkout {source.commit}, then import again; nothing was written"
        )
    got: dict[str, bytes] = {}
    for rel, sha in source.files.items():
        data = (root / rel).read_bytes()
        if _sha256(data) != sha:
            raise PromptSourceError(
                f"{root / rel}: SHA-256 {_sha256(data)}, but the file of {source.repo} at commit {source.commit} "
                f"has {sha} (another commit, or a changed file); nothing was written"
            )
        got[rel] = data
    for rel, data in got.items():
        _drop_links(source.folder, f"files/{rel}")
        _write_file(source.folder / "files" / rel, data)
    _templates(source)
    return source


# ----------------------------------------------------------------------------------------------
# What a run renders


@dataclass(frozen=True)
class RunPrompts:
    """Where a run's prompts come from.

    Attributes:
        method_dir: the prompts folder the method renders from (an authors' templates folder, or
            the run's ``prompts_dir`` for its own wording; None: ``$R2MED_PROMPTS_DIR`` or the package).
        reranker_dir: the same for the LLM reranker.
        sources: the authors' sources in use.
        own_folders: the prompt folders rendered in the project's wording.
    """

    method_dir: Path | None = None
    reranker_dir: Path | None = None
    sources: tuple[PromptSource, ...] = ()
    own_folders: tuple[str, ...] = ()

    def record(self) -> list[dict[str, Any]]:
        """Per source: reference, full commit, the folders it gives, and every file with its hash."""
        return [{"reference": s.repo, "commit": s.commit, "folders": list(s.folders), "pinned": True,
                 "files": dict(s.files)} for s in self.sources]


def split_folders(spec: Any) -> list[tuple[str, str | None, PromptSource | None]]:
    """The prompt folders a spec renders, each with the LLM that reads it and its authors'
    source (None: rendered in the project's wording)."""
    authors = spec.prompts_from not in (OWN, None)
    return [(folder, reader, source_of_folder(folder) if authors else None)
            for folder, reader in renderers(spec.method, spec.llm, spec.generations, spec.reranker)]


def run_prompts(spec: Any, own_dir: Path | None = None,
                folders: Sequence[tuple[str, str | None, str | None]] | None = None) -> RunPrompts:
    """Have every authors' source the run renders (fetching what the cache lacks) and say where
    its method and reranker read their templates. Called before any work.
    ``folders``: the run plan's ``prompt_folders`` (checked when it was made); None: from ``spec``'s names.

    Raises:
        PromptSourceError: a source could not be had (nothing of the run has started).
        ConfigError: the spec names sources of another version (other commits).
    """
    if folders is not None:
        return _fetch(spec, own_dir, plan_folders(folders))
    split = split_folders(spec)
    current = resolve(AUTHORS, spec.method, spec.llm, spec.generations, spec.reranker)
    if any(s is not None for _, _, s in split) and spec.prompts_from != current:
        raise ConfigError(
            f"prompts_from {spec.prompts_from} names results made with the authors' prompts at other commits; "
            f"this version pins {current}"
        )
    return _fetch(spec, own_dir, split)


def plan_folders(folders: Sequence[tuple[str, str | None, str | None]]) -> list[tuple[str, str | None, Any]]:
    """A run plan's ``prompt_folders`` with each authors' source as its :class:`PromptSource`."""
    return [(f, r, source_of_folder(f) if s else None) for f, r, s in folders]


def _fetch(spec: Any, own_dir: Path | None, folders: list[tuple[str, str | None, PromptSource | None]]) -> RunPrompts:
    """Fetch what ``folders`` render of the authors' and say where the method (its name's folder) and reranker read."""
    wanted = [s for _, _, s in folders if s is not None]
    dirs = {s.name: ensure(s) for s in dict.fromkeys(wanted)}
    method_dir = reranker_dir = own_dir
    for folder, _, src in folders:
        if src is None:
            continue
        if folder == spec.method:
            method_dir = dirs[src.name]
        else:
            reranker_dir = dirs[src.name]
    own = tuple(f for f, _, s in folders if s is None)
    return RunPrompts(method_dir, reranker_dir, tuple(dict.fromkeys(wanted)), own)


def describe(plan: Any, prompts_dir: Any = None) -> str:
    """One phrase for ``reproduce --dry-run``: whose prompts a row renders (its ``plan``'s ``prompt_folders``),
    with each authors' source, its files and whether they are at hand ("" when the row renders none)."""
    from r2med_agent.prompts.importer import describe as describe_own

    folders = plan_folders(plan.prompt_folders)
    if not folders:
        return ""
    parts = []
    for src in dict.fromkeys(s for _, _, s in folders if s is not None):
        where = ("at hand" if at_hand(src) else
                 f"not at hand: fetched on first use from {redact(base_url())} (without network: r2med-agent prompts import "
                 f"<a clone of {src.repo} at {src.commit[:12]}>)")
        parts.append(f"the authors', {src.short} ({', '.join(src.files)}): {where}")
    own = [f for f, _, s in folders if s is None]
    if own:
        phrase = describe_own(own, prompts_dir)
        parts.append(f"{', '.join(own)}: {phrase}" if parts else phrase)
    return "; ".join(parts)


def listing() -> list[list[str]]:
    """``r2med-agent prompts sources``: one row per source."""
    return [[s.name, s.short, ", ".join(s.folders), "yes" if at_hand(s) else "no", s.about]
            for s in prompt_sources().values()]


def sources_named(names: Sequence[str]) -> list[PromptSource]:
    """The sources ``names`` (keys or ``owner/repo``; all when empty).

    Raises:
        ConfigError: an unknown name.
    """
    every = prompt_sources()
    if not names:
        return list(every.values())
    out = []
    for name in names:
        found = every.get(name) or next((s for s in every.values() if s.repo.lower() == name.lower()), None)
        if found is None:
            raise ConfigError(f"unknown prompt source '{name}'; known: {', '.join(every)}")
        out.append(found)
    return out


NO_TASK_PROMPT = "the_reference_has_no_prompt_for_this_task"
"""What an imported per-task template renders for a task its reference has no prompt for
(:func:`~r2med_agent.prompts.importer.read_r2med`)."""


def check_tasks(run: RunPrompts, method: str, tasks: Sequence[Any]) -> None:
    """Refuse, before the LLM starts, a task the authors' per-task prompts of the method do not
    cover (R2MED's prompts name its 8 tasks; a task of your own has none).

    Raises:
        ConfigError: naming the task, the source and ``--prompts own``.
    """
    from r2med_agent.prompts import templates as prompts
    from r2med_agent.data import base_task_name

    src = next((s for s in run.sources if method in s.folders), None)
    if src is None or run.method_dir is None:
        return
    for task in tasks:
        try:
            base = base_task_name(task.name)
        except ConfigError:
            base = task.name
        variables = {"query": "", "domain": task.domain, "family": task.family, "task": base, "documents": [],
                     "examples": [], "qwq": False, "max_searches": 10}
        try:
            prompts.render(f"{method}/{task.family}.j2", prompts_dir=run.method_dir, **variables)
        except ConfigError as e:
            if NO_TASK_PROMPT in str(e):
                raise ConfigError(f"task {task.name}: the authors' prompts of {src.short} have no {method} prompt for "
                                  f"it (they are written per R2MED task); run it with --prompts own") from None
