"""BRIGHT's published numbers: its own tables (bright_results.csv), the R2MED frontier systems'
BRIGHT rows (bright_frontier_results.csv), the grids that run them, and compare --published with
both benchmarks on one row."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import pytest

from r2med_agent.grids.grid import load_grid
from r2med_agent.analysis.published import AVERAGE_TASKS, PublishedKey, PublishedResults, benchmark_of, published_results
from r2med_agent.analysis.results import load_results, r2med_tasks
from r2med_agent.analysis.tables import build_table
from r2med_agent.data import task_names
from r2med_agent.errors import DataError
from r2med_agent.paths import resources_dir
from tests.result_trees import GOOD, write_result

FILES = ("bright_results.csv", "bright_frontier_results.csv")


def rows(name: str) -> list[dict[str, str]]:
    with (resources_dir() / name).open(encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("name", FILES)
def test_every_row_names_its_source_and_how_it_was_checked(name: str) -> None:
    bright = set(task_names("bright-all")) | set(task_names("bright-long-all"))
    for r in rows(name):
        assert r["source"] and r["checked"] and r["system"], r
        assert r["task"] in bright or r["task"] in (AVERAGE_TASKS["bright"], AVERAGE_TASKS["bright-long"]), r
        assert 0 < float(r["ndcg_at_10"]) < 1, r
        assert r["kind"] == "frontier" if name == FILES[1] else r["kind"].startswith("bright"), r
        # a row that no command here runs says so (and why)
        runnable_retriever = r["retriever"] not in ("cohere", "voyage-large-2-instruct", "google", "google-gecko-004")
        if not runnable_retriever or r["kind"] == "bright-rerank":
            assert r["note"].startswith("no command here: "), r


@pytest.mark.parametrize("name", FILES)
def test_per_task_values_average_to_the_published_average(name: str) -> None:
    """A transcription check: where a source gives the 12 tasks, they average to the average
    printed beside them (3 decimals: up to 0.0006, DIVER's README truncating ReasonIR's 29.96)."""
    by_key: dict[tuple[str, ...], dict[str, float]] = defaultdict(dict)
    for r in rows(name):
        by_key[(r["method"], r["llm"], r["retriever"], r["reranker"])][r["task"]] = float(r["ndcg_at_10"])
    checked = 0
    for key, scores in by_key.items():
        tasks = [t for t in scores if t not in AVERAGE_TASKS.values()]
        assert "bright-average" in scores or "bright-long-average" in scores, key  # every row has its average
        if not tasks:
            continue
        assert sorted(tasks) == sorted(task_names("bright-all")), key
        mean = sum(scores[t] for t in tasks) / 12
        assert abs(mean - scores["bright-average"]) <= 0.0006 + 1e-9, (key, mean)
        checked += 1
    assert checked >= (18 if name == FILES[0] else 13)


def test_brights_own_tables_are_all_there() -> None:
    pub = published_results()
    original = [k for k in pub.keys("bright")]
    assert len(original) == 13
    assert all(len([t for t in pub.scores(k) if t.startswith("bright-")]) == 12 for k in original)
    assert pub.scores(PublishedKey("none", "", "bm25"))["bright-biology"] == pytest.approx(0.189)
    assert pub.scores(PublishedKey("none", "", "bm25"))["Biology"] == pytest.approx(0.19188)  # R2MED's, untouched
    reasoning = pub.keys("bright-reason")
    assert len(reasoning) == 65 and {k.llm for k in reasoning} == {"gpt4", "llama3-70b", "claude-3-opus", "grit",
                                                                   "Gemini-1.0"}
    gpt4_bm25 = PublishedKey("reason", "gpt4", "bm25")
    assert pub.average(gpt4_bm25, benchmark="bright") == pytest.approx(0.27)
    assert pub.scores(gpt4_bm25)["bright-biology"] == pytest.approx(0.536)
    assert len(pub.keys("bright-rerank")) == 10 and len(pub.keys("bright-long")) == 14
    assert pub.average(PublishedKey("none", "", "bright-qwen"), benchmark="bright-long") == pytest.approx(0.278)
    assert "2407.12883" in pub.info(PublishedKey("none", "", "bm25"), "bright").source
    assert "2505.14558" in pub.info(PublishedKey("none", "", "bm25"), "").source


def test_one_configuration_has_rows_on_two_benchmarks_but_not_twice_on_one(tmp_path: Path) -> None:
    head = "kind,method,llm,retriever,reranker,task,ndcg_at_10,source\n"
    (tmp_path / "a.csv").write_text(head + "retrieval,none,,bm25,,Biology,0.2,\n")
    (tmp_path / "b.csv").write_text(head + "bright,none,,bm25,,bright-biology,0.3,BRIGHT\n")
    pub = PublishedResults(tmp_path / "a.csv", tmp_path / "b.csv")
    key = PublishedKey("none", "", "bm25")
    assert pub.scores(key) == {"Biology": 0.2, "bright-biology": 0.3} and pub.benchmarks(key) == ["", "bright"]
    assert pub.info(key, "bright").source == "BRIGHT" and benchmark_of("bright-biology-long") == "bright-long"
    (tmp_path / "c.csv").write_text(head + "bright,none,,bm25,,bright-average,0.3,BRIGHT\n")
    with pytest.raises(DataError, match=r"c\.csv:2: .*on bright's tasks is also in b\.csv"):
        PublishedResults(tmp_path / "b.csv", tmp_path / "c.csv")


@pytest.mark.parametrize("table, n", [("bright", 60), ("bright-long", 10), ("bright-frontier", 13)])
def test_the_bright_grids_have_a_published_row_for_every_entry(table: str, n: int) -> None:
    grid = load_grid(table)
    pub = published_results()
    bench = benchmark_of(grid.tasks[0])
    assert len(grid.entries) == n and set(grid.tasks) == set(task_names("bright-long-all" if bench == "bright-long" else "bright-all"))
    for entry, scores, average in zip(grid.entries, grid.published, grid.averages):
        assert pub.kind(entry.published_key, bench) is not None, entry.label
        assert average is not None, entry.label  # every BRIGHT row has its source's average
        assert set(scores) <= set(grid.tasks)
        assert entry.args.get("top_k") == 1000  # BRIGHT keeps each query's top 1000
        if entry.method == "reason":
            assert entry.generations == "bright" and entry.generations_mode("fresh") == "bright"


def test_the_bright_grid_runs_every_runnable_row_of_brights_tables() -> None:
    pub = published_results()
    covered = {e.published_key for t in ("bright", "bright-long") for e in load_grid(t).entries}
    for kind in ("bright", "bright-reason", "bright-long"):
        for key in pub.keys(kind):
            bench = "bright-long" if kind == "bright-long" else "bright"
            if pub.info(key, bench).note.startswith("no command here"):
                assert key not in covered
            else:
                assert key in covered, key


def test_compare_published_shows_a_frontier_systems_bright_row_beside_its_r2med_row(tmp_path: Path) -> None:
    root = tmp_path / "results"
    tasks = [*r2med_tasks(), *task_names("bright-all")]
    for task in tasks:
        write_result(root, "none", "none", "reasonembed-qwen3-8b", task, GOOD)
    table = build_table(load_results([root]), "ndcg_at_10", published=True)
    (row,) = table.rows
    assert row.published["Biology"] == pytest.approx(0.5401)  # R2MED (ReasonEmbed's Table 3)
    assert row.published["bright-biology"] == pytest.approx(0.555)  # BRIGHT (ReasonEmbed's Table 2)
    assert len(row.published) == 20 and row.published_average is not None
    notes = table.footnotes()
    assert any("ReasonEmbed, Table 3" in n for n in notes)
    assert any("on BRIGHT" in n and "ReasonEmbed, Table 2" in n for n in notes)
    # over BRIGHT's tasks alone, the source's average
    root2 = tmp_path / "bright-only"
    for task in task_names("bright-all"):
        write_result(root2, "none", "none", "reasonembed-qwen3-8b", task, GOOD)
    (row,) = build_table(load_results([root2]), "ndcg_at_10", published=True).rows
    assert row.published_average == pytest.approx(sum(row.published.values()) / 12)


def test_an_average_only_bright_row_gets_its_average_over_the_twelve_tasks(tmp_path: Path) -> None:
    root = tmp_path / "results"
    for task in task_names("bright-all"):
        write_result(root, "none", "none", "bright-e5", task, GOOD)
    (row,) = build_table(load_results([root]), "ndcg_at_10", published=True).rows
    assert row.published["bright-pony"] == pytest.approx(0.049)
    root2 = tmp_path / "long"
    for task in task_names("bright-long-all"):
        write_result(root2, "none", "none", "bright-e5", task, GOOD)
    (row,) = build_table(load_results([root2]), "ndcg_at_10", published=True).rows
    assert row.published == {} and row.published_average == pytest.approx(0.255)


def test_dry_run_lists_every_row_of_brights_tables(tmp_path: Path) -> None:
    """reproduce --dry-run over the bright and bright-long grids names every configuration of
    bright_results.csv: a command for each row the project runs, the numbers, source and reason for
    each it does not."""
    from typer.testing import CliRunner

    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app

    _register()
    keys = {(r["kind"], r["method"], r["llm"], r["retriever"], r["reranker"]) for r in rows(FILES[0])}
    listed = 0
    for table, kinds in (("bright", ("bright", "bright-reason", "bright-rerank")), ("bright-long", ("bright-long",))):
        res = CliRunner().invoke(app, ["reproduce", "--table", table, "--dry-run", "--output-dir", str(tmp_path)],
                                 env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.output
        commands = sum(1 for line in res.output.splitlines() if line.startswith("[") and not line.startswith("[-]"))
        without = [line for line in res.output.splitlines() if line.startswith("[-]")]
        assert commands + len(without) == sum(1 for k in keys if k[0] in kinds)
        assert all("no command here" in line for line in without)
        listed += commands + len(without)
    assert listed == len(keys) == 13 + 65 + 10 + 14


def test_the_bright_dry_run_totals_its_encoding_gpu_hours_and_api_dollars(tmp_path: Path) -> None:
    """Issue 39 item 17: ``reproduce --table bright --dry-run`` gave no cost totals. Each row with a
    dense encoder now says its documents, queries and tokens (every text at the encoder's limit:
    e5-mistral and SFR at 4,096), its GPU-hours (a local model of known size) or dollars (an API at
    its list price); the total counts each encoder's corpus once (the embedding cache shares it
    between the rows), every row's queries, and adds the hours and dollars up. The reranking rows'
    notes each name only what applies to them."""
    from typer.testing import CliRunner

    from r2med_agent.grids.estimates import ENCODER_TOKENS_PER_S, format_hours
    from r2med_agent.grids.needs import load_models
    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app
    from r2med_agent.data import task_registry

    _register()
    res = CliRunner().invoke(app, ["reproduce", "--table", "bright", "--dry-run", "--output-dir", str(tmp_path)],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    out = res.output.splitlines()
    registry = task_registry()
    tasks = task_names("bright-all")
    docs = sum(registry[t].docs for t in tasks)
    queries = sum(registry[t].queries for t in tasks)
    assert 1_300_000 < docs < 1_400_000
    models = load_models()

    def hours(tokens: int, name: str) -> float:
        return tokens * models[name].params_b / ENCODER_TOKENS_PER_S / 3600

    e5 = docs * 4096
    e5_line = next(line for line in out if line.strip().startswith("encoding: bright-e5:"))
    assert f"{docs:,} documents and {queries:,} queries" in e5_line and "each document at 4,096" in e5_line
    assert f"≤{format_hours(hours(e5 + queries * 4096, 'bright-e5'))} GPU-hours" in e5_line
    assert any(line.strip().startswith("encoding: bright-sf:") and "each document at 4,096" in line for line in out)
    openai = next(line for line in out if line.strip().startswith("encoding: openai:"))
    assert f"≤${(docs + queries) * 6000 * 0.13 / 1e6:,.0f}" in openai and "cost unknown" not in openai

    total = next(line for line in out if line.startswith("total of the"))
    encoders = ("bright-bge", "bright-inst-l", "bright-sbert", "bright-e5", "bright-sf", "bright-inst-xl",
                "bright-grit", "bright-qwen")
    from r2med_agent.retrieval.dense.spec import encoder_registry

    specs = {name: encoder_registry()[name].on_bright() for name in encoders}
    rows_per_encoder = 6  # the original queries and five LLMs' reasoning queries
    want_hours = sum(hours(docs * s.max_length_for("doc") + rows_per_encoder * queries * s.max_length_for("query"), n)
                     for n, s in specs.items())
    want_usd = (docs + rows_per_encoder * queries) * 6000 * 0.13 / 1e6
    assert f"≤{format_hours(want_hours)} GPU-hours" in total, total
    assert f"≤${want_usd:,.0f}" in total, total
    assert "no price for" not in total

    notes = [line for line in out if line.strip().startswith("note:") and "no command here" in line]
    minilm = [line for line in notes if "MiniLM checkpoint" in line]
    llms = [line for line in notes if "rerank.py prompt for Gemini and GPT-4" in line]
    assert len(minilm) == 4 and len(llms) == 6
    assert not any("MiniLM" in line and "GPT-4" in line for line in notes)
