"""Evaluation: parity with a plain pytrec_eval call, hand-computed nDCG, missing queries, ties."""

from __future__ import annotations

import math

import pytest
import pytrec_eval

from r2med_agent.errors import ConfigError, DataError
from r2med_agent.evaluation import (
    DEFAULT_METRICS,
    average_over_tasks,
    evaluate,
    read_trec_run,
    trec_sorted,
    truncate,
    write_trec_run,
)

QRELS = {
    "q1": {"d1": 1, "d3": 2, "d9": 1},
    "q2": {"d2": 1},
    "q3": {"d4": 1},
}
RUN = {
    "q1": {"d1": 3.0, "d2": 2.5, "d3": 2.0, "d4": 1.0, "d5": 0.5},
    "q2": {"d7": 1.2, "d2": 0.9, "d8": 0.1},
    "q3": {"d4": 5.0, "d1": 4.0},
}


def _ndcg_at_k(ranking: list[str], rels: dict[str, int], k: int) -> float:
    """trec_eval's ndcg_cut: gain = grade, discount log2(rank + 1), ideal from the qrels."""
    dcg = sum(rels.get(d, 0) / math.log2(i + 2) for i, d in enumerate(ranking[:k]))
    ideal = sorted(rels.values(), reverse=True)
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal[:k]))
    return dcg / idcg if idcg else 0.0


def test_ndcg_matches_hand_computation():
    ev = evaluate(RUN, QRELS, ["ndcg_at_10", "ndcg_at_1"])
    # q1 ranking d1 d2 d3 d4 d5 with grades 1 0 2 0 0; ideal 2 1 1.
    q1 = (1 / math.log2(2) + 2 / math.log2(4)) / (2 + 1 / math.log2(3) + 1 / math.log2(4))
    assert ev.per_query["q1"]["ndcg_at_10"] == pytest.approx(q1, abs=1e-12)
    assert ev.per_query["q2"]["ndcg_at_10"] == pytest.approx(1 / math.log2(3), abs=1e-12)
    assert ev.per_query["q3"]["ndcg_at_10"] == pytest.approx(1.0)
    assert ev.per_query["q2"]["ndcg_at_1"] == 0.0
    for qid, ranking in RUN.items():
        order = [d for d, _ in trec_sorted(ranking)]
        assert ev.per_query[qid]["ndcg_at_10"] == pytest.approx(_ndcg_at_k(order, QRELS[qid], 10))
    assert ev.mean["ndcg_at_10"] == pytest.approx((q1 + 1 / math.log2(3) + 1.0) / 3)


def _random_run_and_qrels(seed: int) -> tuple[dict, dict]:
    """30 queries, 100 documents each (so the depth cut changes nothing), tied scores, graded
    qrels with relevant documents at every depth and some never retrieved."""
    import random

    rng = random.Random(seed)
    run, qrels = {}, {}
    for q in range(30):
        docs = [f"d{i}" for i in rng.sample(range(400), 100)]
        run[f"q{q}"] = {d: float(rng.randint(0, 40)) / 4 for d in docs}  # many ties
        judged = rng.sample(docs, rng.randint(1, 12)) + [f"x{q}-{i}" for i in range(rng.randint(0, 3))]
        qrels[f"q{q}"] = {d: rng.randint(1, 3) for d in judged}
    return run, qrels


# every metric of docs/protocol.md -> the key pytrec_eval reports it under (written out, not derived)
_TREC_KEYS = {
    **{f"ndcg_at_{k}": f"ndcg_cut_{k}" for k in (1, 10, 25, 50, 100)},
    **{f"map_at_{k}": f"map_cut_{k}" for k in (1, 10, 25, 50, 100)},
    **{f"recall_at_{k}": f"recall_{k}" for k in (1, 10, 25, 50, 100)},
    **{f"precision_at_{k}": f"P_{k}" for k in (1, 10, 25, 50, 100)},
    "mrr": "recip_rank",
}


@pytest.mark.parametrize("seed", [0, 1])
def test_parity_with_plain_pytrec_eval_on_every_metric(seed):
    run, qrels = _random_run_and_qrels(seed)
    assert set(_TREC_KEYS) == set(DEFAULT_METRICS) and len(DEFAULT_METRICS) == 21
    ev = evaluate(run, qrels)
    raw = pytrec_eval.RelevanceEvaluator(
        qrels, {"ndcg_cut.1,10,25,50,100", "map_cut.1,10,25,50,100", "recall.1,10,25,50,100",
                "P.1,10,25,50,100", "recip_rank"}
    ).evaluate(run)
    assert set(raw) == set(qrels) == set(ev.per_query)
    for qid in qrels:
        for metric, key in _TREC_KEYS.items():
            assert ev.per_query[qid][metric] == raw[qid][key], (qid, metric)
    for metric, key in _TREC_KEYS.items():
        assert ev.mean[metric] == pytest.approx(sum(raw[q][key] for q in qrels) / len(qrels), abs=1e-15)
    assert all(type(v) is float for v in ev.mean.values())
    assert all(type(v) is float for q in ev.per_query.values() for v in q.values())
    assert ev.missing == ()
    # the data tells every cut-off of a family apart (so a cut-off mix-up could not pass)
    for family in ("ndcg", "map", "recall", "precision"):
        vectors = {k: [ev.per_query[q][f"{family}_at_{k}"] for q in sorted(qrels)]
                   for k in (1, 10, 25, 50, 100)}
        assert all(vectors[a] != vectors[b] for a in vectors for b in vectors if a < b), family


def test_parity_with_plain_pytrec_eval_when_no_query_is_missing():
    ev = evaluate(RUN, QRELS)
    raw = pytrec_eval.RelevanceEvaluator(
        QRELS, {"ndcg_cut.1,10,25,50,100", "map_cut.1,10,25,50,100", "recall.1,10,25,50,100",
                "P.1,10,25,50,100", "recip_rank"}
    ).evaluate(RUN)
    for qid in QRELS:
        for metric, key in _TREC_KEYS.items():
            assert ev.per_query[qid][metric] == raw[qid][key], (qid, metric)


def test_missing_query_scores_zero_and_is_counted():
    qrels = {"q1": {"d1": 1}, "q2": {"d2": 1}}
    run = {"q1": {"d1": 1.0}}
    # The trap: plain pytrec_eval averages only over q1.
    raw = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut"}).evaluate(run)
    assert list(raw) == ["q1"]
    ev = evaluate(run, qrels, ["ndcg_at_10"])
    assert ev.mean["ndcg_at_10"] == 0.5
    assert ev.per_query["q2"]["ndcg_at_10"] == 0.0
    assert ev.missing == ("q2",)
    assert ev.num_queries == 2
    # An empty ranking counts as missing too; a run query outside the qrels is ignored.
    ev = evaluate({"q1": {"d1": 1.0}, "q2": {}, "zz": {"d1": 1.0}}, qrels, ["ndcg_at_10"])
    assert ev.mean["ndcg_at_10"] == 0.5 and ev.missing == ("q2",)
    ev = evaluate({}, qrels, ["mrr"])
    assert ev.mean["mrr"] == 0.0 and ev.missing == ("q1", "q2")


def test_ties_are_broken_as_trec_eval_does():
    # Equal scores: trec_eval ranks the larger document id first.
    ranking = {"a": 1.0, "c": 1.0, "b": 1.0, "z": 2.0}
    assert [d for d, _ in trec_sorted(ranking)] == ["z", "c", "b", "a"]
    qrels = {"q": {"a": 1}}
    ev = evaluate({"q": ranking}, qrels, ["mrr"])
    raw = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate({"q": ranking})
    assert ev.per_query["q"]["mrr"] == raw["q"]["recip_rank"] == 0.25


def test_depth_cut_keeps_trec_eval_top_documents():
    run = {"q": {f"d{i:03d}": float(i // 2) for i in range(300)}}
    cut = truncate(run, 100)
    assert len(cut["q"]) == 100
    assert [d for d, _ in trec_sorted(cut["q"])] == [d for d, _ in trec_sorted(run["q"])][:100]
    # A relevant document below rank 100 does not count.
    qrels = {"q": {"d000": 1}}
    assert evaluate(run, qrels, ["recall_at_300"]).mean["recall_at_300"] == 0.0
    assert evaluate(run, qrels, ["recall_at_300"], depth=300).mean["recall_at_300"] == 1.0


def test_unknown_metric_names_allowed_forms():
    with pytest.raises(ConfigError, match="ndcg_at_10"):
        evaluate(RUN, QRELS, ["ndgc@10"])


def test_metrics_beyond_the_depth_are_left_out():
    from r2med_agent.evaluation import metrics_within_depth

    assert metrics_within_depth(DEFAULT_METRICS, 100) == DEFAULT_METRICS
    assert metrics_within_depth(DEFAULT_METRICS, 25) == (
        "ndcg_at_1", "ndcg_at_10", "ndcg_at_25", "map_at_1", "map_at_10", "map_at_25",
        "recall_at_1", "recall_at_10", "recall_at_25", "precision_at_1", "precision_at_10",
        "precision_at_25", "mrr",
    )
    assert metrics_within_depth(["mrr", "ndcg_at_10"], 1) == ("mrr",)


def test_average_over_tasks_is_unweighted():
    assert average_over_tasks([{"m": 1.0, "x": 2.0}, {"m": 0.0}]) == {"m": 0.5}
    assert average_over_tasks([]) == {}


def test_trec_run_round_trip(tmp_path):
    path = tmp_path / "run.trec"
    path.write_text(write_trec_run(RUN, "tag"))
    lines = path.read_text().splitlines()
    assert lines[0] == "q1 Q0 d1 1 3.000000 tag"
    back = read_trec_run(path)
    assert {q: list(r) for q, r in back.items()} == {
        q: [d for d, _ in trec_sorted(r)] for q, r in RUN.items()
    }


def test_bad_run_lines_name_file_and_line(tmp_path):
    run = tmp_path / "bad.run"
    run.write_text("q1 Q0 d1 1 1.0 t\nq1 Q0 d2 2 x t\n")
    with pytest.raises(DataError, match=r"bad\.run:2: score 'x'"):
        read_trec_run(run)
    run.write_text("q1 Q0 d1 1 1.0\n")
    with pytest.raises(DataError, match=r"bad\.run:1: expected 6 columns"):
        read_trec_run(run)
    with pytest.raises(DataError, match=r"missing\.run: cannot read run file"):
        read_trec_run(tmp_path / "missing.run")
    # Qrels files are read by the data layer (r2med_agent.data.read_qrels_file, tested there).


@pytest.mark.parametrize(
    "raw, line, pattern",
    [
        (b"\xff\xfeq\x001\x00", 1, "UTF-16 byte-order mark"),
        (b"q1 Q0 d1 1 1.0 t\nq1 Q0 d\xe9 2 0.5 t\n", 2, r"byte 0xe9 at column 8"),
        (b"q1 Q0 d1 1 1.0 t\nq1 Q0 d2 2 nan t\n", 2, "score 'nan' is not finite"),
        (b"q1 Q0 d1 1 inf t\n", 1, "score 'inf' is not finite"),
        (b"q1 Q0 d1 1 -Infinity t\n", 1, "score '-Infinity' is not finite"),
    ],
)
def test_undecodable_or_non_finite_run_lines_name_file_and_line(tmp_path, raw, line, pattern):
    run = tmp_path / "bad.run"
    run.write_bytes(raw)
    with pytest.raises(DataError, match=rf"bad\.run:{line}: .*{pattern}"):
        read_trec_run(run)


@pytest.mark.parametrize("depth", [0, -5, 2.5, True])
def test_depth_below_one_is_rejected(depth):
    with pytest.raises(ConfigError, match="depth must be an integer >= 1"):
        evaluate(RUN, QRELS, ["mrr"], depth=depth)


def test_trec_run_file_keeps_close_scores_apart(tmp_path):
    # Two scores equal to six decimals: rounding them would make a tie that trec_eval breaks by
    # document id (descending), putting the non-relevant "b" first when read back.
    run = {"q1": {"a": 0.12345661, "b": 0.12345649}}
    qrels = {"q1": {"a": 1}}
    path = tmp_path / "close.run"
    path.write_text(write_trec_run(run, "tag"))
    back = read_trec_run(path)
    assert back == run
    assert evaluate(back, qrels, ["mrr"]).mean == evaluate(run, qrels, ["mrr"]).mean == {"mrr": 1.0}
