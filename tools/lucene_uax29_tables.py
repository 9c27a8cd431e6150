"""Write ``r2med_agent/resources/lucene_uax29.json``: the character classes of Lucene 9.9.1's
``StandardTokenizer``, for :mod:`r2med_agent.retrieval.bm25.tokenizer`.

Lucene's tokenizer is a JFlex scanner generated for Unicode 9 (and Unicode 11's emoji data); its
behaviour for a character depends only on the scanner's character class (``ZZ_CMAP``, a
partition of all code points into classes that the scanner cannot tell apart). This script reads
that partition from the real class (pyserini's Anserini jar, through pyjnius), then names each
class by the Unicode properties of its members (word-break classes, scripts, emoji properties,
taken from the ``regex`` package) by majority vote, property by property. The partition is
therefore Lucene's exactly; a class's name is what most of its members are. The analyzer builds its
regular expression from these ranges; ``tests/test_lucene_parity.py`` checks the result against
the real tokenizer, character by character.

Run: ``python tools/lucene_uax29_tables.py`` (needs pyserini, pyjnius, regex and Java 21+).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import regex

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import lucene_peer  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "r2med_agent" / "resources" / "lucene_uax29.json"

# the grammar's macros (StandardTokenizerImpl.jflex) as properties of single characters
PROPERTIES = {
    "AHLetter": r"[\p{WB=ALetter}\p{WB=Hebrew_Letter}]",
    "Hebrew_Letter": r"\p{WB=Hebrew_Letter}",
    "Numeric": r"[\p{WB=Numeric}]|[\uFF00-\uFFEF&&\p{Nd}]",
    "Katakana": r"\p{WB=Katakana}",
    "MidLetter": r"[\p{WB=MidLetter}\p{WB=MidNumLet}\p{WB=Single_Quote}]",
    "MidNum": r"[\p{WB=MidNum}\p{WB=MidNumLet}\p{WB=Single_Quote}]",
    "ExtendNumLet": r"\p{WB=ExtendNumLet}",
    "Single_Quote": r"\p{WB=Single_Quote}",
    "Double_Quote": r"\p{WB=Double_Quote}",
    "Regional_Indicator": r"\p{WB=Regional_Indicator}",
    "ExtFmtZwj": r"[\p{WB=Format}\p{WB=Extend}\p{WB=ZWJ}]",
    "ZWJ": r"\p{WB=ZWJ}",
    "Han": r"\p{Script=Han}",
    "Hiragana": r"\p{Script=Hiragana}",
    "Hangul": r"\p{Script=Hangul}",
    "Complex_Context": r"\p{Line_Break=Complex_Context}",
    "Extended_Pictographic": r"\p{Extended_Pictographic}",
    "Emoji": r"\p{Emoji}",
    "Emoji_Modifier": r"\p{Emoji_Modifier}",
    "Emoji_Modifier_Base": r"\p{Emoji_Modifier_Base}",
}


_DUMP = """
import java.lang.reflect.Method;
public class DumpCmap {
  public static void main(String[] args) throws Exception {
    Class<?> c = Class.forName("org.apache.lucene.analysis.standard.StandardTokenizerImpl");
    Method m = c.getDeclaredMethod("zzCMap", int.class);
    m.setAccessible(true);
    StringBuilder out = new StringBuilder();
    for (int cp = 0; cp < 0x110000; cp++) out.append((int) m.invoke(null, cp)).append('\\n');
    System.out.print(out);
  }
}
"""


def lucene_classes() -> np.ndarray:
    """The scanner's character class of every code point (``StandardTokenizerImpl.zzCMap``),
    printed by a small Java program run against pyserini's jar."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "DumpCmap.java"
        src.write_text(_DUMP, encoding="utf-8")
        java = Path(lucene_peer.java_home() or "") / "bin" / "java"
        out = subprocess.run([str(java), "-cp", str(lucene_peer._jar()), str(src)],
                             capture_output=True, text=True, check=True).stdout
    return np.array(out.split(), dtype=np.int64)


def main() -> int:
    classes = lucene_classes()
    n_classes = int(classes.max()) + 1
    chars = "".join(chr(c) if not 0xD800 <= c <= 0xDFFF else " " for c in range(0x110000))
    ranges: dict[str, list[list[int]]] = {}
    for name, pattern in PROPERTIES.items():
        has = np.zeros(0x110000, dtype=bool)
        for m in regex.finditer(pattern, chars, flags=regex.V1):
            has[m.start()] = True
        has[0xD800:0xE000] = False
        votes = np.bincount(classes, weights=has, minlength=n_classes)
        sizes = np.bincount(classes, minlength=n_classes)
        named = votes * 2 > sizes  # a class has the property if most of its members have it
        member = named[classes]
        edges = np.flatnonzero(np.diff(np.concatenate([[0], member.astype(np.int8), [0]])))
        ranges[name] = [[int(a), int(b) - 1] for a, b in zip(edges[::2], edges[1::2])]
    OUT.write_text(json.dumps({"source": "Lucene 9.9.1 StandardTokenizerImpl character classes",
                               "classes": ranges}, indent=0) + "\n", encoding="utf-8")
    print(f"{n_classes} scanner classes; wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
