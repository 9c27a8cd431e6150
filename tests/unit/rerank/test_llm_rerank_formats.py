"""Published LLM reranker formats (ReasonRank, InsertRank, Rank1): each prompt byte for byte
against a string built the way the authors' code builds it, answer parsing and repairs, scores
from log-probabilities, batching (units with a scripted LLM); the whole path through ``run``
with the real local model (slow)."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.rerank import formats
from r2med_agent.rerank.llm import LLMReranker, RerankJob
from r2med_agent.rerank.spec import RerankerSpec
from r2med_agent.types import Doc, Generation, Query, SearchRequest, Task
from tests.fakes import ScriptedLLM


def _task(name: str, n_docs: int, family: str = "qa") -> Task:
    docs = tuple(Doc(f"{name}-d{i}", f"text {i} [{i}] " + ("GOOD" if i % 2 else "bad")) for i in range(n_docs))
    queries = (Query(f"{name}-q0", "first [3] query"), Query(f"{name}-q1", "second query"))
    return Task(name, family, "biology", queries, docs, {}, "test", name)  # type: ignore[arg-type]


def _job(task: Task) -> RerankJob:
    ids = [d.doc_id for d in task.corpus]
    run = {q.query_id: {d: 10.0 + 1.25 * (len(ids) - i) for i, d in enumerate(ids)} for q in task.queries}
    return RerankJob(task, [SearchRequest(q.query_id, q.text) for q in task.queries], run,
                     {d.doc_id: d.text for d in task.corpus})


def _ranked(run: dict[str, float]) -> list[str]:
    return sorted(run, key=lambda d: -run[d])


# --------------------------------------------------------------------------- ReasonRank


def _reasonrank_reference(query: str, docs: list[str]) -> list[dict[str, str]]:
    """The messages as ReasonRank builds them (8421BCD/ReasonRank rerank/rank_listwise_os_llm.py
    create_prompt with utils.py add_prefix_prompt/add_post_prompt, prompt mode
    rank_GPT_reasoning), written out here independently of the template."""
    def swap(s: str) -> str:
        return re.sub(r"\[(\d+)\]", r"(\1)", s)

    query = swap(query).strip()
    num = len(docs)
    text = (f"I will provide you with {num} passages, each indicated by a numerical identifier []. "
            f"Rank the passages based on their relevance to the search query: {query}.\n")
    text += "\n"
    for rank, doc in enumerate(docs, start=1):
        text += f"[{rank}] {swap(' '.join(doc.strip().split()))}\n"
    text += (f"Search Query: {query}.\nRank the {num} passages above based on their relevance to the search "
             "query. All the passages should be included and listed using identifiers, in descending order of "
             "relevance. The format of the answer should be [] > [], e.g., [2] > [1].")
    system = ("You are RankLLM, an intelligent assistant that can rank passages based on their relevance to the "
              "query. Given a query and a passage list, you first thinks about the reasoning process in the mind "
              "and then provides the answer (i.e., the reranked passage list). The reasoning process and answer "
              "are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> "
              "reasoning process here </think> <answer> answer here </answer>.")
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


def _reverse_in_block(messages, params) -> str:  # noqa: ANN001
    n = len(re.findall(r"^\[\d+\] ", messages[-1]["content"], flags=re.M))
    return "<think>the last is best</think>\n<answer>" + " > ".join(f"[{i}]" for i in range(n, 0, -1)) + "</answer>"


def test_reasonrank_prompt_is_reasonranks_byte_for_byte_and_one_call_per_window(tmp_path) -> None:
    fake = ScriptedLLM(_reverse_in_block)
    llm = CachedLLM(fake, "scripted", cache=GenerationCache(tmp_path / "g.sqlite"))
    spec = RerankerSpec(name="rr", kind="listwise", format="reasonrank", llm="x", window=4, step=2)
    a, b = _task("A", 8), _task("B", 8, family="case")
    outs = LLMReranker(spec, llm=llm).rerank_tasks([_job(a), _job(b)], 6)
    assert [len(c) for c in fake.calls] == [4, 4]  # two window positions, all 4 queries each
    docs = {d.doc_id: d.text for d in a.corpus}
    assert fake.calls[0][0] == _reasonrank_reference("first [3] query", [docs[f"A-d{i}"] for i in range(2, 6)])
    # Every family gets the same trained format (the case task's prompt differs only in content).
    assert fake.calls[0][2][-1]["content"].startswith("I will provide you with 4 passages")
    assert _ranked(outs[0].run["A-q0"]) == [f"A-d{i}" for i in (4, 5, 1, 0, 3, 2, 6, 7)]
    assert outs[0].stats["no_answer_block"] == 0 and outs[0].stats["format"] == "reasonrank"
    assert outs[0].traces[0].extra["windows"][0]["answer_block"] is True
    again = LLMReranker(spec, llm=CachedLLM(fake, "scripted", cache=GenerationCache(tmp_path / "g.sqlite")))
    assert again.rerank_tasks([_job(a), _job(b)], 6)[0].run == outs[0].run and len(fake.calls) == 2


def test_answer_block_reads_the_order_as_reasonrank_does() -> None:
    assert formats.answer_block("<think>[1] looks off</think> <answer>[2] > [1]</answer>") == ("[2] > [1]", True)
    # Without a closed block: after the last <answer>; without one: the whole text (then repaired).
    assert formats.answer_block("<think>long... <answer>[3] > [1]") == ("[3] > [1]", False)
    assert formats.answer_block("[1] > [2]") == ("[1] > [2]", False)


def test_reasonrank_reads_the_answer_block_not_the_reasoning_and_counts_repairs() -> None:
    # The reasoning names [1] first; only the answer block counts. Then a truncated answer.
    answers = iter(["<think>[1] > [2] > [3] > [4]</think><answer>[4] > [4] > [9]</answer>",
                    "<think>I was cut off", "x", "x"])
    fake = ScriptedLLM(lambda m, p: next(answers))
    spec = RerankerSpec(name="rr", kind="listwise", format="reasonrank", llm="x", window=4, step=2)
    job = _job(_task("A", 4))
    job.requests = job.requests[:1]
    out = LLMReranker(spec, llm=CachedLLM(fake, "scripted")).rerank_tasks([job], 4)[0]
    assert out.traces[0].extra["windows"][0]["permutation"] == [4, 1, 2, 3]
    assert out.stats["repairs"] == {"missing": 3, "repeated": 1, "out_of_range": 1}
    assert out.stats["no_answer_block"] == 0
    # A spec validates its format against its kind.
    with pytest.raises(ValueError, match="format rank1 is for kind pointwise-reasoning"):
        RerankerSpec(name="x", kind="listwise", format="rank1", llm="y")
    with pytest.raises(ValueError, match="'format' are for the LLM kinds"):
        RerankerSpec(name="x", model="m", format="reasonrank")


def test_reasonrank_counts_answers_without_a_block() -> None:
    fake = ScriptedLLM(lambda m, p: "<think>I ran out of room")
    spec = RerankerSpec(name="rr", kind="listwise", format="reasonrank", llm="x", window=4, step=2)
    out = LLMReranker(spec, llm=CachedLLM(fake, "scripted")).rerank_tasks([_job(_task("A", 3))], 3)[0]
    assert out.stats["no_answer_block"] == 2 and out.stats["repairs"]["missing"] == 6
    assert _ranked(out.run["A-q0"]) == ["A-d0", "A-d1", "A-d2"]  # nothing named: the order stays


# --------------------------------------------------------------------------- InsertRank


def test_insertrank_shows_each_candidates_score_from_the_run_being_reranked() -> None:
    seen = []
    fake = ScriptedLLM(lambda m, p: seen.append(m[-1]["content"]) or "[2] > [1]")
    spec = RerankerSpec(name="ir", kind="listwise", format="insertrank", llm="x", window=4, step=2)
    job = _job(_task("A", 3))
    job.run["A-q0"]["A-d1"] = 7.123456  # the run's own scores reach the prompt, whatever they are
    out = LLMReranker(spec, llm=CachedLLM(fake, "scripted")).rerank_tasks([job], 3)[0]
    assert len(fake.calls) == 1 and len(fake.calls[0]) == 2
    # The run ranks d0 (13.75), d2 (11.25), d1 (7.123456): each is shown with its own score.
    expected_items = ("[1] text 0 [0] bad\nBM25 score: 13.750\n\n"
                      "[2] text 2 [2] bad\nBM25 score: 11.250\n\n"
                      "[3] text 1 [1] GOOD\nBM25 score: 7.123\n\n")
    assert expected_items in seen[0]
    assert seen[0].startswith("Below are 3 passages, each marked with a number in square brackets and followed "
                              "by the BM25 score")
    assert seen[0].endswith("each number once, and nothing after it.")
    assert "Post: first [3] query" in seen[0]
    assert _ranked(out.run["A-q0"])[:2] == ["A-d2", "A-d0"]


# --------------------------------------------------------------------------- Rank1


def _rank1_reference(query: str, passage: str) -> str:
    """The prompt as Rank1 builds it (orionw/rank1 rank1.py return_prompt), written out here."""
    return ("Determine if the following passage is relevant to the query. Answer only with 'true' or 'false'.\n"
            f"Query: {query}\n"
            f"Passage: {passage}\n"
            "<think>")


class _Rank1LLM(ScriptedLLM):
    """Rank1 on a backend with log-probabilities: P(true) at the judgment is the document's
    number / 10; documents 3 never close their thinking (no judgment token), and the forced end
    gets the judgment from its one token, restricted to the two judgment tokens."""

    returns_logprobs = True
    scores_choices = True

    def generate(self, prompts, params, **kw):  # noqa: ANN001, ANN003, ANN201
        self.calls.append([list(p) for p in prompts])
        out = []
        for m in prompts:
            assert len(m) == 1 and m[0]["role"] == "assistant"  # raw text, no chat turn
            text = m[0]["content"]
            p = int(re.search(r"Passage: text (\d+)", text).group(1)) / 10 + 0.05
            top = ((" true", math.log(p)), (" false", math.log(1 - p)), ("maybe", math.log(1e-3)))
            if params.max_tokens == 1:  # the forced end
                assert text.endswith("\n</think>") and params.token_choices == (" true", " false")
                out.append(Generation(text=" true", logprobs=(top,)))
            elif "text 3" in text:
                out.append(Generation(text="Hmm. It is long and", finish_reason="length",
                                      logprobs=((("and", 0.0),),) * 3))
            else:
                assert params.stop == formats.RANK1_STOPS and params.logprobs == 20
                out.append(Generation(text="It fits.\n", stop_reason="</think> false",
                                      logprobs=((("x", 0.0),), top)))
        return out


def test_rank1_prompt_is_rank1s_raw_text_and_scores_p_true_with_a_forced_end(tmp_path) -> None:
    fake = _Rank1LLM(lambda m, p: "")
    spec = RerankerSpec(name="r1", kind="pointwise-reasoning", format="rank1", llm="x")
    llm = CachedLLM(fake, "scripted", cache=GenerationCache(tmp_path / "g.sqlite"))
    task = _task("A", 5)
    out = LLMReranker(spec, llm=llm).rerank_tasks([_job(task)], 5)[0]
    # All pairs in one call; the two unfinished ones (document 3, both queries) in one more.
    assert [len(c) for c in fake.calls] == [10, 2]
    assert fake.calls[0][0] == [{"role": "assistant", "content": _rank1_reference("first [3] query", "text 0 [0] bad")}]
    assert fake.calls[1][0][0]["content"] == _rank1_reference("first [3] query", "text 3 [3] GOOD") + "\nHmm.\n</think>"
    assert _ranked(out.run["A-q0"]) == ["A-d4", "A-d3", "A-d2", "A-d1", "A-d0"]
    assert out.run["A-q0"]["A-d2"] == pytest.approx(0.25)
    assert out.run["A-q0"]["A-d3"] == pytest.approx(0.35)  # from the forced end
    assert out.stats["scored_by_logprobs"] == 10 and out.stats["forced_end"] == 2
    rec = out.traces[0].extra["judgments"][0]
    assert rec["judgment"] == "false" and rec["p_true"] == pytest.approx(0.05)
    again = LLMReranker(spec, llm=CachedLLM(fake, "scripted", cache=GenerationCache(tmp_path / "g.sqlite")))
    assert again.rerank_tasks([_job(task)], 5)[0].run == out.run and len(fake.calls) == 2


class _Rank1Choices(ScriptedLLM):
    """Rank1 on a backend that scores token choices but returns no generation log-probabilities
    (local llama.cpp): P(true) after ``</think>`` is the document's number / 10."""

    scores_choices = True

    def generate(self, prompts, params, **kw):  # noqa: ANN001, ANN003, ANN201
        self.calls.append([list(p) for p in prompts])
        out = []
        for m in prompts:
            text = m[0]["content"]
            if params.max_tokens == 1:
                assert params.token_choices == (" true", " false") and params.logprobs == 0
                p = int(re.search(r"Passage: text (\d+)", text).group(1)) / 10 + 0.05
                out.append(Generation(text=" true", logprobs=(((" true", math.log(p)), (" false", math.log(1 - p))),)))
            elif "text 3" in text:
                out.append(Generation(text="Hmm. It is long and", finish_reason="length"))
            else:
                assert params.logprobs == 0
                out.append(Generation(text="It fits.\n", stop_reason="</think> false"))
        return out


def test_rank1_with_token_choices_alone_scores_each_answer_after_its_thinking(tmp_path) -> None:
    fake = _Rank1Choices(lambda m, p: "")
    spec = RerankerSpec(name="r1", kind="pointwise-reasoning", format="rank1", llm="x")
    out = LLMReranker(spec, llm=CachedLLM(fake, "scripted")).rerank_tasks([_job(_task("A", 5))], 5)[0]
    assert [len(c) for c in fake.calls] == [10, 10]  # every answer judged in one more call
    follow = {c[0]["content"].split("Passage: ")[1][:6]: c[0]["content"] for c in fake.calls[1]
              if "first [3] query" in c[0]["content"]}
    # A finished answer goes on right after its </think>; an unfinished one is ended by force.
    assert follow["text 0"] == _rank1_reference("first [3] query", "text 0 [0] bad") + "It fits.\n</think>"
    assert follow["text 3"] == _rank1_reference("first [3] query", "text 3 [3] GOOD") + "\nHmm.\n</think>"
    assert _ranked(out.run["A-q0"]) == ["A-d4", "A-d3", "A-d2", "A-d1", "A-d0"]
    assert out.run["A-q0"]["A-d2"] == pytest.approx(0.25)
    assert out.stats["scored_by_logprobs"] == 10 and out.stats["forced_end"] == 2
    rec = {r["doc_id"]: r for r in out.traces[0].extra["judgments"]}
    assert rec["A-d0"]["judgment"] == "false" and rec["A-d0"]["p_true"] == pytest.approx(0.05)
    assert not rec["A-d0"]["forced"] and rec["A-d3"]["forced"]


def test_the_second_rank1_batch_says_it_is_the_judgments(caplog) -> None:
    """Issue 30 item 10: Rank1 over llama.cpp logged "generating 10 of 10 texts" twice, the second
    time for the judgment token of the same answers; that line now says so."""
    import logging

    caplog.set_level(logging.INFO, logger="r2med_agent")
    spec = RerankerSpec(name="r1", kind="pointwise-reasoning", format="rank1", llm="x")
    LLMReranker(spec, llm=CachedLLM(_Rank1Choices(lambda m, p: ""), "scripted")).rerank_tasks([_job(_task("A", 5))], 5)
    plans = [r.getMessage() for r in caplog.records if "generating 10 of 10 texts" in r.getMessage()]
    assert len(plans) == 2 and "judgment" not in plans[0]
    assert plans[1].endswith("in 1 backend call (the judgment token of each answer, 2 of them ended by force)")


@pytest.mark.slow
def test_reading_a_gguf_vocabulary_prints_no_context_warning(smollm2_spec, capfd) -> None:
    """Issue 30 item 10: Search-R1 reads the local model's vocabulary (no weights) to cut inserted
    text by tokens, and an LLM reranker to cut passages; llama.cpp's stray "n_ctx_seq (512) >
    n_ctx_train (0)" line is printed by neither (both load it through ``load_vocab``; the
    reranker's path printed it until it did)."""
    from r2med_agent.methods.loop import load_token_cut
    from r2med_agent.rerank.tokens import load_passage_cut

    cut = load_token_cut(smollm2_spec)
    assert cut("one two three four five six", 2) != "one two three four five six"
    passages = load_passage_cut(smollm2_spec)
    assert passages.count("one two three four five six") >= 6 and "GGUF vocabulary" in passages.how
    captured = capfd.readouterr()
    assert "n_ctx" not in captured.err + captured.out


def test_rank1_without_logprobs_scores_the_judgment_from_the_stop_string() -> None:
    def script(m, p):  # noqa: ANN001, ANN202
        if "GOOD" in m[0]["content"]:
            return "Relevant enough.\n</think> true"
        return "Off topic.\n</think> false" if "text 0" in m[0]["content"] else "I keep thinking"
    fake = ScriptedLLM(script)
    spec = RerankerSpec(name="r1", kind="pointwise-reasoning", format="rank1", llm="x")
    out = LLMReranker(spec, llm=CachedLLM(fake, "scripted")).rerank_tasks([_job(_task("A", 4))], 4)[0]
    assert len(fake.calls) == 1  # no forced end without log-probabilities
    assert _ranked(out.run["A-q0"]) == ["A-d1", "A-d3", "A-d2", "A-d0"]
    assert {r["doc_id"]: r["score"] for r in out.traces[0].extra["judgments"]} == {
        "A-d0": 0.0, "A-d1": 1.0, "A-d2": 0.5, "A-d3": 1.0}
    assert out.run["A-q0"]["A-d1"] == 1.0 and out.run["A-q0"]["A-d3"] == pytest.approx(1.0)
    assert out.stats["no_judgment"] == 2 and out.stats["scored_by_logprobs"] == 0


def test_tied_scores_keep_the_first_stage_order_in_evaluation() -> None:
    """Rank1 on a backend without token choices often finds no judgment (0.5 for all): the run must still rank
    ties in first-stage order, not by document id as trec_eval breaks ties."""
    from r2med_agent.evaluation import trec_sorted

    fake = ScriptedLLM(lambda m, p: "I keep thinking")
    spec = RerankerSpec(name="r1", kind="pointwise-reasoning", format="rank1", llm="x")
    out = LLMReranker(spec, llm=CachedLLM(fake, "scripted")).rerank_tasks([_job(_task("A", 5))], 4)[0]
    assert [d for d, _ in trec_sorted(out.run["A-q0"])] == [f"A-d{i}" for i in range(5)]
    assert out.run["A-q0"]["A-d0"] == 0.5 and out.run["A-q0"]["A-d1"] < 0.5
    assert all(r["score"] == 0.5 for r in out.traces[0].extra["judgments"])


def test_rank1_parts() -> None:
    assert formats.true_probability([(" true", math.log(0.6)), (" false", math.log(0.2))]) == pytest.approx(0.75)
    assert formats.true_probability([("true", 0.0), (" false", -1.0)]) is None  # only " true" counts
    assert formats.rank1_judgment("x </think> false", None) is False
    assert formats.rank1_judgment("reasoning", "</think> true") is True
    assert formats.rank1_judgment("true, I think", None) is None
    assert formats.forced_end("P", "One. Two and") == "P\nOne.\n</think>"
    assert formats.forced_end("P", "no end here ") == "P\nno end here\n</think>"


def test_a_lone_assistant_message_is_raw_text_for_every_backend() -> None:
    from r2med_agent.llm.continuation import continuation_prompt
    from r2med_agent.llm.local import continuation_prompt as local_continuation
    from r2med_agent.llm.registry import with_system_prompt

    class Tok:
        def apply_chat_template(self, messages, **kw):  # noqa: ANN001, ANN003, ANN201
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    raw = [{"role": "assistant", "content": "Query: q\n<think>"}]
    assert with_system_prompt(raw, "You are helpful.") == raw
    assert continuation_prompt(Tok(), raw) == "Query: q\n<think>"
    assert local_continuation(lambda messages: None, raw) == "Query: q\n<think>"
    convo = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    assert continuation_prompt(Tok(), convo) == "<user>u<assistant>a"
    assert with_system_prompt(convo, "S")[0] == {"role": "system", "content": "S"}


# --------------------------------------------------------------------------- end to end, real model


def _tiny_data(root):  # noqa: ANN001, ANN202
    """A tiny stand-in in R2MED layout (the embedded sample's 12 queries take SmolLM2 over 15
    minutes on a shared 2-core machine for the three entries)."""
    import json

    data = root / "data" / "Biology"
    data.mkdir(parents=True)
    (data / "query.jsonl").write_text(
        json.dumps({"id": "q1", "text": "What enzyme digests starch in saliva?"}) + "\n"
        + json.dumps({"id": "q2", "text": "Which organ makes insulin?"}) + "\n")
    docs = ["Salivary amylase digests starch.", "The pancreas makes insulin in islet cells.",
            "Starch is a polymer of glucose.", "Insulin lowers blood glucose.", "Saliva is mostly water."]
    (data / "corpus.jsonl").write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(docs)))
    (data / "qrels.jsonl").write_text(json.dumps({"q_id": "q1", "p_id": "d0", "score": 1}) + "\n"
                                      + json.dumps({"q_id": "q2", "p_id": "d1", "score": 1}) + "\n")
    return data.parent


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-reasonrank", "smollm2-insertrank", "smollm2-rank1"])
def test_format_entries_run_end_to_end_with_the_local_model(name, tmp_path, smollm2_spec) -> None:
    """``run`` with each shipped offline entry (SmolLM2 on llama.cpp): the result, its traces and
    stats; the second run is served by the cache (no generate call)."""
    from r2med_agent.methods.loop import read_traces
    from r2med_agent.api import RunConfig, run_experiment

    cfg = RunConfig(tasks=("Biology",), reranker=name, rerank_k=3, data_dir=_tiny_data(tmp_path),
                    allow_count_mismatch=True, output_dir=tmp_path / "res", cache_path=tmp_path / "gen.sqlite",
                    show_progress=False)
    first = run_experiment(cfg)
    stats = first.outcomes[0].stats["rerank"]
    assert stats["format"] == name.split("-")[1] and stats["generations"] > 0
    assert stats["prompt_tokens"] > 0 and stats["completion_tokens"] > 0
    traces = read_traces(first.result_dir / "Biology.rerank.jsonl")
    assert [t.query_id for t in traces] == ["q1", "q2"] and all(t.extra["format"] == stats["format"] for t in traces)
    if name == "smollm2-rank1":
        # One judgment per candidate BM25 found (q2's words match two documents only).
        # llama.cpp scores the judgment token: P(true) of every pair, in one more call after
        # the answers (ended by force where the tiny model never closed its thinking).
        assert stats["pairs"] == 5 and stats["scored_by_logprobs"] == 5
        judged = [r for t in traces for r in t.extra["judgments"]]
        assert all(0.0 < r["p_true"] < 1.0 and r["score"] == r["p_true"] for r in judged)
        assert len({r["p_true"] for r in judged}) == 5  # real probabilities, no 0.5 ties
        assert stats["generations"] == 10 and stats["forced_end"] == sum(r["forced"] for r in judged)
    else:
        assert stats["windows"] == 2 and stats["answers_repaired"] <= 2
        assert sorted(traces[0].extra["windows"][0]["permutation"]) == [1, 2, 3]
    again = run_experiment(cfg)
    assert again.outcomes[0].stats["rerank"]["generations"] == 0  # all from the cache
    assert again.average == first.average


# --------------------------------------------------------------------------- ReasonRank as its code runs
# (tests/conformance/test_reasonrank.py runs the authors' code itself against these)


def test_reasonrank_strict_reading_takes_every_number_and_leaves_unreadable_windows() -> None:
    from r2med_agent.rerank.llm import reasonrank_permutation

    assert reasonrank_permutation("[2] > [1], and 3 is poor", 4)[0] == [1, 0, 2, 3]  # every number counts
    order, repair, readable = reasonrank_permutation("[\u00b2] > [1]", 3)  # int() refuses "²"
    assert (order, readable) == ([0, 1, 2], False) and not repair.any
    assert reasonrank_permutation("[\u0663] > [\u0661]", 3)[0] == [2, 0, 1]  # Arabic-Indic digits are numbers
    answers = iter(["<think>x</think><answer>[2] > [1] (3 is off)</answer>", "<think>y</think><answer>[\u00b9]</answer>"])
    spec = RerankerSpec(name="rr", kind="listwise", format="reasonrank", llm="x", window=3, step=1)
    job = _job(_task("A", 4))
    job.requests = job.requests[:1]
    out = LLMReranker(spec, llm=CachedLLM(ScriptedLLM(lambda m, p: next(answers)), "scripted")).rerank_tasks([job], 4)[0]
    windows = out.traces[0].extra["windows"]
    assert windows[0]["permutation"] == [2, 1, 3] and windows[1]["readable"] is False
    assert out.stats["unreadable_answers"] == 1
    lenient = LLMReranker(replace(spec, parse="lenient"), llm=CachedLLM(
        ScriptedLLM(lambda m, p: "<think>x</think><answer>[2] > [1] (3 is off)</answer>"), "scripted"))
    assert lenient.rerank_tasks([job], 4)[0].traces[0].extra["windows"][0]["permutation"] == [2, 1, 3]


def test_reasonrank_run_keeps_each_ranks_first_stage_score_to_six_decimals() -> None:
    spec = RerankerSpec(name="rr", kind="listwise", format="reasonrank", llm="x", window=4, step=2,
                        run_scores="positional")
    job = _job(_task("A", 4))
    job.run = {q: {d: s + 1e-9 * (i % 2) for i, (d, s) in enumerate(docs.items())} for q, docs in job.run.items()}
    job.run["A-q0"]["A-d1"] = job.run["A-q0"]["A-d2"]  # a tie the run keeps
    fake = ScriptedLLM(lambda m, p: "<think>x</think><answer>[4] > [3] > [2] > [1]</answer>")
    out = LLMReranker(spec, llm=CachedLLM(fake, "scripted")).rerank_tasks([job], 4)[0]
    first = list(job.run["A-q0"].values())
    assert list(out.run["A-q0"]) == ["A-d3", "A-d2", "A-d1", "A-d0"]
    assert list(out.run["A-q0"].values()) == [float(f"{s:.6f}") for s in first]
    with pytest.raises(ValueError, match="run_scores"):
        RerankerSpec(name="x", kind="groupwise", llm="y", run_scores="positional")


def test_passages_are_cut_by_the_entrys_own_tokenizer_and_repaired_by_ftfy(caplog) -> None:
    """smollm2's GGUF vocabulary (the local entry), ftfy's repair, and the warned fallback when an
    entry's tokenizer cannot be loaded (recorded in the stats)."""
    from r2med_agent.llm.registry import get_llm_spec
    from r2med_agent.rerank.tokens import WORDS, load_passage_cut

    spec = RerankerSpec(name="rr", kind="listwise", format="reasonrank", llm="smollm2", max_doc_tokens=6, fix_text=True)
    reranker = LLMReranker(spec, llm=CachedLLM(ScriptedLLM(lambda m, p: ""), "scripted"))
    cut = reranker.passage_cut()
    assert cut.how.startswith("tokenizer of") and "GGUF" in cut.how
    text = "  The patient\u00e2\u0080\u0099s caf\u00c3\u00a9 &amp; \u201cquoted\u201d [3] words and more words here  "
    prepared = reranker.prepared(text)
    assert prepared.startswith("The patient's caf\u00e9 & ") and cut.count(prepared) <= 7
    llama = get_llm_spec("smollm2")
    broken = replace(llama, backend="vllm", model="no/such-model-anywhere", tokenizer=str(Path("/nonexistent")))
    with caplog.at_level("WARNING"):
        fallback = load_passage_cut(broken)
    assert fallback.how == WORDS and "could not be loaded" in caplog.text
    assert fallback.cut("one  two\nthree four", 3) == "one  two\nthree"
