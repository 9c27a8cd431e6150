"""Rank1 (orionw/rank1, ``rank1.py``) against the project's ``format: rank1`` pointwise reranker,
byte for byte: the raw-text prompt of every pair (``return_prompt``; the authors' text imported
from the pinned copy, and the project's shipped copy), passages sent as they are, the forced end
of an answer that never closed its thinking and the P(true) read from the judgment token's
log-probabilities, for complete, unfinished and empty answers (``_process_with_vllm`` and
``_fix_incomplete_responses``).

The authors' class runs on a bare instance whose vLLM engine is a stand-in answering from a script
(mteb stubbed: it is only the base class and the evaluation harness).
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.prompts.importer import import_clone, write_prompts
from r2med_agent.rerank import formats
from r2med_agent.rerank.llm import LLMReranker, RerankJob
from r2med_agent.rerank.spec import RerankerSpec, get_reranker_spec
from r2med_agent.types import Generation
from tests.conformance.conftest import load_reference_module, reference_repo, stub
from tests.conformance.rerank_inputs import (
    HOSTILE_DOCS,
    HOSTILE_QUERY,
    Logprob,
    as_run,
    first_stage,
    pick,
    requests,
    sample_task,
    smol_dir,
    smol_llm_spec,
)
from tests.fakes import ScriptedLLM

REPO = "orionw/rank1"
TRUE, FALSE = 1001, 1002  # the stand-in tokenizer's ids of " true" and " false"
TOKENS = {TRUE: " true", FALSE: " false", 7: "and", 8: ".", 9: "</think>"}

# (generated text, log-probabilities of its last position): judged, judged the other way, both
# judgment tokens unlikely, one of them missing (thinking never closed), nothing generated.
ANSWERS = [
    ("It fits the query.\n", {TRUE: -0.2, FALSE: -1.8, 8: -4.0}),
    ("Not about this.\n", {TRUE: -2.5, FALSE: -0.1}),
    ("Unsure", {TRUE: -9.0, FALSE: -9.5, 7: -0.01}),
    ("It is long and the case goes on. Then", {7: -0.1, 8: -2.0}),
    ("", None),
]
FORCED = {TRUE: -0.7, FALSE: -0.69}


def _pick(prompt: str) -> tuple[str, dict[int, float] | None]:
    return ANSWERS[pick(prompt, len(ANSWERS))]


@pytest.fixture(scope="module")
def rank1():
    folder = reference_repo(REPO)
    names = ["mteb", "mteb.encoder_interface", "mteb.evaluation", "mteb.evaluation.evaluators",
             "mteb.evaluation.evaluators.RetrievalEvaluator", "mteb.model_meta", "mteb.models",
             "mteb.models.rerankers_custom", "vllm"]
    mod = load_reference_module(folder, "rank1.py", stubs={n: stub(n) for n in names})
    return SimpleNamespace(folder=folder, mod=mod)


@pytest.fixture(scope="module")
def imported(rank1, tmp_path_factory):
    out = tmp_path_factory.mktemp("rank1-prompts")
    write_prompts(import_clone(rank1.folder), out)
    return out


def _authors(rank1, forced_prompts: list[str]):
    """A bare ``rank1`` instance whose engine answers from :data:`ANSWERS` (by prompt) and, for a
    forced end, with :data:`FORCED`."""

    def generate(prompts, params):
        outs = []
        for p in prompts:
            if params.get("max_tokens") == 1:
                forced_prompts.append(p)
                text, lps = " true", [{t: Logprob(v) for t, v in FORCED.items()}]
            else:
                text, last = _pick(p)
                lps = [] if last is None else [{7: Logprob(0.0)}, {t: Logprob(v) for t, v in last.items()}]
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(text=text, logprobs=lps, token_ids=[0] * len(lps))]))
        return outs

    model = rank1.mod.rank1.__new__(rank1.mod.rank1)
    vars(model).update(model=SimpleNamespace(generate=generate), true_token=TRUE, false_token=FALSE,
                       sampling_params={"max_tokens": 8192})
    rank1.mod.SamplingParams = lambda **kw: kw
    return model


class _Rank1Engine(ScriptedLLM):
    """The same answers as the project's backends give them: text, and per generated position the
    top tokens with their log-probabilities (vLLM's, as strings)."""

    returns_logprobs = True
    scores_choices = True

    def generate(self, prompts, params, **kw):  # noqa: ANN001, ANN003, ANN201
        self.calls.append([list(p) for p in prompts])
        out = []
        for m in prompts:
            prompt = m[0]["content"]
            if params.max_tokens == 1:
                out.append(Generation(text=" true", logprobs=(tuple((TOKENS[t], v) for t, v in FORCED.items()),)))
                continue
            text, last = _pick(prompt)
            lps = None if last is None else ((("and", 0.0),), tuple((TOKENS[t], v) for t, v in last.items()))
            out.append(Generation(text=text, logprobs=lps, finish_reason="stop" if last and TRUE in last else "length"))
        return out


@pytest.mark.parametrize("own", [False, True])
def test_rank1_prompts_forced_ends_and_scores_match_the_authors(rank1, imported, own) -> None:
    task = sample_task()
    # Every hostile document but the 20,000-word one, which the entry's guard cuts (see below).
    lists = {q: [d for d in docs if d != "long"] for q, docs in first_stage(task, 12).items()}
    texts = {d.doc_id: d.full_text for d in task.corpus}
    pairs = [(q, d) for q in task.queries for d in lists[q.query_id]]
    model = _authors(rank1, forced := [])
    prompts = [model.return_prompt(q.text, texts[d], None) for q, d in pairs]
    _, _, theirs = model._process_with_vllm(prompts)

    spec = replace(get_reranker_spec("rank1-7b"), llm="x")  # the shipped entry, its LLM scripted
    engine = _Rank1Engine(lambda m, p: "", model_id=str(smol_dir()))
    reranker = LLMReranker(spec, llm=CachedLLM(engine, smol_llm_spec()), prompts_dir=None if own else imported)
    job = RerankJob(task, requests(task), as_run(lists), texts)
    out = reranker.rerank_tasks([job], 12)[0]
    # Every pair's raw prompt (the passage as it is), and every forced end.
    assert [m[0]["content"] for m in engine.calls[0]] == prompts
    assert [m[0]["content"] for m in engine.calls[1]] == forced
    # The scores (P(true)), pair for pair.
    ours = {(r["query_id"], r["doc_id"]): r["score"] for t in out.traces for r in
            [{**j, "query_id": t.query_id} for j in t.extra["judgments"]]}
    for (q, d), score in zip(pairs, theirs):
        assert ours[(q.query_id, d)] == pytest.approx(score, abs=1e-6), (q.query_id, d)


def test_rank1_forced_end_and_p_true_alone(rank1) -> None:
    """``_fix_incomplete_responses`` on hostile answers: its forced prompt and its score."""
    model = _authors(rank1, forced := [])
    texts = ["Hmm. It is long and", "No sentence end at all", "", "   ", "Ends well!", "Q? A. B", "\u00e9t\u00e9. \U0001f600"]
    prompt = model.return_prompt(HOSTILE_QUERY.text, HOSTILE_DOCS["combining"], None)
    _, _, scores = model._fix_incomplete_responses([prompt] * len(texts), texts)
    assert forced == [formats.forced_end(prompt, t) for t in texts]
    p = math.exp(FORCED[TRUE]) / (math.exp(FORCED[TRUE]) + math.exp(FORCED[FALSE]))
    assert scores == [pytest.approx(p)] * len(texts)
    assert formats.true_probability([(TOKENS[t], v) for t, v in FORCED.items()]) == pytest.approx(p)


def test_rank1_guard_cuts_only_a_passage_its_context_could_not_hold(rank1) -> None:
    """The one difference kept on purpose: a passage over ``max_doc_tokens`` (14,000 for the
    shipped entries; Rank1's own run stops at a prompt over its 16,000-token context) is cut to
    them; every other passage goes as it is, as Rank1 sends it."""
    spec = RerankerSpec(name="r1", kind="pointwise-reasoning", format="rank1", llm="x", max_doc_tokens=50)
    reranker = LLMReranker(spec, llm=CachedLLM(ScriptedLLM(lambda m, p: "", model_id=str(smol_dir())), smol_llm_spec()))
    for doc_id, text in HOSTILE_DOCS.items():
        if reranker.passage_cut().count(text) <= 50:
            assert reranker.prepared(text) == text, doc_id
    long = reranker.prepared(HOSTILE_DOCS["long"])
    assert HOSTILE_DOCS["long"].startswith(long) and reranker.passage_cut().count(long) == 50
