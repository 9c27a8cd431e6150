"""The published frontier: the packaged frontier CSV, the `frontier` grid, its candidates entries,
and the published columns of compare for a frontier row."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import pytest

from r2med_agent.grids.grid import load_grid
from r2med_agent.grids.planner import ReproduceOptions, format_plan, plan
from r2med_agent.analysis.published import AVERAGE_TASK, PublishedKey, PublishedResults, published_results
from r2med_agent.analysis.results import load_results, r2med_tasks
from r2med_agent.analysis.tables import build_table
from r2med_agent.errors import ConfigError, DataError
from r2med_agent.experiment.command import cli_args
from r2med_agent.experiment.resolve import resolve_spec
from r2med_agent.experiment.spec import RunSpec
from r2med_agent.paths import resources_dir
from tests.result_trees import GOOD, write_result

FRONTIER_CSV = resources_dir() / "frontier_results.csv"


def frontier_rows() -> list[dict[str, str]]:
    with FRONTIER_CSV.open(encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def test_every_frontier_row_names_its_source_and_how_it_was_checked():
    rows = frontier_rows()
    assert rows
    for r in rows:
        assert r["kind"] == "frontier" and r["source"] and r["checked"] and r["system"], r
        assert r["task"] in (*r2med_tasks(), AVERAGE_TASK), r
        assert 0 < float(r["ndcg_at_10"]) < 1


def test_per_task_frontier_scores_average_to_the_published_average():
    """A transcription check: where a source gives the 8 tasks and an average, they agree to
    the source's rounding (averages given to 0.1 point round by up to 0.0005; RaDeR's table is off by 0.0003, which its row says)."""
    by_key: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for r in frontier_rows():
        by_key[(r["retriever"], r["reranker"])][r["task"]] = float(r["ndcg_at_10"])
    checked = 0
    for key, scores in by_key.items():
        tasks = [t for t in scores if t != AVERAGE_TASK]
        if not tasks:
            continue
        assert sorted(tasks) == sorted(r2med_tasks()), key
        mean = sum(scores[t] for t in tasks) / 8
        assert abs(mean - scores[AVERAGE_TASK]) <= 0.0005 + 1e-9, (key, mean, scores[AVERAGE_TASK])
        checked += 1
    assert checked >= 12


def test_published_results_read_both_files_with_averages_and_sources():
    pub = published_results()
    grouprank = PublishedKey("none", "", "diver-4b", "grouprank-32b")
    assert pub.average(grouprank) == pytest.approx(0.523)
    assert pub.scores(grouprank)["Biology"] == pytest.approx(0.595)
    assert "GroupRank" in pub.info(grouprank).source
    insertrank = PublishedKey("none", "", "bm25", "insertrank-r1")
    assert pub.scores(insertrank) == {} and pub.average(insertrank) == pytest.approx(0.511)
    paper_bm25 = PublishedKey("none", "", "bm25", "")
    assert pub.average(paper_bm25) is None and "2505.14558" in pub.info(paper_bm25).source
    assert "32.23" in pub.info(PublishedKey("none", "", "diver-4b", "")).note


def test_a_configuration_in_two_published_files_is_refused(tmp_path: Path):
    head = "kind,method,llm,retriever,reranker,task,ndcg_at_10\n"
    (tmp_path / "a.csv").write_text(head + "retrieval,none,,bm25,,Biology,0.2\n")
    (tmp_path / "b.csv").write_text(head + "frontier,none,,bm25,,average,0.3\n")
    with pytest.raises(DataError, match=r"b\.csv:2: .*also in a\.csv"):
        PublishedResults(tmp_path / "a.csv", tmp_path / "b.csv")


def test_the_frontier_grid_loads_with_every_entry_published():
    grid = load_grid("frontier")
    assert len(grid.entries) >= 15
    for entry, scores, average in zip(grid.entries, grid.published, grid.averages):
        assert scores or average is not None, entry.label
    labels = {e.label for e in grid.entries}
    for needed in ("none/none/reasonembed-qwen3-8b", "none/none/diver-4b/grouprank-32b",
                   "none/none/candidates/reasonrank-32b", "none/none/diver-4b/qwen3-32b-groupwise-think"):
        assert needed in labels


def test_a_grid_taking_published_scores_refuses_its_own(tmp_path: Path):
    f = tmp_path / "g.yaml"
    f.write_text("title: t\nscores: published\nentries:\n"
                 "  - {method: none, retriever: bm25, ndcg_at_10: {Biology: 0.1}}\n")
    with pytest.raises(ConfigError, match="remove ndcg_at_10"):
        load_grid(f)


def _reasonrank_shaped_runs(root: Path, tasks: tuple[str, ...]) -> Path:
    for t in tasks:
        d = root / f"r2med_{t}"
        d.mkdir(parents=True)
        (d / "e5-mistral-7b-instruct_top100.txt").write_text("q1 Q0 d1 1 0.9 e5\nq1 Q0 d2 2 0.8 e5\n")
    return root


def test_the_candidates_entry_names_its_files_and_refuses_others(tmp_path: Path):
    grid = load_grid("frontier")
    entry = next(e for e in grid.entries if e.candidates and e.reranker == "reasonrank-32b")
    opts = ReproduceOptions(output_dir=tmp_path / "results")
    listing = format_plan([p for p in plan(grid, opts) if p.entry == entry])
    # The folder the clone gives, a command one can run (issue 30 item 9: not a literal <run files>).
    assert "--candidates ReasonRank/runs" in listing and "8421BCD/ReasonRank" in listing
    assert "<run files>" not in listing
    assert "published as: ReasonRank-32B" in listing and "published nDCG@10 avg 0.4285" in listing
    other = _reasonrank_shaped_runs(tmp_path / "runs", r2med_tasks())
    with pytest.raises(ConfigError, match="not the ones the published row reranked"):
        entry.run_config(r2med_tasks(), tmp_path / "results", candidates_path=other)


def test_cli_args_of_a_candidates_run_name_the_files():
    spec = resolve_spec(RunSpec(retriever="candidates", candidates="cfd8477aeab57f44", reranker="bge-reranker"))
    assert cli_args(spec, "ReasonRank/runs")[:4] == ["--method", "none", "--candidates", "ReasonRank/runs"]
    with pytest.raises(ConfigError, match="files' path"):
        cli_args(spec)


def test_compare_published_gives_a_frontier_row_its_average_and_source(tmp_path: Path):
    root = tmp_path / "results"
    for task in r2med_tasks():
        write_result(root, "none", "none", "reasonembed-qwen3-8b", task, GOOD)
    table = build_table(load_results([root]), "ndcg_at_10", published=True)
    (row,) = table.rows
    assert row.published["Biology"] == pytest.approx(0.5401)
    assert row.published_average == pytest.approx(0.4318)
    assert any("ReasonEmbed-Qwen3-8B" in n and "ReasonEmbed, Table 3" in n for n in table.footnotes())


def test_an_average_only_row_gets_the_published_average_over_the_eight_tasks(tmp_path: Path):
    """InsertRank's source gives its average alone (no per-task table could be read)."""
    root = tmp_path / "results"
    for task in r2med_tasks():
        write_result(root, "none", "none", "bm25", task, GOOD, reranker="insertrank-r1")
    (row,) = build_table(load_results([root]), "ndcg_at_10", published=True).rows
    assert row.published == {} and row.published_average == pytest.approx(0.511)
    root2 = tmp_path / "partial"
    write_result(root2, "none", "none", "bm25", "Biology", GOOD, reranker="insertrank-r1")
    (row,) = build_table(load_results([root2]), "ndcg_at_10", published=True).rows
    assert row.published_average is None


def test_rows_the_sources_print_per_task_carry_all_eight_tasks():
    """Every frontier configuration but InsertRank's has its eight per-task values (both papers'
    tables were read in full), e.g. Qwen3-32B groupwise without thinking over DIVER's top 100."""
    pub = published_results()
    r2med = set(r2med_tasks())  # their BRIGHT rows (bright_frontier_results.csv) are checked apart
    partial = [k for k in pub.keys("frontier")
               if pub.kind(k) == "frontier" and set(pub.scores(k)) & r2med != r2med]
    assert [k.reranker for k in partial] == ["insertrank-r1"]
    nothink = pub.scores(PublishedKey("none", "", "diver-4b", "qwen3-32b-groupwise"))
    assert nothink["Biology"] == pytest.approx(0.538) and nothink["IIYi-Clinical"] == pytest.approx(0.331)


def test_dry_run_counts_each_reranker_kinds_calls_and_gpu_hours():
    """The calls of the frontier rerankers as their algorithms make them (876 R2MED queries, top
    100): GroupRank 5 groups x 6 passes, ReasonRank 9 windows, Rank1 100 pairs, Rank-R1's heap
    sort about 25 comparisons of 20; GPU-hours from the stated throughput assumption."""
    from r2med_agent.grids.estimates import GPU_TOKENS_PER_S, gpu_hours, token_estimate
    from r2med_agent.grids.needs import load_models

    models = load_models()
    grid = load_grid("frontier")
    lines = {e.reranker: [t.line() for t in token_estimate(e, 876, e.run_config(("Biology",), Path("results")).plan, models)]
             for e in grid.entries if e.reranker}
    assert "5 groups of 20 x 6 passes per query): 26,280 calls" in lines["grouprank-32b"][0]
    assert "9 windows of 20 per query): 7,884 calls" in lines["reasonrank-32b"][0]
    assert "100 pairs per query + forced ends): 87,600 calls" in lines["rank1-32b"][0]
    assert "≈25 comparisons of 20 per query): 21,900 calls" in lines["rank-r1-14b"][0]
    assert "GPU-hours" in lines["grouprank-32b"][0] and "GPU-hours" not in lines["insertrank-r1"][0]  # an API
    # 32.8B: 1M prompt tokens at 800,000/32.8 per second plus 1M output tokens at 80,000/32.8.
    expected = (1e6 * 32.8 / GPU_TOKENS_PER_S["prompt"] + 1e6 * 32.8 / GPU_TOKENS_PER_S["output"]) / 3600
    assert gpu_hours(32.8, 1_000_000, 1_000_000) == pytest.approx(expected)


def test_dry_run_sizes_an_fp8_checkpoint_by_its_dtype_and_shows_the_models_note():
    """DeepSeek-V3.1 ships FP8 weights: one byte per parameter, not bf16's two; models.yaml's
    note is shown beside the estimate."""
    listing = format_plan(plan(load_grid("frontier"), ReproduceOptions()))
    line = next(x for x in listing.splitlines() if "reranker LLM deepseek-v3.1 ≈" in x)
    assert "deepseek-v3.1 ≈624.9 GiB fp8 weights (does not fit one 80 GiB GPU)" in line
    assert "[a mixture of experts (37B active);" in line


def test_dry_run_shows_divers_own_first_stage_wherever_a_row_reranks_diver():
    """Every row over DIVER-Retriever-4B runs DIVER's own retrieval as its code stood when the
    published numbers were made (raw queries, its document prompt, 16,384 tokens cut by decoding,
    top 100, no expansion or BM25 fusion) and says so with its source; DIVER's later code
    (instructed queries) is its own row beside the same 42.9, with its own source; ReasonEmbed's
    setting of the same model is its own row, beside its own 32.23."""
    grid = load_grid("frontier")
    planned = plan(grid, ReproduceOptions())
    blocks: dict[str, str] = {}
    for p in planned:
        blocks[p.entry.label] = format_plan([p])
    over_diver = [label for label in blocks if label.startswith("none/none/diver-4b/")]
    assert len(over_diver) == 8  # GroupRank-32B, 3 zero-shot groupwise, ReasonRank 32B/7B, Rank-R1, DeepSeek
    divers = ('first stage: diver-4b (AQ-MedAI/Diver-Retriever-4B): query "{query}"; document '
              '"Represent this text:{document}"; 16384 tokens, cut by decoding the first tokens back to text; '
              'last-token pooling, L2-normalised; original queries, no expansion; no fusion')
    source = "settings from AQ-MedAI/Diver@d067dff107fc Retriever/retrievers.py, Qwen3EmbeddingModel"
    for label in over_diver:
        text = blocks[label]
        assert divers in text, text
        assert "its top 100 reranked by " + label.rsplit("/", 1)[1] in text
        assert source in text
    (alone,) = [p for p in planned if p.entry.label == "none/none/diver-4b"]
    assert alone.published_average == pytest.approx(0.429) and "retrieval: diver-4b (" in blocks[alone.entry.label]
    assert source in blocks[alone.entry.label]
    (instructed,) = [p for p in planned if p.entry.label == "none/none/diver-4b-instructed"]
    assert instructed.published_average == pytest.approx(0.429)
    text = blocks[instructed.entry.label]
    assert ('retrieval: diver-4b-instructed (AQ-MedAI/Diver-Retriever-4B): query "Instruct: Given a web search '
            'query, retrieve relevant passages that answer the query\\nQuery:{query}" for every task; document '
            '"Represent this text:{document}"; 16384 tokens') in text
    assert "settings from AQ-MedAI/Diver@95b111b0adad Retriever/retrievers.py, Qwen3EmbeddingModel" in text
    assert "95b111b (2026-01-21), after 42.9 was published" in text
    (variant,) = [p for p in planned if p.entry.label == "none/none/diver-4b-reasonembed"]
    assert variant.published_average == pytest.approx(0.3223)
    text = blocks[variant.entry.label]
    assert 'query "Instruct: {instruction}\\nQuery: {query}" with the task\'s instruction; document "{document}"; 512 tokens' in text
    assert "eval_diver_retriever_4b.sh" in text


def test_each_reranker_row_states_how_it_compares_with_its_authors_run(tmp_path: Path):
    """Every reranker row of the frontier grid has its status (docs/protocol.md, "Rerankers as
    their authors ran them"): the dry run prints it, and the results table gives it a footnote."""
    from r2med_agent.grids.planner import results_table

    grid = load_grid("frontier")
    assert all(e.differences is not None for e in grid.entries if e.reranker)
    listing = format_plan(plan(grid, ReproduceOptions(output_dir=tmp_path / "results")))
    blocks = listing.split("\n[")
    for e in grid.entries:
        block = next(b for b in blocks if b.split("  (")[0].split("] ", 1)[-1] == e.label
                     and (not e.candidates) == ("--candidates" not in b))
        assert (f"    status: {e.status}" in block) == (e.differences is not None), e.label
    from r2med_agent.grids.grid import GridEntry

    assert GridEntry(method="none", retriever="bm25", differences=()).status == "as the authors ran it"
    insert = next(e for e in grid.entries if e.reranker == "insertrank-r1")
    assert insert.status.startswith("differs from the authors' run: no code of the authors is public")
    root = tmp_path / "results"
    for task in r2med_tasks():
        write_result(root, "none", "none", "bm25", task, GOOD, reranker="insertrank-r1")
    table = results_table(grid, ReproduceOptions(output_dir=root))
    assert f"row 0 (none/none/bm25/insertrank-r1): {insert.status}" in table.footnotes()
