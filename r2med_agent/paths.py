"""Where the package's own files are, and where it keeps caches."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path


def package_dir(name: str) -> Path:
    """The folder of ``r2med_agent.<name>`` (``prompts``, ``configs``, ``resources``), inside the
    package that is imported: a checkout, an editable install and a wheel all read their own."""
    return Path(str(resources.files(f"r2med_agent.{name}")))


def prompts_dir() -> Path:
    return package_dir("prompts")


def configs_dir() -> Path:
    return package_dir("configs")


def resources_dir() -> Path:
    return package_dir("resources")


def cache_dir() -> Path:
    """Root of on-disk caches (indexes, embeddings, hub downloads, generations).

    ``R2MED_CACHE_DIR`` overrides it; the default is ``~/.cache/r2med-agent``.
    """
    env = os.environ.get("R2MED_CACHE_DIR")
    root = Path(env) if env else Path.home() / ".cache" / "r2med-agent"
    return root.expanduser()
