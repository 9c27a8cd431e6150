"""Lucene's ``StandardTokenizer`` and ``LowerCaseFilter``, exactly, in Python: the first two steps
of the analyzer (:mod:`~r2med_agent.retrieval.bm25.analysis`).

* **Tokenisation** is ``StandardTokenizer``'s grammar (UAX#29 word rules, plus Lucene's rules for
  emoji sequences, Southeast Asian scripts, Han and Hiragana) written as one regular expression.
  Lucene's scanner was generated for Unicode 9 (emoji: Unicode 11) and sees each code point only
  through its character class; those classes are read from the real scanner by
  ``tools/lucene_uax29_tables.py`` into ``resources/lucene_uax29.json``. A text is translated to
  one representative character per class, position for position, and the expression runs on that
  (it stays small and compiles at once). Lucene's scanner buffer holds 255 UTF-16 units: a longer
  token yields the longest match that fits, and scanning resumes after it; the cutting is linear
  in the token's length (a 50 MB word takes seconds), and so is the search over long runs of
  ``_`` or ZWJ that no letter or emoji follows. One known difference: when no match fits in 255
  units (more than 255 ``_`` before a letter), Lucene moves on one character at a time and emits
  the last 254 ``_`` with the letter; here the run is cut into pieces of 255 (no tokens: they
  hold only ``_``) and the last piece keeps the letter. ASCII texts take an equivalent
  ASCII-only pattern, twice as fast; the analyzer first lowercases a corpus's ASCII texts and cuts them into candidates by
  ``bytes.translate`` and ``bytes.split`` (:data:`_ASCII_CANDIDATES`, four times faster than the
  pattern), and tokenizes each distinct candidate once (``tests/unit/retrieval/test_bm25.py`` checks both against
  the full grammar, text by text). One-character tokens are kept, as Lucene keeps them (bm25s's
  default pattern ``\\w\\w+`` drops them).
* **Lowercasing** is Java's, code point by code point (:func:`java_lower`): ``İ`` becomes ``i`` and
  ``Σ`` is always ``σ``, where Python's ``str.lower`` gives ``i̇`` and a word-final ``ς``.
"""

from __future__ import annotations

import bisect
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
def _scanner() -> tuple[np.ndarray, dict[str, str], dict[str, str]]:
    """(translation table, regex class per macro, twins) of Lucene's tokenizer character classes.

    The classes (``resources/lucene_uax29.json``) were read from Lucene 9.9.1's scanner by
    ``tools/lucene_uax29_tables.py``. Every code point is translated (a numpy lookup) to one
    ASCII representative per distinct set of classes it belongs to (a few dozen), so the grammar
    is a small regular expression over representatives (compiled in milliseconds) and matches map
    back to the original text position for position (code points in no class have their own).

    Each representative of an ExtendNumLet class (``_`` and other connector punctuation) has a
    *twin*, a spare representative in the same classes that no token may start with; the
    ExtendNumLet characters inside a run take it (:func:`_enl_runs`).
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
    spare = iter(_REPS[len(keys):])
    twins = {r: next(spare, "") for k, r in reps.items() if "ExtendNumLet" in k}
    if "" in twins.values():
        raise RuntimeError("no spare representative for an ExtendNumLet class")
    cls = {m: body + "".join(t for r, t in twins.items() if r in body) for m, body in cls.items()}
    return table, cls, twins


@functools.cache
def _enl_runs() -> tuple[str, re.Pattern[str], dict[int, int]]:
    """(ExtendNumLet representatives, a run of two or more of them with only Extend, Format or
    ZWJ characters between, their twins as a ``str.translate`` table).

    A match starting inside such a run reaches the run's end as one starting at its first
    character does, so it cannot succeed where that one failed; tried from each of its characters
    instead, a long run of ``_`` that no letter follows was a quadratic search (hours for a
    megabyte). So the characters of a run after its first take their twins, which no token starts
    with (in :func:`_token_re`) and which match everywhere else as the characters they stand for.
    """
    _, cls, twins = _scanner()
    enl, efz = "".join(twins), cls["ExtFmtZwj"]
    efz = "".join(ch for ch in efz if ch not in twins.values())
    run = re.compile(rf"[{enl}](?:[{efz}]*+[{enl}])++" if efz else rf"[{enl}]{{2,}}")
    return enl, run, str.maketrans(twins)


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
    zwj = c["ZWJ"]
    word = rf"(?:{enl})*{unit}(?:(?:{enl})+{unit})*(?:{enl})*"
    # ExtFmtZwjSansPresSel*; a run of ZWJ before another emoji is left to join the two (the
    # longest match the scanner finds). (A run is taken whole and then looked past once: a
    # lookahead from each of its ZWJ made a long run a quadratic search.)
    starts = f"(?:{c['EmojiChar']}|{c['Emoji_Modifier']})"
    sans = rf"(?:{c['ExtFmtSansPresSel']}|(?>{zwj}+)(?!{starts}))*"
    emoji_char = f"{c['EmojiChar']}{sans}"
    modifier = f"{c['Emoji_Modifier']}{sans}"
    pres = c["EmojiPres"]

    def e1(zwjs: str) -> str:
        return rf"(?:{zwjs}{emoji_char}{pres}?|(?:{zwjs}{emoji_char})?{modifier})"

    # A match starts at a run of ZWJ only at its first character: one starting inside the run
    # would reach the run's end as one starting at its first character does, so it fails where
    # that one failed; tried from each character instead, a long run was a quadratic search.
    # (Runs of ExtendNumLet are kept from starting matches by their representatives: _enl_runs.)
    lead = rf"(?:(?<!{zwj})(?>{zwj}+))?" if zwj.startswith("[") else ""
    emoji = (
        rf"{e1(lead)}(?:{c['TagSpec']}+{c['TagTerm']}|(?:{zwj}{e1(f'{zwj}*')})*)"
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
    first = "".join(ch for ch in first if ch not in _scanner()[2].values())  # not the twins
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
    tokens = [text[m.start() : m.end()] for m in _token_re().finditer(_mark_runs(mapped)[0])]
    if tokens and max(map(len, tokens)) > _MAX_TOKEN_UNITS // 2:  # astral characters count twice
        return _split_long(text, _token_re(), mapped)
    return tokens


def _mark_runs(mapped: str) -> tuple[str, list[tuple[int, int]]]:
    """``mapped`` with the ExtendNumLet characters inside runs replaced by their twins
    (:func:`_enl_runs`), and the runs' spans."""
    enl, runs, twin = _enl_runs()
    if not any(r in mapped for r in enl):
        return mapped, []
    spans: list[tuple[int, int]] = []

    def mark(m: re.Match[str]) -> str:
        spans.append(m.span())
        return m[0][0] + m[0][1:].translate(twin)

    return runs.sub(mark, mapped), spans


def _split_long(text: str, pattern: re.Pattern[str], mapped: str | None = None) -> list[str]:
    """Tokens of ``text`` with StandardTokenizer's length limit: a match longer than 255 UTF-16
    units yields the longest match within its first 255 units, and scanning resumes after it.
    ``mapped`` is the text the pattern runs on (position for position), when not ``text``.

    Linear in the text: a long match is found once, then cut piece by piece, each piece looked
    for and matched within a window of 255 units from where scanning resumes (a match that fits
    its window is the one the pattern finds in the whole text), never by matching the rest of
    the long run again (that made one long word quadratic). The runs of ``_`` in a window are
    marked (:func:`_mark_runs`) from where scanning resumes, which may be inside a run.
    """
    out: list[str] = []
    pos = 0
    scanned, runs = (text, []) if mapped is None else _mark_runs(mapped)
    run_starts = [a for a, _ in runs]
    while (m := pattern.search(scanned, pos)) is not None:
        start, end = m.span()
        if _fit(text, start, end) == end:
            token = text[start:end]
            if not _only_underscores(token):
                out.append(token)
            pos = end
            continue
        while start < end or _inside(runs, run_starts, start):  # within reach of the long match
            limit = min(len(text), _fit(text, start, len(text)) + _MAX_TOKEN_UNITS)
            window = text[start:limit] if mapped is None else _mark_runs(mapped[start:limit])[0]
            found = pattern.search(window)
            if found is None:  # (a token may start near the end and not end in the window)
                start = max(start + 1, limit - _MAX_TOKEN_UNITS)
                continue
            # the scanner's buffer is full at ``reach``: it returns the longest match that fits
            reach = _fit(text, start + found.start(), len(text))
            piece = pattern.match(window, found.start(), reach - start)
            if piece is None:  # no match fits: these units are skipped (the module doc)
                start = reach
                continue
            token = text[start + piece.start() : start + piece.end()]
            if not _only_underscores(token):
                out.append(token)
            start += piece.end()
        pos = start  # past the long match: scanning goes on as anywhere else
    return out


def _inside(runs: list[tuple[int, int]], starts: list[int], i: int) -> bool:
    """Whether position ``i`` is inside (not at the start of) one of ``runs``."""
    k = bisect.bisect_right(starts, i) - 1
    return k >= 0 and runs[k][0] < i < runs[k][1]


def _fit(text: str, start: int, end: int) -> int:
    """The largest ``e <= end`` with ``text[start:e]`` at most 255 UTF-16 units long."""
    e = min(end, start + _MAX_TOKEN_UNITS)
    piece = text[start:e]
    if piece.isascii():
        return e
    units = len(piece.encode("utf-16-le", "surrogatepass")) // 2  # astral characters count twice
    while units > _MAX_TOKEN_UNITS:
        e -= 1
        units -= 2 if ord(text[e]) > 0xFFFF else 1
    return e


def tokenize(text: str) -> list[str]:
    """Split ``text`` into StandardTokenizer's tokens, lowercased (no stopwords, no stemming)."""
    return [t for t in _findall(java_lower(text)) if not _only_underscores(t)]


def _only_underscores(token: str) -> bool:
    # the ASCII pattern matches runs of connector punctuation ("___"), which are no token
    return token[0] == "_" and not token.strip("_")
