"""The runner and the CLI end to end: files written, one LLM batch over all tasks, a cached re-run,
bad input as a clean error, a killed run that resumes from the cache."""

from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from r2med_agent.cli.app import main
from r2med_agent.errors import ConfigError
from r2med_agent.evaluation import read_trec_run
from r2med_agent.experiment.resolve import resolve_spec
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.api import RunConfig, RunSpec, run_experiment
from tests.fakes import ScriptedLLM
from tests.sample_subset import sample_subset


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_run_bm25_on_sample_writes_r2med_files(tmp_path, capsys):
    code, out, _ = _cli(["run", "--task", "sample", "-o", str(tmp_path), "--no-progress"], capsys)
    assert code == 0
    assert "nDCG@10" in out and "sample" in out
    d = tmp_path / "none" / "none" / "bm25"
    record = json.loads((d / "sample.json").read_text())
    assert record["dataset_name"] == "sample"
    assert set(record["test"]) >= {"ndcg_at_10", "recall_at_100", "map_at_10", "precision_at_1", "mrr"}
    assert record["num_queries"] == 12 and record["missing_queries"] == 0
    assert set(record["per_query"]) == set(record["missing_query_ids"]) | set(record["per_query"])
    mean = sum(q["ndcg_at_10"] for q in record["per_query"].values()) / 12
    assert record["test"]["ndcg_at_10"] == pytest.approx(mean)
    run = read_trec_run(d / "sample.run")
    assert len(run) == 12 and all(0 < len(r) <= 100 for r in run.values())
    summary = json.loads((d / "summary.json").read_text())
    assert summary["per_task"]["sample"]["ndcg_at_10"] == record["test"]["ndcg_at_10"]
    # The evaluate command on the written run file gives the same score.
    qrels = tmp_path / "qrels.txt"
    from r2med_agent.data import load_task

    task = load_task("sample")
    qrels.write_text("".join(f"{q} 0 {d} {g}\n" for q, docs in task.qrels.items() for d, g in docs.items()))
    code, out, _ = _cli(["evaluate", "--run", str(d / "sample.run"), "--qrels", str(qrels), "--json"], capsys)
    assert code == 0
    assert json.loads(out)["test"]["ndcg_at_10"] == pytest.approx(record["test"]["ndcg_at_10"])


def test_another_top_k_gets_its_own_folder_and_only_metrics_it_reaches(tmp_path, capsys):
    for k in ("100", "10"):
        code, out, _ = _cli(["run", "--task", "sample", "-o", str(tmp_path), "--no-progress",
                             "--top-k", k], capsys)
        assert code == 0
    k10_spec = resolve_spec(RunSpec(top_k=10))
    full_dir, k10_dir = tmp_path / "none" / "none" / "bm25", tmp_path / k10_spec.folder()
    assert k10_dir.name == f"bm25__k10__{k10_spec.digest()}"
    assert f"results: {k10_dir}" in out and "R@100" in out
    full = json.loads((full_dir / "sample.json").read_text())
    k10 = json.loads((k10_dir / "sample.json").read_text())
    assert full["depth"] == 100 and k10["depth"] == 10
    assert full["model_name"] == "none/none/bm25" and k10["model_name"] == k10_spec.folder()
    assert "recall_at_100" in full["test"] and "recall_at_100" not in k10["test"]
    assert set(k10["test"]) == {"ndcg_at_1", "ndcg_at_10", "map_at_1", "map_at_10", "recall_at_1",
                                "recall_at_10", "precision_at_1", "precision_at_10", "mrr"}
    assert k10["config"]["metrics"] == list(k10["test"])
    assert json.loads((k10_dir / "summary.json").read_text())["depth"] == 10
    # the cut keeps what the top-100 run ranks first, so metrics at 10 agree query by query
    for qid, scores in k10["per_query"].items():
        assert scores["ndcg_at_10"] == full["per_query"][qid]["ndcg_at_10"]
    assert all(len(r) <= 10 for r in read_trec_run(k10_dir / "sample.run").values())
    assert max(len(r) for r in read_trec_run(full_dir / "sample.run").values()) > 10
    # the table shows "-" for a metric the depth does not reach, never a made-up 0
    row = next(line for line in out.splitlines() if line.startswith("│ sample"))
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert cells[2] == "-" and float(cells[1]) == pytest.approx(k10["test"]["ndcg_at_10"], abs=1e-4)


def test_allow_missing_qrels_docs_scores_them_as_pytrec_eval_does(tmp_path, capsys, caplog):
    import logging

    import pytrec_eval

    folder = tmp_path / "data" / "Biology"
    folder.mkdir(parents=True)
    (folder / "query.jsonl").write_text('{"id": "q1", "text": "measles rash fever"}\n')
    (folder / "corpus.jsonl").write_text('{"id": "d1", "text": "measles causes a rash and fever"}\n'
                                         '{"id": "d2", "text": "insulin lowers glucose"}\n')
    (folder / "qrels.jsonl").write_text('{"q_id": "q1", "p_id": "d1", "score": 1}\n'
                                        '{"q_id": "q1", "p_id": "absent", "score": 1}\n')
    args = ["run", "--task", "Biology", "--data-dir", str(tmp_path / "data"), "-o",
            str(tmp_path / "out"), "--no-progress", "--allow-count-mismatch"]  # a 1-query Biology
    code, _, err = _cli(args, capsys)
    assert code == 2 and "qrels.jsonl:2: " in err and "--allow-missing-qrels-docs" in err
    with caplog.at_level(logging.WARNING, logger="r2med_agent.data"):
        code, _, err = _cli([*args, "--allow-missing-qrels-docs"], capsys)
    assert code == 0
    assert any("1 qrels documents are not in corpus.jsonl" in r.getMessage() for r in caplog.records)
    record = json.loads((tmp_path / "out" / "none" / "none" / "bm25" / "Biology.json").read_text())
    assert record["config"]["allow_missing_qrels_docs"] is True
    # the absent document is in the ideal DCG: d1 at rank 1 gives 1 / (1 + 1/log2(3))
    raw = pytrec_eval.RelevanceEvaluator({"q1": {"d1": 1, "absent": 1}}, {"ndcg_cut.10"}).evaluate(
        {"q1": {"d1": 2.0}})
    assert record["test"]["ndcg_at_10"] == raw["q1"]["ndcg_cut_10"] == pytest.approx(1 / (1 + 1 / math.log2(3)))


def _scripted_cached(tmp_path: Path) -> tuple[CachedLLM, ScriptedLLM]:
    backend = ScriptedLLM(lambda msgs, p: "Passage: " + msgs[-1]["content"][-200:], model_id="scripted")
    cache = GenerationCache(tmp_path / "gen.sqlite")
    return CachedLLM(backend, "scripted", "plain", cache), backend


def test_expansion_sends_all_tasks_in_one_llm_call_and_reuses_the_cache(tmp_path, monkeypatch):
    from r2med_agent.llm.registry import LLMSpec

    monkeypatch.setattr("r2med_agent.llm.registry.get_llm_spec", lambda name: LLMSpec(name="scripted", backend="local", model="scripted"))
    cfg = RunConfig(tasks=("sample", "r2med-demo"), method="hyde", llm="scripted", output_dir=tmp_path,
                    show_progress=False)
    llm, backend = _scripted_cached(tmp_path)
    first = run_experiment(cfg, llm=llm)
    assert len(backend.calls) == 1 and len(backend.calls[0]) == 14  # 12 + 2 queries, one batch
    assert [o.stats["generations"] for o in first.outcomes] == [12, 2]
    gens = (tmp_path / "hyde" / "scripted" / "bm25" / "sample.generations.jsonl").read_text().splitlines()
    row = json.loads(gens[0])
    assert set(row) >= {"id", "text", "hy_doc", "doc_id", "final", "reasoning"}
    assert row["hy_doc"].startswith("Passage:") and row["final"] == row["hy_doc"].strip()

    llm2, backend2 = _scripted_cached(tmp_path)
    second = run_experiment(cfg, llm=llm2)
    assert backend2.calls == []
    assert [o.stats["cache_hits"] for o in second.outcomes] == [12, 2]
    # Cost columns describe the method's generations, whether this run made them or not.
    for key in ("prompt_tokens", "completion_tokens", "llm_time_s"):
        assert [o.stats[key] for o in second.outcomes] == [o.stats[key] for o in first.outcomes]
    assert all(o.stats["llm_time_new_s"] == 0 for o in second.outcomes)
    assert second.average == first.average


@pytest.mark.parametrize(("cli", "expected"), [([], "auto"), (["--chunk-size", "0"], 0), (["--chunk-size", "16"], 16)])
def test_chunk_size_option_reaches_make_llm(tmp_path, monkeypatch, capsys, cli, expected):
    seen = []

    def fake_make_llm(name, **kwargs):
        seen.append(kwargs["chunk_size"])
        return _scripted_cached(tmp_path)[0]

    monkeypatch.setattr("r2med_agent.llm.make_llm", fake_make_llm)
    code, _, err = _cli(["run", "--task", "r2med-demo", "--method", "hyde", "--llm", "smollm2", "-o",
                         str(tmp_path / "out"), "--no-progress", *cli], capsys)
    assert code == 0, err
    assert seen == [expected]
    code, _, err = _cli(["run", "--task", "r2med-demo", "--method", "hyde", "--llm", "smollm2",
                         "--chunk-size", "-1", "-o", str(tmp_path / "out")], capsys)
    assert code == 2 and "--chunk-size must be >= 0" in err


def test_priced_model_dollars_reach_the_result_json(tmp_path):
    # gpt4's registry entry has list prices; the scripted backend stands in for the API.
    from r2med_agent.llm.registry import get_llm_spec

    spec = get_llm_spec("gpt4")
    assert spec.price_in_per_mtok > 0 and spec.price_out_per_mtok > 0
    cfg = RunConfig(tasks=("sample",), method="hyde", llm="gpt4", prompts_from="own", output_dir=tmp_path,
                    show_progress=False)
    llm, _ = _scripted_cached(tmp_path)
    result = run_experiment(cfg, llm=llm)
    record = json.loads((tmp_path / "hyde" / "gpt4" / "bm25" / "sample.json").read_text())
    stats = record["stats"]
    assert stats["prompt_tokens"] > 0 and stats["completion_tokens"] > 0
    assert stats["cost_usd"] == round(spec.cost_usd(stats["prompt_tokens"], stats["completion_tokens"]), 6)
    assert stats["cost_usd"] > 0
    assert result.outcomes[0].stats["cost_usd"] == stats["cost_usd"]


def test_unpriced_runs_record_no_dollars(tmp_path, monkeypatch):
    # A self-hosted model and a run without an LLM have no price: null, not an invented $0.
    from r2med_agent.llm.registry import LLMSpec

    monkeypatch.setattr("r2med_agent.llm.registry.get_llm_spec", lambda name: LLMSpec(name=name, backend="local", model="x"))
    cfg = RunConfig(tasks=("sample",), method="hyde", llm="local-model", output_dir=tmp_path, show_progress=False)
    run_experiment(cfg, llm=_scripted_cached(tmp_path)[0])
    run_experiment(RunConfig(tasks=("sample",), output_dir=tmp_path, show_progress=False))
    for leaf in ("hyde/local-model/bm25", "none/none/bm25"):
        stats = json.loads((tmp_path / leaf / "sample.json").read_text())["stats"]
        assert "cost_usd" in stats and stats["cost_usd"] is None


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="needs --llm"):
        RunConfig(tasks=("sample",), method="hyde")
    with pytest.raises(ConfigError, match="--final must be one of"):
        RunConfig(tasks=("sample",), method="search-r1", llm="x", final="best")
    with pytest.raises(ConfigError, match="--loop-retriever must be the same"):
        RunConfig(tasks=("sample",), method="search-r1", llm="x", final="fuse", retriever="bm25",
                  loop_retriever="minilm")


def test_sampling_overrides_out_of_range_are_config_errors():
    # llama.cpp reads max_tokens <= 0 as "until the context is full": never pass it on.
    with pytest.raises(ConfigError, match="--max-tokens must be at least 1"):
        RunConfig(tasks=("sample",), method="hyde", llm="smollm2", sampling={"max_tokens": 0})
    with pytest.raises(ConfigError, match="--temperature must be >= 0"):
        RunConfig(tasks=("sample",), method="hyde", llm="smollm2", sampling={"temperature": -1.0})
    with pytest.raises(ConfigError, match=r"--top-p must be in \(0, 1\]"):
        RunConfig(tasks=("sample",), method="hyde", llm="smollm2", sampling={"top_p": 1.5})


def test_unknown_llm_fails_before_any_index_is_built(tmp_path, monkeypatch):
    built = []

    def record(spec, task, **kw):
        built.append(spec)
        raise AssertionError("an index was built before the LLM name was checked")

    monkeypatch.setattr("r2med_agent.retrieval.make_retriever", record)
    cfg = RunConfig(tasks=("sample",), method="hyde", llm="no-such-llm", output_dir=tmp_path,
                    show_progress=False)
    with pytest.raises(ConfigError, match="unknown llm 'no-such-llm'"):
        run_experiment(cfg)
    assert built == []


def test_unusable_output_dir_is_a_clean_error_before_any_work(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(
        "r2med_agent.retrieval.make_retriever",
        lambda *a, **k: (_ for _ in ()).throw(AssertionError("indexing before the output check")),
    )
    code, _, err = _cli(["run", "--task", "sample", "-o", str(blocker / "results"), "--no-progress"], capsys)
    assert code == 2
    assert "cannot create the result folder" in err and "--output-dir" in err


def _write_task(folder: Path, corpus_lines: list[str]) -> None:
    folder.mkdir(parents=True)
    (folder / "query.jsonl").write_text('{"id": "q1", "text": "fever and rash"}\n')
    (folder / "corpus.jsonl").write_text("\n".join(corpus_lines) + "\n")
    (folder / "qrels.jsonl").write_text('{"q_id": "q1", "p_id": "d1", "score": 1}\n')


def test_malformed_data_exits_2_with_file_and_line_and_no_traceback(tmp_path):
    bad = tmp_path / "Mine"
    _write_task(bad, ['{"id": "d1", "text": "measles"}', '{"id": "d2", "text": oops}'])
    proc = subprocess.run(
        [sys.executable, "-m", "r2med_agent", "run", "--task", "sample", "--data-dir", str(bad),
         "-o", str(tmp_path / "out"), "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "corpus.jsonl:2: malformed JSON" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "out").exists()


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "r2med_agent", *args], capture_output=True,
                          text=True, timeout=120)


# case: (corpus.jsonl bytes, the message stderr must hold)
_UNREADABLE_CORPUS = {
    "latin-1 byte": (b'{"id": "d1", "text": "measles"}\n{"id": "d2", "text": "caf\xe9"}\n',
                     "corpus.jsonl:2: not UTF-8 text: byte 0xe9 at column 26"),
    "deep nesting": (b'{"id": "d1", "text": "measles"}\n' + b"[" * 200_000 + b"\n",
                     "corpus.jsonl:2: malformed JSON (nested too deeply)"),
    "unpaired surrogate": (b'{"id": "d1", "text": "measles \\ud800"}\n',
                           "corpus.jsonl:1: a string holds an unpaired UTF-16 surrogate escape"),
}


@pytest.mark.parametrize("case", list(_UNREADABLE_CORPUS))
def test_unreadable_corpus_exits_2_with_file_and_line(tmp_path, case):
    raw, message = _UNREADABLE_CORPUS[case]
    folder = tmp_path / "Mine"
    _write_task(folder, [])
    (folder / "corpus.jsonl").write_bytes(raw)
    proc = _run_cli("run", "--task", "sample", "--data-dir", str(folder), "-o", str(tmp_path / "out"),
                    "--no-progress")
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_evaluate_rejects_binary_runs_bad_depth_and_unscorable_input(tmp_path):
    qrels = tmp_path / "qrels.txt"
    qrels.write_text("q1 0 d1 1\n")
    binary = tmp_path / "binary.run"
    binary.write_bytes(b"\xff\xfe" + "q1 Q0 d1 1 1.0 t\n".encode("utf-16-le"))
    nan = tmp_path / "nan.run"
    nan.write_text("q1 Q0 d1 1 1.0 t\nq1 Q0 d2 2 nan t\n")
    good = tmp_path / "good.run"
    good.write_text("q1 Q0 d1 1 1.0 t\n")
    zeros = tmp_path / "zeros.txt"
    zeros.write_text("q1 0 d1 0\n")
    cases = [
        (["--run", str(binary), "--qrels", str(qrels)], "binary.run:1: not UTF-8 text"),
        (["--run", str(nan), "--qrels", str(qrels)], "nan.run:2: score 'nan' is not finite"),
        (["--run", str(good), "--qrels", str(zeros)], "zeros.txt: no qrels entry has a positive grade"),
        (["--run", str(good), "--qrels", str(qrels), "--depth", "0"], "--depth must be at least 1"),
        (["--run", str(good), "--qrels", str(qrels), "--depth", "-5"], "--depth must be at least 1"),
    ]
    for args, message in cases:
        proc = _run_cli("evaluate", *args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr + proc.stdout, args
    proc = _run_cli("evaluate", "--run", str(good), "--qrels", str(qrels), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["test"]["mrr"] == 1.0


def test_unknown_method_and_unreachable_hub_are_clean_errors(tmp_path, monkeypatch, capsys):
    code, _, err = _cli(["run", "--task", "sample", "--method", "magic", "--llm", "smollm2", "-o", str(tmp_path)], capsys)
    assert code == 2 and "unknown method 'magic'" in err
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    t0 = time.monotonic()
    code, _, err = _cli(["run", "--task", "Biology", "-o", str(tmp_path), "--no-progress"], capsys)
    assert code == 5 and "--data-dir" in err
    assert time.monotonic() - t0 < 20


def test_generations_file_keeps_the_raw_text_in_hy_doc_as_r2med_does(tmp_path, monkeypatch):
    from r2med_agent.llm.registry import LLMSpec

    monkeypatch.setattr("r2med_agent.llm.registry.get_llm_spec", lambda name: LLMSpec(name="scripted", backend="local", model="scripted"))
    backend = ScriptedLLM(lambda msgs, p: "<think>weigh it</think> The passage.", model_id="scripted")
    llm = CachedLLM(backend, "scripted", "think", GenerationCache(tmp_path / "gen.sqlite"))
    cfg = RunConfig(tasks=("r2med-demo",), method="hyde", llm="scripted", output_dir=tmp_path, show_progress=False)
    run_experiment(cfg, llm=llm)
    path = tmp_path / "hyde" / "scripted" / "bm25" / "r2med-demo.generations.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [list(r)[:4] for r in rows] == [["id", "text", "hy_doc", "doc_id"]] * 2
    assert {(r["hy_doc"], r["final"], r["reasoning"]) for r in rows} == {
        ("<think>weigh it</think> The passage.", "The passage.", "weigh it")
    }


def _assert_bm25_searched(result_dir: Path, task_name: str, expected_query, data_dir: Path | None = None) -> dict:
    """Check the written run against BM25 searched here with the query text
    ``expected_query(query, final)`` built by hand from the written generation (as a plain
    query, so no code under test composes it). Returns that expected run."""
    from r2med_agent.data import load_task
    from r2med_agent.retrieval import make_retriever
    from r2med_agent.types import SearchRequest

    task = load_task(task_name, data_dir, allow_count_mismatch=data_dir is not None)
    rows = {r["id"]: r for r in map(json.loads, (result_dir / f"{task_name}.generations.jsonl").read_text().splitlines())}
    requests = [SearchRequest(q.query_id, expected_query(q.text, rows[q.query_id]["final"])) for q in task.queries]
    expected = make_retriever("bm25", task, show_progress=False).search(requests, 100)
    written = read_trec_run(result_dir / f"{task_name}.run")
    assert set(written) == {q.query_id for q in task.queries}
    for q in task.queries:
        assert written[q.query_id] == pytest.approx(expected[q.query_id], rel=1e-9), q.query_id
    return expected


@pytest.mark.slow
def test_hyde_with_the_local_model_twice_then_resume_after_sigkill(tmp_path, smollm2_gguf):
    """The README's main job: real SmolLM2, real BM25; a second run makes no LLM call; a run
    killed mid-generation resumes and generates only what is missing."""
    env = {**os.environ, "R2MED_CACHE_DIR": str(tmp_path / "cache")}
    args = [sys.executable, "-m", "r2med_agent", "run", "--task", "sample", "--method", "hyde",
            "--llm", "smollm2", "--max-tokens", "24", "--no-progress"]

    first = subprocess.run([*args, "-o", str(tmp_path / "a")], env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr
    assert "LLM generations: 12 new, 0 from cache" in first.stdout
    second = subprocess.run([*args, "-o", str(tmp_path / "b")], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "LLM generations: 0 new, 12 from cache" in second.stdout
    folder = resolve_spec(RunSpec(method="hyde", llm="smollm2", sampling={"max_tokens": 24})).folder()  # hyde/smollm2/bm25__mt24__...
    a = json.loads((tmp_path / "a" / folder / "sample.json").read_text())["test"]
    b = json.loads((tmp_path / "b" / folder / "sample.json").read_text())["test"]
    assert a == b
    gens = [json.loads(l) for l in (tmp_path / "a" / folder / "sample.generations.jsonl").read_text().splitlines()]
    assert len(gens) == 12 and all(g["final"] for g in gens)
    assert all(g["final"] == g["hy_doc"].strip() for g in gens)  # smollm2 is "plain"
    # HyDE searches BM25 with the generated passage only (docs/protocol.md) ...
    passage_only = _assert_bm25_searched(tmp_path / "a" / folder, "sample", lambda q, p: p)
    # ... which this check tells apart from searching with the query added.
    from r2med_agent.data import load_task
    from r2med_agent.retrieval import make_retriever
    from r2med_agent.types import SearchRequest

    task = load_task("sample")
    by_id = {g["id"]: g["final"] for g in gens}
    with_query = make_retriever("bm25", task, show_progress=False).search(
        [SearchRequest(q.query_id, f"{q.text} {by_id[q.query_id]}") for q in task.queries], 100
    )
    assert any(passage_only[q] != pytest.approx(with_query[q], rel=1e-9) for q in by_id)

    # Kill a fresh run (new seed -> new cache keys) once some chunks are committed.
    db = tmp_path / "cache" / "generations.sqlite"

    def rows() -> int:
        try:
            with sqlite3.connect(db, timeout=30) as con:
                return con.execute("SELECT COUNT(*) FROM generations").fetchone()[0]
        except sqlite3.Error:
            return -1

    before = rows()
    proc = subprocess.Popen([*args, "--seed", "7", "-o", str(tmp_path / "c")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while rows() < before + 4 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = rows() - before
    assert 4 <= done < 12
    resumed = subprocess.run([*args, "--seed", "7", "-o", str(tmp_path / "c")], env=env,
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr
    assert f"LLM generations: {12 - done} new, {done} from cache" in resumed.stdout


@pytest.mark.slow
@pytest.mark.parametrize("method", ["query2doc", "lamer"])
def test_query2doc_and_lamer_with_the_local_model(tmp_path, smollm2_gguf, method):
    """Real SmolLM2 generations become BM25 queries as docs/protocol.md tabulates (on the
    sample's first three queries: LameR's prompts hold ten documents each)."""
    data = sample_subset(tmp_path / "data", ("0", "1", "2"))
    cfg = RunConfig(tasks=("sample",), method=method, llm="smollm2", output_dir=tmp_path,
                    cache_path=tmp_path / "gen.sqlite", sampling={"max_tokens": 16}, show_progress=False,
                    data_dir=data, allow_count_mismatch=True)
    result = run_experiment(cfg)
    assert result.outcomes[0].stats["generations"] == 3
    d = result.result_dir  # method/smollm2/bm25__mt16__<digest>
    rows = [json.loads(line) for line in (d / "sample.generations.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["final"] for r in rows)
    # docs/protocol.md: Query2Doc searches with the query twice then the passage, LameR with the
    # query then the passage; the texts are built here by hand from the written generations.
    if method == "query2doc":
        _assert_bm25_searched(d, "sample", lambda q, p: f"{q} {q} {p}", data)
    else:
        _assert_bm25_searched(d, "sample", lambda q, p: f"{q} {p}", data)
    assert 0.0 <= json.loads((d / "sample.json").read_text())["test"]["ndcg_at_10"] <= 1.0


def test_usage_errors_and_missing_files_exit_non_zero_without_traceback(tmp_path):
    for args, code in ((["run", "--no-such-option"], 2), (["run", "--top-k", "abc"], 2),
                       (["evaluate", "--run", str(tmp_path / "none.run"), "--qrels", str(tmp_path / "q.txt")], 2),
                       (["trace", "show", str(tmp_path / "none.jsonl")], 2)):
        proc = subprocess.run([sys.executable, "-m", "r2med_agent", *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == code, (args, proc.stderr)
        assert "Traceback" not in proc.stderr + proc.stdout, args


@pytest.mark.parametrize("terminal", [False, True])
@pytest.mark.parametrize("args", [["tasks"], ["run", "--task", "list"], ["llms"]])
def test_listings_never_cut_names_on_a_narrow_console(monkeypatch, args, terminal):
    import io

    from rich.console import Console

    from r2med_agent.cli import run_cmd
    from r2med_agent.config import load_registry
    from r2med_agent.data import task_registry
    from r2med_agent.llm.registry import LLMSpec

    out = io.StringIO()
    monkeypatch.setattr(run_cmd, "console", Console(file=out, width=40, force_terminal=terminal,
                                                    color_system=None))
    assert main(args) == 0
    text = out.getvalue()
    names = list(load_registry("llms", LLMSpec) if args == ["llms"] else task_registry())
    assert len(names) > 5 and "…" not in text
    lines = text.splitlines()
    for name in names:  # whole, on one line, in the name column
        assert any(line.lstrip("│ ").startswith(name + " ") or line.lstrip("│ ") == name
                   for line in lines), (name, text)
    if not terminal:  # plain rows: every cell whole, e.g. the repo and the model ids
        assert any(line.split()[:1] == [names[0]] for line in lines)
        full = " ".join(lines)
        assert ("R2MED/Bioinformatics" in full) if args != ["llms"] else (
            "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B" in full)
