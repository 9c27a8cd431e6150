"""BRIGHT runs end to end through the CLI on a BRIGHT-layout fixture (tests/bright_fixture.py):
BM25 with excluded ids, BRIGHT's released reasoning queries (no LLM), HyDE and fresh reasoning
queries with the real local model, and bad input that stops a run before it writes anything.

Scores are checked against an independent computation: gensim's ``LuceneBM25Model`` (the model
BRIGHT's ``retrieval_bm25`` runs) over the fixture's texts, the excluded ids left out by hand, and
pytrec_eval. tests/conformance/test_bright.py runs BRIGHT's own ``run.py`` on the same fixture.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from r2med_agent.cli.app import main
from r2med_agent.evaluation import read_trec_run
from tests.bright_fixture import (
    EXCLUDED_FIRST,
    GPT4_REASONING,
    LEETCODE_DOCS,
    LEETCODE_EXAMPLES,
    SHARD,
    example_row,
    make_bright,
    write_parquet,
)

BM25 = ["--retriever", "bm25-compat", "--allow-count-mismatch", "--no-progress"]


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    return make_bright(tmp_path / "BRIGHT")


def run(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(["run", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def gensim_scores(docs: dict[str, str], query: str) -> dict[str, float]:
    """BRIGHT's BM25 (gensim LuceneBM25Model, k1 0.9, b 0.4, query and documents weighted) with
    the project's port of pyserini's analyzer, computed here without the project's index."""
    from gensim.corpora import Dictionary
    from gensim.models import LuceneBM25Model
    from gensim.similarities import SparseMatrixSimilarity

    from r2med_agent.retrieval.bm25.analysis import LuceneEnglishAnalyzer

    analyzer = LuceneEnglishAnalyzer()
    corpus = [analyzer.analyze(t) for t in docs.values()]
    dictionary = Dictionary(corpus)
    model = LuceneBM25Model(dictionary=dictionary, k1=0.9, b=0.4)
    index = SparseMatrixSimilarity(model[list(map(dictionary.doc2bow, corpus))], num_docs=len(corpus),
                                   num_terms=len(dictionary), normalize_queries=False, normalize_documents=False)
    sims = index[model[dictionary.doc2bow(analyzer.analyze(query))]]
    return dict(zip(docs, np.asarray(sims, dtype=float).tolist()))


def test_bm25_compat_on_a_bright_task_leaves_the_excluded_ids_out(root: Path, tmp_path: Path, capsys) -> None:
    import pytrec_eval

    out = tmp_path / "out"
    code, stdout, err = run(["--task", "bright-leetcode", "--data-dir", str(root), "-o", str(out), *BM25], capsys)
    assert code == 0, err
    folder = out / "none" / "none" / "bm25-compat"
    record = json.loads((folder / "bright-leetcode.json").read_text())
    written = read_trec_run(folder / "bright-leetcode.run")
    qid, doc = EXCLUDED_FIRST
    expected = {}
    for e in LEETCODE_EXAMPLES:
        scores = gensim_scores(LEETCODE_DOCS, e["query"])
        assert max(scores, key=scores.get) == e["excluded_ids"][0]  # every query's own problem ranks first
        expected[e["id"]] = {d: s for d, s in scores.items() if d not in e["excluded_ids"]}
    assert doc not in written[qid]
    for q, ranking in expected.items():
        assert written[q] == pytest.approx(ranking, rel=1e-6)
    qrels = {e["id"]: {g: 1 for g in e["gold_ids"]} for e in LEETCODE_EXAMPLES}
    theirs = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.5,10", "recip_rank"}).evaluate(expected)
    assert record["test"]["ndcg_at_10"] == pytest.approx(np.mean([v["ndcg_cut_10"] for v in theirs.values()]))
    assert record["test"]["ndcg_at_5"] == pytest.approx(np.mean([v["ndcg_cut_5"] for v in theirs.values()]))
    assert record["test"]["mrr"] == pytest.approx(np.mean([v["recip_rank"] for v in theirs.values()]))
    assert record["stats"]["excluded_removed"] == 3
    assert "bright-leetcode" in stdout


def test_released_reasoning_queries_score_with_no_llm(root: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    args = ["--task", "bright-biology,bright-leetcode", "--method", "reason", "--llm", "gpt4", "--generations",
            "bright", "--data-dir", str(root), "-o", str(out), *BM25]
    code, stdout, err = run(args, capsys)
    assert code == 0, err
    assert "0 new, 0 from cache, 6 released by BRIGHT (no LLM built)" in stdout
    folder = out / "reason" / "gpt4@bright" / "bm25-compat"
    for task, docs in (("bright-leetcode", LEETCODE_DOCS),):
        record = json.loads((folder / f"{task}.json").read_text())
        assert record["generations"] == "bright" and record["stats"]["released_generations"] == 3
        assert record["stats"]["released_source"].endswith(f"gpt4_reason/leetcode{SHARD}")
        written = read_trec_run(folder / f"{task}.run")
        for e in LEETCODE_EXAMPLES:  # the reasoning replaces the query; the excluded ids still go
            scores = gensim_scores(docs, GPT4_REASONING["leetcode"][e["id"]])
            want = {d: s for d, s in scores.items() if d not in e["excluded_ids"]}
            assert written[e["id"]] == pytest.approx(want, rel=1e-6)
        rows = [json.loads(line) for line in (folder / f"{task}.generations.jsonl").read_text().splitlines()]
        assert [r["final"] for r in rows] == [GPT4_REASONING["leetcode"][e["id"]] for e in LEETCODE_EXAMPLES]


def test_released_reasoning_queries_of_an_llm_brights_release_lacks(root: Path, tmp_path: Path, capsys) -> None:
    args = ["--task", "bright-leetcode", "--method", "reason", "--llm", "claude-3-opus", "--generations", "bright",
            "--data-dir", str(root), "-o", str(tmp_path / "out"), *BM25]
    code, _, err = run(args, capsys)
    assert code != 0 and "no claude-3-opus_reason/leetcode.parquet" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad, message", [
    ("no_excluded", r"leetcode-00000-of-00001\.parquet:1: missing field 'excluded_ids'"),
    ("excluded_gold", r"leetcode-00000-of-00001\.parquet:1: excluded id 'leetcode/pair_sum_hash\.txt' of query "
                      r"'two_sum' is also one of its gold ids"),
])
def test_bad_input_stops_the_run_with_file_and_row_and_keeps_what_was_written(
        root: Path, tmp_path: Path, capsys, bad: str, message: str) -> None:
    import re

    out = tmp_path / "out"
    args = ["--task", "bright-leetcode", "--data-dir", str(root), "-o", str(out), *BM25]
    assert run(args, capsys)[0] == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    rows = [example_row(e) for e in LEETCODE_EXAMPLES]
    if bad == "no_excluded":
        for r in rows:
            r.pop("excluded_ids")
    else:
        rows[0]["excluded_ids"] = list(rows[0]["gold_ids"])
    write_parquet(root / "examples" / f"leetcode{SHARD}", rows)
    code, _, err = run(args, capsys)
    assert code != 0 and re.search(message, err) and "Traceback" not in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_long_split_without_gold_ids_long_stops_with_file_and_row(root: Path, tmp_path: Path, capsys) -> None:
    from tests.bright_fixture import BIOLOGY_EXAMPLES

    out = tmp_path / "out"
    args = ["--task", "bright-biology-long", "--data-dir", str(root), "-o", str(out), *BM25]
    assert run(args, capsys)[0] == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    rows = [example_row(e) for e in BIOLOGY_EXAMPLES]
    for r in rows:
        r.pop("gold_ids_long")
    write_parquet(root / "examples" / f"biology{SHARD}", rows)
    code, _, err = run(args, capsys)
    assert code != 0 and "biology-00000-of-00001.parquet:1: missing field 'gold_ids_long'" in err
    assert "Traceback" not in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.slow
@pytest.mark.parametrize("method", ["hyde", "reason"])
def test_hyde_and_fresh_reasoning_queries_with_the_local_model(root: Path, tmp_path: Path, smollm2_gguf,
                                                                 capsys, method: str) -> None:
    """Real SmolLM2 on llama.cpp writes HyDE's passage, or BRIGHT-style reasoning that replaces the
    query; BM25 searches with it (docs/protocol.md, docs/bright.md) and the excluded ids still go."""
    out = tmp_path / "out"
    args = ["--task", "bright-leetcode", "--method", method, "--llm", "smollm2", "--max-tokens", "24",
            "--data-dir", str(root), "-o", str(out), *BM25]
    code, stdout, err = run(args, capsys)
    assert code == 0, err
    assert "LLM generations: 3 new" in stdout
    (folder,) = [p.parent for p in out.rglob("bright-leetcode.json")]
    rows = {r["id"]: r for r in map(json.loads, (folder / "bright-leetcode.generations.jsonl").read_text().splitlines())}
    written = read_trec_run(folder / "bright-leetcode.run")
    for e in LEETCODE_EXAMPLES:
        passage = rows[e["id"]]["final"]
        assert passage.strip()
        scores = gensim_scores(LEETCODE_DOCS, passage)  # HyDE's and reason's BM25 query: the text alone
        want = {d: s for d, s in scores.items() if d not in e["excluded_ids"]}
        assert written[e["id"]] == pytest.approx(want, rel=1e-6)
    record = json.loads((folder / "bright-leetcode.json").read_text())
    assert record["stats"]["generations"] == 3 and record["stats"]["excluded_removed"] == 3
