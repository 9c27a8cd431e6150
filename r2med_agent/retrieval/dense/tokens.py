"""The token ids an encoder embeds: shared by the transformers and vLLM backends, so both embed
exactly the same tokens."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from r2med_agent.errors import ConfigError
from r2med_agent.retrieval.dense.spec import EncoderSpec

logger = logging.getLogger(__name__)


def prefix_token_count(tokenizer: Any, prefix: str) -> int:
    """How many leading tokens of ``prefix + text`` belong to the prefix, special tokens the
    tokenizer puts in front included: ``[CLS]`` (BERT) or ``<s>`` (Llama, Mistral: GritLM masks
    ``len(tokenizer(instruction))`` tokens, BOS included), but not a special token it appends at
    the end (``[SEP]``, T5's ``</s>``), which follows the text, not the prefix.

    The prefix's own tokens are located inside its tokenisation with special tokens; everything
    up to their end counts.
    """
    with_special: list[int] = list(tokenizer(prefix)["input_ids"])
    bare: list[int] = list(tokenizer(prefix, add_special_tokens=False)["input_ids"])
    if not bare:
        return 0
    for lead in range(len(with_special) - len(bare) + 1):
        if with_special[lead : lead + len(bare)] == bare:
            return lead + len(bare)
    # A tokenizer whose template rewrites the prefix's own tokens: count what it adds in front.
    logger.debug("prefix tokens not found inside the prefix's own tokenisation; counting them alone")
    mask = tokenizer(prefix, return_special_tokens_mask=True)["special_tokens_mask"]
    lead = next((i for i, m in enumerate(mask) if not m), 0)
    return lead + len(bare)


DECODED_TEXT_SLACK = 64
"""Tokens that a ``decoded-text`` cut (:func:`decoded_text_cut`) may have beyond ``max_length``
once its string is tokenized again: the special tokens the tokenizer adds, and the replacement
character that a multi-byte character cut in two decodes to. The vLLM backend sizes its context
with it; the transformers backend needs no limit."""


def decoded_text_cut(tokenizer: Any, texts: Sequence[str], max_length: int) -> list[str]:
    """The strings DIVER's ``Qwen3EmbeddingModel.truncate_text`` (AQ-MedAI/Diver,
    ``Retriever/retrievers.py``) gives the model: a text whose tokens without special tokens
    number more than ``max_length`` becomes the decoding of its first ``max_length`` tokens (the
    tokenizer's default decoding: special tokens kept, its own clean-up setting); any other text
    stays as it is."""
    bare: list[list[int]] = tokenizer(list(texts), add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return [tokenizer.decode(ids[:max_length]) if len(ids) > max_length else text for text, ids in zip(texts, bare)]


def encoder_token_ids(
    spec: EncoderSpec,
    tokenizer: Any,
    texts: Sequence[str],
    max_length: int,
    *,
    titles: Sequence[str] | None = None,
    token_types: bool = False,
    eos_id: int | None = None,
) -> tuple[list[list[int]], list[list[int]] | None]:
    """The token ids an encoder embeds, unpadded: each text (or (title, text) pair) cut on the
    right to ``max_length``, or to ``max_length - 1`` plus EOS with ``append_eos``; with
    ``token_types``, the segment ids of the pairs too. Both backends (transformers, vLLM) embed
    exactly these tokens. With ``truncation: decoded-text`` each text is first cut as
    :func:`decoded_text_cut` cuts it and then tokenized in full, special tokens added."""
    if spec.truncation == "decoded-text":
        cut = decoded_text_cut(tokenizer, texts, max_length)
        return tokenizer(cut, truncation=False, padding=False, return_attention_mask=False)["input_ids"], None
    limit = max_length - 1 if spec.append_eos else max_length
    kwargs: dict[str, Any] = dict(
        truncation=True if titles is None else "longest_first",
        max_length=limit,
        padding=False,
        return_attention_mask=False,
        return_token_type_ids=titles is not None and token_types,
    )
    enc = tokenizer(list(titles), list(texts), **kwargs) if titles is not None else tokenizer(list(texts), **kwargs)
    ids: list[list[int]] = enc["input_ids"]
    types: list[list[int]] | None = enc.get("token_type_ids") if titles is not None else None
    if spec.append_eos:
        eos = tokenizer.eos_token_id if eos_id is None else eos_id
        if eos is None:
            raise ConfigError(f"encoder '{spec.name}': append_eos set but the tokenizer has no EOS")
        ids = [x + [eos] for x in ids]
        if types is not None:
            types = [t + [t[-1] if t else 0] for t in types]
    return ids, types
