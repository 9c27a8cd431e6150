"""The report's drill-down looks ids up in maps without a prototype (issue 39 item 12): documents
named ``constructor``, ``hasOwnProperty``, ``toString`` or ``__proto__`` were badged relevant
("5 of 3 relevant"), since every JavaScript object has such keys; checked in headless Chromium."""

from __future__ import annotations

import re
from pathlib import Path

from r2med_agent.analysis.report import write_report
from r2med_agent.api import build_table, load_results
from tests.result_trees import make_task, ranking, write_result
from tests.unit.analysis.test_report import clean_page, embedded_data

NAMES = ("constructor", "hasOwnProperty", "toString", "__proto__", "valueOf")


def test_documents_named_like_object_properties_are_not_relevant(tmp_path: Path):
    root = tmp_path / "results"
    run = {"q1": ranking(NAMES[0], NAMES[1], "d1", *NAMES[2:]), "q2": ranking("d2"), "q3": ranking("d3"),
           "q4": ranking("d4")}
    write_result(root, "none", "none", "bm25", "sample", run)
    page = write_report(build_table(load_results([root])), tmp_path / "report", tasks={"sample": make_task()})
    row = embedded_data(page.read_text())["rows"][0]["index"]
    dom = clean_page(page.as_uri() + f"#row={row}&task=sample&query=q1")
    # q1's relevant documents are d1 and d5 (tests/result_trees.QRELS): one of them in the top 6
    assert "Top 6 of 6 documents (1 of 2 relevant)" in dom
    ids = re.findall(r'<li class="doc( relevant)?" data-doc-id="([^"]+)"', dom)
    assert ids == [("", NAMES[0]), ("", NAMES[1]), (" relevant", "d1")] + [("", n) for n in NAMES[2:]]
    assert dom.count(">RELEVANT<") == 1
    assert "native code" not in dom  # no inherited function shown as a document's text
    assert "d5 (not retrieved)" in dom
