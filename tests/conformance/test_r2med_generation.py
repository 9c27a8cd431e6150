"""R2MED's HyDE, Query2Doc and LameR prompts and its reasoning-output parsing, against R2MED's own
code (R2MED/R2MED, pinned copy): ``src/instrcution.py`` and ``src/generate_hypothetical_doc.py``
build the prompts, ``src/base.py`` ``split_response_for_r1`` reads the outputs.

The project's side is what a run with the authors' prompts renders: templates imported from the
copy by the importer of ``r2med-agent prompts import`` (as a fetch imports them), rendered by the
methods themselves. The authors' side runs their code: the prompt tables of ``instrcution.py``,
and for LameR ``generate_func_by_gpt.process`` itself over the task written in R2MED's layout, its
OpenAI client replaced by a recorder of the messages it is sent (vllm, transformers and openai
are stubbed: the file imports them at the top). Inputs: the ``sample`` task's queries and
documents, and hostile ones (unicode and odd whitespace, empty text, braces, a 20,000-word
document, ids with odd characters)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from r2med_agent.data import REFERENCE_NAMES, get_task_spec, load_task
from r2med_agent.llm.parsing import split_reasoning
from r2med_agent.llm.registry import get_llm_spec
from r2med_agent.prompts.importer import read_r2med, write_prompts
from r2med_agent.types import Doc, Query, Task
from tests.conformance.conftest import load_reference_module, reference_repo, stub

HOSTILE_QUERIES = (
    "Ünïcödé: 患者の発熱 — fièvre 🙂 with a zero\u200bwidth space and a\u00a0no-break one",
    "",
    "   ",
    "Braces {TEXT} {0} {} {{x}} {% raw %} {# c #} and a trailing space ",
    "Line one\r\nline two\n\n\tindented",
    " ".join(f"w{i}" for i in range(20_000)),
)


@pytest.fixture(scope="module")
def r2med() -> Path:
    return reference_repo("R2MED/R2MED")


@pytest.fixture(scope="module")
def imported(r2med, tmp_path_factory) -> Path:
    """The project's templates of R2MED's prompts, imported from the pinned copy."""
    out = tmp_path_factory.mktemp("r2med-prompts")
    write_prompts(read_r2med(r2med), out)
    return out


@pytest.fixture(scope="module")
def instrcution(r2med):
    return load_reference_module(r2med, "src/instrcution.py")


def _queries() -> tuple[Query, ...]:
    sample = load_task("sample")
    return sample.queries + tuple(Query(f"h{i}", text) for i, text in enumerate(HOSTILE_QUERIES))


def _task(key: str, queries: tuple[Query, ...], corpus: tuple[Doc, ...] = (Doc("d", "x"),)) -> Task:
    spec = get_task_spec(REFERENCE_NAMES[key])
    return Task(name=spec.name, family=spec.family, domain=spec.domain, queries=queries, corpus=corpus, qrels={},
                source="inline", fingerprint="conformance")


@pytest.mark.parametrize("key", list(REFERENCE_NAMES))
def test_hyde_and_query2doc_prompts_per_task(key, imported, instrcution) -> None:
    from r2med_agent.methods.expansion import HyDE, Query2Doc

    queries = _queries()
    t = _task(key, queries)
    for method, table in ((HyDE, instrcution.hyde), (Query2Doc, instrcution.query2doc)):
        got = [c[0]["content"] for c in method(prompts_dir=imported).build_prompts(t)]
        # generate_func.process: input_prompt = self.base_prompt.format(TEXT=entry['text'])
        assert got == [table[key].format(TEXT=q.text) for q in queries], (method.name, key)


class _Recorder:
    """Stands in for generate_func_by_gpt's OpenAI client: records the messages it is sent."""

    def __init__(self) -> None:
        self.sent: list[list[dict[str, str]]] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    def _create(self, messages, **kwargs):  # noqa: ANN001, ANN202 - the client's signature
        self.sent.append(messages)
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="a passage"))])


def _corpus() -> tuple[Doc, ...]:
    sample = load_task("sample")
    hostile = (
        Doc("long doc 20k", " ".join(f"word{i}" for i in range(20_000))),
        Doc("empty/é", ""),
        Doc('quote"id', "Line\nbreaks\r\nand\ttabs,\u2003em space, Ünïcödé 🙂 {PASSAGE} {TEXT}"),
        Doc("0", "   \n  "),
    )
    return hostile + sample.corpus[:8]


@pytest.mark.parametrize("key", ["Stack-Biology", "MedQA-Diag", "PMC-Treat", "PMCPatients"])
def test_lamer_prompts_as_generate_hypothetical_doc_sends_them(key, r2med, imported, instrcution, tmp_path) -> None:
    from r2med_agent.methods.expansion import LameR

    gen = load_reference_module(r2med, "src/generate_hypothetical_doc.py", stubs={
        "vllm": stub("vllm"), "transformers": stub("transformers"), "openai": stub("openai")})
    queries = _queries()
    corpus = _corpus()
    ranked = [d.doc_id for d in corpus]  # the first pass: this order, ten shown
    data = tmp_path / "data"
    data.mkdir()
    (data / "query.jsonl").write_text("".join(json.dumps({"id": q.query_id, "text": q.text, "doc_id": []}) + "\n"
                                              for q in queries))
    (data / "corpus.jsonl").write_text("".join(json.dumps({"id": d.doc_id, "text": d.text}) + "\n" for d in corpus))
    (data / "qrels.jsonl").write_text(json.dumps({"q_id": queries[0].query_id, "p_id": ranked[0]}) + "\n")
    pre = tmp_path / "bm25.jsonl"
    pre.write_text("".join(json.dumps({"id": q.query_id, "topk_pid": [[d, 10.0 - i] for i, d in enumerate(ranked)]})
                           + "\n" for q in queries))
    ref = gen.generate_func_by_gpt(instrcution.lamer[key], f"{data}/", str(tmp_path / "out" / "gen.jsonl"), "m",
                                   "lamer", pre_retrieval_path=str(pre))
    ref.model = recorder = _Recorder()
    ref.process()
    expected = [m[1]["content"] for m in recorder.sent]
    assert [m[0] for m in recorder.sent] == [{"role": "system", "content": "You are a helpful assistant."}] * len(queries)
    first_pass = {q.query_id: {d: 10.0 - i for i, d in enumerate(ranked)} for q in queries}
    got = [c[0]["content"] for c in LameR(prompts_dir=imported).build_prompts(_task(key, queries, corpus), first_pass)]
    assert got == expected


# ----------------------------------------------------------------------------------------------
# Reasoning outputs: src/base.py split_response_for_r1

OUTPUTS = (
    # good
    "<think>\nLet me think.\n</think>\n\nThe passage.\n",
    "reasoning without an opening tag</think> answer",
    "## Thinking\nStep one.\n\n## Final Response\nThe case is croup.",
    "Thinking: a\nFinal Response: b  \n\n",
    "Some thoughts. <answer> Paris </answer> trailing",
    # malformed
    "<think>unclosed reasoning cut by max_tokens",
    "a</think>b</think>c",
    "</think>",
    "<think></think>",
    "Final Responses follow\nthe rest",
    "## Final Response\n\n",
    "Final Response",
    "x Final Response y Final Response z",
    "<answer>unclosed",
    "<answer>a</answer><answer>b</answer>",
    "<answer></answer>",
    "<ANSWER>upper</ANSWER>",
    "  \n plain text with surrounding whitespace \n ",
    "Ünïcödé 🙂 </think>  réponse  ",
    # empty
    "",
    "   ",
    "\n",
)

R2MED_MODELS = ("r1-qwen-32b", "r1-llama-70b", "qwq-32b", "qwen3-32b", "huatuo-o1-70b", "qwen-7b-ins", "qwen-3b-ins",
                "qwen-7b", "qwen-32b", "qwen-72b", "llama-70b", "gpt4", "o3-mini")
"""R2MED's models that the LLM registry has (src/generate_hypothetical_doc.py, src/base.py)."""


@pytest.mark.parametrize("model", R2MED_MODELS)
def test_the_final_response_is_what_split_response_for_r1_gives(model, r2med) -> None:
    """Each registry entry's reasoning format reads every output as R2MED reads that model's."""
    base = load_reference_module(r2med, "src/base.py")
    fmt = get_llm_spec(model).reasoning_format
    for text in OUTPUTS:
        assert split_reasoning(text, fmt)[1] == base.split_response_for_r1(model, text), (model, fmt, text)


# ----------------------------------------------------------------------------------------------
# The GPT-4o request: src/generate_hypothetical_doc.py generate_func_by_gpt


def test_the_gpt4_request_is_the_one_generate_func_by_gpt_sends(r2med, tmp_path) -> None:
    """R2MED's GPT-4o rows: ``generate_func_by_gpt.process`` with its real OpenAI client (the
    ``openai`` package), built as ``generate_hy_doc`` builds it for ``gpt4``, against the request
    the shipped ``gpt4`` entry sends with the sampling a fresh HyDE, Query2Doc or LameR run
    gives it, both to one real loopback server: the same JSON body, field for field (temperature
    and top_p 0.8; no max_tokens, no seed)."""
    import dataclasses

    import openai

    from r2med_agent.llm import default_sampling
    from r2med_agent.llm.registry import make_backend
    from tests.llm_server import CannedChatServer

    gen = load_reference_module(r2med, "src/generate_hypothetical_doc.py", stubs={
        "vllm": stub("vllm"), "transformers": stub("transformers")})
    data = tmp_path / "data"
    data.mkdir()
    (data / "query.jsonl").write_text(json.dumps({"id": "q1", "text": "Why {TEXT} a fever?", "doc_id": []}) + "\n")
    (data / "corpus.jsonl").write_text(json.dumps({"id": "d1", "text": "A document."}) + "\n")
    (data / "qrels.jsonl").write_text(json.dumps({"q_id": "q1", "p_id": "d1"}) + "\n")
    entry = get_llm_spec("gpt4")
    with CannedChatServer() as server:
        # generate_hy_doc("hyde", "gpt4", ...): generate_func_by_gpt(base_prompt, data_dir, save_path,
        # model_dict["gpt4"], gar_method), temperature and top_p at the class's defaults.
        ref = gen.generate_func_by_gpt("Write a passage for: {TEXT}", f"{data}/", str(tmp_path / "out" / "gen.jsonl"),
                                       entry.model, "hyde")
        ref.model = openai.OpenAI(api_key="EMPTY", base_url=server.base_url, max_retries=0)
        ref.process()
        (theirs,) = server.bodies
        # The entry as the API resolves it (server openai), only its address on loopback.
        ours = make_backend(dataclasses.replace(entry, base_urls=(server.base_url,), server="openai"))
        ours.generate([theirs["messages"]], default_sampling(entry))
        # A run's own --max-tokens (BRIGHT's reason.py sends 2,048) is still sent.
        ours.generate([theirs["messages"]], default_sampling(entry, max_tokens=2048))
        mine, limited = server.bodies[1:]
    assert mine == theirs
    assert "max_tokens" not in mine and "seed" not in mine and (mine["temperature"], mine["top_p"]) == (0.8, 0.8)
    assert limited == {**theirs, "max_tokens": 2048}
