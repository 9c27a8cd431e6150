"""BM25 retriever: analyzer, Lucene scoring, R2MED's gensim scoring, the saved index, combine rules.

The corpus is real English text present wherever Python is: docstrings of the standard library
(read from ``sysconfig.get_paths()["stdlib"]``), about 3,000 of them.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import struct
import sysconfig
from collections import Counter
from collections.abc import Sequence
from itertools import chain
from pathlib import Path

import numpy as np
import pytest

from r2med_agent.errors import ConfigError, DataError
from r2med_agent.retrieval.base import Retriever
from r2med_agent.retrieval.bm25 import tokenizer
from r2med_agent.retrieval.bm25.analysis import ENGLISH_STOP_WORDS, LuceneEnglishAnalyzer
from r2med_agent.retrieval.bm25.index import index_key
from r2med_agent.retrieval.bm25.porter import lucene_porter_stem
from r2med_agent.retrieval.bm25.retriever import BM25Retriever
from r2med_agent.retrieval.bm25.tokenizer import tokenize
from r2med_agent.retrieval.query import bm25_query_text
from r2med_agent.types import Doc, Query, SearchRequest, Task

K1, B = 0.9, 0.4
_DOCSTRING = re.compile(r'"""(.*?)"""', re.S)


def _stdlib_docstrings(n: int, min_words: int = 25) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    out: list[str] = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for m in _DOCSTRING.finditer(source):
            text = " ".join(m.group(1).split())
            if len(text.split()) >= min_words and text not in seen:
                seen.add(text)
                out.append(text)
                if len(out) == n:
                    return out
    return out


def make_task(texts: Sequence[str], name: str = "stdlib", ids: Sequence[str] | None = None) -> Task:
    ids = list(ids) if ids is not None else [f"d{i}" for i in range(len(texts))]
    corpus = tuple(Doc(i, t) for i, t in zip(ids, texts))
    h = hashlib.sha256()
    for d in corpus:
        h.update(f"{len(d.doc_id)}:{d.doc_id}|{len(d.text)}:{d.text}\n".encode())
    return Task(
        name=name, family="qa", domain="python", queries=(Query("q0", "x"),), corpus=corpus,
        qrels={}, source="test: stdlib docstrings", fingerprint=h.hexdigest(),
    )


@pytest.fixture(scope="module")
def texts() -> list[str]:
    docs = _stdlib_docstrings(3000)
    if len(docs) < 1000:
        pytest.skip(f"only {len(docs)} standard-library docstrings found")
    return docs


@pytest.fixture(scope="module")
def task(texts: list[str]) -> Task:
    return make_task(texts)


@pytest.fixture(scope="module")
def index_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bm25-index")


@pytest.fixture(scope="module")
def lucene(task: Task, index_root: Path) -> BM25Retriever:
    return BM25Retriever.for_task(task, index_root=index_root, show_progress=False)


@pytest.fixture(scope="module")
def compat(task: Task, index_root: Path) -> BM25Retriever:
    return BM25Retriever.for_task(task, mode="r2med-compat", index_root=index_root,
                                  show_progress=False)


@pytest.fixture(scope="module")
def queries(texts: list[str]) -> list[SearchRequest]:
    """Real queries: word windows cut from documents (short and long), plus a repeated-term query."""
    rng = np.random.default_rng(7)
    out = []
    for n, i in enumerate(rng.choice(len(texts), size=24, replace=False).tolist()):
        words = texts[i].split()
        size = [6, 15, 60][n % 3]
        start = int(rng.integers(0, max(1, len(words) - size)))
        out.append(SearchRequest(f"q{n}", " ".join(words[start : start + size])))
    out.append(SearchRequest("rep", "socket socket socket timeout"))
    return out


def analyzed_corpus(texts: Sequence[str]) -> list[list[str]]:
    return LuceneEnglishAnalyzer().analyze_many(texts)


def assert_ranking(
    got: dict[str, float], ref: np.ndarray, doc_ids: list[str], k: int, rtol: float = 1e-5
) -> None:
    """``got`` is a correct top-``k`` of the reference scores ``ref`` (all documents).

    Each returned score equals the reference score of that document; the returned scores are the
    k best reference scores; the order is by score; and where the reference has no tie at the
    cut, the returned documents are exactly the reference's top k.
    """
    pos = {d: i for i, d in enumerate(doc_ids)}
    positive = int((ref > 0).sum())
    assert len(got) == min(k, positive)
    ours = np.array(list(got.values()))
    np.testing.assert_allclose(ours, ref[[pos[d] for d in got]], rtol=rtol, atol=1e-6)
    best = np.sort(ref)[::-1][: len(got)]
    np.testing.assert_allclose(ours, best, rtol=rtol, atol=1e-6)
    assert all(ours[i] >= ours[i + 1] for i in range(len(ours) - 1))
    if len(got) < positive:
        order = np.argsort(-ref, kind="stable")
        gap = ref[order[len(got) - 1]] - ref[order[len(got)]]
        if gap > 1e-4 * ref[order[0]]:
            assert set(got) == {doc_ids[i] for i in order[: len(got)]}


# --- analyzer ---------------------------------------------------------------------------------


def test_stopwords_are_lucenes_33_english_stopwords() -> None:
    assert len(ENGLISH_STOP_WORDS) == 33
    assert {"a", "the", "such", "their", "will", "with", "into"} <= ENGLISH_STOP_WORDS
    assert not {"he", "she", "from", "have", "which"} & ENGLISH_STOP_WORDS


def test_analyzer_follows_the_lucene_english_chain() -> None:
    a = LuceneEnglishAnalyzer()
    # possessive removed before the stopword test ("it's" -> "it" -> dropped); one-letter tokens
    # kept ("b"); dots between letters and digits join (u.s.a, 3.5); hyphen and slash split;
    # Lucene's Porter: -bli -> -ble (possibly), undoubling kk (trekking), 2-letter words unstemmed.
    got = a.analyze(
        "The Patient's U.S.A. vitamin B 12 dose: 3.5 mg/kg, possibly trekking. It's COVID-19 as us"
    )
    assert got == ["patient", "u.s.a", "vitamin", "b", "12", "dose", "3.5", "mg", "kg",
                   "possibl", "trek", "covid", "19", "us"]
    assert a.analyze("the of and to") == []
    assert a.analyze("") == []
    assert a.analyze("Patients’ caresses, ponies; relational agreed") == [
        "patient", "caress", "poni", "relat", "agre"]


def test_lucene_porter_port_on_classic_examples() -> None:
    # Examples from Porter's paper and the comments of Lucene's PorterStemmer.
    cases = {
        "caresses": "caress", "ponies": "poni", "ties": "ti", "cats": "cat", "feed": "feed",
        "agreed": "agre", "disabled": "disabl", "matting": "mat", "mating": "mate",
        "meeting": "meet", "milling": "mill", "messing": "mess", "meetings": "meet",
        "generalizations": "gener", "oscillators": "oscil", "conditional": "condit",
        "hopefulness": "hope", "sensibility": "sensibl", "electrical": "electr",
        "possibly": "possibl", "cardiology": "cardiolog", "revving": "rev", "as": "as", "is": "is",
    }
    assert {w: lucene_porter_stem(w) for w in cases} == cases


def test_hybrid_stemming_equals_lucene_porter_on_a_real_vocabulary(texts: list[str]) -> None:
    import Stemmer

    vocab = sorted({t for text in texts for t in tokenize(text)})
    a = LuceneEnglishAnalyzer()
    fast = a._stem_words(list(vocab))
    exact = [lucene_porter_stem(w) for w in vocab]
    assert fast == exact
    # the test exercises the three differences between Snowball's "porter" and Lucene's
    snowball = Stemmer.Stemmer("porter").stemWords(vocab)
    differs = [w for w, s, e in zip(vocab, snowball, exact) if s != e]
    assert len(differs) >= 5, differs


def _stdlib_vocabulary() -> list[str]:
    """Every distinct run of lowercase letters in the standard library's own sources (docstrings,
    comments, identifiers) and in the installed distributions' descriptions (their READMEs: prose,
    code, other languages' words). A full CPython has about 40,000 words in its sources alone; a
    distribution's Python without its test suite (Debian's python3) about 21,000, and about 27,000
    with the descriptions of the `[all]` install."""
    from importlib import metadata

    root = Path(sysconfig.get_paths()["stdlib"])
    letters = re.compile(r"[a-z]+")
    words: set[str] = set()
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            words.update(letters.findall(path.read_text(encoding="utf-8").lower()))
        except (OSError, UnicodeDecodeError):
            continue
    for dist in metadata.distributions():
        body = dist.metadata.get_payload() or dist.metadata["Description"] or ""
        words.update(letters.findall(str(body).lower()))
    return sorted(words)


def test_lucene_porter_port_against_snowball_porter_on_the_stdlib_vocabulary() -> None:
    """PyStemmer's ``porter`` (Snowball, the published algorithm) as an independent check.

    Lucene's PorterStemmer is Martin Porter's reference implementation, which departs from the
    published algorithm in four documented ways (see r2med_agent.retrieval.bm25.porter). Every
    disagreement over the vocabulary must be one of them, checked against Snowball itself, never
    against the port: anything else would be a bug in the port.
    """
    import Stemmer

    words = _stdlib_vocabulary()
    assert len(words) > 25_000  # the floor a Python without its test suite reaches (see above)
    snowball = Stemmer.Stemmer("porter")
    ours = [lucene_porter_stem(w) for w in words]
    undoubling = re.compile(r"([^aeioulszbdfgmnprt])\1(?:ed|ing)s?$")
    kinds: Counter[str] = Counter()
    unexplained = []
    for word, theirs, mine in zip(words, snowball.stemWords(words), ours):
        if theirs == mine:
            continue
        if len(word) <= 2 and mine == word:  # the reference leaves 1-2 letter words alone
            kinds["short"] += 1
        elif theirs.endswith("logi") and mine == theirs[:-1]:  # -logi -> -log
            kinds["logi"] += 1
        elif theirs.endswith("bli") and mine == snowball.stemWord(theirs[:-1] + "e"):  # -bli -> -ble
            kinds["bli"] += 1
        elif undoubling.search(word) and mine == theirs[:-1]:  # "specced" -> "spec"
            kinds["undoubling"] += 1
        else:
            unexplained.append((word, theirs, mine))
    assert unexplained == []
    assert set(kinds) == {"short", "logi", "bli", "undoubling"}, kinds  # each rule is exercised
    assert sum(kinds.values()) < 0.005 * len(words)
    # the analyzer (PyStemmer, then the port for the words those rules can reach) equals the port
    assert LuceneEnglishAnalyzer()._stem_words(list(words)) == ours


def test_ascii_fast_path_equals_the_unicode_pattern(texts: list[str]) -> None:
    samples = [t.lower() for t in texts[:800] if t.isascii()]
    samples.append("u.s.a. 1,000;2 x_1 ___ don't a:b 3.5. 'quoted' end.")
    for s in samples:
        assert tokenizer.tokenize(s) == tokenizer._findall_unicode(s)
        assert tokenizer.tokenize(s) == [t for t in tokenizer._ASCII_TOKEN_RE.findall(s)
                                         if t.strip("_")]


def _package_descriptions() -> list[str]:
    """The installed distributions' long descriptions (READMEs: Markdown, code, emoji, other
    scripts), the second parity corpus of benchmarks/lucene_parity.py."""
    from importlib import metadata

    out = []
    for dist in metadata.distributions():
        body = dist.metadata.get_payload() or dist.metadata["Description"] or ""
        if body.strip():
            out.append(body)
    return out


# ASCII texts whose candidates (runs of [a-z0-9_.:',;]) hold several tokens, or none, or "_"
CANDIDATE_PROBES = [
    "a.1 1.a a..b e.g. x'y 1,000.5 a_1.b a,b;c 1;2 a:b 1:2 ___ _a_ a'1 1'a a.b.c. .a. ,1,",
    "os.path.join(a,b) f(x);g(y) 3.14,2.71 it's o'neil's rock'n'roll 'quoted' x:1:y",
    "ACGT" * 70 + ".b " + "ab," * 120 + " " + "a." * 200 + " " + "1.5," * 100 + "a " + "_" * 300,
    "Mixed CASE Words, (parens) [brackets] {braces} \"quotes\" tab\there ___ __init__ x_ _x "
    + "Z" * 260 + " _" + "_" * 256 + "a",
    "",
    "no tokens here? ... ,,, ;;; ' '' :::",
]


def test_candidate_fast_path_equals_the_exact_tokenizer_on_every_text(texts: list[str]) -> None:
    # The corpus is tokenized through candidates (each distinct one tokenized once) and keys in
    # first-occurrence order; it must give every text exactly the exact tokenizer's tokens, and
    # the same first-occurrence vocabulary.
    corpus = [*CANDIDATE_PROBES, *texts, *_package_descriptions()]
    exact = [tokenizer.tokenize(t) for t in corpus]
    ids, offsets, raw_vocab = LuceneEnglishAnalyzer._raw(corpus)
    bounds = offsets.tolist()
    got = [[raw_vocab[i] for i in ids[bounds[j] : bounds[j + 1]].tolist()]
           for j in range(len(corpus))]
    for text, want, have in zip(corpus, exact, got):
        assert have == want, text[:80]
    assert raw_vocab == list(dict.fromkeys(chain.from_iterable(exact)))
    joined = " ".join(t for t in corpus if t.isascii()).encode()
    several = {c for c in joined.translate(tokenizer._ASCII_CANDIDATES).split()
               if tokenizer.tokenize(c.decode()) != [c.decode()]}
    assert len(several) > 20  # the expansion of candidates is exercised


def test_tokenizer_agrees_with_unicode_word_boundaries(texts: list[str]) -> None:
    """Lucene's StandardTokenizer implements UAX#29; the `regex` module implements it too."""
    import regex  # the dev extra's; Python's re has no UAX#29 word boundaries
    boundary = regex.compile(r"\b", flags=regex.WORD | regex.V1)
    word = regex.compile(r"[\p{L}\p{Nd}]")
    extra = ["Naïve café (e\u0301) résumé: ｶﾀｶﾅ ＡＢＣ x² 1,000.5 ½ dose’s l’hôpital"]

    def uax29(text: str) -> list[str]:
        text = text.lower()
        cuts = [m.start() for m in boundary.finditer(text)]
        segments = [text[a:b].lstrip("'") for a, b in zip(cuts, cuts[1:])]
        return [s for s in segments if word.search(s)]

    for text in texts[:1500] + extra:
        assert tokenize(text) == uax29(text), text[:80]
    assert tokenize("中文字 abc") == ["中", "文", "字", "abc"]  # ideographs one by one, as Lucene


def test_fit_and_transform_share_ids_and_drop_unknown_terms() -> None:
    a = LuceneEnglishAnalyzer()
    docs, vocab = a.fit(["Cats chase mice.", "", "The mice run; the cats sleep."])
    assert vocab == {"cat": 0, "chase": 1, "mice": 2, "run": 3, "sleep": 4}
    assert docs.to_lists() == [[0, 1, 2], [], [2, 3, 0, 4]]
    q = a.transform(["running cats zebra", "zebra", "cat cat"], vocab)
    assert q.to_lists() == [[3, 0], [], [0, 0]]


# --- lucene mode --------------------------------------------------------------------------------


def _f32(x: float) -> float:
    """``x`` rounded to float32 (as Java's float arithmetic rounds each operation)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _java_int_to_byte4(i: int) -> int:
    """Lucene's ``SmallFloat.intToByte4``, written out from its Java source with Python ints."""
    free = 24  # 255 - longToInt4(Integer.MAX_VALUE)
    if i < free:
        return i
    v = i - free
    num_bits = v.bit_length()
    if num_bits < 4:
        return free + v
    shift = num_bits - 4
    return free + (((v >> shift) & 0x07) | ((shift + 1) << 3))


def _java_byte4_to_int(b: int) -> int:
    free = 24
    if b < free:
        return b
    i = b - free
    bits, shift = i & 0x07, (i >> 3) - 1
    return free + (bits if shift == -1 else (bits | 0x08) << shift)


def test_length_norms_are_lucenes_small_float() -> None:
    from r2med_agent.retrieval.bm25.lucene import length_to_norm, norm_to_length

    assert _java_byte4_to_int(_java_int_to_byte4(1000)) == 984  # Lucene's documented example
    lengths = np.array(list(range(5000)) + [10**5, 123_456_789, 2**31 - 1])
    norms = length_to_norm(lengths)
    assert norms.tolist() == [_java_int_to_byte4(int(n)) for n in lengths]
    assert norm_to_length(np.arange(256)).tolist() == [_java_byte4_to_int(b) for b in range(256)]
    decoded = norm_to_length(norms)
    assert (decoded[:24] == lengths[:24]).all() and (decoded <= lengths).all()


def test_lucene_mode_scores_equal_an_independent_lucene_computation_bit_for_bit(
    task: Task, texts: list[str], lucene: BM25Retriever, queries: list[SearchRequest]
) -> None:
    # Lucene 9's BM25Similarity written out scalar by scalar in Python floats, rounding to float32
    # where Java's float arithmetic does: 1-byte length norms, docCount = documents with a token,
    # per clause w - w / (1 + tf * normInv) with w = count * idf, clauses summed in double.
    docs = analyzed_corpus(texts)
    dl = [len(d) for d in docs]
    doc_count = sum(1 for n in dl if n)
    avgdl = _f32(sum(dl) / doc_count)
    k1, b = _f32(K1), _f32(B)
    cache = []
    for norm in range(256):
        length = float(_java_byte4_to_int(norm))
        x = _f32(_f32(b * length) / avgdl)
        cache.append(_f32(1.0 / _f32(k1 * _f32(_f32(1.0 - b) + x))))
    df = Counter(t for d in docs for t in set(d))
    postings: dict[str, list[tuple[int, int]]] = {}
    for i, d in enumerate(docs):
        for t, tf in Counter(d).items():
            postings.setdefault(t, []).append((i, tf))
    analyzer = LuceneEnglishAnalyzer()
    run = lucene.search(queries, 10)
    doc_ids = [d.doc_id for d in task.corpus]
    assert list(run) == [q.query_id for q in queries]
    for q in queries:
        total: dict[int, float] = {}
        for t, count in Counter(analyzer.analyze(q.query)).items():
            if t not in df:
                continue
            idf = _f32(math.log(1 + (doc_count - df[t] + 0.5) / (df[t] + 0.5)))
            w = _f32(count * idf)
            for i, tf in postings[t]:
                inv = cache[_java_int_to_byte4(dl[i])]
                part = _f32(w - _f32(w / _f32(1.0 + _f32(tf * inv))))
                total[i] = total.get(i, 0.0) + part
        ref = sorted(((_f32(s), doc_ids[i]) for i, s in total.items()),
                     key=lambda x: (-x[0], x[1]))[:10]  # Anserini: ties by id ascending
        assert run[q.query_id], q.query
        assert list(run[q.query_id].items()) == [(d, s) for s, d in ref], q.query_id
        assert all(type(s) is float for s in run[q.query_id].values())


def test_repeated_query_terms_count_each_time(lucene: BM25Retriever) -> None:
    run = lucene.search([SearchRequest("one", "socket timeout"),
                         SearchRequest("two", "socket socket timeout")], 5)
    assert run["one"] and run["two"]
    assert list(run["one"].values()) != list(run["two"].values())


# --- r2med-compat mode ----------------------------------------------------------------------------


def test_compat_mode_matches_r2meds_gensim_pipeline(
    task: Task, texts: list[str], compat: BM25Retriever, queries: list[SearchRequest]
) -> None:
    """R2MED's eval_bench_BM25.retrieval_bm25, with our analyzer in place of pyserini's."""
    gensim = pytest.importorskip("gensim")
    from gensim.corpora import Dictionary
    from gensim.models import LuceneBM25Model
    from gensim.similarities import SparseMatrixSimilarity

    del gensim
    corpus = analyzed_corpus(texts)
    dictionary = Dictionary(corpus)
    model = LuceneBM25Model(dictionary=dictionary, k1=K1, b=B)
    bm25_corpus = model[list(map(dictionary.doc2bow, corpus))]
    index = SparseMatrixSimilarity(bm25_corpus, num_docs=len(corpus), num_terms=len(dictionary),
                                   normalize_queries=False, normalize_documents=False)
    analyzer = LuceneEnglishAnalyzer()
    doc_ids = [d.doc_id for d in task.corpus]
    run10 = compat.search(queries, 10)
    run100 = compat.search(queries[:6], 100)
    for q in queries:
        sims = np.asarray(index[model[dictionary.doc2bow(analyzer.analyze(q.query))]], dtype=float)
        positive = lambda run: {d: s for d, s in run.items() if s > 0}  # noqa: E731
        assert_ranking(positive(run10[q.query_id]), sims, doc_ids, 10)
        if q.query_id in run100:
            assert_ranking(positive(run100[q.query_id]), sims, doc_ids, 100)


def test_compat_mode_fills_the_depth_with_zero_score_documents_in_corpus_order(
    tmp_path: Path,
) -> None:
    """R2MED's script keeps ``sorted(all scores, reverse=True)[:100]``: a query matching fewer
    documents than the depth gets score-0 documents from the start of the corpus (a stable sort
    keeps them in corpus order), and they are in its run and its scores. The lucene mode keeps
    only matches."""
    texts = ["apple pie recipe", "zebra stripes", "apple orchard", "yak wool", "xylophone music",
             "walrus tusk", "vulture flight"]
    ids = ["d6", "d5", "d4", "d3", "d2", "d1", "d0"]  # corpus order is not id order
    task = make_task(texts, ids=ids)
    req = [SearchRequest("q", "apple")]
    compat = BM25Retriever.for_task(task, mode="r2med-compat", index_root=tmp_path, show_progress=False)
    run = compat.search(req, 5)["q"]
    # the reference's own selection, with gensim scores computed independently
    gensim = pytest.importorskip("gensim")
    from gensim.corpora import Dictionary
    from gensim.models import LuceneBM25Model
    from gensim.similarities import SparseMatrixSimilarity

    del gensim
    corpus = analyzed_corpus(texts)
    dictionary = Dictionary(corpus)
    model = LuceneBM25Model(dictionary=dictionary, k1=K1, b=B)
    index = SparseMatrixSimilarity(model[list(map(dictionary.doc2bow, corpus))], num_docs=len(corpus),
                                   num_terms=len(dictionary), normalize_queries=False, normalize_documents=False)
    sims = index[model[dictionary.doc2bow(LuceneEnglishAnalyzer().analyze("apple"))]].tolist()
    reference = dict(sorted(zip(ids, sims), key=lambda x: x[1], reverse=True)[:5])
    assert list(run) == list(reference) == ["d4", "d6", "d5", "d3", "d2"]
    np.testing.assert_allclose(list(run.values()), list(reference.values()), rtol=1e-6)
    assert run["d5"] == run["d3"] == run["d2"] == 0.0
    # the depth caps the fill; a query matching nothing gets the start of the corpus
    assert list(compat.search([SearchRequest("n", "qqqzzz")], 3)["n"]) == ["d6", "d5", "d4"]
    lucene_run = BM25Retriever.for_task(task, index_root=tmp_path, show_progress=False).search(req, 5)
    assert list(lucene_run["q"]) == ["d6", "d4"] or list(lucene_run["q"]) == ["d4", "d6"]


def test_compat_query2doc_repeats_the_query_with_no_space(tmp_path: Path) -> None:
    """R2MED builds Query2Doc's BM25 query as ``text * 2 + " " + passage``: the end of the first
    copy and the start of the second run together into one token."""
    texts = ["cells divide by mitosis", "cellsWhy is one odd token here", "mitosis mitosis phases"]
    task = make_task(texts)
    req = SearchRequest("q", "Why do cells", "mitosis", "query2doc")
    assert bm25_query_text(req, compat=True) == "Why do cellsWhy do cells mitosis"
    compat = BM25Retriever.for_task(task, mode="r2med-compat", index_root=tmp_path, show_progress=False)
    got = compat.search([req], 3)["q"]
    want = compat.search([SearchRequest("q", "Why do cellsWhy do cells mitosis")], 3)["q"]
    spaced = compat.search([SearchRequest("q", "Why do cells Why do cells mitosis")], 3)["q"]
    assert got == want and got != spaced
    assert got["d1"] > 0  # matched only through the joined token "cellswhy"


def test_compat_mode_weights_the_query_side(compat: BM25Retriever, lucene: BM25Retriever) -> None:
    # gensim turns the query bag-of-words into BM25 weights: a term repeated in the query gains
    # less than linearly, and the scores are not the lucene mode's.
    reqs = [SearchRequest("q", "socket timeout error connection connection")]
    a, b = compat.search(reqs, 10)["q"], lucene.search(reqs, 10)["q"]
    assert a and b
    assert not np.allclose(list(a.values()), list(b.values()))


# --- both modes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["lucene", "r2med-compat"])
def test_dense_block_and_posting_lists_give_the_same_ranking(
    mode: str, task: Task, index_root: Path, queries: list[SearchRequest],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from r2med_agent.retrieval.bm25 import compat, lucene

    # lucene mode saves its dense rows with the index: each budget gets its own index folder
    owner = lucene._LuceneIndex if mode == "lucene" else compat._ScoreMatrix

    # frequent terms repeated in a query: lucene mode scores a dense term with count > 1 from its
    # dense row of 1 + tf * normInv, and a count-1 dense term through the matrix product
    repeated = SearchRequest("rep-dense", "return return value value value the object default")
    rows: list[np.ndarray] = []

    def search(budget: int, min_df: float) -> dict:
        monkeypatch.setattr(owner, "DENSE_BUDGET", budget)
        monkeypatch.setattr(owner, "DENSE_MIN_DF", min_df)
        r = BM25Retriever.for_task(task, mode=mode, index_root=index_root / f"{mode}-{budget}",
                                   show_progress=False)
        if mode == "lucene":
            vocab = r._index.vocab
            rows.append(r._index.dense_row[[vocab[t] for t in ("return", "valu", "object")]])
        return r.search([*queries, repeated], 20)

    sparse_only = search(0, 1 / 20)
    mostly_dense = search(2**25, 1 / len(task.corpus))  # ~2,800 terms, df >= 2
    assert list(sparse_only) == list(mostly_dense)
    if mode == "lucene":  # exact sums in double: the same bits whichever path adds a term
        assert (rows[0] < 0).all() and (rows[1] >= 0).all()  # sparse, then dense
        assert sparse_only["rep-dense"]
        assert sparse_only == mostly_dense
        return
    for qid, a in sparse_only.items():
        b = mostly_dense[qid]
        np.testing.assert_allclose(list(a.values()), list(b.values()), rtol=1e-5)
        common = a.keys() & b.keys()  # equal but for near-ties at the cut
        assert len(common) >= len(a) - 2
        np.testing.assert_allclose([a[d] for d in common], [b[d] for d in common], rtol=1e-5)


@pytest.mark.parametrize("mode", ["lucene", "r2med-compat"])
def test_duplicate_documents_score_exactly_alike_wherever_they_sit(
    mode: str, texts: list[str], tmp_path: Path, queries: list[SearchRequest],
) -> None:
    # A document's score must not depend on where it sits in the corpus, or ties between duplicate
    # passages would be broken by rounding instead of by document id as trec_eval does. (A BLAS
    # matrix product over the dense block fails this: its edge tiles round differently.)
    rng = np.random.default_rng(3)
    corpus = list(texts)
    originals = rng.choice(len(texts), size=40, replace=False).tolist()
    for i in originals:
        corpus.insert(int(rng.integers(0, len(corpus) + 1)), texts[i])
    t = make_task(corpus, name="dups")
    r = BM25Retriever.for_task(t, mode=mode, index_root=tmp_path, show_progress=False)
    dense = r._index.arrays["dense_once"] if mode == "lucene" else r._index.matrix.dense
    assert dense.shape[0] > 0  # the product path is exercised
    run = r.search(queries, len(corpus))
    positions: dict[str, list[str]] = {}
    for doc in t.corpus:
        positions.setdefault(doc.text, []).append(doc.doc_id)
    pairs = [ids for ids in positions.values() if len(ids) == 2]
    assert len(pairs) == 40
    checked = 0
    for ranking in run.values():
        for a, b in pairs:
            assert ranking.get(a) == ranking.get(b)
            checked += a in ranking
    assert checked > 40


@pytest.mark.parametrize("mode", ["lucene", "r2med-compat"])
def test_every_qid_present_and_non_matching_queries_are_empty(
    mode: str, task: Task, index_root: Path
) -> None:
    r = BM25Retriever.for_task(task, mode=mode, index_root=index_root, show_progress=False)
    reqs = [
        SearchRequest("nothing", "zzqxv qqqqzz"),
        SearchRequest("stop", "the of and to it"),
        SearchRequest("blank", ""),
        SearchRequest("real", "return the socket timeout"),
        SearchRequest("hyde-empty", "zzqxv", "", "hyde"),
    ]
    run = r.search(reqs, 10)
    assert list(run) == [q.query_id for q in reqs]
    # compat mode fills up with score-0 documents from the start of the corpus, as R2MED does
    no_match = {} if mode == "lucene" else {d.doc_id: 0.0 for d in task.corpus[:10]}
    assert run["nothing"] == run["stop"] == run["blank"] == run["hyde-empty"] == no_match
    assert 0 < len(run["real"]) <= 10
    assert isinstance(r, Retriever)
    assert r.name == {"lucene": "bm25", "r2med-compat": "bm25-compat"}[mode]


@pytest.mark.parametrize("mode", ["lucene", "r2med-compat"])
def test_k_is_capped_and_zero_score_docs_are_not_matches(mode: str, tmp_path: Path) -> None:
    t = make_task(["aspirin reduces fever", "insulin lowers glucose", "fever and cough in children"],
                  name="tiny")
    r = BM25Retriever.for_task(t, mode=mode, index_root=tmp_path, show_progress=False)
    run = r.search([SearchRequest("a", "fever"), SearchRequest("b", "glucose fever aspirin")], 100)
    matches = {d: v for d, v in run["a"].items() if v > 0}
    assert set(matches) == {"d0", "d2"}
    assert run["a"] == (matches if mode == "lucene" else {**matches, "d1": 0.0})
    assert list(run["b"])[0] == "d0" and set(run["b"]) == {"d0", "d1", "d2"}
    assert all(s > 0 for s in run["b"].values())


def test_top_k_cut_keeps_trec_eval_top_documents_among_ties() -> None:
    """The cut and the order follow trec_eval (score desc, doc id desc) against a full sort."""
    from r2med_agent.evaluation import trec_sorted
    from r2med_agent.retrieval.bm25.ranking import _doc_id_ranks, _top_positive

    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(1, 400))
        # few distinct values, so ties at the cut are the rule; zeros and negatives are not hits
        scores = rng.integers(-2, 6, size=n).astype(np.float32)
        ids = [f"{rng.integers(0, 10**6)}-{i}" for i in range(n)]
        ids = [ids[i] for i in rng.permutation(n)]
        k = int(rng.integers(1, n + 2))
        hits, values = _top_positive(scores, min(k, n), _doc_id_ranks(ids))
        full = [(d, s) for d, s in trec_sorted(dict(zip(ids, scores.tolist()))) if s > 0]
        assert [(ids[h], v) for h, v in zip(hits.tolist(), values.tolist())] == full[:k], trial


def test_ties_at_the_cut_keep_the_corpus_order_as_r2meds_stable_sort(tmp_path: Path) -> None:
    # r2med-compat: 150 identical documents score equally. R2MED's BM25 script keeps
    # sorted(scores of the whole corpus, reverse=True)[:100], a stable sort over corpus order, so
    # k keeps the tied documents that come first in the corpus, in that order (not the largest ids
    # trec_eval would rank first, nor whichever a partition leaves).
    r = _tie_retriever("r2med-compat", tmp_path)
    corpus_ids = [ids for ids, _ in _tie_corpus()]
    req = [SearchRequest("q", "fever rash")]
    full = r.search(req, 152)["q"]  # compat fills to the whole corpus
    assert set(full) == set(corpus_ids) and len(set(v for v in full.values() if 0 < v < max(full.values()))) == 1
    reference = sorted(corpus_ids, key=lambda d: -full[d])  # Python's sort is stable
    for k in (1, 10, 100, 150):
        assert list(r.search(req, k)["q"]) == reference[:k]
    kept = list(r.search(req, 100)["q"])[1:]
    assert kept == [d for d in corpus_ids if d.startswith("dup")][:99]


def test_lucene_mode_breaks_ties_as_anserini_does(tmp_path: Path) -> None:
    # Anserini sorts equal scores by document id ascending, in the ranking and at the k cut
    r = _tie_retriever("lucene", tmp_path)
    req = [SearchRequest("q", "fever rash")]
    full = list(r.search(req, 152)["q"])
    assert full == ["best"] + [f"dup{i:03d}" for i in range(150)]
    for k in (1, 10, 100, 150):
        assert list(r.search(req, k)["q"]) == full[:k]


def _tie_corpus() -> list[tuple[str, str]]:
    """150 identical documents, a better one and an unrelated one, in a shuffled corpus order."""
    ids = [f"dup{i:03d}" for i in range(150)] + ["best", "other"]
    texts = ["fever and rash"] * 150 + ["fever rash fever rash measles", "insulin and glucose"]
    order = np.random.default_rng(1).permutation(len(ids))
    return [(ids[i], texts[i]) for i in order]


def _tie_retriever(mode: str, tmp_path: Path) -> BM25Retriever:
    corpus = _tie_corpus()
    t = make_task([text for _, text in corpus], name="ties", ids=[i for i, _ in corpus])
    return BM25Retriever.for_task(t, mode=mode, index_root=tmp_path, show_progress=False)


# --- the saved index -----------------------------------------------------------------------------


def test_index_is_saved_then_loaded_without_reindexing(
    texts: list[str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t = make_task(texts[:400], name="Bio logy/x")
    reqs = [SearchRequest("q", "socket timeout"), SearchRequest("r", "unicode string")]
    for mode in ("lucene", "r2med-compat"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="r2med_agent.retrieval.bm25"):
            first = BM25Retriever.for_task(t, mode=mode, index_root=tmp_path, show_progress=False)
            second = BM25Retriever.for_task(t, mode=mode, index_root=tmp_path, show_progress=False)
        assert first.built_index and not second.built_index
        assert first.index_dir == second.index_dir
        assert first.index_dir.parent == tmp_path
        assert (first.index_dir / "meta.json").is_file()
        messages = [r.getMessage() for r in caplog.records]
        assert sum(m.startswith("indexed 400 docs") for m in messages) == 1
        assert sum(m.startswith(f"loaded BM25 index from {first.index_dir}") for m in messages) == 1
        assert second.search(reqs, 20) == first.search(reqs, 20)
    assert sorted(p.name.startswith("Bio-logy-x-") for p in tmp_path.iterdir()) == [True, True]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_default_index_root_is_the_cache_dir(texts: list[str], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path))
    r = BM25Retriever.for_task(make_task(texts[:50]), show_progress=False)
    assert r.index_dir.parent == tmp_path / "bm25"


def test_index_key_changes_with_corpus_mode_and_parameters(texts: list[str]) -> None:
    a = make_task(texts[:20])
    b = make_task(texts[:19] + [texts[20]])
    aid = LuceneEnglishAnalyzer.id
    base = index_key(a, "lucene", 0.9, 0.4, aid)
    assert base == index_key(a, "lucene", 0.9, 0.4, aid)
    others = [
        index_key(b, "lucene", 0.9, 0.4, aid),
        index_key(a, "r2med-compat", 0.9, 0.4, aid),
        index_key(a, "lucene", 1.2, 0.4, aid),
        index_key(a, "lucene", 0.9, 0.75, aid),
        index_key(a, "lucene", 0.9, 0.4, aid + "-v2"),
    ]
    assert len({base, *others}) == 6


def test_changed_parameters_build_a_new_index(texts: list[str], tmp_path: Path) -> None:
    t = make_task(texts[:100])
    r1 = BM25Retriever.for_task(t, index_root=tmp_path, show_progress=False)
    r2 = BM25Retriever.for_task(t, k1=1.2, index_root=tmp_path, show_progress=False)
    r3 = BM25Retriever.for_task(t, k1=1.2, index_root=tmp_path, show_progress=False)
    assert r1.built_index and r2.built_index and not r3.built_index
    assert r1.index_dir != r2.index_dir
    req = [SearchRequest("q", "return a string value")]
    assert r1.search(req, 5)["q"] != r2.search(req, 5)["q"]


def test_saved_index_of_other_documents_is_rebuilt(texts: list[str], tmp_path: Path) -> None:
    # Same fingerprint (a careless caller), other document ids: the saved ids catch it.
    t1 = make_task(texts[:60])
    t2 = make_task(texts[:60], ids=[f"x{i}" for i in range(60)])
    object.__setattr__(t2, "fingerprint", t1.fingerprint)
    BM25Retriever.for_task(t1, index_root=tmp_path, show_progress=False)
    r = BM25Retriever.for_task(t2, index_root=tmp_path, show_progress=False)
    assert r.built_index
    hits = r.search([SearchRequest("q", texts[3])], 3)["q"]
    assert next(iter(hits)) == "x3"


def test_incomplete_or_corrupt_saved_index_is_rebuilt(texts: list[str], tmp_path: Path) -> None:
    t = make_task(texts[:40])
    first = BM25Retriever.for_task(t, index_root=tmp_path, show_progress=False)
    (first.index_dir / "meta.json").write_text("{not json", encoding="utf-8")
    second = BM25Retriever.for_task(t, index_root=tmp_path, show_progress=False)
    assert second.built_index
    (second.index_dir / "meta.json").unlink()  # e.g. a folder copied by hand, half
    third = BM25Retriever.for_task(t, index_root=tmp_path, show_progress=False)
    assert third.built_index
    fourth = BM25Retriever.for_task(t, index_root=tmp_path, show_progress=False)
    assert not fourth.built_index
    req = [SearchRequest("q", texts[5])]
    assert fourth.search(req, 3) == first.search(req, 3)


def test_a_failed_save_leaves_nothing_behind(texts: list[str], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from r2med_agent.retrieval.bm25 import compat

    def boom(self, folder: Path, show_progress: bool) -> None:
        (folder / "partial.npy").write_bytes(b"x")
        raise OSError("disk full")

    monkeypatch.setattr(compat._CompatIndex, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        BM25Retriever.for_task(make_task(texts[:30]), mode="r2med-compat", index_root=tmp_path,
                               show_progress=False)
    assert list(tmp_path.iterdir()) == []


# --- combine rules and errors --------------------------------------------------------------------


def test_combine_rules() -> None:
    def text(rule: str, expansion: str = "EXP") -> str:
        return bm25_query_text(SearchRequest("q", "QUERY", expansion, rule))  # type: ignore[arg-type]

    assert text("none") == "QUERY"
    assert text("hyde") == "EXP"
    assert text("query2doc") == "QUERY QUERY EXP"
    assert bm25_query_text(SearchRequest("q", "QUERY", "EXP", "query2doc"), compat=True) == "QUERYQUERY EXP"
    assert text("lamer") == "QUERY EXP"
    assert text("reasoning") == "EXP"
    for rule in ("hyde", "query2doc", "lamer", "reasoning"):
        assert text(rule, "  ") == "QUERY"
    with pytest.raises(ConfigError, match="allowed: none, hyde, query2doc, lamer, reasoning"):
        text("bogus")


def test_search_applies_the_combine_rule_and_warns_once_on_blank_expansions(
    lucene: BM25Retriever, caplog: pytest.LogCaptureFixture
) -> None:
    hyde = SearchRequest("h", "zzqxv", "socket timeout", "hyde")
    plain = SearchRequest("p", "socket timeout")
    blank = [SearchRequest(f"b{i}", "socket timeout", "", "lamer") for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="r2med_agent.retrieval.bm25"):
        run = lucene.search([hyde, plain, *blank], 5)
    assert run["h"] == run["p"] == run["b0"] == run["b2"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "3 'lamer' request(s)" in warnings[0]


def test_bad_options_raise_actionable_errors(task: Task, tmp_path: Path,
                                             lucene: BM25Retriever) -> None:
    with pytest.raises(ConfigError, match="allowed: lucene, r2med-compat"):
        BM25Retriever.for_task(task, mode="okapi", index_root=tmp_path)
    with pytest.raises(ConfigError, match="b must be between 0 and 1"):
        BM25Retriever.for_task(task, b=1.5, index_root=tmp_path)
    with pytest.raises(ConfigError, match="k1"):
        BM25Retriever.for_task(task, k1=-1, index_root=tmp_path)
    with pytest.raises(DataError, match="empty corpus"):
        BM25Retriever.for_task(make_task([]), index_root=tmp_path)
    with pytest.raises(DataError, match="no document has an indexable term"):
        BM25Retriever.for_task(make_task(["the a of", ""]), index_root=tmp_path)
    with pytest.raises(ConfigError, match="k must be a positive integer"):
        lucene.search([SearchRequest("q", "x")], 0)
    with pytest.raises(ValueError, match="appears twice"):
        lucene.search([SearchRequest("q", "x"), SearchRequest("q", "y")], 5)
