"""Two versions of one task's data never replace each other (issue 39, item 14): a result is filed
under the task's name unless the folder holds that task on other data, then beside it as
``<task>@data-<8 hex>``; ``results list`` and ``compare`` show both; the same data replaces its own."""

from __future__ import annotations

import json
from pathlib import Path

from r2med_agent.cli.app import main
from r2med_agent.data import data_fingerprint, load_task


def write_task(folder: Path, gold: str) -> Path:
    """A tiny R2MED-layout task ``pydocs`` whose one query's relevant document is ``gold``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "query.jsonl").write_text(json.dumps({"id": "q1", "text": "python list comprehension"}) + "\n")
    docs = [{"id": "d1", "text": "a python list comprehension builds a list"}, {"id": "d2", "text": "dicts map keys"}]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "qrels.jsonl").write_text(json.dumps({"q_id": "q1", "p_id": gold, "score": 1}) + "\n")
    return folder.parent


def _run(parent: Path, out: Path, capsys) -> None:
    code = main(["run", "--task", "pydocs", "--data-dir", str(parent), "-o", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err


def _results(out: Path) -> dict[str, dict]:
    folder = out / "none" / "none" / "bm25"
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json") if p.name not in ("spec.json", "summary.json")}


def test_other_data_is_kept_beside_and_both_are_listed_and_compared(tmp_path: Path, capsys, caplog) -> None:
    v1 = write_task(tmp_path / "v1" / "pydocs", gold="d1")
    v2 = write_task(tmp_path / "v2" / "pydocs", gold="d2")  # same corpus, other judgments
    out = tmp_path / "out"
    _run(v1, out, capsys)
    _run(v2, out, capsys)
    fp2 = data_fingerprint(load_task("pydocs", v2))
    other = f"pydocs@data-{fp2[:8]}"
    assert f"holds pydocs on other data ({(tmp_path / 'v1' / 'pydocs').resolve()}); this run's result is {other}" in caplog.text
    found = _results(out)
    assert set(found) == {"pydocs", other}
    assert found["pydocs"]["test"]["ndcg_at_10"] == 1.0 and found[other]["test"]["ndcg_at_10"] < 1.0
    assert found[other]["data_fingerprint"] == fp2 and found["pydocs"]["data_fingerprint"] != fp2
    assert found[other]["dataset_name"] == other
    assert found[other]["source"].startswith(str((tmp_path / "v2").resolve()))
    summary = json.loads((out / "none" / "none" / "bm25" / "summary.json").read_text())
    assert set(summary["per_task"]) == {"pydocs", other}
    # the same data again replaces its own result, whichever name it has
    _run(v1, out, capsys)
    _run(v2, out, capsys)
    assert set(_results(out)) == {"pydocs", other}
    main(["results", "list", str(out)])
    listing = capsys.readouterr().out
    assert "pydocs" in listing and other in listing
    main(["compare", str(out), "--format", "csv", "--out", "-"])
    table = capsys.readouterr().out
    assert "pydocs" in table.splitlines()[0] and other in table.splitlines()[0]


def test_a_record_from_before_the_data_fingerprint_is_compared_by_its_corpus(tmp_path: Path, capsys) -> None:
    v1 = write_task(tmp_path / "v1" / "pydocs", gold="d1")
    out = tmp_path / "out"
    _run(v1, out, capsys)
    path = out / "none" / "none" / "bm25" / "pydocs.json"
    record = json.loads(path.read_text())
    del record["data_fingerprint"]  # as an earlier version wrote it
    path.write_text(json.dumps(record))
    _run(v1, out, capsys)  # the same corpus: replaced
    assert set(_results(out)) == {"pydocs"}
    (tmp_path / "v1" / "pydocs" / "corpus.jsonl").write_text(
        json.dumps({"id": "d1", "text": "another text"}) + "\n" + json.dumps({"id": "d2", "text": "dicts"}) + "\n")
    record = json.loads(path.read_text())
    del record["data_fingerprint"]
    path.write_text(json.dumps(record))
    _run(v1, out, capsys)  # another corpus: kept beside
    assert len(_results(out)) == 2
