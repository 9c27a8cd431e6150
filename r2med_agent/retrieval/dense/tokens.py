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
    exactly these tokens."""
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
