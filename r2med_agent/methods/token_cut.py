"""Cutting the text a loop inserts: documents to a number of words, an observation to a number
of tokens of the model's own tokenizer (:func:`load_token_cut`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def cut_words(text: str, max_words: int | None) -> str:
    """``text`` cut to its first ``max_words`` whitespace tokens (unchanged when shorter)."""
    if max_words is None:
        return text
    words = text.split()
    if len(words) <= max_words:
        return text
    return " ".join(words[:max_words]) + " ..."


TokenCut = Callable[[str, int], str]
"""``(text, n) -> text``: ``text`` cut to its first ``n`` tokens of a model's tokenizer."""


def cut_whitespace_tokens(text: str, max_tokens: int) -> str:
    """The cut of a loop run without its model's tokenizer (a bare ``run`` call):
    whitespace-separated words stand in for tokens. The cut text is a prefix of ``text``."""
    words = list(re.finditer(r"\S+", text))
    return text if len(words) <= max_tokens else text[: words[max_tokens - 1].end()]


def load_token_cut(spec: Any) -> TokenCut:
    """The token cut of an LLM registry entry's model: its GGUF vocabulary (``local``, read
    without the weights) or its ``transformers`` tokenizer (``tokenizer``, else ``model``; only
    tokenizer files are read). Tokens are counted without special tokens added, as Search-R1
    tokenizes its observations. When neither can be loaded, a warning says so and whitespace
    words stand in for tokens (:func:`cut_whitespace_tokens`)."""
    try:
        return _gguf_cut(spec) if spec.backend == "local" else _transformers_cut(spec)
    except Exception as e:  # noqa: BLE001 - missing packages, hub and file errors alike
        logger.warning(
            "llm '%s': its tokenizer could not be loaded (%s: %s), so inserted text is cut by "
            "whitespace words instead of tokens; set tokenizer: in the entry to the model's Hugging "
            "Face id or a local folder", spec.name, type(e).__name__, " ".join(str(e).split())[:200],
        )
        return cut_whitespace_tokens


def _gguf_cut(spec: Any) -> TokenCut:
    from r2med_agent.llm.local import load_vocab

    vocab = load_vocab(spec)

    def cut(text: str, n: int) -> str:
        ids = vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        return text if len(ids) <= n else vocab.detokenize(ids[:n]).decode("utf-8", "ignore")

    return cut


def _transformers_cut(spec: Any) -> TokenCut:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(getattr(spec, "tokenizer", None) or spec.model)

    def cut(text: str, n: int) -> str:
        ids = tok.encode(text, add_special_tokens=False)
        return text if len(ids) <= n else tok.decode(ids[:n], clean_up_tokenization_spaces=False)

    return cut
