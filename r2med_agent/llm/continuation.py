"""Continuing a conversation's final assistant message, shared by the backends.

A conversation that ends with an assistant message asks the model to CONTINUE that text (the
reasoning-search loops re-submit a trajectory's running text that way). The vLLM backend and the
OpenAI-compatible backend's ``vllm`` servers render such a prompt the same way, with
:func:`continuation_prompt`; the vLLM module docstring explains why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from r2med_agent.types import Message


def continues_final_message(messages: Sequence[Message]) -> bool:
    """True when the conversation ends with an assistant message (to be continued, not answered)."""
    return bool(messages) and messages[-1].get("role") == "assistant"


def continuation_prompt(
    tokenizer: Any, conversation: Sequence[Message], chat_template_kwargs: dict[str, Any] | None = None
) -> str:
    """The prompt text that continues the final assistant message of ``conversation``: the
    messages before it rendered by ``tokenizer``'s chat template with the generation prompt,
    then that message's text exactly as it is (see the vLLM backend's module docstring). A
    conversation of that one message is raw text (no chat template): its text is the prompt."""
    head = [dict(m) for m in conversation[:-1]]
    if not head:
        return str(conversation[-1].get("content") or "")
    rendered = tokenizer.apply_chat_template(
        head, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
    )
    return str(rendered) + str(conversation[-1].get("content") or "")
