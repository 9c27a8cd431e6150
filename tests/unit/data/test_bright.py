"""BRIGHT's tasks: the registry, the hub layout (parquet shards, or JSON lines in a folder of your
own), validation with file and row, the task cache, and real downloads from a loopback hub."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from r2med_agent import data
from r2med_agent.data import bright, hub
from r2med_agent.errors import ConfigError, DataError
from tests.bright_fixture import (
    BIOLOGY_DOCS,
    BIOLOGY_EXAMPLES,
    LEETCODE_EXAMPLES,
    SHARD,
    example_row,
    hub_files,
    make_bright,
    write_jsonl,
    write_parquet,
)
from tests.unit.data.test_data import FakeHub, closed_port, isolated  # noqa: F401  (autouse fixture)


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    return make_bright(tmp_path / "BRIGHT")


def load(name: str, folder: Path, **kw):
    return data.load_task(name, folder, allow_count_mismatch=True, **kw)


# --------------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------------


def test_twelve_tasks_and_eight_long_ones_named_apart_from_r2meds() -> None:
    short = data.task_names("bright-all")
    long = data.task_names("bright-long-all")
    assert [data.get_task_spec(t).split for t in short] == list(bright.BRIGHT_TASKS)
    assert [data.get_task_spec(t).split for t in long] == list(bright.LONG_TASKS)
    assert all(t.startswith("bright-") for t in short + long) and all(t.endswith("-long") for t in long)
    assert not set(short + long) & set(data.task_names("all"))
    # R2MED's Biology stays R2MED's; BRIGHT's own keys are aliases after "bright-"
    assert data.get_task_spec("biology").name == "Biology"
    assert data.task_names("bright-earth_science, bright-theoremqa_questions-long".replace("-long", "")) == [
        "bright-earth-science", "bright-theoremqa-questions"]
    spec = data.get_task_spec("bright-pony-long")
    assert spec.bright == bright.BrightSplit("pony", long=True) and spec.repo == bright.BRIGHT_REPO
    assert len(spec.revision) == 40 and spec.docs == 577 and spec.queries == 112
    assert data.get_task_spec("bright-leetcode").docs == 413932


def test_tasks_lists_them_with_their_sizes() -> None:
    from typer.testing import CliRunner

    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app

    _register()
    out = CliRunner().invoke(app, ["tasks"], env={"COLUMNS": "200"}).output
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip().startswith("bright-")}
    assert len(lines) == 20
    assert "116" in lines["bright-earth-science"] and "121249" in lines["bright-earth-science"]
    assert "1858" in lines["bright-stackoverflow-long"]


# --------------------------------------------------------------------------------------------------
# reading the layout
# --------------------------------------------------------------------------------------------------


def test_short_and_long_settings_read_their_documents_and_gold_ids(root: Path) -> None:
    short = load("bright-biology", root)
    assert [q.query_id for q in short.queries] == ["0", "1", "2"]
    assert short.doc_ids == list(BIOLOGY_DOCS)
    assert short.qrels["0"] == {d: 1 for d in BIOLOGY_EXAMPLES[0]["gold_ids"]}
    assert short.excluded == {"0": (), "1": (), "2": ()}  # "N/A" excludes nothing
    long = load("bright-biology-long", root)
    assert len(long.corpus) == 4 and long.qrels["1"] == {"nasal_cycle/Nasal_cycle.txt": 1}
    assert long.fingerprint != short.fingerprint
    leet = load("bright-leetcode", root)
    assert leet.excluded["rotated_search"] == ("leetcode/rotated_search.txt",)
    assert leet.family == "qa" and leet.domain == "coding"


def test_excluded_ids_survive_the_task_cache(root: Path) -> None:
    first = load("bright-leetcode", root)
    again = load("bright-leetcode", root)
    assert not again.corpus.__class__ is tuple  # from the cache: the corpus is read on first use
    assert again.excluded == first.excluded and again.qrels == first.qrels


def test_json_lines_and_several_shards_read_the_same(tmp_path: Path, root: Path) -> None:
    jl = make_bright(tmp_path / "jl", fmt="jsonl")
    assert load("bright-leetcode", jl).excluded == load("bright-leetcode", root).excluded
    sharded = make_bright(tmp_path / "sharded")
    docs = sharded / "documents" / f"biology{SHARD}"
    rows = [{"id": k, "content": v} for k, v in BIOLOGY_DOCS.items()]
    docs.unlink()
    write_parquet(sharded / "documents" / "biology-00000-of-00002.parquet", rows[:3])
    write_parquet(sharded / "documents" / "biology-00001-of-00002.parquet", rows[3:])
    assert load("bright-biology", sharded).doc_ids == load("bright-biology", root).doc_ids


def test_a_copy_of_the_whole_repo_or_a_parent_of_task_folders(tmp_path: Path, root: Path) -> None:
    parent = tmp_path / "parent"
    make_bright(parent / "bright-leetcode")
    assert load("bright-leetcode", parent).source.startswith(str((parent / "bright-leetcode").resolve()) + " (counts")
    # an R2MED-layout Biology/ beside it never stands in for BRIGHT's biology
    (parent / "Biology").mkdir()
    write_jsonl(parent / "Biology" / "query.jsonl", [{"id": "q", "text": "t"}])
    with pytest.raises(DataError, match="no data for task bright-biology"):
        load("bright-biology", parent)
    assert data.local_task_names(root) == ["bright-biology", "bright-leetcode"]


def test_a_folder_of_your_own_in_brights_layout(tmp_path: Path) -> None:
    own = tmp_path / "mine"
    write_jsonl(own / "examples" / "cooking.jsonl", [example_row(
        {"id": "c1", "query": "why does bread rise", "gold_ids": ["y"], "excluded_ids": ["x"]})])
    write_jsonl(own / "documents" / "cooking.jsonl", [{"id": "x", "content": "why does bread rise"},
                                                      {"id": "y", "content": "yeast makes gas"}])
    task = data.load_task("cooking", own)
    assert task.excluded == {"c1": ("x",)} and task.qrels == {"c1": {"y": 1}}
    assert data.local_task_names(own) == ["cooking"]


# --------------------------------------------------------------------------------------------------
# bad input: a clear error with file and row
# --------------------------------------------------------------------------------------------------


def _broken(root: Path, split: str, examples: list[dict], mutate, fmt: str = "parquet") -> Path:
    rows = [example_row(e) for e in examples]
    mutate(rows)
    for old in (root / "examples").glob(f"{split}[-.]*"):
        old.unlink()
    if fmt == "jsonl":  # a column of mixed types, which parquet cannot hold
        return write_jsonl(root / "examples" / f"{split}.jsonl", rows)
    return write_parquet(root / "examples" / f"{split}{SHARD}", rows)


def test_missing_excluded_ids_names_file_and_row(root: Path) -> None:
    def drop(rows: list[dict]) -> None:
        for r in rows:
            r.pop("excluded_ids")
    path = _broken(root, "leetcode", LEETCODE_EXAMPLES, drop)
    with pytest.raises(DataError, match=r"leetcode-00000-of-00001\.parquet:1: missing field 'excluded_ids'") as e:
        load("bright-leetcode", root)
    assert str(path) in str(e.value) and '["N/A"]' in str(e.value)


def test_an_excluded_id_that_is_also_gold_names_file_and_row(root: Path) -> None:
    def clash(rows: list[dict]) -> None:
        rows[2]["excluded_ids"] = ["N/A", rows[2]["gold_ids"][0]]
    _broken(root, "leetcode", LEETCODE_EXAMPLES, clash)
    with pytest.raises(DataError, match=r"parquet:3: excluded id 'leetcode/binary_search.txt' of query "
                                        r"'rotated_search' is also one of its gold ids"):
        load("bright-leetcode", root)


def test_a_long_split_without_gold_ids_long_names_file_and_row(root: Path) -> None:
    def drop(rows: list[dict]) -> None:
        rows[1].pop("gold_ids_long")
    _broken(root, "biology", BIOLOGY_EXAMPLES, drop)
    with pytest.raises(DataError, match=r"parquet:2: missing field 'gold_ids_long' \(a long-document task"):
        load("bright-biology-long", root)
    assert load("bright-biology", root).qrels  # the short setting does not read it


def test_other_malformed_rows(root: Path, tmp_path: Path) -> None:
    def bad_gold(rows: list[dict]) -> None:
        rows[0]["gold_ids"] = "leetcode/two_sum.txt"
    _broken(root, "leetcode", LEETCODE_EXAMPLES, bad_gold, "jsonl")
    with pytest.raises(DataError, match=r"leetcode\.jsonl:1: field 'gold_ids' must be a list of document ids"):
        load("bright-leetcode", root)

    def unknown_gold(rows: list[dict]) -> None:
        rows[0]["gold_ids"] = ["leetcode/nowhere.txt"]
    _broken(root, "leetcode", LEETCODE_EXAMPLES, unknown_gold)
    with pytest.raises(DataError, match=r"parquet:1: qrels name document 'leetcode/nowhere.txt'"):
        load("bright-leetcode", root)

    def twice(rows: list[dict]) -> None:
        rows[2]["id"] = rows[0]["id"]
    _broken(root, "leetcode", LEETCODE_EXAMPLES, twice)
    with pytest.raises(DataError, match=r"parquet:3: duplicate query id 'two_sum'"):
        load("bright-leetcode", root)
    (root / "long_documents" / f"biology{SHARD}").unlink()
    with pytest.raises(DataError, match=r"missing long_documents/biology\.parquet"):
        load("bright-biology-long", root)


def test_an_excluded_id_outside_the_corpus_is_a_warning(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    def elsewhere(rows: list[dict]) -> None:
        rows[0]["excluded_ids"] = ["leetcode/not_here.txt"]
    _broken(root, "leetcode", LEETCODE_EXAMPLES, elsewhere)
    with caplog.at_level(logging.WARNING):
        task = load("bright-leetcode", root)
    assert task.excluded["two_sum"] == ("leetcode/not_here.txt",)
    assert any("1 excluded ids are not in the corpus" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------------------------------
# the hub: real huggingface_hub downloads from a loopback server
# --------------------------------------------------------------------------------------------------


def test_real_download_of_one_split_then_offline_reuse(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    spec = data.get_task_spec("bright-leetcode")
    fake = FakeHub(spec.repo, spec.revision, {**hub_files(root), "README.md": b"card"})
    try:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        task = data.load_task("bright-leetcode")
    finally:
        fake.close()
    downloaded = {r.split("/resolve/")[1].partition("/")[2] for r in fake.requests if "/resolve/" in r}
    assert downloaded == {f"examples/leetcode{SHARD}", f"documents/leetcode{SHARD}"}  # the task's files only
    assert task.excluded["two_sum"] == ("leetcode/two_sum.txt",)
    assert task.source == f"hf://datasets/xlangai/BRIGHT@{spec.revision}#leetcode"
    snapshot = hub.hub_cache_dir() / "datasets--xlangai--BRIGHT" / "snapshots" / spec.revision
    assert (snapshot / "documents" / f"leetcode{SHARD}").is_file()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    again = data.load_task("bright-leetcode")  # the pinned commit from the cache, no hub
    assert again.fingerprint == task.fingerprint


def test_the_long_setting_downloads_long_documents(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    spec = data.get_task_spec("bright-biology-long")
    fake = FakeHub(spec.repo, spec.revision, hub_files(root))
    try:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        task = data.load_task("bright-biology-long")
    finally:
        fake.close()
    downloaded = {r.split("/resolve/")[1].partition("/")[2] for r in fake.requests if "/resolve/" in r}
    assert downloaded == {f"examples/biology{SHARD}", f"long_documents/biology{SHARD}"}
    assert "(long_documents)" in task.source and len(task.corpus) == 4


def test_unknown_group_words_still_fail() -> None:
    with pytest.raises(ConfigError, match="unknown task 'bright-nothing'"):
        data.task_names("bright-nothing")
    assert json.dumps(data.get_task_spec("bright-aops").split) == '"aops"'


def test_released_reasoning_queries_download_one_file(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    from r2med_agent.data.bright_released import load_reasoning_generations
    from tests.bright_fixture import GPT4_REASONING

    spec = data.get_task_spec("bright-leetcode")
    fake = FakeHub(spec.repo, spec.revision, hub_files(root))
    try:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        task = data.load_task("bright-leetcode")
        gens, source = load_reasoning_generations(task, "gpt4")
        with pytest.raises(DataError, match=r"has no grit_reason/leetcode-00000-of-00001\.parquet: no released "
                                            r"reasoning queries of grit for bright-leetcode"):
            load_reasoning_generations(task, "grit")
    finally:
        fake.close()
    assert [g.final for g in gens] == [GPT4_REASONING["leetcode"][q.query_id] for q in task.queries]
    assert source == f"hf://datasets/xlangai/BRIGHT@{spec.revision}/gpt4_reason/leetcode{SHARD}"
    downloaded = {r.split("/resolve/")[1].partition("/")[2] for r in fake.requests if "/resolve/" in r}
    assert f"gpt4_reason/leetcode{SHARD}" in downloaded and not any("biology" in d for d in downloaded)
    with pytest.raises(DataError, match="not a BRIGHT task"):
        load_reasoning_generations(data.load_task("sample"), "gpt4")
