"""The templates folders of the prompt cache (``<cache>/reference-prompts/<source>/templates-<hash>``):
what a run renders, so never trusted as found.

A folder is derived from its source's pinned files (each checked against its SHA-256 before use)
by the importer. The folder name holds a hash of the derived text, but a file in it can still be
edited, appended to or replaced by a link after it was written; :func:`install` compares the folder
with the text just derived from the files, byte for byte, every time a run asks for it, and makes
it again when anything differs."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["differs", "install"]

log = logging.getLogger(__name__)


def install(imported: Any, target: Path, source: str) -> Path:
    """``target``, holding exactly the templates of ``imported`` (an
    :class:`~r2med_agent.prompts.importer.ImportedPrompts` of the pinned source named ``source``).

    A folder already there that matches is kept. One that differs (a template edited, a line
    appended, a file replaced by a link, a template added) is made again in its place, with a
    warning naming what differed; a new one is written to a temporary folder and renamed into
    place."""
    if target.is_dir() and not target.is_symlink():
        changed = differs(target, imported.templates)
        if changed is None:
            return target
        log.warning("%s is not what the pinned files of %s give (%s); importing them again", target, source,
                    changed)
    _write(imported, target)
    return target


def differs(folder: Path, templates: Mapping[str, str]) -> str | None:
    """What in ``folder`` differs from ``templates`` (relative path -> text); None when nothing.

    A template missing, changed, a link or not a regular file, and any file the import did not
    write (the template loader would find it) count; the import's record is not rendered and may
    differ."""
    from r2med_agent.prompts.importer import RECORD

    for rel, text in templates.items():
        path = folder / rel
        if path.is_symlink() or not path.is_file():
            return f"{rel} is {'a link' if path.is_symlink() else 'missing or not a file'}"
        try:
            if path.read_bytes() != text.encode("utf-8"):
                return f"{rel} was changed"
        except OSError as e:
            return f"{rel} cannot be read ({e.strerror})"
    for path in folder.rglob("*"):
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink():
            return f"{rel} is a link"
        if rel not in templates and rel != RECORD and not path.is_dir():
            return f"{rel} is not one of the imported templates"
    return None


def _write(imported: Any, target: Path) -> None:
    """Write ``imported`` into a temporary folder beside ``target`` and rename it into place; a
    ``target`` already there is renamed aside first and removed after."""
    from r2med_agent.io import remove_stale_temps, temp_prefix
    from r2med_agent.prompts.importer import write_prompts

    folder = target.parent
    remove_stale_temps(folder)
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix=temp_prefix(target), suffix=".tmp"))
    aside = None
    try:
        write_prompts(imported, tmp)
        if os.path.lexists(target):
            aside = Path(tempfile.mkdtemp(dir=folder, prefix=temp_prefix(target), suffix=".tmp"))
            os.rename(target, aside / "old")
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():  # not another process that made it first
            raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
