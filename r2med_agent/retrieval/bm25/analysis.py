"""Text analysis for BM25: pyserini's default Lucene English analyzer, exactly, in Python.

R2MED's BM25 uses pyserini's ``get_lucene_analyzer()`` (Anserini's ``DefaultEnglishAnalyzer``,
Lucene 9.9.1 in pyserini 1.6.0)::

    StandardTokenizer -> EnglishPossessiveFilter -> LowerCaseFilter -> StopFilter
        -> PorterStemFilter

This module reproduces that chain without Java (``benchmarks/lucene_parity.py`` and
``tests/integration/test_lucene_parity.py`` compare it with the real one):

* **Tokenisation** and **lowercasing** are :mod:`~r2med_agent.retrieval.bm25.tokenizer`'s.
* **Possessives**: a trailing ``'s`` (also ``’s``, ``＇s``) is removed before the stopword test,
  so ``it's`` is dropped as ``it``.
* **Stopwords**: Lucene's ``EnglishAnalyzer.ENGLISH_STOP_WORDS_SET`` (33 words).
* **Stemming**: Lucene's ``PorterStemmer`` departs from Snowball's ``porter`` in a few rules
  (:mod:`~r2med_agent.retrieval.bm25.porter`). PyStemmer (C) stems every distinct word; the few
  words those rules can reach (about 3% of a vocabulary) are re-stemmed by
  :func:`~r2med_agent.retrieval.bm25.porter.lucene_porter_stem`, a port of Lucene's class. The
  tests check the result equals the port on a real vocabulary.

Work is done per distinct word, not per occurrence: occurrences become distinct-token ids through
C-level dict lookups, and stopword removal and stemming are applied through a numpy lookup table.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, count

import numpy as np

from r2med_agent.retrieval.bm25.porter import lucene_porter_stem
from r2med_agent.retrieval.bm25.tokenizer import (
    _ASCII_CANDIDATES,
    _JOINER,
    _MAX_TOKEN_UNITS,
    _findall,
    _findall_unicode,
    _only_underscores,
    java_lower,
    tokenize,
)

__all__ = [
    "ENGLISH_STOP_WORDS",
    "AnalyzedTexts",
    "LuceneEnglishAnalyzer",
]

ENGLISH_STOP_WORDS: frozenset[str] = frozenset(
    (
        "a an and are as at be but by for if in into is it no not of on or such "
        "that the their then there these they this to was will with"
    ).split()
)
"""Lucene's ``EnglishAnalyzer.ENGLISH_STOP_WORDS_SET``, the default of pyserini's analyzer."""

_POSSESSIVE_ENDINGS = ("'s", "\u2019s", "\uff07s")

# Words where Snowball's "porter" and Lucene's PorterStemmer can disagree (see the porter module's doc):
# "-bli"/"-logi" forms reach step 2 only through a "bl" or "log" in the word, and the undoubling
# difference needs a double consonant other than bdfgmnprt + l s z right before -ed/-ing(s).
_SNOWBALL_DIFFERS = re.compile(r"bl|log|([^aeioulszbdfgmnprt])\1(?:ed|ing)s?$")


@dataclass(frozen=True)
class AnalyzedTexts:
    """Analyzed texts as term ids, stored flat: text ``i`` is ``ids[offsets[i]:offsets[i + 1]]``.

    Terms keep their order and repetitions (a term occurring twice appears twice).
    """

    ids: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def row(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    def to_lists(self) -> list[list[int]]:
        """One list of Python ints per text (the shape bm25s takes)."""
        flat = self.ids.tolist()
        bounds = self.offsets.tolist()
        return [flat[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]


class LuceneEnglishAnalyzer:
    """pyserini's default English analyzer (see the module doc), batched.

    Attributes:
        id: a string naming the analyzer and its version; part of every index cache key, so a
            change in analysis (bump it) never reuses an index built by an older analyzer.
    """

    id = "lucene-english:lucene9.9.1-standard:possessive:java-lower:stop33:porter-lucene:v2"

    def __init__(self) -> None:
        import Stemmer  # PyStemmer, a core dependency

        self._stemmer = Stemmer.Stemmer("porter")
        self._memo: dict[str, str | None] = {}

    def analyze(self, text: str) -> list[str]:
        """Terms of one text, in order (stopwords removed, stemmed)."""
        return self.analyze_many([text])[0]

    def analyze_many(self, texts: Sequence[str]) -> list[list[str]]:
        """Terms of each text, in order."""
        tokens = [tokenize(t) for t in texts]
        terms = self._terms(set(chain.from_iterable(tokens)), remember=False)
        return [[terms[t] for t in toks if terms[t] is not None] for toks in tokens]

    def fit(
        self, texts: Sequence[str], show_progress: bool = False
    ) -> tuple[AnalyzedTexts, dict[str, int]]:
        """Analyze a corpus and build its vocabulary.

        Args:
            texts: the documents.
            show_progress: a progress bar over the texts while tokenizing.

        Returns:
            The texts as term ids, and the vocabulary ``{term: id}`` with ids ``0..V-1`` in order
            of first occurrence.
        """
        raw_ids, offsets, raw_vocab = self._raw(texts, show_progress)
        terms = self._terms(raw_vocab, remember=False)
        vocab: dict[str, int] = {}
        lookup = np.full(len(raw_vocab) + 1, -1, dtype=np.int64)
        for i, raw in enumerate(raw_vocab):
            term = terms[raw]
            if term is not None:
                lookup[i] = vocab.setdefault(term, len(vocab))
        return _select(lookup[raw_ids], offsets), vocab

    def transform(self, texts: Sequence[str], vocab: dict[str, int]) -> AnalyzedTexts:
        """Analyze texts against an existing vocabulary; terms outside it are dropped."""
        raw_ids, offsets, raw_vocab = self._raw(texts)
        terms = self._terms(raw_vocab)
        lookup = np.full(len(raw_vocab) + 1, -1, dtype=np.int64)
        for i, raw in enumerate(raw_vocab):
            term = terms[raw]
            if term is not None:
                lookup[i] = vocab.get(term, -1)
        return _select(lookup[raw_ids], offsets)

    # -- internals --

    @staticmethod
    def _raw(
        texts: Sequence[str], show_progress: bool = False
    ) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """Tokenize; return occurrence ids into the list of distinct raw tokens (in order of first
        occurrence; runs of ``_`` left out, as :func:`tokenize` leaves them), and offsets.

        An ASCII text is lowercased and cut into *candidates* in one pass of ``bytes.translate``
        and ``bytes.split`` (:data:`_ASCII_CANDIDATES`: the runs of the characters a token can
        hold); every token of the grammar lies inside one candidate, and a candidate's tokens
        depend on the candidate alone, so each distinct candidate is tokenized once
        (:func:`_findall`: most are one token, themselves) and its occurrences take its tokens.
        Texts with other characters take the full grammar. Tokens become integer keys as they are
        read (a C-level ``dict.setdefault`` per token, text by text, while the strings are in the
        cache); a key is the stream position of the token's first occurrence, which gives the
        first-occurrence order.
        """
        if show_progress:
            from r2med_agent.progress import stage_bar

            texts = stage_bar(texts, desc="BM25 analyze", unit="doc", leave=False)
        keys = count()
        candidates: dict[bytes, int] = {}  # ASCII candidate -> key (its first position)
        unicode_raw: dict[str, int] = {}  # raw token of a non-ASCII text -> key
        chunks: list[np.ndarray] = []
        lengths: list[int] = []
        table = _ASCII_CANDIDATES
        for text in texts:
            if text.isascii():
                tokens: list = text.encode("ascii").translate(table).split()
                seen: dict = candidates
            else:
                tokens, seen = _findall_unicode(java_lower(text)), unicode_raw
            chunks.append(np.fromiter(map(seen.setdefault, tokens, keys), dtype=np.int64,
                                      count=len(tokens)))
            lengths.append(len(tokens))
        n_keys = next(keys)
        # each key's raw tokens, and each raw token's first position (key, index in the key)
        first: dict[str, tuple[int, int]] = {t: (k, 0) for t, k in unicode_raw.items()}
        split: dict[int, list[str]] = {}  # candidate key -> its tokens, where not one token
        for raw, k in candidates.items():
            cand = raw.decode("ascii")
            if len(cand) > _MAX_TOKEN_UNITS or _JOINER.search(cand) or cand[0] == "_":
                tokens = [t for t in _findall(cand) if not _only_underscores(t)]
                if tokens != [cand]:
                    split[k] = tokens
                    for j, t in enumerate(tokens):
                        if first.get(t, (n_keys, 0)) > (k, j):
                            first[t] = (k, j)
                    continue
            if first.get(cand, (n_keys, 0)) > (k, 0):
                first[cand] = (k, 0)
        raw_vocab = sorted(first, key=first.__getitem__)
        raw_id = dict(zip(raw_vocab, range(len(raw_vocab))))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # number the keys (stream positions) 0..n-1, candidates first; per number, its raw ids
        cand_keys = np.fromiter(candidates.values(), dtype=np.int64, count=len(candidates))
        uni_keys = np.fromiter(unicode_raw.values(), dtype=np.int64, count=len(unicode_raw))
        number = np.empty(n_keys, dtype=np.int32 if n_keys < 2**31 else np.int64)
        number[cand_keys] = np.arange(len(cand_keys))
        number[uni_keys] = np.arange(len(cand_keys), len(cand_keys) + len(uni_keys))
        per_key = [split[k] if k in split else (cand,) for cand, k in
                   zip(map(bytes.decode, candidates), candidates.values())]
        per_key.extend((t,) for t in unicode_raw)
        occ = number[np.concatenate(chunks)] if chunks else np.zeros(0, dtype=np.int64)
        if not split:
            ids = np.fromiter((raw_id[t] for (t,) in per_key), dtype=np.int64, count=len(per_key))
            return ids[occ], offsets, raw_vocab
        # candidates of several tokens, or none: expand their occurrences in place
        sizes = np.fromiter(map(len, per_key), dtype=np.int64, count=len(per_key))
        ids = np.fromiter((raw_id[t] for v in per_key for t in v), dtype=np.int64,
                          count=int(sizes.sum()))
        per_occ = sizes[occ]
        ends = np.cumsum(per_occ)
        before = ends - per_occ
        total = int(ends[-1]) if len(ends) else 0
        pos = np.repeat((np.cumsum(sizes) - sizes)[occ] - before, per_occ)
        pos += np.arange(total, dtype=np.int64)
        offsets = np.append(before, total)[offsets]
        return ids[pos], offsets, raw_vocab

    def _terms(self, raw_tokens: Iterable[str], remember: bool = True) -> dict[str, str | None]:
        """Map distinct raw tokens to their term (None: dropped), stemming each new word once.

        With ``remember``, results are kept for later calls (queries repeat words across calls;
        a corpus's vocabulary is analyzed once and not kept).
        """
        memo = self._memo
        out: dict[str, str | None] = {}
        new_raw: list[str] = []
        words: list[str] = []
        for raw in raw_tokens:
            if raw in memo:
                out[raw] = memo[raw]
                continue
            word = raw[:-2] if raw.endswith(_POSSESSIVE_ENDINGS) else raw
            if not word or word in ENGLISH_STOP_WORDS or _only_underscores(word):
                out[raw] = None
            else:
                new_raw.append(raw)
                words.append(word)
        out.update(zip(new_raw, self._stem_words(words)))
        if remember:
            memo.update(out)
        return out

    def _stem_words(self, words: list[str]) -> list[str]:
        stems = self._stemmer.stemWords(words)
        search = _SNOWBALL_DIFFERS.search
        for i, word in enumerate(words):
            if len(word) <= 2:
                stems[i] = word
            elif search(word):
                stems[i] = lucene_porter_stem(word)
        return stems


def _select(term_ids: np.ndarray, offsets: np.ndarray) -> AnalyzedTexts:
    """Drop the -1 entries (stopwords, unknown terms) and recompute per-text offsets."""
    kept = np.flatnonzero(term_ids >= 0)
    return AnalyzedTexts(ids=term_ids[kept].astype(np.int32),
                         offsets=np.searchsorted(kept, offsets).astype(np.int64))
