"""Methods: how a query becomes what the retriever searches with.

A new method is one class, registered: a line in :data:`METHODS` for a built-in one,
``register("methods", name, cls)`` (:mod:`r2med_agent.plugins`) from your own package. Single-shot expansion methods
(``none``, ``hyde``, ``query2doc``, ``lamer``) implement :class:`ExpansionMethod`'s
``build_prompts`` / ``to_requests``; agentic methods (``search-r1``, ``search-o1``) have
``agentic = True`` and ``run(...)``.
"""

from __future__ import annotations

from typing import Any

from r2med_agent.errors import ConfigError
from r2med_agent.methods.agentic import SearchO1, SearchR1
from r2med_agent.methods.base import ExpansionMethod, NoneMethod
from r2med_agent.methods.expansion import HyDE, LameR, Query2Doc, Reason
from r2med_agent.plugins import PluginError, Registry

__all__ = [
    "METHODS", "ExpansionMethod", "HyDE", "LameR", "NoneMethod", "Query2Doc", "Reason", "SearchO1", "SearchR1",
    "get_method",
]


def _check_method(registry: Registry[type[Any]], name: str, cls: type[Any]) -> type[Any]:
    if not isinstance(cls, type):
        raise PluginError(f"method '{name}' must be a class (an ExpansionMethod or an agentic method), got {cls!r}")
    return cls


METHODS: Registry[type[Any]] = Registry("methods", {
    # Single-shot query expansion (r2med_agent/methods/expansion.py).
    "none": NoneMethod,
    "hyde": HyDE,
    "query2doc": Query2Doc,
    "lamer": LameR,
    # BRIGHT's reasoning queries: the LLM's reasoning replaces the query.
    "reason": Reason,
    # Agentic reasoning-search loops (r2med_agent/methods/agentic.py): one line per method here.
    "search-r1": SearchR1,
    "search-o1": SearchO1,
}.items(), _check_method)
"""Method registry: name -> class. Classes are constructed with no required arguments."""


def get_method(name: str) -> type[Any]:
    """The method class registered as ``name``.

    Raises:
        ConfigError: unknown name; the message lists the allowed names.
    """
    from r2med_agent.errors import did_you_mean

    try:
        return METHODS[method_name(name)]
    except KeyError:
        raise ConfigError(
            f"unknown method '{name}'{did_you_mean(name, METHODS)}; allowed: {', '.join(METHODS)}"
        ) from None


def method_name(name: str) -> str:
    """The registered spelling of a method name typed in any case (``HyDE`` -> ``hyde``,
    ``Search_R1`` -> ``search-r1``); an unknown name comes back unchanged."""
    low = name.strip().lower().replace("_", "-")
    return low if low in METHODS else name
