"""The runner and the CLI end to end: files written, one LLM batch over all tasks, a cached re-run,
bad input as a clean error, a killed run that resumes from the cache."""

from __future__ import annotations

import json
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
from r2med_agent.llm.cache import GenerationCache
from r2med_agent.llm.cached import CachedLLM
from r2med_agent.runner import RunConfig, run_experiment
from tests.fakes import ScriptedLLM


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
    assert set(row) >= {"id", "text", "hy_doc", "doc_id"} and row["hy_doc"].startswith("Passage:")

    llm2, backend2 = _scripted_cached(tmp_path)
    second = run_experiment(cfg, llm=llm2)
    assert backend2.calls == []
    assert [o.stats["cache_hits"] for o in second.outcomes] == [12, 2]
    # Cost columns describe the method's generations, whether this run made them or not.
    for key in ("prompt_tokens", "completion_tokens", "llm_time_s"):
        assert [o.stats[key] for o in second.outcomes] == [o.stats[key] for o in first.outcomes]
    assert all(o.stats["llm_time_new_s"] == 0 for o in second.outcomes)
    assert second.average == first.average


def test_priced_model_dollars_reach_the_result_json(tmp_path):
    # gpt4's registry entry has list prices; the scripted backend stands in for the API.
    from r2med_agent.llm.registry import get_llm_spec

    spec = get_llm_spec("gpt4")
    assert spec.price_in_per_mtok > 0 and spec.price_out_per_mtok > 0
    cfg = RunConfig(tasks=("sample",), method="hyde", llm="gpt4", output_dir=tmp_path, show_progress=False)
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


def test_unknown_method_and_unreachable_hub_are_clean_errors(tmp_path, monkeypatch, capsys):
    code, _, err = _cli(["run", "--task", "sample", "--method", "magic", "--llm", "smollm2", "-o", str(tmp_path)], capsys)
    assert code == 2 and "unknown method 'magic'" in err
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    t0 = time.monotonic()
    code, _, err = _cli(["run", "--task", "Biology", "-o", str(tmp_path), "--no-progress"], capsys)
    assert code == 5 and "--data-dir" in err
    assert time.monotonic() - t0 < 20


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
    a = json.loads((tmp_path / "a/hyde/smollm2/bm25/sample.json").read_text())["test"]
    b = json.loads((tmp_path / "b/hyde/smollm2/bm25/sample.json").read_text())["test"]
    assert a == b
    gens = [json.loads(l) for l in (tmp_path / "a/hyde/smollm2/bm25/sample.generations.jsonl").read_text().splitlines()]
    assert len(gens) == 12 and all(g["hy_doc"].strip() for g in gens)

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
    """Real SmolLM2 generations become BM25 queries as PROTOCOL.md tabulates."""
    from r2med_agent.data import load_task
    from r2med_agent.retrieval.bm25 import bm25_query_text

    cfg = RunConfig(tasks=("sample",), method=method, llm="smollm2", output_dir=tmp_path,
                    cache_path=tmp_path / "gen.sqlite", sampling={"max_tokens": 16}, show_progress=False)
    result = run_experiment(cfg)
    assert result.outcomes[0].stats["generations"] == 12
    d = tmp_path / method / "smollm2" / "bm25"
    rows = [json.loads(line) for line in (d / "sample.generations.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(r["hy_doc"].strip() for r in rows)
    task = load_task("sample")
    from r2med_agent.methods import get_method
    from r2med_agent.types import Generation

    requests = get_method(method)().to_requests(task, [Generation(text=r["hy_doc"], final=r["hy_doc"]) for r in rows])
    q, passage = task.queries[0].text, rows[0]["hy_doc"]
    expected = f"{q} {q} {passage}" if method == "query2doc" else f"{q} {passage}"
    assert bm25_query_text(requests[0]) == expected
    assert 0.0 <= json.loads((d / "sample.json").read_text())["test"]["ndcg_at_10"] <= 1.0


def test_usage_errors_and_missing_files_exit_non_zero_without_traceback(tmp_path):
    for args, code in ((["run", "--no-such-option"], 2), (["run", "--top-k", "abc"], 2),
                       (["evaluate", "--run", str(tmp_path / "none.run"), "--qrels", str(tmp_path / "q.txt")], 2),
                       (["trace", "show", str(tmp_path / "none.jsonl")], 2)):
        proc = subprocess.run([sys.executable, "-m", "r2med_agent", *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == code, (args, proc.stderr)
        assert "Traceback" not in proc.stderr + proc.stdout, args
