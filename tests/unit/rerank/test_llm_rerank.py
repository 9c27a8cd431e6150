"""LLM rerankers: sliding windows, permutation repair, judgments and P(yes) scoring (units with a
scripted LLM), and the whole path through ``run`` with the real local model."""

from __future__ import annotations

import math
import re

import pytest

from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.rerank.llm import (
    LLMReranker,
    RerankJob,
    judgment_prefix,
    parse_judgment,
    parse_permutation,
    window_positions,
    yes_probability,
)
from r2med_agent.rerank.spec import RerankerSpec
from r2med_agent.types import Doc, Generation, SamplingParams, SearchRequest, Task
from tests.fakes import ScriptedLLM

# --------------------------------------------------------------------------- pure parts


def test_window_positions_follow_rankgpt_from_the_bottom_up() -> None:
    assert window_positions(100, 20, 10) == [(80, 100), (70, 90), (60, 80), (50, 70), (40, 60),
                                             (30, 50), (20, 40), (10, 30), (0, 20)]
    assert window_positions(25, 20, 10) == [(5, 25), (0, 15)]  # the top is always read
    assert window_positions(15, 20, 10) == [(0, 15)]
    assert window_positions(0, 20, 10) == []


def test_parse_permutation_repairs_and_counts() -> None:
    order, repair = parse_permutation("[2] > [1] > [3]", 3)
    assert order == [1, 0, 2] and not repair.any
    order, repair = parse_permutation("[2] > [2] > [7] > [0] > [4]", 4)
    assert order == [1, 3, 0, 2]
    assert repair.to_dict() == {"missing": 2, "repeated": 1, "out_of_range": 2}
    order, repair = parse_permutation("3, 1", 3)  # bare numbers when nothing is bracketed
    assert order == [2, 0, 1] and repair.missing == 1
    order, repair = parse_permutation("I cannot rank these.", 3)
    assert order == [0, 1, 2] and repair.missing == 3
    # Bracketed numbers win over other numbers in the text.
    assert parse_permutation("Passage [2] cites 1999 studies; [2] > [1]", 2)[0] == [1, 0]


def test_parse_judgment() -> None:
    assert parse_judgment("It explains the mechanism.\nRelevant: yes") is True
    assert parse_judgment("**Relevant:** No") is False
    assert parse_judgment("Relevant: no... on reflection, Relevance - YES") is True
    assert parse_judgment("I would say yes.") is True
    assert parse_judgment("Not sure.") is None


def test_yes_probability_sums_every_spelling() -> None:
    top = [(" yes", math.log(0.5)), ("Yes", math.log(0.1)), (" no", math.log(0.2)), ("maybe", math.log(0.1))]
    assert yes_probability(top) == pytest.approx(0.6 / 0.8)
    assert yes_probability([("maybe", 0.0)]) is None
    assert yes_probability(None) is None


def test_judgment_prefix_cuts_at_the_last_marker() -> None:
    assert judgment_prefix("a\nRelevant: yes\nb\nRelevant: no") == "a\nRelevant: yes\nb\nRelevant:"
    assert judgment_prefix("no marker here  ") == "no marker here\n\nRelevant:"


# --------------------------------------------------------------------------- rerankers, scripted


def _task(name: str, n_docs: int, family: str = "qa") -> Task:
    docs = tuple(Doc(f"{name}-d{i}", f"text {i} " + ("GOOD" if i % 2 else "bad")) for i in range(n_docs))
    from r2med_agent.types import Query

    queries = (Query(f"{name}-q0", "first query"), Query(f"{name}-q1", "second query"))
    return Task(name, family, "biology", queries, docs, {}, "test", name)  # type: ignore[arg-type]


def _job(task: Task) -> RerankJob:
    ids = [d.doc_id for d in task.corpus]
    run = {q.query_id: {d: float(len(ids) - i) for i, d in enumerate(ids)} for q in task.queries}
    return RerankJob(task, [SearchRequest(q.query_id, q.text) for q in task.queries], run,
                     {d.doc_id: d.text for d in task.corpus})


def _reverse_window(messages, params) -> str:  # noqa: ANN001
    n = len(re.findall(r"^\[\d+\] ", messages[-1]["content"], flags=re.M))
    return " > ".join(f"[{i}]" for i in range(n, 0, -1))


def _ranked(run: dict[str, float]) -> list[str]:
    return sorted(run, key=lambda d: -run[d])


def test_listwise_slides_windows_bottom_up_one_call_per_window_across_tasks(tmp_path) -> None:
    fake = ScriptedLLM(_reverse_window)
    llm = CachedLLM(fake, "scripted", cache=GenerationCache(tmp_path / "g.sqlite"))
    spec = RerankerSpec(name="lw", kind="listwise", llm="x", window=4, step=2)
    a, b = _task("A", 8), _task("B", 8, family="case")
    outs = LLMReranker(spec, llm=llm).rerank_tasks([_job(a), _job(b)], 6)
    # Windows (2, 6) then (0, 4): each one generate call holding all 4 queries of both tasks.
    assert [len(c) for c in fake.calls] == [4, 4]
    # [0 1 2 3 4 5] -> window 2..6 reversed: [0 1 5 4 3 2] -> window 0..4 reversed: [4 5 1 0 3 2];
    # the tail (6, 7) keeps its order below.
    expected = [f"A-d{i}" for i in (4, 5, 1, 0, 3, 2, 6, 7)]
    assert _ranked(outs[0].run["A-q0"]) == expected
    # The model sees positions, never document ids, and each task's own prompt.
    first = fake.calls[0][0][-1]["content"]
    assert "A-d" not in first and "[1] text 2 bad" in first
    assert "similar" in fake.calls[0][2][-1]["content"]  # task B's family is "case"
    trace = outs[0].traces[0]
    assert [(w["start"], w["end"]) for w in trace.extra["windows"]] == [(2, 6), (0, 4)]
    assert trace.steps[0].doc_ids == ("A-d2", "A-d3", "A-d4", "A-d5")
    assert outs[0].stats["windows"] == 4 and outs[0].stats["repairs"] == {"missing": 0, "repeated": 0, "out_of_range": 0}
    # A second run is served by the cache: no call reaches the model.
    again = LLMReranker(spec, llm=CachedLLM(fake, "scripted", cache=GenerationCache(tmp_path / "g.sqlite")))
    assert again.rerank_tasks([_job(a), _job(b)], 6)[0].run == outs[0].run and len(fake.calls) == 2


def test_listwise_counts_repairs_in_stats_and_traces() -> None:
    fake = ScriptedLLM(lambda m, p: "[3] > [3] > [9]")
    spec = RerankerSpec(name="lw", kind="listwise", llm="x", window=4, step=2)
    out = LLMReranker(spec, llm=CachedLLM(fake, "scripted")).rerank_tasks([_job(_task("A", 4))], 4)[0]
    assert out.stats["repairs"] == {"missing": 6, "repeated": 2, "out_of_range": 2}
    assert out.stats["answers_repaired"] == 2
    assert _ranked(out.run["A-q0"]) == ["A-d2", "A-d0", "A-d1", "A-d3"]
    assert "repaired: 3 missing, 1 repeated, 1 out of range" in out.traces[0].steps[0].inserted


def test_pointwise_parsed_judgments_keep_first_stage_order_on_ties() -> None:
    fake = ScriptedLLM(lambda m, p: "Thinking.\nRelevant: " + ("yes" if "GOOD" in m[-1]["content"] else "no"))
    spec = RerankerSpec(name="pw", kind="pointwise-reasoning", llm="x")
    out = LLMReranker(spec, llm=CachedLLM(fake, "scripted")).rerank_tasks([_job(_task("A", 6))], 5)[0]
    assert len(fake.calls) == 1 and len(fake.calls[0]) == 10  # all pairs in one call, no logprobs
    assert _ranked(out.run["A-q0"]) == ["A-d1", "A-d3", "A-d0", "A-d2", "A-d4", "A-d5"]
    assert out.run["A-q0"]["A-d1"] == 1.0 and out.run["A-q0"]["A-d0"] == 0.0
    assert out.stats["scored_by_logprobs"] == 0


class _LogprobLLM(ScriptedLLM):
    """Scripted answers; the judgment request (max_tokens 1, logprobs) gets top log-probabilities
    whose P(yes) is the document's number / 10."""

    returns_logprobs = True

    def generate(self, prompts, params):  # noqa: ANN001, ANN201
        if not params.logprobs:
            return super().generate(prompts, params)
        self.calls.append([list(p) for p in prompts])
        out = []
        for m in prompts:
            assert m[-1]["role"] == "assistant" and m[-1]["content"].endswith("Relevant:")
            p = int(re.search(r"text (\d+)", m[-2]["content"]).group(1)) / 10 + 0.05
            top = ((" yes", math.log(p * 0.5)), (" Yes", math.log(p * 0.5)), (" no", math.log(1 - p)))
            out.append(Generation(text=" yes", finish_reason="length", logprobs=(top,)))
        return out


def test_pointwise_scores_by_yes_probability_and_caches_the_logprobs(tmp_path) -> None:
    fake = _LogprobLLM(lambda m, p: "It might help.\nRelevant: no")
    spec = RerankerSpec(name="pw", kind="pointwise-reasoning", llm="x")
    llm = CachedLLM(fake, "scripted", cache=GenerationCache(tmp_path / "g.sqlite"))
    out = LLMReranker(spec, llm=llm).rerank_tasks([_job(_task("A", 5))], 5)[0]
    assert len(fake.calls) == 2  # reasoning for all pairs, then all judgments
    assert _ranked(out.run["A-q0"]) == ["A-d4", "A-d3", "A-d2", "A-d1", "A-d0"]
    assert out.run["A-q0"]["A-d2"] == pytest.approx(0.25)
    rec = out.traces[0].extra["judgments"][0]
    assert rec["judgment"] == "no" and rec["p_yes"] == pytest.approx(0.05)
    # The log-probabilities come back from the cache: the same scores without the model.
    again = LLMReranker(spec, llm=CachedLLM(fake, "scripted", cache=GenerationCache(tmp_path / "g.sqlite")))
    assert again.rerank_tasks([_job(_task("A", 5))], 5)[0].run == out.run and len(fake.calls) == 2


def test_logprobs_enter_the_key_only_when_asked(tmp_path) -> None:
    llm = CachedLLM(ScriptedLLM(lambda m, p: "x"), "scripted")
    msgs = [{"role": "user", "content": "q"}]
    assert "logprobs" not in SamplingParams().to_dict()
    assert llm.builder.key(msgs, SamplingParams()) != llm.builder.key(msgs, SamplingParams(logprobs=20))
    assert llm.request(msgs, SamplingParams(logprobs=20))["params"]["logprobs"] == 20


def test_reranker_spec_validation() -> None:
    with pytest.raises(ValueError, match="needs 'llm'"):
        RerankerSpec(name="x", kind="listwise")
    with pytest.raises(ValueError, match="step between"):
        RerankerSpec(name="x", kind="listwise", llm="smollm2", window=4, step=4)
    with pytest.raises(ValueError, match="needs 'model'"):
        RerankerSpec(name="x")


# --------------------------------------------------------------------------- end to end, real model


@pytest.mark.slow
def test_llm_rerankers_run_end_to_end_with_the_local_model(tmp_path, smollm2_spec, monkeypatch) -> None:
    import json

    from typer.testing import CliRunner

    import r2med_agent.cli.trace_cmd  # noqa: F401  (registers the command)
    from r2med_agent.cli.common import app
    from r2med_agent.api import build_table, load_results
    from r2med_agent.config import set_user_config
    from r2med_agent.methods.loop import read_traces
    from r2med_agent.analysis.report import drilldown_data
    from r2med_agent.api import RunConfig, run_experiment

    data = tmp_path / "data" / "Biology"  # a tiny stand-in in R2MED layout
    data.mkdir(parents=True)
    (data / "query.jsonl").write_text(
        json.dumps({"id": "q1", "text": "What enzyme digests starch in saliva?"}) + "\n"
        + json.dumps({"id": "q2", "text": "Which organ makes insulin?"}) + "\n")
    docs = ["Salivary amylase digests starch.", "The pancreas makes insulin in islet cells.",
            "Starch is a polymer of glucose.", "Insulin lowers blood glucose.", "Saliva is mostly water."]
    (data / "corpus.jsonl").write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(docs)))
    (data / "qrels.jsonl").write_text(json.dumps({"q_id": "q1", "p_id": "d0", "score": 1}) + "\n"
                                      + json.dumps({"q_id": "q2", "p_id": "d1", "score": 1}) + "\n")
    user = tmp_path / "config.yaml"
    user.write_text("rerankers:\n"
                    "  tiny-lw: {kind: listwise, llm: smollm2, window: 3, step: 1, max_doc_words: 12, max_tokens: 12}\n"
                    "  tiny-pw: {kind: pointwise-reasoning, llm: smollm2, max_doc_words: 12, max_tokens: 12}\n")
    set_user_config(user)
    try:
        results = {}
        for name in ("tiny-lw", "tiny-pw"):
            cfg = RunConfig(tasks=("Biology",), reranker=name, rerank_k=3, data_dir=data.parent, allow_count_mismatch=True, output_dir=tmp_path / "res",
                            cache_path=tmp_path / "gen.sqlite", show_progress=False)
            results[name] = run_experiment(cfg)
            again = run_experiment(cfg)
            assert again.outcomes[0].stats["rerank"]["generations"] == 0  # all from the cache
            assert again.average == results[name].average
        lw_dir, pw_dir = results["tiny-lw"].result_dir, results["tiny-pw"].result_dir
        # The rerankers are a user config's entries: their folders carry the entries token.
        assert re.match(r"bm25__rk3__entries-[0-9a-f]{6}__tiny-lw__", lw_dir.name), lw_dir.name
        assert re.match(r"bm25__rk3__entries-[0-9a-f]{6}__tiny-pw__", pw_dir.name), pw_dir.name
        lw = json.loads((lw_dir / "Biology.json").read_text())["stats"]
        assert lw["rerank"]["windows"] == 2 * 1 and lw["prompt_tokens"] > 0  # 3 candidates: one window each
        pw = json.loads((pw_dir / "Biology.json").read_text())["stats"]
        traces = read_traces(pw_dir / "Biology.rerank.jsonl")
        assert [t.query_id for t in traces] == ["q1", "q2"] and len(traces[0].steps) == 3
        # One judgment per candidate BM25 found (q2's words match two documents only).
        assert pw["rerank"]["pairs"] == sum(len(t.steps) for t in traces) == 5
        assert pw["rerank"]["scored_by_logprobs"] == 0  # llama.cpp: the parsed judgment
        shown = CliRunner().invoke(app, ["trace", "show", str(lw_dir / "Biology.rerank.jsonl")],
                                env={"COLUMNS": "200"})
        assert shown.exit_code == 0 and "rerank-listwise" in shown.output and "ranks 1-3" in shown.output
        table = build_table(load_results([tmp_path / "res"]), tasks=["Biology"])
        assert {r.row.reranker for r in table.rows} == {"tiny-lw", "tiny-pw"}
        dd = drilldown_data(table)
        assert any(q.get("rerank") for per in dd["results"].values() for q in per["Biology"].values())
    finally:
        set_user_config(None)


def test_openai_wire_asks_for_top_logprobs_only_when_set_and_reads_them() -> None:
    from types import SimpleNamespace as NS

    from r2med_agent.llm.replies import to_generation
    from r2med_agent.llm.wire import key_params

    assert "logprobs" not in key_params(SamplingParams(), server="vllm")
    sent = key_params(SamplingParams(logprobs=20), server="vllm")
    assert sent["logprobs"] is True and sent["top_logprobs"] == 20
    pos = NS(token=" yes", logprob=-0.1, top_logprobs=[NS(token=" no", logprob=-2.5), NS(token=" yes", logprob=-0.1)])
    choice = NS(message=NS(content=" yes"), finish_reason="length", logprobs=NS(content=[pos]))
    response = NS(choices=[choice], usage=NS(prompt_tokens=5, completion_tokens=1))
    gen = to_generation(response, SamplingParams(logprobs=20, max_tokens=1), 0.0)
    assert gen.logprobs == (((" yes", -0.1), (" no", -2.5)),)
    assert yes_probability(gen.logprobs[0]) == pytest.approx(math.exp(-0.1) / (math.exp(-0.1) + math.exp(-2.5)))
    assert to_generation(response, SamplingParams(), 0.0).logprobs is None


def test_token_choices_travel_as_vllm_ids_and_only_to_vllm_servers(tmp_path) -> None:
    """``token_choices``: part of the cache key, sent to a vLLM server as ``allowed_token_ids``
    and ``logprob_token_ids`` (the ids of the entry's tokenizer, with as many top
    log-probabilities), read back although ``logprobs`` is 0, and refused by other servers."""
    from types import SimpleNamespace as NS

    from r2med_agent.config import build
    from r2med_agent.errors import ConfigError, LLMError
    from r2med_agent.llm.base import choice_token_ids
    from r2med_agent.llm.openai_compat import OpenAICompatBackend
    from r2med_agent.llm.registry import LLMSpec
    from r2med_agent.llm.replies import to_generation
    from r2med_agent.llm.wire import key_params

    params = SamplingParams(temperature=0.0, max_tokens=1, token_choices=(" true", " false"))
    assert params.to_dict()["token_choices"] == [" true", " false"]
    assert "token_choices" not in SamplingParams().to_dict()  # older keys stay valid
    sent = key_params(params, server="vllm")
    assert sent["token_choices"] == [" true", " false"] and sent["top_logprobs"] == 2
    with pytest.raises(ConfigError, match="need a vLLM server; this one is 'llamacpp'"):
        key_params(params, server="llamacpp")

    class Tok:  # a tokenizer whose words are single tokens
        vocab = {" true": [7], " false": [9, 1], " t": [7, 3]}

        def encode(self, text, add_special_tokens=True):  # noqa: ANN001, ANN201
            assert add_special_tokens is False
            return self.vocab[text]

    spec = build(LLMSpec, {"name": "v", "backend": "openai", "model": "m", "server": "vllm",
                           "base_urls": ["http://127.0.0.1:9/v1"]}, "test")
    backend = OpenAICompatBackend(spec)
    backend._tokenizer = Tok()
    req = backend._request([{"role": "user", "content": "q"}], params)
    assert req["extra_body"]["allowed_token_ids"] == [7, 9] == req["extra_body"]["logprob_token_ids"]
    assert "token_choices" not in req["extra_body"] and req["top_logprobs"] == 2
    with pytest.raises(LLMError, match="share a first token"):
        choice_token_ids(lambda s: Tok().encode(s, add_special_tokens=False), (" true", " t"))
    top = {" false": -11.6, " true": -14.0}
    choice = NS(text=" false", message=None, finish_reason="length", logprobs=NS(top_logprobs=[top]))
    gen = to_generation(NS(choices=[choice], usage=None), params, 0.0)
    assert gen.logprobs == (((" false", -11.6), (" true", -14.0)),)
