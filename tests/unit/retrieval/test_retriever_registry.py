"""The retriever registry: a kind of retriever defined here and registered with one line runs end
to end through ``r2med run``; make_retriever's keywords and its typed options build the same
thing; names registered from Python are checked and can be removed."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from r2med_agent.errors import ConfigError
from r2med_agent.retrieval import make_retriever, register_retriever, retriever_names, unregister_retriever
from r2med_agent.retrieval.bm25.retriever import BM25Options
from r2med_agent.retrieval.dense.spec import EncoderOptions
from r2med_agent.retrieval.fusion import FusionOptions
from r2med_agent.retrieval.registry import RETRIEVER_KINDS, RetrieverKind, RetrieverOptions
from r2med_agent.types import Run, SearchRequest, Task

TOY = "toy-word-overlap"


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


class WordOverlapRetriever:
    """Ranks documents by how many distinct query words they contain (ties by document id)."""

    name = TOY

    def __init__(self, task: Task) -> None:
        self.words = {d.doc_id: _words(d.full_text) for d in task.corpus}

    def search(self, requests: Sequence[SearchRequest], k: int) -> Run:
        run: Run = {}
        for r in requests:
            query = _words(r.query)
            counts = [(len(query & words), doc_id) for doc_id, words in self.words.items()]
            top = sorted((c for c in counts if c[0] > 0), key=lambda c: (-c[0], c[1]))[:k]
            run[r.query_id] = {doc_id: float(n) for n, doc_id in top}
        return run


@pytest.fixture
def toy_kind(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The toy kind in the registry for one test (monkeypatch takes it out again)."""
    monkeypatch.setitem(RETRIEVER_KINDS, "toy", RetrieverKind(lambda: [TOY], lambda word, task, options: WordOverlapRetriever(task)))
    yield TOY


def test_a_registered_kind_runs_end_to_end_through_the_cli(toy_kind: str, tmp_path: Path, capsys) -> None:
    import pytrec_eval

    from r2med_agent.cli.app import main
    from r2med_agent.data import load_task
    from r2med_agent.evaluation import read_trec_run

    assert toy_kind in retriever_names()
    code = main(["run", "--task", "sample", "--retriever", toy_kind, "--output-dir", str(tmp_path), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    leaf = tmp_path / "none" / "none" / toy_kind
    record = json.loads((leaf / "sample.json").read_text(encoding="utf-8"))
    written = read_trec_run(leaf / "sample.run")

    # The run file holds the toy's own ranking ...
    task = load_task("sample")
    ours = WordOverlapRetriever(task).search([SearchRequest(q.query_id, q.text) for q in task.queries], 100)
    assert {q: set(d) for q, d in written.items() if d} == {q: set(d) for q, d in ours.items() if d}
    # ... and its nDCG@10 is pytrec_eval's over that file (queries without results count 0).
    judged = {q: {d: int(g) for d, g in docs.items()} for q, docs in task.qrels.items() if docs}
    per_query = pytrec_eval.RelevanceEvaluator(judged, {"ndcg_cut.10"}).evaluate(
        {q: d for q, d in written.items() if q in judged and d}
    )
    expected = sum(v["ndcg_cut_10"] for v in per_query.values()) / len(judged)
    assert 0.0 < expected < 1.0
    assert record["test"]["ndcg_at_10"] == pytest.approx(expected, abs=1e-12)


def test_the_toy_kind_is_gone_after_its_test() -> None:
    assert TOY not in retriever_names() and "toy" not in RETRIEVER_KINDS


def test_keywords_and_options_are_the_same_settings(tmp_path: Path) -> None:
    got = RetrieverOptions.from_keywords(
        show_progress=False, precision="float16", encoder_backend="transformers", device=None,
        k1=1.2, index_root=tmp_path, fusion="weighted", weights=[1.0, 2.0],
    )
    assert got == RetrieverOptions(
        encoder=EncoderOptions(show_progress=False, precision="float16", backend="transformers"),
        bm25=BM25Options(k1=1.2, index_root=tmp_path, show_progress=False),
        fusion=FusionOptions(method="weighted", weights=[1.0, 2.0]),
    )
    assert RetrieverOptions.from_keywords() == RetrieverOptions()  # no fusion options: None
    with pytest.raises(ConfigError, match="unknown retriever option"):
        RetrieverOptions.from_keywords(colour="red")


def test_make_retriever_takes_options_or_keywords_not_both(toy_kind: str) -> None:
    from r2med_agent.data import load_task

    task = load_task("sample")
    assert isinstance(make_retriever(toy_kind, task, options=RetrieverOptions()), WordOverlapRetriever)
    with pytest.raises(ConfigError, match="options= or keywords, not both"):
        make_retriever(toy_kind, task, options=RetrieverOptions(), show_progress=False)
    with pytest.raises(ConfigError, match="fusion options need a '\\+'-joined spec"):
        make_retriever(toy_kind, task, options=RetrieverOptions(fusion=FusionOptions()))


def test_python_registered_names_are_checked_and_removable() -> None:
    for taken in ("bm25", "minilm", "nano-bm25"):
        with pytest.raises(ConfigError, match="taken by the registry"):
            register_retriever(taken, WordOverlapRetriever)
    with pytest.raises(ConfigError, match="without"):
        register_retriever("a+b", WordOverlapRetriever)
    before = retriever_names()
    try:
        register_retriever(TOY, WordOverlapRetriever)
        after = retriever_names()
        assert len(after) == len(before) + 1 and set(after) == {*before, TOY}
    finally:
        unregister_retriever(TOY)
    assert TOY not in retriever_names()
