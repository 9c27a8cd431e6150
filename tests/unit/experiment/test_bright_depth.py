"""A run's top 100 is the first 100 of its top 1000 on a BRIGHT-layout task, where most documents
score 0 under ``bm25-compat`` (issue 35, item 6).

BRIGHT ranks every query 1000 deep (``get_scores`` and ``retrieval_bm25``: a stable sort by score,
its first 1000) and scores that list with pytrec_eval, which orders equal scores by document id.
Cut at 100 by the same stable sort, the zero-score documents kept are the first ones of the corpus;
in BRIGHT's 1000-deep list trec_eval ranks the largest ids of its zeros first. The task built here
puts a relevant zero-score document where the two differ, so the default depth must rank as BRIGHT
does at 1000 for the run to score as BRIGHT's code. tests/conformance/test_bright.py runs BRIGHT's
own ``run.py`` on a task of this shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from r2med_agent.cli.app import main
from r2med_agent.evaluation import read_trec_run
from tests.bright_fixture import example_row, write_jsonl

TOPICS = ("moths light compass", "nostril nasal cycle", "sleep memory hippocampus", "plants chloroplast energy")
PER_TOPIC = 30
N_DOCS = 1200


def zero_heavy_docs() -> dict[str, str]:
    """``d0000``...: 30 documents per topic first (each matching its topic's query), then filler
    that matches no query, ids ascending in corpus order."""
    docs = {}
    for i in range(N_DOCS):
        topic = i // PER_TOPIC
        text = f"{TOPICS[topic]} passage {i}" if topic < len(TOPICS) else f"granite boulder quarry {i}"
        docs[f"d{i:04d}"] = text
    return docs


def zero_heavy_examples() -> list[dict]:
    """One query per topic: a matching document and a filler document (score 0) relevant;
    the second query excludes a filler document, as BRIGHT's ``excluded_ids`` do."""
    out = []
    for j, topic in enumerate(TOPICS):
        out.append({"id": f"q{j}", "query": topic, "gold_ids": [f"d{j * PER_TOPIC + 3:04d}", f"d{990 + j:04d}"],
                    "excluded_ids": ["d0998"] if j == 1 else ["N/A"]})
    return out


def make_zero_heavy(root: Path, split: str = "ties", fmt: str = "jsonl") -> Path:
    from tests.bright_fixture import SHARD, write_parquet

    write = write_jsonl if fmt == "jsonl" else write_parquet
    name = f"{split}.jsonl" if fmt == "jsonl" else f"{split}{SHARD}"
    write(root / "examples" / name, [example_row(e) for e in zero_heavy_examples()])
    write(root / "documents" / name, [{"id": k, "content": v} for k, v in zero_heavy_docs().items()])
    return root


def brights_ranking(scores: dict[str, float], excluded: list[str]) -> dict[str, float]:
    """BRIGHT's list of one query: the excluded ids out, a stable sort by score, its first 1000."""
    kept = [(d, s) for d, s in scores.items() if d not in set(excluded)]
    return dict(sorted(kept, key=lambda x: x[1], reverse=True)[:1000])


def _run(root: Path, out: Path, *extra: str) -> Path:
    code = main(["run", "--task", "ties", "--data-dir", str(root), "--retriever", "bm25-compat", "--no-progress",
                 "-o", str(out), *extra])
    assert code == 0
    return next(out.rglob("ties.json"))


def test_the_top_100_is_the_first_100_of_the_top_1000_and_scores_as_brights_code(tmp_path: Path) -> None:
    import pytrec_eval

    from tests.unit.experiment.test_bright_runs import gensim_scores

    root = make_zero_heavy(tmp_path / "data")
    at_100 = _run(root, tmp_path / "k100")
    at_1000 = _run(root, tmp_path / "k1000", "--top-k", "1000")
    run_100, run_1000 = read_trec_run(at_100.with_suffix(".run")), read_trec_run(at_1000.with_suffix(".run"))
    for qid, ranking in run_100.items():
        assert list(ranking) == list(run_1000[qid])[:100], qid
        assert ranking == {d: run_1000[qid][d] for d in list(run_1000[qid])[:100]}
    # BRIGHT's own ordering over gensim's scores: its 1000-deep list, scored by pytrec_eval
    docs = zero_heavy_docs()
    theirs = {e["id"]: brights_ranking(gensim_scores(docs, e["query"]), e["excluded_ids"])
              for e in zero_heavy_examples()}
    qrels = {e["id"]: {g: 1 for g in e["gold_ids"]} for e in zero_heavy_examples()}
    scored = pytrec_eval.RelevanceEvaluator(qrels, {"recall.10,100", "ndcg_cut.10,100"}).evaluate(theirs)
    mine, deep = json.loads(at_100.read_text())["test"], json.loads(at_1000.read_text())["test"]
    for ours, trec in (("recall_at_100", "recall_100"), ("ndcg_at_100", "ndcg_cut_100"), ("ndcg_at_10", "ndcg_cut_10")):
        want = float(np.mean([v[trec] for v in scored.values()]))
        assert mine[ours] == pytest.approx(want, abs=1e-12), ours
        assert mine[ours] == pytest.approx(deep[ours], abs=1e-12), ours
    assert mine["recall_at_100"] == 1.0  # every relevant filler document is in BRIGHT's top 100
    record = json.loads(at_100.read_text())
    assert record["stats"]["excluded_removed"] == 1 and "d0998" not in run_100["q1"]
