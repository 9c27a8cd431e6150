"""HyDE, Query2Doc, LameR and BRIGHT's reasoning queries: one LLM call per query, whose output
expands the query (or, for ``reason``, replaces it).

The prompts live in ``prompts/<method>/<family>.j2``; docs/protocol.md ("Prompts") gives
what each must contain, and its table how the generated text becomes the retrieval query (the
``combine`` rule each class sets).
"""

from __future__ import annotations

import hashlib
from typing import Any

from r2med_agent.prompts import templates as prompts
from r2med_agent.errors import DataError
from r2med_agent.methods.base import ExpansionMethod
from r2med_agent.types import Run, Task

LAMER_TOP_K = 10
"""LameR shows the model the top 10 documents of the first pass."""

LAMER_MAX_WORDS = 512
"""Each first-pass document is cut to its first 512 whitespace-separated tokens."""


def cut_words(text: str, max_words: int) -> str:
    """The first ``max_words`` whitespace-separated tokens of ``text``, joined by single spaces.

    Newlines and runs of whitespace become single spaces even when nothing is cut, so every
    document shows as one line in the prompt.
    """
    return " ".join(text.split()[:max_words])


def top_doc_ids(run: Run, query_id: str, k: int) -> list[str]:
    """The ``k`` best documents of ``query_id`` in ``run``, highest score first.

    Ties keep the run's own order (retrievers insert documents in rank order).
    """
    ranked = sorted(run.get(query_id, {}).items(), key=lambda kv: -kv[1])
    return [doc_id for doc_id, _ in ranked[:k]]


class HyDE(ExpansionMethod):
    """Hypothetical Document Embeddings: the model writes a passage that answers the query.

    Prompt: an instruction, the query, then ``Passage:`` (``Similar Case:`` for the
    similar-case tasks). BM25 searches with the passage only.
    """

    name = "hyde"
    combine = "hyde"


class Reason(ExpansionMethod):
    """BRIGHT's reasoning queries (Su et al., ICLR 2025, ``reason.py``): the model reasons about the
    query (the essential problem, what would help, a draft answer) and its whole output replaces the
    query for every retriever (``combine="rewrite"``), dense ones after their instruction.

    Prompt: ``prompts/reason/<family>.j2`` (the project's wording; ``prompts import`` of a BRIGHT
    clone writes BRIGHT's own). BRIGHT's released reasoning queries of GPT-4, Claude-3-Opus,
    Llama-3-70B, Gemini-1.0 and GritLM are this method's released generations
    (``--generations bright``).
    """

    name = "reason"
    combine = "rewrite"


class Query2Doc(ExpansionMethod):
    """Query2Doc: HyDE's prompt with two worked in-domain examples before the real query.

    The examples come from ``prompts/query2doc/examples/<family>.yaml`` (per domain for the
    Q&A tasks; per task in files imported from R2MED's own examples with ``r2med-agent prompts
    import-examples``). BM25 searches with the query twice followed by the passage.
    """

    name = "query2doc"
    combine = "query2doc"

    def template_variables(self, task: Task, first_pass: Run | None) -> list[dict[str, Any]]:
        examples = prompts.load_examples(
            self.name, task.family, task.domain, prompts_dir=self.prompts_dir, task=_registry_base(task.name)
        )
        return [{**self._base_variables(task, q), "examples": examples} for q in task.queries]


def _registry_base(name: str) -> str:
    """The full R2MED task behind ``name`` (``nano-Biology``, ``r2med-demo`` -> ``Biology``), or
    ``name`` itself for a task the registry does not know."""
    from r2med_agent.data import base_task_name
    from r2med_agent.errors import ConfigError

    try:
        return base_task_name(name)
    except ConfigError:
        return name


class LameR(ExpansionMethod):
    """LameR: the model sees the query with the top-10 documents of a first pass (most of them
    wrong, the prompt says) and writes a correct passage. BM25 searches with query + passage.

    ``build_prompts`` needs the first-pass run (the runner makes it with BM25); its documents
    are numbered ``[1]. ...`` in rank order, each cut to its first 512 whitespace tokens.
    """

    name = "lamer"
    combine = "lamer"
    needs_first_pass = True
    first_pass_depth = LAMER_TOP_K

    def template_variables(self, task: Task, first_pass: Run | None) -> list[dict[str, Any]]:
        if first_pass is None:
            raise ValueError("LameR needs a first-pass run")
        texts = {doc.doc_id: doc.full_text for doc in task.corpus}
        out: list[dict[str, Any]] = []
        for q in task.queries:
            if q.query_id not in first_pass:
                raise ValueError(f"{task.name}: first-pass run has no entry for query {q.query_id}")
            documents = []
            for doc_id in top_doc_ids(first_pass, q.query_id, LAMER_TOP_K):
                if doc_id not in texts:
                    raise DataError(
                        f"first-pass run names document {doc_id} for query {q.query_id}, "
                        f"which is not in the corpus of {task.name}"
                    )
                documents.append(cut_words(texts[doc_id], LAMER_MAX_WORDS))
            out.append({**self._base_variables(task, q), "documents": documents})
        return out

    def template_hash(self, task: Task) -> str:
        # The document cut and count shape the prompt as much as the template does.
        base = super().template_hash(task)
        extra = f"{base}\0top_k={LAMER_TOP_K}\0max_words={LAMER_MAX_WORDS}"
        return hashlib.sha256(extra.encode()).hexdigest()
