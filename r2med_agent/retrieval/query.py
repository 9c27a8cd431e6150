"""Query construction: the text a lexical retriever searches with, by a request's ``combine`` rule.

Each rule (docs/protocol.md, BM25 column of its query table) says how a request's query and its
LLM expansion become one query text; :func:`bm25_query_text` builds it for BM25 (and for the
text retrievers of the Python API). Dense retrievers combine embeddings instead
(:func:`~r2med_agent.retrieval.dense.index.query_embeddings`).
"""

from __future__ import annotations

from r2med_agent.errors import ConfigError
from r2med_agent.types import SearchRequest

__all__ = ["COMBINE_RULES", "bm25_query_text"]

COMBINE_RULES = ("none", "hyde", "query2doc", "lamer", "reasoning", "rewrite")
"""The ``combine`` rules a request may name."""


def bm25_query_text(request: SearchRequest, *, compat: bool = False) -> str:
    """The BM25 query text of a request, by its ``combine`` rule (the table of docs/protocol.md).

    ``none``: the query; ``hyde``: the expansion; ``query2doc``: query, query and expansion joined
    by spaces; ``lamer``: query + " " + expansion; ``reasoning``: the expansion (the final
    response); ``rewrite``: the expansion, which replaces the query for every retriever (BRIGHT's
    reasoning queries). A rule that uses the expansion falls back to the query when the expansion is blank
    (the caller logs that), unless the request's ``keep_empty`` says to use it as it is, as R2MED's
    BM25 script does (HyDE's and a reasoning model's query is then empty and matches nothing); see
    :meth:`~r2med_agent.retrieval.bm25.retriever.BM25Retriever.search`. Several samples
    (``more_expansions``) are joined by spaces into the expansion.

    ``compat`` (the ``bm25-compat`` retriever) builds Query2Doc's query as R2MED's BM25 script
    does: the query repeated with nothing between the two copies, then a space and the passage
    (``query * 2 + " " + passage``). The analyzer then reads the last word of the first copy and
    the first word of the second as one token when no punctuation separates them.
    """
    rule = request.combine
    if rule not in COMBINE_RULES:
        raise ConfigError(
            f"unknown combine rule '{rule}' for query {request.query_id}; "
            f"allowed: {', '.join(COMBINE_RULES)}"
        )
    q, x = request.query, " ".join(request.expansions) if request.more_expansions else request.expansion
    if rule == "none" or (not x.strip() and not request.keep_empty):
        return q
    if rule in ("hyde", "reasoning", "rewrite"):
        return x
    if rule == "query2doc":
        return f"{q}{q} {x}" if compat else f"{q} {q} {x}"
    return f"{q} {x}"  # lamer
