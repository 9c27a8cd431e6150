"""Where a run's generations come from besides an LLM: the registered sources of released
generations, keyed by ``--generations`` (a run's plan holds its source; the runner reads it and
names no benchmark).

A source says what it is (``about``, for the log), whether a run needs its LLM's registry entry
(R2MED's released texts are parsed in the entry's reasoning format; BRIGHT's reasoning LLMs have
none), how it loads one task's generations and what it checks before any work. Its functions are
named ``module:function`` so a plan that holds it pickles.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from r2med_agent.types import Generation, Task

__all__ = ["GENERATION_SOURCES", "GenerationSource", "generation_source"]


@dataclass(frozen=True)
class GenerationSource:
    """A source of released generations.

    Attributes:
        name: the ``--generations`` value.
        about: what it is, for the log (``R2MED's released generations``).
        needs_llm_entry: whether a run needs its LLM's registry entry.
        loader: ``module:function`` ``(task, plan, data_dir) -> (generations, provenance)``.
        checker: ``module:function`` ``(plan, task names, data_dir)``, run before any work (None: none).
    """

    name: str
    about: str
    needs_llm_entry: bool
    loader: str
    checker: str | None = None

    def load(self, task: Task, plan: Any, data_dir: Path | None) -> tuple[list[Generation], str]:
        """One task's generations, in ``task.queries`` order, and the files' provenance."""
        return _function(self.loader)(task, plan, data_dir)

    def check(self, plan: Any, task_names: Sequence[str], data_dir: Path | None) -> None:
        """Refuse, before any other work, what the source cannot give (ConfigError)."""
        if self.checker is not None:
            _function(self.checker)(plan, task_names, data_dir)


def _function(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _r2med_load(task: Task, plan: Any, data_dir: Path | None) -> tuple[list[Generation], str]:
    """R2MED's released texts, parsed in the method's own output format (Search-R1's ``<answer>``)
    where it has one, else the LLM entry's reasoning format."""
    from r2med_agent.data.released import load_generations

    fmt = plan.method.output_format or plan.llm_entry().reasoning_format
    return load_generations(task, plan.spec.method, plan.spec.llm, fmt, data_dir)


def _r2med_check(plan: Any, task_names: Sequence[str], data_dir: Path | None) -> None:
    from r2med_agent.data.released import check_samples

    check_samples(task_names, plan.spec.method, plan.spec.llm or "", plan.spec.samples, data_dir)


def _bright_load(task: Task, plan: Any, data_dir: Path | None) -> tuple[list[Generation], str]:
    from r2med_agent.data.bright_released import load_reasoning_generations

    return load_reasoning_generations(task, plan.spec.llm, data_dir)


GENERATION_SOURCES: dict[str, GenerationSource] = {
    "r2med": GenerationSource("r2med", "R2MED's released generations", True,
                              f"{__name__}:_r2med_load", f"{__name__}:_r2med_check"),
    "bright": GenerationSource("bright", "BRIGHT's released reasoning queries", False, f"{__name__}:_bright_load"),
}
"""The sources of released generations, by ``--generations`` value (``fresh``: an LLM, no source)."""


def generation_source(name: str) -> GenerationSource | None:
    """The registered source ``name`` (None: ``fresh``, the run's own LLM)."""
    return GENERATION_SOURCES.get(name)
