"""``run --generations r2med``: R2MED's released generations scored with no LLM, from a packaged
task, a ``--data-dir`` copy and the hub (a loopback server speaking the hub's file API)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from r2med_agent.cli.app import main
from r2med_agent.errors import ConfigError, DataError
from r2med_agent.evaluation import read_trec_run
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.paths import resources_dir
from r2med_agent.api import RunConfig, run_experiment
from tests.fakes import ScriptedLLM
from tests.unit.data.test_data import CORPUS, QRELS, QUERIES, FakeHub, _jsonl_bytes, closed_port

DEMO_FILE = resources_dir() / "r2med-demo" / "Biology" / "hyde" / "qwen-7b" / "query_with_hydoc.jsonl"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_demo_hyde_row_runs_from_the_packaged_file_with_no_generation(tmp_path, capsys) -> None:
    code, out, err = _cli(["run", "--method", "hyde", "--llm", "qwen-7b", "--generations", "r2med",
                           "--task", "r2med-demo", "-o", str(tmp_path), "--no-progress"], capsys)
    assert code == 0, err
    assert "0 new, 0 from cache, 2 released by R2MED" in out
    leaf = tmp_path / "hyde" / "qwen-7b@r2med" / "bm25"
    record = json.loads((leaf / "r2med-demo.json").read_text())
    assert record["generations"] == "r2med" and record["config"]["generations"] == "r2med"
    assert record["stats"]["generations"] == 0 and record["stats"]["released_generations"] == 2
    assert record["stats"]["released_source"] == "package:r2med-demo/Biology/hyde/qwen-7b/query_with_hydoc.jsonl"
    assert json.loads((leaf / "summary.json").read_text())["generations"] == "r2med"
    # The released text is what was searched: hy_doc as the file has it, HyDE's passage-only query.
    released = {r["id"]: r["hy_doc"] for r in _rows(DEMO_FILE)}
    written = {r["id"]: r for r in _rows(leaf / "r2med-demo.generations.jsonl")}
    assert {k: v["hy_doc"] for k, v in written.items()} == released
    assert all(v["final"] == released[k].strip() for k, v in written.items())


def test_released_run_never_imports_an_llm_engine(tmp_path) -> None:
    """In a Python where importing vllm, llama_cpp, openai or torch fails, the demo row still runs."""
    script = (
        "import sys\n"
        "for m in ('vllm', 'llama_cpp', 'openai', 'torch', 'transformers'):\n"
        "    sys.modules[m] = None  # any import of it raises ImportError\n"
        "from r2med_agent.cli.app import main\n"
        f"code = main(['run', '--method', 'hyde', '--llm', 'qwen-7b', '--generations', 'r2med', "
        f"'--task', 'r2med-demo', '-o', {str(tmp_path)!r}, '--no-progress'])\n"
        "assert code == 0, code\n"
        "loaded = [m for m in ('vllm', 'llama_cpp', 'openai', 'torch') if sys.modules.get(m) is not None]\n"
        "print('loaded:', loaded)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded: []" in proc.stdout
    assert "2 released by R2MED" in proc.stdout
    # Control: the same blocking makes a fresh run of that LLM fail, so the check can fail.
    bad = script.replace("'r2med'", "'fresh'").replace("hyde', '--llm', 'qwen-7b'", "hyde', '--llm', 'smollm2'")
    proc = subprocess.run([sys.executable, "-c", bad], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0


def _copy_task(root: Path, name: str = "sample") -> Path:
    folder = root / name
    shutil.copytree(resources_dir() / name, folder)
    return folder


def _write_released(folder: Path, method: str, llm: str, rows: list[dict]) -> Path:
    path = folder / method / llm / "query_with_hydoc.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _sample_queries() -> list[dict]:
    return _rows(resources_dir() / "sample" / "query.jsonl")


def _think_text(q: dict) -> str:
    words = q["text"].split()
    return f"<think>reason about {words[0]}</think>\n{' '.join(reversed(words[:12]))} passage"


@pytest.mark.parametrize("method", ["hyde", "query2doc", "lamer"])
def test_released_text_is_parsed_and_combined_as_a_fresh_generation(tmp_path, monkeypatch, method) -> None:
    """A reasoning model's released outputs give the same queries, run files and scores as the
    same texts generated fresh: the text after </think>, each method's query construction."""
    from r2med_agent.llm.registry import LLMSpec

    spec = LLMSpec(name="r1-qwen-32b", backend="local", model="scripted", reasoning_format="think")
    monkeypatch.setattr("r2med_agent.llm.registry.get_llm_spec", lambda name: spec)
    data = tmp_path / "data"
    folder = _copy_task(data)
    queries = _sample_queries()
    _write_released(folder, method, "r1-qwen-32b",
                    [{"id": q["id"], "text": q["text"], "hy_doc": _think_text(q), "doc_id": []} for q in queries])
    by_text = {q["text"]: _think_text(q) for q in queries}

    def script(messages, params):
        content = messages[-1]["content"]
        # the prompt ends with the query (then the answer label); the longest query it holds
        return by_text[max((t for t in by_text if t in content), key=len)]

    backend = ScriptedLLM(script)
    fresh_llm = CachedLLM(backend, "scripted", "think", GenerationCache(tmp_path / "gen.sqlite"))
    common = dict(tasks=("sample",), method=method, llm="r1-qwen-32b", data_dir=data, show_progress=False)
    fresh = run_experiment(RunConfig(output_dir=tmp_path / "fresh", **common), llm=fresh_llm)
    assert len(backend.calls) == 1
    released = run_experiment(RunConfig(output_dir=tmp_path / "released", generations="r2med", **common))
    assert released.result_dir.parent.name == "r1-qwen-32b@r2med"
    assert read_trec_run(released.result_dir / "sample.run") == read_trec_run(fresh.result_dir / "sample.run")
    assert released.average == fresh.average
    finals = [r["final"] for r in _rows(released.result_dir / "sample.generations.jsonl")]
    assert finals == [_think_text(q).split("</think>")[1].strip() for q in queries]
    used_r = [r["query_used"] for r in _rows(released.result_dir / "sample.generations.jsonl")]
    used_f = [r["query_used"] for r in _rows(fresh.result_dir / "sample.generations.jsonl")]
    assert used_r == used_f


def test_search_r1_released_text_becomes_its_answer_span(tmp_path) -> None:
    data = tmp_path / "data"
    folder = _copy_task(data)
    queries = _sample_queries()
    _write_released(folder, "search-r1", "qwen-3b-ins", [
        {"id": q["id"], "text": q["text"],
         "hy_doc": f"<think>look</think><search>{q['text'][:20]}</search><answer> ans {q['id']} </answer> tail"}
        for q in queries
    ])
    result = run_experiment(RunConfig(tasks=("sample",), method="search-r1", llm="qwen-3b-ins",
                                      generations="r2med", data_dir=data, output_dir=tmp_path / "o",
                                      show_progress=False))
    rows = _rows(result.result_dir / "sample.generations.jsonl")
    assert [r["final"] for r in rows] == [f"ans {q['id']}" for q in queries]
    assert result.result_dir == tmp_path / "o" / "search-r1" / "qwen-3b-ins@r2med" / "bm25"
    assert all(o.stats["generations"] == 0 for o in result.outcomes)


def test_missing_file_or_query_is_one_clear_error(tmp_path, capsys) -> None:
    data = tmp_path / "data"
    folder = _copy_task(data)
    code, _, err = _cli(["run", "--method", "hyde", "--llm", "qwen-7b", "--generations", "r2med", "--task",
                         "sample", "--data-dir", str(data), "-o", str(tmp_path / "o"), "--no-progress"], capsys)
    assert code == 2
    assert "no released hyde generations of qwen-7b for task sample: expected hyde/qwen-7b/query_with_hydoc.jsonl" in err
    assert "--generations fresh" in err and "Traceback" not in err
    queries = _sample_queries()
    _write_released(folder, "hyde", "qwen-7b", [{"id": q["id"], "hy_doc": "x"} for q in queries[:-2]])
    code, _, err = _cli(["run", "--method", "hyde", "--llm", "qwen-7b", "--generations", "r2med", "--task",
                         "sample", "--data-dir", str(data), "-o", str(tmp_path / "o"), "--no-progress"], capsys)
    assert code == 2
    assert f"no released generation for 2 of the 12 queries of sample (ids {queries[-2]['id']}, {queries[-1]['id']})" in err
    assert "hyde/qwen-7b/query_with_hydoc.jsonl" in err
    _write_released(folder, "hyde", "qwen-7b", [{"id": "1", "hy_doc": "x"}, {"id": "1", "hy_doc": "y"}])
    with pytest.raises(DataError, match=r"query_with_hydoc\.jsonl:2: query id '1' appears twice"):
        run_experiment(RunConfig(tasks=("sample",), method="hyde", llm="qwen-7b", generations="r2med",
                                 data_dir=data, output_dir=tmp_path / "o", show_progress=False))
    with pytest.raises(DataError, match="packaged task sample has no released hyde generations of qwen-7b"):
        run_experiment(RunConfig(tasks=("sample",), method="hyde", llm="qwen-7b", generations="r2med",
                                 output_dir=tmp_path / "o", show_progress=False))


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "none", "generations": "r2med"}, "needs a --method that generates"),
    ({"method": "hyde", "llm": "qwen-7b", "generations": "hub"}, "--generations must be one of fresh, r2med"),
    ({"method": "search-r1", "llm": "qwen-3b-ins", "generations": "r2med", "final": "fuse"}, "--final fuse"),
    ({"method": "hyde", "llm": "qwen-7b", "generations": "r2med", "sampling": {"seed": 3}},
     r"sampling options \(seed\) do not apply to R2MED's released generations"),
])
def test_bad_generations_options(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        RunConfig(tasks=("sample",), **kwargs)


def test_hub_file_at_the_pinned_revision_from_a_loopback_hub(tmp_path, monkeypatch) -> None:
    from r2med_agent.data import get_task_spec

    spec = get_task_spec("Biology")
    released = [{"id": q["id"], "text": q["text"], "hy_doc": f"{q['text']} answer", "doc_id": []} for q in QUERIES]
    files = {
        "query.jsonl": _jsonl_bytes(QUERIES),
        "corpus.jsonl": _jsonl_bytes(CORPUS),
        "qrels.jsonl": _jsonl_bytes(QRELS),
        "hyde/qwen-7b/query_with_hydoc.jsonl": _jsonl_bytes(released),
        "lamer/qwen-7b/query_with_hydoc.jsonl": _jsonl_bytes(released),
    }
    fake = FakeHub(spec.repo, spec.revision, files)
    try:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        result = run_experiment(RunConfig(tasks=("Biology",), method="hyde", llm="qwen-7b", generations="r2med",
                                          output_dir=tmp_path, show_progress=False))
        # a file the repo does not have: one error naming repo, revision and path
        with pytest.raises(DataError) as e:
            run_experiment(RunConfig(tasks=("Biology",), method="query2doc", llm="qwen-7b", generations="r2med",
                                     output_dir=tmp_path, show_progress=False))
    finally:
        fake.close()
    downloads = [r for r in fake.requests if "/resolve/" in r]
    assert any(r.startswith("GET") and r.endswith(f"/resolve/{spec.revision}/hyde/qwen-7b/query_with_hydoc.jsonl")
               for r in downloads), downloads
    assert not any("lamer/" in r for r in downloads)
    record = json.loads((result.result_dir / "Biology.json").read_text())
    assert record["stats"]["released_source"] == (
        f"hf://datasets/{spec.repo}@{spec.revision}/hyde/qwen-7b/query_with_hydoc.jsonl"
    )
    assert [r["hy_doc"] for r in _rows(result.result_dir / "Biology.generations.jsonl")] == [r["hy_doc"] for r in released]
    msg = str(e.value)
    assert f"{spec.repo}@{spec.revision} has no query2doc/qwen-7b/query_with_hydoc.jsonl" in msg
    # The hub is gone: the pinned revision's file comes from the cache.
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    again = run_experiment(RunConfig(tasks=("Biology",), method="hyde", llm="qwen-7b", generations="r2med",
                                     output_dir=tmp_path / "again", show_progress=False))
    assert again.average == result.average


def test_compare_labels_released_rows_and_matches_the_published_row(tmp_path, capsys) -> None:
    from r2med_agent.analysis.tables import published_key
    from r2med_agent.api import load_results

    for generations in ("r2med", "fresh"):
        leaf = tmp_path / "hyde" / ("qwen-7b@r2med" if generations == "r2med" else "qwen-7b") / "bm25-compat"
        leaf.mkdir(parents=True)
        (leaf / "Biology.json").write_text(json.dumps({"dataset_name": "Biology", "test": {"ndcg_at_10": 0.5},
                                                       "generations": generations}))
    rows = load_results([tmp_path])
    assert sorted(r.llm for r in rows) == ["qwen-7b", "qwen-7b@r2med"]
    keys = {r.llm: published_key(r) for r in rows}
    assert keys["qwen-7b@r2med"] == keys["qwen-7b"] is not None
    assert keys["qwen-7b@r2med"].llm == "qwen-7b"
    code, out, _ = _cli(["compare", str(tmp_path), "--published", "--format", "csv"], capsys)
    assert code == 0 and "qwen-7b@r2med" in out


def test_released_hyde_run_equals_bm25_searched_with_the_text_after_think(tmp_path) -> None:
    """Independent check: BM25 searched here with each released text's part after </think>, built
    by hand from the file, gives the written run."""
    from r2med_agent.data import load_task
    from r2med_agent.retrieval import make_retriever
    from r2med_agent.types import SearchRequest

    data = tmp_path / "data"
    folder = _copy_task(data)
    queries = _sample_queries()
    path = _write_released(folder, "hyde", "r1-qwen-32b",
                           [{"id": q["id"], "hy_doc": _think_text(q)} for q in queries])
    result = run_experiment(RunConfig(tasks=("sample",), method="hyde", llm="r1-qwen-32b", generations="r2med",
                                      data_dir=data, output_dir=tmp_path / "o", show_progress=False))
    by_hand = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        by_hand[row["id"]] = row["hy_doc"][row["hy_doc"].index("</think>") + len("</think>"):].strip()
    task = load_task("sample", data)
    expected = make_retriever("bm25", task, show_progress=False).search(
        [SearchRequest(q.query_id, by_hand[q.query_id]) for q in task.queries], 100)
    written = read_trec_run(result.result_dir / "sample.run")
    assert set(written) == set(by_hand)
    for qid in by_hand:
        assert written[qid] == pytest.approx(expected[qid], rel=1e-9), qid
