"""The token ids an encoder embeds: shared by the transformers and vLLM backends, so both embed
exactly the same tokens; and the character cuts that bound what any tokenizer of the project sees
(:func:`bounded_token_ids`: both encoder backends, the API encoder's ``hf_tokenizer`` and the
cross-encoders' pairs)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from r2med_agent.errors import ConfigError
from r2med_agent.retrieval.dense.spec import EncoderSpec

logger = logging.getLogger(__name__)

CHARS_PER_TOKEN_BOUND = 32
"""Texts are cut to ``max_length`` times this many characters before the tokenizer sees them: a
fast tokenizer tokenizes a whole text before truncating it, so one 50 MB document took gigabytes.
A text whose cut still fills ``max_length`` tokens embeds exactly as before (the tokens past the
cut are dropped by truncation anyway). A cut that falls short (a text of long "words" or of
much whitespace) is tried again longer (:func:`_cuts`)."""

MAX_CHARS_PER_TOKEN = 2048
"""The longest cut: ``max_length`` times this many characters (half a million for a 256-token
model), so no text costs more than that to tokenize, whatever it holds. Cuts grow fourfold from
:data:`CHARS_PER_TOKEN_BOUND` characters per token until they fill ``max_length`` tokens; a text
that does not by then is embedded from its cut (a word of a 512-token model takes at most a few
dozen characters; only text of hundreds of kilobytes that the tokenizer drops, such as control
characters, gets there). For a tokenizer that drops whitespace between words (BERT's, MiniLM's),
runs of whitespace are first made one space, which changes no token."""

_WHITESPACE_RUN = re.compile("[\t\n\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]{2,}")
"""Two or more characters that a BERT tokenizer turns into spaces and splits words on (Unicode's
White_Space without the control characters, which its normalizer deletes instead)."""


def _cuts(max_length: int) -> list[int]:
    """The lengths a text is cut to before tokenizing, shortest first (:data:`MAX_CHARS_PER_TOKEN`)."""
    sizes = [max_length * CHARS_PER_TOKEN_BOUND]
    while sizes[-1] < max_length * MAX_CHARS_PER_TOKEN:
        sizes.append(min(sizes[-1] * 4, max_length * MAX_CHARS_PER_TOKEN))
    return sizes


def _drops_whitespace_runs(tokenizer: Any) -> bool:
    """Whether a run of whitespace between words gives the tokens one space gives: a fast
    tokenizer with BERT's normalizer (or none) and a pre-tokenizer that splits words on
    whitespace and drops it (BERT, MiniLM and their kin)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    normalizer = type(backend.normalizer).__name__ if backend.normalizer is not None else None
    pre = type(backend.pre_tokenizer).__name__ if backend.pre_tokenizer is not None else None
    return normalizer in (None, "BertNormalizer") and pre in ("BertPreTokenizer", "Whitespace",
                                                             "WhitespaceSplit")


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


Tokenize = Callable[[list[str], "list[str] | None"], tuple[list[list[int]], "list[list[int]] | None"]]
"""``(texts, titles) -> (ids, segment ids or None)``: a tokenizer call on (cut) texts, or on
(title, text) pairs when ``titles`` is not None."""


@dataclass(frozen=True)
class BoundedIds:
    """What :func:`bounded_token_ids` gives: the ids (and segment ids) per text, the text (and
    title) each row's ids came from, and whether that is the whole text (runs of whitespace made
    one space where the tokenizer drops them) or a cut of it."""

    ids: list[list[int]]
    types: list[list[int]] | None
    texts: list[str]
    titles: list[str] | None
    whole: list[bool]


def bounded_token_ids(
    tokenizer: Any, texts: Sequence[str], limit: int, tokenize: Tokenize, *, titles: Sequence[str] | None = None,
) -> BoundedIds:
    """``tokenize`` over every text (and title) cut first (:func:`_cuts`), so the cost is bounded
    by ``limit`` whatever a text holds: a row whose cut gives ``limit`` tokens or more is done (the
    tokens past the cut would be cut anyway); a shorter one is tried on its squeezed text (runs of
    whitespace made one space, where ``tokenizer`` drops them), then on longer cuts, up to
    :data:`MAX_CHARS_PER_TOKEN` characters a token. ``tokenize`` is called on cut strings only."""
    texts, titles = list(texts), list(titles) if titles is not None else None
    sizes = _cuts(limit)

    def ids_of(rows: Sequence[int], size: int) -> Any:
        return tokenize([texts[i][:size] for i in rows],
                        [titles[i][:size] for i in rows] if titles is not None else None)

    def longer(i: int, size: int) -> bool:
        return len(texts[i]) > size or (titles is not None and len(titles[i]) > size)

    ids, types = ids_of(range(len(texts)), sizes[0])
    used = [sizes[0]] * len(texts)
    short = [i for i in range(len(texts)) if longer(i, sizes[0]) and len(ids[i]) < limit]
    squeezed: list[int] = []
    if short and _drops_whitespace_runs(tokenizer):  # runs of whitespace made one space
        for i in short:
            text = _WHITESPACE_RUN.sub(" ", texts[i])
            title = _WHITESPACE_RUN.sub(" ", titles[i]) if titles is not None else None
            if len(text) < len(texts[i]) or (title is not None and titles is not None and len(title) < len(titles[i])):
                texts[i] = text
                if titles is not None and title is not None:
                    titles[i] = title
                squeezed.append(i)
    for size in sizes:  # the cut fell short: the same cut of squeezed texts, then longer ones
        rows = squeezed if size == sizes[0] else short
        if not rows:
            continue
        more_ids, more_types = ids_of(rows, size)
        for n, i in enumerate(rows):
            ids[i] = more_ids[n]
            used[i] = size
            if types is not None and more_types is not None:
                types[i] = more_types[n]
        short = [i for i in short if longer(i, size) and len(ids[i]) < limit]
    return BoundedIds(
        ids=ids, types=types, texts=[t[:size] for t, size in zip(texts, used)],
        titles=[t[:size] for t, size in zip(titles, used)] if titles is not None else None,
        whole=[not longer(i, used[i]) for i in range(len(texts))],
    )
