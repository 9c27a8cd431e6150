"""NanoR2MED's candidate rankings (the card's BM25, dense and reranking-hybrid profiles) on a
small split in NanoR2MED's layout: the shipped lists read and scored as the card scores them, the
hybrid list rebuilt, the rank-101 safeguard, and the card's numbers beside ours in compare."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from r2med_agent import data
from r2med_agent.errors import ConfigError, DataError
from r2med_agent.retrieval import make_retriever, retriever_names
from r2med_agent.retrieval.candidates import (
    HYBRID_TOP,
    CandidateRetriever,
    HybridRetriever,
    hybrid_ranking,
)
from r2med_agent.types import SearchRequest

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

SPLIT = "NanoR2MEDBiology"
N_DOCS = 400
N_QUERIES = 12
SEED = 20260524  # HAKARI-Bench's reranking-hybrid builder default


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def reference_hybrid(bm25: list[str], dense: list[str], positives: set[str], qid: str) -> list[str]:
    """The reranking_hybrid row as HAKARI-Bench's builder describes it, written out independently:
    RRF k=100 over both lists, ties by best rank then id, top 100, then a seeded positive at 101
    when the 100 hold none."""
    rank_b = {d: i + 1 for i, d in enumerate(bm25)}
    rank_d = {d: i + 1 for i, d in enumerate(dense)}
    docs = set(rank_b) | set(rank_d)

    def score(d: str) -> float:
        return sum(1.0 / (100 + r[d]) for r in (rank_b, rank_d) if d in r)

    def best(d: str) -> int:
        return min(r[d] for r in (rank_b, rank_d) if d in r)

    top = sorted(docs, key=lambda d: (-score(d), best(d), d))[:100]
    if positives and not positives & set(top):
        top.append(random.Random(f"{SEED}\0{SPLIT}\0{qid}\0positive_safeguard").choice(sorted(positives)))
    return top


def make_split(root: Path) -> dict:
    """A NanoR2MED-layout folder with one split: task files plus the three candidate subsets.

    Rankings are random permutations of the corpus (BM25 and dense top-150 each); query q0's
    positives sit deep in both lists so the fused top 100 misses them (a safeguard row)."""
    rng = random.Random(7)
    doc_ids = [f"d{i:03d}" for i in range(N_DOCS)]
    qids = [f"q{i}" for i in range(N_QUERIES)]
    corpus = [{"_id": d, "text": f"passage {d} about cells"} for d in doc_ids]
    queries = [{"_id": q, "text": f"question {q} about biology"} for q in qids]
    qrels: dict[str, set[str]] = {}
    bm25: dict[str, list[str]] = {}
    dense: dict[str, list[str]] = {}
    for q in qids:
        b = rng.sample(doc_ids, 150)
        d = rng.sample(doc_ids, 150)
        if q == "q0":
            deep = [x for x in doc_ids if x not in b[:120] and x not in d[:120]][:2]
            qrels[q] = set(deep)
        else:
            qrels[q] = set(rng.sample(b[:30] + d[:30], 3))
        bm25[q], dense[q] = b, d
    hybrid = {q: reference_hybrid(bm25[q], dense[q], qrels[q], q) for q in qids}
    _write(root / "corpus" / f"{SPLIT}.parquet", corpus)
    _write(root / "queries" / f"{SPLIT}.parquet", queries)
    _write(root / "qrels" / f"{SPLIT}.parquet",
           [{"query-id": q, "corpus-id": d} for q in qids for d in sorted(qrels[q])])
    for subset, lists in (("bm25", bm25), ("harrier_oss_v1_270m", dense), ("reranking_hybrid", hybrid)):
        _write(root / subset / f"{SPLIT}-00000-of-00001.parquet",
               [{"query-id": q, "corpus-ids": lists[q]} for q in qids])
    return {"qrels": qrels, "bm25": bm25, "dense": dense, "hybrid": hybrid, "queries": queries}


def card_ndcg10(lists: dict[str, list[str]], qrels: dict[str, set[str]]) -> float:
    """nDCG@10 as the card computes it: binary gains of the list as ordered, mean over queries."""
    vals = []
    for q, pos in qrels.items():
        dcg = sum(1 / math.log2(i + 2) for i, d in enumerate(lists[q][:10]) if d in pos)
        idcg = sum(1 / math.log2(i + 2) for i in range(min(len(pos), 10)))
        vals.append(dcg / idcg)
    return sum(vals) / len(vals)


@pytest.fixture()
def split(tmp_path: Path):
    root = tmp_path / "NanoR2MED"
    made = make_split(root)
    task = data.load_task("nano-Biology", data_dir=root, allow_count_mismatch=True)
    return root, task, made


def requests_of(task) -> list[SearchRequest]:
    return [SearchRequest(q.query_id, q.text) for q in task.queries]


def order(run_for_query: dict[str, float]) -> list[str]:
    return [d for d, _ in sorted(run_for_query.items(), key=lambda kv: (-kv[1], kv[0]))]


def test_the_fixture_has_a_safeguard_row(split) -> None:
    _, _, made = split
    assert len(made["hybrid"]["q0"]) == HYBRID_TOP + 1
    assert made["hybrid"]["q0"][-1] in made["qrels"]["q0"]
    assert all(len(made["hybrid"][q]) == HYBRID_TOP for q in made["hybrid"] if q != "q0")


def test_read_nano_candidates_returns_each_list_in_order(split) -> None:
    root, task, made = split
    for subset, key in (("bm25", "bm25"), ("harrier_oss_v1_270m", "dense"), ("reranking_hybrid", "hybrid")):
        lists, path = data.read_nano_candidates(task, subset)
        assert lists == made[key]
        assert path.parent.name == subset


def test_shipped_lists_answer_in_their_order_and_the_safeguard_is_dropped(split) -> None:
    _, task, made = split
    reqs = requests_of(task)
    for name, key in (("nano-bm25", "bm25"), ("nano-dense", "dense")):
        run = make_retriever(name, task).search(reqs, 100)
        assert {q: order(r) for q, r in run.items()} == {q: made[key][q][:100] for q in made[key]}
    hybrid = make_retriever("nano-hybrid", task)
    assert isinstance(hybrid, CandidateRetriever) and hybrid.safeguards == 1
    run = hybrid.search(reqs, 200)  # deeper than the list: still no safeguard
    assert len(run["q0"]) == HYBRID_TOP and not set(run["q0"]) & made["qrels"]["q0"]
    kept = make_retriever("nano-hybrid-safeguard", task).search(reqs, 101)
    assert order(kept["q0"]) == made["hybrid"]["q0"]
    assert order(kept["q0"])[-1] in made["qrels"]["q0"]


def test_rebuilt_hybrid_equals_the_shipped_list(split) -> None:
    # hakari-hybrid's construction over the two shipped member lists gives the shipped
    # reranking_hybrid rows, built independently above, with and without the safeguard.
    _, task, made = split
    reqs = requests_of(task)
    bm25 = CandidateRetriever("nano-bm25", task)
    dense = CandidateRetriever("nano-dense", task)
    plain = HybridRetriever("hakari-hybrid", task, bm25, dense).search(reqs, 101)
    guarded = HybridRetriever("hakari-hybrid-safeguard", task, bm25, dense, safeguard=True).search(reqs, 101)
    for q, shipped in made["hybrid"].items():
        assert order(plain[q]) == shipped[:HYBRID_TOP]
        assert order(guarded[q]) == shipped
    # Our '+' fusion (RRF k=60, ties by id, 100 deep) is another list: the profile needs its own.
    fused = make_retriever("nano-bm25+nano-dense", task).search(reqs, 100)
    assert any(order(fused[q]) != made["hybrid"][q][:100] for q in made["hybrid"])


def test_hybrid_ties_go_to_the_better_rank_then_the_lower_id() -> None:
    # a and b tie (ranks 1 and 2 in swapped lists); c and d tie (rank 3 in one list each).
    assert hybrid_ranking(["a", "b", "c"], ["b", "a", "d"]) == ["a", "b", "c", "d"]
    assert hybrid_ranking(["b", "a", "d"], ["a", "b", "c"]) == ["a", "b", "c", "d"]
    assert hybrid_ranking(list("abc"), list("xyz"), top=2) == ["a", "x"]
    # Equal sums from different ranks: "z" at rank 1 of one list (1/101) and "a" at rank 102 of
    # both (2/202, the same float): the better single rank wins before the id.
    fill_b = [f"b{i:03d}" for i in range(100)]
    fill_d = [f"e{i:03d}" for i in range(101)]
    got = hybrid_ranking(["z", *fill_b, "a"], [*fill_d, "a"], top=200)
    assert 1 / 101 == 2 / 202 and got.index("z") < got.index("a")
    assert got.index("a") == got.index("z") + 1


def test_fixed_lists_refuse_text_they_were_not_made_for(split) -> None:
    _, task, _ = split
    q = task.queries[0]
    for name in ("nano-bm25", "nano-hybrid"):
        retriever = make_retriever(name, task)
        with pytest.raises(ConfigError, match="--method none"):
            retriever.search([SearchRequest(q.query_id, q.text, "a passage", "hyde")], 10)
        with pytest.raises(ConfigError, match="fixed ranking"):
            retriever.search([SearchRequest(q.query_id, "another query")], 10)


def test_candidate_files_are_checked_with_file_and_row(split, tmp_path: Path) -> None:
    root, task, made = split
    path = root / "bm25" / f"{SPLIT}-00000-of-00001.parquet"
    rows = [{"query-id": q, "corpus-ids": made["bm25"][q]} for q in made["bm25"]]
    rows[2] = {"query-id": "q2", "corpus-ids": ["d001", "nope"]}
    _write(path, rows)
    with pytest.raises(DataError, match=r"-00000-of-00001\.parquet:3: candidate document 'nope'"):
        data.read_nano_candidates(task, "bm25")
    rows[2] = {"query-id": "q99", "corpus-ids": ["d001"]}
    _write(path, rows)
    with pytest.raises(DataError, match=r":3: candidate row names query 'q99'"):
        data.read_nano_candidates(task, "bm25")
    rows[2] = {"query-id": "q2", "corpus-ids": ["d001", "d001"]}
    _write(path, rows)
    with pytest.raises(DataError, match=r":3: a document is listed twice"):
        data.read_nano_candidates(task, "bm25")
    _write(path, rows[:2] + rows[3:])
    with pytest.raises(DataError, match=r"parquet: no candidate row for 1 of the task's 12 queries \(q2\)"):
        data.read_nano_candidates(task, "bm25")
    path.unlink()
    with pytest.raises(DataError, match=r"missing bm25/NanoR2MEDBiology\.parquet"):
        make_retriever("nano-bm25", task)
    sample = data.load_task("sample")
    with pytest.raises(ConfigError, match="NanoR2MED splits"):
        make_retriever("nano-hybrid", sample)


def test_candidate_names_are_retrievers() -> None:
    names = retriever_names()
    for name in ("nano-bm25", "nano-dense", "nano-hybrid", "nano-hybrid-safeguard", "hakari-hybrid",
                 "harrier"):
        assert name in names


@pytest.fixture()
def cli():
    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app

    _register()
    return app


def test_runs_score_the_lists_as_the_card_does_and_compare_shows_the_card(split, tmp_path: Path, cli) -> None:
    root, _, made = split
    out = tmp_path / "results"
    runner = CliRunner()
    for name in ("nano-bm25", "nano-hybrid", "nano-hybrid-safeguard"):
        res = runner.invoke(cli, ["run", "--method", "none", "--retriever", name, "--task", "nano-Biology",
                                  "--data-dir", str(root), "--output-dir", str(out), "--allow-count-mismatch"])
        assert res.exit_code == 0, res.output
    rec = json.loads((out / "none/none/nano-bm25/nano-Biology.json").read_text())
    assert rec["test"]["ndcg_at_10"] == pytest.approx(card_ndcg10(made["bm25"], made["qrels"]), abs=1e-4)
    hyb = json.loads((out / "none/none/nano-hybrid/nano-Biology.json").read_text())
    assert hyb["test"]["ndcg_at_10"] == pytest.approx(card_ndcg10(made["hybrid"], made["qrels"]), abs=1e-4)
    # At the default depth of 100 the safeguard never counts.
    guarded = json.loads((out / "none/none/nano-hybrid-safeguard/nano-Biology.json").read_text())
    assert guarded["test"] == hyb["test"]

    res = runner.invoke(cli, ["compare", str(out), "--published", "--format", "csv"])
    assert res.exit_code == 0, res.output
    import csv
    import io

    rows = {r["retriever"]: r for r in csv.DictReader(io.StringIO(res.output))}
    assert float(rows["nano-bm25"]["nano-Biology_published"]) == 0.3455
    assert float(rows["nano-hybrid"]["nano-Biology_published"]) == 0.4722
    assert float(rows["nano-hybrid-safeguard"]["nano-Biology_published"]) == 0.4722


def test_card_numbers_give_its_query_weighted_group_scores() -> None:
    # The card's per-split nDCG@10 (packaged CSV) reproduce its group numbers, weighted by the
    # registry's query counts (876 in all): BM25 0.2110, dense 0.2980.
    from r2med_agent.api import PublishedKey, published_results

    pub = published_results()
    for retriever, group in (("nano-bm25", 0.2110), ("harrier", 0.2980)):
        scores = pub.scores(PublishedKey("none", "", retriever))
        assert list(scores) == data.task_names("nano-all")
        n = {t: data.get_task_spec(t).queries for t in scores}
        assert sum(n.values()) == 876
        assert sum(scores[t] * n[t] for t in scores) / 876 == pytest.approx(group, abs=5e-5)


def test_hub_tasks_read_their_lists_from_the_commit_they_loaded(tmp_path: Path, monkeypatch) -> None:
    # A task from the hub (NanoR2MED follows main) records the commit it came from; its candidate
    # lists are fetched from that same commit, only the subset's files of the split.
    from r2med_agent.data import hub

    commit = "0123456789abcdef0123456789abcdef01234567"
    root = tmp_path / commit
    made = make_split(root)
    calls = []

    def fake_fetch(repo: str, rev: str, patterns: list[str], *, hint: str) -> Path:
        calls.append((repo, rev, patterns))
        return root

    monkeypatch.setattr(hub, "fetch_snapshot", fake_fetch)
    monkeypatch.setattr(hub, "is_commit", lambda rev: len(rev) == 40)
    task = data.load_task("nano-Biology", allow_count_mismatch=True)
    assert task.source.endswith(f"(commit {commit})")
    lists, _ = data.read_nano_candidates(task, "reranking_hybrid")
    assert lists == made["hybrid"]
    assert calls[-1] == ("hakari-bench/NanoR2MED", commit,
                         [f"reranking_hybrid/{SPLIT}.*", f"reranking_hybrid/{SPLIT}-*"])


def _tiny_harrier(folder: Path, texts: list[str]) -> None:
    """A tiny random Gemma3TextModel (harrier's class) with a word tokenizer over ``texts``' words
    that adds a BOS as Gemma's does."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import Gemma3TextConfig, Gemma3TextModel, PreTrainedTokenizerFast

    words = sorted({w for t in texts for w in t.split()})
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<bos>", "<eos>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<bos>", eos_token="<eos>")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
                           pad_token_id=0, bos_token_id=2, eos_token_id=3)
    Gemma3TextModel(cfg).eval().save_pretrained(folder)


def test_hakari_hybrid_run_fuses_the_shipped_bm25_with_harrier(split, tmp_path: Path, cli) -> None:
    # `run --retriever hakari-hybrid` with the harrier entry pointed (by a user config, as a user
    # would) at a tiny model of its class: the run's ranking is the reference hybrid of the shipped
    # BM25 list and the dense ranking sentence-transformers computes with the web_search_query
    # prompt (top-500, cosine), independently of the project's encoder and fusion.
    import numpy as np

    from tests.st_reference import last_token_model

    root, task, made = split
    prompt = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "
    corpus = {d.doc_id: d.text for d in task.corpus}
    # Distinct words per document so the random model separates them.
    texts = [*corpus.values(), *(q.text for q in task.queries), prompt]
    folder = tmp_path / "tiny-harrier"
    _tiny_harrier(folder, texts)
    user = tmp_path / "user.yaml"
    user.write_text(
        "encoders:\n  harrier:\n"
        f"    model: {json.dumps(str(folder))}\n"
        "    pooling: last-token\n    normalize: true\n    max_length: 64\n    batch_size: 8\n"
        f"    query_prefix: {json.dumps(prompt)}\n"
    )
    out = tmp_path / "results"
    res = CliRunner().invoke(cli, ["run", "--method", "none", "--retriever", "hakari-hybrid", "--task", "nano-Biology",
                                   "--data-dir", str(root), "--output-dir", str(out), "--config", str(user),
                                   "--allow-count-mismatch"])
    assert res.exit_code == 0, res.output

    st = last_token_model(folder, {"web_search_query": prompt}, 64)
    ids = list(corpus)
    doc_emb = st.encode([corpus[d] for d in ids], batch_size=32)
    q_emb = st.encode([q.text for q in task.queries], prompt_name="web_search_query", batch_size=32)
    sims = q_emb @ doc_emb.T
    run_lines = (out / "none/none/hakari-hybrid/nano-Biology.run").read_text().splitlines()
    got: dict[str, list[str]] = {}
    for line in run_lines:
        qid, _, doc, rank, _, _ = line.split()
        got.setdefault(qid, []).append(doc)
    for i, q in enumerate(task.queries):
        dense = [ids[j] for j in np.argsort(-sims[i], kind="stable")[:500]]
        want = reference_hybrid(made["bm25"][q.query_id], dense, made["qrels"][q.query_id], q.query_id)
        assert got[q.query_id] == want[:100], q.query_id


def test_llm_methods_over_fixed_lists_stop_before_any_work(tmp_path: Path, capsys) -> None:
    # Refused when the run is configured: no task loaded, no model started, one message, exit 2.
    from r2med_agent.cli.app import main

    cases = [
        (["--method", "hyde", "--llm", "smollm2", "--retriever", "nano-hybrid"], "--retriever nano-hybrid"),
        (["--method", "search-r1", "--llm", "smollm2", "--retriever", "bm25", "--loop-retriever", "nano-bm25"],
         "--loop-retriever nano-bm25"),
        (["--method", "lamer", "--llm", "smollm2", "--retriever", "bm25+nano-dense"], "--retriever bm25+nano-dense"),
    ]
    for args, option in cases:
        code = main(["run", *args, "--task", "nano-Biology", "--output-dir", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.startswith(f"error: {option}:") and "use --method none" in err
        assert "Traceback" not in err
    assert not (tmp_path / "o").exists()
