"""Task registry, loading and validation (r2med_agent.data, r2med_agent.data.hub)."""

from __future__ import annotations

import http.server
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from r2med_agent import config, data
from r2med_agent.data import formats, hub
from r2med_agent.errors import ConfigError, DataError, HubUnavailableError, MissingExtraError
from r2med_agent.types import Doc

R2MED_TASKS = [
    "Biology",
    "Bioinformatics",
    "Medical-Sciences",
    "MedXpertQA-Exam",
    "MedQA-Diag",
    "PMC-Treatment",
    "PMC-Clinical",
    "IIYi-Clinical",
]


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


QUERIES = [
    {
        "id": "q1",
        "text": "Why does my urine smell after asparagus?",
        "answer": "asparagusic acid",
        "doc_id": ["d1"],
    },
    {"id": "q2", "text": "Cola-coloured urine two weeks after a sore throat.", "body_system": "renal"},
]
CORPUS = [
    {"id": "d1", "text": "Asparagusic acid is metabolised to volatile sulfur compounds."},
    {"id": "d2", "text": "Post-streptococcal glomerulonephritis follows pharyngitis by 1-3 weeks."},
    {"id": "d3", "text": "Rhabdomyolysis turns urine dark."},
]
QRELS = [
    {"q_id": "q1", "p_id": "d1", "score": 1},
    {"q_id": "q2", "p_id": "d2", "score": 2},
    {"q_id": "q2", "p_id": "d3", "score": 0},
]


def make_r2med_dir(folder: Path, queries=QUERIES, corpus=CORPUS, qrels=QRELS) -> Path:
    write_jsonl(folder / "query.jsonl", queries)
    write_jsonl(folder / "corpus.jsonl", corpus)
    if qrels is not None:
        write_jsonl(folder / "qrels.jsonl", qrels)
    return folder


def load_dir(folder: Path, **kw):
    return data.load_task_dir(folder, name="T", family="qa", domain="biology", **kw)


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No user config, a private cache, and a hub endpoint that nothing listens on."""
    monkeypatch.delenv("R2MED_CONFIG", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    config.set_user_config(None)
    yield
    config.set_user_config(None)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------------
# registry and names
# --------------------------------------------------------------------------------------------------


def test_all_and_nano_all_expand_to_the_eight_tasks() -> None:
    assert data.task_names("all") == R2MED_TASKS
    nano = data.task_names("nano-all")
    assert nano == [f"nano-{t}" for t in R2MED_TASKS]
    for name, base in zip(nano, R2MED_TASKS):
        spec = data.get_task_spec(name)
        assert spec.repo == "hakari-bench/NanoR2MED"
        assert spec.split == "NanoR2MED" + base.replace("-", "")
        assert spec.base == base and data.base_task_name(name) == base
        assert spec.family == data.get_task_spec(base).family
        assert spec.docs == 10000


@pytest.mark.parametrize(
    "old, new",
    [
        ("Stack-Biology", "Biology"),
        ("Stack-Medical", "Medical-Sciences"),
        ("Stack-Bioinformatics", "Bioinformatics"),
        ("MedXpertQA-Exam", "MedXpertQA-Exam"),
        ("MedQA-Diag", "MedQA-Diag"),
        ("PMC-Treat", "PMC-Treatment"),
        ("PMCPatients", "PMC-Clinical"),
        ("IIYiPatients-EN", "IIYi-Clinical"),
    ],
)
def test_old_reference_names_map_to_new(old: str, new: str) -> None:
    assert data.task_names(old) == [new]
    assert data.get_task_spec(old).name == new
    assert data.task_names(f"nano-{old}") == [f"nano-{new}"]
    assert data.reference_name(new) == data.reference_name(f"nano-{new}") == old


def test_task_names_lists_case_and_duplicates() -> None:
    assert data.task_names("biology, PMC-Treat  pmcpatients,Biology") == [
        "Biology",
        "PMC-Treatment",
        "PMC-Clinical",
    ]
    assert data.task_names("sample,all")[0] == "sample"
    assert data.task_names("all,Biology,sample") == [*R2MED_TASKS, "sample"]
    assert data.task_names("NanoR2MEDMedQADiag") == ["nano-MedQA-Diag"]
    assert data.task_names("r2med-demo") == ["r2med-demo"]


@pytest.mark.parametrize("spec", ["Biologyy", "Biology,nope", "nano-sample"])
def test_unknown_task_is_config_error_listing_known(spec: str) -> None:
    with pytest.raises(ConfigError) as e:
        data.task_names(spec)
    msg = str(e.value)
    assert "unknown task" in msg
    for known in ("Biology", "IIYi-Clinical", "nano-Biology", "sample", "all", "nano-all", "PMC-Treat"):
        assert known in msg


def test_empty_task_selection_is_config_error() -> None:
    with pytest.raises(ConfigError, match="empty task selection"):
        data.task_names(" , ")
    with pytest.raises(ConfigError, match="unknown task"):
        data.load_task("no-such-task")


def test_families_and_domains() -> None:
    expected = {
        "Biology": ("qa", "biology"),
        "Bioinformatics": ("qa", "bioinformatics"),
        "Medical-Sciences": ("qa", "medical sciences"),
        "MedXpertQA-Exam": ("exam", "medicine"),
        "MedQA-Diag": ("exam", "medicine"),
        "PMC-Treatment": ("treatment", "medicine"),
        "PMC-Clinical": ("case", "medicine"),
        "IIYi-Clinical": ("case", "medicine"),
        "sample": ("qa", "medical sciences"),
        "r2med-demo": ("qa", "biology"),
    }
    for name, (family, domain) in expected.items():
        spec = data.get_task_spec(name)
        assert (spec.family, spec.domain) == (family, domain), name


def test_list_tasks_rows() -> None:
    rows = {r["name"]: r for r in data.list_tasks()}
    assert set(R2MED_TASKS) <= set(rows) and {"sample", "r2med-demo"} <= set(rows)
    bio = rows["Biology"]
    assert bio["repo"] == "R2MED/Biology" and bio["family"] == "qa"
    assert re.fullmatch(r"[0-9a-f]{40}", bio["revision"])
    assert (bio["queries"], bio["docs"]) == (103, 57359)
    assert rows["IIYi-Clinical"]["docs"] == 10449
    assert sum(rows[f"nano-{t}"]["queries"] for t in R2MED_TASKS) == 876
    for t in R2MED_TASKS:
        assert rows[t]["queries"] == rows[f"nano-{t}"]["queries"]
    assert rows["sample"]["source"] == "package:sample" and rows["sample"]["revision"] == ""
    assert rows["PMC-Clinical"]["aliases"] == ["PMCPatients"]


def test_user_config_can_pin_a_revision_and_unknown_keys_fail(tmp_path: Path) -> None:
    user = tmp_path / "user.yaml"
    user.write_text(
        "tasks:\n  Biology: {group: r2med, family: qa, domain: biology, source: hub,\n"
        "            repo: R2MED/Biology, revision: v1.0}\n",
        encoding="utf-8",
    )
    config.set_user_config(user)
    assert data.get_task_spec("Stack-Biology").revision == "v1.0"
    assert data.task_names("all") == R2MED_TASKS
    user.write_text("tasks:\n  Mine: {family: qa, domain: x, source: hub, repo: a/b, colour: red}\n")
    config.set_user_config(user)
    with pytest.raises(ConfigError, match="colour"):
        data.task_names("all")
    user.write_text("tasks:\n  Mine: {family: qa, domain: x, source: nano, repo: a/b}\n")
    config.set_user_config(user)
    with pytest.raises(ConfigError, match="split"):
        data.task_names("Mine")


# --------------------------------------------------------------------------------------------------
# the shipped tasks
# --------------------------------------------------------------------------------------------------


def test_sample_task_loads_and_is_consistent() -> None:
    task = data.load_task("sample")
    assert (task.name, task.family, task.domain) == ("sample", "qa", "medical sciences")
    assert len(task.queries) == 12 and len(task.corpus) == 122
    assert task.source == "package:sample"
    assert re.fullmatch(r"[0-9a-f]{64}", task.fingerprint)
    ids = {d.doc_id for d in task.corpus}
    assert set(task.qrels) == {q.query_id for q in task.queries}
    for qid, docs in task.qrels.items():
        assert 2 <= len(docs) <= 3 and set(docs) <= ids and set(docs.values()) == {1}, qid
    assert all(q.answer for q in task.queries)
    spec = data.get_task_spec("sample")
    assert (spec.queries, spec.docs) == (len(task.queries), len(task.corpus))


def test_r2med_demo_allows_missing_qrels_docs_only_by_flag(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="r2med_agent.data"):
        task = data.load_task("r2med-demo")
    assert len(task.queries) == 2 and len(task.corpus) == 2
    assert task.qrels == {
        "0": {
            "insects_attracted_to_light/Phototaxis_3.txt": 1,
            "insects_attracted_to_light/Proximate_and_ultimate_causation_0.txt": 1,
        }
    }
    assert any("not in corpus.jsonl" in r.getMessage() for r in caplog.records)
    folder = Path(data.__file__).parent.parent / "resources" / "r2med-demo" / "Biology"
    with pytest.raises(DataError, match=r"qrels\.jsonl:1: .*not in corpus\.jsonl"):
        load_dir(folder)


def test_qrels_naming_missing_documents_are_kept_only_on_request(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    qrels = [*QRELS, {"q_id": "q1", "p_id": "gone-1", "score": 2},
             {"q_id": "q2", "p_id": "gone-2", "score": 1}]
    make_r2med_dir(tmp_path / "Biology", qrels=qrels)
    with pytest.raises(DataError, match=r"qrels\.jsonl:4: .*'gone-1'.*--allow-missing-qrels-docs"):
        data.load_task("Biology", data_dir=tmp_path, allow_count_mismatch=True)
    with caplog.at_level(logging.WARNING, logger="r2med_agent.data"):
        task = data.load_task("Biology", data_dir=tmp_path, allow_missing_qrels_docs=True, allow_count_mismatch=True)
    # they stay in the qrels (relevant documents no retriever can find), and their count is logged
    assert task.qrels == {"q1": {"d1": 1, "gone-1": 2}, "q2": {"d2": 2, "gone-2": 1}}
    assert any("2 qrels documents are not in corpus.jsonl" in r.getMessage() for r in caplog.records)
    # the same path the bundled r2med-demo takes through its registry entry
    demo = data.load_task("r2med-demo")
    folder = Path(data.__file__).parent.parent / "resources" / "r2med-demo" / "Biology"
    assert load_dir(folder, allow_missing_qrels_docs=True).qrels == demo.qrels


# --------------------------------------------------------------------------------------------------
# local layouts
# --------------------------------------------------------------------------------------------------


def test_r2med_layout_loads_and_keeps_positive_grades(tmp_path: Path) -> None:
    task = load_dir(make_r2med_dir(tmp_path / "t"))
    assert [q.query_id for q in task.queries] == ["q1", "q2"]
    assert task.queries[0].answer == "asparagusic acid" and task.queries[1].answer == ""
    assert [d.doc_id for d in task.corpus] == ["d1", "d2", "d3"]
    assert task.qrels == {"q1": {"d1": 1}, "q2": {"d2": 2}}
    assert task.source == str((tmp_path / "t").resolve())


@pytest.mark.parametrize("folder_name", ["Biology", "Stack-Biology", "biology"])
def test_data_dir_may_be_the_task_folder_or_its_parent(tmp_path: Path, folder_name: str) -> None:
    make_r2med_dir(tmp_path / "root" / folder_name)
    make_r2med_dir(tmp_path / "root" / "PMC-Clinical", corpus=CORPUS[:2] + [{"id": "d3", "text": "other"}])
    via_parent = data.load_task("Biology", data_dir=tmp_path / "root", allow_count_mismatch=True)
    via_folder = data.load_task("Stack-Biology", data_dir=tmp_path / "root" / folder_name, allow_count_mismatch=True)
    assert via_parent.name == via_folder.name == "Biology"
    assert via_parent.fingerprint == via_folder.fingerprint
    assert via_parent.fingerprint != data.load_task("PMC-Clinical", tmp_path / "root", allow_count_mismatch=True).fingerprint


def test_task_folder_with_another_name_loads_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = make_r2med_dir(tmp_path / "my_copy")
    with caplog.at_level(logging.WARNING, logger="r2med_agent.data"):
        task = data.load_task("PMC-Clinical", data_dir=folder, allow_count_mismatch=True)
    assert task.name == "PMC-Clinical" and len(task.corpus) == 3
    assert any("folder name is not the task's" in r.getMessage() for r in caplog.records)


def test_data_dir_without_the_task_is_a_data_error(tmp_path: Path) -> None:
    make_r2med_dir(tmp_path / "root" / "Biology")
    with pytest.raises(DataError, match=r"no data for task PMC-Clinical: expected .*PMC-Clinical/"):
        data.load_task("PMC-Clinical", data_dir=tmp_path / "root", allow_count_mismatch=True)
    with pytest.raises(DataError, match="not a directory"):
        data.load_task("Biology", data_dir=tmp_path / "missing")


def test_qrels_txt_trec_and_three_column_formats(tmp_path: Path) -> None:
    expected = {"q1": {"d1": 1}, "q2": {"d2": 2}}
    variants = {
        "trec": "q1 0 d1 1\nq2 0 d2 2\nq2 0 d3 0\n",
        "trec-header": "qid iter docid rel\nq1\t0\td1\t1\nq2\t0\td2\t2\n",
        "tsv-header": "query-id\tcorpus-id\tscore\nq1\td1\t1\n\nq2\td2\t2\n",
        "space-3col": "q1 d1 1\nq2 d2 2\nq2 d3 -1\n",
    }
    for name, text in variants.items():
        folder = make_r2med_dir(tmp_path / name, qrels=None)
        (folder / "qrels.txt").write_text(text, encoding="utf-8")
        assert load_dir(folder).qrels == expected, name


def test_beir_layout_loads(tmp_path: Path) -> None:
    folder = tmp_path / "beir"
    write_jsonl(folder / "queries.jsonl", [{"_id": "1", "text": "a question", "metadata": {}}])
    write_jsonl(
        folder / "corpus.jsonl",
        [
            {"_id": "10", "title": "Title A", "text": "passage a"},
            {"_id": "11", "title": "Only a title", "text": ""},
        ],
    )
    (folder / "qrels").mkdir()
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n1\t10\t1\n", encoding="utf-8")
    task = data.load_task("Biology", data_dir=folder, allow_count_mismatch=True)
    assert task.corpus == (Doc("10", "passage a", "Title A"), Doc("11", "", "Only a title"))
    assert task.qrels == {"1": {"10": 1}}


# --------------------------------------------------------------------------------------------------
# bad inputs: DataError with file name and line number
# --------------------------------------------------------------------------------------------------


def _mutate(folder: Path, name: str, lines: list[str]) -> None:
    (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")


def j(**fields: object) -> str:
    return json.dumps(fields)


def qrel(q: str, p: str, score: object = 1) -> str:
    return json.dumps({"q_id": q, "p_id": p, "score": score})


D1 = j(id="d1", text="a")
Q1 = j(id="q1", text="x")

# case: (file, its lines, line number the error must name, pattern the message must match)
BAD = {
    "malformed json": ("corpus.jsonl", [D1, '{"id": "d2", "text": '], 2, "malformed JSON"),
    "not an object": ("query.jsonl", ['["q1", "text"]'], 1, "expected a JSON object"),
    "query without id": ("query.jsonl", [j(text="x")], 1, "missing field 'id'"),
    "doc without text": ("corpus.jsonl", [D1, j(id="d2")], 2, "missing field 'text'"),
    "doc text not a string": ("corpus.jsonl", [j(id="d1", text=5)], 1, "must be a string"),
    "empty doc text": ("corpus.jsonl", [D1, j(id="d2", text="  ")], 2, "empty document text"),
    "empty query text": ("query.jsonl", [Q1, j(id="q2", text="")], 2, "empty query text"),
    "duplicate doc id": (
        "corpus.jsonl",
        [D1, j(id="d2", text="b"), j(id="d1", text="c")],
        3,
        r"duplicate document id 'd1' \(first on line 1\)",
    ),
    "duplicate query id": ("query.jsonl", [Q1, j(id="q1", text="y")], 2, "duplicate query id"),
    "qrels unknown doc": (
        "qrels.jsonl",
        [qrel("q1", "d1"), qrel("q1", "zz")],
        2,
        "document 'zz', which is not in corpus.jsonl",
    ),
    "qrels unknown query": ("qrels.jsonl", [qrel("q9", "d1")], 1, "query 'q9', which is not in query.jsonl"),
    "qrels missing q_id": ("qrels.jsonl", [j(p_id="d1", score=1)], 1, "missing field 'q_id'"),
    "qrels missing p_id": ("qrels.jsonl", [j(q_id="q1", score=1)], 1, "missing field 'p_id'"),
    "qrels missing score": ("qrels.jsonl", [j(q_id="q1", p_id="d1")], 1, "missing field 'score'"),
    "qrels fractional score": ("qrels.jsonl", [qrel("q1", "d1", 0.5)], 1, "score must be an integer"),
    "qrels boolean score": ("qrels.jsonl", [qrel("q1", "d1", True)], 1, "score must be an integer"),
    "qrels string score": ("qrels.jsonl", [qrel("q1", "d1", "high")], 1, "score must be an integer"),
    "qrels conflicting grades": ("qrels.jsonl", [qrel("q1", "d1"), qrel("q1", "d1", 2)], 2, "conflicting grades"),
    "qrels.txt bad score": ("qrels.txt", ["q1 0 d1 1", "q1 0 d2 x"], 2, "score must be an integer"),
    "qrels.txt bad width": ("qrels.txt", ["q1 0 d1 1", "q1 d2 1"], 2, "expected 4 columns"),
    "qrels.txt two columns": ("qrels.txt", ["q1 d1"], 1, "expected 4 columns 'qid 0 docid rel' or 3 columns"),
    "qrels.txt unknown doc": ("qrels.txt", ["query-id corpus-id score", "q1 nope 1"], 2, "document 'nope'"),
    "qrels.txt first line bad score": ("qrels.txt", ["q1 0 d1 x", "q1 0 d2 1"], 1, "score must be an integer"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_file_and_line(tmp_path: Path, case: str) -> None:
    file_name, lines, line_no, pattern = BAD[case]
    folder = make_r2med_dir(tmp_path / "t", qrels=None if file_name == "qrels.txt" else QRELS)
    _mutate(folder, file_name, lines)
    with pytest.raises(DataError) as e:
        load_dir(folder)
    msg = str(e.value)
    assert f"{file_name}:{line_no}: " in msg, msg
    assert re.search(pattern, msg), msg
    assert e.value.line == line_no and Path(str(e.value.path)).name == file_name


# case: (file, its bytes, line number the error must name, pattern the message must match)
BAD_BYTES = {
    "latin-1 byte in corpus": (
        "corpus.jsonl",
        (D1 + "\n" + '{"id": "d2", "text": "caf\u00e9"}\n').encode("latin-1"),
        2,
        r"not UTF-8 text: byte 0xe9 at column 26 \(invalid continuation byte\)",
    ),
    "utf-16 query file": (
        "query.jsonl", (Q1 + "\n").encode("utf-16"), 1, "UTF-16 byte-order mark; save it as UTF-8"
    ),
    "latin-1 byte in qrels.txt": ("qrels.txt", b"q1 0 d1 1\nq1 0 d\xe92 1\n", 2, "not UTF-8 text"),
    "bad byte after crlf lines": (
        "corpus.jsonl", (D1 + "\r\n" + D1.replace("d1", "d2") + "\r\n").encode() + b"\xff\n", 3,
        "byte 0xff at column 1",
    ),
    "deep nesting": ("corpus.jsonl", (D1 + "\n" + "[" * 200_000 + "\n").encode(), 2, "nested too deeply"),
    "huge integer": ("query.jsonl", (Q1 + "\n" + "1" * 5000 + "\n").encode(), 2, "malformed JSON"),
    "unpaired surrogate in a text": (
        "corpus.jsonl", (D1 + "\n" + r'{"id": "d2", "text": "fever \ud800 rash"}' + "\n").encode(), 2,
        "unpaired UTF-16 surrogate escape",
    ),
    "unpaired low surrogate in an id": (
        "query.jsonl", (r'{"id": "q\uDC00", "text": "x"}' + "\n").encode(), 1, "unpaired UTF-16 surrogate",
    ),
}


@pytest.mark.parametrize("case", list(BAD_BYTES))
def test_undecodable_input_names_file_and_line(tmp_path: Path, case: str) -> None:
    file_name, raw, line_no, pattern = BAD_BYTES[case]
    folder = make_r2med_dir(tmp_path / "t", qrels=None if file_name == "qrels.txt" else QRELS)
    (folder / file_name).write_bytes(raw)
    with pytest.raises(DataError) as e:
        load_dir(folder)
    msg = str(e.value)
    assert f"{file_name}:{line_no}: " in msg and re.search(pattern, msg), msg


def test_escaped_surrogate_pairs_are_text(tmp_path: Path) -> None:
    corpus = [{"id": "d1", "text": "a"}, {"id": "d2", "text": "b"}, {"id": "d3", "text": "emoji \U0001F600"}]
    folder = make_r2med_dir(tmp_path / "t", corpus=corpus)  # json.dumps writes "\ud83d\ude00"
    assert r"\ud83d\ude00" in (folder / "corpus.jsonl").read_text()
    assert load_dir(folder).corpus[2].text == "emoji \U0001F600"


def test_utf8_byte_order_mark_and_crlf_are_read(tmp_path: Path) -> None:
    folder = make_r2med_dir(tmp_path / "t")
    for name in ("query.jsonl", "corpus.jsonl", "qrels.jsonl"):
        text = (folder / name).read_text(encoding="utf-8")
        (folder / name).write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    task, plain = load_dir(folder), load_dir(make_r2med_dir(tmp_path / "plain"))
    assert (task.queries, task.corpus, task.qrels) == (plain.queries, plain.corpus, plain.qrels)


def test_qrels_without_a_positive_grade_are_a_data_error(tmp_path: Path) -> None:
    trec = tmp_path / "qrels.txt"
    trec.write_text("q1 0 d1 0\nq2 0 d2 -1\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"qrels\.txt: no qrels entry has a positive grade \(all 2"):
        data.read_qrels_file(trec)
    folder = make_r2med_dir(tmp_path / "t", qrels=[{"q_id": "q1", "p_id": "d1", "score": 0}])
    with pytest.raises(DataError, match=r"qrels\.jsonl: no qrels entry has a positive grade"):
        load_dir(folder)


def test_beir_bad_qrels_names_file_and_line(tmp_path: Path) -> None:
    folder = tmp_path / "beir"
    write_jsonl(folder / "queries.jsonl", [{"_id": "1", "text": "q"}])
    write_jsonl(folder / "corpus.jsonl", [{"_id": "10", "text": "p"}])
    (folder / "qrels").mkdir()
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n1\t10\t1\n1\t99\t1\n")
    with pytest.raises(DataError, match=r"test\.tsv:3: .*'99'"):
        load_dir(folder)


def test_missing_files_are_data_errors(tmp_path: Path) -> None:
    # No qrels is not an error: a task of unjudged queries (tests/unit/data/test_beir_splits_and_unjudged.py).
    folder = make_r2med_dir(tmp_path / "noqrels", qrels=None)
    assert load_dir(folder).qrels == {}
    only_corpus = tmp_path / "onlycorpus"
    write_jsonl(only_corpus / "corpus.jsonl", CORPUS)
    with pytest.raises(DataError, match="missing file query.jsonl"):
        load_dir(only_corpus)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no task files found"):
        load_dir(tmp_path / "empty")


# --------------------------------------------------------------------------------------------------
# fingerprint
# --------------------------------------------------------------------------------------------------


def test_fingerprint_tracks_corpus_content(tmp_path: Path) -> None:
    base = load_dir(make_r2med_dir(tmp_path / "a")).fingerprint
    assert base == load_dir(make_r2med_dir(tmp_path / "a2")).fingerprint
    changed = [dict(CORPUS[0]), *CORPUS[1:]]
    changed[0]["text"] = changed[0]["text"].replace("volatile", "volatlle")
    assert load_dir(make_r2med_dir(tmp_path / "b", corpus=changed)).fingerprint != base
    reordered = [CORPUS[1], CORPUS[0], CORPUS[2]]
    assert load_dir(make_r2med_dir(tmp_path / "c", corpus=reordered)).fingerprint != base
    # The queries and qrels do not enter the fingerprint.
    assert load_dir(make_r2med_dir(tmp_path / "d", qrels=QRELS[:1])).fingerprint == base
    # Length-prefixed fields: moving characters between id, title and text changes the hash.
    assert data.corpus_fingerprint([Doc("ab", "c")]) != data.corpus_fingerprint([Doc("a", "bc")])
    assert data.corpus_fingerprint([Doc("a", "b", "t")]) != data.corpus_fingerprint([Doc("a", "b")])


# --------------------------------------------------------------------------------------------------
# task cache
# --------------------------------------------------------------------------------------------------


def _count_corpus_parses(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    parsed: list[Path] = []
    real = formats._parse_docs

    def counting(records, path, **kw):
        parsed.append(path)
        return real(records, path, **kw)

    monkeypatch.setattr(formats, "_parse_docs", counting)
    return parsed


def test_a_task_loaded_again_comes_from_the_task_cache_and_reads_its_corpus_on_first_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from r2med_agent.types import Corpus

    parsed = _count_corpus_parses(monkeypatch)
    folder = make_r2med_dir(tmp_path / "t")
    first = load_dir(folder)
    assert len(parsed) == 1 and isinstance(first.corpus, tuple)
    with caplog.at_level(logging.INFO, logger="r2med_agent.data"):
        again = load_dir(folder)
    assert "from the task cache" in caplog.text
    assert len(parsed) == 1  # nothing parsed: ids, queries, qrels and fingerprint were stored
    assert isinstance(again.corpus, Corpus) and not again.corpus.loaded
    assert again.doc_ids == first.doc_ids == ["d1", "d2", "d3"] and len(again.corpus) == 3
    assert (again.queries, again.qrels, again.fingerprint) == (first.queries, first.qrels, first.fingerprint)
    assert not again.corpus.loaded
    # The texts are parsed once, when first needed, and are the same documents.
    assert tuple(again.corpus) == first.corpus and again.corpus == first.corpus
    assert again.corpus[1] == first.corpus[1] and again.corpus.loaded
    assert len(parsed) == 2
    list(again.corpus)
    assert len(parsed) == 2
    # Without the cache, always parsed.
    load_dir(folder, use_task_cache=False)
    assert len(parsed) == 3


def test_task_cache_is_keyed_by_the_bytes_of_every_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = _count_corpus_parses(monkeypatch)
    folder = make_r2med_dir(tmp_path / "t")
    base = load_dir(folder)
    # Same size, same modification time, one byte changed: a new key, parsed again.
    corpus = folder / "corpus.jsonl"
    stat = corpus.stat()
    corpus.write_bytes(corpus.read_bytes().replace(b"volatile", b"volatlle"))
    import os
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed = load_dir(folder)
    assert len(parsed) == 2 and changed.fingerprint != base.fingerprint
    assert "volatlle" in changed.corpus[0].text
    # The qrels file too (the corpus is the same, the qrels differ): parsed again.
    write_jsonl(folder / "qrels.jsonl", QRELS[:1])
    assert load_dir(folder).qrels == {"q1": {"d1": 1}}
    assert len(parsed) == 3


def test_task_cache_keeps_the_loaders_warnings_and_validation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = make_r2med_dir(tmp_path / "t", qrels=[*QRELS, {"q_id": "q1", "p_id": "gone", "score": 1}])
    with pytest.raises(DataError, match="--allow-missing-qrels-docs"):
        load_dir(folder)
    for _ in range(2):  # parsed, then from the task cache: the same warning both times
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="r2med_agent.data"):
            task = load_dir(folder, allow_missing_qrels_docs=True)
        assert "1 qrels documents are not in corpus.jsonl" in caplog.text
        assert task.qrels["q1"] == {"d1": 1, "gone": 1}
    # A stored task never stands in for one that fails validation without the option.
    with pytest.raises(DataError, match="--allow-missing-qrels-docs"):
        load_dir(folder)


def test_a_corpus_changed_before_its_first_use_is_an_error(tmp_path: Path) -> None:
    folder = make_r2med_dir(tmp_path / "t")
    load_dir(folder)
    task = load_dir(folder)
    write_jsonl(folder / "corpus.jsonl", [CORPUS[1], CORPUS[0], CORPUS[2]])
    with pytest.raises(DataError, match="changed on disk"):
        list(task.corpus)


def test_unreadable_task_cache_file_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = make_r2med_dir(tmp_path / "t")
    first = load_dir(folder)
    (stored,) = (tmp_path / "cache" / "tasks").iterdir()
    stored.write_text('{"format": 1, "queries": [')
    with caplog.at_level(logging.WARNING, logger="r2med_agent.data"):
        again = load_dir(folder)
    assert "ignoring unreadable task cache file" in caplog.text
    assert isinstance(again.corpus, tuple) and again.corpus == first.corpus
    assert load_dir(folder).fingerprint == first.fingerprint  # rewritten, read back


def test_bm25_rerun_never_reads_a_cached_tasks_corpus(tmp_path: Path) -> None:
    from r2med_agent.retrieval.bm25.retriever import BM25Retriever
    from r2med_agent.types import SearchRequest

    folder = make_r2med_dir(tmp_path / "t")
    first = load_dir(folder)
    reqs = [SearchRequest(q.query_id, q.text) for q in first.queries]
    expected = BM25Retriever.for_task(first, show_progress=False).search(reqs, 10)
    again = load_dir(folder)
    retriever = BM25Retriever.for_task(again, show_progress=False)
    assert not retriever.built_index
    assert retriever.search(reqs, 10) == expected
    assert not again.corpus.loaded


# --------------------------------------------------------------------------------------------------
# hub code path against local snapshots
# --------------------------------------------------------------------------------------------------


def test_hub_task_reads_the_downloaded_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = make_r2med_dir(tmp_path / "snap")
    write_jsonl(snapshot / "hyde" / "qwen-7b" / "query_with_hydoc.jsonl", [{"id": "q1", "hy_doc": "x"}])
    calls = []

    def fake_fetch(repo_id, revision, allow_patterns, *, hint):
        calls.append((repo_id, revision, list(allow_patterns), hint))
        return snapshot

    monkeypatch.setattr(hub, "fetch_snapshot", fake_fetch)
    task = data.load_task("PMC-Treat")
    spec = data.get_task_spec("PMC-Treatment")
    assert calls == [(spec.repo, spec.revision, list(data.R2MED_HUB_FILES), calls[0][3])]
    assert "--data-dir" not in calls[0][3] and "PMC-Treatment/" in calls[0][3]
    assert task.name == "PMC-Treatment" and task.family == "treatment"
    assert task.source == f"hf://datasets/R2MED/PMC-Treatment@{spec.revision}"
    assert task.qrels == {"q1": {"d1": 1}, "q2": {"d2": 2}}


def _write_parquet(path: Path, rows: list[dict]) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def make_nano_snapshot(root: Path, split: str, fmt: str) -> Path:
    corpus = [{"_id": f"{split}-d{i}", "text": f"document {i}"} for i in range(4)]
    queries = [{"_id": "0", "text": "first query"}, {"_id": "1", "text": "second query"}]
    qrels = [
        {"query-id": "0", "corpus-id": f"{split}-d1"},
        {"query-id": "1", "corpus-id": f"{split}-d2"},
        {"query-id": "1", "corpus-id": f"{split}-d3"},
    ]
    for config_name, rows in (("corpus", corpus), ("queries", queries), ("qrels", qrels)):
        if fmt == "parquet":
            _write_parquet(root / config_name / f"{split}-00000-of-00001.parquet", rows)
        else:
            write_jsonl(root / config_name / f"{split}.jsonl", rows)
    return root


def test_nano_hub_path_reads_its_parquet_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_nano_snapshot(tmp_path / "nano", "NanoR2MEDPMCClinical", "parquet")
    make_nano_snapshot(root, "NanoR2MEDBiology", "parquet")  # another split in the same repo
    calls = []

    def fake_fetch(repo: str, rev: str, patterns: list[str], *, hint: str) -> Path:
        calls.append((repo, rev, patterns))
        return root

    monkeypatch.setattr(hub, "fetch_snapshot", fake_fetch)
    task = data.load_task("nano-PMCPatients")
    assert calls[0][0] == "hakari-bench/NanoR2MED" and calls[0][1] == "main"
    assert "corpus/NanoR2MEDPMCClinical-*" in calls[0][2] and "qrels/NanoR2MEDPMCClinical.*" in calls[0][2]
    assert task.name == "nano-PMC-Clinical" and task.family == "case"
    assert [d.doc_id for d in task.corpus] == [f"NanoR2MEDPMCClinical-d{i}" for i in range(4)]
    assert task.qrels == {
        "0": {"NanoR2MEDPMCClinical-d1": 1},
        "1": {"NanoR2MEDPMCClinical-d2": 1, "NanoR2MEDPMCClinical-d3": 1},
    }
    assert task.source == "hf://datasets/hakari-bench/NanoR2MED@main#NanoR2MEDPMCClinical"


def test_nano_layout_as_data_dir_with_jsonl(tmp_path: Path) -> None:
    root = make_nano_snapshot(tmp_path / "NanoR2MED", "NanoR2MEDBiology", "jsonl")
    task = data.load_task("nano-Biology", data_dir=root, allow_count_mismatch=True)
    assert len(task.corpus) == 4 and task.qrels["1"] == {"NanoR2MEDBiology-d2": 1, "NanoR2MEDBiology-d3": 1}
    with pytest.raises(DataError, match="NanoR2MEDBioinformatics"):
        data.load_task("nano-Bioinformatics", data_dir=root, allow_count_mismatch=True)
    (root / "qrels" / "NanoR2MEDBiology.jsonl").write_text('{"query-id": "0"}\n')
    with pytest.raises(DataError, match=r"NanoR2MEDBiology\.jsonl:1: missing field 'p_id'"):
        data.load_task("nano-Biology", data_dir=root, allow_count_mismatch=True)


def test_parquet_without_pyarrow_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "nano"
    for config_name in ("corpus", "queries", "qrels"):
        (root / config_name).mkdir(parents=True)
        (root / config_name / "NanoR2MEDBiology.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)
    with pytest.raises(MissingExtraError, match="pyarrow"):
        data.load_task("nano-Biology", data_dir=root, allow_count_mismatch=True)


def test_cached_commit_snapshot_is_used_without_network(tmp_path: Path) -> None:
    """The real huggingface_hub cache lookup: a pinned commit already in the cache needs no hub."""
    spec = data.get_task_spec("MedQA-Diag")
    assert hub.is_commit(spec.revision)
    snapshot = hub.hub_cache_dir() / "datasets--R2MED--MedQA-Diag" / "snapshots" / spec.revision
    make_r2med_dir(snapshot)
    started = time.perf_counter()
    task = data.load_task("MedQA-Diag")
    assert time.perf_counter() - started < 20
    assert task.family == "exam" and len(task.corpus) == 3
    assert task.source == f"hf://datasets/R2MED/MedQA-Diag@{spec.revision}"


def test_unreachable_hub_fails_fast_with_data_dir_advice() -> None:
    for name in ("Biology", "nano-Biology"):
        started = time.perf_counter()
        with pytest.raises(HubUnavailableError) as e:
            data.load_task(name)
        elapsed = time.perf_counter() - started
        # A generous bound that still catches retry loops (huggingface_hub's backoff takes minutes).
        assert elapsed < 20, elapsed
        msg = str(e.value)
        assert "Cannot reach the Hugging Face hub at http://127.0.0.1:" in msg
        assert "--data-dir" in msg and msg.count(". ") == 0


def test_offline_mode_fails_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnavailableError, match="HF_HUB_OFFLINE is set.*--data-dir"):
        data.load_task("IIYi-Clinical")


class _Handler(http.server.BaseHTTPRequestHandler):
    status = 404

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "nope"}')

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("status, error", [(404, ConfigError), (503, HubUnavailableError)])
def test_hub_answers_with_an_error(monkeypatch: pytest.MonkeyPatch, status: int, error: type) -> None:
    handler = type("H", (_Handler,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(error) as e:
            data.load_task("Bioinformatics")
        assert ("revision" in str(e.value)) if status == 404 else ("HTTP 503" in str(e.value))
    finally:
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------------------------------
# end to end: real huggingface_hub downloads from a loopback server that speaks the hub's file API
# --------------------------------------------------------------------------------------------------


class FakeHub:
    """Serves dataset files the way the hub does: revision info, tree listing, resolve URLs."""

    def __init__(self, repo: str, sha: str, files: dict[str, bytes]) -> None:
        import hashlib

        self.requests: list[str] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, code: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def route(self) -> None:  # noqa: C901 - one small router
                from urllib.parse import unquote, urlparse

                path = unquote(urlparse(self.path).path)
                fake.requests.append(f"{self.command} {path}")
                as_json = {"Content-Type": "application/json"}
                if path.startswith(f"/api/datasets/{repo}/revision/"):
                    info = {"id": repo, "sha": sha, "siblings": [{"rfilename": f} for f in files]}
                    return self._send(200, json.dumps(info).encode(), as_json)
                if path.startswith(f"/api/datasets/{repo}/tree/"):
                    items = [
                        {"type": "file", "oid": hashlib.sha1(b).hexdigest(), "size": len(b), "path": f}
                        for f, b in files.items()
                    ]
                    return self._send(200, json.dumps(items).encode(), as_json)
                prefix = f"/datasets/{repo}/resolve/"
                if path.startswith(prefix):
                    name = path[len(prefix):].partition("/")[2]
                    if name in files:
                        body = files[name]
                        headers = {
                            "ETag": f'"{hashlib.sha1(body).hexdigest()}"',
                            "X-Repo-Commit": sha,
                            "Content-Type": "application/octet-stream",
                        }
                        return self._send(200, body, headers)
                return self._send(404, b"{}", {**as_json, "X-Error-Code": "EntryNotFound"})

            do_GET = route
            do_HEAD = route

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _jsonl_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def test_real_download_of_pinned_revision_then_offline_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = data.get_task_spec("Biology")
    files = {
        "query.jsonl": _jsonl_bytes(QUERIES),
        "corpus.jsonl": _jsonl_bytes(CORPUS),
        "qrels.jsonl": _jsonl_bytes(QRELS),
        "README.md": b"card",
        "hyde/gpt4/query_with_hydoc.jsonl": b"{}\n",
    }
    fake = FakeHub(spec.repo, spec.revision, files)
    try:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        task = data.load_task("Biology")
    finally:
        fake.close()
    assert task.qrels == {"q1": {"d1": 1}, "q2": {"d2": 2}}
    downloaded = {r.split("/resolve/")[1].partition("/")[2] for r in fake.requests if "/resolve/" in r}
    assert downloaded == {"query.jsonl", "corpus.jsonl", "qrels.jsonl"}  # only the task's files
    snapshot = hub.hub_cache_dir() / "datasets--R2MED--Biology" / "snapshots" / spec.revision
    assert (snapshot / "corpus.jsonl").is_file()
    # The hub is gone now: the pinned commit comes from the cache.
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    again = data.load_task("Stack-Biology")
    assert again.fingerprint == task.fingerprint


def test_real_download_of_branch_then_cache_fallback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    split = "NanoR2MEDIIYiClinical"
    root = make_nano_snapshot(tmp_path / "nano", split, "jsonl")
    make_nano_snapshot(root, "NanoR2MEDBiology", "jsonl")
    files = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*.jsonl")}
    fake = FakeHub("hakari-bench/NanoR2MED", "b" * 40, files)
    try:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        task = data.load_task("nano-IIYi-Clinical")
    finally:
        fake.close()
    downloaded = {r.split("/resolve/")[1].partition("/")[2] for r in fake.requests if "/resolve/" in r}
    assert downloaded == {f"{c}/{split}.jsonl" for c in ("corpus", "queries", "qrels")}
    assert task.name == "nano-IIYi-Clinical" and len(task.corpus) == 4
    # the branch's commit is recorded, so a result says which data it was computed on
    assert task.source == f"hf://datasets/hakari-bench/NanoR2MED@main#{split} (commit {'b' * 40})"
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    with caplog.at_level(logging.WARNING, logger="r2med_agent.data.hub"):
        again = data.load_task("nano-IIYi-Clinical")
    assert again.fingerprint == task.fingerprint and again.source == task.source
    assert any("using the cached copy" in r.getMessage() for r in caplog.records)


def test_read_qrels_files_on_their_own(tmp_path: Path) -> None:
    jsonl = write_jsonl(tmp_path / "qrels.jsonl", QRELS)
    assert data.read_qrels_jsonl(jsonl) == {"q1": {"d1": 1}, "q2": {"d2": 2}}
    trec = tmp_path / "qrels.txt"
    trec.write_text("qid iter docid rel\nq1 0 d1 1\nq2 0 d2 0\n", encoding="utf-8")
    assert data.read_qrels_file(trec) == {"q1": {"d1": 1}}
    assert data.read_qrels_file(jsonl) == data.read_qrels_jsonl(jsonl)
    (tmp_path / "bad.jsonl").write_text(qrel("q1", "d1") + "\n" + qrel("q1", "d2", 1.5) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: qrels score must be an integer"):
        data.read_qrels_jsonl(tmp_path / "bad.jsonl")


def test_qrels_text_ids_with_a_zero_width_character_or_inner_space_are_refused(tmp_path: Path) -> None:
    """Issue 29 item 9: a zero-width space made ``q1`` and ``q1<U+200B>`` two ids that look alike."""
    trec = tmp_path / "qrels.txt"
    trec.write_text("q1 0 d1 1\nq2\u200b 0 d2 1\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"qrels\.txt:2: qrels query id 'q2\\u200b' holds an invisible "
                                        r"character \(U\+200B ZERO WIDTH SPACE\)"):
        data.read_qrels_file(trec)
    tsv = tmp_path / "qrels.tsv"
    tsv.write_text("q1\t0\td1\t1\nq2\t0\td 2\t1\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"qrels\.tsv:2: qrels document id 'd 2' holds whitespace"):
        data.read_qrels_file(tsv)
