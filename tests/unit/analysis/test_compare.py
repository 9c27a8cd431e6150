"""compare: result trees -> rows -> table; values, published column, baseline marks, outputs, CLI."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from r2med_agent.analysis.render import render_csv, render_markdown
from r2med_agent.analysis.results import r2med_tasks, split_leaf
from r2med_agent.analysis.tables import BETTER_MARK, MISSING, PARTIAL_MARK, WORSE_MARK
from r2med_agent.api import PublishedKey, build_table, load_results, render
from r2med_agent.errors import ConfigError, DataError
from r2med_agent.paths import resources_dir
from tests.result_trees import GOOD, MIXED, WEAK, ranking, read_json, write_result



@pytest.fixture()
def cli():
    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app

    _register()
    return app


def published_csv_rows() -> list[dict[str, str]]:
    with (resources_dir() / "published_results.csv").open(encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture()
def two_trees(tmp_path: Path) -> tuple[Path, Path]:
    """Tree A: BM25 (Biology, sample) and HyDE (Biology only); tree B: a dense row on both tasks."""
    a, b = tmp_path / "runA", tmp_path / "runB"
    for task in ("sample", "Biology"):
        write_result(a, "none", "none", "bm25", task, MIXED)
        write_result(b, "none", "none", "minilm", task, GOOD)
    write_result(
        a, "hyde", "smollm2", "bm25", "Biology", WEAK,
        stats={"generations": 4, "cache_hits": 1, "prompt_tokens": 400, "completion_tokens": 120,
               "llm_time_s": 2.5, "retrieval_time_s": 0.25, "cost_usd": None},
    )
    (a / "none" / "none" / "bm25" / "summary.json").write_text(json.dumps({"average": {}}))
    return a, b


def test_split_leaf_keeps_the_fuse_variant_on_the_retriever():
    assert split_leaf("bm25") == ("bm25", "")
    assert split_leaf("nv__monobert") == ("nv", "monobert")
    assert split_leaf("bm25__fuse") == ("bm25__fuse", "")
    assert split_leaf("nv__fuse__rankllama") == ("nv__fuse", "rankllama")
    assert split_leaf("bm25__k10") == ("bm25__k10", "")  # a run at depth 10 (--top-k 10)
    assert split_leaf("bm25__fuse__k1000__bge-reranker") == ("bm25__fuse__k1000", "bge-reranker")


def test_rows_and_table_values_equal_the_result_files(two_trees):
    a, b = two_trees
    rows = load_results([a, b])
    assert [r.label for r in rows] == ["none/none/bm25", "hyde/smollm2/bm25", "none/none/minilm"]
    assert [r.source for r in rows] == [str(a), str(a), str(b)]
    table = build_table(rows, "ndcg_at_10")
    # R2MED tasks first, in the order of docs/protocol.md, then the others.
    assert table.tasks == ("Biology", "sample")
    assert table.show_source
    for tr in table.rows:
        for task in table.tasks:
            path = tr.row.directory / f"{task}.json"
            if path.exists():
                assert tr.values[task] == read_json(path)["test"]["ndcg_at_10"]
            else:
                assert tr.values[task] is None
    bm25 = table.rows[0]
    assert bm25.average == pytest.approx(
        (bm25.values["Biology"] + bm25.values["sample"]) / 2, abs=0
    )
    # The CSV carries full precision: parse it back and compare exactly with the files.
    parsed = list(csv.DictReader(io.StringIO(render_csv(table))))
    assert len(parsed) == 3
    for rec, tr in zip(parsed, table.rows):
        assert rec["method"] == tr.row.method and rec["retriever"] == tr.row.retriever
        for task in table.tasks:
            path = tr.row.directory / f"{task}.json"
            expected = read_json(path)["test"]["ndcg_at_10"] if path.exists() else None
            assert (float(rec[task]) if rec[task] else None) == expected


def test_partial_average_is_flagged_never_silent(two_trees):
    a, b = two_trees
    table = build_table(load_results([a, b]))
    hyde = table.rows[1]
    assert hyde.missing_tasks == ("sample",)
    assert hyde.average == hyde.values["Biology"]
    md = render_markdown(table)
    assert f"{hyde.average:.4f}{PARTIAL_MARK}" in md
    assert "row 1 (hyde/smollm2/bm25): average over 1 of 2 tasks; missing: sample" in md
    rec = list(csv.DictReader(io.StringIO(render_csv(table))))[1]
    assert rec["avg_tasks"] == "1" and rec["avg_missing"] == "sample"
    # Complete rows carry no flag.
    assert f"{table.rows[0].average:.4f}{PARTIAL_MARK}" not in md


def test_metric_and_task_selection(two_trees):
    a, _ = two_trees
    rows = load_results([a])
    table = build_table(rows, "recall_at_100", tasks=["sample"])
    assert table.tasks == ("sample",)
    assert table.rows[0].values["sample"] == read_json(a / "none/none/bm25/sample.json")["test"]["recall_at_100"]
    with pytest.raises(ConfigError, match="no result file has metric 'ndcg_at_7'"):
        build_table(rows, "ndcg_at_7")
    with pytest.raises(ConfigError, match="no results for task"):
        build_table(rows, tasks=["MedQA-Diag"])


def test_published_column_equals_the_csv(tmp_path):
    root = tmp_path / "results"
    tasks = r2med_tasks()
    for task in tasks:
        write_result(root, "none", "none", "bm25", task, GOOD)
        write_result(root, "none", "none", "nv", task, MIXED, reranker="monobert")
    write_result(root, "hyde", "qwen-7b", "bge", "Biology", WEAK)
    write_result(root, "hyde", "smollm2", "bm25", "Biology", WEAK)  # not a published configuration
    table = build_table(load_results([root]), published=True)
    by_label = {tr.row.label: tr for tr in table.rows}
    csv_rows = published_csv_rows()

    def paper(kind, method, llm, retriever, reranker, task):
        hits = [r for r in csv_rows if (r["kind"], r["method"], r["llm"], r["retriever"], r["reranker"], r["task"])
                == (kind, method, llm, retriever, reranker, task)]
        assert len(hits) == 1
        return float(hits[0]["ndcg_at_10"])

    bm25 = by_label["none/none/bm25"]
    assert bm25.published == {t: paper("retrieval", "none", "", "bm25", "", t) for t in tasks}
    assert bm25.published_average == pytest.approx(sum(bm25.published.values()) / 8)
    rerank = by_label["none/none/nv/monobert"]
    assert rerank.published == {t: paper("rerank", "none", "", "nv", "monobert", t) for t in tasks}
    hyde = by_label["hyde/qwen-7b/bge"]
    # The paper's numbers show for every column, also where we lack the task ...
    assert hyde.published == {t: paper("gar", "hyde", "qwen-7b", "bge", "", t) for t in tasks}
    assert hyde.values["MedQA-Diag"] is None
    # ... but its average covers exactly our tasks (here Biology only), like ours.
    assert hyde.average == hyde.values["Biology"]
    assert hyde.published_average == hyde.published["Biology"]
    assert by_label["hyde/smollm2/bm25"].published == {}

    parsed = {f"{r['method']}/{r['llm']}/{r['retriever']}": r for r in csv.DictReader(io.StringIO(render_csv(table)))}
    rec = parsed["none/none/bm25"]
    for t in tasks:
        assert float(rec[f"{t}_published"]) == paper("retrieval", "none", "", "bm25", "", t)
        assert float(rec[f"{t}_diff"]) == pytest.approx(bm25.values[t] - bm25.published[t])
    assert parsed["hyde/smollm2/bm25"]["Biology_published"] == ""
    md = render_markdown(table)
    smollm = next(line for line in md.splitlines() if "| smollm2 |" in line)
    assert MISSING in smollm
    assert f"{bm25.published['Biology']:.4f}" in md


def test_bm25_compat_rows_get_the_papers_bm25_scores(tmp_path):
    # bm25-compat is the reference's BM25 (gensim LuceneBM25Model), the one behind the paper's
    # BM25 numbers; the mapping holds without the grids' aliases too.
    root = tmp_path / "results"
    for task in r2med_tasks():
        write_result(root, "none", "none", "bm25-compat", task, GOOD)
    write_result(root, "hyde", "qwen-7b", "bm25-compat", "Biology", WEAK)
    rows = load_results([root])
    bm25 = {r["task"]: float(r["ndcg_at_10"]) for r in published_csv_rows()
            if (r["method"], r["llm"], r["retriever"], r["reranker"]) == ("none", "", "bm25", "")}
    hyde = {r["task"]: float(r["ndcg_at_10"]) for r in published_csv_rows()
            if (r["method"], r["llm"], r["retriever"], r["reranker"]) == ("hyde", "qwen-7b", "bm25", "")}
    for aliases in (None, {}):
        table = build_table(rows, published=True, published_aliases=aliases)
        by_label = {tr.row.label: tr for tr in table.rows}
        assert by_label["none/none/bm25-compat"].published == bm25
        assert by_label["hyde/qwen-7b/bm25-compat"].published == hyde


def test_published_scores_load_all_592_rows():
    from r2med_agent.analysis.published import PublishedResults
    from r2med_agent.paths import resources_dir

    # R2MED's two files (BRIGHT's own, bright_*.csv, are counted in tests/unit/analysis/test_bright_published.py)
    pub = PublishedResults(resources_dir() / "published_results.csv", resources_dir() / "frontier_results.csv")
    paper = [k for k in pub.keys() if pub.kinds[k] != "frontier"]
    assert len(paper) == 74 and len(pub.keys("frontier")) == 26
    assert len(pub.keys("retrieval")) == 15 and len(pub.keys("rerank")) == 3
    assert sum(len(pub.scores(k)) for k in paper) == 568 + 24
    # The NanoR2MED card's three profiles, 8 splits each.
    assert [k.retriever for k in pub.keys("nano")] == ["nano-bm25", "harrier", "nano-hybrid"]
    assert pub.scores(PublishedKey("none", "", "nano-hybrid"))["nano-MedQA-Diag"] == 0.1406
    assert pub.scores(PublishedKey("none", "", "harrier"), "recall_at_100")["nano-Biology"] == 0.8369
    assert pub.scores(PublishedKey("none", "", "bm25"))["Biology"] == 0.19188
    # MRR is blank for most rows: those tasks are left out, not read as 0.
    assert pub.scores(PublishedKey("none", "", "bge"), "mrr") == {}


def test_baseline_marks_significant_rows(tmp_path):
    root = tmp_path / "results"
    qids = [f"q{i}" for i in range(20)]
    qrels = {q: {f"{q}-rel": 1} for q in qids}
    good = {q: ranking(f"{q}-rel", "x1", "x2") for q in qids}  # relevant at rank 1 everywhere
    bad = {q: ranking("x1", "x2", "x3", f"{q}-rel") for q in qids}  # relevant at rank 4
    write_result(root, "none", "none", "bm25", "sample", bad, qrels)
    write_result(root, "none", "none", "bm25-compat", "sample", bad, qrels)
    write_result(root, "hyde", "smollm2", "bm25", "sample", good, qrels)
    rows = load_results([root])
    table = build_table(rows, baseline="none/none/bm25", seed=1)
    labels = [r.row.label for r in table.rows]
    base = labels.index("none/none/bm25")
    assert table.baseline == base and table.rows[base].tests == {}
    hyde = table.rows[labels.index("hyde/smollm2/bm25")]
    same = table.rows[labels.index("none/none/bm25-compat")]
    t = hyde.tests["all"]
    assert (t.wins, t.ties, t.losses) == (20, 0, 0)
    assert not t.exact and t.p_value == pytest.approx(1 / 10_001)
    assert table.marker(hyde, "sample") == BETTER_MARK
    assert table.marker(same, "all") == ""
    assert same.tests["all"].p_value == 1.0
    md = render_markdown(table)
    assert f"{hyde.values['sample']:.4f}{BETTER_MARK}" in md
    assert "| 20/0/0 |" in md and "| 0/20/0 |" in md
    assert f"| {base} (base) |" in md
    # Swapping the roles turns the marker around.
    table2 = build_table(rows, baseline=labels.index("hyde/smollm2/bm25"))
    assert table2.marker(table2.rows[base], "all") == WORSE_MARK
    # --alpha below the attainable p-value removes the marks.
    assert build_table(rows, baseline=base, alpha=1e-5).marker(hyde, "all") == ""
    with pytest.raises(ConfigError, match="matches no row"):
        build_table(rows, baseline="hyde/qwen-7b/bm25")
    with pytest.raises(ConfigError, match="only 3 rows"):
        build_table(rows, baseline="7")


def write_scores(root: Path, label: str, task: str, scores: dict[str, float]) -> None:
    """A result file holding given per-query nDCG@10 scores (the runner's keys that compare reads)."""
    leaf = root / label
    leaf.mkdir(parents=True, exist_ok=True)
    rec = {
        "dataset_name": task,
        "test": {"ndcg_at_10": sum(scores.values()) / len(scores)},
        "num_queries": len(scores),
        "per_query": {q: {"ndcg_at_10": v} for q, v in scores.items()},
    }
    (leaf / f"{task}.json").write_text(json.dumps(rec), encoding="utf-8")


def test_avg_marker_follows_the_task_average_with_unequal_task_sizes(tmp_path):
    # Biology, 6 queries, 0.1 -> 0.9; MedQA-Diag, 200 queries, 0.5 -> 0.45: the average goes from
    # 0.300 to 0.675. A test pooling the 206 queries calls the second row significantly worse;
    # the stratified test of the average calls it better (p = 2/64, see test_stats).
    root = tmp_path / "r"
    for label, bio, medqa in (("none/none/bm25", 0.1, 0.5), ("hyde/qwen-7b/bm25", 0.9, 0.45)):
        write_scores(root, label, "Biology", {f"b{i}": bio for i in range(6)})
        write_scores(root, label, "MedQA-Diag", {f"m{i}": medqa for i in range(200)})
    table = build_table(load_results([root]), baseline="none/none/bm25")
    base, hyde = table.rows
    assert base.average == pytest.approx(0.3) and hyde.average == pytest.approx(0.675)
    assert table.marker(hyde, "all") == BETTER_MARK
    assert table.marker(hyde, "Biology") == BETTER_MARK
    assert table.marker(hyde, "MedQA-Diag") == WORSE_MARK
    assert hyde.tests["all"].mean_diff == pytest.approx(hyde.average - base.average)
    assert f"{hyde.average:.4f}{BETTER_MARK}" in render_markdown(table)


def test_per_task_tests_reach_csv_and_markdown(tmp_path):
    root = tmp_path / "r"
    for task in ("Biology", "sample"):
        write_result(root, "none", "none", "bm25", task, MIXED)
        write_result(root, "hyde", "qwen-7b", "bm25", task, GOOD if task == "Biology" else WEAK)
    rows = load_results([root])
    for test in ("permutation", "bootstrap"):
        table = build_table(rows, baseline=0, test=test, n_resamples=2000, seed=3)
        hyde = table.rows[1]
        rec = list(csv.DictReader(io.StringIO(render_csv(table))))[1]
        for task in ("Biology", "sample"):
            t = hyde.tests[task]
            assert (rec[f"{task}_wins"], rec[f"{task}_ties"], rec[f"{task}_losses"]) == (
                str(t.wins), str(t.ties), str(t.losses))
            assert float(rec[f"{task}_p"]) == t.p_value
        overall = hyde.tests["all"]
        assert float(rec["avg_p"]) == overall.p_value and rec["wins"] == str(overall.wins)
        assert overall.wins == hyde.tests["Biology"].wins + hyde.tests["sample"].wins
        md = render_markdown(table)
        assert "Against the baseline, row 0 (none/none/bm25):" in md
        assert "| # | configuration | Biology | sample | Avg |" in md
        line = next(x for x in md.splitlines() if x.startswith("| 1 | hyde/qwen-7b/bm25 | Δ"))
        bio = hyde.tests["Biology"]
        if test == "bootstrap":
            for task in ("Biology", "sample", "avg"):
                t = hyde.tests["all" if task == "avg" else task]
                assert float(rec[f"{task}_ci_low"]) == t.ci_low and float(rec[f"{task}_ci_high"]) == t.ci_high
                assert t.ci_low <= t.mean_diff <= t.ci_high
            assert f"Δ {bio.mean_diff:+.4f} [{bio.ci_low:+.4f}, {bio.ci_high:+.4f}]" in line
        else:
            assert "Biology_ci_low" not in rec
            assert f"Δ {bio.mean_diff:+.4f}, p " in line
        assert f"W/T/L {bio.wins}/{bio.ties}/{bio.losses}" in line


def test_significance_needs_per_query_scores(tmp_path):
    root = tmp_path / "r"
    write_result(root, "none", "none", "bm25", "sample", GOOD)
    leaf = write_result(root, "none", "none", "minilm", "sample", MIXED)
    rec = read_json(leaf / "sample.json")
    del rec["per_query"]
    (leaf / "sample.json").write_text(json.dumps(rec))
    with pytest.raises(DataError, match="no per_query scores"):
        build_table(load_results([root]), baseline=0)


def test_cost_columns_sum_stats_over_tasks(tmp_path):
    root = tmp_path / "r"
    for task, tokens in (("Biology", 100), ("sample", 250)):
        write_result(
            root, "hyde", "gpt4", "bm25", task, GOOD,
            stats={"generations": 4, "cache_hits": 2, "prompt_tokens": tokens, "completion_tokens": 10,
                   "llm_time_s": 1.5, "retrieval_time_s": 0.5, "cost_usd": 0.125},
        )
    # A self-hosted model has no price: the runner records cost_usd null, and so does a run
    # without an LLM; their cost cells show no dollars.
    write_result(
        root, "hyde", "smollm2", "bm25", "Biology", GOOD,
        stats={"generations": 4, "cache_hits": 0, "prompt_tokens": 90, "completion_tokens": 10,
               "llm_time_s": 1.0, "retrieval_time_s": 0.5, "cost_usd": None},
    )
    write_result(root, "none", "none", "bm25", "Biology", GOOD)
    table = build_table(load_results([root]), cost=True)
    labels = [r.row.label for r in table.rows]
    assert labels == ["none/none/bm25", "hyde/gpt4/bm25", "hyde/smollm2/bm25"]
    assert table.rows[1].totals == {
        "generations": 8, "cache_hits": 4, "prompt_tokens": 350, "completion_tokens": 20,
        "llm_time_s": 3.0, "retrieval_time_s": 1.0, "cost_usd": 0.25,
    }
    assert "cost_usd" not in table.rows[0].totals and "cost_usd" not in table.rows[2].totals
    recs = list(csv.DictReader(io.StringIO(render_csv(table))))
    assert float(recs[1]["prompt_tokens"]) == 350 and float(recs[1]["cost_usd"]) == 0.25
    # counts are written as integers, times and dollars as numbers
    assert (recs[1]["generations"], recs[1]["cache_hits"], recs[1]["prompt_tokens"], recs[1]["completion_tokens"]) == (
        "8", "4", "350", "20")
    assert recs[1]["llm_time_s"] == "3.0"
    assert recs[0]["cost_usd"] == "" and recs[2]["cost_usd"] == ""
    md = render_markdown(table).splitlines()
    header = next(line for line in md if line.startswith("| #"))
    col = [c.strip() for c in header.split("|")].index("cost $")
    cost_cells = [[c.strip() for c in line.split("|")][col] for line in md if line.startswith("| ") and line != header]
    assert cost_cells == [MISSING, "0.2500", MISSING]
    assert "| 350 |" in render_markdown(table)
    assert "0.0000" not in render(table, "rich")


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_results([tmp_path / "nope"])
    leaf = tmp_path / "r" / "none" / "none" / "bm25"
    leaf.mkdir(parents=True)
    (leaf / "Biology.json").write_text('{"test": {"ndcg_at_10": 0.5,}}')
    with pytest.raises(DataError, match=r"Biology\.json:1: malformed JSON"):
        load_results([tmp_path / "r"])
    (leaf / "Biology.json").write_bytes(b'{"test":\n {"ndcg_at_10": 0.5, "note": "caf\xe9"}}')
    with pytest.raises(DataError, match=r"Biology\.json:2: not UTF-8 text: byte 0xe9"):
        load_results([tmp_path / "r"])
    (leaf / "Biology.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match=r"Biology\.json: malformed JSON \(nested too deeply\)"):
        load_results([tmp_path / "r"])
    (leaf / "Biology.json").write_text('{"test": {"ndcg_at_10": "high"}}')
    with pytest.raises(DataError, match="test.ndcg_at_10 must be a number"):
        load_results([tmp_path / "r"])
    with pytest.raises(ConfigError, match="no results to compare"):
        build_table([])


def test_same_folder_through_two_paths_is_loaded_once(two_trees):
    a, _ = two_trees
    rows = load_results([a, a / "none" / "none" / "bm25"])
    assert [r.label for r in rows] == ["none/none/bm25", "hyde/smollm2/bm25"]


def test_rich_rendering_lists_every_row(two_trees):
    a, b = two_trees
    text = render(build_table(load_results([a, b]), published=True), "rich")
    for label in ("bm25", "smollm2", "minilm"):
        assert label in text
    assert "paper (Δ)" in text


def test_cli_compare_markdown_csv_and_out_file(cli, two_trees, tmp_path):
    a, b = two_trees
    runner = CliRunner()
    res = runner.invoke(cli, ["compare", str(a), str(b), "--format", "md"])
    assert res.exit_code == 0, res.output
    rows = load_results([a, b])
    table = build_table(rows)
    assert res.stdout == render_markdown(table)
    res = runner.invoke(cli, ["compare", str(a), "--format", "csv", "--metric", "mrr"])
    assert res.exit_code == 0, res.output
    parsed = list(csv.DictReader(io.StringIO(res.output)))
    assert float(parsed[0]["sample"]) == read_json(a / "none/none/bm25/sample.json")["test"]["mrr"]
    out = tmp_path / "table.csv"
    res = runner.invoke(cli, ["compare", str(a), str(b), "--published", "--cost", "--out", str(out)])
    assert res.exit_code == 0, res.output
    header = out.read_text().splitlines()[0].split(",")
    assert "Biology_published" in header and "cost_usd" in header and "results" in header
    res = runner.invoke(cli, ["compare", str(a), "--format", "rich"])
    assert res.exit_code == 0 and "hyde" in res.output


def test_cli_compare_baseline_and_errors(cli, two_trees):
    a, b = two_trees
    runner = CliRunner()
    res = runner.invoke(cli, ["compare", str(a), str(b), "--baseline", "none/none/bm25", "--format", "md"])
    assert res.exit_code == 0, res.output
    assert "W/T/L" in res.output and "0 (base)" in res.output
    res = runner.invoke(cli, ["compare", str(a), "--baseline", "nope/x/y", "--format", "md"])
    assert res.exit_code != 0
    assert isinstance(res.exception, ConfigError) and "0: none/none/bm25" in str(res.exception)
    res = runner.invoke(cli, ["compare", str(a), "--format", "html"])
    assert isinstance(res.exception, ConfigError) and "rich, md, csv" in str(res.exception)


def test_cli_main_prints_user_errors_without_traceback(two_trees, capsys):
    from r2med_agent.cli import main

    a, _ = two_trees
    assert main(["compare", str(a), "--metric", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "no result file has metric 'bogus'" in err and "Traceback" not in err


def test_cli_compare_tasks_takes_the_names_of_tasks_of_your_own(cli, tmp_path):
    """A task run from ``--data-dir`` is not in the registry; ``--tasks`` selects it by the name
    the results hold (any case), beside registry names, and an unknown name lists both."""
    root = tmp_path / "res"
    for task in ("MyClinic", "Biology", "sample"):
        write_result(root, "none", "none", "bm25", task, MIXED)
    runner = CliRunner()
    res = runner.invoke(cli, ["compare", str(root), "--tasks", "myclinic,biology", "--format", "csv"])
    assert res.exit_code == 0, res.output
    header = next(csv.reader(io.StringIO(res.output)))
    assert "MyClinic" in header and "Biology" in header and "sample" not in header
    res = runner.invoke(cli, ["compare", str(root), "--tasks", "OtherClinic", "--format", "csv"])
    assert isinstance(res.exception, ConfigError)
    assert "OtherClinic" in str(res.exception) and "the results hold: Biology, MyClinic, sample" in str(res.exception)


def _cells(text: str) -> list[str]:
    """Every cell of a rich table's body lines (``│``-separated), stripped."""
    return [c.strip() for line in text.splitlines() if line.startswith("│") for c in line.split("│")[1:-1]]


def test_tables_at_80_columns_never_cut_a_figure(tmp_path, monkeypatch):
    """Issue 30 item 5: written to a file or a pipe (80 columns), the run table and ``compare
    --cost`` used to show ``MRR 1.00…``, ``nDCG@…`` and ``5…``. Labels fold onto more lines; every
    figure is printed whole, the table wider than 80 columns where it must be."""
    from rich.console import Console

    import r2med_agent.cli.run_cmd as run_cmd
    from r2med_agent.analysis.render import print_rich
    from r2med_agent.cli.app import main
    from tests.unit.analysis.test_report import _beir_task

    console = Console(file=io.StringIO(), width=80, color_system=None)
    monkeypatch.setattr(run_cmd, "console", console)
    data = tmp_path / "a-medical-task-of-our-own"
    _beir_task(data, "insects fly towards light")
    out = tmp_path / "results"
    assert main(["run", "--data-dir", str(data), "--all-queries", "-o", str(out), "--no-progress"]) == 0
    printed = console.file.getvalue()
    assert "…" not in printed
    record = read_json(out / "none" / "none" / "bm25" / f"{data.name}@test-all.json")
    cells = _cells(printed)
    for key in ("ndcg_at_10", "recall_at_100", "mrr"):
        assert f"{record['test'][key]:.4f}" in cells
    for header in ("nDCG@10", "R@100", "MRR", "queries"):
        assert header in printed
    table_lines = [line for line in printed.splitlines() if line[:1] in "┏┃┡│└"]
    assert max(len(line) for line in table_lines) <= 80  # the folded task name leaves room

    root = tmp_path / "r"
    for i, task in enumerate(("Biology", "Medical-Sciences", "MedXpertQA-Exam", "PMC-Treatment")):
        write_result(root, "query2doc", "gpt4", "bm25", task, GOOD, stats={
            "generations": 1234, "cache_hits": 56, "prompt_tokens": 5_432_109 + i, "completion_tokens": 987_654,
            "llm_time_s": 4321.5, "retrieval_time_s": 12.25, "cost_usd": 5.125})
        write_result(root, "hyde", "qwen-7b", "bm25", task, MIXED)
    table = build_table(load_results([root]), cost=True, baseline=1)
    wide = Console(file=io.StringIO(), width=80, color_system=None)
    print_rich(table, wide)
    text = wide.file.getvalue()
    assert "…" not in text
    cells = _cells(text)
    for want in ("21,728,442", "3,950,616", "20.5000", "17286.00", "4,936", "224", "0/0/16", "<0.0001"):
        assert any(want in c for c in cells), want
    assert "MedXpertQA-" in text  # a long task name is given on two lines, its figures stay whole


def test_cli_compare_tasks_lists_only_rows_with_a_result_on_those_tasks(cli, two_trees):
    """Issue 39 item 18: ``--tasks sample`` listed HyDE's row, which has no sample result, as a
    row of dashes. Rows without a result on any chosen task are left out (and logged); their
    indexes are the shown rows' (as --baseline takes them)."""
    a, b = two_trees
    res = CliRunner().invoke(cli, ["compare", str(a), str(b), "--tasks", "sample", "--format", "csv"])
    assert res.exit_code == 0, res.output
    body = list(csv.reader(io.StringIO(res.output)))[1:]
    assert len(body) == 2 and not any("hyde" in ",".join(row) for row in body)
    table = build_table(load_results([a, b]), tasks=["sample"], baseline=1)
    assert [r.row.label for r in table.rows] == ["none/none/bm25", "none/none/minilm"]
    assert table.baseline == 1
    assert len(build_table(load_results([a, b])).rows) == 3  # without --tasks: every row


def test_a_misspelt_metric_or_table_gets_a_did_you_mean(cli, two_trees):
    """Issue 39 item 18: ``--metric ndgc@10`` and ``--table brigth`` said only what exists."""
    a, _ = two_trees
    res = CliRunner().invoke(cli, ["compare", str(a), "--metric", "ndgc@10"])
    assert isinstance(res.exception, ConfigError)
    assert "no result file has metric 'ndgc@10' (did you mean 'ndcg@10'?)" in str(res.exception)
    res = CliRunner().invoke(cli, ["reproduce", "--table", "brigth", "--dry-run"])
    assert isinstance(res.exception, ConfigError)
    assert "unknown table 'brigth' (did you mean 'bright'?)" in str(res.exception)
