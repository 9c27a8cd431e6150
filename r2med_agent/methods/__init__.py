"""Methods: how a query becomes what the retriever searches with.

A new method is one class plus one line in :data:`METHODS`. Single-shot expansion methods
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

__all__ = [
    "METHODS", "ExpansionMethod", "HyDE", "LameR", "NoneMethod", "Query2Doc", "Reason", "SearchO1", "SearchR1",
    "get_method",
]

METHODS: dict[str, type[Any]] = {
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
}
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
