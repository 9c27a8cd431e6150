"""Listwise reranking (``kind: listwise``): windows slide from the bottom of each query's top
``k`` up (:func:`~r2med_agent.rerank.answers.window_positions`), and each window is
re-ordered by the model's permutation; ONE ``generate`` call per window position for all queries
of all tasks. The formats' prompts and answer reading: ReasonRank's rewritten numbers and answer
block, InsertRank's first-stage scores beside each candidate."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from r2med_agent.rerank import formats
from r2med_agent.rerank.answers import read_window, window_positions
from r2med_agent.rerank.llm_jobs import PromptingReranker, RerankQuery
from r2med_agent.types import Message, TraceStep

logger = logging.getLogger(__name__)

SCORE_DECIMALS = 3
"""InsertRank: decimals of the first-stage score shown beside each candidate."""


def rerank_windows(reranker: PromptingReranker, queries: list[RerankQuery]) -> None:
    """Re-order every query's top ``k`` window by window, all queries of a window position in one
    batch; each query's scores are then its new ranks (or, ``run_scores: positional``, the
    first-stage score of each rank)."""
    spec = reranker.spec
    positions = {id(q): [q.first[d] for d in q.head] for q in queries}  # the first-stage score of each rank
    for q in queries:
        q.windows = window_positions(len(q.head), spec.window, spec.step)
    params = reranker.sampling()
    position = 0
    while True:
        batch = [q for q in queries if position < len(q.windows)]
        if not batch:
            break
        prompts_, hashes, metas = [], [], []
        for q in batch:
            start, end = q.windows[position]
            prompts_.append(window_prompt(reranker, q, start, end))
            hashes.append(reranker.template_hash(q.task))
            metas.append(reranker.meta(q, window=[start, end]))
        logger.info("%s: window %d, %d queries in one batch", reranker.name, position + 1, len(batch))
        outs = reranker.llm.generate(prompts_, params, template_hash=hashes, meta=metas)
        strict = getattr(spec, "parse", "lenient") == "strict"
        for q, gen in zip(batch, outs):
            q.gens.append(gen)
            start, end = q.windows[position]
            shown = q.head[start:end]
            order, repair, read = read_window(gen, len(shown), reranker.format, strict)
            q.head[start:end] = [shown[i] for i in order]
            q.records.append({"start": start, "end": end, "permutation": [i + 1 for i in order],
                              **repair.to_dict(), "finish_reason": gen.finish_reason, **read})
            note = " > ".join(f"[{i + 1}]" for i in order)
            if read.get("readable") is False:
                note += " (its numbers could not be read: the window keeps its order)"
            if repair.any:
                note += " (repaired: " + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in repair.to_dict().items() if n) + ")"
            q.steps.append(TraceStep(
                generated=gen.text, search_query=f"ranks {start + 1}-{end}", doc_ids=tuple(shown),
                inserted=note, prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens,
            ))
        position += 1
    for q in queries:
        if getattr(spec, "run_scores", "rank") == "positional":
            q.scores = [float(f"{s:.6f}") for s in positions[id(q)]]
        else:
            q.scores = [float(len(q.head) - i) for i in range(len(q.head))]


def window_prompt(reranker: PromptingReranker, q: RerankQuery, start: int, end: int) -> list[Message]:
    """One window's prompt: its candidates cut to ``max_doc_words`` in window order (ReasonRank:
    bracketed numbers rewritten; InsertRank: each with its first-stage score)."""
    shown = q.head[start:end]
    passages = [shown_text(reranker, q, d) for d in shown]
    query = q.request.query
    extra: dict[str, Any] = {}
    if reranker.format == "reasonrank":
        query = formats.replace_numbers(query).strip()
    elif reranker.format == "insertrank":
        extra["scores"] = [f"{q.first[d]:.{SCORE_DECIMALS}f}" for d in shown]
    return reranker.prompt(q.task, query=query, passages=passages, **extra)


def shown_text(reranker: PromptingReranker, q: RerankQuery, doc_id: str) -> str:
    """A candidate as a window shows it (the reranker's ``prepared`` text; ReasonRank: its
    bracketed numbers rewritten), made once per query."""
    if doc_id not in q.texts:
        text = reranker.prepared(q.corpus[doc_id])
        q.texts[doc_id] = formats.replace_numbers(text) if reranker.format == "reasonrank" else text
    return q.texts[doc_id]


def window_stats(records: Sequence[Mapping[str, Any]], fmt: str = "default") -> dict[str, Any]:
    """A task's listwise statistics from its windows' records: windows read, repairs of each
    kind and answers repaired; ReasonRank's answers without an answer block or unreadable."""
    stats: dict[str, Any] = {
        "windows": len(records),
        "repairs": {k: sum(r[k] for r in records) for k in ("missing", "repeated", "out_of_range")},
        "answers_repaired": sum(1 for r in records if r["missing"] or r["repeated"] or r["out_of_range"]),
    }
    if fmt == "reasonrank":
        stats["no_answer_block"] = sum(1 for r in records if not r["answer_block"])
        stats["unreadable_answers"] = sum(1 for r in records if r.get("readable") is False)
    return stats
