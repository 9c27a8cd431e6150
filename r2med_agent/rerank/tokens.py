"""Cutting a reranker's passages (and Rank-R1's query) to a number of tokens of its own LLM's
tokenizer, as the published rerankers do, and ReasonRank's ftfy text repair.

ReasonRank (``utils.py``, ``convert_doc_to_prompt_content``) and llm-rankers' setwise ranker
(``SetwiseLlmRanker.truncate``, which Rank-R1's evaluation script uses) cut a text the same way:
the tokenizer splits it into tokens, the first ``n`` are kept and turned back into text
(``convert_tokens_to_string``). The text is always round-tripped, so a tokenizer that normalises
(NFC, lower case) changes short texts too, as it does for them.

The tokenizer is that of the reranker's LLM entry, loaded as the project loads tokenizers
elsewhere (:func:`~r2med_agent.methods.loop.load_token_cut`, Search-R1's observation cut): a
``local`` entry's GGUF vocabulary (read without the weights), else the ``transformers`` tokenizer
of the entry's ``tokenizer`` (default ``model``; only tokenizer files are read). When neither can
be loaded, a warning says so, whitespace-separated words stand in for tokens, and the reranker's
stats say which cut ran (``passage_cut``), so a result never hides it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from r2med_agent.errors import MissingExtraError

logger = logging.getLogger(__name__)

TokenCut = Callable[[str, int], str]
"""``(text, n) -> text``: ``text`` cut to its first ``n`` tokens, turned back into text."""

WORDS = "whitespace words (the tokenizer could not be loaded)"
"""The ``how`` of the fallback cut."""


@dataclass(frozen=True)
class PassageCut:
    """A loaded cut, its token count, and how it counts (``tokenizer <name>`` or :data:`WORDS`)."""

    cut: TokenCut
    how: str
    count: Callable[[str], int] = lambda text: len(text.split())
    """How many tokens ``text`` has (without special tokens)."""


def tokens_to_text(tokenizer: Any) -> TokenCut:
    """The cut of a ``transformers`` tokenizer: ``convert_tokens_to_string(tokenize(text)[:n])``,
    applied to every text (the published rerankers' truncation)."""

    def cut(text: str, n: int) -> str:
        return tokenizer.convert_tokens_to_string(tokenizer.tokenize(text)[:n])

    return cut


def gguf_cut(vocab: Any) -> TokenCut:
    """The same cut with a llama.cpp vocabulary (``Llama(..., vocab_only=True)``): tokens without
    a BOS, back to text with bytes that end inside a character dropped."""

    def cut(text: str, n: int) -> str:
        ids = vocab.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        return vocab.detokenize(ids[:n]).decode("utf-8", "ignore")

    return cut


def cut_words(text: str, n: int) -> str:
    """The fallback: ``text`` up to the end of its ``n``-th whitespace-separated word."""
    words = list(re.finditer(r"\S+", text))
    return text if len(words) <= n else text[: words[n - 1].end()]


def load_passage_cut(spec: Any) -> PassageCut:
    """The token cut of an LLM registry entry's tokenizer (see the module docstring); whitespace
    words, with a warning, when it cannot be loaded (``spec`` None: an LLM without an entry)."""
    if spec is None:
        logger.warning("the reranker's LLM has no registry entry, so passages are cut by whitespace words "
                       "instead of its tokenizer's tokens")
        return PassageCut(cut_words, WORDS)
    try:
        if spec.backend == "local":
            from r2med_agent.llm.local import load_vocab

            vocab = load_vocab(spec)
            return PassageCut(gguf_cut(vocab), f"tokenizer of {spec.model} (GGUF vocabulary)",
                              lambda text: len(vocab.tokenize(text.encode("utf-8"), add_bos=False, special=False)))
        from transformers import AutoTokenizer

        source = getattr(spec, "tokenizer", None) or spec.model
        tokenizer = AutoTokenizer.from_pretrained(source)
        return PassageCut(tokens_to_text(tokenizer), f"tokenizer of {source}", lambda text: len(tokenizer.tokenize(text)))
    except Exception as e:  # noqa: BLE001 - missing packages, hub and file errors alike
        logger.warning(
            "llm '%s': its tokenizer could not be loaded (%s: %s), so the reranker cuts passages by "
            "whitespace words instead of tokens; set tokenizer: in the entry to the model's Hugging Face id "
            "or a local folder", spec.name, type(e).__name__, " ".join(str(e).split())[:200],
        )
        return PassageCut(cut_words, WORDS)


def fix_text(text: str, *, in_prompt: bool = False) -> str:
    """ftfy's ``fix_text`` as ReasonRank applies it: to a candidate with ftfy's defaults, and, with
    ``in_prompt``, to a message of the prompt as its fix of the whole rendered prompt treats it
    (that prompt opens with a chat-template tag, so ftfy leaves HTML entities alone from its first
    line on)."""
    try:
        import ftfy
    except ImportError:
        raise MissingExtraError("ftfy", "rerank", "ReasonRank's entries repair text with ftfy, as its code does") from None
    return ftfy.fix_text(text, unescape_html=False) if in_prompt else ftfy.fix_text(text)
