"""Scripted fake LLM for unit tests only (end-to-end tests use the real local model)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from r2med_agent.llm.base import PromptMeta, TemplateHashes
from r2med_agent.types import Generation, Message, SamplingParams

Script = Callable[[list[Message], SamplingParams], str]


class ScriptedLLM:
    """Answers each prompt with ``script(messages, params)``; records every call.

    A stop string in ``params.stop`` cuts the scripted text there, as a real backend would
    (the stop string itself is dropped and reported as ``stop_reason``).
    """

    def __init__(self, script: Script, model_id: str = "scripted") -> None:
        self.script = script
        self.model_id = model_id
        self.calls: list[list[list[Message]]] = []

    def generate(
        self, prompts: Sequence[list[Message]], params: SamplingParams, *, sample_index: int = 0,
        template_hash: TemplateHashes = "", meta: Sequence[PromptMeta] | None = None,
    ) -> list[Generation]:
        """The scripted texts; the request options (the cache's) do not change them."""
        self.calls.append([list(p) for p in prompts])
        out = []
        for messages in prompts:
            text = self.script(list(messages), params)
            stop_reason = None
            cut = len(text)
            for s in params.stop:
                i = text.find(s)
                if i != -1 and i < cut:
                    cut, stop_reason = i, s
            text = text[:cut]
            out.append(
                Generation(
                    text=text,
                    final=text,
                    finish_reason="stop",
                    stop_reason=stop_reason,
                    prompt_tokens=sum(len(m["content"].split()) for m in messages),
                    completion_tokens=len(text.split()),
                )
            )
        return out
