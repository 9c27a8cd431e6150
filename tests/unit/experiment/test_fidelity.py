"""Run settings the paper's rows need: rerankers keep only the reranked top k, LameR's first pass
is an explicit, recorded retriever."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import pytest

from r2med_agent.errors import ConfigError
from r2med_agent.evaluation import evaluate, read_trec_run
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.experiment.runner import cut_run
from r2med_agent.api import RunConfig, run_experiment
from r2med_agent.types import Run, SearchRequest
from tests.fakes import ScriptedLLM


class ReversingReranker:
    """Scripted reranker (unit test): the top k in reverse order, above the rest."""

    name = "reverse"
    batches_tasks = False

    def check(self) -> None:
        pass

    def rerank(self, requests: Sequence[SearchRequest], run: Run, corpus: Mapping[str, str], k: int) -> Run:
        out: Run = {}
        for qid, docs in run.items():
            ranked = [d for d, _ in sorted(docs.items(), key=lambda kv: -kv[1])]
            head, tail = ranked[:k][::-1], ranked[k:]
            out[qid] = {d: 1000.0 - i for i, d in enumerate(head)}
            out[qid].update({d: float(-i) for i, d in enumerate(tail)})
        return out


def test_cut_run_keeps_the_k_best_in_order() -> None:
    run = {"q": {"a": 1.0, "b": 3.0, "c": 2.0, "d": 3.0}}
    assert list(cut_run(run, 2)["q"].items()) == [("b", 3.0), ("d", 3.0)]
    assert cut_run(run, 10) == {"q": {"b": 3.0, "d": 3.0, "c": 2.0, "a": 1.0}}


@pytest.mark.parametrize("cut", [False, True])
def test_rerank_cut_keeps_only_the_reranked_depth(tmp_path, monkeypatch, cut) -> None:
    """As R2MED's reranker files: the reranked top 10 alone, scored at depth 100, so Recall@100
    equals Recall@10."""
    monkeypatch.setattr("r2med_agent.retrieval.make_reranker", lambda name, **_: ReversingReranker())
    # The scripted reranker has no registry entry whose precision the result could record.
    monkeypatch.setattr("r2med_agent.experiment.runner.model_precisions", lambda cfg: {})
    cfg = RunConfig(tasks=("sample",), reranker="reverse", rerank_k=10, rerank_cut=cut, output_dir=tmp_path,
                    show_progress=False)
    result = run_experiment(cfg)
    assert result.result_dir.name == cfg.leaf == (
        f"bm25__top10__reverse__{cfg.digest()}" if cut else f"bm25__rk10__reverse__{cfg.digest()}")
    written = read_trec_run(result.result_dir / "sample.run")
    base = run_experiment(RunConfig(tasks=("sample",), output_dir=tmp_path, show_progress=False))
    plain = read_trec_run(base.result_dir / "sample.run")
    for qid, docs in written.items():
        top10 = sorted(plain[qid], key=lambda d: -plain[qid][d])[:10]
        ranked = sorted(docs, key=lambda d: -docs[d])
        assert ranked[:10] == top10[::-1]
        assert len(ranked) == (10 if cut else len(plain[qid]))
    record = json.loads((result.result_dir / "sample.json").read_text())
    assert record["depth"] == 100 and record["config"]["rerank_cut"] is cut
    if cut:
        scores = record["test"]
        assert scores["recall_at_100"] == scores["recall_at_10"] == scores["recall_at_25"]
        # scored as trec_eval scores the same 10 documents
        from r2med_agent.data import load_task

        ev = evaluate(cut_run(ReversingReranker().rerank([], plain, {}, 10), 10), load_task("sample").qrels)
        assert scores["ndcg_at_10"] == pytest.approx(ev.mean["ndcg_at_10"])


def test_rerank_cut_needs_a_reranker() -> None:
    with pytest.raises(ConfigError, match="--rerank-cut needs --reranker"):
        RunConfig(tasks=("sample",), rerank_cut=True)


def test_lamer_first_pass_is_the_chosen_retriever_and_recorded(tmp_path, monkeypatch) -> None:
    from r2med_agent.data import load_task
    from r2med_agent.llm.registry import LLMSpec
    from r2med_agent.methods.expansion import cut_words
    from r2med_agent.retrieval import make_retriever

    monkeypatch.setattr("r2med_agent.llm.registry.get_llm_spec",
                        lambda name: LLMSpec(name="scripted", backend="local", model="scripted"))
    backend = ScriptedLLM(lambda messages, params: "a passage")
    llm = CachedLLM(backend, "scripted", "plain", GenerationCache(tmp_path / "gen.sqlite"))
    cfg = RunConfig(tasks=("sample",), method="lamer", llm="scripted", first_pass="bm25-compat",
                    output_dir=tmp_path, show_progress=False)
    result = run_experiment(cfg, llm=llm)
    task = load_task("sample")
    texts = {d.doc_id: d.text for d in task.corpus}
    compat = make_retriever("bm25-compat", task, show_progress=False).search(
        [SearchRequest(q.query_id, q.text) for q in task.queries], 10)
    prompts = [p[-1]["content"] for p in backend.calls[0]]
    for q, prompt in zip(task.queries, prompts):
        top = sorted(compat[q.query_id], key=lambda d: -compat[q.query_id][d])
        positions = [prompt.index(cut_words(texts[d], 512)) for d in top]
        assert positions == sorted(positions), q.query_id  # shown in bm25-compat's rank order
    record = json.loads((result.result_dir / "sample.json").read_text())
    assert record["config"]["first_pass"] == "bm25-compat"
    with pytest.raises(ConfigError, match="--first-pass is LameR's"):
        RunConfig(tasks=("sample",), method="hyde", llm="x", first_pass="bm25-compat")
