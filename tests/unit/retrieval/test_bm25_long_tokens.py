"""Long tokens and long runs in BM25 analysis (issue 29 item 1): linear time, the same tokens.

Lucene cuts a token at 255 UTF-16 units and resumes scanning after the cut. Cutting used to match
the whole rest of the word again after every cut, so one long word (DNA, base64, a minified blob)
was quadratic: 0.8 MB took about 11 s, 50 MB hours. Runs of ``_`` or ZWJ that no letter or emoji
follows were quadratic in the grammar's own search too. These tests bound the time of each case
(generously: a blow-up takes minutes) and check the tokens against a plain cutter that matches the
rest of the text again at every cut, as the old code did, on texts small enough for it.
"""

from __future__ import annotations

import random
import re
import time

import numpy as np

from r2med_agent.retrieval.bm25 import tokenizer
from r2med_agent.retrieval.bm25.analysis import LuceneEnglishAnalyzer
from r2med_agent.retrieval.bm25.tokenizer import tokenize

BOUND_S = 10.0
"""Each case below takes well under a second; before the fix the first took minutes."""


def timed(f, *args):
    t0 = time.perf_counter()
    out = f(*args)
    return out, time.perf_counter() - t0


def test_a_two_megabyte_word_is_cut_in_linear_time() -> None:
    tokenize("warm up")
    tokens, seconds = timed(tokenize, "ACGT" * 500_000)
    assert seconds < BOUND_S, f"{seconds:.1f}s"
    full, rest = divmod(2_000_000, 255)
    assert len(tokens) == full + 1 and {len(t) for t in tokens[:-1]} == {255} and len(tokens[-1]) == rest
    assert "".join(tokens) == "acgt" * 500_000


def test_a_two_megabyte_word_in_a_non_ascii_text_is_cut_in_linear_time() -> None:
    tokenize("é")  # builds the character tables
    tokens, seconds = timed(tokenize, "é " + "ACGT" * 500_000 + " \U0001D7CE" * 200)
    assert seconds < BOUND_S, f"{seconds:.1f}s"
    pieces = -(-2_000_000 // 255)
    assert tokens[0] == "é" and len(tokens) == 1 + pieces + 200
    assert "".join(tokens[1 : 1 + pieces]) == "acgt" * 500_000


def test_astral_characters_count_twice_in_a_long_word() -> None:
    tokens, seconds = timed(tokenize, "\U0001D7CE" * 400_000)
    assert seconds < BOUND_S, f"{seconds:.1f}s"
    assert {len(t) for t in tokens[:-1]} == {127}  # 254 UTF-16 units: a 128th would make 256


def test_runs_of_underscores_and_zwj_are_searched_in_linear_time() -> None:
    tokenize("é")
    for text in ("é " + "_" * 300_000, "é " + "_\u00ad" * 150_000, "é " + "\u200d_" * 150_000,
                 "\U0001F917" + "\u200d" * 300_000, "é " + "\u200d" * 300_000,
                 "é a" + "_" * 300_000 + "b"):
        tokens, seconds = timed(tokenize, text)
        assert seconds < BOUND_S, (text[:4], f"{seconds:.1f}s")
        assert tokens[0] in ("é", "\U0001F917" + "\u200d" * 253), text[:4]


def test_indexing_a_corpus_with_a_long_word_is_linear() -> None:
    docs = ["a normal first document about cells", "TTAGGG" * 400_000, "é unicode " + "gc" * 1_000_000,
            "a normal last document"]
    (analyzed, vocab), seconds = timed(LuceneEnglishAnalyzer().fit, docs)
    assert seconds < BOUND_S, f"{seconds:.1f}s"
    assert analyzed.lengths().tolist() == [5, -(-2_400_000 // 255), 2 + -(-2_000_000 // 255), 3]


# -- the same tokens as cutting by matching the rest again -----------------------------------


def _mapped(text: str) -> str:
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    return tokenizer._scanner()[0][codes].tobytes().decode("ascii")


def plain_cut(text: str) -> list[str]:
    """Lucene's cut by the plain rule: search from where scanning resumes (the rest of the text
    on its own, matched in full); a match over 255 units gives the longest match within 255."""
    lowered = tokenizer.java_lower(text)
    ascii_ = lowered.isascii()
    pattern = tokenizer._ASCII_TOKEN_RE if ascii_ else tokenizer._token_re()
    scanned = lowered if ascii_ else _mapped(lowered)
    out, pos = [], 0
    while (m := pattern.search(scanned[pos:])) is not None:
        start, end = pos + m.start(), pos + m.end()
        units = 0
        for i in range(start, end):
            units += 2 if ord(lowered[i]) > 0xFFFF else 1
            if units > 255:
                fit = pattern.match(scanned[:i], start)
                end = fit.end() if fit is not None else i
                break
        token = lowered[start:end]
        if token.strip("_"):
            out.append(token)
        pos = end
    return out


def _long_token_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = ["a", "b", "1", "2", ".", ",", ":", "'", " ", "-", "_", "é", "\U0001D7CE",
                "\u30a2", "\u0e44", "\u6f22", "\u00ad", "\u200d", "\U0001F917", "\u3072"]
    out = []
    for k in range(n):
        letters = alphabet if k % 2 else alphabet[:11]
        parts = []
        for _ in range(rng.randint(1, 5)):
            base = rng.choice(letters[:4] + (["é", "\U0001D7CE", "\u30a2", "\u0e44"] if k % 2 else []))
            parts.append("".join(rng.choice(letters) if rng.random() < 0.06 else base
                                 for _ in range(rng.randint(1, 900))))
            parts.append(rng.choice([" ", ".", "a.b", " x "]))
        out.append("".join(parts))
    return out


def test_long_tokens_are_cut_as_by_matching_the_rest_again() -> None:
    for text in _long_token_texts(29, 400):
        assert tokenize(text) == plain_cut(text), text[:60]


def test_cuts_inside_runs_of_underscores_resume_there() -> None:
    # a cut inside a run of "_" that a letter follows within reach: the next token starts at the
    # cut with the rest of the run (Lucene does so)
    for text in ("_" * 14 + "a" + "_" * 400 + "2_" + "b" * 300,
                 "é " + "_" * 14 + "a" + "_" * 400 + "2_" + "b" * 300,
                 "é " + "x" * 200 + "\u200d_" * 60 + "y"):
        assert tokenize(text) == plain_cut(text), text[:20]


def test_normal_text_never_takes_the_long_token_path(monkeypatch) -> None:
    calls = []
    real = tokenizer._split_long
    monkeypatch.setattr(tokenizer, "_split_long", lambda *a: calls.append(1) or real(*a))
    words = re.findall(r"\w+", tokenizer.__doc__ or "")
    tokenize(" ".join(words * 20))
    tokenize("é " + " ".join(words * 20))
    assert calls == []
