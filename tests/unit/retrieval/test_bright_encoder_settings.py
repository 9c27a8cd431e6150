"""The reasoning embedders on BRIGHT's tasks: each entry's ``bright:`` block (``EncoderSpec.bright``)
against the settings its authors' BRIGHT code used, recorded here with their source.

The sources' strings are written out in ``tests/bright_embedder_sources.py``, byte for byte, each
with its repository, commit and file, so that these tests need no copy of the authors' code;
``tests/conformance/test_embed_bright.py`` checks them against the pinned copies (FlagEmbedding's
and ReasonIR's ``evaluation/bright``; RaDeR has none) and runs what they hold (ReasonEmbed's BRIGHT
scripts, ReasonIR's ``retrieval_reasonir`` as DIVER's repository carries it).

Also here: how the block is validated, which tasks it applies to, that it keeps the R2MED
embedding caches' keys and enters a user entry's identity, the other-tokenizer setting RaDeR's
code needs (checked against RaDeR's recipe written out by hand on a tiny random Qwen2), and the
dry run's description of a BRIGHT row.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from r2med_agent.config import build
from r2med_agent.errors import ConfigError
from r2med_agent.retrieval.dense.instructions import instruction_prefixes, is_bright_task, settings_for_task
from r2med_agent.retrieval.dense.spec import EncoderSpec, get_encoder_spec

from tests.bright_embedder_sources import (
    FLAG_BRIGHT_LONG,
    FLAG_BRIGHT_SHORT,
    FLAG_ENTRIES,
    FLAG_FORMAT,
    KEYS,
    LONG_KEYS,
    RADER_QUERY,
    REASONIR_DOC,
    REASONIR_QUERY,
    task_name,
)


def _bright_tasks() -> list[tuple[str, str, bool]]:
    return [(task_name(k), k, False) for k in KEYS] + [(task_name(k, True), k, True) for k in LONG_KEYS]


def _prefixes(spec: EncoderSpec, name: str):
    from r2med_agent.data import get_task_spec

    ts = get_task_spec(name)
    return instruction_prefixes(spec, name, ts.family, ts.domain)


def test_the_configs_written_out_here_are_the_sources_counts() -> None:
    # The sources' shape: 12 short instructions, 8 long ones (7 StackExchange tasks and Pony).
    assert len(FLAG_BRIGHT_SHORT) == len(REASONIR_QUERY) == len(RADER_QUERY) == 12
    assert set(FLAG_BRIGHT_LONG) == set(LONG_KEYS) == {k for k, (_, lg) in REASONIR_QUERY.items() if lg}
    assert REASONIR_QUERY["earth_science"][0].format(task="earth_science") == (
        "<|user|>\nGiven a earth_science post, retrieve relevant passages that help answer the post\n<|embed|>\n")


@pytest.mark.parametrize("name", FLAG_ENTRIES)
def test_reasonembed_and_qwen3_entries_run_reasonembeds_bright_scripts(name: str) -> None:
    spec = get_encoder_spec(name)
    for task, key, long in _bright_tasks():
        on = settings_for_task(spec, task)
        instruction = (FLAG_BRIGHT_LONG if long else FLAG_BRIGHT_SHORT)[key]
        p = _prefixes(on, task)
        assert (p.query, p.doc, p.expansion) == (FLAG_FORMAT.format(instruction, ""), "", ""), task
        assert (on.max_length, on.query_max_length, on.batch_size) == (8192, None, 8)  # --embedder_*_length 8192
        # Everything else as the R2MED scripts: FlagEmbedding's decoder-only embedder, fp16.
        assert (on.model, on.pooling, on.precision, on.append_eos, on.truncation) == (
            spec.model, "last-token", "float16", False, "tokens")
        assert on.reference.startswith("VectorSpaceLab/agentic-search@b2f2e40050f4 ReasonEmbed/evaluation_bright/scripts/")
    # On R2MED's tasks the entry is its own: 512 tokens and the R2MED instructions.
    assert settings_for_task(spec, "Biology") is spec and spec.max_length == 512
    assert _prefixes(spec, "Biology").query == FLAG_FORMAT.format(
        "Given a Biology post, retrieve relevant passages that help answer the post.", "")


@pytest.mark.parametrize("name", ["reasonir-8b", "reasonir-8b-prompt-excluded"])
def test_reasonir_entries_run_reasonirs_own_bright_code(name: str) -> None:
    spec = get_encoder_spec(name)
    for task, key, long in _bright_tasks():
        on = settings_for_task(spec, task)
        template = REASONIR_QUERY[key][1 if long else 0]
        p = _prefixes(on, task)
        # retrieval_reasonir: instructions['query'].format(task=task), instructions['document']
        assert (p.query, p.doc, p.expansion) == (template.format(task=key), REASONIR_DOC, ""), task
        # ReasonIRModel.encode(..., instruction=...) masks the instruction's tokens (BOS included) out
        # of the mean; query_max_length and doc_max_length default to 32768; torch_dtype "auto".
        assert (on.pooling, on.pool_exclude_prefix, on.max_length, on.query_max_length) == ("mean", True, 32768, None)
        assert (on.precision, on.trust_remote_code, on.normalize) == ("bfloat16", True, True)
        assert on.reference.startswith("facebookresearch/ReasonIR@0aac96269e45 evaluation/bright/retrievers.py")
    assert settings_for_task(spec, "PMC-Clinical").max_length == 512


def test_rader_runs_raders_own_bright_code() -> None:
    spec = get_encoder_spec("rader-7b")
    for task, key, long in _bright_tasks():
        on = settings_for_task(spec, task)
        template = RADER_QUERY[key][1 if long else 0]
        p = _prefixes(on, task)
        assert (p.query, p.doc, p.expansion) == ("query: " + template.format(task=key), "document: ", ""), task
        # Its EOS appended, from Qwen2.5-14B-Instruct's tokenizer; no cut; AutoModel's own Qwen2
        # (no trust_remote_code) in float32 (no dtype given, transformers 4.49.0); last token.
        assert (on.hf_tokenizer, on.append_eos, on.max_length, on.query_max_length) == (
            "Qwen/Qwen2.5-14B-Instruct", True, 131072, None)
        assert (on.trust_remote_code, on.precision, on.pooling, on.normalize) == (False, "float32", "last-token", True)
        assert on.model == spec.model and on.reference.startswith("Debrup-61/RaDeR@3a127e47a419 retrievers.py")
    # R2MED: ReasonEmbed's run, unchanged.
    assert (spec.hf_tokenizer, spec.append_eos, spec.trust_remote_code, spec.max_length) == ("", False, True, 512)


@pytest.mark.parametrize(("name", "query"), [
    ("diver-4b", ""),  # DIVER's code when its README's numbers were made: raw queries
    ("diver-4b-instructed", "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"),
])
def test_diver_needs_no_block_and_diver_reasonembed_has_no_bright_run(name: str, query: str) -> None:
    diver = get_encoder_spec(name)
    assert not diver.bright  # its own settings are DIVER's BRIGHT code (Qwen3EmbeddingModel)
    for task, _, _ in _bright_tasks():
        p = _prefixes(settings_for_task(diver, task), task)
        assert p.query == query
        assert p.doc == "Represent this text:"
    assert not get_encoder_spec("diver-4b-reasonembed").bright


@pytest.mark.parametrize(("task", "bright"), [
    ("bright-biology", True), ("bright-earth_science", True), ("bright-pony-long", True), ("BRIGHT-AOPS", True),
    ("Biology", False), ("nano-Biology", False), ("r2med-demo", False), ("sample", False), ("my-own-task", False),
    ("", False),
])
def test_the_block_applies_to_brights_tasks_only(task: str, bright: bool) -> None:
    spec = get_encoder_spec("reasonembed-qwen3-8b")
    assert is_bright_task(task) is bright
    assert settings_for_task(spec, task).max_length == (8192 if bright else 512)


def test_entries_without_a_block_are_the_same_on_bright() -> None:
    spec = get_encoder_spec("bright-e5")
    assert not spec.bright and settings_for_task(spec, "bright-biology") is spec


def _entry(**bright) -> dict:
    return {"name": "mine", "model": "some/model", "pooling": "last-token", "max_length": 512, "bright": bright}


@pytest.mark.parametrize(("bright", "message"), [
    ({"max_lenght": 8192}, "unknown key(s) max_lenght"),
    ({"max_length": "long"}, "bright.max_length: expected an integer"),
    ({"pooling": "max"}, "bright.pooling: 'max' is not one of"),
    ({"model": "other/model"}, "bright cannot change model"),
    ({"name": "x"}, "bright cannot change name"),
    ({"bright": {}}, "bright cannot change bright"),
    ({"instruction_format": "{instruction}"}, "instruction_format must contain"),
    ({"max_length": 1}, "max_length must be >= 2"),
])
def test_a_bad_block_fails_when_the_registry_loads(bright: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        build(EncoderSpec, _entry(**bright), "my.yaml: encoders.mine")
    assert "my.yaml: encoders.mine" in str(e.value) and message in str(e.value)


def test_a_user_entrys_block_fails_with_its_file(tmp_path: Path) -> None:
    from r2med_agent.config import set_user_config

    user = tmp_path / "config.yaml"
    user.write_text("encoders:\n  mine:\n    model: some/model\n    bright: {max_lenght: 8192}\n")
    set_user_config(user)
    try:
        with pytest.raises(ConfigError) as e:
            get_encoder_spec("mine")
    finally:
        set_user_config(None)
    assert str(user) in str(e.value) and "max_lenght" in str(e.value)


def test_the_block_is_coerced_and_resolves() -> None:
    spec = build(EncoderSpec, _entry(max_length=8192, query_instructions={"bright-biology": "Find it."},
                                     instruction_format="Instruct: {instruction}\nQuery: {text}"), "x")
    on = spec.on_bright()
    assert (on.max_length, dict(on.query_instructions), on.bright) == (8192, {"bright-biology": "Find it."}, {})
    assert spec.max_length == 512 and not spec.query_instructions
    assert _prefixes(on, "bright-biology").query == "Instruct: Find it.\nQuery: "


def test_r2med_embedding_caches_keep_their_keys_and_bright_ones_get_their_own() -> None:
    from r2med_agent.retrieval.dense.cache import embedding_cache_key

    for name in (*FLAG_ENTRIES, "reasonir-8b", "rader-7b"):
        spec = get_encoder_spec(name)
        key = embedding_cache_key(spec, "", "fp", 10)
        assert key == embedding_cache_key(dataclasses.replace(spec, bright={}), "", "fp", 10), name
        on = spec.on_bright()
        assert embedding_cache_key(on, _prefixes(on, "bright-biology").doc, "fp", 10) != key, name


def test_the_block_is_part_of_a_user_entrys_identity(tmp_path: Path) -> None:
    from r2med_agent.config import set_user_config
    from r2med_agent.experiment.runner import entries_in_use
    from r2med_agent.api import RunConfig

    hashes = []
    for length in (8192, 4096):
        entry = {"model": "some/model", "pooling": "last-token", "bright": {"max_length": length}}
        user = tmp_path / f"{length}.yaml"
        user.write_text(json.dumps({"encoders": {"mine": entry}}))
        set_user_config(user)
        try:
            hashes.append(entries_in_use(RunConfig(tasks=("bright-biology",), retriever="mine")))
        finally:
            set_user_config(None)
    assert None not in hashes and hashes[0] != hashes[1]


def test_the_dry_run_describes_the_settings_each_task_runs() -> None:
    from r2med_agent.grids.first_stage import first_stage_lines
    from r2med_agent.experiment.resolve import resolve
    from r2med_agent.experiment.spec import RunSpec

    row = resolve(RunSpec(retriever="reasonembed-qwen3-8b"))
    bright = "\n".join(first_stage_lines(row, ("bright-biology", "bright-pony")))
    assert "on BRIGHT's tasks" in bright and "8192 tokens" in bright and "ReasonEmbed/evaluation_bright/" in bright
    assert "512 tokens" not in bright
    r2med = "\n".join(first_stage_lines(row, ("Biology",)))
    assert "512 tokens" in r2med and "evaluation_r2med" in r2med and "BRIGHT" not in r2med
    both = "\n".join(first_stage_lines(row, ("Biology", "bright-biology")))
    assert "on BRIGHT's tasks" in both and "on the other tasks" in both
    rader = "\n".join(first_stage_lines(resolve(RunSpec(retriever="rader-7b")), ("bright-aops",)))
    assert '"query: Instruct: {instruction}\\nQuery: {query}" with the task\'s instruction' in rader
    assert "131072 tokens" in rader and "EOS appended" in rader and "Debrup-61/RaDeR" in rader
    assert "tokenized by Qwen/Qwen2.5-14B-Instruct's tokenizer" in rader


def test_the_dry_runs_needs_follow_the_bright_settings() -> None:
    from r2med_agent.grids.grid import GridEntry
    from r2med_agent.grids.needs import entry_needs

    entry = GridEntry(method="none", retriever="rader-7b")
    row = entry.run_config(("Biology",), Path("results")).plan
    bright = entry_needs(entry, row, tasks=("bright-biology",))
    assert any("in fp32, texts through Qwen/Qwen2.5-14B-Instruct's tokenizer" in s for s in bright.setup)
    assert any("fp32 weights" in g for g in bright.gpu) and "Qwen/Qwen2.5-14B-Instruct (tokenizer)" in bright.hub
    r2med = entry_needs(entry, row, tasks=("Biology",))
    assert any(" in fp16" in s for s in r2med.setup) and not any("tokenizer" in h for h in r2med.hub)


# --------------------------------------------------------------------------- another tokenizer


def _tokenizers(tmp_path: Path):
    """Two tokenizers with one vocabulary: the model's own, gte-Qwen2-style (appends
    <|endoftext|>, its EOS), and a Qwen2.5-Instruct-style one (adds nothing; EOS <|im_end|>)."""
    from tests.tiny_embedders import byte_bpe_tokenizer

    corpus = [*FLAG_BRIGHT_SHORT.values(), "query: Instruct: ", "document: ", "Why do moths fly to light?"]
    own = byte_bpe_tokenizer(corpus, "$A <|endoftext|>", {"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"})
    own.eos_token = "<|endoftext|>"
    instruct = byte_bpe_tokenizer(corpus, "$A", {"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"})
    assert own.get_vocab() == instruct.get_vocab()
    folder = tmp_path / "qwen25-instruct-tokenizer"
    instruct.save_pretrained(folder)
    return own, folder


def test_raders_bright_recipe_on_a_tiny_qwen2(tmp_path: Path) -> None:
    """RaDeR's retrieval_trainedmodel written out: each text alone, ``f"query: {instruction}{query}
    {eos}"`` and ``f"document: {document}{eos}"`` through Qwen2.5-Instruct's tokenizer (its EOS as
    text), no truncation, the last token's state, L2. The entry's BRIGHT settings give the same
    vectors; the model's own tokenizer (another EOS) gives others."""
    import torch
    from transformers import AutoTokenizer

    from r2med_agent.retrieval.dense.hf import HFEncoder
    from tests.tiny_embedders import tiny_model

    own, tok_folder = _tokenizers(tmp_path)
    folder = tmp_path / "tiny-rader"
    model, _ = tiny_model("qwen2", folder, own)
    instruct = AutoTokenizer.from_pretrained(tok_folder)
    on = dataclasses.replace(settings_for_task(get_encoder_spec("rader-7b"), "bright-biology"),
                             model=str(folder), hf_tokenizer=str(tok_folder), batch_size=2)
    prefixes = _prefixes(on, "bright-biology")
    queries = ["Why do moths fly to light?", "Which nostril breathes? " * 5]
    docs = ["Phototaxis is movement toward light.", "The nasal cycle."]

    def rader(text: str) -> np.ndarray:
        ids = instruct(text, return_tensors="pt")["input_ids"]
        assert ids[0, -1].item() == instruct.convert_tokens_to_ids("<|im_end|>")
        with torch.inference_mode():
            return torch.nn.functional.normalize(model(input_ids=ids).last_hidden_state[:, -1, :], dim=-1)[0].numpy()

    enc = HFEncoder(on, device="cpu")
    instruction = RADER_QUERY["biology"][0].format(task="biology")
    got_q = enc.encode(queries, side="query", prefix=prefixes.query)
    got_d = enc.encode(docs, side="doc", prefix=prefixes.doc)
    for row, q in zip(got_q, queries):
        np.testing.assert_allclose(row, rader(f"query: {instruction}{q}{instruct.eos_token}"), atol=1e-5)
    for row, d in zip(got_d, docs):
        np.testing.assert_allclose(row, rader(f"document: {d}{instruct.eos_token}"), atol=1e-5)
    # The model's own tokenizer (its EOS <|endoftext|>, appended by its template): other vectors.
    mine = HFEncoder(dataclasses.replace(on, hf_tokenizer=""), device="cpu")
    assert not np.allclose(mine.encode(queries, side="query", prefix=prefixes.query), got_q, atol=1e-4)


def test_the_vllm_backend_takes_the_same_tokens_from_the_other_tokenizer(tmp_path: Path) -> None:
    from r2med_agent.retrieval.dense.hf import HFEncoder
    from r2med_agent.retrieval.dense.vllm import VLLMEncoder
    from tests.tiny_embedders import tiny_model

    own, tok_folder = _tokenizers(tmp_path)
    folder = tmp_path / "tiny"
    tiny_model("qwen2", folder, own)
    on = dataclasses.replace(settings_for_task(get_encoder_spec("rader-7b"), "bright-biology"),
                             model=str(folder), hf_tokenizer=str(tok_folder))
    texts = ["Why do moths fly to light?", ""]
    hf = HFEncoder(on, device="cpu")
    lo = hf._load("doc")
    want, _ = hf._tokenize(lo, ["document: " + t for t in texts], None, on.max_length)
    assert VLLMEncoder(on).token_ids(texts, side="doc", prefix="document: ") == want
    assert all(ids[-1] == lo.eos_id for ids in want) and lo.eos_id == own.convert_tokens_to_ids("<|im_end|>")
