"""r2med-agent: reasoning-augmented medical retrieval on the R2MED benchmark."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "evaluate_encoder", "evaluate_llm", "evaluate_retriever"]

_API = ("evaluate_encoder", "evaluate_llm", "evaluate_retriever")


def __getattr__(name: str) -> Any:
    """The Python API's entry points, imported on first use (``from r2med_agent import
    evaluate_llm``), so importing one submodule never loads the whole pipeline."""
    if name in _API:
        from r2med_agent import api

        return getattr(api, name)
    raise AttributeError(f"module 'r2med_agent' has no attribute {name!r}")
