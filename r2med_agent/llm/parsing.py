"""Reasoning-output parsing: split a raw generation into (reasoning, final response).

The final response is what becomes the retrieval query (docs/protocol.md, "Reasoning output"). Each format mirrors the R2MED reference's extraction:

``plain``
    Non-reasoning models: the whole text is the final response.
``think``
    DeepSeek-R1 distills, QwQ, Qwen3 with thinking, and API reasoning models whose backend wraps
    the separate reasoning in ``<think>...</think>``: the final response is the text after the
    FIRST ``</think>``; the reasoning is what precedes it, without a leading ``<think>``. With no
    ``</think>`` (an unclosed or absent block, e.g. a generation cut by ``max_tokens``) the whole
    text is the final response, as in the reference.
``huatuo``
    HuatuoGPT-o1 (``## Thinking ... ## Final Response ...``): the final response is the text after
    the first ``Final Response`` (whitespace after it skipped; a colon there stays in the
    response, as the reference's ``Final Response\s*(.*)`` keeps it); the reasoning is what
    precedes the marker's line, without the ``## Thinking`` heading. With no marker the whole text
    is the final response.
``search-r1``
    Search-R1 checkpoints: the first ``<answer>...</answer>`` span; the reasoning is the text
    before it. With no complete span the whole text is the final response.

Whitespace follows the reference (``split_response_for_r1`` in R2MED's ``src/base.py``): a final
response found after a marker is stripped; a whole text used as the final response (``plain``,
or no marker found) is kept exactly as generated. Only tokenizers that encode surrounding
whitespace see the difference (NV-Embed-v2's; BM25 and BERT-style tokenizers do not). The
reasoning is always stripped.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

from r2med_agent.errors import ConfigError

ReasoningFormat = Literal["plain", "think", "huatuo", "search-r1"]
"""The reasoning-output formats ``split_reasoning`` understands."""

REASONING_FORMATS: tuple[str, ...] = get_args(ReasoningFormat)

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
# "Final Response", optionally as a markdown heading ("## Final Response"); the final response
# starts after the whitespace that follows it (a colon is part of the response, as in the reference).
_HUATUO_FINAL = re.compile(r"(?:^[ \t]*#+[ \t]*)?Final Response\s*", re.MULTILINE)
_HUATUO_THINKING = re.compile(r"^\s*(?:#+[ \t]*)?Thinking[ \t]*:?")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def split_reasoning(text: str, fmt: str) -> tuple[str, str]:
    """Split a raw generation into ``(reasoning, final)``.

    Args:
        text: the raw generated text.
        fmt: one of ``plain``, ``think``, ``huatuo``, ``search-r1`` (see the module docstring).

    Returns:
        ``(reasoning, final)``: ``reasoning`` stripped (empty when the format finds none);
        ``final`` stripped when a marker was found, else the text as it is (module docstring).

    Raises:
        ConfigError: ``fmt`` is not a known format.
    """
    if fmt == "plain":
        return "", text
    if fmt == "think":
        return _split_think(text)
    if fmt == "huatuo":
        return _split_huatuo(text)
    if fmt == "search-r1":
        return _split_search_r1(text)
    raise ConfigError(
        f"unknown reasoning_format {fmt!r}; allowed: {', '.join(REASONING_FORMATS)}"
    )


def _split_think(text: str) -> tuple[str, str]:
    i = text.find(_THINK_CLOSE)
    if i == -1:
        return "", text
    reasoning = text[:i].strip()
    if reasoning.startswith(_THINK_OPEN):
        reasoning = reasoning[len(_THINK_OPEN) :].strip()
    return reasoning, text[i + len(_THINK_CLOSE) :].strip()


def _split_huatuo(text: str) -> tuple[str, str]:
    m = _HUATUO_FINAL.search(text)
    if m is None:
        return "", text
    reasoning = _HUATUO_THINKING.sub("", text[: m.start()], count=1).strip()
    return reasoning, text[m.end() :].strip()


def _split_search_r1(text: str) -> tuple[str, str]:
    m = _ANSWER.search(text)
    if m is None:
        return "", text
    return text[: m.start()].strip(), m.group(1).strip()


def check_format(fmt: str) -> str:
    """Return ``fmt`` if it is a known reasoning format, else raise ConfigError naming the allowed ones."""
    if fmt not in REASONING_FORMATS:
        raise ConfigError(
            f"unknown reasoning_format {fmt!r}; allowed: {', '.join(REASONING_FORMATS)}"
        )
    return fmt
