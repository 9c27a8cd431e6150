"""Rough LLM work of a grid entry: calls, prompt and output tokens per stage, API dollars and
GPU-hours, for the dry run and ``reproduce`` (:func:`token_estimate`, :func:`gpu_hours`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from r2med_agent.analysis.grids import GridEntry
from r2med_agent.methods.base import capabilities


class Registries(Protocol):
    """The registries an estimate reads (:class:`r2med_agent.analysis.needs.Registries` has them)."""

    llms: Mapping[str, Any]
    rerankers: Mapping[str, Any]
    models: Mapping[str, Any]


def method_caps(entry: GridEntry) -> Any:
    """The capabilities the entry's method declares."""
    from r2med_agent.methods import get_method

    return capabilities(get_method(entry.method))


TOKENS_PER_WORD = 1.4
"""English and medical text: about 1.3-1.5 subword tokens per whitespace-separated word."""

CHARS_PER_TOKEN = 4.5
"""English and medical text: about 4-5 characters per subword token (a reranker that cuts documents
by characters, GroupRank's 3,000)."""

EXPANSION_PROMPT_TOKENS = 300
"""A HyDE/Query2Doc/LameR prompt, roughly (LameR's ten documents: about 4,000 more)."""

LOOP_PROMPT_TOKENS = 400
"""A Search-R1/Search-o1 task prompt with its question, roughly."""


@dataclass(frozen=True)
class TokenEstimate:
    """Upper-bound work of one LLM stage of an entry (:func:`token_estimate`).

    Attributes:
        label: the stage (``hyde qwen-7b x1``, a reranker and its calls per query).
        calls: LLM calls.
        prompt_tokens: prompt tokens (an estimate; for the loops an upper bound, as their
            prompts grow with what the model wrote).
        output_tokens: output tokens at the entries' ``max_tokens`` (an upper bound).
        usd: the dollar cost at the LLM entry's prices (None: no price).
        gpu_hours: GPU-hours of a self-hosted model (None: an API's, or no size known).
        api: the LLM is a paid API (an API key): a missing price is said so.
        grows: the prompts grow with the outputs (the loops): both are upper bounds.
    """

    label: str
    calls: int
    prompt_tokens: int
    output_tokens: int
    usd: float | None = None
    gpu_hours: float | None = None
    api: bool = False
    grows: bool = False

    def line(self) -> str:
        prompt = "≤" if self.grows else "≈"
        line = (f"{self.label}: {self.calls:,} calls, {prompt}{self.prompt_tokens / 1e6:.1f}M prompt tokens, "
                f"≤{self.output_tokens / 1e6:.1f}M output tokens")
        if self.usd is not None:
            line += f", ≤${self.usd:,.0f}"
        elif self.api:
            line += ", cost unknown (its llms entry has no price_in_per_mtok/price_out_per_mtok)"
        if self.gpu_hours is not None:
            hours = format_hours(self.gpu_hours)
            line += f", {'' if hours.startswith('<') else '≤'}{hours} GPU-hours"
        return line


def format_hours(hours: float) -> str:
    """GPU-hours as ``--dry-run`` writes them: whole hours from 10 on, one decimal below, ``<0.1``
    for less (never ``0``)."""
    if hours >= 10:
        return f"{hours:,.0f}"
    return f"{hours:.1f}" if hours >= 0.05 else "<0.1"


def token_estimate(entry: GridEntry, n_queries: int, registries: Registries,
                   released: bool = False) -> list[TokenEstimate]:
    """Upper-bound LLM calls and tokens of an entry's LLM stages over ``n_queries`` queries:
    prompts from the reranker's document cut (``max_doc_tokens``, ``max_doc_chars`` /
    CHARS_PER_TOKEN or ``max_doc_words`` x TOKENS_PER_WORD), outputs at the entries'
    ``max_tokens`` (reasoning models often use far fewer); the reasoning loops at their turn and
    search limits, every step at its ``max_tokens`` (:func:`_loop_work`). Dollars where the LLM
    entry has prices, GPU-hours for a self-hosted model of known size."""
    out: list[TokenEstimate] = []
    samples = int(entry.args.get("samples", 1))
    caps = method_caps(entry)
    if caps.uses_llm and entry.llm in registries.llms and not released:
        spec = registries.llms[entry.llm]
        if caps.agentic:
            label, calls, p_in, p_out = _loop_work(entry, spec, n_queries)
        else:
            calls = n_queries * samples
            p_in = calls * (EXPANSION_PROMPT_TOKENS + (4000 if caps.needs_first_pass else 0))
            label, p_out = f"{entry.method} {entry.llm} x{samples}", calls * _max_tokens(entry, spec.max_tokens)
        out.append(_estimate(label, spec, calls, p_in, p_out, registries.models.get(entry.llm), caps.agentic))
    rr = registries.rerankers.get(entry.reranker) if entry.reranker else None
    if rr is not None and rr.kind_of.work is not None and rr.llm in registries.llms:
        spec = registries.llms[rr.llm]
        k = int(entry.args.get("rerank_k", 100))
        label, calls, p_in = _rerank_work(rr, k, n_queries)
        out.append(_estimate(label, spec, calls, p_in, calls * (rr.max_tokens or spec.max_tokens),
                             registries.models.get(rr.llm)))
    return out


def _max_tokens(entry: GridEntry, default: int) -> int:
    """Tokens per generation: the entry's ``--max-tokens`` where it sets one, else ``default``."""
    sampling = entry.args.get("sampling") or {}
    return int(sampling.get("max_tokens") or default)


def _loop_work(entry: GridEntry, spec: Any, n_queries: int) -> tuple[str, int, int, int]:
    """``(label, calls, prompt tokens, output tokens)`` of a reasoning loop over ``n_queries``, at its
    limits: every turn taken (Search-R1: the searching turns and the final one; Search-o1: its turns,
    each search condensed by Reason-in-Documents), every step writing its ``max_tokens``, each step's
    prompt the task prompt plus everything written and inserted before it (at most the entry's
    context length)."""
    from r2med_agent.methods import get_method

    method = get_method(entry.method)()
    if hasattr(method, "for_model"):
        method = method.for_model(spec.model)
    step = _max_tokens(entry, int(method.model_sampling.get("max_tokens") or
                                  min(method.params.max_tokens, spec.max_tokens)))
    turns = method.max_turns + (1 if method.final_turn else 0)
    searches = min(method.max_searches if method.max_searches is not None else method.max_turns, method.max_turns)
    if method.condenses:  # the inserted text is Reason-in-Documents' answer
        inserted = step
    elif getattr(method, "max_obs_tokens", None):
        inserted = int(method.max_obs_tokens)
    else:
        inserted = int(method.docs_per_search * (method.max_doc_words or 300) * TOKENS_PER_WORD)
    context = spec.max_model_len or float("inf")
    prompts = sum(min(LOOP_PROMPT_TOKENS + t * (step + inserted), context) for t in range(turns))
    calls, outputs = turns, turns * step
    label = f"{entry.method} {entry.llm} (≤{turns} steps"
    if method.condenses:
        chars = getattr(method, "max_doc_chars", None)
        docs = method.docs_per_search * (chars / CHARS_PER_TOKEN if chars else 300 * TOKENS_PER_WORD)
        prompts += sum(min(LOOP_PROMPT_TOKENS + docs + s * (step + inserted), context) for s in range(searches))
        calls, outputs = calls + searches, outputs + searches * step
        label += f" + ≤{searches} Reason-in-Documents calls"
    label += " per query)"
    return label, calls * n_queries, int(prompts * n_queries), outputs * n_queries


def _rerank_work(rr: Any, k: int, n_queries: int) -> tuple[str, int, int]:
    """``(label, calls, prompt tokens)`` of an LLM reranker over the top ``k`` of ``n_queries``
    (its kind's declared ``work``, with each candidate at its cut)."""
    if getattr(rr, "max_doc_tokens", 0):
        doc = float(rr.max_doc_tokens)  # an upper bound: shorter documents stay shorter (Rank1's guard too)
    elif getattr(rr, "max_doc_chars", 0):
        doc = rr.max_doc_chars / CHARS_PER_TOKEN
    else:
        doc = rr.max_doc_words * TOKENS_PER_WORD
    return rr.kind_of.work(rr, k, doc, n_queries)


def _estimate(label: str, spec: Any, calls: int, p_in: int, p_out: int, model: Any = None,
              grows: bool = False) -> TokenEstimate:
    priced = bool(spec.price_in_per_mtok or spec.price_out_per_mtok)
    hours = None
    if model is not None and spec.backend in ("vllm", "openai") and not spec.api_key_env:
        hours = gpu_hours(model.params_b, p_in, p_out)
    return TokenEstimate(label, calls, int(p_in), int(p_out), spec.cost_usd(p_in, p_out) if priced else None, hours,
                         api=bool(spec.api_key_env), grows=grows)


GPU_TOKENS_PER_S = {"prompt": 8.0e5, "output": 8.0e4}
"""Rough batch throughput of vLLM on one 80 GB GPU, per billion parameters: a P-billion model reads
about 800,000/P prompt tokens and writes about 80,000/P output tokens a second with full batches
(an 8B model ~10,000 output tokens/s, a 32B model ~2,500). Assumptions, not measurements here:
the estimates are upper bounds to plan with (outputs at the entries' max_tokens); measure yours."""


def gpu_hours(params_b: float, prompt_tokens: int, output_tokens: int) -> float:
    """GPU-hours of an LLM stage from :data:`GPU_TOKENS_PER_S` (tensor-parallel GPUs count each)."""
    seconds = prompt_tokens * params_b / GPU_TOKENS_PER_S["prompt"] + output_tokens * params_b / GPU_TOKENS_PER_S["output"]
    return seconds / 3600
