"""Real English text that every Python install has, for benchmarks: sentences from the
docstrings of the standard library and then the installed packages, cut into passages of a chosen
length with a fixed seed (deterministic for a given Python environment)."""

from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path

import numpy as np

_DOCSTRING = re.compile(r'"""(.*?)"""|\'\'\'(.*?)\'\'\'', re.S)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def sentence_pool(min_words: int) -> tuple[list[str], np.ndarray, int]:
    """Sentences of docstrings from the standard library, then installed packages (sorted paths).

    Reading stops once the pool holds ``min_words`` words. Returns the sentences, their word
    counts, and the number of files read.
    """
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    sentences: list[str] = []
    total = 0
    files = 0
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            try:
                source = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            files += 1
            for m in _DOCSTRING.finditer(source):
                text = " ".join((m.group(1) or m.group(2) or "").split())
                for s in _SENTENCE_END.split(text):
                    n = s.count(" ") + 1
                    if n >= 4:
                        sentences.append(s)
                        total += n
            if total >= min_words:
                return sentences, np.array([s.count(" ") + 1 for s in sentences]), files
    return sentences, np.array([s.count(" ") + 1 for s in sentences]), files


def passages(sentences: list[str], n: int, lo: int, hi: int, seed: int) -> list[str]:
    """``n`` passages of ``lo``-``hi`` words, each consecutive sentences from a random start."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, size=n)
    starts = rng.integers(0, len(sentences), size=n)
    out = []
    for start, length in zip(starts.tolist(), lengths.tolist()):
        words: list[str] = []
        i = start
        while len(words) < length:
            words.extend(sentences[i % len(sentences)].split())
            i += 1
        out.append(" ".join(words[:length]))
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """``rows`` as JSON lines (UTF-8, not ASCII-escaped), as R2MED's files are written."""
    with path.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
