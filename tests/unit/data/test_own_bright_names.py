"""Naming the tasks of a BRIGHT-layout folder of your own (issue 35 item 6, issue 39 item 15): a
split is a task by its name, ``<split>-long`` its long documents; a result is named by what ran; a
name that is no split is refused, and one that is also a registry task's says exactly what to type.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from r2med_agent import data
from r2med_agent.cli.app import main
from r2med_agent.errors import DataError
from tests.bright_fixture import example_row, write_jsonl

SHORT = {"a1": "python list comprehension builds a list", "a2": "a dict maps keys to values",
         "a3": "generators yield values lazily"}
LONG = {"page_a": "python list comprehension builds a list. a dict maps keys to values.",
        "page_b": "generators yield values lazily and save memory"}
EXAMPLES = [{"id": "p1", "query": "how do I build a list in python", "gold_ids": ["a1"], "gold_ids_long": ["page_a"]},
            {"id": "p2", "query": "lazy values with generators", "gold_ids": ["a3"], "gold_ids_long": ["page_b"]}]


def own_split(root: Path, split: str, *, short: bool = True, long: bool = True) -> Path:
    write_jsonl(root / "examples" / f"{split}.jsonl", [example_row(e) for e in EXAMPLES])
    if short:
        write_jsonl(root / "documents" / f"{split}.jsonl", [{"id": k, "content": v} for k, v in SHORT.items()])
    if long:
        write_jsonl(root / "long_documents" / f"{split}.jsonl", [{"id": k, "content": v} for k, v in LONG.items()])
    return root


def run(args: list[str], capsys) -> tuple[int, str]:
    code = main(["run", "--retriever", "bm25-compat", "--no-progress", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_name_long_runs_the_long_documents_and_is_named_so(tmp_path: Path, capsys) -> None:
    root = own_split(tmp_path / "data", "pydocs")
    own_split(root, "other")  # two splits: the long setting is chosen by name
    out = tmp_path / "out"
    code, text = run(["--data-dir", str(root), "--task", "pydocs-long", "-o", str(out)], capsys)
    assert code == 0, text
    record = json.loads((out / "none" / "none" / "bm25-compat" / "pydocs-long.json").read_text())
    written = data.load_task("pydocs-long", root)
    assert written.name == "pydocs-long" and set(written.doc_ids) == set(LONG)
    assert written.qrels == {"p1": {"page_a": 1}, "p2": {"page_b": 1}}
    assert record["dataset_name"] == "pydocs-long" and record["corpus_fingerprint"] == written.fingerprint
    run_file = (out / "none" / "none" / "bm25-compat" / "pydocs-long.run").read_text()
    assert "page_a" in run_file and "a1" not in run_file.split()
    assert data.task_names("PyDocs-Long", root) == ["pydocs-long"]  # any case, named by the split


def test_what_does_not_exist_is_refused_before_anything_is_written(tmp_path: Path, capsys) -> None:
    root = own_split(tmp_path / "data", "pydocs", long=False)
    out = tmp_path / "out"
    code, text = run(["--data-dir", str(root), "--task", "pydocs-long", "-o", str(out)], capsys)
    assert code != 0 and "missing long_documents/pydocs.parquet" in text and "--task pydocs" in text
    # one split, and a name that is not it: not run under a made-up name
    code, text = run(["--data-dir", str(root), "--task", "whatever", "-o", str(out)], capsys)
    assert code != 0 and "holds the split pydocs; task 'whatever' is none of them" in text
    assert "--task pydocs" in text and "Traceback" not in text
    assert not out.exists()


def test_a_folder_with_long_documents_only_names_its_task_long(tmp_path: Path, capsys) -> None:
    root = own_split(tmp_path / "data", "pydocs", short=False)
    assert data.local_task_names(root) == ["pydocs-long"]
    with pytest.raises(DataError, match=r"missing documents/pydocs\.parquet .* runs as --task pydocs-long"):
        data.load_task("pydocs", root)
    out = tmp_path / "out"
    code, text = run(["--data-dir", str(root), "-o", str(out)], capsys)
    assert code == 0, text
    assert [p.name for p in out.rglob("*.json") if p.name not in ("spec.json", "summary.json")] == ["pydocs-long.json"]


def test_a_split_named_as_a_registry_task_says_exactly_what_to_type(tmp_path: Path, capsys) -> None:
    """The split ``biology`` (BRIGHT's own key) in a folder of your own: ``--task biology`` is R2MED's
    Biology by name, so the message gives the entry to write, and typing it runs the split."""
    root = own_split(tmp_path / "data", "biology")
    own_split(root, "pony")
    out = tmp_path / "out"
    code, text = run(["--data-dir", str(root), "--task", "biology", "-o", str(out)], capsys)
    assert code != 0 and "Traceback" not in text
    assert "task 'biology' is the registry's Biology" in text
    assert "tasks: {my-biology: {source: local, split: biology, family: qa, domain: YOUR DOMAIN}}" in text
    assert "--config FILE --task my-biology" in text
    assert "--task bright-biology --allow-count-mismatch" in text
    assert not out.exists()
    config = tmp_path / "config.yaml"
    config.write_text("tasks: {my-biology: {source: local, split: biology, family: qa, domain: biology}}\n")
    code, text = run(["--config", str(config), "--data-dir", str(root), "--task", "my-biology", "-o", str(out)],
                     capsys)
    assert code == 0, text
    record = json.loads(next(out.rglob("my-biology.json")).read_text())
    assert record["dataset_name"] == "my-biology" and record["domain"] == "biology"
    # the folder's other split, which no registry name takes, runs by its own name
    code, text = run(["--data-dir", str(root), "--task", "pony-long", "-o", str(out)], capsys)
    assert code == 0, text
    assert next(out.rglob("pony-long.json"))
