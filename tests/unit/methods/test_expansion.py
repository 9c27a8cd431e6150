"""Single-shot expansion methods: prompts per query, LameR's first pass, requests, registry."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from r2med_agent.prompts import templates as prompts
from r2med_agent.errors import ConfigError, DataError
from r2med_agent.methods import METHODS, ExpansionMethod, HyDE, LameR, NoneMethod, Query2Doc, get_method
from r2med_agent.methods.expansion import cut_words, top_doc_ids
from r2med_agent.types import Doc, Generation, Query, SamplingParams, SearchRequest, Task
from tests.fakes import ScriptedLLM

ENDING = {"qa": "Passage:", "exam": "Passage:", "treatment": "Passage:", "case": "Similar Case:"}
DOMAIN = {"qa": "biology", "exam": "medicine", "treatment": "medicine", "case": "medicine"}


def make_task(family: str = "qa", *, name: str = "Toy", n_docs: int = 12, domain: str | None = None) -> Task:
    queries = (
        Query("q1", "Why do leaves change colour in autumn?"),
        Query("q2", "A 50-year-old man has crushing chest pain radiating to the left arm."),
    )
    corpus = tuple(Doc(f"d{i}", f"document number {i} text") for i in range(n_docs))
    return Task(
        name=name,
        family=family,  # type: ignore[arg-type]
        domain=domain or DOMAIN[family],
        queries=queries,
        corpus=corpus,
        qrels={"q1": {"d1": 1}, "q2": {"d2": 1}},
        source="inline",
        fingerprint=f"fp-{name}",
    )


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(prompts.ENV_VAR, raising=False)


def user_text(conversation: list[dict[str, str]]) -> str:
    assert len(conversation) == 1 and conversation[0]["role"] == "user"
    return conversation[0]["content"]


# -- HyDE and Query2Doc ------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qa", "exam", "treatment", "case"])
@pytest.mark.parametrize("cls", [HyDE, Query2Doc])
def test_prompt_per_query_with_query_and_ending(cls, family):
    task = make_task(family)
    convs = cls().build_prompts(task)
    assert len(convs) == len(task.queries)
    for q, conv in zip(task.queries, convs):
        text = user_text(conv)
        assert q.text in text
        assert text.endswith(ENDING[family])
        assert "You are a helpful assistant" not in text
    # Query order is kept: each prompt holds its own query only.
    assert task.queries[1].text not in user_text(convs[0])


def test_hyde_prompt_is_exact():
    task = make_task("qa")
    text = user_text(HyDE().build_prompts(task)[0])
    assert text == (
        "Please write a passage that helps answer the following biology post.\n"
        "Post: Why do leaves change colour in autumn?\n"
        "Passage:"
    )


@pytest.mark.parametrize("family", ["qa", "exam", "treatment", "case"])
def test_query2doc_has_two_examples_before_the_query(family):
    task = make_task(family)
    text = user_text(Query2Doc().build_prompts(task)[0])
    examples = prompts.load_examples("query2doc", family, task.domain)
    assert len(examples) == 2
    label = {"qa": "Post: ", "exam": "Exam: ", "treatment": "Case: ", "case": "Case: "}[family]
    assert text.count("\n" + label) == 3  # two examples and the real query
    answer = ENDING[family] + " "
    assert text.count(answer) == 2  # the examples' passages; the real one ends the prompt
    query_at = text.index(task.queries[0].text)
    for ex in examples:
        assert ex["query"] in text and ex["passage"] in text
        assert text.index(ex["passage"]) < query_at


def test_query2doc_examples_follow_the_domain():
    bio = user_text(Query2Doc().build_prompts(make_task("qa", domain="biology"))[0])
    bioinf = user_text(Query2Doc().build_prompts(make_task("qa", domain="bioinformatics"))[0])
    assert "polyphenol oxidase" in bio and "polyphenol oxidase" not in bioinf
    assert "DESeq2" in bioinf and "DESeq2" not in bio


def test_query2doc_unknown_domain_gets_the_medical_sciences_examples():
    # A task the examples file does not know (one's own data) is not an error any more.
    text = user_text(Query2Doc().build_prompts(make_task("qa", domain="astronomy"))[0])
    for ex in prompts.load_examples("query2doc", "qa", "medical sciences"):
        assert ex["passage"] in text


# -- LameR -------------------------------------------------------------------------------------


def test_lamer_numbers_top10_in_first_pass_order():
    task = make_task("qa", n_docs=15)
    # Scores out of insertion order; q1's ranking is d14, d13, ..., d0.
    first_pass = {
        "q1": {f"d{i}": float(i) for i in range(15)},
        "q2": {"d3": 0.5, "d7": 2.0},
    }
    convs = LameR().build_prompts(task, first_pass)
    text = user_text(convs[0])
    expected = "".join(f"[{n}]. document number {14 - (n - 1)} text\n" for n in range(1, 11))
    assert expected in text
    assert "[11]." not in text and "document number 4 text" not in text
    assert task.queries[0].text in text and text.endswith("Passage:")
    assert text.index(task.queries[0].text) < text.index("[1].")
    # A query with fewer than 10 first-pass documents shows only those.
    text2 = user_text(convs[1])
    assert "[1]. document number 7 text\n[2]. document number 3 text\n" in text2
    assert "[3]." not in text2


def test_lamer_cuts_documents_to_512_whitespace_tokens():
    long_text = "\n".join(f"w{i}" for i in range(700))
    task = make_task("case", n_docs=3)
    task = dataclasses.replace(task, corpus=(Doc("long", long_text), *task.corpus))
    first_pass = {"q1": {"long": 9.0, "d0": 1.0}, "q2": {}}
    text = user_text(LameR().build_prompts(task, first_pass)[0])
    shown = " ".join(f"w{i}" for i in range(512))
    assert f"[1]. {shown}\n[2]. document number 0 text\n" in text
    assert "w512" not in text
    assert text.endswith("Similar Case:")


def test_lamer_needs_first_pass_and_known_docs():
    task = make_task("qa")
    with pytest.raises(ValueError, match="first-pass"):
        LameR().build_prompts(task, None)
    with pytest.raises(ValueError, match="q2"):
        LameR().build_prompts(task, {"q1": {"d1": 1.0}})
    with pytest.raises(DataError, match="ghost.*q1.*Toy"):
        LameR().build_prompts(task, {"q1": {"ghost": 1.0}, "q2": {}})


def test_cut_words_and_top_doc_ids():
    assert cut_words("a  b\n\tc d", 3) == "a b c"
    assert cut_words("short\ntext", 512) == "short text"
    assert top_doc_ids({"q": {"x": 1.0, "y": 3.0, "z": 1.0}}, "q", 10) == ["y", "x", "z"]
    assert top_doc_ids({"q": {"x": 1.0, "y": 3.0}}, "q", 1) == ["y"]


# -- requests ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, combine", [(HyDE, "hyde"), (Query2Doc, "query2doc"), (LameR, "lamer")]
)
def test_to_requests_uses_final_and_combine_rule(cls, combine):
    task = make_task("qa")
    gens = [
        Generation(text="<think>hmm</think> Leaves lose chlorophyll.", final="Leaves lose chlorophyll.",
                   reasoning="hmm"),
        Generation(text="Myocardial infarction ...", final="  Myocardial infarction ...\n"),
    ]
    reqs = cls().to_requests(task, gens)
    # the final response as it is, whitespace included, as R2MED's scripts use hy_doc
    assert reqs == [
        SearchRequest("q1", task.queries[0].text, "Leaves lose chlorophyll.", combine),
        SearchRequest("q2", task.queries[1].text, "  Myocardial infarction ...\n", combine),
    ]
    assert cls.combine == combine


def test_requests_follow_the_protocol_table_for_bm25():
    """docs/protocol.md: HyDE -> passage only; Query2Doc -> query twice then passage; LameR -> query + passage."""
    from r2med_agent.retrieval.query import bm25_query_text

    task = make_task("qa")
    q, q2 = task.queries[0].text, task.queries[1].text
    gens = [Generation(text="raw", final="PASSAGE"), Generation(text="", final="")]
    expected = {"hyde": "PASSAGE", "query2doc": f"{q} {q} PASSAGE", "lamer": f"{q} PASSAGE"}
    for cls in (HyDE, Query2Doc, LameR):
        reqs = cls().to_requests(task, gens)
        assert bm25_query_text(reqs[0]) == expected[cls.name]
        # The empty generation searches with the plain query, or with itself when kept.
        assert bm25_query_text(reqs[1]) == task.queries[1].text and reqs[1].empty_generations == 1
        kept = {"hyde": "", "query2doc": f"{q2}{q2} ", "lamer": f"{q2} "}[cls.name]
        assert bm25_query_text(dataclasses.replace(reqs[1], keep_empty=True), compat=True) == kept
    for req in NoneMethod().to_requests(task):
        assert bm25_query_text(req) == req.query


def test_empty_generation_falls_back_to_plain_query(caplog):
    task = make_task("exam")
    gens = [Generation(text="<think>only thinking", final="", finish_reason="length"),
            Generation(text="ok", final="ok")]
    with caplog.at_level(logging.WARNING, logger="r2med_agent.methods.base"):
        reqs = HyDE().to_requests(task, gens)
    assert reqs[0] == SearchRequest("q1", task.queries[0].text, "", "hyde")  # the retrievers fall back
    assert reqs[1] == SearchRequest("q2", task.queries[1].text, "ok", "hyde")
    assert len(caplog.records) == 1 and "q1" in caplog.records[0].getMessage()


def test_to_requests_checks_the_count():
    with pytest.raises(ValueError, match="1 generations for 2 queries"):
        HyDE().to_requests(make_task("qa"), [Generation(text="x", final="x")])


def test_none_method():
    task = make_task("treatment")
    m = NoneMethod()
    assert m.build_prompts(task) == [] and not m.uses_llm and m.combine == "none"
    assert m.to_requests(task) == [SearchRequest(q.query_id, q.text) for q in task.queries]
    with pytest.raises(ValueError):
        m.to_requests(task, [Generation(text="x", final="x")] * 2)


# -- hashes, overrides, registry ---------------------------------------------------------------


def test_method_template_hash(tmp_path):
    task = make_task("qa")
    hashes = {cls.name: cls().template_hash(task) for cls in (HyDE, Query2Doc, LameR)}
    assert len(set(hashes.values())) == 3
    assert hashes["hyde"] == prompts.template_hash("hyde", "qa")
    assert HyDE().template_hash(make_task("case")) != hashes["hyde"]
    (tmp_path / "hyde").mkdir()
    (tmp_path / "hyde" / "qa.j2").write_text("Answer: {{ query }}\nPassage:\n", encoding="utf-8")
    custom = HyDE(prompts_dir=tmp_path)
    assert custom.template_hash(task) != hashes["hyde"]
    assert user_text(custom.build_prompts(task)[0]) == f"Answer: {task.queries[0].text}\nPassage:"


def test_registry():
    assert set(METHODS) >= {"none", "hyde", "query2doc", "lamer"}
    for name in ("none", "hyde", "query2doc", "lamer"):
        cls = get_method(name)
        assert cls.name == name and issubclass(cls, ExpansionMethod)
        assert not cls.agentic
    assert get_method("lamer").needs_first_pass and not get_method("hyde").needs_first_pass
    with pytest.raises(ConfigError, match=r"unknown method 'hide' \(did you mean 'hyde'\?\); allowed: none, hyde, query2doc, lamer"):
        get_method("hide")


# -- end to end with a scripted LLM ------------------------------------------------------------


def test_prompts_of_two_tasks_go_in_one_generate_call():
    tasks = [make_task("qa", name="Bio"), make_task("case", name="Cases")]

    def script(messages, params):
        text = messages[-1]["content"]
        return "A similar case." if text.endswith("Similar Case:") else "A passage about leaves."

    llm = ScriptedLLM(script)
    method = get_method("hyde")()
    prompts_all, spans = [], {}
    for task in tasks:
        convs = method.build_prompts(task)
        spans[task.name] = (len(prompts_all), len(prompts_all) + len(convs))
        prompts_all.extend(convs)
    gens = llm.generate(prompts_all, SamplingParams(temperature=0.0, max_tokens=64))
    assert len(llm.calls) == 1 and len(llm.calls[0]) == 4
    requests = {t.name: method.to_requests(t, gens[slice(*spans[t.name])]) for t in tasks}
    assert [r.expansion for r in requests["Bio"]] == ["A passage about leaves."] * 2
    assert [r.expansion for r in requests["Cases"]] == ["A similar case."] * 2
    assert all(r.combine == "hyde" for rs in requests.values() for r in rs)
    assert [r.query_id for r in requests["Cases"]] == ["q1", "q2"]
