"""Rank-R1 (ielab/llm-rankers at the pinned commit) against the project's setwise reranker, byte
for byte: the query and passage cuts to tokens of a real tokenizer (``SetwiseLlmRanker.truncate``),
the messages of every comparison (``R1SetwiseLlmRanker.compare`` of ``Rank-R1/run_setwise.py``,
the script of the README's BRIGHT evaluation, with ``prompts/prompt_setwise-R1.toml``), the
reading of good, malformed and empty answers, and the heap sort's comparisons and final order
(``SetwiseLlmRanker.heapSort`` and ``rerank``). The project's side renders the template a default
``rank-r1-14b`` run renders, the authors' TOML file imported from the pinned copy (as a fetch
imports it), and the project's own shipped template too.

The authors' ranker runs on a bare instance with vLLM's ``LLM`` replaced by a stand-in that
answers from the same script as the project's scripted LLM. Rank-R1 shuffles each set with one
generator shared by all queries (a kept difference: docs/protocol.md); both sides here show each
set in heap order, so that everything else can be compared exactly.
"""

from __future__ import annotations

import random
import tomllib
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.prompts.importer import import_clone, write_prompts
from r2med_agent.rerank import setwise
from r2med_agent.rerank.llm import RerankJob
from r2med_agent.rerank.setwise import SetwiseReranker, parse_choice
from r2med_agent.rerank.spec import get_reranker_spec
from tests.conformance.conftest import load_reference_module, reference_repo, stub
from tests.conformance.rerank_inputs import (
    HOSTILE_DOCS,
    as_run,
    fake_vllm,
    first_stage,
    minilm_tokenizer,
    pick,
    requests,
    sample_task,
    smol_dir,
    smol_llm_spec,
    smol_tokenizer,
)
from tests.fakes import ScriptedLLM

REPO = "ielab/llm-rankers"
PROMPT = "Rank-R1/prompts/prompt_setwise-R1.toml"

# Answers the reading must agree on: a label, one with spaces or upper-case tags, none of the
# set's labels, a number without brackets, a leading zero, no <think>, nothing.
ANSWERS = [
    lambda n: f"<think>the best is [{n}]</think>\n<answer>[{n}]</answer>",
    lambda n: "<think>hm</think> <answer> [2] </answer>",
    lambda n: "<THINK>A</THINK><ANSWER>[1]</ANSWER>",
    lambda n: f"<think>x</think><answer>[{n + 1}]</answer>",
    lambda n: "<think>x</think><answer>2</answer>",
    lambda n: "<think>x</think><answer>[02]</answer>",
    lambda n: "<answer>[2]</answer>",
    lambda n: "",
    lambda n: "<think>a</think><answer>[2]</answer><think>b</think><answer>[1]</answer>",
]


def _answer(user: str) -> str:
    n = user.count("\n[") + 1  # documents are "[i]: text", one per line after the first
    return ANSWERS[pick(user, len(ANSWERS))](n)


@pytest.fixture(scope="module")
def rank_r1():
    folder = reference_repo(REPO)
    toml = stub("toml", load=lambda path: tomllib.loads(Path(path).read_text(encoding="utf-8")))
    stubs = {"vllm": stub("vllm"), "vllm.lora": stub("vllm.lora"), "vllm.lora.request": stub("vllm.lora.request"),
             "pyserini": stub("pyserini"), "pyserini.search": stub("pyserini.search"),
             "pyserini.search.lucene": stub("pyserini.search.lucene"), "pyserini.search._base": stub("pyserini.search._base"),
             "toml": toml}
    state = random.getstate()
    try:
        mod = load_reference_module(folder, "Rank-R1/run_setwise.py", stubs=stubs, search=[folder / "Rank-R1", folder])
    finally:
        random.setstate(state)  # its modules seed the global generator when they load
    prompt = tomllib.loads((folder / PROMPT).read_text(encoding="utf-8"))
    return SimpleNamespace(folder=folder, mod=mod, prompt=prompt)


@pytest.fixture(scope="module")
def imported(rank_r1, tmp_path_factory):
    """The authors' prompt file imported from the pinned copy: what a default run renders."""
    out = tmp_path_factory.mktemp("rank-r1-prompts")
    write_prompts(import_clone(rank_r1.folder), out)
    return out


def _authors_ranker(ref, tokenizer, num_child: int, k: int):
    """``R1SetwiseLlmRanker`` as ``run_setwise.py``'s ``main`` builds it, without a model: its
    ``compare`` shows each set in heap order (``random.sample`` made the identity)."""
    ranker = ref.mod.R1SetwiseLlmRanker.__new__(ref.mod.R1SetwiseLlmRanker)
    fake = fake_vllm(tokenizer, lambda conversation: _answer(conversation[-1]["content"]))
    vars(ranker).update(prompt=ref.prompt, lora_path=None, num_child=num_child, num_permutation=1, k=k,
                        sampling_params=None, tokenizer=tokenizer, llm=fake(), scoring="generation",
                        method="heapsort", total_compare=0, total_completion_tokens=0, total_prompt_tokens=0)
    ref.mod.random = SimpleNamespace(sample=lambda population, n: list(population)[:n], choice=random.choice)
    return ranker, fake


def _search_result(ref, docid: str, text: str):
    return ref.mod.SearchResult(docid=docid, score=0.0, text=text)


@pytest.mark.parametrize("prompts_from", ["authors", "own"])
@pytest.mark.parametrize("num_child,k,depth,length", [(19, 10, 25, 1024), (3, 4, 12, 1024), (3, 4, 12, 12), (2, 3, 11, 1)])
def test_rank_r1_cuts_prompts_reading_and_heap_match_the_authors(rank_r1, imported, monkeypatch, prompts_from,
                                                                 num_child, k, depth, length) -> None:
    tok = smol_tokenizer()
    task = sample_task()
    lists = first_stage(task, depth)
    texts = {d.doc_id: d.full_text for d in task.corpus}
    ranker, fake = _authors_ranker(rank_r1, tok, num_child, k)
    theirs = {}
    for q in task.queries:
        ranking = [_search_result(rank_r1, d, ranker.truncate(texts[d], length)) for d in lists[q.query_id]]
        theirs[q.query_id] = [r.docid for r in ranker.rerank(ranker.truncate(q.text, length), ranking)]

    monkeypatch.setattr(setwise, "_shuffled", lambda positions, rng: list(positions))
    spec = replace(get_reranker_spec("rank-r1-14b"), llm="x", num_child=num_child, select_k=k)
    if length != 1024:  # the shipped entry's is Rank-R1's 1024
        spec = replace(spec, max_doc_tokens=length, max_query_tokens=length)
    script = ScriptedLLM(lambda messages, params: _answer(messages[-1]["content"]), model_id=str(smol_dir()))
    job = RerankJob(task, requests(task), as_run(lists), texts)
    prompts_dir = imported if prompts_from == "authors" else None
    out = SetwiseReranker(spec, llm=CachedLLM(script, smol_llm_spec()), prompts_dir=prompts_dir).rerank_tasks([job], depth)[0]
    # The same comparisons, message for message (the authors sort one query after another, the
    # project advances all queries together: the same sets, in another order of calls).
    assert sorted(str(m) for call in script.calls for m in call) == sorted(map(str, fake.prompts))
    for q in task.queries:
        run = out.run[q.query_id]
        assert sorted(run, key=lambda d: -run[d]) == theirs[q.query_id], q.query_id


def test_rank_r1_reads_answers_as_the_authors(rank_r1) -> None:
    """``compare`` alone over single sets: the label it returns is the project's strict reading."""
    for text in [f(4) for f in ANSWERS] + ["<think>\n</think>\n\n<answer>[3]</answer>", "<think>x</think><answer>[4] </answer>",
                                            "<think><answer>[1]</answer></think><answer>[2]</answer>", "[1]"]:
        tok = None
        ranker = rank_r1.mod.R1SetwiseLlmRanker.__new__(rank_r1.mod.R1SetwiseLlmRanker)
        fake = fake_vllm(tok, lambda conversation, text=text: text)
        vars(ranker).update(prompt=rank_r1.prompt, lora_path=None, num_permutation=1, llm=fake(), sampling_params=None,
                            total_compare=0, total_completion_tokens=0, total_prompt_tokens=0)
        rank_r1.mod.random = SimpleNamespace(sample=lambda population, n: list(population)[:n], choice=random.choice)
        docs = [_search_result(rank_r1, f"d{i}", f"text {i}") for i in range(4)]
        label = ranker.compare("q", docs)
        expected = ranker.CHARACTERS.index(label) if label in ranker.CHARACTERS else 0
        pick_, how = parse_choice(text, text, 4)
        assert (0 if how == "unanswered" else pick_) == expected, text


@pytest.mark.parametrize("tokenizer", ["smol", "minilm"])
@pytest.mark.parametrize("length", [1, 5, 1024])
def test_rank_r1_truncation(rank_r1, tokenizer, length) -> None:
    """``SetwiseLlmRanker.truncate`` (tokens back to text) against the project's cut, with
    SmolLM2's byte-level tokenizer and MiniLM's lossy WordPiece one, on every hostile text."""
    from r2med_agent.config import build
    from r2med_agent.llm.registry import LLMSpec
    from r2med_agent.rerank.tokens import load_passage_cut

    tok = smol_tokenizer() if tokenizer == "smol" else minilm_tokenizer()
    folder = str(smol_dir()) if tokenizer == "smol" else tok.name_or_path
    cut = load_passage_cut(build(LLMSpec, {"name": "t", "backend": "vllm", "model": folder}, "test"))
    ranker = rank_r1.mod.R1SetwiseLlmRanker.__new__(rank_r1.mod.R1SetwiseLlmRanker)
    ranker.tokenizer = tok
    for doc_id, text in {**HOSTILE_DOCS, "query": "Why [2] \u201ccaf\u00e9\u201d?"}.items():
        assert cut.cut(text, length) == ranker.truncate(text, length), doc_id
