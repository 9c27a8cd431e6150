"""The run options that follow R2MED's scripts where the project otherwise does its own thing
(docs/protocol.md, "Known differences"): documents whose id is the query's id left out of a dense
ranking as BEIR's exact search does, and empty generations used as they are. Both run end to end
through the runner over a task of their own, with the real MiniLM and the real BM25."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from r2med_agent.evaluation import read_trec_run
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.retrieval.dense.index import drop_identical_ids
from r2med_agent.api import RunConfig, run_experiment
from tests.fakes import ScriptedLLM

pytest.importorskip("faiss")

PATIENTS = [
    ("p1", "A 54-year-old man with crushing chest pain radiating to the left arm."),
    ("p2", "A 7-year-old girl with fever, sore throat and a sandpaper rash."),
    ("p3", "A 30-year-old woman with heat intolerance, weight loss and a tremor."),
]
OTHERS = [
    ("c1", "Acute myocardial infarction presenting with chest pain and sweating."),
    ("c2", "Scarlet fever after streptococcal pharyngitis in a child."),
    ("c3", "Graves disease with thyrotoxicosis, tremor and weight loss."),
    ("c4", "Ankle sprain after a fall while running."),
    ("c5", "Migraine with aura and photophobia."),
]


def _case_task(root: Path) -> Path:
    """A case-retrieval task whose queries are patients that are also documents under the same id
    (as on PMC-Clinical and IIYi-Clinical), each relevant to one other case."""
    folder = root / "Cases"
    folder.mkdir(parents=True)
    (folder / "query.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in PATIENTS))
    corpus = PATIENTS + OTHERS
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in corpus))
    qrels = [("p1", "c1"), ("p2", "c2"), ("p3", "c3")]
    (folder / "qrels.jsonl").write_text("".join(json.dumps({"q_id": q, "p_id": d, "score": 1}) + "\n" for q, d in qrels))
    return folder


def _run(tmp_path: Path, **kw):
    cfg = RunConfig(tasks=("Cases",), data_dir=tmp_path / "data" / "Cases", output_dir=tmp_path / "out",
                    show_progress=False, **kw)
    result = run_experiment(cfg)
    folder = tmp_path / "out" / cfg.folder()
    return result.outcomes[0], read_trec_run(folder / "Cases.run"), json.loads((folder / "Cases.json").read_text())


def test_drop_identical_ids_moves_the_next_document_up_and_counts() -> None:
    run = {"q1": {"q1": 0.9, "a": 0.8, "b": 0.7}, "q2": {"a": 0.5, "b": 0.4, "q2x": 0.3}}
    kept, removed = drop_identical_ids(run, 2)
    assert kept == {"q1": {"a": 0.8, "b": 0.7}, "q2": {"a": 0.5, "b": 0.4}}
    assert removed == 1


def test_dense_run_leaves_out_the_query_itself_as_beir_does(tmp_path: Path) -> None:
    _case_task(tmp_path / "data")
    plain, plain_run, plain_record = _run(tmp_path, retriever="minilm", top_k=3)
    # the patient's own record is the nearest document of every query: the ids collide
    assert all(next(iter(plain_run[q])) == q for q, _ in PATIENTS)
    assert "identical_ids_removed" not in plain_record["stats"]

    outcome, run, record = _run(tmp_path, retriever="minilm", top_k=3, exclude_identical_ids=True)
    assert record["config"]["exclude_identical_ids"] is True
    assert record["stats"]["identical_ids_removed"] == 3 == outcome.stats["identical_ids_removed"]
    for q, _ in PATIENTS:
        assert q not in run[q] and len(run[q]) == 3
        # the same order without the query itself, and the next document moved up into the top 3
        assert list(run[q])[:2] == [d for d in plain_run[q] if d != q]
    assert record["test"]["ndcg_at_1"] > plain_record["test"]["ndcg_at_1"]


def test_bm25_runs_do_not_take_the_option(tmp_path: Path) -> None:
    _case_task(tmp_path / "data")
    cfg = RunConfig(tasks=("Cases",), retriever="bm25-compat", exclude_identical_ids=True)
    assert cfg.exclude_identical_ids is False  # R2MED's BM25 script excludes nothing


def _empty_for_p2(tmp_path: Path) -> CachedLLM:
    def script(messages, params):
        return "" if "sandpaper" in messages[-1]["content"] else "Acute myocardial infarction or Graves disease."

    return CachedLLM(ScriptedLLM(script, model_id="scripted"), "scripted", "plain",
                     GenerationCache(tmp_path / "gen.sqlite"))


@pytest.fixture
def scripted_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    from r2med_agent.llm.registry import LLMSpec

    monkeypatch.setattr("r2med_agent.llm.registry.get_llm_spec",
                        lambda name: LLMSpec(name="scripted", backend="local", model="scripted"))


def test_empty_generation_keep_searches_bm25_with_nothing_as_r2med(tmp_path: Path, scripted_entry) -> None:
    _case_task(tmp_path / "data")
    kw = {"method": "hyde", "llm": "scripted", "retriever": "bm25-compat", "top_k": 4}
    cfg = RunConfig(tasks=("Cases",), data_dir=tmp_path / "data" / "Cases", output_dir=tmp_path / "out",
                    show_progress=False, **kw)
    run_experiment(cfg, llm=_empty_for_p2(tmp_path))
    default = json.loads((tmp_path / "out" / cfg.folder() / "Cases.json").read_text())
    default_run = read_trec_run(tmp_path / "out" / cfg.folder() / "Cases.run")
    assert default["stats"]["empty_generations"] == 1
    assert "c2" in default_run["p2"]  # the plain query was searched instead

    keep = RunConfig(tasks=("Cases",), data_dir=tmp_path / "data" / "Cases", output_dir=tmp_path / "out",
                     show_progress=False, empty_generation="keep", **kw)
    run_experiment(keep, llm=_empty_for_p2(tmp_path))
    record = json.loads((tmp_path / "out" / keep.folder() / "Cases.json").read_text())
    run = read_trec_run(tmp_path / "out" / keep.folder() / "Cases.run")
    assert record["config"]["empty_generation"] == "keep" and record["stats"]["empty_generations"] == 1
    # an empty BM25 query scores every document 0; R2MED keeps the first ones in corpus order
    assert run["p2"] == {"p1": 0.0, "p2": 0.0, "p3": 0.0, "c1": 0.0}
    assert run["p1"] == default_run["p1"] and run["p3"] == default_run["p3"]
    # compare --cost shows the count beside the scores of both rows
    from r2med_agent.analysis.render import render_markdown
    from r2med_agent.api import build_table, load_results

    md = render_markdown(build_table(load_results([tmp_path / "out"]), metric="ndcg_at_1", cost=True)).splitlines()
    header = [c.strip() for c in next(line for line in md if line.startswith("| #")).split("|")]
    col = header.index("empty gens")
    rows = [[c.strip() for c in line.split("|")] for line in md if line.startswith("| ") and not line.startswith("| #")]
    assert sorted(r[col] for r in rows if r[1].isdigit() or r[1].endswith("(base)")) == ["1", "1"]


def test_rankllama_length_is_the_producing_scripts_and_a_run_can_set_it(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    import r2med_agent.retrieval as retrieval
    from r2med_agent.retrieval import make_reranker
    from r2med_agent.rerank.spec import get_reranker_spec

    # R2MED's first commit, src/eval_reranker.py: max_length=1024 for its "llama" (RankLLaMA) run
    assert get_reranker_spec("rankllama").max_length == 1024
    assert make_reranker("rankllama", max_length=512).spec.max_length == 512
    seen: list = []

    def capture(name: str, **kw):
        seen.append((name, kw["max_length"]))
        raise KeyboardInterrupt  # before any model loads

    monkeypatch.setattr(retrieval, "make_reranker", capture)
    for length in (None, 512):
        cfg = RunConfig(tasks=("sample",), retriever="bm25", reranker="rankllama", rerank_max_length=length,
                        output_dir=tmp_path, show_progress=False)
        with pytest.raises(KeyboardInterrupt):
            run_experiment(cfg)
    assert seen == [("rankllama", None), ("rankllama", 512)]
