"""Lucene's ``PorterStemmer`` (``PorterStemFilter``), ported line by line.

Lucene's class is Martin Porter's reference implementation, which departs from the published
algorithm that PyStemmer's ``porter`` (Snowball) follows: it maps ``-bli`` to ``-ble`` (Snowball:
only ``-abli``) and ``-logi`` to ``-log`` (``possibly``, ``cardiology``), undoubles any double
consonant but ``l s z`` after removing ``-ed``/``-ing`` (Snowball: only ``bb dd ff gg mm nn pp rr
tt``; ``trekking``), and leaves words of one or two letters alone (``us``). The analyzer
(:mod:`~r2med_agent.retrieval.bm25.analysis`) stems with PyStemmer and re-stems with
:func:`lucene_porter_stem` only the words those rules can reach.
"""

from __future__ import annotations

__all__ = ["lucene_porter_stem"]


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
