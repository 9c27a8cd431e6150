"""Getting a Hugging Face model: ``resource:`` paths, the fingerprint that keys caches, the
transformers version an entry needs, and ``from_pretrained`` with load failures as a
:class:`~r2med_agent.errors.ConfigError` that says the way out.

transformers is imported inside functions (:class:`~r2med_agent.errors.MissingExtraError` when
missing).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from r2med_agent.errors import ConfigError, MissingExtraError
from r2med_agent.retrieval.dense.spec import _specifier
from r2med_agent.retrieval.dense.torch_utils import GPU_ALTERNATIVE


def resolve_model_path(model: str) -> str:
    """Map ``resource:<package>/<folder>`` to the installed folder; other ids pass through."""
    if not model.startswith("resource:"):
        return model
    rest = model[len("resource:") :]
    package, _, sub = rest.partition("/")
    try:
        root = resources.files(package)
    except ModuleNotFoundError:
        raise MissingExtraError(package.replace("_", "-"), "cpu", GPU_ALTERNATIVE) from None
    path = Path(str(root / sub)) if sub else Path(str(root))
    if not (path / "config.json").exists():
        raise ConfigError(f"model '{model}': no config.json under {path}; reinstall the package")
    return str(path)


def model_fingerprint(model: str) -> str:
    """A stable description of a model for cache keys: the id, plus for local folders (and
    packaged models) the names and sizes of its files, so replaced weights invalidate caches.
    Machine paths never enter the key."""
    if model.startswith("resource:") or Path(model).is_dir():
        try:
            path = Path(resolve_model_path(model))
        except (ConfigError, MissingExtraError):
            return model
        files = sorted(
            (p.name, p.stat().st_size) for p in path.iterdir() if p.is_file() and p.name != "README.md"
        )
        label = model if model.startswith("resource:") else path.name
        return f"{label}|{json.dumps(files)}"
    return model


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise MissingExtraError("transformers", "cpu", GPU_ALTERNATIVE) from None
    return transformers


def check_transformers_version(
    name: str, model: str, requirement: str, installed: str | None = None
) -> None:
    """Raise a ConfigError when the installed transformers does not satisfy ``requirement``.

    Args:
        name: the registry entry (for the message).
        model: the model id (for the message).
        requirement: a PEP 440 specifier (``==4.42.4``); empty means any version.
        installed: the version to check (default: the installed transformers).
    """
    if not requirement:
        return
    from packaging.version import InvalidVersion, Version

    if installed is None:
        installed = str(_import_transformers().__version__)
    try:
        ok = _specifier(requirement).contains(Version(installed), prereleases=True)
    except InvalidVersion:
        ok = False
    if not ok:
        raise ConfigError(
            f"'{name}' ({model}) needs transformers{requirement}: the model's own code does not run "
            f"on other releases, and transformers {installed} is installed. Install it, best in a "
            f"separate environment: pip install 'transformers{requirement}'"
        )


_LOAD_ERRORS = (OSError, ValueError, ImportError)
"""What ``from_pretrained`` raises for a model it cannot get: OSError (not in the cache and no hub
access, a wrong id or folder), ValueError (not a model folder it knows), ImportError (a package the
model's own code needs)."""


def model_load_error(kind: str, name: str, model: str, err: BaseException) -> ConfigError:
    """The ConfigError for a registry entry whose model cannot be loaded: what failed and the two
    ways out (hub access once, or a local copy through a user config entry)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    detail = f"{type(err).__name__}: {lines[0].rstrip('.')}" if lines else type(err).__name__
    section = f"{kind}s"
    return ConfigError(
        f"cannot load {kind} '{name}' ({model}): {detail}. Either let it download once from the "
        f"Hugging Face hub (network access, HF_HUB_OFFLINE unset; later runs use the cached copy), "
        f"or use a local copy: copy the '{name}' entry of configs/{section}.yaml under '{section}:' "
        f"in a user config file, set its model to the folder, and pass --config FILE"
    )


def load_pretrained(loader: Any, path: str, *, kind: str, name: str, model: str, **kwargs: Any) -> Any:
    """``loader(path, **kwargs)`` (a ``from_pretrained``) with load failures as a ConfigError.

    A hub id (not a local folder) is loaded from the hub cache only when the hub cannot be
    reached (checked once per process), so a model that is not downloaded fails in seconds
    instead of after huggingface_hub's retries."""
    unreachable = None
    if isinstance(path, str) and not Path(path).exists() and "local_files_only" not in kwargs:
        from r2med_agent.data.hub import hub_unreachable

        unreachable = hub_unreachable()
        if unreachable is not None:
            kwargs["local_files_only"] = True
    try:
        return loader(path, **kwargs)
    except _LOAD_ERRORS as e:
        err = model_load_error(kind, name, model, e)
        if unreachable is not None:
            err = ConfigError(f"{err} (the hub is unreachable: {unreachable})")
        raise err from e


def dtype_kwarg(dtype: Any) -> dict[str, Any]:
    """``from_pretrained``'s dtype argument under its name for the installed transformers:
    ``dtype`` since 4.56, ``torch_dtype`` before (NV-Embed-v2 needs 4.42.4)."""
    from packaging.version import Version

    version = Version(str(_import_transformers().__version__))
    return {"dtype": dtype} if version >= Version("4.56.0.dev0") else {"torch_dtype": dtype}
