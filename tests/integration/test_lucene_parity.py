"""Parity with real Lucene 9.9.1 (pyserini 1.6.0 / Anserini 1.7.1): the analyzer and ``bm25``.

The first test needs nothing: its expected tokens were produced by pyserini's analyzer, one probe
per class of difference that real text showed between a UAX#29 approximation and Lucene. The
others run the real thing in this process (pyjnius) and skip with the reason when pyserini or
Java 21+ is missing (``pip install --no-deps pyserini==1.6.0 pyjnius``, a JDK on ``JAVA_HOME`` or
``PATH``).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from r2med_agent.retrieval.bm25.analysis import LuceneEnglishAnalyzer
from r2med_agent.retrieval.bm25.retriever import BM25Retriever
from r2med_agent.types import SearchRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import lucene_peer  # noqa: E402  (benchmarks/lucene_peer.py)
from realtext import passages, sentence_pool  # noqa: E402

from tests.unit.retrieval.test_bm25 import make_task  # noqa: E402

# probe text -> pyserini 1.6.0's get_lucene_analyzer() tokens
PROBES = {
    # emoji and pictographic symbols are tokens; ZWJ, modifier, flag and keycap sequences are one
    "I \u2764\ufe0f \U0001F917 transformers \u00a9 2024 \u00ae \u2122 \u2194 "
    "\U0001F469\u200d\U0001F469\u200d\U0001F467 \U0001F44D\U0001F3FD \U0001F1FA\U0001F1F8 "
    "1\ufe0f\u20e3": ["i", "\u2764\ufe0f", "\U0001F917", "transform", "\u00a9", "2024", "\u00ae",
                      "\u2122", "\u2194", "\U0001F469\u200d\U0001F469\u200d\U0001F467",
                      "\U0001F44D\U0001F3FD", "\U0001F1FA\U0001F1F8", "1\ufe0f\u20e3"],
    # Java lowercases per code point: dotted I is i, sigma is never final
    "\u0130STANBUL \u03a3\u039f\u03a6\u039f\u03a3 \u039f\u0394\u039f\u03a3":
        ["istanbul", "\u03c3\u03bf\u03c6\u03bf\u03c3", "\u03bf\u03b4\u03bf\u03c3"],
    # modifier letters U+02C2-02FF are letters to UAX#29
    "a\u02f3b \u02c2x \u02d0": ["a\u02f3b", "\u02c2x", "\u02d0"],
    # tokens are cut at 255 UTF-16 units (a DNA string)
    "ACGT" * 70: ["acgt" * 63 + "acg", "tacgtacgtacgtacgtacgtacgt"],
    # format characters do not break a word; U+200B does
    "left\u200eright soft\u00adhyphen zero\u200bwidth word\u2060joiner":
        ["left\u200eright", "soft\u00adhyphen", "zero", "width", "word\u2060join"],
    # supplementary characters: math digits, tags, Deseret (lowercased)
    "x\U0001D7CE2 a\U000E0001b \U00010400\U00010401":
        ["x\U0001D7CE2", "a\U000E0001b", "\U00010428\U00010429"],
    # a change of script inside a word: Latin|Katakana, Latin|Thai
    "abc\u30a2\u30a4 abc\u0e44\u0e17\u0e22 \u30a2\u30a4_\u30a6":
        ["abc", "\u30a2\u30a4", "abc", "\u0e44\u0e17\u0e22", "\u30a2\u30a4_\u30a6"],
    # Hebrew quotes
    "\u05e9\"\u05d1 \u05d0'\u05d1 \u05d0\"": ["\u05e9\"\u05d1", "\u05d0'\u05d1", "\u05d0"],
    # Han radicals and ideographs, Hiragana: one token per character
    "\u2e80\u2f00 \u6f22\u5b57 \u3072\u3089": ["\u2e80", "\u2f00", "\u6f22", "\u5b57", "\u3072",
                                               "\u3089"],
    # characters newer than Lucene's Unicode 9 tables (emoji excepted: Unicode 11's data covers
    # their code points in advance) are not letters
    "\U0001FAE0 \u0870x \U0001F979 a\u1ac1b": ["\U0001FAE0", "x", "\U0001F979", "b"],
}


def test_analyzer_equals_lucene_on_probes_of_every_class_of_difference() -> None:
    analyzer = LuceneEnglishAnalyzer()
    for text, want in PROBES.items():
        assert analyzer.analyze(text) == want, text


@pytest.fixture(scope="module")
def lucene_analyzer() -> lucene_peer.Analyzer:
    why = lucene_peer.unavailable()
    if why:
        pytest.skip(f"real Lucene unavailable: {why}")
    return lucene_peer.Analyzer()


def test_probes_are_what_real_lucene_says(lucene_analyzer: lucene_peer.Analyzer) -> None:
    for text, want in PROBES.items():
        assert lucene_analyzer.analyze(text) == want, text


def test_every_character_class_tokenizes_as_in_lucene(
    lucene_analyzer: lucene_peer.Analyzer,
) -> None:
    """Each code point (all of U+0080-2FFF, a seeded sample of the planes in use, the tags) alone,
    doubled, between letters and between digits."""
    ours = LuceneEnglishAnalyzer()
    rng = random.Random(1)
    pool = [c for c in range(0x3000, 0x30000) if not 0xD800 <= c <= 0xDFFF]
    cps = list(range(0x80, 0x3000)) + rng.sample(pool, 6000) + list(range(0xE0000, 0xE0080))
    wrong = []
    for i in range(0, len(cps), 400):
        chunk = cps[i : i + 400]
        probes = [f"a{chr(c)}b {chr(c)} 1{chr(c)}2 {chr(c)}{chr(c)}" for c in chunk]
        if ours.analyze(" ".join(probes)) != lucene_analyzer.analyze(" ".join(probes)):
            wrong += [hex(c) for c, p in zip(chunk, probes)
                      if ours.analyze(p) != lucene_analyzer.analyze(p)]
    assert not wrong


def test_long_tokens_are_cut_as_lucene_cuts_them(lucene_analyzer: lucene_peer.Analyzer) -> None:
    """Words of up to 900 characters (ASCII, accented, astral, Katakana, Thai) with joiners,
    ``_``, ZWJ and emoji inside: each cut at 255 UTF-16 units where Lucene cuts it (issue 29
    item 1: the cutting became linear; the pieces stay Lucene's), and the known difference
    (more than 255 ``_`` before a letter, the module doc) left out."""
    from tests.unit.retrieval.test_bm25_long_tokens import _long_token_texts

    ours = LuceneEnglishAnalyzer()
    texts = [t for t in _long_token_texts(29, 400) if "_" * 255 not in t]
    assert len(texts) > 350 and sum(len(t) > 1000 for t in texts) > 150
    differ = [t[:60] for t in texts if ours.analyze(t) != lucene_analyzer.analyze(t)]
    assert not differ


def test_real_text_tokens_equal_lucene(lucene_analyzer: lucene_peer.Analyzer) -> None:
    from lucene_parity import package_descriptions

    sentences, _, _ = sentence_pool(400_000)
    texts = passages(sentences, 800, 50, 400, 5) + package_descriptions()[0]
    ours = LuceneEnglishAnalyzer().analyze_many(texts)
    differ = [t[:60] for t, got in zip(texts, ours) if got != lucene_analyzer.analyze(t)]
    assert not differ


def test_bm25_top10_and_scores_equal_lucene(lucene_analyzer: lucene_peer.Analyzer,
                                            tmp_path: Path) -> None:
    sentences, _, _ = sentence_pool(600_000)
    texts = passages(sentences, 1500, 20, 480, 11)
    texts += [texts[3]] * 3 + ["the of and", ""]  # duplicates (ties) and documents with no term
    queries = passages(sentences, 40, 100, 600, 12) + passages(sentences, 40, 3, 12, 13)
    task = make_task(texts, name="parity")
    ret = BM25Retriever.for_task(task, index_root=tmp_path / "ours", show_progress=False)
    run = ret.search([SearchRequest(f"q{i}", q) for i, q in enumerate(queries)], 10)
    lucene_peer.write_collection(tmp_path / "collection", task.doc_ids, texts)
    lucene_peer.build_index(tmp_path / "collection", tmp_path / "index")
    exact = lucene_peer.ExactSearcher(tmp_path / "index")
    for i, q in enumerate(queries):
        assert list(run[f"q{i}"].items()) == exact.search(q, 10), i
    # the 4 copies of texts[3] tie: ordered by id ascending, and cut at k as Lucene cuts
    for k in (2, 6):
        tied = ret.search([SearchRequest("t", texts[3])], k)["t"]
        assert list(tied.items()) == exact.search(texts[3], k)
