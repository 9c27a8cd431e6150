"""The shape of single-shot query-expansion methods (HyDE, Query2Doc, LameR) and the plain query.

An expansion method is split in two halves around the LLM so that the runner can send the prompts
of every task in ONE ``llm.generate`` call: ``build_prompts`` renders one conversation per query,
``to_requests`` turns the generations back into :class:`SearchRequest` records whose ``combine``
rule tells the retriever how to mix the query and the generated text (the table of docs/protocol.md).
Methods never call the LLM or a retriever themselves and never write files.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from r2med_agent import prompt_templates as prompts
from r2med_agent.types import Combine, Generation, Message, Query, Run, SearchRequest, Task

log = logging.getLogger(__name__)


class ExpansionMethod:
    """Base class of the single-shot expansion methods.

    A subclass sets the class attributes and, when its template needs more than the query and
    the task's domain, overrides :meth:`template_variables`.

    Attributes:
        name: registry name; also the prompt folder (``prompts/<name>/<family>.j2``).
        combine: the SearchRequest rule for this method's generations.
        needs_first_pass: True when ``build_prompts`` needs a first-pass run (LameR).
        uses_llm: False only for the plain-query method.
        agentic: False: single-shot (the runner checks this to pick the agentic path).
    """

    name: ClassVar[str]
    combine: ClassVar[Combine]
    needs_first_pass: ClassVar[bool] = False
    uses_llm: ClassVar[bool] = True
    agentic: ClassVar[bool] = False

    def __init__(self, prompts_dir: str | os.PathLike[str] | None = None) -> None:
        """Create the method.

        Args:
            prompts_dir: a folder of prompt files overriding the package's files of the same
                name (default: ``$R2MED_PROMPTS_DIR`` if set, else the package's own prompts).
        """
        self.prompts_dir: Path | None = Path(prompts_dir) if prompts_dir is not None else None

    def template_path(self, task: Task) -> str:
        """The template this method renders for ``task``: ``<name>/<family>.j2``."""
        return f"{self.name}/{task.family}.j2"

    def template_variables(self, task: Task, first_pass: Run | None) -> list[dict[str, Any]]:
        """The template variables of every query, in ``task.queries`` order.

        The base gives ``query`` (the query text), ``domain`` and ``family``.
        """
        return [self._base_variables(task, q) for q in task.queries]

    @staticmethod
    def _base_variables(task: Task, query: Query) -> dict[str, Any]:
        return {"query": query.text, "domain": task.domain, "family": task.family}

    def build_prompts(self, task: Task, first_pass: Run | None = None) -> list[list[Message]]:
        """One conversation per query of ``task``, in ``task.queries`` order.

        Each conversation is the user message only; the LLM backend adds the registry's system
        prompt. Trailing whitespace of the rendered template is dropped.

        Args:
            task: the task whose queries get prompts.
            first_pass: a first-pass run over ``task`` (required when ``needs_first_pass``).

        Raises:
            ValueError: ``first_pass`` is missing for a method that needs it.
            ConfigError: the template is missing, broken, or needs a variable not given.
        """
        if self.needs_first_pass and first_pass is None:
            raise ValueError(f"method '{self.name}' needs a first-pass run (first_pass=None given)")
        path = self.template_path(task)
        return [
            [{"role": "user", "content": prompts.render(path, prompts_dir=self.prompts_dir, **v).rstrip()}]
            for v in self.template_variables(task, first_pass)
        ]

    def template_hash(self, task: Task) -> str:
        """Hash of the template files (and examples) behind this task's prompts; changes on edit."""
        return prompts.template_hash(self.name, task.family, prompts_dir=self.prompts_dir)

    def to_requests(self, task: Task, generations: Sequence[Generation]) -> list[SearchRequest]:
        """Search requests from the generations, one per query, in ``task.queries`` order.

        The expansion is ``Generation.final`` (the response after reasoning-output parsing).
        An empty one falls back to the plain query (``combine="none"``) with a warning naming
        the query, so that a failed generation never turns into an empty search.

        Raises:
            ValueError: the number of generations differs from the number of queries.
        """
        if len(generations) != len(task.queries):
            raise ValueError(
                f"{task.name}: {len(generations)} generations for {len(task.queries)} queries"
            )
        out: list[SearchRequest] = []
        for query, gen in zip(task.queries, generations):
            expansion = gen.final.strip()
            if not expansion:
                log.warning(
                    "%s: empty %s generation for query %s (finish_reason=%s); searching with the plain query",
                    task.name, self.name, query.query_id, gen.finish_reason,
                )
                out.append(SearchRequest(query.query_id, query.text))
            else:
                out.append(SearchRequest(query.query_id, query.text, expansion, self.combine))
        return out


class NoneMethod(ExpansionMethod):
    """The plain query: no prompts, no LLM, ``combine="none"``."""

    name = "none"
    combine = "none"
    uses_llm = False

    def template_variables(self, task: Task, first_pass: Run | None) -> list[dict[str, Any]]:
        return []

    def build_prompts(self, task: Task, first_pass: Run | None = None) -> list[list[Message]]:
        return []

    def template_hash(self, task: Task) -> str:
        return ""

    def to_requests(self, task: Task, generations: Sequence[Generation] = ()) -> list[SearchRequest]:
        """One plain-query request per query.

        Raises:
            ValueError: generations were given (this method makes none).
        """
        if generations:
            raise ValueError(f"method 'none' takes no generations, got {len(generations)}")
        return [SearchRequest(q.query_id, q.text) for q in task.queries]
