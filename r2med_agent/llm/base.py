"""The protocol every LLM backend implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from r2med_agent.types import Generation, Message, SamplingParams


@runtime_checkable
class LLM(Protocol):
    """Batch in, batch out: ``generate`` returns one Generation per prompt, in input order.

    Backends fill ``text``, ``finish_reason``, ``stop_reason`` and token usage; reasoning-output
    parsing (``final``/``reasoning``) is applied by the caching wrapper from the model's registry
    entry, so every backend gets it the same way.
    """

    model_id: str

    def generate(
        self, prompts: Sequence[list[Message]], params: SamplingParams
    ) -> list[Generation]: ...
