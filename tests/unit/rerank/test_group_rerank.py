"""Groupwise (GroupRank) and setwise (Rank-R1) rerankers: their trained formats (Rank-R1's prompt
byte for byte),
answer parsing and repairs, test-time scaling, the heap sort, batching (units with a scripted
LLM), and the whole path through ``run`` with the real local model."""

from __future__ import annotations

import random
import re
from dataclasses import replace

import pytest

from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.rerank.groupwise import (
    GroupwiseReranker,
    make_groups,
    parse_group_scores,
    pass_rng,
)
from r2med_agent.rerank.llm import RerankJob
from r2med_agent.rerank.setwise import SetwiseReranker, heapsort_selection, parse_choice
from r2med_agent.rerank.spec import RerankerSpec
from r2med_agent.types import Doc, Query, SearchRequest, Task
from tests.fakes import ScriptedLLM

# Rank-R1's prompts, ielab/llm-rankers Rank-R1/prompts/prompt_setwise-R1.toml (prompt_system, prompt_user).
RANK_R1_SYSTEM = (
    'A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The assistant first thinks about the reasoning process in the mind and then provides the user with the answer. The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>.'
)
RANK_R1_USER = (
    'Given the query: "{query}", which of the following documents is most relevant?\n'
    '{docs}\n'
    'After completing the reasoning process, please provide only the label of the most relevant document to the query, enclosed in square brackets, within the answer tags. For example, if the third document is the most relevant, the answer should be: <think> reasoning process here </think> <answer>[3]</answer>.'
)


def _task(name: str, n_docs: int, family: str = "qa") -> Task:
    docs = tuple(Doc(f"{name}-d{i}", f"text {i}\n\nline two of {i}") for i in range(n_docs))
    queries = (Query(f"{name}-q0", "first query"), Query(f"{name}-q1", "second query"))
    return Task(name, family, "biology", queries, docs, {}, "test", name)  # type: ignore[arg-type]


def _job(task: Task) -> RerankJob:
    ids = [d.doc_id for d in task.corpus]
    run = {q.query_id: {d: float(len(ids) - i) for i, d in enumerate(ids)} for q in task.queries}
    return RerankJob(task, [SearchRequest(q.query_id, q.text) for q in task.queries], run,
                     {d.doc_id: d.text for d in task.corpus})


def _ranked(run: dict[str, float]) -> list[str]:
    return sorted(run, key=lambda d: -run[d])


def _numbers(user: str, pattern: str) -> list[int]:
    """The document numbers (``text N``) of a prompt, in the order shown."""
    return [int(n) for n in re.findall(pattern, user, flags=re.M)]


# --------------------------------------------------------------------------- prompts, byte for byte


def test_groupwise_prompt_keeps_grouprank_format() -> None:
    """The shipped prompt is the project's wording around GroupRank's trained format, which must be
    exact: documents as prepare_groups_one_epoch lays them out (newlines to one space, cut to
    max_doc_chars, "[i]. text" and a blank line each), the <reason> and <answer> parts and the JSON
    example. The authors' own text, imported from a clone, is rendered byte for byte in
    tests/unit/prompts/test_import.py::test_grouprank_system_and_user_prompts."""
    spec = RerankerSpec(name="g", kind="groupwise", llm="x", max_doc_chars=12)
    texts = ["alpha\n\n\nbeta gamma delta", "short", "tabs\tand  spaces stay\nhere"]
    reranker = GroupwiseReranker(spec, llm=object())
    messages = reranker.messages(_task("A", 1), "Why? \"quoted\"", [reranker._doc_text(_Fake(t), "d") for t in texts])
    assert [m["role"] for m in messages] == ["system", "user"]
    user = messages[1]["content"]
    doc_texts = [re.sub("\n+", " ", t)[:12] for t in texts]
    docs_str = "".join("[{}]. {}\n\n".format(i + 1, t) for i, t in enumerate(doc_texts))
    assert "Query:\nWhy? \"quoted\"\n\nDocuments:\n" + docs_str in user
    assert user.index("<reason>") < user.index("</reason>") < user.index("<answer>") < user.index("</answer>")
    assert '```json\n{"[1]": 5, "[2]": 3, "[3]": 8}\n```' in user and "3 documents" in user
    assert "0 to 10" in messages[0]["content"]
    # Every family reads the same prompt.
    other = GroupwiseReranker(spec, llm=object()).messages(_task("A", 1, family="case"), "Why? \"quoted\"", doc_texts)
    assert other == messages


class _Fake:
    """A query record holding one document ``d``."""

    def __init__(self, text: str) -> None:
        self.corpus = {"d": text}


def test_setwise_prompt_is_rank_r1_format_byte_for_byte() -> None:
    spec = RerankerSpec(name="s", kind="setwise", llm="x")
    texts = ["first passage", "second one", "third"]
    messages = SetwiseReranker(spec, llm=object()).messages(_task("A", 1, family="exam"), "a query", texts)
    # As R1SetwiseLlmRanker.compare (Rank-R1/run_setwise.py) builds it: the toml's doc_prefix "[i]: "
    # and doc_separator "\n" into prompt_user (tests/conformance checks it against the file itself).
    docs = "\n".join([f"[{i + 1}]: {t}" for i, t in enumerate(texts)])
    assert messages == [{"role": "system", "content": RANK_R1_SYSTEM},
                        {"role": "user", "content": RANK_R1_USER.format(query="a query", docs=docs)}]


# --------------------------------------------------------------------------- groupwise, pure parts


def test_parse_group_scores_reads_grouprank_answers() -> None:
    answer = ("<reason>\n- **[1]**: weak.\n- **[3]**: exact.\n</reason>\n\n<answer>\n```json\n"
              "{\n  \"[1]\": 1,\n  \"[2]\": 7,\n  \"[3]\": 10\n}\n```\n</answer>")
    scores, repair = parse_group_scores(answer, 3)
    assert scores == [0.1, 0.7, 1.0] and not repair.any
    # GroupRank's own fix-up ("[7]]" keys) and a plain {...} without a fence.
    assert parse_group_scores('<answer>{"[1]]": 4, "[2]": 6}</answer>', 2)[0] == [0.4, 0.6]
    # An answer cut by max_tokens: the unclosed block is read to its end.
    scores, repair = parse_group_scores('<reason>ok</reason><answer>```json\n{"[2]": 3, "[1]": 9', 3)
    assert scores == [0.9, 0.3, None] and repair.to_dict()["missing"] == 1


def test_parse_group_scores_counts_each_repair() -> None:
    scores, repair = parse_group_scores('```json\n{"[1]": 12, "[2]": -1, "[2]": 5, "[9]": 3}\n```', 4)
    assert scores == [1.0, 0.5, None, None]
    assert repair.to_dict() == {"unparseable": 0, "missing": 2, "repeated": 1, "out_of_range": 1, "clamped": 2}
    scores, repair = parse_group_scores("I think document two is best.", 3)
    assert scores == [0.0, 0.0, 0.0]  # GroupRank scores a failed group 0
    assert repair.to_dict() == {"unparseable": 1, "missing": 0, "repeated": 0, "out_of_range": 0, "clamped": 0}


def test_groups_are_seeded_shuffles() -> None:
    ids = [f"d{i}" for i in range(7)]
    groups = make_groups(ids, 3, pass_rng(666, "T", "q"))
    assert [len(g) for g in groups] == [3, 3, 1] and sorted(sum(groups, [])) == sorted(ids)
    assert groups == make_groups(ids, 3, pass_rng(666, "T", "q"))  # the same seed, the same groups
    assert groups != make_groups(ids, 3, pass_rng(667, "T", "q"))


# --------------------------------------------------------------------------- groupwise reranker


def _score_by_number(messages, params) -> str:  # noqa: ANN001
    """Scores each document of a group by its number (``text N``), 10 for the first shown."""
    nums = _numbers(messages[-1]["content"], r"^\[\d+\]\. text (\d+)")
    scores = {f"[{i}]": (10 if i == 1 else n) for i, n in enumerate(nums, 1)}
    return "<reason>by number</reason>\n<answer>\n```json\n" + str(scores).replace("'", '"') + "\n```\n</answer>"


def test_groupwise_one_generate_call_per_pass_for_all_tasks_averaging_passes(tmp_path) -> None:
    fake = ScriptedLLM(_score_by_number)
    spec = RerankerSpec(name="gw", kind="groupwise", llm="x", group_size=4, passes=2, seed=5, shuffle="per-query")
    a, b = _task("A", 9), _task("B", 9, family="case")
    llm = CachedLLM(fake, "scripted", cache=GenerationCache(tmp_path / "g.sqlite"))
    outs = GroupwiseReranker(spec, llm=llm).rerank_tasks([_job(a), _job(b)], 6)
    # 2 tasks x 2 queries x 2 groups (4 + 2 of the top 6): one generate call per pass.
    assert [len(c) for c in fake.calls] == [8, 8]
    # Each document's score is its mean over the two passes; the expected groups are rebuilt
    # from the recorded seeds (5 and 6).
    top = [f"A-d{i}" for i in range(6)]
    got: dict[str, list[float]] = {d: [] for d in top}
    for p in (0, 1):
        for group in make_groups(top, 4, pass_rng(5 + p, "A", "A-q0")):
            for pos, d in enumerate(group):
                got[d].append(1.0 if pos == 0 else int(d.split("d")[1]) / 10)
    run = outs[0].run["A-q0"]
    for d in top:
        assert run[d] == pytest.approx(sum(got[d]) / 2)
    assert _ranked(run)[6:] == ["A-d6", "A-d7", "A-d8"]  # the tail keeps its order below
    trace = outs[0].traces[0]
    assert [(r["pass"], r["seed"]) for r in trace.extra["groups"]] == [(0, 5), (0, 5), (1, 6), (1, 6)]
    assert outs[0].stats["groups"] == 8 and outs[0].stats["passes"] == 2 and outs[0].stats["seed"] == 5
    assert outs[0].stats["answers_repaired"] == 0
    # The model sees numbers, never document ids, and newlines made spaces (max_doc_chars 0: words).
    first = fake.calls[0][0][-1]["content"]
    assert "A-d" not in first and re.search(r"^\[1\]\. text \d line two of \d$", first, flags=re.M)
    # A second run is served by the cache: no call reaches the model.
    again = GroupwiseReranker(spec, llm=CachedLLM(fake, "scripted", cache=GenerationCache(tmp_path / "g.sqlite")))
    assert again.rerank_tasks([_job(a), _job(b)], 6)[0].run == outs[0].run and len(fake.calls) == 2


def test_lenient_groupwise_repairs_are_counted_and_ties_keep_the_first_stage_order() -> None:
    fake = ScriptedLLM(lambda m, p: "Document two seems best." if "text 0" in m[-1]["content"] else '{"[1]": 5}')
    spec = RerankerSpec(name="gw", kind="groupwise", llm="x", group_size=2, parse="lenient", unscored="zero",
                        shuffle="per-query")
    out = GroupwiseReranker(spec, llm=CachedLLM(fake, "scripted")).rerank_tasks([_job(_task("A", 4))], 4)[0]
    repairs = out.stats["repairs"]
    # The group holding d0 is unparseable (both score 0); the other names only its first document.
    assert repairs["unparseable"] == 2 and repairs["missing"] == 2 and out.stats["answers_repaired"] == 4
    groups = out.traces[0].extra["groups"]
    lone = next(g for g in groups if "A-d0" not in g["doc_ids"])
    scored, unscored = lone["doc_ids"]
    run = out.run["A-q0"]
    assert run[scored] == 0.5 and run[unscored] == 0.0 == run["A-d0"]
    zeros = [d for d in _ranked(run) if run[d] == 0.0]
    assert zeros == sorted(zeros, key=lambda d: int(d.split("d")[1]))  # first-stage order among ties
    assert "repaired: 1 unparseable" in " ".join(s.inserted for s in out.traces[0].steps)


# --------------------------------------------------------------------------- setwise, pure parts


def _oracle_heapsort(n: int, num_child: int, k: int, choose) -> tuple[list[list[int]], list[int]]:  # noqa: ANN001
    """llm-rankers' recursive heapify/heapSort and rerank's final order, written out as a
    reference: the sets compared (parent first) and the resulting order of positions."""
    arr, sets = list(range(n)), []

    def heapify(size: int, i: int) -> None:
        if num_child * i + 1 < size:
            inds = [i] + list(range(num_child * i + 1, min(num_child * (i + 1) + 1, size)))
            sets.append([arr[j] for j in inds])
            best = choose([arr[j] for j in inds])
            largest = inds[best] if best < len(inds) else i
            if largest != i:
                arr[i], arr[largest] = arr[largest], arr[i]
                heapify(size, largest)

    for i in range(n // num_child, -1, -1):
        heapify(n, i)
    ranked = 0
    for i in range(n - 1, 0, -1):
        arr[i], arr[0] = arr[0], arr[i]
        ranked += 1
        if ranked == k:
            break
        heapify(i, 0)
    top = list(reversed(arr))[:k]
    return sets, top + [j for j in range(n) if j not in top]


def _drive(n: int, num_child: int, k: int, choose) -> tuple[list[list[int]], list[int]]:  # noqa: ANN001
    steps, sets = heapsort_selection(n, num_child, k), []
    try:
        s = next(steps)
        while True:
            sets.append(s)
            s = steps.send(choose(s))
    except StopIteration as done:
        return sets, done.value


@pytest.mark.parametrize("n,num_child,k", [(100, 19, 10), (100, 3, 10), (7, 2, 3), (20, 19, 10), (3, 19, 10), (1, 19, 10)])
def test_heapsort_selection_follows_llm_rankers(n: int, num_child: int, k: int) -> None:
    value = random.Random(n * num_child).sample(range(1000), n)  # a hidden relevance per position
    perfect = lambda s: max(range(len(s)), key=lambda i: value[s[i]])  # noqa: E731
    sets, order = _drive(n, num_child, k, perfect)
    assert (sets, order) == _oracle_heapsort(n, num_child, k, perfect)
    assert order[:k] == sorted(range(n), key=lambda i: -value[i])[:k]  # the true top k, in order
    assert order[k:] == sorted(order[k:])  # the rest in first-stage order
    noisy = random.Random(1)
    answers = [noisy.randrange(num_child + 3) for _ in range(500)]  # out-of-range picks keep the parent
    it1, it2 = iter(answers), iter(answers)
    assert _drive(n, num_child, k, lambda s: next(it1)) == _oracle_heapsort(n, num_child, k, lambda s: next(it2))


def test_parse_choice_uses_rank_r1_pattern() -> None:
    for strict in (True, False):
        assert parse_choice("<think> d3 matches </think>\n<answer>[3]</answer>", "", 5, strict=strict) == (2, "pattern")
        assert parse_choice("<THINK>x</THINK> <ANSWER> [2] </ANSWER>", "", 5, strict=strict) == (1, "pattern")
        assert parse_choice("<think>x</think><answer>[9]</answer>", "", 5, strict=strict) == (0, "unanswered")
        assert parse_choice("<think>x</think><answer>3</answer>", "", 5, strict=strict) == (0, "unanswered")
        assert parse_choice("The answer is [2].", "The answer is [2].", 5, strict=strict) == (0, "unanswered")
    # Lenient: the <think> part taken away by a reasoning parser, the final response's <answer> is
    # read; a label with a leading zero names its document. Rank-R1 (strict) reads neither.
    assert parse_choice("<answer>[4]</answer>", "<answer>[4]</answer>", 5, strict=False) == (3, "answer_tag")
    assert parse_choice("<think>x</think><answer>[03]</answer>", "", 5, strict=False) == (2, "pattern")
    assert parse_choice("<answer>[4]</answer>", "<answer>[4]</answer>", 5) == (0, "unanswered")
    assert parse_choice("<think>x</think><answer>[03]</answer>", "", 5) == (0, "unanswered")


# --------------------------------------------------------------------------- setwise reranker


def _pick_highest(messages, params) -> str:  # noqa: ANN001
    nums = _numbers(messages[-1]["content"], r"^\[\d+\]: text (\d+)")
    best = max(range(len(nums)), key=lambda i: nums[i])
    return f"<think> [{best + 1}] has the highest number </think>\n<answer>[{best + 1}]</answer>"


def test_setwise_batches_queries_per_round_and_sorts_the_top(tmp_path) -> None:
    fake = ScriptedLLM(_pick_highest)
    spec = RerankerSpec(name="sw", kind="setwise", llm="x", num_child=2, select_k=3, seed=929)
    a, b = _task("A", 9), _task("B", 6, family="treatment")
    llm = CachedLLM(fake, "scripted", cache=GenerationCache(tmp_path / "g.sqlite"))
    outs = SetwiseReranker(spec, llm=llm).rerank_tasks([_job(a), _job(b)], 8)
    # The highest numbers are the most relevant: the top 3 sorted, the rest in first-stage order.
    assert _ranked(outs[0].run["A-q0"]) == [f"A-d{i}" for i in (7, 6, 5, 0, 1, 2, 3, 4, 8)]
    assert _ranked(outs[1].run["B-q1"]) == [f"B-d{i}" for i in (5, 4, 3, 0, 1, 2)]
    # One generate call per round, each holding every query still sorting, across tasks.
    per_query = [len(t.extra["comparisons"]) for out in outs for t in out.traces]
    assert len(fake.calls) == max(per_query) == outs[0].stats["rounds"]
    assert [len(c) for c in fake.calls] == [sum(1 for n in per_query if n > r) for r in range(max(per_query))]
    assert outs[0].stats["answers_read"] == {"pattern": sum(per_query[:2]), "answer_tag": 0, "unanswered": 0}
    # Sets are shown shuffled (seeded), and the answer's label maps back to the document shown.
    shown = [_numbers(c[-1]["content"], r"^\[\d+\]: text (\d+)") for call in fake.calls for c in call]
    assert any(s != sorted(s) for s in shown)
    again = SetwiseReranker(spec, llm=CachedLLM(fake, "scripted", cache=GenerationCache(tmp_path / "g.sqlite")))
    calls = len(fake.calls)
    assert again.rerank_tasks([_job(a), _job(b)], 8)[0].run == outs[0].run and len(fake.calls) == calls


def test_setwise_unanswered_keeps_the_parent() -> None:
    fake = ScriptedLLM(lambda m, p: "I cannot tell.")
    spec = RerankerSpec(name="sw", kind="setwise", llm="x", num_child=2, select_k=2)
    out = SetwiseReranker(spec, llm=CachedLLM(fake, "scripted")).rerank_tasks([_job(_task("A", 5))], 5)[0]
    # Every parent stays: the heap sort of an unanswering model places positions 0 and 4 first
    # (the root, then the last leaf swapped to the root), as llm-rankers does.
    assert _ranked(out.run["A-q0"])[:2] == ["A-d0", "A-d4"]
    assert out.stats["answers_read"]["unanswered"] == out.stats["comparisons"] > 0


# --------------------------------------------------------------------------- registry and factory


def test_spec_validation_and_factory() -> None:
    with pytest.raises(ValueError, match="group_size and passes"):
        RerankerSpec(name="x", kind="groupwise", llm="smollm2", passes=0)
    with pytest.raises(ValueError, match="num_child"):
        RerankerSpec(name="x", kind="setwise", llm="smollm2", num_child=20)
    from r2med_agent.rerank.factory import make_reranker

    gw, sw = make_reranker("smollm2-groupwise"), make_reranker("smollm2-setwise")
    assert isinstance(gw, GroupwiseReranker) and isinstance(sw, SetwiseReranker)
    gw.check()
    sw.check()
    for name in ("grouprank-32b", "qwen3-32b-groupwise", "qwen3-32b-groupwise-think", "rank-r1-14b"):
        make_reranker(name).check()  # the LLM entry and the prompts exist; nothing loads
    with pytest.raises(Exception, match="not a setwise"):
        SetwiseReranker(gw.spec)


# --------------------------------------------------------------------------- end to end, real model


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-groupwise", "smollm2-setwise"])
def test_group_and_set_rerankers_run_end_to_end_with_the_local_model(tmp_path, smollm2_spec, name: str) -> None:
    """``run`` on the sample task with the registry's offline entry: two queries' first three
    BM25 documents as ``--candidates`` (the local model reads a GroupRank prompt in seconds, not
    a dozen queries' in minutes), then the same run again from the cache."""
    import json

    from r2med_agent.data import load_task
    from r2med_agent.methods.loop import read_traces
    from r2med_agent.retrieval import make_retriever
    from r2med_agent.api import RunConfig, run_experiment

    task = load_task("sample")
    requests = [SearchRequest(q.query_id, q.text) for q in task.queries[:2]]
    first_stage = make_retriever("bm25", task, show_progress=False).search(requests, 3)
    lines = [f"{qid} Q0 {d} {r} {s} bm25" for qid, docs in first_stage.items()
             for r, (d, s) in enumerate(sorted(docs.items(), key=lambda kv: -kv[1]), 1)]
    (tmp_path / "sample.run").write_text("\n".join(lines) + "\n")
    cfg = RunConfig(tasks=("sample",), reranker=name, rerank_k=3, candidates_path=tmp_path / "sample.run",
                    output_dir=tmp_path / "res", cache_path=tmp_path / "gen.sqlite", show_progress=False)
    first = run_experiment(cfg)
    stats = json.loads((first.result_dir / "sample.json").read_text())["stats"]["rerank"]
    traces = {t.query_id: t for t in read_traces(first.result_dir / "sample.rerank.jsonl")}
    assert stats["kind"] == name.split("-")[1] and stats["generations"] > 0
    for req in requests:  # the candidates come back reranked, in some order
        assert sorted(traces[req.query_id].final.removeprefix("reranked: ").split(", ")) == sorted(first_stage[req.query_id])
    if name == "smollm2-groupwise":
        # 2 queries x 2 passes x 1 group of 3, recorded with their seeds.
        groups = [g for t in traces.values() for g in t.extra["groups"]]
        # GroupRank's shuffles: one generator seeded 666 per task, drawn pass after pass.
        assert stats["groups"] == len(groups) == 4 and {g["seed"] for g in groups} == {666}
        assert sorted(g["pass"] for g in groups) == [0, 0, 1, 1] and stats["shuffle"] == "sequential"
        # SmolLM2 seldom writes GroupRank's JSON: what it could not give is counted, not hidden.
        for kind, count in stats["repairs"].items():
            assert count == sum(g[kind] for g in groups)
        assert stats["answers_repaired"] == sum(1 for g in groups if any(g[k] for k in stats["repairs"]))
    else:
        # Sets of 3 (num_child 2), top 2 placed: 2 comparisons per query, in 2 rounds.
        assert stats["comparisons"] == 4 and stats["rounds"] == 2
        assert sum(stats["answers_read"].values()) == 4
    print(name, {k: v for k, v in stats.items() if k != "llm"})
    again = run_experiment(cfg)
    assert again.outcomes[0].stats["rerank"]["generations"] == 0  # every answer from the cache
    assert again.average == first.average


# --------------------------------------------------------------------------- GroupRank's own reading, shuffles, drops
# (tests/conformance/test_grouprank.py runs the authors' code itself against these)


def test_grouprank_reading_zeroes_a_group_where_its_script_fails() -> None:
    from r2med_agent.rerank.groupwise import grouprank_pairs

    group = ["a", "b", "c"]
    assert grouprank_pairs('<answer>```json\n{"[2]": 7, "[1]": 3}\n```</answer>', group) == [("b", 0.7), ("a", 0.3)]
    # Its fixes: a doubled bracket, a fenced object left unclosed; but an unclosed fence is no block.
    assert grouprank_pairs('<answer>```json\n{"[1]]": 4, "[3]": 9\n```', group) == [("a", 0.4), ("c", 0.9)]
    assert grouprank_pairs('<answer>```json\n{"[1]": 4, "[3]": 9', group) is None
    assert grouprank_pairs('{"[0]": 5}', group) == [("c", 0.5)]  # dids[-1]: Python indexing, as in its script
    assert grouprank_pairs('{"[1]": 12, "1": -2}', group) == [("a", 1.2), ("a", -0.2)]  # no clamping, both count
    for failed in ('{"[4]": 5}', '{"[1]": "5"}', "no JSON here", "", '{"[1]": NaN}', '{"[x]": 1}'):
        assert grouprank_pairs(failed, group) is None, failed


def test_grouprank_strict_run_drops_never_scored_documents_and_zeroes_failed_groups() -> None:
    # Groups of 2 in one pass: the group holding d0 fails (every document 0); the others name only
    # their first document, so their second is never scored and leaves the run.
    fake = ScriptedLLM(lambda m, p: "Document two." if "text 0" in m[-1]["content"] else '{"[1]": 5}')
    spec = RerankerSpec(name="gw", kind="groupwise", llm="x", group_size=2, seed=666)
    out = GroupwiseReranker(spec, llm=CachedLLM(fake, "scripted")).rerank_tasks([_job(_task("A", 6))], 6)[0]
    run = out.run["A-q0"]
    groups = out.traces[0].extra["groups"]
    failed = next(g for g in groups if "A-d0" in g["doc_ids"])
    assert all(run[d] == 0.0 for d in failed["doc_ids"]) and failed["unparseable"] == 1
    named = [g["doc_ids"][0] for g in groups if g is not failed]
    dropped = [g["doc_ids"][1] for g in groups if g is not failed]
    assert all(run[d] == 0.5 for d in named) and not set(dropped) & set(run)
    assert sorted(out.traces[0].extra["unscored"]) == sorted(dropped) and out.stats["unscored"] == 2 * len(dropped)
    zero = GroupwiseReranker(replace(spec, unscored="zero"), llm=CachedLLM(fake, "scripted")).rerank_tasks(
        [_job(_task("A", 6))], 6)[0]
    assert {d: zero.run["A-q0"][d] for d in dropped} == dict.fromkeys(dropped, 0.0)


def test_grouprank_sequential_shuffles_are_one_generator_per_task_drawn_pass_by_pass() -> None:
    """An independent computation of GroupRank's groups: random.seed(seed), then for each pass and
    each query in order, shuffle that query's list in place (the last pass's order) and cut it."""
    fake = ScriptedLLM(_score_by_number)
    spec = RerankerSpec(name="gw", kind="groupwise", llm="x", group_size=3, passes=3, seed=666)
    a, b = _task("A", 7), _task("B", 7)
    out = GroupwiseReranker(spec, llm=CachedLLM(fake, "scripted")).rerank_tasks([_job(a), _job(b)], 7)
    for task, result in zip((a, b), out):
        rng = random.Random(666)
        lists = {q.query_id: [d.doc_id for d in task.corpus] for q in task.queries}
        expected = []
        for p in range(3):
            for q in task.queries:
                rng.shuffle(lists[q.query_id])
                expected += [(q.query_id, p, lists[q.query_id][i:i + 3]) for i in range(0, 7, 3)]
        got = [(t.query_id, g["pass"], g["doc_ids"]) for t in result.traces for g in t.extra["groups"]]
        assert sorted(got) == sorted(expected)


def test_groupwise_sampling_is_the_entrys_top_p_and_each_pass_is_a_sample() -> None:
    seen = []
    fake = ScriptedLLM(lambda m, p: seen.append(p) or '{"[1]": 1}')
    spec = RerankerSpec(name="gw", kind="groupwise", llm="x", group_size=10, passes=2, temperature=0.3, top_p=0.8,
                        max_tokens=8000)
    GroupwiseReranker(spec, llm=CachedLLM(fake, "scripted")).rerank_tasks([_job(_task("A", 2))], 2)
    assert {(p.temperature, p.top_p, p.max_tokens) for p in seen} == {(0.3, 0.8, 8000)}
    assert len({p.seed for p in seen}) == 2  # pass 1 is another sample of the same prompts
    with pytest.raises(ValueError, match="top_p"):
        RerankerSpec(name="x", kind="groupwise", llm="y", top_p=1.5)
