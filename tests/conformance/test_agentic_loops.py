"""Search-R1's and Search-o1's prompts and the reading of their outputs, against the authors' own
code (PeterGriffinJin/Search-R1, sunnynexus/Search-o1; pinned copies).

The authors' functions run here: module files are imported (heavy imports stubbed), and functions
defined inside others or methods of classes whose modules cannot be imported are compiled from the
file's own syntax tree and called with a stand-in ``self`` (the tokenizer's decode as the identity).
The project's side renders templates imported from the copies (as a fetch imports them) through
the loops' own methods, and reads outputs through the loops' own parser.

Step outputs are given as a backend with the loops' stop strings returns them: ended by the first
closing tag (included), by the end of generation, or cut by ``max_tokens``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from r2med_agent.data import load_task
from r2med_agent.methods.agentic import (
    O1_CONTEXT_CHARS,
    SearchO1,
    SearchR1,
    extract_final_information,
    previous_steps,
)
from r2med_agent.methods.loop import Trajectory, parse_output
from r2med_agent.prompts.importer import read_search_o1, read_search_r1, write_prompts
from r2med_agent.types import Query, Task
from tests.conformance.conftest import load_reference_module, reference_repo, stub
from tests.conformance.reference_blocks import reference_block, reference_functions

HOSTILE_QUESTIONS = (
    "Ünïcödé: 患者の発熱 — fièvre 🙂\u200b?",
    "Braces {question} {0} {{x}} {% raw %} and a trailing space ",
    "Line one\r\nline two\n\n\tindented",
    " ".join(f"w{i}" for i in range(20_000)),
    "ends with a question mark?",
    "?",
)


def _questions() -> tuple[str, ...]:
    return tuple(q.text for q in load_task("sample").queries) + HOSTILE_QUESTIONS


def _task(queries: tuple[Query, ...] = ()) -> Task:
    return Task(name="Biology", family="qa", domain="biology", queries=queries, corpus=(), qrels={}, source="inline",
                fingerprint="conformance")


# ----------------------------------------------------------------------------------------------
# Search-R1


@pytest.fixture(scope="module")
def search_r1() -> Path:
    return reference_repo("PeterGriffinJin/Search-R1")


@pytest.fixture(scope="module")
def r1_prompts(search_r1, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("search-r1-prompts")
    write_prompts(read_search_r1(search_r1), out)
    return out


def test_search_r1_prompt_is_the_training_prompt(search_r1, r1_prompts) -> None:
    """nq_search.py builds each training example's prompt: the question stripped, a "?" added when
    it lacks one, then make_prefix; the checkpoints were trained on exactly that text."""
    ns = reference_functions(search_r1 / "scripts/data_process/nq_search.py", {"make_prefix", "make_map_fn"},
                             {"args": SimpleNamespace(template_type="base"), "data_source": "nq"})
    process_fn = ns["make_map_fn"]("test")
    loop = SearchR1().with_prompts(r1_prompts)
    for question in _questions():
        expected = process_fn({"question": question, "golden_answers": ["x"]}, 0)["prompt"]
        got = loop.initial_messages(_task(), Query("q", question))
        assert got == expected, question[:60]


def test_search_r1_empty_question(search_r1, r1_prompts) -> None:
    """Kept: an empty (or blank) question fails in the authors' preprocessing (``question[-1]``
    of an empty string); the project renders the prompt with an empty question."""
    ns = reference_functions(search_r1 / "scripts/data_process/nq_search.py", {"make_prefix", "make_map_fn"},
                             {"args": SimpleNamespace(template_type="base"), "data_source": "nq"})
    for question in ("", "   "):
        with pytest.raises(IndexError):
            ns["make_map_fn"]("test")({"question": question, "golden_answers": []}, 0)
        content = SearchR1().with_prompts(r1_prompts).initial_messages(_task(), Query("q", question))[0]["content"]
        assert content == ns["make_prefix"]({"question": ""}, "base")


def _r1_loop_functions(search_r1: Path) -> dict[str, Any]:
    return reference_functions(search_r1 / "search_r1/llm_agent/generation.py",
                               {"_postprocess_responses", "postprocess_predictions", "execute_predictions"},
                               {"torch": stub("torch")})


def test_search_r1_corrective_message(search_r1, r1_prompts) -> None:
    ns = _r1_loop_functions(search_r1)
    manager = SimpleNamespace()
    manager.postprocess_predictions = lambda predictions: ns["postprocess_predictions"](manager, predictions)
    next_obs, dones, valid, searched = ns["execute_predictions"](manager, ["no action here"], "<pad>", [True], False)
    traj = Trajectory(job=None, messages=[])  # type: ignore[arg-type]
    assert (dones, valid, searched) == ([0], [0], [0])
    assert SearchR1().with_prompts(r1_prompts).invalid_turn(traj) == next_obs[0]


R1_STEPS = (
    # (the step's text as the backend returns it, its finish reason)
    ("<think>I should look it up.</think>\n<search> iron deficiency anemia </search>", "stop"),
    ("<search>croup</search>", "stop"),
    ("<think>done</think>\n<answer> Paris </answer>", "stop"),
    ("<answer>a\nmulti-line answer</answer>", "stop"),
    ("<search>first<search>second</search>", "stop"),
    ("<answer>x <answer> y</answer>", "stop"),
    ("<search>a<answer>b</search>", "stop"),
    ("<answer>a <search> b</answer>", "stop"),
    ("<search> </search>", "stop"),
    ("<search></search>", "stop"),
    ("<answer></answer>", "stop"),
    ("I must write the query between <search> and </search>", "stop"),
    ("<think>no tags at all, the model stopped", "stop"),
    ("</search>", "stop"),
    ("", "stop"),
    ("<think>cut by max_tokens <search>partial query", "length"),
    ("Ünïcödé <search> 患者 🙂 </search>", "stop"),
)


@pytest.mark.parametrize(("text", "finish"), R1_STEPS)
def test_search_r1_reads_each_step_as_its_loop_does(text, finish, search_r1) -> None:
    """The action (search, answer or none), its content, and the step text kept in the
    trajectory: _postprocess_responses then postprocess_predictions of generation.py."""
    ns = _r1_loop_functions(search_r1)
    manager = SimpleNamespace(tokenizer=SimpleNamespace(batch_decode=lambda r, skip_special_tokens=True: r),
                              config=SimpleNamespace(no_think_rl=False), _batch_tokenize=lambda texts: texts)
    _, (kept,) = ns["_postprocess_responses"](manager, [text])
    (action,), (content,) = ns["postprocess_predictions"](manager, [kept])
    act = parse_output(text, SearchR1.tags(), stop_reason=None, finish_reason=finish,
                       empty_ok=SearchR1.empty_actions)
    assert (act.kind, act.content, act.body) == (action or "none", content, kept)


# ----------------------------------------------------------------------------------------------
# Search-o1


@pytest.fixture(scope="module")
def search_o1() -> Path:
    return reference_repo("sunnynexus/Search-o1")


@pytest.fixture(scope="module")
def o1_prompts(search_o1, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("search-o1-prompts")
    write_prompts(read_search_o1(search_o1), out)
    return out


O1_SCRIPT = "scripts/run_search_o1.py"
MULTI_HOP = ("hotpotqa", "musique", "bamboogle", "2wiki")
"""The datasets ``run_search_o1.py`` runs in its multi-hop QA setting, the one the loop follows."""


def o1_settings(search_o1: Path, dataset: str, model_path: str) -> dict[str, Any]:
    """What ``run_search_o1.py`` sets for ``dataset``, from its own code: its argument defaults
    (``parse_args``), its per-dataset adjustment in ``main``, and the instruction and user prompt
    its prompt preparation picks (for the question ``{question}``, a placeholder)."""
    import argparse
    import sys

    script = search_o1 / O1_SCRIPT
    parse_args = reference_functions(script, {"parse_args"}, {"argparse": argparse})["parse_args"]
    argv = sys.argv
    sys.argv = ["run_search_o1.py", "--dataset_name", dataset, "--split", "test", "--model_path", model_path,
                "--bing_subscription_key", "k"]
    try:
        args = parse_args()
    finally:
        sys.argv = argv
    adjust = reference_block(
        script, "if dataset_name in ['nq', 'triviaqa', 'hotpotqa', 'musique', 'bamboogle', '2wiki', 'medmcqa'",
        "if dataset_name in ['nq', 'triviaqa', 'hotpotqa', 'musique', 'bamboogle', '2wiki', 'medmcqa'",
        ("dataset_name", "MAX_SEARCH_LIMIT", "MAX_TURN", "top_k", "max_doc_len"),
        ("MAX_SEARCH_LIMIT", "MAX_TURN", "top_k", "max_doc_len"), {}, prefix=True)
    limit, turns, top_k, doc_len = adjust(dataset, args.max_search_limit, args.max_turn, args.top_k, args.max_doc_len)
    prompts = load_reference_module(search_o1, "scripts/prompts.py")
    scope = {name: getattr(prompts, name) for name in dir(prompts) if name.startswith("get_")}
    prepare = reference_block(
        script, "if dataset_name in ['nq', 'triviaqa', 'hotpotqa', 'musique', 'bamboogle', '2wiki']:",
        "if dataset_name in ['nq', 'triviaqa', 'hotpotqa', 'musique', 'bamboogle', '2wiki']:",
        ("dataset_name", "MAX_SEARCH_LIMIT", "model_path", "question"), ("instruction", "user_prompt"), scope,
        prefix=True)
    return {"max_searches": limit, "max_turns": turns, "top_k": top_k, "max_doc_len": doc_len,
            "prompt": lambda question: "".join(prepare(dataset, limit, model_path, question))}


@pytest.mark.parametrize("dataset", MULTI_HOP)
@pytest.mark.parametrize("qwq", [False, True])
def test_search_o1_runs_the_multi_hop_setting_of_run_search_o1(qwq, dataset, search_o1, o1_prompts) -> None:
    """The pair of instruction and search limit the loop runs is one ``run_search_o1.py`` runs:
    its multi-hop QA setting, every value read from the script (the searches, the turns, the
    documents per search, the document length, the instruction and the user prompt, QwQ's variant
    for a model whose path names qwq)."""
    theirs = o1_settings(search_o1, dataset, "Qwen/QwQ-32B" if qwq else "Qwen/Qwen3-32B")
    loop = SearchO1(qwq=qwq).with_prompts(o1_prompts)
    assert (loop.max_searches, loop.max_turns, loop.docs_per_search) == (
        theirs["max_searches"], theirs["max_turns"], theirs["top_k"])
    assert O1_CONTEXT_CHARS == 2 * theirs["max_doc_len"]
    for question in _questions() + ("", "   "):
        expected = theirs["prompt"](question)
        assert loop.initial_messages(_task(), Query("q", question)) == [{"role": "user", "content": expected}]


def test_search_o1_single_qa_instruction_goes_with_five_searches(search_o1) -> None:
    """Why not the single-QA instruction: the script gives it only with 5 searches (nq, triviaqa),
    never with the loop's 10."""
    ref = load_reference_module(search_o1, "scripts/prompts.py")
    for dataset in ("nq", "triviaqa"):
        theirs = o1_settings(search_o1, dataset, "Qwen/Qwen3-32B")
        assert theirs["max_searches"] == 5 != SearchO1().max_searches
        assert theirs["prompt"]("q").startswith(ref.get_singleqa_search_o1_instruction(5))


REASONINGS = (
    "",
    "One step.",
    "Step one.\n\nStep two.\n<|begin_search_query|>iron<|end_search_query|>",
    "a\nb\n\nc\n\n\nd\ne\nf\ng\nh\n<|begin_search_query|>q1<|end_search_query|>\n\n<|begin_search_result|>found"
    "<|end_search_result|>\n\nmore\nand more\n\n<|begin_search_query|>q2<|end_search_query|>",
    "\n".join(f"line {i} Ünïcödé 🙂" for i in range(40)) + "\n<|begin_search_query|>last<|end_search_query|>",
    "trailing newlines\n\n\n\n",
)


def test_search_o1_previous_steps_as_run_search_o1_shortens_them(search_o1) -> None:
    """The previous reasoning steps Reason-in-Documents reads: run_search_o1.py's own inline
    code, from all_reasoning_steps = seq['output'] to the strip of truncated_prev_reasoning."""
    ref = reference_block(
        search_o1 / "scripts/run_search_o1.py", "all_reasoning_steps = seq['output']",
        "truncated_prev_reasoning = truncated_prev_reasoning.strip('\\n')", ("seq",), "truncated_prev_reasoning",
        {"BEGIN_SEARCH_QUERY": "<|begin_search_query|>", "BEGIN_SEARCH_RESULT": "<|begin_search_result|>"})
    for text in REASONINGS:
        assert previous_steps(text, "<|begin_search_query|>", "<|begin_search_result|>") == ref({"output": text})


def test_search_o1_reason_in_documents_prompt(search_o1, o1_prompts) -> None:
    ref = load_reference_module(search_o1, "scripts/prompts.py")
    from r2med_agent.prompts import templates as prompts

    for prev, query, docs in (("Step 1: a", "iron", "**Web Page 1:**\n{}\n"), ("", "", ""),
                              ("Ünïcödé {x} {{y}}", "q {0}", " ".join(["doc"] * 20_000))):
        got = prompts.render("search-o1/reason_in_documents.j2", prompts_dir=o1_prompts, previous_steps=prev,
                             search_query=query, documents=docs)
        assert got == ref.get_webpage_to_reasonchain_instruction(prev, query, docs)


CONDENSED = (
    "Reasoning first.\n**Final Information**\n\nIron deficiency\nanemia.\n",
    "**Final Information** at the very start, with no newline before it",
    "a\n**Final Information**\nfirst\n**Final Information**\n```\nsecond\n```",
    "thinking\n**Modified Reasoning Steps**\nStep 1: x\n\nStep 2: y\n",
    "x\n**Modified Reasoning Steps**\n```steps```\n**Final Information**\nwins",
    "No markers at all.",
    "",
    "\n",
    "<think>\n**Final Information** inside the thinking\n</think>\nplain",
    "Ünïcödé\n**Final Information**  患者 🙂  ",
)


def test_search_o1_final_information_as_evaluate_extracts_it(search_o1) -> None:
    evaluate = load_reference_module(search_o1, "scripts/evaluate.py", stubs={
        "lcb_runner": stub("lcb_runner"), "lcb_runner.evaluation": stub("lcb_runner.evaluation"),
        "utils": stub("utils"), "utils.math_equivalence": stub("utils.math_equivalence")})
    for raw in CONDENSED:
        assert extract_final_information(raw) == evaluate.extract_answer(raw, mode="infogen"), raw


O1_STEPS = (
    "I need to check.\n<|begin_search_query|>iron deficiency<|end_search_query|>",
    "<|begin_search_query|>first<|begin_search_query|>second<|end_search_query|>",
    "<|begin_search_query|>  <|end_search_query|>",
    "<|begin_search_query|>multi\nline query<|end_search_query|>",
    "The answer is \\boxed{anemia}.",
    "",
    "Ünïcödé <|begin_search_query|> 患者 🙂 <|end_search_query|>",
)


@pytest.mark.parametrize("text", O1_STEPS)
def test_search_o1_reads_each_step_as_its_loop_does(text, search_o1) -> None:
    """run_search_o1.py: extract_between(text, BEGIN, END), searched when it is not empty and the
    output ends with the end tag (vLLM with include_stop_str_in_output). The project's backends
    return the text without the stop string and report it; both forms read the same."""
    ns = reference_functions(search_o1 / "scripts/run_search_o1.py", {"extract_between"})
    end = "<|end_search_query|>"
    query = ns["extract_between"](text, "<|begin_search_query|>", end)
    searched = bool(query) and text.rstrip().endswith(end)
    with_stop = parse_output(text, SearchO1.tags(), stop_reason=None, finish_reason="stop")
    reported = parse_output(text.removesuffix(end), SearchO1.tags(), stop_reason=end if text.endswith(end) else None,
                            finish_reason="stop")
    for act in (with_stop, reported):
        assert (act.kind == "search", act.content if act.kind == "search" else None) == (
            searched, query if searched else None)
