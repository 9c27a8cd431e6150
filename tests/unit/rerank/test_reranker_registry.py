"""The reranker kinds: a kind defined here (one class) and registered with one line of
RERANKER_KINDS runs end to end through ``r2med run`` from an entry of a user config; the
built-in kinds declare what the code used to guess from their names."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from r2med_agent.errors import ConfigError
from r2med_agent.rerank.kinds import RERANKER_KINDS, RerankerKind, RerankerOptions
from r2med_agent.rerank.spec import RerankerSpec, follows_published_code, get_reranker_spec
from r2med_agent.types import Run, SearchRequest


class ReverseReranker:
    """Turns each query's top ``k`` upside down (a reranker with no model and no LLM)."""

    batches_tasks = False

    def __init__(self, spec: RerankerSpec, options: RerankerOptions) -> None:
        self.name = spec.name

    def check(self) -> None:
        pass

    def rerank(self, requests: Sequence[SearchRequest], run: Run, corpus: Mapping[str, str], k: int) -> Run:
        out: Run = {}
        for qid, docs in run.items():
            ranked = [d for d, _ in sorted(docs.items(), key=lambda kv: (-kv[1], kv[0]))]
            order = [*reversed(ranked[:k]), *ranked[k:]]
            out[qid] = {d: float(len(order) - i) for i, d in enumerate(order)}
        return out


@pytest.fixture
def toy_kind(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The toy kind in the registry for one test: the one line a new kind takes."""
    monkeypatch.setitem(RERANKER_KINDS, "reverse", RerankerKind(ReverseReranker))
    yield "reverse"


def test_a_registered_kind_runs_end_to_end_through_the_cli(toy_kind: str, tmp_path: Path, capsys) -> None:
    import pytrec_eval

    from r2med_agent.cli.app import main
    from r2med_agent.data import load_task
    from r2med_agent.evaluation import read_trec_run
    from r2med_agent.retrieval import make_retriever

    config = tmp_path / "mine.yaml"
    config.write_text(f"rerankers:\n  upside-down: {{kind: {toy_kind}}}\n", encoding="utf-8")
    assert main(["rerankers", "--config", str(config)]) == 0
    listed = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("upside-down")]
    assert listed == [["upside-down", toy_kind, "-", "default"]]
    out = tmp_path / "results"
    code = main(["run", "--task", "sample", "--reranker", "upside-down", "--rerank-k", "10", "--config", str(config),
                 "--output-dir", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    [result] = list(out.rglob("sample.json"))
    assert result.parent.name.startswith("bm25__rk10__entries-") and "__upside-down__" in result.parent.name
    record = json.loads(result.read_text(encoding="utf-8"))
    assert record["config"]["reranker"] == "upside-down" and record["config"]["rerank_k"] == 10
    written = read_trec_run(result.with_suffix(".run"))

    # The run file holds BM25's ranking with each top 10 reversed ...
    task = load_task("sample")
    first = make_retriever("bm25", task, show_progress=False).search(
        [SearchRequest(q.query_id, q.text) for q in task.queries], 100)
    for qid, docs in first.items():
        ranked = [d for d, _ in sorted(docs.items(), key=lambda kv: (-kv[1], kv[0]))]
        got = [d for d, _ in sorted(written.get(qid, {}).items(), key=lambda kv: -kv[1])]
        assert got == [*reversed(ranked[:10]), *ranked[10:]], qid
    # ... and its nDCG@10 is pytrec_eval's over that file (queries without results count 0).
    judged = {q: {d: int(g) for d, g in docs.items()} for q, docs in task.qrels.items() if docs}
    per_query = pytrec_eval.RelevanceEvaluator(judged, {"ndcg_cut.10"}).evaluate(
        {q: d for q, d in written.items() if q in judged and d})
    expected = sum(v["ndcg_cut_10"] for v in per_query.values()) / len(judged)
    assert record["test"]["ndcg_at_10"] == pytest.approx(expected, abs=1e-12)


def test_the_toy_kind_is_gone_after_its_test() -> None:
    assert "reverse" not in RERANKER_KINDS


def test_an_entry_is_checked_against_its_kinds_declarations(toy_kind: str) -> None:
    assert RerankerSpec(name="x", kind=toy_kind).prompt_folder is None
    with pytest.raises(ValueError, match="loads no model"):
        RerankerSpec(name="x", kind=toy_kind, model="m")
    with pytest.raises(ValueError, match="'llm' and 'format' are for the LLM kinds"):
        RerankerSpec(name="x", kind=toy_kind, llm="smollm2")
    with pytest.raises(ValueError, match="run_scores is for kind listwise"):
        RerankerSpec(name="x", kind="groupwise", llm="smollm2", run_scores="positional")
    with pytest.raises(ValueError, match="kind must be one of cross-encoder, listwise"):
        RerankerSpec(name="x", kind="pairwise", llm="smollm2")


def test_the_built_in_kinds_declare_what_they_do() -> None:
    cases: dict[str, dict[str, Any]] = {
        # entry: (uses an LLM, has a model, batches tasks, prompt folder, follows published code)
        "monobert": dict(uses_llm=False, has_model=True, batches_tasks=False, folder=None, published=False),
        "smollm2-listwise": dict(uses_llm=True, has_model=False, batches_tasks=True, folder="rerank-listwise",
                                 published=False),
        "reasonrank-7b": dict(uses_llm=True, has_model=False, batches_tasks=True,
                              folder="rerank-listwise-reasonrank", published=True),
        "smollm2-insertrank": dict(uses_llm=True, has_model=False, batches_tasks=True,
                                   folder="rerank-listwise-insertrank", published=False),
        "rank1-7b": dict(uses_llm=True, has_model=False, batches_tasks=True, folder="rerank-pointwise-rank1",
                         published=True),
        "smollm2-pointwise": dict(uses_llm=True, has_model=False, batches_tasks=True, folder="rerank-pointwise",
                                  published=False),
        "grouprank-32b": dict(uses_llm=True, has_model=False, batches_tasks=True, folder="rerank-groupwise",
                              published=True),
        "rank-r1-14b": dict(uses_llm=True, has_model=False, batches_tasks=True, folder="rerank-setwise",
                            published=True),
    }
    for name, want in cases.items():
        entry = get_reranker_spec(name)
        kind = entry.kind_of
        got = dict(uses_llm=kind.uses_llm, has_model=kind.has_model, batches_tasks=kind.batches_tasks,
                   folder=entry.prompt_folder, published=follows_published_code(entry))
        assert got == want, name


def test_a_builder_must_batch_as_its_kind_declares(monkeypatch: pytest.MonkeyPatch) -> None:
    from r2med_agent.config import register_entry
    from r2med_agent.rerank.factory import make_reranker

    from r2med_agent import config

    monkeypatch.setitem(RERANKER_KINDS, "liar", RerankerKind(ReverseReranker, batches_tasks=True))
    register_entry("rerankers", "liar", {"kind": "liar"})
    try:
        with pytest.raises(ConfigError, match="declares batches_tasks=True"):
            make_reranker("liar")
    finally:  # the entry goes with its kind: a later test would read a registry with an unknown kind
        config._PYTHON_ENTRIES.get("rerankers", {}).pop("liar", None)
        config._registry_cache.clear()
    with pytest.raises(ConfigError, match="unknown reranker option"):
        make_reranker("monobert", colour="red")
