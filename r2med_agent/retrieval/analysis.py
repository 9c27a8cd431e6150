"""Text analysis for BM25: pyserini's default Lucene English analyzer, exactly, in Python.

R2MED's BM25 uses pyserini's ``get_lucene_analyzer()`` (Anserini's ``DefaultEnglishAnalyzer``,
Lucene 9.9.1 in pyserini 1.6.0)::

    StandardTokenizer -> EnglishPossessiveFilter -> LowerCaseFilter -> StopFilter
        -> PorterStemFilter

This module reproduces that chain without Java (``benchmarks/lucene_parity.py`` and
``tests/test_lucene_parity.py`` compare it with the real one):

* **Tokenisation** is ``StandardTokenizer``'s grammar (UAX#29 word rules, plus Lucene's rules for
  emoji sequences, Southeast Asian scripts, Han and Hiragana) written as one regular expression.
  Lucene's scanner was generated for Unicode 9 (emoji: Unicode 11) and sees each code point only
  through its character class; those classes are read from the real scanner by
  ``tools/lucene_uax29_tables.py`` into ``resources/lucene_uax29.json``. A text is translated to
  one representative character per class, position for position, and the expression runs on that
  (it stays small and compiles at once). Lucene's scanner buffer holds 255 UTF-16 units: a longer
  token yields the longest match that fits, and scanning resumes after it (one known difference:
  when no match fits, e.g. more than 255 ``_`` before a letter, Lucene emits the 255 units
  anyway; here they are skipped). ASCII texts take an equivalent ASCII-only pattern, twice as
  fast; a corpus's ASCII texts are first lowercased and cut into candidates by
  ``bytes.translate`` and ``bytes.split`` (four times faster than the pattern), and each distinct
  candidate is tokenized once (``tests/test_bm25.py`` checks both against the full grammar, text
  by text). One-character tokens are kept, as Lucene keeps them (bm25s's default pattern
  ``\\w\\w+`` drops them).
* **Possessives**: a trailing ``'s`` (also ``’s``, ``＇s``) is removed before the stopword test,
  so ``it's`` is dropped as ``it``.
* **Lowercasing** is Java's, code point by code point (:func:`java_lower`): ``İ`` becomes ``i`` and
  ``Σ`` is always ``σ``, where Python's ``str.lower`` gives ``i̇`` and a word-final ``ς``.
* **Stopwords**: Lucene's ``EnglishAnalyzer.ENGLISH_STOP_WORDS_SET`` (33 words).
* **Stemming**: Lucene's ``PorterStemmer`` is Martin Porter's reference implementation, which
  departs from the published algorithm that PyStemmer's ``porter`` (Snowball) follows: it maps
  ``-bli`` to ``-ble`` (Snowball: only ``-abli``) and ``-logi`` to ``-log`` (``possibly``,
  ``cardiology``), undoubles any double consonant but ``l s z`` after removing ``-ed``/``-ing``
  (Snowball: only ``bb dd ff gg mm nn pp rr tt``; ``trekking``), and leaves words of one or two
  letters alone (``us``). PyStemmer (C) stems every distinct word; the few words those rules can
  reach (about 3% of a vocabulary) are re-stemmed by :func:`lucene_porter_stem`, a port of
  Lucene's class. The tests check the result equals the port on a real vocabulary.

Work is done per distinct word, not per occurrence: occurrences become distinct-token ids through
C-level dict lookups, and stopword removal and stemming are applied through a numpy lookup table.
"""

from __future__ import annotations

import functools
import json
import re
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, count

import numpy as np

__all__ = [
    "ENGLISH_STOP_WORDS",
    "AnalyzedTexts",
    "LuceneEnglishAnalyzer",
    "lucene_porter_stem",
]

ENGLISH_STOP_WORDS: frozenset[str] = frozenset(
    (
        "a an and are as at be but by for if in into is it no not of on or such "
        "that the their then there these they this to was will with"
    ).split()
)
"""Lucene's ``EnglishAnalyzer.ENGLISH_STOP_WORDS_SET``, the default of pyserini's analyzer."""

# --- tokenizer -------------------------------------------------------------------------------

_MAX_TOKEN_UNITS = 255
"""StandardTokenizer's maximum token length, in UTF-16 code units: longer runs are cut into pieces
of this length (the scanner's buffer is that long)."""


# Characters the grammar names one by one, as pseudo-classes beside the table's classes.
_LITERALS = {
    "KeyCapBase": "0123456789#*",
    "Accidental": "\u00a9\u00ae\u2122\u3030\u303d",
    "PresSel": "\ufe0e\ufe0f",
    "EmojiPres": "\ufe0f",
    "KeyCap": "\u20e3",
    "TagSpec": "".join(map(chr, range(0xE0020, 0xE007F))),
    "TagTerm": "\U000e007f",
}
_REPS = string.ascii_letters + string.digits
"""Class representatives: every character of a text is translated to one of these (ASCII, so the
translated text is a one-byte-per-character string, the fastest for ``re``)."""


@functools.cache
def _scanner() -> tuple[np.ndarray, dict[str, str]]:
    """(translation table, regex class per macro) of Lucene's tokenizer character classes.

    The classes (``resources/lucene_uax29.json``) were read from Lucene 9.9.1's scanner by
    ``tools/lucene_uax29_tables.py``. Every code point is translated (a numpy lookup) to one
    ASCII representative per distinct set of classes it belongs to (a few dozen), so the grammar
    is a small regular expression over representatives (compiled in milliseconds) and matches map
    back to the original text position for position (code points in no class have their own).
    """
    from importlib import resources

    raw = json.loads(
        resources.files("r2med_agent.resources").joinpath("lucene_uax29.json").read_text("utf-8")
    )["classes"]
    names = sorted(set(raw) | set(_LITERALS))
    sig = np.zeros(0x110000, dtype=np.int64)  # per code point, a bit per class it belongs to
    for bit, name in enumerate(names):
        ranges = raw[name] if name in raw else [[ord(ch), ord(ch)] for ch in _LITERALS[name]]
        for a, b in ranges:
            sig[a : b + 1] |= 1 << bit
    keys, inverse = np.unique(sig, return_inverse=True)
    if len(keys) > len(_REPS):
        raise RuntimeError(f"{len(keys)} character classes; only {len(_REPS)} representatives")
    reps = {
        frozenset(n for bit, n in enumerate(names) if key >> bit & 1): _REPS[i]
        for i, key in enumerate(keys.tolist())
    }
    table = np.frombuffer(_REPS.encode("ascii"), dtype=np.uint8)[inverse.ravel()]
    reps.pop(frozenset(), None)  # in no class: not a representative of anything
    macros = set(raw) | set(_LITERALS)
    cls = {m: "".join(r for k, r in reps.items() if m in k) for m in macros}

    def union(*names: str, minus: tuple[str, ...] = ()) -> str:
        return "".join(
            r for k, r in reps.items() if k & set(names) and not k & set(minus)
        )

    # the grammar's EmojiChar: Extended_Pictographic, or Emoji but not a regional indicator, a
    # keycap base, an "accidental" emoji or a modifier
    cls["EmojiChar"] = "".join(
        r for k, r in reps.items()
        if "Extended_Pictographic" in k
        or ("Emoji" in k and not k & {"Regional_Indicator", "KeyCapBase", "Accidental",
                                      "Emoji_Modifier"})
    )
    cls["ExtFmtSansPresSel"] = union("ExtFmtZwj", minus=("PresSel", "ZWJ"))
    return table, cls


@functools.cache
def _token_re() -> re.Pattern[str]:
    """StandardTokenizer's grammar (UAX#29 word rules plus Lucene's emoji, Southeast Asian, Han and
    Hiragana rules) as one regular expression over class representatives (see :func:`_scanner`)."""
    c = {name: f"[{body}]" if body else "(?!)" for name, body in _scanner()[1].items()}

    def ex(name: str) -> str:
        return f"{c[name]}{c['ExtFmtZwj']}*"

    a, h, n, k = ex("AHLetter"), ex("Hebrew_Letter"), ex("Numeric"), ex("Katakana")
    ml, mn, enl = ex("MidLetter"), ex("MidNum"), ex("ExtendNumLet")
    sq, dq = ex("Single_Quote"), ex("Double_Quote")
    efz = c["ExtFmtZwj"][1:-1] if c["ExtFmtZwj"].startswith("[") else ""

    def run(name: str) -> str:
        """``X (X)*`` with ``X = class ExtFmtZwj*`` as one run of a single character class (the
        regex engine's fastest loop): ``[class][class ExtFmtZwj]*``."""
        return f"{c[name]}[{c[name][1:-1]}{efz}]*" if c[name].startswith("[") else c[name]

    ka, na, aa = run("Katakana"), run("Numeric"), run("AHLetter")
    # the grammar's X ((ExtendNumLet* | Mid) X)*, with the runs absorbing the zero-ENL case
    unit = (
        rf"(?:{ka}(?:(?:{enl})+{ka})*"
        rf"|(?:{h}(?:{sq}|{dq}{h})|{na}(?:(?:(?:{enl})+|{mn}){na})*"
        rf"|{aa}(?:(?:(?:{enl})+|{ml}){aa})*)+)"
    )
    word = rf"(?:{enl})*{unit}(?:(?:{enl})+{unit})*(?:{enl})*"
    zwj = c["ZWJ"]
    # ExtFmtZwjSansPresSel*; a ZWJ before another emoji is left to join the two (the longest match
    # the scanner finds)
    starts = f"(?:{c['EmojiChar']}|{c['Emoji_Modifier']})"
    sans = rf"(?:{c['ExtFmtSansPresSel']}|{zwj}(?!{zwj}*{starts}))*"
    emoji_char = f"{c['EmojiChar']}{sans}"
    modifier = f"{c['Emoji_Modifier']}{sans}"
    pres = c["EmojiPres"]
    e1 = rf"(?:{zwj}*{emoji_char}{pres}?|(?:{zwj}*{emoji_char})?{modifier})"
    emoji = (
        rf"{e1}(?:{c['TagSpec']}+{c['TagTerm']}|(?:{zwj}{e1})*)"
        rf"|{c['KeyCapBase']}{sans}{pres}?{c['KeyCap']}{sans}"
        rf"|(?:{ex('Regional_Indicator')}){{2}}"
    )
    # the characters a token can start with, tested first so that other positions fail at once
    first = "".join(
        c[n][1:-1] for n in ("ExtendNumLet", "Katakana", "Hebrew_Letter", "Numeric", "AHLetter",
                             "EmojiChar", "Emoji_Modifier", "ZWJ", "KeyCapBase",
                             "Regional_Indicator", "Complex_Context", "Han", "Hiragana")
        if c[n].startswith("[")
    )
    return re.compile(
        rf"(?=[{first}])"
        rf"(?:{word}|{emoji}|(?:{ex('Complex_Context')})+|{ex('Han')}|{ex('Hiragana')})"
    )


_ASCII_TOKEN_RE = re.compile(
    r"[a-z0-9_]+(?:(?:(?<=[a-z])[.:'](?=[a-z])|(?<=[0-9])[.,;'](?=[0-9]))[a-z0-9_]+)*"
)
"""The same grammar restricted to lowercase ASCII text (twice as fast; most documents are ASCII)."""

_TOKEN_BYTES = b"abcdefghijklmnopqrstuvwxyz0123456789_.:',;"
_ASCII_CANDIDATES = bytes(
    c + 32 if 65 <= c <= 90 else c if c in _TOKEN_BYTES else 32 for c in range(256)
)
"""A ``bytes.translate`` table: ASCII lowercased, every character no token can hold (all but
``[a-z0-9_.:',;]``) made a space. A text's words after it are *candidates*: each holds whole
tokens of the grammar (a token never spans a character outside that set), and is found far
faster than by a regular expression."""

_JOINER = re.compile(r"[.:',;]")

_POSSESSIVE_ENDINGS = ("'s", "\u2019s", "\uff07s")

_JAVA_LOWER_FIX = str.maketrans({"\u0130": "i", "\u03a3": "\u03c3"})
"""Java lowercases code point by code point (``Character.toLowerCase``): ``İ`` becomes ``i``
(Python: ``i`` + combining dot) and ``Σ`` is always ``σ`` (Python: ``ς`` ending a word)."""


def java_lower(text: str) -> str:
    """``text`` lowercased as Lucene's ``LowerCaseFilter`` does."""
    if text.isascii() or ("\u0130" not in text and "\u03a3" not in text):
        return text.lower()  # (translating is a dict lookup per character: only when needed)
    return text.translate(_JAVA_LOWER_FIX).lower()


def _findall(text: str) -> list[str]:
    """Raw tokens of lowercased ``text``."""
    if text.isascii():
        tokens = _ASCII_TOKEN_RE.findall(text)
        if tokens and max(map(len, tokens)) > _MAX_TOKEN_UNITS:
            return _split_long(text, _ASCII_TOKEN_RE)
        return tokens  # (may hold runs of "_", which are no token: the callers drop them)
    return _findall_unicode(text)


def _findall_unicode(text: str) -> list[str]:
    """Raw tokens of lowercased ``text`` by the full grammar (any text)."""
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    mapped = _scanner()[0][codes].tobytes().decode("ascii")
    tokens = [text[m.start() : m.end()] for m in _token_re().finditer(mapped)]
    if tokens and max(map(len, tokens)) > _MAX_TOKEN_UNITS // 2:  # astral characters count twice
        return _split_long(text, _token_re(), mapped)
    return tokens


def _split_long(text: str, pattern: re.Pattern[str], mapped: str | None = None) -> list[str]:
    """Tokens of ``text`` with StandardTokenizer's length limit: a match longer than 255 UTF-16
    units yields the longest match within its first 255 units, and scanning resumes after it.
    ``mapped`` is the text the pattern runs on (position for position), when not ``text``."""
    out: list[str] = []
    pos = 0
    scanned = text if mapped is None else mapped
    while (m := pattern.search(scanned, pos)) is not None:
        end = m.end()
        units = 0
        for i in range(m.start(), end):
            units += 2 if ord(text[i]) > 0xFFFF else 1
            if units > _MAX_TOKEN_UNITS:
                # the scanner's buffer is full: it returns the longest match that fits
                end = pattern.match(scanned, m.start(), i).end()
                break
        token = text[m.start() : end]
        if not _only_underscores(token):
            out.append(token)
        pos = end
    return out


def tokenize(text: str) -> list[str]:
    """Split ``text`` into StandardTokenizer's tokens, lowercased (no stopwords, no stemming)."""
    return [t for t in _findall(java_lower(text)) if not _only_underscores(t)]


def _only_underscores(token: str) -> bool:
    # the ASCII pattern matches runs of connector punctuation ("___"), which are no token
    return token[0] == "_" and not token.strip("_")


# --- Lucene's Porter stemmer ------------------------------------------------------------------


def lucene_porter_stem(word: str) -> str:
    """Stem one lowercase word exactly as Lucene's ``PorterStemmer`` (``PorterStemFilter``) does.

    A line-by-line port of ``org.apache.lucene.analysis.en.PorterStemmer`` (Martin Porter's
    reference implementation). Pure Python, so slow: the analyzer uses it only for the words where
    PyStemmer's Snowball ``porter`` can disagree.
    """
    return _PorterStemmer(word).stem()


class _PorterStemmer:
    """State of one stemming run; method names follow Lucene's class."""

    __slots__ = ("b", "j", "k")

    def __init__(self, word: str) -> None:
        self.b = list(word)
        self.k = len(word) - 1
        self.j = 0

    def cons(self, i: int) -> bool:
        ch = self.b[i]
        if ch in "aeiou":
            return False
        if ch == "y":
            return True if i == 0 else not self.cons(i - 1)
        return True

    def m(self) -> int:
        n = 0
        i = 0
        j = self.j
        while True:
            if i > j:
                return n
            if not self.cons(i):
                break
            i += 1
        i += 1
        while True:
            while True:
                if i > j:
                    return n
                if self.cons(i):
                    break
                i += 1
            i += 1
            n += 1
            while True:
                if i > j:
                    return n
                if not self.cons(i):
                    break
                i += 1
            i += 1

    def vowelinstem(self) -> bool:
        return any(not self.cons(i) for i in range(self.j + 1))

    def doublec(self, j: int) -> bool:
        if j < 1 or self.b[j] != self.b[j - 1]:
            return False
        return self.cons(j)

    def cvc(self, i: int) -> bool:
        if i < 2 or not self.cons(i) or self.cons(i - 1) or not self.cons(i - 2):
            return False
        return self.b[i] not in "wxy"

    def ends(self, s: str) -> bool:
        length = len(s)
        o = self.k - length + 1
        if o < 0:
            return False
        if "".join(self.b[o : self.k + 1]) != s:
            return False
        self.j = self.k - length
        return True

    def setto(self, s: str) -> None:
        o = self.j + 1
        self.b[o:] = list(s)
        self.k = self.j + len(s)

    def r(self, s: str) -> None:
        if self.m() > 0:
            self.setto(s)

    def step1(self) -> None:
        b = self.b
        if b[self.k] == "s":
            if self.ends("sses"):
                self.k -= 2
            elif self.ends("ies"):
                self.setto("i")
            elif b[self.k - 1] != "s":
                self.k -= 1
            del b[self.k + 1 :]
        if self.ends("eed"):
            if self.m() > 0:
                self.k -= 1
        elif (self.ends("ed") or self.ends("ing")) and self.vowelinstem():
            self.k = self.j
            del b[self.k + 1 :]
            if self.ends("at"):
                self.setto("ate")
            elif self.ends("bl"):
                self.setto("ble")
            elif self.ends("iz"):
                self.setto("ize")
            elif self.doublec(self.k):
                ch = b[self.k]
                self.k -= 1
                if ch in "lsz":
                    self.k += 1
            elif self.m() == 1 and self.cvc(self.k):
                self.setto("e")
        del b[self.k + 1 :]

    def step2(self) -> None:
        if self.ends("y") and self.vowelinstem():
            self.b[self.k] = "i"

    _STEP3 = {
        "a": (("ational", "ate"), ("tional", "tion")),
        "c": (("enci", "ence"), ("anci", "ance")),
        "e": (("izer", "ize"),),
        "l": (("bli", "ble"), ("alli", "al"), ("entli", "ent"), ("eli", "e"), ("ousli", "ous")),
        "o": (("ization", "ize"), ("ation", "ate"), ("ator", "ate")),
        "s": (("alism", "al"), ("iveness", "ive"), ("fulness", "ful"), ("ousness", "ous")),
        "t": (("aliti", "al"), ("iviti", "ive"), ("biliti", "ble")),
        "g": (("logi", "log"),),
    }
    _STEP4 = {
        "e": (("icate", "ic"), ("ative", ""), ("alize", "al")),
        "i": (("iciti", "ic"),),
        "l": (("ical", "ic"), ("ful", "")),
        "s": (("ness", ""),),
    }
    _STEP5 = {
        "a": ("al",),
        "c": ("ance", "ence"),
        "e": ("er",),
        "i": ("ic",),
        "l": ("able", "ible"),
        "n": ("ant", "ement", "ment", "ent"),
        "s": ("ism",),
        "t": ("ate", "iti"),
        "u": ("ous",),
        "v": ("ive",),
        "z": ("ize",),
    }

    def _replace_first(self, table: dict[str, tuple[tuple[str, str], ...]], key: str) -> None:
        for suffix, repl in table.get(key, ()):
            if self.ends(suffix):
                self.r(repl)
                del self.b[self.k + 1 :]
                return

    def step3(self) -> None:
        if self.k == 0:
            return
        self._replace_first(self._STEP3, self.b[self.k - 1])

    def step4(self) -> None:
        self._replace_first(self._STEP4, self.b[self.k])

    def step5(self) -> None:
        if self.k == 0:
            return
        key = self.b[self.k - 1]
        if key == "o":
            matched = (
                self.ends("ion") and self.j >= 0 and self.b[self.j] in "st"
            ) or self.ends("ou")
        else:
            matched = any(self.ends(s) for s in self._STEP5.get(key, ()))
        if matched and self.m() > 1:
            self.k = self.j
            del self.b[self.k + 1 :]

    def step6(self) -> None:
        self.j = self.k
        if self.b[self.k] == "e":
            a = self.m()
            if a > 1 or (a == 1 and not self.cvc(self.k - 1)):
                self.k -= 1
        if self.b[self.k] == "l" and self.doublec(self.k) and self.m() > 1:
            self.k -= 1
        del self.b[self.k + 1 :]

    def stem(self) -> str:
        if self.k > 1:
            self.step1()
            self.step2()
            self.step3()
            self.step4()
            self.step5()
            self.step6()
        return "".join(self.b[: self.k + 1])


# Words where Snowball's "porter" and Lucene's PorterStemmer can disagree (see the module doc):
# "-bli"/"-logi" forms reach step 2 only through a "bl" or "log" in the word, and the undoubling
# difference needs a double consonant other than bdfgmnprt + l s z right before -ed/-ing(s).
_SNOWBALL_DIFFERS = re.compile(r"bl|log|([^aeioulszbdfgmnprt])\1(?:ed|ing)s?$")


# --- analyzer ----------------------------------------------------------------------------------


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
            from tqdm.auto import tqdm

            texts = tqdm(texts, desc="BM25 analyze", unit="doc", leave=False)
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
