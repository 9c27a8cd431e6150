"""Lucene's ``StandardTokenizer`` and ``LowerCaseFilter``, exactly, in Python: the first two steps
of the analyzer (:mod:`~r2med_agent.retrieval.bm25.analysis`).

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
  fast; the analyzer first lowercases a corpus's ASCII texts and cuts them into candidates by
  ``bytes.translate`` and ``bytes.split`` (:data:`_ASCII_CANDIDATES`, four times faster than the
  pattern), and tokenizes each distinct candidate once (``tests/unit/retrieval/test_bm25.py`` checks both against
  the full grammar, text by text). One-character tokens are kept, as Lucene keeps them (bm25s's
  default pattern ``\\w\\w+`` drops them).
* **Lowercasing** is Java's, code point by code point (:func:`java_lower`): ``İ`` becomes ``i`` and
  ``Σ`` is always ``σ``, where Python's ``str.lower`` gives ``i̇`` and a word-final ``ς``.
"""

from __future__ import annotations

import functools
import json
import re
import string

import numpy as np

__all__ = ["java_lower", "tokenize"]

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

    h = ex("Hebrew_Letter")
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
