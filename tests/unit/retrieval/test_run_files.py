"""`run --candidates`: first-stage lists from TREC run files (ReasonRank's released layout
included), reranked exactly as given, scored as pytrec_eval scores the files themselves."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from r2med_agent.cli.app import main
from r2med_agent.data import load_task
from r2med_agent.errors import ConfigError, DataError
from r2med_agent.evaluation import evaluate, read_trec_run
from r2med_agent.retrieval import make_retriever
from r2med_agent.retrieval.run_files import find_candidate_files, read_ranked_run
from r2med_agent.api import RunConfig, run_experiment
from r2med_agent.types import SearchRequest
from tests.unit.experiment.test_fidelity import ReversingReranker


def _released_layout(root: Path, reverse: bool = True, extra: str = "") -> Path:
    """ReasonRank's layout for the sample task: runs/r2med_sample/<model>_top100.txt, here a BM25
    top 20 written in reversed order (so the file's order is not what BM25 would give)."""
    task = load_task("sample")
    run = make_retriever("bm25", task, show_progress=False).search(
        [SearchRequest(q.query_id, q.text) for q in task.queries], 20)
    lines = []
    for qid, docs in run.items():
        ranked = sorted(docs, key=lambda d: -docs[d])
        ranked = ranked[::-1] if reverse else ranked
        lines += [f"{qid} Q0 {d} {i + 1} {1.0 - i / 100:.6f} e5-mistral-7b-instruct" for i, d in enumerate(ranked)]
    folder = root / "runs" / "r2med_sample"
    folder.mkdir(parents=True)
    (folder / "e5-mistral-7b-instruct_top100.txt").write_text("\n".join(lines) + "\n" + extra)
    return root / "runs"


def test_candidates_are_scored_as_given(tmp_path: Path) -> None:
    runs = _released_layout(tmp_path)
    out = tmp_path / "results"
    assert main(["run", "--candidates", str(runs), "-o", str(out), "--no-progress"]) == 0
    (result,) = out.glob("none/none/candidates__cand-*/sample.json")
    given = runs / "r2med_sample" / "e5-mistral-7b-instruct_top100.txt"
    written = read_trec_run(result.with_name("sample.run"))
    expected = read_ranked_run(given)
    assert {q: list(d) for q, d in written.items()} == {q: list(d) for q, d in expected.items()}
    ev = evaluate(read_trec_run(given), load_task("sample").qrels)
    assert json.loads(result.read_text())["test"]["ndcg_at_10"] == pytest.approx(ev.mean["ndcg_at_10"])
    assert json.loads(result.read_text())["config"]["candidates_path"] == str(runs)


def test_a_reranker_gets_the_candidates_top_k_in_the_files_order(tmp_path: Path, monkeypatch) -> None:
    runs = _released_layout(tmp_path)
    monkeypatch.setattr("r2med_agent.retrieval.make_reranker", lambda name, **_: ReversingReranker())
    monkeypatch.setattr("r2med_agent.experiment.runner.model_precisions", lambda cfg: {})
    cfg = RunConfig(tasks=("sample",), candidates_path=runs, reranker="reverse", rerank_k=5,
                    output_dir=tmp_path / "out", show_progress=False)
    result = run_experiment(cfg)
    given = read_ranked_run(runs / "r2med_sample" / "e5-mistral-7b-instruct_top100.txt")
    written = read_trec_run(result.result_dir / "sample.run")
    for qid, docs in written.items():
        order = list(given[qid])
        assert sorted(docs, key=lambda d: -docs[d]) == order[:5][::-1] + order[5:]
    assert result.result_dir.name == cfg.leaf and cfg.leaf.startswith("candidates__cand-")


def test_an_llm_reranker_keeps_the_files_order_where_scores_tie(tmp_path: Path, monkeypatch) -> None:
    """ReasonRank's released runs tie scores in 103 of 876 queries; the authors read each list in
    the file's order. A listwise reranker's one window shows them so, not by score and document id."""
    from r2med_agent.llm.cache.wrapper import CachedLLM
    from r2med_agent.rerank.llm import LLMReranker
    from r2med_agent.rerank.spec import RerankerSpec
    from tests.fakes import ScriptedLLM

    task = load_task("sample")
    docs = [d.doc_id for d in task.corpus][:4][::-1]  # not in id order
    qid = task.queries[0].query_id
    path = tmp_path / "sample.run"
    path.write_text("".join(f"{qid} Q0 {d} {i + 1} 0.5 tag\n" for i, d in enumerate(docs)))
    fake = ScriptedLLM(lambda m, p: "[1] > [2] > [3] > [4]")
    spec = RerankerSpec(name="ordered", kind="listwise", llm="smollm2", window=4, step=2, max_doc_words=3)
    reranker = LLMReranker(spec, llm=CachedLLM(fake, "scripted"))
    monkeypatch.setattr("r2med_agent.retrieval.make_reranker", lambda name, **_: reranker)
    monkeypatch.setattr("r2med_agent.experiment.runner.model_precisions", lambda cfg: {})
    cfg = RunConfig(tasks=("sample",), candidates_path=path, reranker="smollm2-listwise", rerank_k=4,
                    output_dir=tmp_path / "out", show_progress=False)
    run_experiment(cfg)
    shown = fake.calls[0][0][-1]["content"]
    texts = {d.doc_id: " ".join(d.full_text.split()[:3]) for d in task.corpus}
    assert [shown.index(texts[d]) for d in docs] == sorted(shown.index(texts[d]) for d in docs)


def test_a_document_listed_again_keeps_its_first_listing(tmp_path: Path, caplog) -> None:
    """ReasonRank's released runs list 337 documents a second time for the same query; they are read,
    each document at its first listing, with a warning that counts the repeats."""
    path = tmp_path / "dup.run"
    path.write_text("q Q0 a 1 0.9 t\nq Q0 b 2 0.8 t\nq Q0 a 3 0.7 t\nr Q0 a 1 0.5 t\n")
    with caplog.at_level(logging.WARNING):
        run = read_ranked_run(path)
    assert run == {"q": {"a": 0.9, "b": 0.8}, "r": {"a": 0.5}}
    assert "dup.run:3: 1 lines list a document again" in caplog.text


def test_other_files_other_folder_same_files_same_folder(tmp_path: Path) -> None:
    a = _released_layout(tmp_path / "a")
    b = _released_layout(tmp_path / "b", reverse=False)
    copy = tmp_path / "copy"
    (copy / "r2med_sample").mkdir(parents=True)
    (copy / "r2med_sample" / "list.trec").write_bytes((a / "r2med_sample" / "e5-mistral-7b-instruct_top100.txt").read_bytes())
    spec = lambda p: RunConfig(tasks=("sample",), candidates_path=p).spec()  # noqa: E731
    assert spec(a).folder() != spec(b).folder()
    assert spec(a).folder() == spec(copy).folder()
    assert spec(a).settings() == {"candidates": spec(a).candidates}


def test_documents_the_corpus_lacks_stop_the_run_or_are_left_out(tmp_path: Path, capsys, caplog) -> None:
    runs = _released_layout(tmp_path, extra="0 Q0 not-a-doc 21 0.1 x\n0 Q0 nor-this 22 0.05 x\n")
    out = tmp_path / "results"
    assert main(["run", "--candidates", str(runs), "-o", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "e5-mistral-7b-instruct_top100.txt" in err and "2 candidate documents (1 queries)" in err
    assert "--allow-missing-candidates" in err
    with caplog.at_level(logging.WARNING):
        assert main(["run", "--candidates", str(runs), "--allow-missing-candidates", "-o", str(out),
                     "--no-progress"]) == 0
    assert "2 candidate documents (1 queries) are not in sample's corpus" in caplog.text
    (result,) = out.glob("none/none/candidates__cand-*/sample.run")
    assert "not-a-doc" not in result.read_text()


def test_bad_candidate_paths_and_combinations_are_clear_errors(tmp_path: Path) -> None:
    runs = _released_layout(tmp_path)
    with pytest.raises(ConfigError, match="no run file for task Biology"):
        find_candidate_files(runs, ["Biology"])
    with pytest.raises(ConfigError, match="one run file serves one task"):
        find_candidate_files(runs / "r2med_sample" / "e5-mistral-7b-instruct_top100.txt", ["sample", "Biology"])
    with pytest.raises(ConfigError, match="no such file or folder"):
        find_candidate_files(tmp_path / "nowhere", ["sample"])
    with pytest.raises(ConfigError, match="use --method none"):
        RunConfig(tasks=("sample",), candidates_path=runs, method="hyde", llm="smollm2")
    with pytest.raises(ConfigError, match="--candidates replaces --retriever"):
        RunConfig(tasks=("sample",), candidates_path=runs, retriever="minilm")
    bad = tmp_path / "bad.run"
    bad.write_text("q1 Q0 d1 first 0.5 x\n")
    with pytest.raises(DataError, match="bad.run:1: rank 'first'"):
        read_ranked_run(bad)
