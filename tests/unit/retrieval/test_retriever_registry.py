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
from r2med_agent.retrieval.registry import RETRIEVER_KINDS, RetrieverKind, RetrieverOptions, TextQueryRetriever
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
    """The toy kind in the registry for one test (monkeypatch takes it out again): the one line
    a new kind takes. ``combine="text"``: the registry gives it each request's query text, so a
    method's expansion reaches it though it reads ``request.query`` alone."""
    monkeypatch.setitem(RETRIEVER_KINDS, "toy", RetrieverKind(
        lambda: [TOY], lambda word, task, options: WordOverlapRetriever(task), combine="text"))
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
    built = make_retriever(toy_kind, task, options=RetrieverOptions())
    assert isinstance(built, TextQueryRetriever) and isinstance(built.inner, WordOverlapRetriever)
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


def test_a_text_kind_searches_the_query_text_its_rule_gives(toy_kind: str) -> None:
    """The registry applies the combine rule for a ``text`` kind: the toy, which reads only
    ``request.query``, gets HyDE's passage, Query2Doc's query-query-passage, the plain query."""
    from r2med_agent.data import load_task

    seen: list[str] = []

    class Recorder(WordOverlapRetriever):
        def search(self, requests: Sequence[SearchRequest], k: int) -> Run:
            seen.extend(r.query for r in requests)
            assert all(r.combine == "none" for r in requests)
            return super().search(requests, k)

    RETRIEVER_KINDS["toy"] = RetrieverKind(lambda: [TOY], lambda word, task, options: Recorder(task), combine="text")
    retriever = make_retriever(toy_kind, load_task("sample"))
    retriever.search([SearchRequest("q", "fever", "a passage", "hyde"), SearchRequest("r", "cough", "notes", "query2doc"),
                      SearchRequest("s", "rash")], 10)
    assert seen == ["a passage", "cough cough notes", "rash"]


def test_every_kind_declares_how_it_combines_an_expansion() -> None:
    with pytest.raises(TypeError, match="combine"):
        RetrieverKind(lambda: ["x"], lambda word, task, options: None)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="combine must be one of text, own, fixed"):
        RetrieverKind(lambda: ["x"], lambda word, task, options: None, combine="mix")  # type: ignore[arg-type]
    from r2med_agent.retrieval.registry import retriever_kind

    declared = {word: (retriever_kind(word).combine, retriever_kind(word).has_model)
                for word in ("bm25", "bm25-compat", "minilm", "nano-bm25", "hakari-hybrid", "candidates")}
    assert declared == {"bm25": ("own", False), "bm25-compat": ("own", False), "minilm": ("own", True),
                        "nano-bm25": ("fixed", False), "hakari-hybrid": ("fixed", True), "candidates": ("fixed", False)}


def test_the_spec_reads_what_a_kind_declares(toy_kind: str) -> None:
    from r2med_agent.experiment.resolve import resolve_spec
    from r2med_agent.experiment.spec import RunSpec

    # No model: --precision and --encoder-backend play no part (no `toy-word-overlap__float16__...`).
    assert resolve_spec(RunSpec(retriever=toy_kind, precision="float16")) == resolve_spec(RunSpec(retriever=toy_kind))
    assert resolve_spec(RunSpec(retriever="minilm", precision="float16")).precision == "float16"
    # A registered retriever declares the same; a fixed list refuses an LLM's queries before any work.
    try:
        register_retriever("fixed-toy", WordOverlapRetriever, combine="fixed")
        with pytest.raises(ConfigError, match="fixed-toy answer the task's own queries from a fixed list"):
            resolve_spec(RunSpec(method="hyde", llm="smollm2", retriever="bm25+fixed-toy"))
        assert resolve_spec(RunSpec(retriever="fixed-toy", precision="float16")).precision is None
    finally:
        unregister_retriever("fixed-toy")
    with pytest.raises(ConfigError, match="nano-bm25 answer the task's own queries"):
        resolve_spec(RunSpec(method="hyde", llm="smollm2", retriever="nano-bm25"))
