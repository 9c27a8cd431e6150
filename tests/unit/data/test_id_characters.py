"""Ids with invisible or direction-changing characters, or equal to another after Unicode
normalisation, are refused where they are read, with file and line (issue 39 item 9).

trec_eval and pytrec_eval read an id up to its first NUL: with ``zz<NUL>rel`` relevant and
``zz<NUL>junk`` ranked first, pytrec_eval scores nDCG@1 1.0 (checked below), so such an id would
give silently wrong scores. The other characters show nothing, or turn the text around them, so
two ids that read the same are two ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from r2med_agent.data import load_task_dir, read_qrels_file
from r2med_agent.errors import DataError
from r2med_agent.evaluation import read_trec_run
from r2med_agent.retrieval.run_files import read_ranked_run
from tests.unit.data.test_own_data import _copy_sample, _main, set_id

HIDDEN = {
    "\u0000": "NUL", "\u200e": "LEFT-TO-RIGHT MARK", "\u200f": "RIGHT-TO-LEFT MARK",
    "\u202e": "RIGHT-TO-LEFT OVERRIDE", "\u2066": "LEFT-TO-RIGHT ISOLATE", "\u00ad": "SOFT HYPHEN",
    "\u034f": "COMBINING GRAPHEME JOINER", "\u061c": "ARABIC LETTER MARK", "\u2062": "INVISIBLE TIMES",
    "\u3164": "HANGUL FILLER", "\u2800": "BRAILLE PATTERN BLANK", "\ufe0f": "VARIATION SELECTOR-16",
    "\U000e0041": "TAG LATIN CAPITAL LETTER A", "\u0007": "CONTROL CHARACTER",
}


def _load(data: Path):
    return load_task_dir(data, name="mine", family="qa", domain="medical", use_task_cache=False)


def test_pytrec_eval_takes_ids_equal_up_to_a_nul():
    """Why a NUL must be refused: pytrec_eval scores the junk document as the relevant one."""
    import pytrec_eval

    evaluator = pytrec_eval.RelevanceEvaluator({"q": {"zz\0rel": 1}}, {"ndcg_cut_1"})
    assert evaluator.evaluate({"q": {"zz\0junk": 2.0, "other": 1.0}})["q"]["ndcg_cut_1"] == 1.0


@pytest.mark.parametrize("ch", list(HIDDEN))
@pytest.mark.parametrize("which", ["query", "document"])
def test_an_id_with_an_invisible_character_is_refused_with_file_and_line(tmp_path, which, ch):
    data = _copy_sample(tmp_path / "mine")
    bad = f"zz{ch}rel"
    path = set_id(data, which, bad)
    with pytest.raises(DataError) as err:
        _load(data)
    assert str(err.value).startswith(f"{path}:3: {which} id {bad!r} holds an invisible character "
                                     f"(U+{ord(ch):04X} {HIDDEN[ch]})"), err.value


def test_the_cli_says_it_in_one_line_and_writes_nothing(tmp_path, capsys):
    data = _copy_sample(tmp_path / "mine")
    set_id(data, "document", "zz\0rel")
    out = tmp_path / "results"
    assert _main("run", "--data-dir", str(data), "-o", str(out), "--no-progress") == 2
    err = capsys.readouterr().err
    assert "corpus.jsonl:3: document id 'zz\\x00rel' holds an invisible character (U+0000 NUL)" in err
    assert "pytrec_eval read as the end of the id" in err and "Traceback" not in err
    assert not list(out.rglob("*.run"))


@pytest.mark.parametrize(("first", "second"), [("d\ufb01", "dfi"), ("dfi", "d\ufb01"), ("\u00c5x", "A\u030ax"),
                                               ("A\u030ax", "\u212bx"), ("d\uff11", "d1")])
@pytest.mark.parametrize("which", ["query", "document"])
def test_two_ids_equal_after_nfkc_are_refused(tmp_path, which, first, second):
    data = _copy_sample(tmp_path / "mine")
    set_id(data, which, first, line=2)
    path = set_id(data, which, second, line=4)
    with pytest.raises(DataError) as err:
        _load(data)
    assert str(err.value) == (
        f"{path}:4: {which} id {second!r} is the same as {first!r} after Unicode normalisation (NFKC); two ids "
        f"that read the same would be confused: give them distinct ids (line 2)")


def test_ids_that_are_not_ascii_but_distinct_load(tmp_path):
    data = _copy_sample(tmp_path / "mine")
    set_id(data, "document", "Ärztin_0", line=2)
    set_id(data, "document", "Arztin_0", line=4)
    set_id(data, "query", "\u00c5", line=2)
    task = _load(data)
    assert "Ärztin_0" in task.doc_ids and "Arztin_0" in task.doc_ids


def test_qrels_text_refuses_them_too(tmp_path):
    trec = tmp_path / "qrels.txt"
    trec.write_text("q1 0 d1 1\nq2 0 zz\0rel 1\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"qrels\.txt:2: qrels document id 'zz\\x00rel' holds an invisible "
                                        r"character \(U\+0000 NUL\)"):
        read_qrels_file(trec)


@pytest.mark.parametrize("reader", [read_trec_run, read_ranked_run])
def test_run_files_read_back_refuse_them(tmp_path, reader):
    run = tmp_path / "mine.run"
    run.write_text("q Q0 zz\0junk 1 2.0 t\nq Q0 other 2 1.0 t\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"mine\.run:1: document id 'zz\\x00junk' holds an invisible character "
                                        r"\(U\+0000 NUL\)"):
        reader(run)
    run.write_text("q\u202e Q0 d 1 2.0 t\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"mine\.run:1: query id 'q\\u202e' holds an invisible character"):
        reader(run)
    run.write_text("q Q0 d\ufb01 1 2.0 t\nq Q0 dfi 2 1.0 t\nr Q0 dfi 1 1.0 t\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"mine\.run:2: document id 'dfi' is the same as 'd\ufb01' after Unicode "
                                        r"normalisation \(NFKC\).*\(query 'q'\)"):
        reader(run)
    run.write_text("q Q0 d\u00fc 1 2.0 t\nq Q0 du 2 1.0 t\n", encoding="utf-8")
    assert list(reader(run)["q"]) == ["d\u00fc", "du"]
