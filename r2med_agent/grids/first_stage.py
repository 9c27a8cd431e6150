"""What a grid row's dense retrieval does, for ``reproduce --dry-run``: each encoder it searches
with, the strings and token limit that encoder feeds its model, and how deep its list goes and
what reads it (the reranker, the fusion), with the source the settings follow."""

from __future__ import annotations

from collections.abc import Sequence

from r2med_agent.experiment.plan import RunPlan
from r2med_agent.experiment.spec import RunSpec
from r2med_agent.retrieval.fusion import member_names


def _how_searched(spec: RunSpec, name: str, members: list[str]) -> str:
    queries = "original queries, no expansion" if not spec.llm else f"queries of the {spec.method} method"
    others = [m for m in members if m != name]
    fusion = (f"fused ({spec.fusion}) with {', '.join(others)}" if others
              else "no fusion (no BM25 or other retriever merged)")
    if spec.reranker:
        depth = f"its top {spec.rerank_k} reranked by {spec.reranker}"
    else:
        depth = f"its top {spec.top_k} scored"
    return f"{queries}; {fusion}; {depth}"


def first_stage_lines(plan: RunPlan, tasks: Sequence[str] = ()) -> list[str]:
    """One line per dense encoder of the row's retriever (none for BM25 or given run files; the
    entries are the row's ``plan``'s):
    ``first stage`` when the row reranks, else ``retrieval``; then the entry's ``reference``. An
    entry with BRIGHT settings of its own is described as it runs on the row's ``tasks``: with
    those on BRIGHT's tasks, its own on the others (both when the row has both)."""
    from r2med_agent.retrieval.dense.instructions import describe_inputs, is_bright_task

    spec = plan.spec
    if spec.candidates:
        return []
    members = member_names(spec.retriever)
    label = "first stage" if spec.reranker else "retrieval"
    on_bright = [is_bright_task(t) for t in tasks]
    out = []
    for name in members:
        enc = plan.encoder(name)
        if enc is None:
            continue
        model = enc.model or f"{enc.query_model} / {enc.doc_model}"
        settings = [(enc, "")]
        if enc.bright and any(on_bright):
            settings = [(enc.on_bright(), " on BRIGHT's tasks")]
            if not all(on_bright):
                settings.append((enc, " on the other tasks"))
        for entry, where in settings:
            out.append(f"{label}: {name} ({model}){where}: {describe_inputs(entry)}; {_how_searched(spec, name, members)}")
            if entry.reference:
                out.append(f"  settings from {entry.reference}")
    return out
