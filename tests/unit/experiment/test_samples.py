"""``run --samples N``: N generations per query, one cache key per sample index, combined as HyDE
does for dense retrieval and joined for BM25."""

from __future__ import annotations

import json

import numpy as np
import pytest

from r2med_agent.errors import ConfigError
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.types import Generation, SamplingParams, SearchRequest
from tests.fakes import ScriptedLLM

MSGS = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]


def test_samples_without_n_move_the_seed_and_key_each_sample(tmp_path) -> None:
    fake = ScriptedLLM(lambda m, p: f"{m[-1]['content']} seed={p.seed}")
    llm = CachedLLM(fake, "scripted", cache=GenerationCache(tmp_path / "g.sqlite"))
    params = SamplingParams(seed=42)
    out = llm.generate_samples(MSGS, params, 3)
    assert [[g.text for g in s] for s in out] == [[f"{c} seed={42 + i}" for i in range(3)] for c in "ab"]
    assert len(fake.calls) == 3  # one call per sample index, all prompts in each
    # Sample 0 is the plain generation's cache entry; more samples later make only the new ones.
    assert llm.generate(MSGS, params)[0].text == "a seed=42" and len(fake.calls) == 3
    more = llm.generate_samples(MSGS, params, 4)
    assert [g.text for g in more[1]] == [f"b seed={42 + i}" for i in range(4)]
    assert len(fake.calls) == 4 and [len(c) for c in fake.calls[3:]] == [2]


class _NBackend:
    """Draws n samples per prompt in one call (as vLLM's and OpenAI's n)."""

    model_id = "n-backend"

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def generate(self, prompts, params, *, sample_index=0, template_hash="", meta=None):  # noqa: ANN001, ANN201
        return [s[0] for s in self.generate_samples(prompts, params, 1)]

    def generate_samples(self, prompts, params, n, *, template_hash="", meta=None):  # noqa: ANN001, ANN201
        self.calls.append((len(prompts), n))
        base = len(self.calls) * 100
        return [[Generation(text=f"{p[-1]['content']}{base + j}", completion_tokens=2) for j in range(n)] for p in prompts]


def test_samples_with_n_one_request_per_prompt_and_only_missing_samples_kept(tmp_path) -> None:
    backend = _NBackend()
    llm = CachedLLM(backend, "n-backend", cache=GenerationCache(tmp_path / "g.sqlite"))
    params = SamplingParams(temperature=0.7)
    first = llm.generate_samples(MSGS, params, 2)
    assert backend.calls == [(2, 2)] and [g.text for g in first[0]] == ["a100", "a101"]
    keys = [llm.builder.key(MSGS[0], params, sample_index=s) for s in range(3)]
    assert len(set(keys)) == 3 and keys[0] == llm.builder.key(MSGS[0], params)
    rows = llm.cache.get_many(keys)
    assert {rows[k].sample_index for k in keys[:2]} == {0, 1} and keys[2] not in rows
    second = llm.generate_samples(MSGS, params, 3)
    assert backend.calls == [(2, 2), (2, 3)]
    # The two samples already cached are served as they were; only sample 3 is new.
    assert [g.text for g in second[0]] == ["a100", "a101", "a202"]
    assert [g.cached for g in second[0]] == [True, True, False] and llm.stats.generations == 4 + 2


def test_dense_mean_of_query_and_samples_and_bm25_joins_them() -> None:
    from r2med_agent.retrieval.query import bm25_query_text
    from r2med_agent.retrieval.dense.cache import l2_normalize
    from r2med_agent.retrieval.dense.index import SEP, query_embeddings
    from r2med_agent.retrieval.dense.instructions import instruction_prefixes
    from r2med_agent.retrieval.dense.spec import get_encoder_spec
    from tests.unit.retrieval.test_dense import HashEncoder

    spec = get_encoder_spec("minilm")
    enc = HashEncoder(spec)
    pre = instruction_prefixes(spec, "Biology", "qa", "biology")
    reqs = [
        SearchRequest("q1", "why do cells divide", "s1", "hyde", ("s2", "  ", "s3")),
        SearchRequest("q2", "how do enzymes work", "e1", "query2doc", ("e2",)),
        SearchRequest("q3", "what is DNA", "d1", "lamer"),
    ]
    got = query_embeddings(enc, reqs, pre)
    v = lambda t: l2_normalize(HashEncoder.vector(t)[None])[0]  # noqa: E731 - minilm normalises
    expect_q1 = np.mean([v("why do cells divide"), v("s1"), v("s2"), v("s3")], axis=0)  # blank sample left out
    expect_q2 = np.mean([v("how do enzymes work" + SEP + "e1"), v("how do enzymes work" + SEP + "e2")], axis=0)
    expect_q3 = (v("what is DNA") + v("d1")) / 2
    want = l2_normalize(np.stack([expect_q1, expect_q2, expect_q3]).astype(np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert bm25_query_text(reqs[0]) == "s1 s2 s3"
    assert bm25_query_text(reqs[1]) == "how do enzymes work how do enzymes work e1 e2"
    assert bm25_query_text(reqs[2]) == "what is DNA d1"


def test_run_with_samples_records_n_and_writes_every_sample(tmp_path, monkeypatch) -> None:
    from r2med_agent.analysis.results import split_leaf
    from r2med_agent.llm.registry import LLMSpec
    from r2med_agent.api import RunConfig, run_experiment

    monkeypatch.setattr("r2med_agent.llm.registry.get_llm_spec",
                        lambda name: LLMSpec(name="scripted", backend="local", model="scripted"))
    fake = ScriptedLLM(lambda m, p: f"passage seed {p.seed}")
    llm = CachedLLM(fake, "scripted", cache=GenerationCache(tmp_path / "g.sqlite"))
    cfg = RunConfig(tasks=("sample",), method="hyde", llm="scripted", samples=3, output_dir=tmp_path / "res",
                    show_progress=False)
    result = run_experiment(cfg, llm=llm)
    assert result.result_dir.name == f"bm25__n3__{cfg.digest()}" and split_leaf("bm25__n3") == ("bm25__n3", "")
    stats = result.outcomes[0].stats
    assert stats["samples"] == 3 and stats["generations"] == 36
    row = json.loads((result.result_dir / "sample.generations.jsonl").read_text().splitlines()[0])
    assert row["samples"] == ["passage seed 42", "passage seed 43", "passage seed 44"]
    assert json.loads((result.result_dir / "sample.json").read_text())["config"]["samples"] == 3
    with pytest.raises(ConfigError, match="--samples applies to hyde"):
        RunConfig(tasks=("sample",), method="search-r1", llm="x", samples=2)
    with pytest.raises(ConfigError, match="at least 1"):
        RunConfig(tasks=("sample",), method="hyde", llm="x", samples=0)


@pytest.mark.slow
def test_samples_end_to_end_with_the_local_model(tmp_path, smollm2_spec) -> None:
    from r2med_agent.api import RunConfig, run_experiment

    data = tmp_path / "data" / "Biology"
    data.mkdir(parents=True)
    (data / "query.jsonl").write_text(json.dumps({"id": "q1", "text": "What enzyme digests starch?"}) + "\n"
                                      + json.dumps({"id": "q2", "text": "Which organ makes insulin?"}) + "\n")
    docs = ["Salivary amylase digests starch.", "The pancreas makes insulin.", "Starch is made of glucose."]
    (data / "corpus.jsonl").write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(docs)))
    (data / "qrels.jsonl").write_text(json.dumps({"q_id": "q1", "p_id": "d0", "score": 1}) + "\n"
                                      + json.dumps({"q_id": "q2", "p_id": "d1", "score": 1}) + "\n")
    cfg = RunConfig(tasks=("Biology",), method="hyde", llm="smollm2", samples=2, data_dir=data.parent, allow_count_mismatch=True,
                    output_dir=tmp_path / "res", cache_path=tmp_path / "gen.sqlite", sampling={"max_tokens": 12},
                    show_progress=False)
    first = run_experiment(cfg)
    assert first.result_dir.name == f"bm25__mt12__n2__{cfg.digest()}" and first.outcomes[0].stats["generations"] == 4
    rows = [json.loads(r) for r in (first.result_dir / "Biology.generations.jsonl").read_text().splitlines()]
    assert all(len(r["samples"]) == 2 for r in rows)
    assert any(r["samples"][0] != r["samples"][1] for r in rows)  # seeds 42 and 43 draw differently
    again = run_experiment(cfg)
    assert again.outcomes[0].stats["cache_hits"] == 4 and again.average == first.average


def test_samples_with_released_generations_are_refused_before_any_work(tmp_path, capsys) -> None:
    """Issue 30 item 1: R2MED released one text per query; ``--samples 4`` over them used to
    score that one text under a ``[samples=4]`` label. The run stops first, naming the file and
    its counts, and writes nothing."""
    from r2med_agent.cli.app import main

    out = tmp_path / "results"
    args = ["run", "--method", "hyde", "--llm", "qwen-7b", "--generations", "r2med", "--task", "r2med-demo",
            "-o", str(out), "--no-progress"]
    assert main([*args, "--samples", "4"]) == ConfigError.exit_code
    message = " ".join(capsys.readouterr().err.split())
    assert "r2med-demo/Biology/hyde/qwen-7b/query_with_hydoc.jsonl" in message
    assert "holds 2 released texts, one per query" in message and "(8 texts)" in message
    assert "--samples 1" in message and "--generations fresh" in message
    assert not out.exists()
    # One sample per query is what the file holds, and it runs.
    assert main(args) == 0
