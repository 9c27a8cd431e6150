"""Defaults and names that the run spec and the components share, each stated once.

Pure constants and functions (no imports of the package, no registries, no I/O), so that the run
spec (:mod:`r2med_agent.experiment.spec`) names a run exactly as the components name their parts,
whatever is installed: R2MED's depth, the rerank depth, RRF's constant, how a fused retriever and
released generations are named.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["DEFAULT_RERANK_K", "DEFAULT_RRF_K", "DEFAULT_TOP_K", "MAX_NAME", "NAME_RULE", "ORIGINAL_QUERY",
           "fusion_label", "member_names", "name_problem", "released_label"]

DEFAULT_TOP_K = 100
"""R2MED's depth: the top 100 documents per query are kept and scored."""

DEFAULT_RERANK_K = 100
"""How many top documents a reranker re-scores unless told otherwise (the paper uses 10 or 100)."""

DEFAULT_RRF_K = 60
"""Reciprocal rank fusion's constant k (score = sum of 1/(k + rank)), as in the RRF paper."""

ORIGINAL_QUERY = ":query"
"""Suffix of a fused member that searches with the original query, whatever the method generated
(``bm25+reasonembed-qwen3-8b:query``: BM25 on the HyDE text, the embedder on the question)."""


def member_names(spec: str) -> list[str]:
    """The retriever names of a '+'-joined spec, each without its ``:query`` suffix."""
    return [p.strip().removesuffix(ORIGINAL_QUERY) for p in spec.split("+") if p.strip()]


def fusion_label(
    members: str, method: str = "rrf", rrf_k: int = DEFAULT_RRF_K, weights: Sequence[float] | None = None
) -> str:
    """The name of a fused retriever, as result folders and run tags show it: the members
    (``bm25+minilm``) alone for RRF with k=60, else with the settings appended, so runs with
    other settings never share a folder: ``bm25+minilm-rrf20``, ``bm25+minilm-weighted``
    (equal weights), ``bm25+minilm-weighted-0.3-0.7``."""
    if method == "rrf":
        return members if rrf_k == DEFAULT_RRF_K else f"{members}-rrf{rrf_k}"
    label = f"{members}-{method}"
    if weights is not None:
        label += "".join(f"-{float(w):g}" for w in weights)
    return label


def released_label(llm: str, source: str = "r2med") -> str:
    """The result folder's LLM part for released generations (``qwen-7b@r2med``, ``gpt4@bright``)."""
    return f"{llm}@{source}"


MAX_NAME = 100
"""Most characters of an entry's or a task's name."""

NAME_RULE = (f"ASCII letters, digits and . _ - + @, starting with a letter or a digit, at most {MAX_NAME} "
             "characters")
"""What an entry's or a task's name may hold, in words (every shipped name fits: ``qwen2.5-7b``,
``bm25``, ``nano-Biology``)."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+@-]*")


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot name an LLM, encoder, reranker or task entry, or None when it can.

    Names become folder and file names (``<out>/<method>/<llm>/...``, ``<Task>.json``, cache
    folders), so a name is one plain path component: no ``/``, no ``..``, no leading dot, no
    control or invisible character, nothing a shell or an HTML page reads specially
    (:data:`NAME_RULE`)."""
    if not isinstance(name, str) or not name:
        return "a name must be non-empty text"
    if len(name) > MAX_NAME:
        return f"{len(name)} characters, more than {MAX_NAME}"
    if _NAME.fullmatch(name) is None:
        bad = [c for c in name if not (c.isascii() and (c.isalnum() or c in "._+@-"))]
        return f"it holds {bad[0]!r}" if bad else f"it starts with {name[0]!r}"
    return None
