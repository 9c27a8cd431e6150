"""GroupRank's answer readers in linear time, with the results they had (issue 39 item 12).

The lenient parse took 4.6 s on an answer ending in 1,000 spaces and 45 s on 2,000 (its patterns
backtracked over every split of a whitespace run); an unclosed ``<answer>`` or a run of ``{`` was
quadratic. ``REFERENCE`` below is the readers as they were, regular expressions and all: on a
corpus of generated answers (every existing parse test's answer among them) the new readers give
exactly what they gave; and answers of 100,000 spaces or braces are read at all (a child process
with a generous bound: before, the first would have run for days). Timings: benchmarks/hostile.py."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from r2med_agent.rerank import groupwise as gw

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FENCED_RE = re.compile(r"```json\s*([\s\S]+?)\s*```")
_BRACES_RE = re.compile(r"\{[\s\S]*?\}")


def reference_block(text: str) -> str:
    m = _ANSWER_RE.search(text)
    if m:
        text = m.group(1).strip()
    fenced = _FENCED_RE.findall(text)
    if fenced:
        return fenced[-1].strip()
    braces = _BRACES_RE.findall(text)
    if braces:
        return braces[-1]
    start = text.rfind("{")
    return text[start:] if start >= 0 else ""


def reference_pairs(text: str) -> list[tuple[str, str]]:
    return gw._PAIR_RE.findall(reference_block(text))


def reference_answer(text: str):
    m = _ANSWER_RE.search(text)
    if m:
        text = m.group(1).strip()
    fenced = _FENCED_RE.findall(text)
    if fenced:
        block = fenced[-1].strip()
    else:
        braces = _BRACES_RE.findall(text)
        if not braces:
            return None
        block = braces[-1]
    block = gw._DOUBLED_BRACKET_RE.sub(r"\1", block.strip())
    if block.count("{") > block.count("}"):
        block += "}"
    block = gw._SPACES_RE.sub(" ", block).strip()
    try:
        return dict(json.loads(block, parse_constant=gw._no_constant))
    except Exception:  # noqa: BLE001
        return None


EXISTING = [
    '<answer>{"[1]]": 4, "[2]": 6}</answer>', '<reason>ok</reason><answer>```json\n{"[2]": 3, "[1]": 9',
    '```json\n{"[1]": 12, "[2]": -1, "[2]": 5, "[9]": 3}\n```', "I think document two is best.",
    '<answer>```json\n{"[2]": 7, "[1]": 3}\n```</answer>', '<answer>```json\n{"[1]]": 4, "[3]": 9\n```',
    '<answer>```json\n{"[1]": 4, "[3]": 9', '{"[0]": 5}', '{"[1]": 12, "1": -2}',
]
_PIECES = ["{", "}", '"[1]"', '"[2]"', "[3]", "3", ": 7", ":", "8.5", "-2", ", ", " ", "  ", "\n", "\t \n",
           "```json", "```", "<answer>", "</answer>", "]]", '"', "x", "NaN", "\u3000", "\r\n"]


def corpus() -> list[str]:
    rng = random.Random(39)
    out = list(EXISTING)
    for _ in range(4000):
        out.append("".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 30))))
    return out


def test_the_readers_give_what_they_gave():
    for text in corpus():
        assert gw._PAIR_RE.findall(gw.answer_block(text)) == reference_pairs(text), repr(text)
        assert gw.grouprank_answer(text) == reference_answer(text), repr(text)


_CHILD = """
from r2med_agent.rerank.groupwise import grouprank_answer, parse_group_scores
for text in ('{"[1]"' + ' ' * 100_000, '[1]' + ' ' * 100_000, '```json' + ' ' * 100_000 + 'x',
             '{' * 100_000, '<answer>' * 20_000, '<answer>{1' + ' ' * 100_000):
    parse_group_scores(text, 10)
    grouprank_answer(text)
print("read")
"""


def test_degenerate_answers_are_read():
    root = Path(__file__).resolve().parents[3]
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD], cwd=root, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("six degenerate answers of 100,000 characters were not read in 120 s")
    assert done.stdout.strip() == "read", done.stderr
