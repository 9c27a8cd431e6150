"""The conformance suite: the project's behaviour against the authors' own code.

The authors' repositories are read from pinned copies, one folder each, named
``<owner>+<repo>@<commit>`` (for example ``ielab+llm-rankers@b36517bf17a3``), under the folder that
``R2MED_REFERENCE_CODE`` names; without that variable, ``../shared/reference-code`` beside the
repository is used when it exists. Nothing of the authors' code is copied into the project: these
tests import or parse it from there at test time, stub heavy imports (vLLM, torch.distributed, ...)
only where a module cannot be imported without them, and compare its outputs with the project's on
fixed inputs. Without the copies, every test here skips with the reason.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ENV_VAR = "R2MED_REFERENCE_CODE"
_REPO_ROOT = Path(__file__).resolve().parents[2]


def reference_root() -> Path | None:
    """The folder that holds the pinned copies, or None when there is none."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    default = _REPO_ROOT.parent / "shared" / "reference-code"
    return default if default.is_dir() else None


def reference_repo(owner_repo: str) -> Path:
    """The pinned copy of ``owner/repo`` (``owner+repo@<commit>``) directly under the copies'
    folder (never one under :data:`OLDER`); skips the test without it."""
    root = reference_root()
    if root is None:
        pytest.skip(f"no copies of the authors' code: set {ENV_VAR} to the folder of <owner>+<repo>@<commit> copies")
    if not root.is_dir():
        pytest.skip(f"{ENV_VAR}={root} is not a folder")
    prefix = owner_repo.replace("/", "+") + "@"
    found = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(prefix))
    if not found:
        pytest.skip(f"no copy of {owner_repo} under {ENV_VAR} ({prefix}<commit>)")
    return found[-1]


OLDER = "older"
"""The folder, under the copies' folder, of copies at earlier commits than the newest
(``older/AQ-MedAI+Diver@d067dff107fc``): :func:`reference_repo` never looks there, so the copy
it takes by prefix is always the newest; :func:`older_reference_repo` names one by its commit."""


def older_reference_repo(owner_repo: str, commit: str) -> Path:
    """The pinned copy of ``owner/repo`` at ``commit`` (12 hex) under :data:`OLDER`, named
    explicitly; skips the test without it."""
    root = reference_root()
    if root is None:
        pytest.skip(f"no copies of the authors' code: set {ENV_VAR} to the folder of <owner>+<repo>@<commit> copies")
    folder = root / OLDER / f"{owner_repo.replace('/', '+')}@{commit}"
    if not folder.is_dir():
        pytest.skip(f"no copy of {owner_repo} at {commit} under {ENV_VAR}/{OLDER}")
    return folder


def reference_commit(folder: Path) -> str:
    """The commit a copy's folder name pins (the part after ``@``)."""
    return folder.name.rsplit("@", 1)[1]


class _Anything(types.ModuleType):
    """A stub module: every attribute is a further stub, callable and subclassable, so that
    ``from vllm import LLM, SamplingParams`` and class statements over them import."""

    def __getattr__(self, name: str):  # noqa: D105
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: None})
        setattr(self, name, value)
        return value


def stub(name: str, **attrs) -> types.ModuleType:
    """A module named ``name`` whose missing attributes are stubs; ``attrs`` set real ones."""
    module = _Anything(name)
    module.__path__ = []  # a package, so that ``import name.sub`` finds stubs too
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


@contextlib.contextmanager
def _patched_modules(stubs: Mapping[str, types.ModuleType], paths: list[Path]) -> Iterator[None]:
    saved = {name: sys.modules.get(name) for name in stubs}
    saved_path = list(sys.path)
    try:
        for name, module in stubs.items():
            sys.modules[name] = module
        sys.path[:0] = [str(p) for p in paths]
        yield
    finally:
        sys.path[:] = saved_path
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def load_reference_module(folder: Path, rel: str, *, stubs: Mapping[str, types.ModuleType] | None = None,
                          search: list[Path] | None = None) -> types.ModuleType:
    """Import the authors' file ``folder/rel`` under a private name and return the module.

    ``stubs`` stand in for modules that cannot be imported here, only while the file imports;
    ``search`` adds folders (default: the file's own folder and the copy's root) to ``sys.path``
    for its own imports of sibling files. The authors' sibling modules it imports are dropped from
    ``sys.modules`` again afterwards so that two copies never see each other's.
    """
    path = folder / rel
    if not path.is_file():
        pytest.fail(f"the pinned copy {folder.name} has no {rel}")
    name = f"_reference_{folder.name.split('@')[0].replace('+', '_').replace('-', '_')}_{Path(rel).stem}"
    before = set(sys.modules)
    with _patched_modules(dict(stubs or {}), search if search is not None else [path.parent, folder]):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        finally:
            sys.modules.pop(name, None)
    for added in set(sys.modules) - before:  # the authors' own sibling modules, not third-party packages
        mod_file = getattr(sys.modules.get(added), "__file__", None) or ""
        if mod_file and Path(mod_file).resolve().is_relative_to(folder.resolve()):
            sys.modules.pop(added, None)
    return module


def run_reference_script(folder: Path, rel: str, argv: list[str], *, cwd: Path,
                         stubs: Mapping[str, types.ModuleType] | None = None) -> dict:
    """Run the authors' script ``folder/rel`` as ``__main__`` (``python rel *argv``) in this
    process, from ``cwd``, with ``stubs`` standing in for modules that cannot be imported here;
    return its globals. Its own sibling modules are dropped from ``sys.modules`` afterwards, as
    :func:`load_reference_module` drops them."""
    import runpy

    path = folder / rel
    if not path.is_file():
        pytest.fail(f"the pinned copy {folder.name} has no {rel}")
    before = set(sys.modules)
    saved_argv, saved_cwd = list(sys.argv), os.getcwd()
    try:
        with _patched_modules(dict(stubs or {}), [path.parent, folder]):
            sys.argv = [str(path), *argv]
            os.chdir(cwd)
            return runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        for added in set(sys.modules) - before:
            mod_file = getattr(sys.modules.get(added), "__file__", None) or ""
            if mod_file and Path(mod_file).resolve().is_relative_to(folder.resolve()):
                sys.modules.pop(added, None)


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/conformance/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.conformance)
