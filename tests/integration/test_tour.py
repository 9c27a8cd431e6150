"""A new researcher's tour with data of their own (issue 30): a BEIR-layout folder made here, every
method on the offline default model (SmolLM2 on llama.cpp), then ``compare``, ``report`` and
``trace show`` on the results, all through the command line as a user types it.

Kept cheap for a 2-core CI: one query of the test split over six short documents and 8 tokens a
generation; one process, so llama.cpp loads the model once.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

METHODS = ("none", "hyde", "query2doc", "lamer", "search-r1", "search-o1")

DOCS = {
    "d1": ("Insulin", "Insulin lowers blood glucose by moving sugar into cells."),
    "d2": ("Amylase", "Amylase in saliva digests starch into sugars."),
    "d3": ("Heart", "The heart pumps blood through the arteries."),
    "d4": ("Bile", "Bile from the liver emulsifies dietary fat."),
    "d5": ("Fever", "A fever is the body raising its temperature to fight infection."),
    "d6": ("Vaccines", "Vaccines train the immune system to recognise a pathogen."),
}
QUERIES = {"q1": "What lowers blood sugar after a meal?", "q2": "Why does the body get a fever?",
           "q3": "Which organ makes bile?"}
QRELS = {"q1": "d1", "q2": "d5", "q3": "d4"}  # q2 and q3 are the dev split's: the test split runs q1
TEST_SPLIT = ("q1",)


def _beir_folder(folder: Path) -> Path:
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": d, "title": t, "text": x}) + "\n" for d, (t, x) in DOCS.items()), encoding="utf-8")
    (folder / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in QUERIES.items()), encoding="utf-8")
    for split, qids in (("test", TEST_SPLIT), ("dev", ("q2", "q3"))):
        rows = "".join(f"{q}\t{QRELS[q]}\t1\n" for q in qids)
        (folder / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + rows, encoding="utf-8")
    return folder


def _main(*args: str) -> int:
    from r2med_agent.cli import main

    return main(list(args))


def test_own_beir_data_every_method_then_compare_report_and_trace(tmp_path, capsys, smollm2_gguf):
    data = _beir_folder(tmp_path / "mini-med")
    out = tmp_path / "results"
    folders = {}
    for method in METHODS:
        llm = [] if method == "none" else ["--llm", "smollm2", "--max-tokens", "8"]
        assert _main("run", "--data-dir", str(data), "--method", method, *llm, "-o", str(out), "--no-progress") == 0
        printed = capsys.readouterr().out
        row = next(line for line in printed.splitlines() if line.startswith("│ mini-med"))
        cells = [c.strip() for c in row.split("│")[1:-1]]
        assert re.fullmatch(r"\d\.\d{4}", cells[1]) and cells[4] == "1", printed  # nDCG@10 whole, the query ran
        folders[method] = Path(re.search(r"^results: (.+)$", printed, re.M).group(1))
        record = json.loads((folders[method] / "mini-med.json").read_text(encoding="utf-8"))
        assert record["data"] == {"folder": str(data.resolve()), "layout": "beir", "name": "mini-med",
                                  "split": "test", "all_queries": False}
        if method != "none":
            assert f"LLM generations: {record['stats']['generations']} new" in printed
            assert record["config"]["sampling"] == {"max_tokens": 8}

    # compare: one row per method, every score whole.
    assert _main("compare", str(out)) == 0
    table = capsys.readouterr().out
    for method in METHODS:
        assert f"{method}/" in table, method
    assert "…" not in table

    # report: no --data-dir; the texts come from the BEIR folder the results record.
    assert _main("report", str(out), "--out", str(tmp_path / "report")) == 0
    capsys.readouterr()
    page = (tmp_path / "report" / "report.html").read_text(encoding="utf-8")
    data_block = json.loads(re.search(r'<script type="application/json" id="r2med-data">(.*?)</script>',
                                      page, re.S).group(1))
    assert data_block["tasks"]["mini-med"]["queries"] == {q: QUERIES[q] for q in TEST_SPLIT}
    assert len(data_block["rows"]) == len(METHODS) and page.count("<svg") == 2

    # trace show on the agentic methods' result folders.
    for method in ("search-r1", "search-o1"):
        assert _main("trace", "show", str(folders[method])) == 0
        shown = capsys.readouterr().out
        assert f"{method} · query q1" in shown and "Final response:" in shown
