"""Traces as JSON lines: the ``<Task>.traces.jsonl`` of the agentic loops and the
``<Task>.rerank.jsonl`` of the LLM rerankers, one :class:`~r2med_agent.types.Trace` per line."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from os import PathLike
from typing import Any

from r2med_agent.errors import DataError
from r2med_agent.io import iter_jsonl
from r2med_agent.types import Trace, TraceStep

__all__ = ["read_traces", "trace_from_dict", "trace_to_dict", "traces_to_jsonl"]


def trace_to_dict(trace: Trace) -> dict[str, Any]:
    """A JSON-ready dict of a Trace (the ``<Task>.traces.jsonl`` record)."""
    return {
        "query_id": trace.query_id,
        "method": trace.method,
        "finish_reason": trace.finish_reason,
        "final": trace.final,
        "steps": [
            {
                "generated": s.generated,
                "search_query": s.search_query,
                "doc_ids": list(s.doc_ids),
                "inserted": s.inserted,
                "prompt_tokens": s.prompt_tokens,
                "completion_tokens": s.completion_tokens,
            }
            for s in trace.steps
        ],
        "extra": dict(trace.extra),
    }


def trace_from_dict(obj: Mapping[str, Any]) -> Trace:
    """The inverse of :func:`trace_to_dict`; a malformed record raises ValueError naming the field."""
    def need(o: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
        if key not in o:
            raise ValueError(f"missing field '{where}{key}'")
        value = o[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"field '{where}{key}' has the wrong type ({type(value).__name__})")
        return value

    steps_raw = need(obj, "steps", list, "")
    steps = []
    for i, s in enumerate(steps_raw):
        where = f"steps[{i}]."
        if not isinstance(s, Mapping):
            raise ValueError(f"field 'steps[{i}]' must be an object")
        doc_ids = need(s, "doc_ids", list, where)
        steps.append(
            TraceStep(
                generated=need(s, "generated", str, where),
                search_query=need(s, "search_query", (str, type(None)), where),
                doc_ids=tuple(str(d) for d in doc_ids),
                inserted=need(s, "inserted", str, where),
                prompt_tokens=need(s, "prompt_tokens", int, where),
                completion_tokens=need(s, "completion_tokens", int, where),
            )
        )
    extra = obj.get("extra", {})
    if not isinstance(extra, Mapping):
        raise ValueError("field 'extra' must be an object")
    return Trace(
        query_id=need(obj, "query_id", str, ""),
        method=need(obj, "method", str, ""),
        steps=tuple(steps),
        final=need(obj, "final", str, ""),
        finish_reason=need(obj, "finish_reason", str, ""),
        extra=dict(extra),
    )


def read_traces(path: str | PathLike[str]) -> list[Trace]:
    """Read a ``traces.jsonl`` file; a malformed line raises DataError with file:line."""
    out = []
    for lineno, obj in iter_jsonl(path):
        try:
            out.append(trace_from_dict(obj))
        except ValueError as e:
            raise DataError(f"not a trace record: {e}", path, lineno) from None
    return out


def traces_to_jsonl(traces: Sequence[Trace]) -> str:
    """Traces as JSON lines (one record per line, newline-terminated)."""
    return "".join(json.dumps(trace_to_dict(t), ensure_ascii=False) + "\n" for t in traces)
