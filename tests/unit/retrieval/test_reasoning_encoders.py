"""The post-paper reasoning retrievers of ``configs/encoders.yaml`` (ReasonEmbed, DIVER, RaDeR,
ReasonIR, Qwen3-Embedding): their settings as the ReasonEmbed authors ran them on R2MED
(VectorSpaceLab/agentic-search, ``ReasonEmbed/evaluation_r2med/``), DIVER's as its own code ran it
when its numbers were made (``diver-4b``: raw queries) and runs it since its commit 95b111b
(``diver-4b-instructed``), and each pipeline on a tiny random model of the same architecture class against
an independent computation of the authors' recipe: FlagEmbedding's decoder-only embedder (format
the query, tokenise as the tokenizer does, last token, L2) checked by hand and with
sentence-transformers' last-token pipeline; DIVER's (its fixed prompts, the decoded-text cut,
last token, L2) by hand; ReasonIR's sentence-transformers recipe (mean pooling, L2; with and
without the prompt) with sentence-transformers itself. No hub access: weights and tokenizers are
built in the test. (The authors' own functions are run in ``tests/conformance/``.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from r2med_agent.retrieval.dense.hf import HFEncoder
from r2med_agent.retrieval.dense.instructions import instruction_prefixes
from r2med_agent.retrieval.dense.spec import get_encoder_spec
from tests.result_trees import read_trec_run
from tests.sample_subset import sample_subset
from tests.tiny_embedders import TOKENIZER_STYLES, byte_bpe_tokenizer, tiny_model, user_entry

# ReasonEmbed/evaluation_r2med/code/prompts.py (R2MEDInstructions), byte for byte.
REASONEMBED_R2MED = {
    "Biology": "Given a Biology post, retrieve relevant passages that help answer the post.",
    "Medical-Sciences": "Given a Medical Science post, retrieve relevant passages that help answer the post.",
    "Bioinformatics": "Given a Bioinformatics post, retrieve relevant passages that help answer the post.",
    "MedXpertQA-Exam": "Given a Medical Exam, retrieve relevant passages that help answer the exam.",
    "MedQA-Diag": "Given a Medical Exam, retrieve relevant passages that help answer the exam.",
    "PMC-Treatment": "Given a Clinical Case, retrieve relevant passages that help answer the case.",
    "PMC-Clinical": "Given a Clinical Case, retrieve similar cases that help diagnose the case.",
    "IIYi-Clinical": "Given a Clinical Case, retrieve similar cases that help diagnose the case.",
}
# The scripts' --query_instruction_format_for_retrieval 'Instruct: {}\nQuery: {}' (FlagEmbedding
# turns the literal backslash-n into a newline).
FLAG_FORMAT = "Instruct: {}\nQuery: {}"
# ReasonEmbed/evaluation_r2med/code/reasonir_models.py.
REASONIR_QUERY_PROMPT = "<|user|>\n{}\n<|embed|>\n"
REASONIR_DOC_PROMPT = "<|embed|>\n"

# name -> (hub model, the architecture class a tiny stand-in is built from, backend)
LAST_TOKEN_ENTRIES = {
    "reasonembed-qwen3-8b": ("hanhainebula/reason-embed-qwen3-8b-0928", "qwen3", "auto"),
    "reasonembed-qwen3-4b": ("hanhainebula/reason-embed-qwen3-4b-0928", "qwen3", "auto"),
    "reasonembed-llama-8b": ("hanhainebula/reason-embed-llama-3.1-8b-0928", "llama", "auto"),
    "diver-4b-reasonembed": ("AQ-MedAI/Diver-Retriever-4B", "qwen3", "auto"),
    "qwen3-embedding-8b": ("Qwen/Qwen3-Embedding-8B", "qwen3", "auto"),
    "qwen3-embedding-4b": ("Qwen/Qwen3-Embedding-4B", "qwen3", "auto"),
    "rader-7b": ("Raderspace/RaDeR_gte_Qwen2-7B_MATH_LLMq_CoT_lexical", "qwen2", "transformers"),
}


def _registry_tasks() -> list[tuple[str, str]]:
    """(task name, R2MED task it is instructed as): the 8 tasks, their Nano splits, the demo."""
    from r2med_agent import data

    full = data.task_names("all")
    nano = data.task_names("nano-all")
    assert len(full) == len(nano) == 8
    return [(t, t) for t in full] + [(n, data.get_task_spec(n).base) for n in nano] + [("r2med-demo", "Biology")]


def _prefixes(spec, name: str):
    from r2med_agent import data

    ts = data.get_task_spec(name)
    return instruction_prefixes(spec, name, ts.family, ts.domain)


# --------------------------------------------------------------------------- registry entries


@pytest.mark.parametrize("name", sorted(LAST_TOKEN_ENTRIES))
def test_last_token_entries_are_the_reasonembed_r2med_settings(name: str) -> None:
    import torch

    from r2med_agent.retrieval.dense.torch_utils import resolve_dtype

    model, _, backend = LAST_TOKEN_ENTRIES[name]
    spec = get_encoder_spec(name)
    assert (spec.model, spec.backend, spec.pooling, spec.normalize, spec.append_eos) == (
        model, backend, "last-token", True, False)
    assert (spec.max_length, spec.query_max_length, spec.precision) == (512, None, "float16")
    assert resolve_dtype(spec.precision, "cuda:0") == torch.float16  # use_fp16: model.half()
    assert resolve_dtype(spec.precision, "cpu") == torch.float32
    assert spec.trust_remote_code == (name == "rader-7b")  # only RaDeR's script passes it
    assert (spec.pool_exclude_prefix, dict(spec.forward_kwargs), spec.instruction_on) == (False, {}, "query")
    assert dict(spec.query_instructions) == REASONEMBED_R2MED
    assert not spec.doc_instructions and not spec.query_prefix and not spec.doc_prefix
    tasks = _registry_tasks()
    assert len(tasks) == 17
    for task, r2med_task in tasks:
        p = _prefixes(spec, task)
        want = FLAG_FORMAT.format(REASONEMBED_R2MED[r2med_task], "")
        assert (p.query, p.doc, p.expansion) == (want, "", ""), task


@pytest.mark.parametrize(("name", "excluded"), [("reasonir-8b", False), ("reasonir-8b-prompt-excluded", True)])
def test_reasonir_entries_are_its_sentence_transformers_recipe(name: str, excluded: bool) -> None:
    # reasonir-8b: ReasonEmbed's run, whose mean covers the prompt (the repository's pooling config
    # includes it: docs/protocol.md); the variant pools as ReasonIR's own encode() does.
    spec = get_encoder_spec(name)
    assert (spec.model, spec.backend, spec.pooling, spec.pool_exclude_prefix) == (
        "reasonir/ReasonIR-8B", "transformers", "mean", excluded)
    assert (spec.normalize, spec.append_eos, spec.max_length, spec.precision) == (True, False, 512, "bfloat16")
    assert spec.trust_remote_code and spec.transformers == ">=4.47" and spec.truncation == "tokens"
    assert dict(spec.query_instructions) == REASONEMBED_R2MED
    for task, r2med_task in _registry_tasks():
        p = _prefixes(spec, task)
        want = REASONIR_QUERY_PROMPT.format(REASONEMBED_R2MED[r2med_task])
        assert (p.query, p.doc, p.expansion) == (want, REASONIR_DOC_PROMPT, ""), task


# AQ-MedAI/Diver Retriever/retrievers.py, Qwen3EmbeddingModel: embed_queries and embed_docs. Until
# commit 95b111b (2026-01-21) embed_queries embedded the raw queries (diver-4b); since, the
# instructed strings it builds (diver-4b-instructed).
DIVER_QUERY = {"diver-4b": "{}",
               "diver-4b-instructed": "Instruct: Given a web search query, retrieve relevant passages that answer "
                                      "the query\nQuery:{}"}
DIVER_DOC = "Represent this text:{}"


@pytest.mark.parametrize("name", sorted(DIVER_QUERY))
def test_diver_entry_is_divers_own_code(name: str) -> None:
    spec = get_encoder_spec(name)
    assert (spec.model, spec.backend, spec.pooling, spec.normalize, spec.append_eos) == (
        "AQ-MedAI/Diver-Retriever-4B", "auto", "last-token", True, False)
    assert (spec.max_length, spec.query_max_length, spec.truncation, spec.precision) == (16384, None, "decoded-text", "auto")
    assert not spec.query_instructions and not spec.doc_instructions and spec.instruction_on == "query"
    assert "AQ-MedAI/Diver@" in spec.reference and "Qwen3EmbeddingModel" in spec.reference
    # One instruction for every task, R2MED's or a user's own.
    for task, family, domain in [*((t, "", "") for t, _ in _registry_tasks()), ("my-cardiology", "qa", "cardiology")]:
        p = instruction_prefixes(spec, task, family, domain)
        assert (p.query, p.doc, p.expansion) == (DIVER_QUERY[name].format(""), DIVER_DOC.format(""), "")


@pytest.mark.parametrize("name", [*sorted(LAST_TOKEN_ENTRIES), "reasonir-8b", "reasonir-8b-prompt-excluded"])
def test_tasks_outside_r2med_get_no_guessed_instruction(name: str) -> None:
    # The source has one instruction per R2MED task and no template for other tasks.
    spec = get_encoder_spec(name)
    for task, family, domain in (("my-cardiology", "qa", "cardiology"), ("", "case", ""), ("", "", "")):
        p = instruction_prefixes(spec, task, family, domain)
        assert p.query == "" and p.doc == spec.doc_prefix


def test_backend_support_follows_the_settings() -> None:
    from r2med_agent.retrieval.dense.vllm import vllm_unsupported_reason

    for name, (_, _, backend) in LAST_TOKEN_ENTRIES.items():
        reason = vllm_unsupported_reason(get_encoder_spec(name))
        assert (reason is None) == (backend == "auto"), (name, reason)
    assert "own modelling code" in str(vllm_unsupported_reason(get_encoder_spec("rader-7b")))
    assert vllm_unsupported_reason(get_encoder_spec("diver-4b")) is None
    assert "instruction tokens" not in str(vllm_unsupported_reason(get_encoder_spec("reasonir-8b")))
    assert "own modelling code" in str(vllm_unsupported_reason(get_encoder_spec("reasonir-8b")))
    assert "instruction tokens" in str(vllm_unsupported_reason(get_encoder_spec("reasonir-8b-prompt-excluded")))


# --------------------------------------------------------------------------- tiny models

QUERIES = [
    "A 45-year-old man has fever and a new heart murmur.",
    "Why do cells divide?",
    # Longer than max_length below: cut on the right, as the tokenizer's truncation does.
    " ".join(["The patient presented with fever, cough and shortness of breath."] * 12),
]
DOCS = ["Infective endocarditis presents with fever and a murmur.", "Mitosis.", "Cells divide by mitosis; " * 20]
MAX_LENGTH = 48

def _byte_bpe_tokenizer(template: str, specials: dict[str, str]):
    """A real byte-level BPE tokenizer built offline from this file's texts (tests/tiny_embedders.py)."""
    corpus = [*REASONEMBED_R2MED.values(), *QUERIES, *DOCS, FLAG_FORMAT, REASONIR_QUERY_PROMPT]
    return byte_bpe_tokenizer(corpus, template, specials)


def _tiny_model(arch: str, folder: Path, tok, head_dim: int = 8):
    return tiny_model(arch, folder, tok, head_dim=head_dim)


def _states(model, tok, text: str):
    """Token states of one text, unpadded, tokenised as FlagEmbedding does (the tokenizer's own
    special tokens, truncation at MAX_LENGTH)."""
    import torch

    ids = tok(text, truncation=True, max_length=MAX_LENGTH)["input_ids"]
    with torch.inference_mode():
        return ids, model(input_ids=torch.tensor([ids])).last_hidden_state[0]


def _unit(vec) -> np.ndarray:
    import torch

    return torch.nn.functional.normalize(vec, dim=-1).numpy()


@pytest.mark.parametrize("name", sorted(LAST_TOKEN_ENTRIES))
def test_last_token_entries_encode_as_flagembedding_does(name: str, tmp_path: Path) -> None:
    from tests.st_reference import last_token_model

    arch = LAST_TOKEN_ENTRIES[name][1]
    tok = _byte_bpe_tokenizer(**TOKENIZER_STYLES[arch])
    folder = tmp_path / f"tiny-{name}"
    model, tok = _tiny_model(arch, folder, tok)
    spec = dataclasses.replace(get_encoder_spec(name), model=str(folder), max_length=MAX_LENGTH, batch_size=2)
    prefixes = _prefixes(spec, "nano-PMC-Clinical")
    instruction = REASONEMBED_R2MED["PMC-Clinical"]
    enc = HFEncoder(spec, device="cpu")
    got_q = enc.encode(QUERIES, side="query", prefix=prefixes.query)
    got_d = enc.encode(DOCS, side="doc", prefix=prefixes.doc)

    def flag(text: str) -> np.ndarray:  # FlagEmbedding's last_token_pool + normalize, one text
        ids, hidden = _states(model, tok, text)
        if arch == "qwen3":  # the tokenizer's own EOS is kept, also after truncation
            assert ids[-1] == tok.eos_token_id and ids.count(tok.eos_token_id) == 1
        else:  # nothing appended by the embedder
            assert ids[-1] != tok.eos_token_id
        return _unit(hidden[-1])

    for row, query in zip(got_q, QUERIES):
        np.testing.assert_allclose(row, flag(FLAG_FORMAT.format(instruction, query)), atol=1e-5)
        assert np.linalg.norm(row) == pytest.approx(1.0, abs=1e-5)
        # Without the full stop (R2MED's own table) or with another task's instruction: another vector.
        assert not np.allclose(row, flag(FLAG_FORMAT.format(instruction[:-1], query)), atol=1e-4)
        assert not np.allclose(row, flag(FLAG_FORMAT.format(REASONEMBED_R2MED["Biology"], query)), atol=1e-4)
    for row, doc in zip(got_d, DOCS):
        np.testing.assert_allclose(row, flag(doc), atol=1e-5)
    assert len(tok(FLAG_FORMAT.format(instruction, QUERIES[2]))["input_ids"]) > MAX_LENGTH  # truncation ran

    st = last_token_model(folder, {"r2med": FLAG_FORMAT.format(instruction, "")}, MAX_LENGTH)
    np.testing.assert_allclose(got_q, st.encode(QUERIES, prompt_name="r2med", batch_size=3), atol=1e-5)
    np.testing.assert_allclose(got_d, st.encode(DOCS, batch_size=3), atol=1e-5)


def _mean_model(folder: Path, max_seq_length: int, include_prompt: bool):
    """sentence-transformers' Transformer -> Pooling(mean, include_prompt) -> Normalize: ReasonIR
    through sentence-transformers, with the repository's pooling config (the prompt included, as
    ReasonEmbed ran it) or as ReasonIR's README sets it up
    (``set_pooling_include_prompt(include_prompt=False)``)."""
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Normalize, Pooling, Transformer

    body = Transformer(str(folder), max_seq_length=max_seq_length)
    dim = body.get_embedding_dimension() if hasattr(body, "get_embedding_dimension") else body.get_word_embedding_dimension()
    return SentenceTransformer(
        modules=[body, Pooling(dim, pooling_mode="mean", include_prompt=include_prompt), Normalize()], device="cpu")


@pytest.mark.parametrize(("name", "excluded"), [("reasonir-8b", False), ("reasonir-8b-prompt-excluded", True)])
def test_reasonir_encodes_as_sentence_transformers(name: str, excluded: bool, tmp_path: Path) -> None:
    # A tiny random Llama (ReasonIR-8B is a Llama 3.1; its bidirectional attention is the model
    # repository's own code, which the same forward call runs in both pipelines, not tested here).
    tok = _byte_bpe_tokenizer(**TOKENIZER_STYLES["llama"])
    folder = tmp_path / "tiny-reasonir"
    model, tok = _tiny_model("llama", folder, tok)
    spec = dataclasses.replace(get_encoder_spec(name), model=str(folder), max_length=MAX_LENGTH, batch_size=2)
    prefixes = _prefixes(spec, "MedQA-Diag")
    query_prompt = REASONIR_QUERY_PROMPT.format(REASONEMBED_R2MED["MedQA-Diag"])
    enc = HFEncoder(spec, device="cpu")
    got_q = enc.encode(QUERIES, side="query", prefix=prefixes.query)
    got_d = enc.encode(DOCS, side="doc", prefix=prefixes.doc)

    def by_hand(prompt: str, text: str, skip_prompt: bool) -> np.ndarray:
        ids, hidden = _states(model, tok, prompt + text)
        n_prompt = len(tok(prompt)["input_ids"]) if skip_prompt else 0  # BOS + prompt tokens
        assert ids[:n_prompt] == tok(prompt)["input_ids"][:n_prompt]
        return _unit(hidden[n_prompt:].mean(dim=0))

    for row, query in zip(got_q, QUERIES):
        np.testing.assert_allclose(row, by_hand(query_prompt, query, excluded), atol=1e-5)
        assert not np.allclose(row, by_hand(query_prompt, query, not excluded), atol=1e-4)  # the other pooling
    for row, doc in zip(got_d, DOCS):
        np.testing.assert_allclose(row, by_hand(REASONIR_DOC_PROMPT, doc, excluded), atol=1e-5)

    st = _mean_model(folder, MAX_LENGTH, include_prompt=not excluded)
    np.testing.assert_allclose(got_q, st.encode(QUERIES, prompt=query_prompt, batch_size=3), atol=1e-5)
    np.testing.assert_allclose(got_d, st.encode(DOCS, prompt=REASONIR_DOC_PROMPT, batch_size=3), atol=1e-5)


def _diver_cut(tok, text: str, limit: int) -> str:
    """DIVER's truncate_text, written out here: tokens without special tokens; over the limit,
    the decoded first ``limit`` of them."""
    ids = tok.encode(text, add_special_tokens=False)
    return tok.decode(ids[:limit]) if len(ids) > limit else text


@pytest.mark.parametrize("name", sorted(DIVER_QUERY))
@pytest.mark.parametrize("limit", [MAX_LENGTH, 12])
def test_diver_encodes_as_its_own_code_does(limit: int, name: str, tmp_path: Path) -> None:
    # A tiny random Qwen3 whose tokenizer appends <|endoftext|> as Qwen3-Embedding's does: the
    # strings DIVER's Qwen3EmbeddingModel builds, cut by decoding, tokenized again with the
    # tokenizer's own special tokens and nothing cut (vLLM's embed), last token, L2.
    tok = _byte_bpe_tokenizer(**TOKENIZER_STYLES["qwen3"])
    folder = tmp_path / "tiny-diver"
    model, tok = _tiny_model("qwen3", folder, tok)
    spec = dataclasses.replace(get_encoder_spec(name), model=str(folder), max_length=limit, batch_size=2)
    prefixes = _prefixes(spec, "PMC-Clinical")
    enc = HFEncoder(spec, device="cpu")
    got_q = enc.encode(QUERIES, side="query", prefix=prefixes.query)
    got_d = enc.encode(DOCS, side="doc", prefix=prefixes.doc)

    def diver(string: str) -> np.ndarray:
        import torch

        ids = tok(_diver_cut(tok, string, limit))["input_ids"]
        assert ids[-1] == tok.eos_token_id
        with torch.inference_mode():
            return _unit(model(input_ids=torch.tensor([ids])).last_hidden_state[0][-1])

    cut = 0
    for row, query in zip(got_q, QUERIES):
        np.testing.assert_allclose(row, diver(DIVER_QUERY[name].format(query)), atol=1e-5)
        cut += len(tok.encode(DIVER_QUERY[name].format(query), add_special_tokens=False)) > limit
        # ReasonEmbed's format (a space after "Query:") is another vector (unless both are cut inside the prompt).
        assert limit < MAX_LENGTH or not np.allclose(row, diver("Instruct: Given a web search query, retrieve relevant passages "
                                          "that answer the query\nQuery: " + query), atol=1e-4)
    for row, doc in zip(got_d, DOCS):
        np.testing.assert_allclose(row, diver(DIVER_DOC.format(doc)), atol=1e-5)
        assert not np.allclose(row, diver(doc), atol=1e-4)  # no document prompt: another vector
    assert cut >= 1  # the decoded-text cut ran



THREE = ("0", "1", "2")
"""The sample's queries the CLI tests below run (the groupwise reranker's generations are their cost)."""


def _assert_scored_as_pytrec_eval(record: Path, data: Path) -> None:
    """The record's nDCG@10 and MRR equal pytrec_eval's over the run file written beside it and the
    data folder's qrels, and every query of the folder was ranked."""
    import json

    import pytrec_eval

    qrels: dict[str, dict[str, int]] = {}
    for line in (data / "sample" / "qrels.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        qrels.setdefault(row["q_id"], {})[row["p_id"]] = int(row["score"])
    run = read_trec_run(record.with_suffix(".run"))
    assert sorted(run) == sorted(qrels)
    per_query = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recip_rank"}).evaluate(run)
    result = json.loads(record.read_text(encoding="utf-8"))
    for ours, theirs in (("ndcg_at_10", "ndcg_cut_10"), ("mrr", "recip_rank")):
        want = sum(m[theirs] for m in per_query.values()) / len(per_query)
        assert result["test"][ours] == pytest.approx(want, abs=1e-4), ours


@pytest.mark.slow
def test_reasoning_retriever_then_groupwise_reranker_through_the_cli(tmp_path: Path, monkeypatch, smollm2_spec) -> None:
    """The frontier's shape, ``run --retriever reasonembed-qwen3-8b --reranker grouprank-32b``, with
    tiny real models in the entries' places: a random Qwen3 under ReasonEmbed-Qwen3-8B's settings
    (last-token pooling, its instruction format) and SmolLM2-135M in the groupwise reranker. On
    R2MED's released demo (Biology) the query side gets Biology's ReasonEmbed instruction; on the
    embedded sample's first three queries (:func:`tests.sample_subset.sample_subset`: the reranker's
    work is what this costs) the reranked run is scored as pytrec_eval scores its run file."""
    import json

    from typer.testing import CliRunner

    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app

    tok = _byte_bpe_tokenizer(**TOKENIZER_STYLES["qwen3"])
    folder = tmp_path / "tiny-reasonembed"
    _tiny_model("qwen3", folder, tok)
    user = tmp_path / "config.yaml"
    user.write_text(json.dumps({"encoders": {"tiny-reasonembed": user_entry(
        "reasonembed-qwen3-8b", model=str(folder), backend="transformers", max_length=MAX_LENGTH, batch_size=4)}}))
    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    seen: list[tuple[str, str]] = []
    real_encode = HFEncoder.encode

    def recording(self, texts, *, side, prefix="", titles=None):  # noqa: ANN001, ANN202
        seen.append((side, prefix))
        return real_encode(self, texts, side=side, prefix=prefix, titles=titles)

    monkeypatch.setattr(HFEncoder, "encode", recording)
    _register()
    runner = CliRunner()
    common = ["--config", str(user), "--retriever", "tiny-reasonembed", "--output-dir", str(tmp_path / "res")]
    demo = runner.invoke(app, ["run", "--task", "r2med-demo", *common])
    assert demo.exit_code == 0, demo.output
    assert ("query", FLAG_FORMAT.format(REASONEMBED_R2MED["Biology"], "")) in seen and ("doc", "") in seen
    data = sample_subset(tmp_path / "data", THREE)
    res = runner.invoke(app, ["run", "--task", "sample", *common, "--reranker", "smollm2-groupwise", "--rerank-k", "3",
                              "--cache-path", str(tmp_path / "gen.sqlite"), "--data-dir", str(data),
                              "--allow-count-mismatch"])
    assert res.exit_code == 0, res.output
    (record,) = (tmp_path / "res").glob("none/none/tiny-reasonembed__*smollm2-groupwise*/sample.json")
    result = json.loads(record.read_text())
    _assert_scored_as_pytrec_eval(record, data)
    assert result["stats"]["rerank"]["groups"] == 3 * 2  # 3 queries, one group of 3, 2 passes
    assert result["config"]["retriever"] == "tiny-reasonembed" and result["config"]["entries"]


@pytest.mark.slow
def test_diver_first_stage_then_groupwise_reranker_through_the_cli(tmp_path: Path, monkeypatch, smollm2_spec) -> None:
    """A frontier row over DIVER, ``run --retriever diver-4b --reranker grouprank-32b``, with tiny
    real models in the entries' places: a random Qwen3 under diver-4b's own settings (here cut at 40
    tokens so the sample's long texts go through DIVER's decoded-text cut) and SmolLM2-135M in the
    groupwise reranker, on the ``sample`` task's first three queries and its whole corpus. Every
    query reaches the model as DIVER's code builds it, every document with DIVER's prompt."""
    import json

    from typer.testing import CliRunner

    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app
    from r2med_agent.data.load import load_task
    from r2med_agent.retrieval.dense.tokens import decoded_text_cut

    tok = _byte_bpe_tokenizer(**TOKENIZER_STYLES["qwen3"])
    folder = tmp_path / "tiny-diver"
    _, tok = _tiny_model("qwen3", folder, tok)
    entry = user_entry("diver-4b", model=str(folder), backend="transformers", max_length=40, batch_size=4)
    assert entry["truncation"] == "decoded-text" and entry["doc_prefix"] == DIVER_DOC.format("")
    user = tmp_path / "config.yaml"
    user.write_text(json.dumps({"encoders": {"tiny-diver": entry}}))
    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    seen: list[list[int]] = []
    real_tokenize = HFEncoder._tokenize

    def recording(self, lo, texts, titles, max_length):  # noqa: ANN001, ANN202
        out = real_tokenize(self, lo, texts, titles, max_length)
        seen.extend(out[0])
        return out

    monkeypatch.setattr(HFEncoder, "_tokenize", recording)
    _register()
    runner = CliRunner()
    data = sample_subset(tmp_path / "data", THREE)
    common = ["--config", str(user), "--task", "sample", "--output-dir", str(tmp_path / "res"),
              "--reranker", "smollm2-groupwise", "--rerank-k", "3", "--cache-path", str(tmp_path / "gen.sqlite"),
              "--data-dir", str(data), "--allow-count-mismatch"]
    res = runner.invoke(app, ["run", "--retriever", "tiny-diver", *common])
    assert res.exit_code == 0, res.output
    task = load_task("sample", data_dir=data, allow_count_mismatch=True)
    assert [q.query_id for q in task.queries] == list(THREE)
    want = [tok(s)["input_ids"] for s in decoded_text_cut(
        tok, [DIVER_QUERY["diver-4b"].format(q.text) for q in task.queries] + [DIVER_DOC.format(d.text) for d in task.corpus], 40)]
    assert sorted(map(tuple, seen)) == sorted(map(tuple, want))  # every text, as DIVER's code gives it
    assert sum(len(x) > 40 for x in seen) > 0  # cut texts: 40 tokens, then the tokenizer's EOS
    (record,) = (tmp_path / "res").glob("none/none/tiny-diver__*smollm2-groupwise*/sample.json")
    result = json.loads(record.read_text())
    _assert_scored_as_pytrec_eval(record, data)
    assert result["config"]["entries"]


def test_the_cut_is_part_of_a_runs_identity(tmp_path: Path) -> None:
    # The same user entry with the tokenizer's cut instead of DIVER's is another run: another
    # entries hash, so another result folder (a shipped entry is its name: its settings are the
    # package's).
    import json

    from r2med_agent.config import set_user_config
    from r2med_agent.experiment.runner import entries_in_use
    from r2med_agent.api import RunConfig

    hashes = []
    for truncation in ("decoded-text", "tokens"):
        user = tmp_path / f"{truncation}.yaml"
        user.write_text(json.dumps({"encoders": {"my-diver": user_entry("diver-4b", truncation=truncation)}}))
        set_user_config(user)
        try:
            hashes.append(entries_in_use(RunConfig(tasks=("sample",), retriever="my-diver")))
        finally:
            set_user_config(None)
    assert None not in hashes and hashes[0] != hashes[1]


def test_a_text_of_no_tokens_embeds_as_zero_whatever_its_batch(tmp_path: Path) -> None:
    """RaDeR's R2MED setting appends nothing and its Qwen2 tokenizer adds no special token, so an
    empty document is zero tokens: it used to crash the batch that held it alone ("cannot reshape
    tensor of 0 elements") and, beside other texts, to pool a padding position whose vector
    depended on the batch. It is the zero vector now (no similarity to anything), and the other
    texts of its batch embed as they do alone."""
    tok = _byte_bpe_tokenizer(**TOKENIZER_STYLES["qwen2"])
    folder = tmp_path / "tiny-rader"
    _, tok = _tiny_model("qwen2", folder, tok)
    assert tok("")["input_ids"] == []
    spec = dataclasses.replace(get_encoder_spec("rader-7b"), model=str(folder), max_length=MAX_LENGTH, batch_size=2)
    enc = HFEncoder(spec, device="cpu")
    alone = enc.encode([""], side="doc")
    assert alone.shape[0] == 1 and not np.any(alone)
    mixed = enc.encode(["", DOCS[0], "", DOCS[1]], side="doc")
    assert not np.any(mixed[[0, 2]]) and np.isfinite(mixed).all()
    np.testing.assert_allclose(mixed[[1, 3]], enc.encode([DOCS[0], DOCS[1]], side="doc"), atol=1e-6)
