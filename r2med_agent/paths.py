"""Where the package's own files are, and where it keeps caches.

The templates (``prompts/``) and the registries (``configs/``) are one copy each, at the top of
the repository beside ``r2med_agent/``; a wheel carries them as the package's data folder
``r2med_agent/_data/`` (pyproject's ``package-dir`` maps them there). :func:`data_dir` finds
them: a checkout (an editable install, or one used through ``PYTHONPATH``) reads the folders next
to the ``r2med_agent/`` that is imported, never another checkout's; an installed wheel reads its
packaged copy. ``resources/`` stays inside the package.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

DATA_FOLDERS = ("prompts", "configs")
"""The top-level folders a wheel carries under ``r2med_agent/_data/``."""

# What marks the imported r2med_agent/ as a checkout's (a wheel has no pyproject.toml beside it).
_CHECKOUT_MARK = "pyproject.toml"


def package_dir(name: str) -> Path:
    """The folder of ``r2med_agent.<name>`` (``resources``), inside the package that is imported:
    a checkout, an editable install and a wheel all read their own. ``prompts`` and ``configs``
    are :func:`data_dir`'s."""
    if name in DATA_FOLDERS:
        return data_dir(name)
    return Path(str(resources.files(f"r2med_agent.{name}")))


def data_dir(name: str) -> Path:
    """``prompts/`` or ``configs/`` of the imported package: beside it in a checkout, the packaged
    ``r2med_agent/_data/<name>`` in a wheel."""
    if name not in DATA_FOLDERS:
        raise ValueError(f"no data folder {name!r} (one of {', '.join(DATA_FOLDERS)})")
    package = Path(str(resources.files("r2med_agent")))
    checkout = package.parent
    if (checkout / _CHECKOUT_MARK).is_file() and (checkout / name).is_dir():
        return checkout / name
    return package / "_data" / name


def prompts_dir() -> Path:
    return data_dir("prompts")


def configs_dir() -> Path:
    return data_dir("configs")


def resources_dir() -> Path:
    return package_dir("resources")


def cache_dir() -> Path:
    """Root of on-disk caches (indexes, embeddings, hub downloads, generations).

    ``R2MED_CACHE_DIR`` overrides it; the default is ``~/.cache/r2med-agent``.
    """
    env = os.environ.get("R2MED_CACHE_DIR")
    root = Path(env) if env else Path.home() / ".cache" / "r2med-agent"
    return root.expanduser()
