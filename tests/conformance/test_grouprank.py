"""GroupRank (AQ-MedAI/Diver, ``Reranker/rerank_groupwise.py``) against the project's groupwise
reranker, byte for byte: the rendered prompts (the authors' text imported from the pinned copy),
the groups each pass builds (GroupRank's ``random.seed(666)`` shuffles), the reading of good,
malformed and empty answers, the dropping of never-scored documents, and the mean over groups and
passes that orders the run.

The authors' ``GroupReranker`` runs for real: its ``__init__`` and ``rerank_by_group`` with vLLM's
``LLM`` replaced by a stand-in that answers from the same script as the project's scripted LLM
(torch and datasets stubbed: the script never uses them here). Its ``random`` is a generator
seeded as its module seeds the global one, as in a fresh process per task.
"""

from __future__ import annotations

import random
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest

from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.prompts.importer import import_clone, write_prompts
from r2med_agent.rerank.groupwise import GroupwiseReranker
from r2med_agent.rerank.llm import RerankJob
from r2med_agent.rerank.spec import get_reranker_spec
from tests.conformance.conftest import load_reference_module, reference_repo, stub
from tests.conformance.rerank_inputs import (
    as_run,
    fake_vllm,
    first_stage,
    pick,
    render,
    requests,
    sample_task,
    smol_tokenizer,
)
from tests.fakes import ScriptedLLM

REPO = "AQ-MedAI/Diver"
SCRIPT = "Reranker/rerank_groupwise.py"
DOC_LINE = r"^\[(\d+)\]\. (.*)$"

# Answers of every kind the reading must agree on: good ones (fenced, bare, after <think>), the
# fixes GroupRank makes (a doubled bracket, an unclosed block), and what fails (a key past the
# group, a string score, no JSON, an empty answer), plus "[0]" (GroupRank's indexing takes the
# group's last document), repeated keys, missing documents, scores off the 0-10 scale.
ANSWERS = [
    lambda n: "<reason>ok</reason>\n<answer>\n```json\n{" + ", ".join(f'"[{i}]": {(i * 7) % 11}' for i in range(1, n + 1)) + "}\n```\n</answer>",
    lambda n: "<answer>{" + ", ".join(f'"[{i}]": {i}' for i in range(n, 0, -1)) + "}</answer>",
    lambda n: "<think>maybe <answer>{\"[1]\": 0}</answer> no</think><answer>```json\n{\"[1]]\": 9, \"[2]\": 4}\n```</answer>",
    lambda n: "<answer>```json\n{\"[2]\": 3, \"[1]\": 8",
    lambda n: '<answer>{"[1]": 5, "[99]": 7}</answer>',
    lambda n: '```json\n{"[0]": 6, "[1]": 2}\n```',
    lambda n: '<answer>{"[1]": "5", "[2]": 4}</answer>',
    lambda n: "I think the second document is the most useful.",
    lambda n: "",
    lambda n: '{"[1]": 2, "1": 10, "[1]": 4}',
    lambda n: '<answer>{"[1]": 12.5, "[2]": -3}</answer>',
    lambda n: '<answer>{"[ 2 ]": 1}</answer> trailing {"[1]": 10}',
]


def _answer(user_text: str) -> str:
    """The scripted answer to a group: chosen by the documents it shows (so both sides, given the
    same group, get the same answer)."""
    docs = re.findall(DOC_LINE, user_text, flags=re.M)
    return ANSWERS[pick("\n".join(t for _, t in docs), len(ANSWERS))](len(docs))


@pytest.fixture(scope="module")
def diver():
    return reference_repo(REPO)


def _authors(diver, tokenizer, answer):
    """The authors' module with the stand-in LLM, and a generator for its ``random``."""
    fake = fake_vllm(tokenizer, answer)
    state = random.getstate()
    try:
        mod = load_reference_module(diver, SCRIPT, stubs={
            "vllm": stub("vllm", LLM=fake, SamplingParams=lambda **k: SimpleNamespace(**k)),
            "torch": stub("torch", cuda=SimpleNamespace(device_count=lambda: 1)),
            "datasets": stub("datasets"),
        })
    finally:
        random.setstate(state)  # the module seeds the global generator when it loads
    mod.random = random.Random(666)  # its random.seed(666), in a fresh process
    return mod, fake


@pytest.fixture(scope="module")
def imported(diver, tmp_path_factory):
    """The authors' prompts, imported from the pinned copy (``prompts import``)."""
    out = tmp_path_factory.mktemp("grouprank-prompts")
    write_prompts(import_clone(diver), out)
    return out


def _project(task, lists, imported, **settings):
    """The shipped ``grouprank-32b`` entry (its LLM scripted; group size and passes as given)."""
    spec = replace(get_reranker_spec("grouprank-32b"), llm="x", **settings)
    fake = ScriptedLLM(lambda messages, params: _answer(messages[-1]["content"]))
    reranker = GroupwiseReranker(spec, llm=CachedLLM(fake, "scripted"), prompts_dir=imported)
    job = RerankJob(task, requests(task), as_run(lists), {d.doc_id: d.full_text for d in task.corpus})
    out = reranker.rerank_tasks([job], max(len(v) for v in lists.values()))[0]
    return out, [m for call in fake.calls for m in call]


@pytest.mark.parametrize("group_size,passes,depth", [(3, 3, 12), (20, 2, 12), (4, 6, 15)])
def test_grouprank_prompts_groups_reading_and_means_match_the_authors(diver, imported, group_size, passes, depth) -> None:
    tok = smol_tokenizer()
    task = sample_task()
    lists = first_stage(task, depth)
    mod, fake = _authors(diver, tok, lambda prompt: _answer(prompt))
    ranker = mod.GroupReranker("AQ-MedAI/Diver-GroupRank-32B")
    qid_queries = [{"qid": q.query_id, "query": q.text} for q in task.queries]
    texts = {d.doc_id: d.full_text for d in task.corpus}
    ctxs = {q: [{"id": d, "text": texts[d]} for d in docs] for q, docs in lists.items()}
    theirs = ranker.rerank_by_group(qid_queries, ctxs, topk=depth, group_size=group_size, interval=group_size,
                                    num_epoch=passes, max_doc_lens=3000)

    out, sent = _project(task, lists, imported, group_size=group_size, passes=passes)
    # The prompts, in the same order (pass after pass, query after query, group after group),
    # rendered by the same chat template.
    assert [render(tok, m) for m in sent] == fake.prompts
    # Each query's run: the same documents (never-scored ones dropped), scores and order.
    for q in task.queries:
        assert list(out.run[q.query_id].items()) == list(theirs[q.query_id].items()), q.query_id
    # The cases the answers hold all occurred.
    stats = out.stats
    assert stats["repairs"]["unparseable"] > 0 and stats["groups"] == len(fake.prompts)


def test_grouprank_reads_each_answer_as_the_authors(diver) -> None:
    """Reading alone, over the answers above and more: GroupRank's ``_extract_rerank_output`` and its
    mapping of keys to documents (which raises where the group scores 0)."""
    from r2med_agent.rerank.groupwise import grouprank_pairs

    mod, _ = _authors(diver, None, lambda p: "")
    ranker = mod.GroupReranker.__new__(mod.GroupReranker)
    group = ["a", "b", "c", "d"]
    answers = [f(4) for f in ANSWERS] + [
        '{"[1]": true}', '{"[1]": null}', '[["[2]", 5]]', '{"[1]": {"x": 1}}', "{}", "{ }",
        '<answer>\n```json\n{"[4]": 10, "[3]": 0}\n``` \n</answer>', '{"[-1]": 3}', '{"[3.0]": 3}',
        '{"\uff13": 7}', "```json\n\n```", "{" * 3000 + "}" * 3000, '{"[1]": 1e400}',
    ]
    for text in answers:
        try:
            expected = [(group[int(k.strip().strip("[]")) - 1], s / 10)
                        for k, s in ranker._extract_rerank_output(text).items()]
        except Exception:  # noqa: BLE001 - GroupRank zeroes the group on any failure here
            expected = None
        assert grouprank_pairs(text, group) == expected, text[:80]


def test_grouprank_empty_and_single_document_lists(diver, imported) -> None:
    """A query whose list holds one document, and one whose only document is empty."""
    tok = smol_tokenizer()
    task = sample_task(n_queries=2)
    lists = {task.queries[0].query_id: ["0"], task.queries[1].query_id: [task.corpus[0].doc_id],
             task.queries[2].query_id: ["long", "-1"]}
    task = type(task)(task.name, task.family, task.domain, task.queries[:3], task.corpus, task.qrels, task.source,
                      task.fingerprint)
    mod, fake = _authors(diver, tok, lambda prompt: _answer(prompt))
    texts = {d.doc_id: d.full_text for d in task.corpus}
    theirs = mod.GroupReranker("m").rerank_by_group(
        [{"qid": q.query_id, "query": q.text} for q in task.queries],
        {q: [{"id": d, "text": texts[d]} for d in docs] for q, docs in lists.items()},
        topk=2, group_size=20, interval=20, num_epoch=2, max_doc_lens=3000)
    out, sent = _project(task, lists, imported, group_size=20, passes=2)
    assert [render(tok, m) for m in sent] == fake.prompts
    for q in task.queries:
        assert list(out.run[q.query_id].items()) == list(theirs[q.query_id].items())


def test_grouprank_shuffles_run_through_the_score_files_query_order(diver, imported, tmp_path) -> None:
    """A first stage whose queries come in another order than the task's (a run file listing
    them backwards): the authors' ``__main__`` builds its queries from the score file's keys
    (``qid_list = list(all_scores.keys())``) and its one generator shuffles them in that order;
    the project's reranker, given the run file through ``--candidates``' reader, builds the same
    groups, so every prompt and every score is the same."""
    from r2med_agent.retrieval.run_files import CandidateRunRetriever
    from tests.conformance.reference_blocks import reference_block

    tok = smol_tokenizer()
    task = sample_task()
    depth, group_size, passes = 12, 4, 3
    lists = first_stage(task, depth)
    backwards = dict(reversed(list(as_run(lists).items())))
    assert list(backwards) != [q.query_id for q in task.queries]
    lines = [f"{q} Q0 {d} {r} {s} first" for q, docs in backwards.items() for r, (d, s) in enumerate(docs.items(), 1)]
    path = tmp_path / "first.run"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    run = CandidateRunRetriever.for_task(task, path).search(requests(task), depth)
    assert list(run) == list(backwards)

    mod, fake = _authors(diver, tok, lambda prompt: _answer(prompt))
    texts = {d.doc_id: d.full_text for d in task.corpus}
    main_block = reference_block(
        diver / SCRIPT, "qid_list = list(all_scores.keys())", "new_scores = model.rerank_by_group(",
        ("all_scores", "examples", "documents", "args", "model"), "new_scores", {}, prefix=True)
    args = SimpleNamespace(input_k=depth, k=depth, group_size=group_size, interval=group_size, repeat_num=passes,
                           max_doc_len=3000)
    theirs = main_block(backwards, {q.query_id: {"query": q.text} for q in task.queries}, texts, args,
                        mod.GroupReranker("AQ-MedAI/Diver-GroupRank-32B"))

    spec = replace(get_reranker_spec("grouprank-32b"), llm="x", group_size=group_size, passes=passes)
    script = ScriptedLLM(lambda messages, params: _answer(messages[-1]["content"]))
    reranker = GroupwiseReranker(spec, llm=CachedLLM(script, "scripted"), prompts_dir=imported)
    job = RerankJob(task, requests(task), run, texts, ordered=True)
    out = reranker.rerank_tasks([job], depth)[0]
    assert [render(tok, m) for call in script.calls for m in call] == fake.prompts
    for q in task.queries:
        assert list(out.run[q.query_id].items()) == list(theirs[q.query_id].items()), q.query_id
