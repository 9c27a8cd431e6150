"""Pointwise reranking (``kind: pointwise-reasoning``): the model judges every (query, document)
pair of every query of every task in ONE ``generate`` call, and a second call reads the
judgment's probability where the backend gives log-probabilities. The default format ends with
``Relevant: yes`` or ``no`` (:func:`judge`); Rank1's stops at its judgment token (:func:`rank1`).
Ties keep the first-stage order (:func:`~r2med_agent.rerank.llm_jobs.sort_by_score`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from r2med_agent.progress import part as progress_part
from r2med_agent.rerank import formats
from r2med_agent.rerank.answers import judgment_prefix, parse_judgment, yes_probability
from r2med_agent.rerank.llm_jobs import PromptingReranker, RerankQuery, sort_by_score
from r2med_agent.types import Generation, Message, SamplingParams, TraceStep

logger = logging.getLogger(__name__)

TOP_LOGPROBS = 20
"""Alternatives asked for at the judgment position (vLLM's and OpenAI's limit)."""

Pairs = list[tuple[RerankQuery, str]]
"""Every (query, document id) pair judged, in query order."""


def judge_pairs(
    reranker: PromptingReranker, queries: list[RerankQuery], params: SamplingParams,
) -> tuple[Pairs, list[list[Message]], list[str], list[Generation]]:
    """Every (query, document) pair of the top ``k``, its prompt and template hash, and the
    answers of ONE generate call for all of them (each kept with its query)."""
    pairs = [(q, d) for q in queries for d in q.head]
    prompts_ = [
        reranker.prompt(q.task, query=q.request.query, document=reranker.prepared(q.corpus[d]))
        for q, d in pairs
    ]
    hashes = [reranker.template_hash(q.task) for q, _ in pairs]
    logger.info("%s: %d (query, document) pairs in one batch", reranker.name, len(pairs))
    first = reranker.llm.generate(prompts_, params, template_hash=hashes,
                                  meta=[reranker.meta(q, doc_id=d) for q, d in pairs])
    for (q, _), g in zip(pairs, first):
        q.gens.append(g)
    return pairs, prompts_, hashes, first


def judge(reranker: PromptingReranker, queries: list[RerankQuery]) -> None:
    """The default format: the score is P(yes) / (P(yes) + P(no)) of the token after the
    answer's ``Relevant:`` where the backend returns log-probabilities, else the parsed judgment
    (1 for yes, 0 for no, 0.5 when none was found)."""
    params = reranker.sampling()
    pairs, prompts_, hashes, first = judge_pairs(reranker, queries, params)
    probs: list[float | None] = [None] * len(pairs)
    if pairs and reranker.returns_logprobs():
        judge_params = replace(params, temperature=0.0, max_tokens=1, stop=(), logprobs=TOP_LOGPROBS)
        follow = [p + [{"role": "assistant", "content": judgment_prefix(g.text)}] for p, g in zip(prompts_, first)]
        with progress_part("(the one-token judgment of each answer)"):
            second = reranker.llm.generate(follow, judge_params, template_hash=hashes,
                                           meta=[reranker.meta(q, doc_id=d, step="judgment") for q, d in pairs])
        for (q, _), g in zip(pairs, second):
            q.gens.append(g)
        probs = [yes_probability(g.logprobs[0] if g.logprobs else None) for g in second]
    for (q, d), gen, p in zip(pairs, first, probs):
        judged = parse_judgment(gen.final)
        score = p if p is not None else (0.5 if judged is None else float(judged))
        q.scores.append(score)
        q.records.append({"doc_id": d, "judgment": None if judged is None else ("yes" if judged else "no"),
                          "p_yes": None if p is None else round(p, 6), "score": round(score, 6),
                          "finish_reason": gen.finish_reason})
        label = "none found" if judged is None else ("yes" if judged else "no")
        note = f"judgment: {label}; " + (f"P(yes) = {p:.4f}" if p is not None else "score from the judgment")
        q.steps.append(TraceStep(generated=gen.text, doc_ids=(d,), inserted=note,
                                 prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens))
    sort_by_score(queries)


def rank1(reranker: PromptingReranker, queries: list[RerankQuery]) -> None:
    """Rank1 (:mod:`~r2med_agent.rerank.formats`): all pairs in one call that stops
    at the judgment token; the score is P(true) of that token. With log-probabilities of the
    generation (vLLM), as Rank1 does: read at the stop, and the answers lacking both tokens
    among the top ones are ended by force in one more call restricted to the two tokens.
    A backend that scores token choices but returns no generation log-probabilities (local
    llama.cpp) scores every answer in that one more call: a finished one right after its
    ``</think>``, an unfinished one ended by force. Without either, the parsed judgment
    (1, 0, or 0.5 when none)."""
    logprobs, choices = reranker.returns_logprobs(), reranker.scores_choices()
    params = replace(reranker.sampling(), stop=formats.RANK1_STOPS, logprobs=TOP_LOGPROBS if logprobs else 0)
    pairs, prompts_, hashes, first = judge_pairs(reranker, queries, params)
    probs = [formats.true_probability(g.logprobs[-1]) if logprobs and g.logprobs else None for g in first]
    later = [i for i, p in enumerate(probs) if p is None] if choices else []
    forced = {i for i in later if logprobs or first[i].stop_reason not in formats.RANK1_STOPS}
    if later:
        end = replace(params, temperature=0.0, max_tokens=1, stop=(), logprobs=0,
                      token_choices=(formats.RANK1_TRUE, formats.RANK1_FALSE))
        follow = [[{"role": "assistant", "content": formats.judgment_point(
            prompts_[i][0]["content"], first[i].text, force=i in forced)}] for i in later]
        # The same pairs again: said so in the log line and the progress of this second batch.
        with progress_part(f"(the judgment token of each answer, {len(forced)} of them ended by force)"):
            second = reranker.llm.generate(follow, end, template_hash=[hashes[i] for i in later], meta=[
                reranker.meta(pairs[i][0], doc_id=pairs[i][1], step="forced end" if i in forced else "judgment")
                for i in later])
        for i, g in zip(later, second):
            pairs[i][0].gens.append(g)
            probs[i] = formats.true_probability(g.logprobs[0] if g.logprobs else None)
    for i, ((q, d), gen, p) in enumerate(zip(pairs, first, probs)):
        judged = formats.rank1_judgment(gen.text, gen.stop_reason)
        fallback = 0.5 if choices or judged is None else float(judged)
        score = p if p is not None else fallback
        q.scores.append(score)
        q.records.append({"doc_id": d, "judgment": None if judged is None else ("true" if judged else "false"),
                          "p_true": None if p is None else round(p, 6), "score": round(score, 6),
                          "forced": i in forced, "finish_reason": gen.finish_reason})
        label = "none found" if judged is None else ("true" if judged else "false")
        how = f"P(true) = {p:.4f}" if p is not None else ("no judgment token: 0.5" if choices else "score from the judgment")
        note = f"judgment: {label}; {how}" + ("; thinking ended by force" if i in forced else "")
        q.steps.append(TraceStep(generated=gen.text, doc_ids=(d,), inserted=note,
                                 prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens))
    sort_by_score(queries)


def judgment_stats(records: Sequence[Mapping[str, Any]], fmt: str = "default") -> dict[str, Any]:
    """A task's pointwise statistics from its judgments' records: pairs judged, those scored by
    log-probabilities and those without a judgment; Rank1's answers ended by force."""
    prob = "p_true" if fmt == "rank1" else "p_yes"
    stats: dict[str, Any] = {
        "pairs": len(records),
        "scored_by_logprobs": sum(1 for r in records if r[prob] is not None),
        "no_judgment": sum(1 for r in records if r["judgment"] is None),
    }
    if fmt == "rank1":
        stats["forced_end"] = sum(1 for r in records if r["forced"])
    return stats
