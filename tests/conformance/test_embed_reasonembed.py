"""The entries that follow ReasonEmbed's R2MED evaluation against the authors' own code
(``tests/conformance/reasonembed_code.py``): each script's arguments as ``main.py`` parses them,
the embedder ``R2MEDEvalRunner.get_models`` builds from them (FlagEmbedding's ``BaseLLMEmbedder``),
and the instruction each R2MED task gets (``prompts.R2MEDInstructions``, set per task as
``R2MEDEvalRunner.run`` sets it). Compared with the project: the settings, the query and
document strings byte for byte on the ``sample`` task and hostile texts for all 8 R2MED tasks,
then on a tiny random model of each entry's architecture class the strings and token ids the
authors' embedder tokenizes and the vectors it returns.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from r2med_agent.retrieval.dense.hf import HFEncoder
from r2med_agent.retrieval.dense.spec import get_encoder_spec
from tests.conformance.embedder_inputs import (
    docs,
    project_doc_strings,
    project_token_ids,
    queries,
    task_prefixes,
    tokenizer_corpus,
)
from tests.conformance.reasonembed_code import AGENTIC as AGENTIC_REPO
from tests.conformance.reasonembed_code import Code, RecordingTokenizer, scripts
from tests.tiny_embedders import TOKENIZER_STYLES, byte_bpe_tokenizer, tiny_model

# script (under ReasonEmbed/evaluation_r2med/) -> (the project's entry, its architecture class)
FOLLOWED = {
    "scripts/ours/eval_reason_embed_qwen3_8b.sh": ("reasonembed-qwen3-8b", "qwen3"),
    "scripts/ours/eval_reason_embed_qwen3_4b.sh": ("reasonembed-qwen3-4b", "qwen3"),
    "scripts/ours/eval_reason_embed_llama_3.1_8b.sh": ("reasonembed-llama-8b", "llama"),
    "scripts/baselines/eval_diver_retriever_4b.sh": ("diver-4b-reasonembed", "qwen3"),
    "scripts/baselines/eval_qwen3_embedding_8b.sh": ("qwen3-embedding-8b", "qwen3"),
    "scripts/baselines/eval_qwen3_embedding_4b.sh": ("qwen3-embedding-4b", "qwen3"),
    "scripts/baselines/eval_rader_gte_qwen2_7b.sh": ("rader-7b", "qwen2"),
}
# Scripts no entry follows: ReasonIR (its own case file), the unreleased "basic" models, and
# e5-mistral, whose `e5` entry follows R2MED's own evaluation instead.
NOT_FOLLOWED = {
    "scripts/baselines/eval_reasonir_8b.sh", "scripts/baselines/eval_e5_mistral_7b_instruct.sh",
    "scripts/ours/eval_reason_embed_basic_qwen3_8b.sh", "scripts/ours/eval_reason_embed_basic_qwen3_4b.sh",
    "scripts/ours/eval_reason_embed_basic_llama_3.1_8b.sh",
}
R2MED_TASKS = ("Biology", "Bioinformatics", "Medical-Sciences", "MedXpertQA-Exam", "MedQA-Diag",
               "PMC-Treatment", "PMC-Clinical", "IIYi-Clinical")


@pytest.fixture(scope="module")
def code() -> Code:
    return Code()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random model per architecture class, with a tokenizer of that family's style."""
    out = {}
    for arch in ("qwen3", "llama", "qwen2"):
        folder = tmp_path_factory.mktemp(f"tiny-{arch}")
        tiny_model(arch, folder, byte_bpe_tokenizer(tokenizer_corpus(), **TOKENIZER_STYLES[arch]), positions=1024)
        out[arch] = folder
    return out


def test_every_script_is_followed_or_named(code: Code) -> None:
    assert set(scripts(code.agentic)) == set(FOLLOWED) | NOT_FOLLOWED


@pytest.mark.parametrize("script", sorted(FOLLOWED))
def test_settings_and_strings_are_the_scripts(code: Code, script: str) -> None:
    name, _ = FOLLOWED[script]
    eval_args, model_args = code.args(scripts(code.agentic)[script])
    spec = get_encoder_spec(name)
    assert eval_args.use_special_instructions is True  # one instruction per R2MED task
    assert spec.model == model_args.embedder_name_or_path
    assert spec.max_length == model_args.embedder_query_max_length == model_args.embedder_passage_max_length
    assert spec.query_max_length in (None, spec.max_length) and spec.truncation == "tokens"
    assert (model_args.pooling_method, spec.pooling) == ("last_token", "last-token")
    assert spec.normalize == model_args.normalize_embeddings is True
    assert spec.trust_remote_code == model_args.trust_remote_code
    assert model_args.use_fp16 and spec.precision == "float16"  # FlagEmbedding's model.half() on a GPU
    assert spec.append_eos is False  # BaseLLMEmbedder adds nothing to what the tokenizer gives

    fmt = model_args.query_instruction_format_for_retrieval
    detailed = code.decoder_only.BaseLLMEmbedder.get_detailed_instruct
    qs, ds = queries(), docs()
    for task in R2MED_TASKS:
        prefixes = task_prefixes(spec, task)
        assert [prefixes.query + q for q in qs] == [detailed(fmt, code.instructions[task], q) for q in qs], task
        # No passage instruction is set: documents are their text (the searcher's corpus texts).
        assert project_doc_strings(spec, prefixes.doc, ds) == [d.text for d in ds], task


# One script per architecture class: the entries of one class share every setting the embedder
# runs (the strings of all of them are compared above).
ONE_PER_CLASS = sorted({arch: script for script, (_, arch) in sorted(FOLLOWED.items(), reverse=True)}.values())


@pytest.mark.parametrize("script", ONE_PER_CLASS)
def test_the_authors_embedder_tokenizes_and_embeds_as_the_entry(code: Code, folders: dict[str, Path],
                                                                script: str) -> None:
    name, arch = FOLLOWED[script]
    _, model_args = code.args(scripts(code.agentic)[script])
    # float32 weights: on a CPU FlagEmbedding computes in float32 either way (model.float()).
    embedder = code.embedder(model_args, folders[arch], use_fp16=False)
    assert type(embedder).__name__ == "BaseLLMEmbedder" and embedder.target_devices == ["cpu"]
    recorder = embedder.tokenizer = RecordingTokenizer(embedder.tokenizer)
    task = "PMC-Clinical"
    embedder.query_instruction_for_retrieval = code.instructions[task]  # as R2MEDEvalRunner.run sets it

    spec = dataclasses.replace(get_encoder_spec(name), model=str(folders[arch]), batch_size=8)
    prefixes = task_prefixes(spec, task)
    ours = HFEncoder(spec, device="cpu")
    qs, ds = queries(), docs()
    for side, texts, prefix, theirs in (
        ("query", qs, prefixes.query, embedder.encode_queries),
        ("doc", [d.text for d in ds], prefixes.doc, embedder.encode_corpus),
    ):
        recorder.texts.clear()
        recorder.ids.clear()
        strings = [prefix + t for t in texts]
        theirs(texts)
        # Vectors are compared for texts with at least one token. An empty document under a
        # tokenizer that adds no special token (RaDeR's Qwen2 style) has none: FlagEmbedding pools
        # the state at its padded batch's last position, which depends on the batch.
        keep = [i for i, s in enumerate(strings) if recorder.inner(s)["input_ids"]]
        assert len(keep) >= len(texts) - 1
        their_ids = list(recorder.ids)
        assert recorder.texts[:len(strings)] == strings, side
        assert recorder.max_lengths == {spec.max_length}
        assert their_ids[:len(strings)] == project_token_ids(spec, folders[arch], strings, side), side
        assert max(len(x) for x in their_ids) == spec.max_length  # the 20,000-word text was cut
        kept = [texts[i] for i in keep]
        their_vectors = theirs(kept)
        np.testing.assert_allclose(ours.encode(kept, side=side, prefix=prefix), their_vectors, atol=2e-5,
                                   err_msg=f"{name} {side}")


def test_entries_name_the_script_they_follow(code: Code) -> None:
    from tests.conformance.conftest import reference_commit

    commit = reference_commit(code.agentic)
    for script, (name, _) in FOLLOWED.items():
        assert get_encoder_spec(name).reference.startswith(
            f"{AGENTIC_REPO}@{commit} ReasonEmbed/evaluation_r2med/{script}"), name
