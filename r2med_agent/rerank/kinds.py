"""The reranker kinds: what each ``kind`` of a ``configs/rerankers.yaml`` entry is and can do.

Every kind declares its capabilities in :data:`RERANKER_KINDS`, and the code that needs one reads
the declaration, never the kind's name: the factory (what to build), the run spec (which settings
apply), the runner (how to call it), the prompt sources and importer (which prompt folder it
renders), ``reproduce --dry-run`` (what it loads and how many LLM calls it makes).

=================== ======== ========= ============= ========================================
kind                uses_llm has_model batches_tasks prompt folder
=================== ======== ========= ============= ========================================
cross-encoder       no       yes       no            none
listwise            yes      no        yes           ``rerank-listwise[-<format>]``
pointwise-reasoning yes      no        yes           ``rerank-pointwise[-<format>]``
groupwise           yes      no        yes           ``rerank-groupwise``
setwise             yes      no        yes           ``rerank-setwise``
=================== ======== ========= ============= ========================================

A new kind is one module (a class following the
:class:`~r2med_agent.rerank.spec.Reranker` protocol, with a builder
``build(entry, options) -> reranker``) registered as ``register("rerankers", "mine",
RerankerKind(build=..., ...))`` (:mod:`r2med_agent.plugins`), from your own package or, for a
built-in kind, as one line here; docs/rerankers.md, "Adding a reranker". The built-in kinds name their builders by import
path (``module:attribute``), so this table sits below the classes it lists and importing it loads
none of them; a kind registered from Python may give the builder itself.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from r2med_agent.plugins import PluginError, Registry

__all__ = ["RERANKER_KINDS", "RerankerKind", "RerankerOptions", "llm_kinds", "reranker_kind"]


@dataclass(frozen=True)
class RerankerOptions:
    """What a run passes to the reranker it builds; each kind reads what applies to it.

    Attributes:
        precision: overrides the entry's ``precision`` (kinds with a model).
        max_length: overrides the entry's ``max_length`` (``run --rerank-max-length``).
        device: as for encoders (the first device is used).
        backend: overrides the entry's ``backend`` (``auto``, ``transformers``, ``vllm``).
        show_progress: a progress bar over pairs.
        llm: an LLM to use instead of building the entry's ``llm`` (tests, notebooks).
        cache_path, use_cache, refresh, chunk_size: the generation cache of the LLM kinds.
        prompts_dir: the prompts folder the LLM kinds render from (None: the package's, or
            ``$R2MED_PROMPTS_DIR``).
    """

    precision: str | None = None
    max_length: int | None = None
    device: str | None = None
    backend: str | None = None
    show_progress: bool = False
    llm: Any = None
    cache_path: Path | str | None = None
    use_cache: bool = True
    refresh: bool = False
    chunk_size: Any = "auto"
    prompts_dir: Path | str | None = None


Work = Callable[[Any, int, float, int], "tuple[str, int, int]"]
"""``work(entry, k, doc_tokens, n_queries)``: ``(label, LLM calls, prompt tokens)`` of reranking the
top ``k`` of ``n_queries`` queries with candidates of ``doc_tokens`` tokens each (upper bounds)."""


@dataclass(frozen=True)
class RerankerKind:
    """One kind of reranker: how it is built and what it declares.

    Attributes:
        build: ``build(entry, options) -> Reranker`` (:class:`RerankerOptions`), or its import
            path ``"package.module:attribute"`` (imported when a reranker is built).
        uses_llm: an LLM of the registry answers (the entry's ``llm``): the entry needs ``llm``
            and no ``model``; the run's own LLM is shared when it is the same entry; its tokens,
            time and cost join the result's stats.
        has_model: it loads a model of its own (the entry's ``model``): ``--precision`` and
            ``--rerank-max-length`` apply, and ``reproduce`` counts its weights.
        batches_tasks: the runner calls ``rerank_tasks(jobs, k)`` once with every task (one
            generate call serves them all) instead of ``rerank(...)`` per task.
        prompt_folder: the prompt folder it renders (``prompts/<folder>/<family>.j2``); a
            ``format`` other than ``default`` renders ``<folder>-<format>``; None: no prompt.
        formats: the entry ``format`` values it takes.
        published_formats: the formats that follow a published reranker's code (the results
            the run spec's ``rerank_rules`` versions).
        fields: entry fields that only this kind reads (another kind's entry must leave them
            at their defaults).
        work: ``reproduce --dry-run``'s LLM work estimate (:data:`Work`); None: no LLM calls.
        about: one line for docs and listings.
    """

    build: str | Callable[..., Any]
    uses_llm: bool = False
    has_model: bool = False
    batches_tasks: bool = False
    prompt_folder: str | None = None
    formats: tuple[str, ...] = ("default",)
    published_formats: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    work: Work | None = None
    about: str = ""

    def builder(self) -> Callable[..., Any]:
        """The builder itself (an import path is imported now)."""
        if callable(self.build):
            return self.build
        module, _, attribute = self.build.partition(":")
        target: Any = importlib.import_module(module)
        for part in attribute.split("."):
            target = getattr(target, part)
        return target

    def folder(self, fmt: str = "default") -> str | None:
        """The prompt folder an entry of this kind with ``format`` ``fmt`` renders."""
        if self.prompt_folder is None:
            return None
        return self.prompt_folder if fmt == "default" else f"{self.prompt_folder}-{fmt}"


def _listwise_work(entry: Any, k: int, doc: float, n_queries: int) -> tuple[str, int, int]:
    from r2med_agent.rerank.llm import window_positions

    windows = window_positions(k, entry.window, entry.step)
    calls = n_queries * len(windows)
    p_in = int(sum(end - start for start, end in windows) * doc * n_queries + calls * 200)
    return f"{entry.name} ({len(windows)} windows of {entry.window} per query)", calls, p_in


def _pointwise_work(entry: Any, k: int, doc: float, n_queries: int) -> tuple[str, int, int]:
    calls = n_queries * k
    extra = " + forced ends" if entry.format == "rank1" else ", + 1-token judgments"
    return f"{entry.name} ({k} pairs per query{extra})", calls, int(calls * (doc + 300))


def _groupwise_work(entry: Any, k: int, doc: float, n_queries: int) -> tuple[str, int, int]:
    groups = math.ceil(k / entry.group_size)
    calls = n_queries * groups * entry.passes
    return (f"{entry.name} ({groups} groups of {entry.group_size} x {entry.passes} passes per query)", calls,
            int(calls * (min(entry.group_size, k) * doc + 400)))


def _setwise_work(entry: Any, k: int, doc: float, n_queries: int) -> tuple[str, int, int]:
    size = entry.num_child + 1
    # llm-rankers' heap sort: about k/size comparisons to build the heap, then about
    # log_size(k) per document taken from its top.
    per_query = math.ceil(k / size) + entry.select_k * max(1, math.ceil(math.log(max(k, 2)) / math.log(size)))
    calls = n_queries * per_query
    return f"{entry.name} (≈{per_query} comparisons of {size} per query)", calls, int(calls * (size * doc + 300))


_FACTORY = "r2med_agent.rerank.factory"



def _check_kind(registry: Registry[RerankerKind], name: str, kind: RerankerKind) -> RerankerKind:
    if not isinstance(kind, RerankerKind):
        raise PluginError(f"reranker kind '{name}' must be a RerankerKind, got {type(kind).__name__}")
    return kind


RERANKER_KINDS: Registry[RerankerKind] = Registry("rerankers", {
    "cross-encoder": RerankerKind(f"{_FACTORY}:build_cross_encoder", has_model=True,
                                  about="a scoring model over (query, document) pairs"),
    "listwise": RerankerKind(f"{_FACTORY}:build_llm_reranker", uses_llm=True, batches_tasks=True,
                             prompt_folder="rerank-listwise", formats=("default", "reasonrank", "insertrank"),
                             published_formats=("reasonrank",), fields=("run_scores",), work=_listwise_work,
                             about="an LLM orders sliding windows of candidates"),
    "pointwise-reasoning": RerankerKind(f"{_FACTORY}:build_llm_reranker", uses_llm=True, batches_tasks=True,
                                        prompt_folder="rerank-pointwise", formats=("default", "rank1"),
                                        published_formats=("rank1",), work=_pointwise_work,
                                        about="an LLM reasons about each (query, document) pair and judges it"),
    "groupwise": RerankerKind(f"{_FACTORY}:build_groupwise", uses_llm=True, batches_tasks=True,
                              prompt_folder="rerank-groupwise", published_formats=("default",), work=_groupwise_work,
                              about="an LLM scores groups of candidates, GroupRank's way"),
    "setwise": RerankerKind(f"{_FACTORY}:build_setwise", uses_llm=True, batches_tasks=True,
                            prompt_folder="rerank-setwise", published_formats=("default",), work=_setwise_work,
                            about="an LLM picks the best of small sets in a heap sort, Rank-R1's way"),
}.items(), _check_kind)
"""Kind -> its declaration, in the order listings show them."""


def reranker_kind(name: str) -> RerankerKind:
    """The declaration of kind ``name``.

    Raises:
        ValueError: an unknown kind (the message lists the known ones).
    """
    kind = RERANKER_KINDS.get(name)
    if kind is None:
        raise ValueError(f"kind must be one of {', '.join(RERANKER_KINDS)}, got {name!r}")
    return kind


def llm_kinds() -> list[str]:
    """The kinds an LLM answers (``uses_llm``)."""
    return [name for name, kind in RERANKER_KINDS.items() if kind.uses_llm]
