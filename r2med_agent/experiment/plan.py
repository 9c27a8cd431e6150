"""A run's plan: everything resolving a run looked up, merged and checked, in one frozen,
picklable object (:func:`~r2med_agent.experiment.resolve.resolve`).

The runner, the estimates and the prompt fetching read a plan, never a registry: the method
class, the LLM entry, the reranker entry and its kind, the declared facts of every retriever the
run searches with, the final sampling of the method's generations (the LLM's defaults merged with
the run's overrides once), the prompt folders the run renders and where its generations come
from. A plan holds data and classes by reference only, so it pickles and rebuilds identically in
another process (a grid on a cluster ships plans).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from r2med_agent.errors import ConfigError
from r2med_agent.experiment.spec import RunSpec
from r2med_agent.types import SamplingParams

__all__ = ["RetrieverFacts", "RunPlan"]


@dataclass(frozen=True)
class RetrieverFacts:
    """What a retriever kind declares about one retriever word of the run
    (:class:`~r2med_agent.retrieval.registry.RetrieverKind`, without its builder)."""

    word: str
    combine: str
    has_model: bool
    settings: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunPlan:
    """One run, resolved.

    Attributes:
        spec: the run's resolved spec (its identity: folder, row, cache keys).
        method: the method's class (``spec.method`` in the method registry).
        llm: the LLM entry that generates (:class:`~r2med_agent.llm.registry.LLMSpec`); None for a
            run without one, or where the entry is unknown (``llm_problem`` says so).
        llm_problem: why a run that needs its LLM's entry has none (the registry's message).
        reranker: the reranker entry (:class:`~r2med_agent.rerank.spec.RerankerSpec`).
        reranker_kind: its kind's declaration (:class:`~r2med_agent.rerank.kinds.RerankerKind`).
        reranker_problem: why a run with a reranker has no entry (the registry's message).
        reranker_llm: the LLM entry an LLM reranker's entry names (its prices price its tokens).
        retrievers: the declared facts of every retriever word the run searches with.
        encoders: ``(word, encoder entry)`` of every searched word that names an encoder entry
            (:class:`~r2med_agent.retrieval.dense.spec.EncoderSpec`), and of the dense encoder a
            rebuilt shipped list fuses with (:data:`~r2med_agent.retrieval.candidates.DENSE_ENCODER`).
        sampling: the final sampling of the method's generations (None: nothing generates).
        prompt_folders: ``(folder, reader LLM, authors' source or None)`` of every prompt folder
            the run renders (:func:`~r2med_agent.prompts.sources.split_folders`).
        plugins: ``(component, who registered it)`` of each component of the run that is not
            built in (``"rerankers toy"``, ``"plugin 'toy' (toy_pkg) of distribution toy-pkg
            0.1"``): recorded with the results, so a reader knows which package made them.
        source: the registered source of released generations the method's texts come from
            (:class:`~r2med_agent.data.sources.GenerationSource`; None: ``fresh``, an LLM).
    """

    spec: RunSpec
    method: type[Any]
    llm: Any = None
    llm_problem: str | None = None
    reranker: Any = None
    reranker_kind: Any = None
    reranker_problem: str | None = None
    reranker_llm: Any = None
    retrievers: tuple[RetrieverFacts, ...] = ()
    encoders: tuple[tuple[str, Any], ...] = ()
    sampling: SamplingParams | None = None
    prompt_folders: tuple[tuple[str, str | None, str | None], ...] = ()
    source: Any = None
    plugins: tuple[tuple[str, str], ...] = ()

    @property
    def generates(self) -> bool:
        """Whether the method's texts are generated in this run (an LLM method, fresh generations)."""
        return bool(getattr(self.method, "uses_llm", False)) and self.source is None

    @property
    def released(self) -> Any:
        """The source of released generations an LLM method's texts come from (None: generated)."""
        return self.source if getattr(self.method, "uses_llm", False) else None

    def llm_entry(self) -> Any:
        """The LLM entry a run that generates needs (ConfigError, the registry's message, where unknown)."""
        return _known(self.llm, self.llm_problem)

    def reranker_entry(self) -> Any:
        """The reranker entry (None without one; ConfigError, the registry's message, where unknown)."""
        return _known(self.reranker, self.reranker_problem)

    def encoder(self, word: str) -> Any:
        """The encoder entry of a retriever word the run searches with (None: no encoder entry)."""
        return dict(self.encoders).get(word)

    def with_spec(self, spec: RunSpec) -> RunPlan:
        """This plan for ``spec``, the same run with the hashes a config adds (``prompts``,
        ``entries``, ``candidates``) filled in."""
        from dataclasses import replace

        return replace(self, spec=spec)


def _known(entry: Any, problem: str | None) -> Any:
    if entry is None and problem:
        raise ConfigError(problem)
    return entry
