"""``prompts import``: the reference repositories' exact prompts, read from the user's clone.

The shipped templates are this project's own wording. A user who has a clone of a reference
repository turns its prompts into a prompts folder of the same layout::

    r2med-agent prompts import path/to/R2MED --out ref-prompts
    export R2MED_PROMPTS_DIR=ref-prompts

The clone's Python files are parsed with :mod:`ast`; nothing in them is imported or run. Each
recognised repository gives the templates of the methods it defines (see :data:`READERS`); every
template renders, through the project's template variables, the text the reference's own code
builds for the same question and documents, byte for byte: its first line is
:data:`~r2med_agent.prompts.templates.EXACT_MARK`, which tells the methods to keep the rendered
text's trailing whitespace (the shipped templates have it dropped). What the reference builds
around the prompt (the documents' own layout, the chat template) stays the project's.

The folder also gets :data:`RECORD` (JSON): per import, the reference, the clone's commit when it
has a ``.git``, and the prompt folders it wrote. A run records it beside its configuration
(:func:`imported_prompts`); the run's identity already holds the folder's hash (``prompts``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from r2med_agent.errors import ConfigError
from r2med_agent.prompts.readers import BRIGHT_FILES, BRIGHT_REPO, READERS, ImportedPrompts, read_bright, read_grouprank, read_r2med, read_rank1, read_rank_r1, read_reasonrank, read_search_o1, read_search_r1
from r2med_agent.prompts.templates import ENV_VAR

__all__ = ["BRIGHT_FILES", "BRIGHT_REPO", "READERS", "RECORD", "ImportedPrompts", "describe", "import_clone",
           "imported_prompts", "read_bright", "read_grouprank", "read_r2med", "read_rank1", "read_rank_r1",
           "read_reasonrank", "read_search_o1", "read_search_r1", "run_prompt_folders", "write_prompts"]
"""The import's names; the readers of each reference are in :mod:`~r2med_agent.prompts.readers`,
the static reading of a clone's Python in :mod:`~r2med_agent.prompts.static_python`."""

RECORD = ".r2med-import.json"
"""The file in an imported prompts folder that says where its templates came from."""


def import_clone(clone: str | Path) -> ImportedPrompts:
    """Recognise the clone's repository by its files and read its prompts (never running them).

    Raises:
        ConfigError: not a folder, or no recognised repository layout.
        DataError: a recognised file that is not in the reference's shape (file and line).
    """
    clone = Path(clone).expanduser()
    if not clone.is_dir():
        raise ConfigError(f"'{clone}' is not a folder (give the root of a clone of a reference repository)")
    for _name, (marks, reader) in READERS.items():
        if any((clone / m).is_file() for m in marks):
            return reader(clone)
    known = "; ".join(f"{n}: {' or '.join(m)}" for n, (m, _) in READERS.items())
    raise ConfigError(f"'{clone}' is not a clone of a known reference (looked for {known})")


def write_prompts(imported: ImportedPrompts, out_dir: str | Path, *, force: bool = False) -> list[Path]:
    """Write the templates under ``out_dir`` and add the import to its :data:`RECORD`.

    Raises:
        ConfigError: a template file exists there and ``force`` is False.
    """
    from r2med_agent.io import atomic_write_text

    out_dir = Path(out_dir)
    existing = [str(out_dir / rel) for rel in imported.templates if (out_dir / rel).exists()]
    if existing and not force:
        raise ConfigError(f"{', '.join(existing[:3])}{' ...' if len(existing) > 3 else ''} already exist; "
                          "pass --force to replace them")
    written = [atomic_write_text(out_dir / rel, text) for rel, text in sorted(imported.templates.items())]
    record = read_record(out_dir)
    entries = [e for e in record if e.get("reference") != imported.reference]
    entries.append({"reference": imported.reference, "commit": imported.commit, "folders": imported.folders,
                    "files": dict(sorted(imported.origins.items()))})
    written.append(atomic_write_text(out_dir / RECORD, json.dumps({"imports": entries}, indent=2) + "\n"))
    return written


def read_record(folder: Path) -> list[dict[str, Any]]:
    """The imports listed in ``folder``'s :data:`RECORD` ([] without one or when unreadable)."""
    try:
        doc = json.loads((folder / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    imports = doc.get("imports") if isinstance(doc, dict) else None
    return [e for e in imports if isinstance(e, dict)] if isinstance(imports, list) else []


def imported_prompts(folders: Iterable[str], prompts_dir: Any = None) -> list[dict[str, Any]]:
    """The imports behind the prompt folders a run renders (``hyde``, ``rerank-groupwise`` ...):
    ``{reference, commit, folders}`` of each import in the overriding folder (``prompts_dir``,
    else ``$R2MED_PROMPTS_DIR``) that wrote one of them; [] when the prompts are the project's."""
    from r2med_agent.prompts.templates import search_path

    paths = search_path(prompts_dir)
    if len(paths) < 2:
        return []
    wanted = set(folders)
    out = []
    for entry in read_record(paths[0]):
        used = sorted(wanted & set(entry.get("folders", [])))
        if used:
            out.append({"reference": entry.get("reference"), "commit": entry.get("commit"), "folders": used})
    return out


def run_prompt_folders(method: str, generations: str, reranker: str) -> list[str]:
    """The prompt folders a run renders: its method's when it generates fresh, its reranker's
    (the prompt folder its kind declares: ``rerank-listwise-reasonrank`` ...); an unknown reranker
    adds none."""
    folders = [method] if generations == "fresh" and _generates(method) else []
    if reranker:
        from r2med_agent.rerank.spec import get_reranker_spec

        try:
            folder = get_reranker_spec(reranker).prompt_folder
        except ConfigError:
            return folders
        if folder is not None:
            folders.append(folder)
    return folders


def _generates(method: str) -> bool:
    """Whether ``method`` renders prompts: a registered method that declares ``uses_llm``; its
    registry name is its prompt folder (an unknown name renders none)."""
    from r2med_agent.methods import METHODS

    return bool(getattr(METHODS.get(method), "uses_llm", False))


def describe(folders: Sequence[str], prompts_dir: Any = None) -> str:
    """One phrase for ``reproduce --dry-run``: whose prompts a run rendering ``folders`` uses:
    the reference's (imported), the user's own files, or the project's own."""
    from r2med_agent.prompts.templates import search_path

    imports = imported_prompts(folders, prompts_dir)
    if imports:
        refs = ", ".join(f"{e['reference']}" + (f"@{str(e['commit'])[:12]}" if e.get("commit") else "")
                         for e in imports)
        return f"the reference's, imported from {refs}"
    paths = search_path(prompts_dir)
    if len(paths) > 1 and any((paths[0] / f).is_dir() for f in folders):
        return f"your own files in {paths[0]} (${ENV_VAR}) over the project's own"
    return "the project's own"
