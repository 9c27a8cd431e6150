"""Qwen3-Embedding's own evaluation code (QwenLM/Qwen3-Embedding ``evaluation/``) against the
project's Qwen3 entries.

- Its instruction template (``run_mteb.sh``: ``"Instruct: {}\\nQuery:"``, through
  ``Qwen3Embedding.format_instruction``) with DIVER's one instruction is ``diver-4b-instructed``'s
  query prefix (DIVER's code since its commit 95b111b; ``diver-4b`` embeds raw queries, as that code
  did before): DIVER-Retriever-4B (fine-tuned from Qwen3-Embedding-4B) keeps its base model's format,
  no space after ``Query:``. The ``qwen3-embedding-*`` entries follow ReasonEmbed's runs, whose
  published numbers they stand beside: the same template plus a space (checked here exactly).
- Its ``TransformersTextEmbedder`` (left padding, the tokenizer's own truncation with its appended
  EOS kept, last token, L2) on a tiny random Qwen3 gives the token ids and vectors of the project's
  ``qwen3-embedding-4b`` pipeline for the same strings.

``mteb`` is stubbed (the wrapper's base classes; not installed here).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import types
from pathlib import Path

import numpy as np
import pytest

from r2med_agent.retrieval.dense.hf import HFEncoder
from r2med_agent.retrieval.dense.spec import get_encoder_spec
from tests.conformance.conftest import load_reference_module, reference_repo, stub
from tests.conformance.embedder_inputs import (
    docs,
    project_doc_strings,
    project_token_ids,
    queries,
    task_prefixes,
    tokenizer_corpus,
)
from tests.conformance.reasonembed_code import RecordingTokenizer
from tests.tiny_embedders import TOKENIZER_STYLES, byte_bpe_tokenizer, tiny_model

REPO = "QwenLM/Qwen3-Embedding"
DIVER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
"""The one task of DIVER's Qwen3EmbeddingModel (AQ-MedAI/Diver Retriever/retrievers.py, its
``self.task``; tests/conformance/test_embed_diver.py compares the whole strings)."""


@pytest.fixture(scope="module")
def qwen() -> types.SimpleNamespace:
    folder = reference_repo(REPO)
    mteb = {name: stub(name) for name in ("mteb", "mteb.encoder_interface", "mteb.models", "mteb.models.wrapper",
                                          "mteb.model_meta")}
    module = load_reference_module(folder, "evaluation/qwen3_embedding_model.py", stubs=mteb)
    # run_mteb.sh: python run_mteb.py ... --model_kwargs "<JSON>" (the JSON in double quotes).
    script = (folder / "evaluation/run_mteb.sh").read_text(encoding="utf-8")
    args = shlex.split(re.search(r"python run_mteb\.py(.*?)(?:\n\s*#|\Z)", script, re.S).group(1).replace("\\\n", " "))
    kwargs = json.loads(args[args.index("--model_kwargs") + 1])
    return types.SimpleNamespace(module=module, kwargs=kwargs)


def test_divers_query_format_is_qwen3_embeddings_template(qwen: types.SimpleNamespace) -> None:
    template = qwen.kwargs["instruction_template"]
    assert template == "Instruct: {}\nQuery:"
    wrapper = object.__new__(qwen.module.Qwen3Embedding)
    wrapper.instruction_template = template
    own = wrapper.format_instruction(DIVER_INSTRUCTION, "query")
    assert get_encoder_spec("diver-4b-instructed").query_prefix == own
    # ReasonEmbed's runs of Qwen3-Embedding: the template with a space after "Query:".
    for name in ("qwen3-embedding-8b", "qwen3-embedding-4b"):
        spec = get_encoder_spec(name)
        for task, instruction in spec.query_instructions.items():
            assert task_prefixes(spec, task).query == wrapper.format_instruction(instruction, "query") + " "
    assert (qwen.kwargs["pooler_type"], qwen.kwargs["do_norm"]) == ("last", True)


def test_transformers_text_embedder_gives_the_entrys_tokens_and_vectors(qwen: types.SimpleNamespace,
                                                                        tmp_path: Path) -> None:
    folder = tmp_path / "tiny-qwen3"
    tiny_model("qwen3", folder, byte_bpe_tokenizer(tokenizer_corpus(), **TOKENIZER_STYLES["qwen3"]), positions=1024)
    theirs = qwen.module.TransformersTextEmbedder(str(folder), pooler_type="last", do_norm=True)
    assert theirs.tokenizer.padding_side == "left"
    recorder = theirs.tokenizer = RecordingTokenizer(theirs.tokenizer)
    spec = dataclasses.replace(get_encoder_spec("qwen3-embedding-4b"), model=str(folder), batch_size=8)
    prefixes = task_prefixes(spec, "PMC-Treatment")
    ours = HFEncoder(spec, device="cpu")
    qs, corpus = queries(), docs()
    ds = [d.text for d in corpus]
    assert project_doc_strings(spec, prefixes.doc, corpus) == ds  # no document instruction, as Qwen's retrieval
    for side, texts, prompt in (("query", qs, prefixes.query), ("doc", ds, prefixes.doc)):
        recorder.texts.clear()
        recorder.ids.clear()
        import torch

        with torch.inference_mode():
            vectors = theirs.embed(texts, spec.max_length, prompt or None).numpy()
        strings = [prompt + t for t in texts]
        assert recorder.texts == strings, side
        assert recorder.ids == project_token_ids(spec, folder, strings, side), side
        assert max(len(x) for x in recorder.ids) == spec.max_length and all(x[-1] == recorder.eos_token_id
                                                                             for x in recorder.ids)
        np.testing.assert_allclose(ours.encode(texts, side=side, prefix=prompt), vectors, atol=2e-5, err_msg=side)
