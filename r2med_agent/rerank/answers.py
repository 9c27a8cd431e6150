"""Reading an LLM reranker's answers: a listwise window's order (repaired into a permutation),
a pointwise yes/no judgment and its probability, and the windows a listwise reranker reads.
Pure functions of text; the rerankers that use them are in
:mod:`~r2med_agent.rerank.llm`."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from r2med_agent.rerank import formats
from r2med_agent.types import Generation

JUDGMENT_MARKER = "Relevant:"
"""What the pointwise prompt asks the answer to end with, before ``yes`` or ``no``."""

_MARKER_RE = re.compile(r"relevan(?:t|ce)\s*[:\-]", re.IGNORECASE)
_JUDGMENT_RE = re.compile(r"relevan(?:t|ce)\W{0,6}(yes|no)\b", re.IGNORECASE)
_YES_NO_RE = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_BRACKETED_RE = re.compile(r"\[\s*(\d+)\s*\]")
_NUMBER_RE = re.compile(r"\d+")


def window_positions(n: int, window: int, step: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` slices the listwise reranker reads, in order, for a list of ``n``.

    From the bottom up: ``(n - window, n)``, then each ``step`` higher, the last one starting at
    0. ``window_positions(100, 20, 10)`` is ``(80, 100), (70, 90), ..., (0, 20)``.
    """
    if window < 1 or step < 1:
        raise ValueError("window and step must be at least 1")
    out: list[tuple[int, int]] = []
    end = n
    while n > 0:
        start = max(end - window, 0)
        out.append((start, end))
        if start == 0:
            break
        end -= step
    return out


@dataclass(frozen=True)
class Repair:
    """What :func:`parse_permutation` had to fix in one answer."""

    missing: int = 0
    """Candidates the answer did not name (appended in their window order)."""
    repeated: int = 0
    """Numbers named again after their first mention (ignored)."""
    out_of_range: int = 0
    """Numbers that are not a position of the window (ignored)."""

    @property
    def any(self) -> bool:
        return bool(self.missing or self.repeated or self.out_of_range)

    def to_dict(self) -> dict[str, int]:
        return {"missing": self.missing, "repeated": self.repeated, "out_of_range": self.out_of_range}


def parse_permutation(text: str, size: int) -> tuple[list[int], Repair]:
    """The order an answer gives to a window of ``size`` candidates, as 0-based positions.

    The bracketed numbers of the answer (``[3] > [1]``) are read, or its bare numbers when it
    has none. A number outside 1..``size`` or named a second time is dropped; candidates never
    named follow in their window order. The result is always a permutation of ``range(size)``.
    """
    return permutation_of([int(t) for t in _BRACKETED_RE.findall(text) or _NUMBER_RE.findall(text)], size)


def permutation_of(numbers: Sequence[int], size: int) -> tuple[list[int], Repair]:
    """The permutation of ``range(size)`` that 1-based ``numbers`` name, repaired as
    :func:`parse_permutation` says (the first mention counts; candidates never named follow in
    their window order)."""
    order: list[int] = []
    seen: set[int] = set()
    repeated = out_of_range = 0
    for number in numbers:
        i = number - 1
        if not 0 <= i < size:
            out_of_range += 1
        elif i in seen:
            repeated += 1
        else:
            seen.add(i)
            order.append(i)
    missing = [i for i in range(size) if i not in seen]
    return order + missing, Repair(len(missing), repeated, out_of_range)


def parse_judgment(text: str) -> bool | None:
    """The yes/no relevance judgment at the end of an answer (None when there is none).

    ``Relevant: yes`` (any case, with markup such as ``**Relevant:** no``) counts first, the last
    one when several; otherwise the last stand-alone ``yes`` or ``no`` of the answer.
    """
    matches = _JUDGMENT_RE.findall(text) or _YES_NO_RE.findall(text)
    if not matches:
        return None
    return matches[-1].lower() == "yes"


def yes_probability(top: Sequence[tuple[str, float]] | None) -> float | None:
    """P(yes) / (P(yes) + P(no)) from one position's top tokens and their log-probabilities.

    Every spelling of each word counts (``yes``, `` Yes``, ``YES``: the token stripped and
    lower-cased); None when neither word is among the tokens.
    """
    if not top:
        return None
    yes = sum(math.exp(lp) for tok, lp in top if tok.strip().lower() == "yes")
    no = sum(math.exp(lp) for tok, lp in top if tok.strip().lower() == "no")
    if yes + no <= 0.0:
        return None
    return yes / (yes + no)


def judgment_prefix(text: str) -> str:
    """The answer up to and including its last ``Relevant:``, to be continued by one token; an
    answer without one gets the marker appended on a line of its own."""
    last = None
    for m in _MARKER_RE.finditer(text):
        last = m
    if last is not None:
        return text[: last.end()]
    return text.rstrip() + "\n\n" + JUDGMENT_MARKER


def cut_words(text: str, max_words: int) -> str:
    """The first ``max_words`` whitespace-separated words of ``text`` on one line."""
    return " ".join(text.split()[:max_words])


def reasonrank_permutation(answer: str, size: int) -> tuple[list[int], Repair, bool]:
    """The order ReasonRank reads from an answer block (``receive_permutation``): every run of
    digits in it is a number, whatever surrounds it; then as :func:`permutation_of`. When a run of
    digits is no number (``int`` refuses it, e.g. superscript digits) ReasonRank leaves the window
    as it was: the third value is then False."""
    numbers = formats.reasonrank_numbers(answer)
    if numbers is None:
        return list(range(size)), Repair(), False
    order, repair = permutation_of(numbers, size)
    return order, repair, True



def read_window(gen: Generation, size: int, fmt: str = "default", strict: bool = False,
                ) -> tuple[list[int], Repair, dict[str, Any]]:
    """A listwise window's order from its answer, and what the window's record adds. The default
    and InsertRank formats read the final response (:func:`parse_permutation`); ReasonRank reads
    its answer block (recorded), leniently as the others or, ``strict``, as ReasonRank does
    (:func:`reasonrank_permutation`, recording whether its numbers could be read at all)."""
    if fmt != "reasonrank":
        order, repair = parse_permutation(gen.final, size)
        return order, repair, {}
    answer, block = formats.answer_block(gen.text)
    if not strict:
        order, repair = parse_permutation(answer, size)
        return order, repair, {"answer_block": block}
    order, repair, readable = reasonrank_permutation(answer, size)
    return order, repair, {"answer_block": block, "readable": readable}
