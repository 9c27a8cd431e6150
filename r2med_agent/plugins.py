"""Components from the user's own package: one registry type for every kind of component, and
the plugins that fill them.

Five groups of components are registered the same way, ``register(group, name, entry)``:

============== ============================================================ ==========================
group          entry                                                        registry
============== ============================================================ ==========================
``methods``    a method class (:class:`~r2med_agent.methods.ExpansionMethod`) ``methods.METHODS``
``retrievers`` a :class:`~r2med_agent.retrieval.registry.RetrieverKind`      ``RETRIEVER_KINDS``
``rerankers``  a :class:`~r2med_agent.rerank.kinds.RerankerKind`             ``RERANKER_KINDS``
``encoders``   a function of no arguments returning an encoder               ``ENCODERS``
               (:class:`~r2med_agent.retrieval.dense.spec.Encoder`)
``llm-backends`` a backend class, or its ``"module:Class"`` path, built with ``BACKENDS``
               the :class:`~r2med_agent.llm.registry.LLMSpec`
============== ============================================================ ==========================

Each entry declares its capabilities itself (a method's class attributes, a kind's fields); the
code that needs one reads the declaration, never the name.

Plugins are found by the standard Python mechanism: every entry point of the group
``r2med_agent.plugins`` (:data:`ENTRY_POINT_GROUP`) names a module (importing it registers its
components) or a function of no arguments (called once). The modules named by ``--plugin MODULE``
(the CLI's global option) and by ``$R2MED_PLUGINS`` (comma-separated) load the same way. All load
once per process, lazily, when a registry is first read (:func:`load_plugins`).

A name that is taken is refused: a built-in name always, and a name another plugin (or an earlier
call) registered unless ``replace=True`` (the Python API's re-runs in a notebook). So no plugin can
change what a built-in name means, and two plugins that want one name fail loudly instead of one
silently winning by load order.
"""

from __future__ import annotations

import importlib
import os
import types
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from importlib import metadata
from typing import Any, TypeVar

from r2med_agent.errors import ConfigError

__all__ = [
    "ENTRY_POINT_GROUP", "GROUPS", "PLUGIN_ENV", "PluginError", "Registry", "add_plugin_modules", "load_plugins",
    "register", "registry",
]

T = TypeVar("T")

ENTRY_POINT_GROUP = "r2med_agent.plugins"
"""The entry point group a distribution lists its plugins under (``[project.entry-points."r2med_agent.plugins"]``)."""

PLUGIN_ENV = "R2MED_PLUGINS"
"""Environment variable: modules to load as plugins, comma-separated (as ``--plugin`` does)."""

GROUPS: dict[str, str] = {
    "methods": "r2med_agent.methods:METHODS",
    "retrievers": "r2med_agent.retrieval.registry:RETRIEVER_KINDS",
    "rerankers": "r2med_agent.rerank.kinds:RERANKER_KINDS",
    "encoders": "r2med_agent.retrieval.registry:ENCODERS",
    "llm-backends": "r2med_agent.llm.registry:BACKENDS",
}
"""Group -> the registry that holds it (``module:attribute``, imported when first asked for)."""

BUILT_IN = "built in"


class PluginError(ConfigError):
    """A plugin that cannot be loaded, or that registers a name that is taken."""


class Registry(MutableMapping[str, T]):
    """Name -> entry of one group of components (a mapping; reading it loads the plugins first).

    ``registry[name] = entry`` and ``del registry[name]`` change it without checks (tests);
    :meth:`register` is the checked way in.
    """

    def __init__(self, group: str, entries: Iterable[tuple[str, T]] = (),
                 prepare: Callable[[Registry[T], str, T], T] | None = None) -> None:
        self.group = group
        self._entries: dict[str, T] = dict(entries)
        self._origins: dict[str, str] = dict.fromkeys(self._entries, BUILT_IN)
        self._prepare = prepare

    def __getitem__(self, name: str) -> T:
        load_plugins()
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        load_plugins()
        return iter(list(self._entries))

    def __len__(self) -> int:
        load_plugins()
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        load_plugins()
        return name in self._entries

    def __setitem__(self, name: str, entry: T) -> None:
        self._entries[name] = entry
        self._origins.setdefault(name, "Python")

    def __delitem__(self, name: str) -> None:
        del self._entries[name]
        self._origins.pop(name, None)

    def __repr__(self) -> str:
        return f"Registry({self.group!r}, {list(self._entries)!r})"

    def registered(self) -> dict[str, T]:
        """The entries registered so far, without loading the plugins (for checks made while
        one registers)."""
        return dict(self._entries)

    def origin(self, name: str) -> str | None:
        """Who registered ``name``: ``built in``, ``plugin M (distribution D)``, ``Python``; None: nobody."""
        return self._origins.get(name)

    def register(self, name: str, entry: T, *, replace: bool = False) -> None:
        """Add ``entry`` under ``name``.

        Raises:
            PluginError: ``name`` is built in, or taken and ``replace`` is false; or the entry
                is refused by the group's own checks.
        """
        if not isinstance(name, str) or not name.strip():
            raise PluginError(f"{_who()}: a {self.group} name must be a non-empty string, got {name!r}")
        taken = self._origins.get(name) if name in self._entries else None
        if taken == BUILT_IN or (taken is not None and not replace):
            raise PluginError(f"{_who()}: {self.group} name '{name}' is taken by the registry ({taken}); choose another name")
        if self._prepare is not None:
            entry = self._prepare(self, name, entry)
        self._entries[name] = entry
        self._origins[name] = _who()


def registry(group: str) -> Registry[Any]:
    """The registry of ``group`` (:data:`GROUPS`).

    Raises:
        ConfigError: an unknown group (the message lists them).
    """
    path = GROUPS.get(group)
    if path is None:
        raise ConfigError(f"unknown component group '{group}'; allowed: {', '.join(GROUPS)}")
    module, _, attribute = path.partition(":")
    found: Registry[Any] = getattr(importlib.import_module(module), attribute)
    return found


def register(group: str, name: str, entry: Any, *, replace: bool = False) -> None:
    """Register a component: ``register("rerankers", "mine", RerankerKind(build=...))``.

    Args:
        group: ``methods``, ``retrievers``, ``rerankers``, ``encoders`` or ``llm-backends``.
        name: the name runs use (``--method``, a ``--retriever`` word, a reranker entry's
            ``kind``, an encoder as a ``--retriever`` word, an LLM entry's ``backend``).
        entry: what the group holds (the module docstring).
        replace: replace an earlier registration of ``name`` (never a built-in one).

    Raises:
        PluginError: the name is taken or the entry is refused.
    """
    registry(group).register(name, entry, replace=replace)


# --------------------------------------------------------------------------- discovery

_state: dict[str, Any] = {"loaded": False, "error": None, "current": None}


def add_plugin_modules(modules: Iterable[str]) -> None:
    """Load these modules as plugins too (``--plugin``): they join ``$R2MED_PLUGINS``, so the
    processes this one starts load them as well; loaded now when the plugins already are."""
    given = _env_modules()
    names = [m.strip() for m in modules if m.strip() and m.strip() not in given]
    if names:
        os.environ[PLUGIN_ENV] = ",".join([*given, *names])
    if _state["loaded"]:
        for name in names:
            _load_module(name)


def _env_modules() -> list[str]:
    return [m.strip() for m in os.environ.get(PLUGIN_ENV, "").split(",") if m.strip()]


def _who() -> str:
    return _state["current"] or "Python"


def load_plugins() -> None:
    """Load every plugin once: the entry points of :data:`ENTRY_POINT_GROUP`, then the modules of
    ``$R2MED_PLUGINS`` (where ``--plugin`` adds its own). A failure is raised again on every later read.

    Raises:
        PluginError: a plugin fails to import or to register (one line naming the plugin and
            its distribution).
    """
    if _state["error"] is not None:
        raise _state["error"]
    if _state["loaded"]:
        return
    _state["loaded"] = True  # before loading: a plugin that reads a registry must not load again
    try:
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = ep.dist
            where = f"plugin '{ep.name}' ({ep.value}) of distribution " + (
                f"{dist.metadata['Name']} {dist.version}" if dist is not None else "(unknown)")
            _load(ep.load, where)
        for name in _env_modules():
            _load_module(name)
    except PluginError as e:
        _state["error"] = e
        raise


def _load_module(name: str) -> None:
    _load(lambda: importlib.import_module(name), f"plugin module '{name}'")


def _load(load: Callable[[], Any], where: str) -> None:
    previous, _state["current"] = _state["current"], where
    try:
        target = load()
        if callable(target) and not isinstance(target, types.ModuleType):
            target()
    except PluginError:
        raise
    except Exception as e:  # a plugin's own failure, whatever it is: one line, no traceback
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise PluginError(f"{where} failed to load: {type(e).__name__}" + (f": {detail}" if detail else "")) from None
    finally:
        _state["current"] = previous
