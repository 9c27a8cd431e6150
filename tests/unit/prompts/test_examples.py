"""``prompts import-examples``: a file in the layout of R2MED's src/example.py (written here, with
this test's own sentences) becomes per-task Query2Doc examples, read without running its code."""

from __future__ import annotations

from pathlib import Path

import pytest

from r2med_agent.cli.app import main
from r2med_agent.errors import DataError
from r2med_agent.prompts.examples import read_reference_examples, split_pairs
from r2med_agent.prompts.templates import load_examples

SOURCE = '''
import os
os.makedirs("EXECUTED")  # must never run
raise SystemExit(3)

Example = {
    "Stack-Biology": \'\'\'Post: Why do leaves change colour in autumn?
Trees in my street turn red and yellow every October.
Passage:
Chlorophyll breaks down as days shorten, revealing carotenoids already in the leaf.

Post: How do bees find their way home?
Passage:
Honeybees use the sun's position and landmarks learned on orientation flights.
\'\'\',
    "PMC-Treat": \'\'\'Case: Summary:\\n- **Age:** 60\\n- **Problem:** knee pain
What treatment would you suggest?
Passage:
Weight loss and physiotherapy come first for knee osteoarthritis.
\'\'\',
    "IIYiPatients-EN": \'\'\'Case: A man of 40 with a cough for three weeks.
Similar Case:
A man of 45 had a cough for a month.
Case: this line belongs to the similar case, not a new example.
\'\'\',
}
'''


def _write(tmp_path: Path, text: str = SOURCE) -> Path:
    path = tmp_path / "example.py"
    path.write_text(text, encoding="utf-8")
    return path


def test_reads_the_examples_without_running_the_file(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    imported = read_reference_examples(_write(tmp_path))
    assert not (tmp_path / "EXECUTED").exists()
    assert list(imported.examples) == ["Biology", "PMC-Treatment", "IIYi-Clinical"]
    assert imported.examples["Biology"] == [
        {"query": "Why do leaves change colour in autumn?\nTrees in my street turn red and yellow every October.",
         "passage": "Chlorophyll breaks down as days shorten, revealing carotenoids already in the leaf."},
        {"query": "How do bees find their way home?",
         "passage": "Honeybees use the sun's position and landmarks learned on orientation flights."},
    ]
    assert imported.examples["PMC-Treatment"][0]["query"].startswith("Summary:\n- **Age:** 60\n- **Problem:**")
    assert imported.examples["IIYi-Clinical"] == [{
        "query": "A man of 40 with a cough for three weeks.",
        "passage": "A man of 45 had a cough for a month.\nCase: this line belongs to the similar case, not a new example.",
    }]
    assert imported.lines["Biology"] == 7


def test_cli_writes_a_prompts_folder_that_fresh_query2doc_runs_use(tmp_path, capsys) -> None:
    from r2med_agent.data import load_task
    from r2med_agent.methods.expansion import Query2Doc

    out = tmp_path / "my-prompts"
    assert main(["prompts", "import-examples", str(_write(tmp_path)), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Biology: 2 example(s) from line 7" in printed and f"R2MED_PROMPTS_DIR={out}" in printed
    assert sorted(p.name for p in (out / "query2doc" / "examples").iterdir()) == ["case.yaml", "qa.yaml", "treatment.yaml"]
    imported = read_reference_examples(tmp_path / "example.py").examples
    assert load_examples("query2doc", "qa", "biology", prompts_dir=out, task="Biology") == imported["Biology"]
    assert load_examples("query2doc", "treatment", "medicine", prompts_dir=out, task="PMC-Treatment") == imported["PMC-Treatment"]
    # r2med-demo is drawn from Biology: its prompts show the imported Biology examples.
    prompt = Query2Doc(prompts_dir=out).build_prompts(load_task("r2med-demo"))[0][0]["content"]
    assert "Post: Why do leaves change colour in autumn?" in prompt
    assert "Passage: Honeybees use the sun's position" in prompt
    # the package's own examples otherwise
    default = Query2Doc().build_prompts(load_task("r2med-demo"))[0][0]["content"]
    assert "leaves change colour" not in default
    # existing files are kept unless --force
    assert main(["prompts", "import-examples", str(tmp_path / "example.py"), "--out", str(out)]) == 2
    assert "already exist; pass --force" in capsys.readouterr().err
    assert main(["prompts", "import-examples", str(tmp_path / "example.py"), "--out", str(out), "--force"]) == 0


@pytest.mark.parametrize("text, message", [
    ("Example = {\n  'Stack-Biology': 'Post: x\n", r"example\.py:2: not valid Python"),
    ("Example = {'Stack-Cooking': 'Post: a\\nPassage:\\nb'}\n", r"example\.py:1: 'Stack-Cooking' names no task"),
    ("Example = {'Stack-Biology': 'Post: a question with no passage'}\n",
     r"example\.py:1: the examples of 'Stack-Biology': example 1 has no passage"),
    ("Example = {'Stack-Biology': 'Intro\\nPost: a\\nPassage:\\nb'}\n", "text before the first query label"),
    ("Example = {'Stack-Biology': open('x').read()}\n", "are not literal text"),
    ("Names = ['a']\n", "no module-level dict"),
])
def test_malformed_files_name_file_and_line(tmp_path, text, message) -> None:
    with pytest.raises(DataError, match=message):
        read_reference_examples(_write(tmp_path, text))


def test_cli_error_exits_2_without_traceback(tmp_path, capsys) -> None:
    code = main(["prompts", "import-examples", str(tmp_path / "missing.py"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "missing.py: cannot read the examples file" in err and "Traceback" not in err


def test_split_pairs_needs_a_label() -> None:
    with pytest.raises(ValueError, match="no labelled example"):
        split_pairs("\n\n")
