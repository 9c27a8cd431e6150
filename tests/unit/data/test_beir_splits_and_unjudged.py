"""BEIR folders are read by split as BEIR's loader reads them (only the queries the split's qrels
name, the rest counted and left out unless ``--all-queries``), and a folder without qrels, or
``--no-eval``, runs every stage and writes its files without scores."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from r2med_agent.paths import resources_dir

DOCS = {"d1": "Insulin lowers blood glucose.", "d2": "Amylase digests starch into sugars.",
        "d3": "The heart pumps blood through the body.", "d4": "Bile emulsifies dietary fat."}
QUERIES = {"q1": "what lowers blood glucose", "q2": "which enzyme digests starch",
           "q3": "what pumps blood", "q4": "what emulsifies fat"}


def _main(*args: str) -> int:
    from r2med_agent.cli import main

    return main(list(args))


def _beir(folder: Path, splits: dict[str, dict[str, str]] | None) -> Path:
    """A BEIR folder: every query in queries.jsonl, ``splits`` as qrels/<split>.tsv (none: no qrels/)."""
    folder.mkdir(parents=True)
    (folder / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": d, "title": "", "text": t}) + "\n" for d, t in DOCS.items()), encoding="utf-8")
    (folder / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in QUERIES.items()), encoding="utf-8")
    if splits is not None:
        (folder / "qrels").mkdir()
        for split, pairs in splits.items():
            rows = "".join(f"{q}\t{d}\t1\n" for q, d in pairs.items())
            (folder / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + rows, encoding="utf-8")
    return folder


def _run_ids(path: Path) -> list[str]:
    return sorted({line.split()[0] for line in path.read_text(encoding="utf-8").splitlines()})


def test_a_beir_folder_runs_the_queries_of_its_split_only(tmp_path, caplog):
    data = _beir(tmp_path / "mybeir", {"test": {"q1": "d1", "q2": "d2"}, "dev": {"q3": "d3"}})
    out = tmp_path / "results"
    folder = out / "none" / "none" / "bm25"
    assert _main("run", "--data-dir", str(data), "-o", str(out), "--no-progress") == 0
    assert _run_ids(folder / "mybeir.run") == ["q1", "q2"]  # q3 (dev) and q4 (no qrels) left out
    rec = json.loads((folder / "mybeir.json").read_text())
    assert rec["num_queries"] == 2 and rec["source"] == f"{data.resolve()} (split test)"
    assert "2 of 4 queries have no row in qrels/test.tsv and are left out" in caplog.text

    # Another split (or every query) is another query set: a task of its own, whose results never
    # replace the test split's.
    assert _main("run", "--data-dir", str(data), "-o", str(out), "--no-progress", "--split", "dev") == 0
    assert _run_ids(folder / "mybeir@dev.run") == ["q3"]
    rec = json.loads((folder / "mybeir@dev.json").read_text())
    assert rec["source"].endswith("(split dev)") and rec["config"]["split"] == "dev"
    assert rec["dataset_name"] == "mybeir@dev"

    assert _main("run", "--data-dir", str(data), "-o", str(out), "--no-progress", "--all-queries") == 0
    assert _run_ids(folder / "mybeir@test-all.run") == ["q1", "q2", "q3", "q4"]
    rec = json.loads((folder / "mybeir@test-all.json").read_text())
    assert rec["num_queries"] == 2 and rec["source"].endswith("(split test, all queries)")
    assert _run_ids(folder / "mybeir.run") == ["q1", "q2"]  # the test split's run is still there


def test_a_split_the_folder_lacks_names_those_it_has(tmp_path, capsys):
    data = _beir(tmp_path / "mybeir", {"test": {"q1": "d1"}, "dev": {"q3": "d3"}})
    assert _main("run", "--data-dir", str(data), "-o", str(tmp_path / "r"), "--no-progress", "--split", "val") == 2
    err = capsys.readouterr().err
    assert "no qrels for split 'val'" in err and "this folder has qrels for dev, test" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("layout", ["r2med", "beir"])
def test_a_folder_without_qrels_is_run_and_written_but_not_scored(tmp_path, capsys, layout):
    if layout == "r2med":
        data = tmp_path / "unjudged"
        shutil.copytree(resources_dir() / "sample", data)
        (data / "qrels.jsonl").unlink()
        every = sorted(json.loads(x)["id"] for x in (data / "query.jsonl").read_text().splitlines())
    else:
        data = _beir(tmp_path / "unjudged", None)
        every = sorted(QUERIES)
    out = tmp_path / "results"
    assert _main("run", "--data-dir", str(data), "-o", str(out), "--no-progress") == 0
    captured = capsys.readouterr()
    assert "unjudged: not scored (no relevance judgments (qrels) in its folder)" in " ".join(captured.out.split())
    folder = out / "none" / "none" / "bm25"
    assert _run_ids(folder / "unjudged.run") == every
    rec = json.loads((folder / "unjudged.json").read_text())
    assert rec["test"] == {} and rec["not_scored"].startswith("no relevance judgments") and rec["num_queries"] == 0
    # compare leaves the unscored result out instead of stopping on it.
    shutil.copytree(resources_dir() / "sample", tmp_path / "judged")
    assert _main("run", "--data-dir", str(tmp_path / "judged"), "-o", str(out), "--no-progress") == 0
    capsys.readouterr()
    assert _main("compare", str(out)) == 0
    table = capsys.readouterr().out
    assert "judged" in table and "unjudged" not in table


def test_no_eval_writes_generations_and_the_run_without_scores(tmp_path):
    import r2med_agent

    data = tmp_path / "mine"
    shutil.copytree(resources_dir() / "sample", data)
    result = r2med_agent.evaluate_llm(lambda prompts: ["Insulin and glucose."] * len(prompts), "echo-writer",
                                      data_dir=data, output_dir=tmp_path / "results", no_eval=True,
                                      cache_path=tmp_path / "gen.sqlite")
    [outcome] = result.outcomes
    assert outcome.not_scored == "--no-eval" and outcome.evaluation.mean == {} and result.average == {}
    names = sorted(p.name for p in result.result_dir.iterdir())
    assert {"mine.run", "mine.json", "mine.generations.jsonl"} <= set(names)
    assert len((result.result_dir / "mine.generations.jsonl").read_text().splitlines()) == 12
    assert json.loads((result.result_dir / "mine.json").read_text())["not_scored"] == "--no-eval"


def test_a_hub_release_without_qrels_is_still_an_error(monkeypatch):
    # Only a folder of one's own may be unjudged: a registry task's download without qrels is broken.
    from r2med_agent.data import get_task_spec, load_task
    from r2med_agent.errors import DataError
    from tests.unit.data.test_data import CORPUS, QUERIES, FakeHub, _jsonl_bytes

    spec = get_task_spec("Biology")
    fake = FakeHub(spec.repo, spec.revision, {"query.jsonl": _jsonl_bytes(QUERIES),
                                              "corpus.jsonl": _jsonl_bytes(CORPUS)})
    try:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        with pytest.raises(DataError, match="missing qrels: Biology's release has relevance judgments"):
            load_task("Biology")
    finally:
        fake.close()


def test_unscored_runs_say_how_many_queries_ran_and_compare_says_why_it_has_nothing(tmp_path, capsys):
    """Issue 30 item 8: an unscored run's table showed ``queries 0`` when 4 ran, and ``compare`` on
    unscored results said it left them out, then "no <Task>.json found"."""
    data = _beir(tmp_path / "unjudged", None)
    out = tmp_path / "results"
    assert _main("run", "--data-dir", str(data), "-o", str(out), "--no-progress") == 0
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("│ unjudged"))
    assert [c.strip() for c in row.split("│")[1:-1]] == ["unjudged", "-", "-", "-", "4", "0"]
    assert "not scored (no relevance judgments (qrels) in its folder); its 4 queries ran" in " ".join(printed.split())
    rec = json.loads((out / "none" / "none" / "bm25" / "unjudged.json").read_text())
    assert rec["queries_run"] == 4 and rec["num_queries"] == 0
    assert _main("compare", str(out)) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "nothing to compare: the 1 result file(s) under" in err and "hold no scores" in err
    assert "bm25/unjudged.json" in err and "r2med-agent evaluate --run FILE --qrels QRELS" in err
    assert "no <Task>.json found" not in err
