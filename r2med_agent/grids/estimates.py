"""Rough LLM work of a grid entry: calls, prompt and output tokens per stage, API dollars and
GPU-hours, for the dry run and ``reproduce`` (:func:`token_estimate`, :func:`gpu_hours`); and the
work of its dense encoders, documents and queries (:func:`encode_estimate`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from r2med_agent.experiment.plan import RunPlan
from r2med_agent.grids.grid import GridEntry
from r2med_agent.methods.base import capabilities


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
        return line + _cost_parts(self.usd, self.api, self.gpu_hours,
                                  "its llms entry has no price_in_per_mtok/price_out_per_mtok")


def _cost_parts(usd: float | None, api: bool, gpu_hours: float | None, no_price: str) -> str:
    """The end of an estimate's line: ``, ≤$N`` (or, for an API without a price, why there is
    none) and ``, ≤N GPU-hours``."""
    line = ""
    if usd is not None:
        line += f", ≤${usd:,.0f}"
    elif api:
        line += f", cost unknown ({no_price})"
    if gpu_hours is not None:
        hours = format_hours(gpu_hours)
        line += f", {'' if hours.startswith('<') else '≤'}{hours} GPU-hours"
    return line


def format_hours(hours: float) -> str:
    """GPU-hours as ``--dry-run`` writes them: whole hours from 10 on, one decimal below, ``<0.1``
    for less (never ``0``)."""
    if hours >= 10:
        return f"{hours:,.0f}"
    return f"{hours:.1f}" if hours >= 0.05 else "<0.1"


def token_estimate(entry: GridEntry, n_queries: int, plan: RunPlan, models: Mapping[str, Any],
                   released: bool = False) -> list[TokenEstimate]:
    """Upper-bound LLM calls and tokens of an entry's LLM stages over ``n_queries`` queries:
    prompts from the reranker's document cut (``max_doc_tokens``, ``max_doc_chars`` /
    CHARS_PER_TOKEN or ``max_doc_words`` x TOKENS_PER_WORD), outputs at the entries'
    ``max_tokens`` (reasoning models often use far fewer); the reasoning loops at their turn and
    search limits, every step at its ``max_tokens`` (:func:`_loop_work`). Dollars where the LLM
    entry has prices, GPU-hours for a self-hosted model of known size. The LLM, the reranker and
    its LLM are the row's ``plan``'s entries; sizes come from ``models`` (``configs/reproduce/models.yaml``)."""
    out: list[TokenEstimate] = []
    samples = int(entry.args.get("samples", 1))
    caps = capabilities(plan.method)
    if caps.uses_llm and entry.llm and plan.llm is not None and not released:
        spec = plan.llm
        if caps.agentic:
            label, calls, p_in, p_out = _loop_work(entry, plan.method, spec, n_queries)
        else:
            calls = n_queries * samples
            p_in = calls * (EXPANSION_PROMPT_TOKENS + (4000 if caps.needs_first_pass else 0))
            label, p_out = f"{entry.method} {entry.llm} x{samples}", calls * _max_tokens(entry, spec.max_tokens)
        out.append(_estimate(label, spec, calls, p_in, p_out, models.get(entry.llm), caps.agentic))
    rr = plan.reranker if entry.reranker else None
    if rr is not None and rr.kind_of.work is not None and plan.reranker_llm is not None:
        spec = plan.reranker_llm
        k = int(entry.args.get("rerank_k", 100))
        label, calls, p_in = _rerank_work(rr, k, n_queries)
        out.append(_estimate(label, spec, calls, p_in, calls * (rr.max_tokens or spec.max_tokens),
                             models.get(rr.llm)))
    return out


def _max_tokens(entry: GridEntry, default: int) -> int:
    """Tokens per generation: the entry's ``--max-tokens`` where it sets one, else ``default``."""
    sampling = entry.args.get("sampling") or {}
    return int(sampling.get("max_tokens") or default)


def _loop_work(entry: GridEntry, method_cls: type[Any], spec: Any, n_queries: int) -> tuple[str, int, int, int]:
    """``(label, calls, prompt tokens, output tokens)`` of a reasoning loop over ``n_queries``, at its
    limits: every turn taken (Search-R1: the searching turns and the final one; Search-o1: its turns,
    each search condensed by Reason-in-Documents), every step writing its ``max_tokens``, each step's
    prompt the task prompt plus everything written and inserted before it (at most the entry's
    context length)."""
    method = method_cls()
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


ENCODER_TOKENS_PER_S = 5.0e4
"""Rough throughput of a dense encoder on one 80 GB GPU in bf16, per billion parameters: a
P-billion encoder embeds about 50,000/P tokens a second (2·P GFLOP a token plus attention over a
few thousand tokens, at about 40% of an A100's 312 TFLOP/s: e5-mistral or SFR, 7.1B, ~7,000
tokens/s). An assumption to plan with, not a measurement here; measure yours."""


@dataclass(frozen=True)
class EncodeEstimate:
    """Upper-bound work of one dense encoder of an entry over the planned tasks
    (:func:`encode_estimate`): every text at the encoder's limit.

    Attributes:
        encoder: the registry name.
        docs, doc_tokens: the tasks' documents and their tokens. The embedding cache keeps a
            corpus's embeddings per encoder, so every row of the encoder over the same tasks
            shares them: a total counts them once (:attr:`doc_key`).
        queries, query_tokens: the tasks' queries (every row embeds its own).
        max_length: the tokens each document is counted at.
        doc_usd, query_usd: dollars at the API's price (None: not an API, or no price known).
        doc_hours, query_hours: GPU-hours of a local encoder of known size (None otherwise).
        api: the encoder is a paid API: a missing price is said so.
    """

    encoder: str
    tasks: tuple[str, ...]
    docs: int
    doc_tokens: int
    queries: int
    query_tokens: int
    max_length: int
    doc_usd: float | None = None
    query_usd: float | None = None
    doc_hours: float | None = None
    query_hours: float | None = None
    api: bool = False

    @property
    def doc_key(self) -> tuple[str, tuple[str, ...]]:
        """What makes two rows' document embeddings the same cached ones."""
        return self.encoder, self.tasks

    def line(self) -> str:
        tokens = (self.doc_tokens + self.query_tokens) / 1e6
        line = (f"{self.encoder}: {self.docs:,} documents and {self.queries:,} queries, ≤{tokens:,.1f}M tokens "
                f"(each document at {self.max_length:,}; the documents once for every row of this encoder)")
        usd = None if self.doc_usd is None else self.doc_usd + (self.query_usd or 0.0)
        hours = None if self.doc_hours is None else self.doc_hours + (self.query_hours or 0.0)
        return line + _cost_parts(usd, self.api, hours, "configs/reproduce/models.yaml gives no price_per_mtok")


def encode_estimate(name: str, spec: Any, tasks: Sequence[str], model: Any = None) -> EncodeEstimate | None:
    """The work of encoder entry ``spec`` (as it runs on ``tasks``) over the tasks' documents and
    queries, each text at its limit (``max_length``; an API's ``max_tokens``, or ``max_chars`` /
    :data:`CHARS_PER_TOKEN`): GPU-hours from :data:`ENCODER_TOKENS_PER_S` for a local encoder of
    known size (``model``: its ``models.yaml`` entry), dollars at its ``price_per_mtok`` for an API.
    None when a task's counts are unknown."""
    from r2med_agent.data import task_registry

    registry = task_registry()
    counts = [(getattr(registry.get(t), "docs", None), getattr(registry.get(t), "queries", None)) for t in tasks]
    if not tasks or any(not d or not q for d, q in counts):
        return None
    docs, queries = sum(d for d, _ in counts), sum(q for _, q in counts)  # type: ignore[misc]
    api = spec.kind == "api"
    if api:
        doc_len = query_len = int(spec.max_tokens or (spec.max_chars or 0) / CHARS_PER_TOKEN or spec.max_length)
    else:
        doc_len, query_len = spec.max_length_for("doc"), spec.max_length_for("query")
    doc_tokens, query_tokens = docs * doc_len, queries * query_len
    price = float(getattr(model, "price_per_mtok", 0.0) or 0.0)
    usd = (doc_tokens * price / 1e6, query_tokens * price / 1e6) if api and price else (None, None)
    size = float(getattr(model, "params_b", 0.0) or 0.0)
    hours = ((doc_tokens * size / ENCODER_TOKENS_PER_S / 3600, query_tokens * size / ENCODER_TOKENS_PER_S / 3600)
             if not api and size else (None, None))
    return EncodeEstimate(name, tuple(tasks), docs, doc_tokens, queries, query_tokens, doc_len,
                          usd[0], usd[1], hours[0], hours[1], api=api)
