"""``diver-4b`` against DIVER's own code: ``Qwen3EmbeddingModel`` of AQ-MedAI/Diver
``Retriever/retrievers.py`` (the class ``retrieval_qwen3_ft_diver`` runs), imported from the pinned
copy. vLLM is replaced by a stand-in that records the strings handed to ``LLM.embed`` (vLLM itself
is not needed to build them); the tokenizer that vLLM's ``get_tokenizer`` would load is the real
tokenizer of a tiny stand-in model folder. The strings the authors' methods give the model are
compared byte for byte with the project's, on the ``sample`` task and hostile texts, at DIVER's
16,384 tokens and at a small limit that cuts most texts; then the token ids the model sees.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import types
from pathlib import Path

import pytest

from r2med_agent.retrieval.dense.instructions import instruction_prefixes
from r2med_agent.retrieval.dense.spec import get_encoder_spec
from tests.conformance.conftest import load_reference_module, reference_repo, stub
from tests.conformance.embedder_inputs import (
    LONG_TEXT,
    docs,
    project_doc_strings,
    project_token_ids,
    queries,
    sample_task,
    tokenizer_corpus,
)
from tests.tiny_embedders import TOKENIZER_STYLES, byte_bpe_tokenizer

REPO = "AQ-MedAI/Diver"
FILE = "Retriever/retrievers.py"


class _RecordingLLM:
    """Stands in for ``vllm.LLM``: keeps its arguments and every text given to ``embed``."""

    def __init__(self, model: str, **kwargs) -> None:
        self.model, self.kwargs, self.received = model, kwargs, []

    def embed(self, texts):
        texts = [texts] if isinstance(texts, str) else list(texts)
        self.received.extend(texts)
        return [types.SimpleNamespace(outputs=types.SimpleNamespace(embedding=[0.0])) for _ in texts]


def _get_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


@pytest.fixture(scope="module")
def diver() -> types.ModuleType:
    import importlib.util

    stubs = {
        "vllm": stub("vllm", LLM=_RecordingLLM),
        "vllm.transformers_utils": stub("vllm.transformers_utils"),
        "vllm.transformers_utils.tokenizer": stub("vllm.transformers_utils.tokenizer", get_tokenizer=_get_tokenizer),
    }
    if importlib.util.find_spec("torchmetrics") is None:  # imported for a function these cases do not run
        stubs.update({name: stub(name) for name in
                      ("torchmetrics", "torchmetrics.functional", "torchmetrics.functional.pairwise")})
    return load_reference_module(reference_repo(REPO), FILE, stubs=stubs)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-Embedding-style tokenizer (no BOS, <|endoftext|> appended) saved as a model folder."""
    folder = tmp_path_factory.mktemp("tiny-diver-tokenizer")
    byte_bpe_tokenizer(tokenizer_corpus(), **TOKENIZER_STYLES["qwen3"]).save_pretrained(folder)
    return folder


def test_limit_and_engine_are_divers(diver: types.ModuleType, tiny_folder: Path) -> None:
    spec = get_encoder_spec("diver-4b")
    default = inspect.signature(diver.Qwen3EmbeddingModel.__init__).parameters["max_length"].default
    # retrieval_qwen3_ft_diver builds the model with max_length=16384 (the class default too).
    tree = ast.parse(inspect.getsource(diver.retrieval_qwen3_ft_diver))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Qwen3EmbeddingModel"]
    (call,) = calls
    (given,) = [k.value.value for k in call.keywords if k.arg == "max_length"]
    assert spec.max_length == given == default == 16384 and spec.query_max_length is None
    model = diver.Qwen3EmbeddingModel(str(tiny_folder))
    assert model.max_length == spec.max_length
    assert model.model.kwargs["task"] == "embed"  # vLLM's pooling from the model's own config
    assert (spec.truncation, spec.pooling, spec.normalize, spec.backend) == ("decoded-text", "last-token", True, "auto")


@pytest.mark.parametrize("limit", [16384, 64])
@pytest.mark.parametrize("task_name", ["sample", "PMC-Clinical"])
def test_query_and_document_strings_are_divers(diver: types.ModuleType, tiny_folder: Path, limit: int,
                                                task_name: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_folder)
    authors = diver.Qwen3EmbeddingModel(str(tiny_folder), max_length=limit)
    qs, ds = queries(), docs()
    authors.embed_queries(qs)
    their_queries = list(authors.model.received)
    authors.model.received.clear()
    authors.embed_docs([d.text for d in ds])
    their_docs = list(authors.model.received)

    spec = dataclasses.replace(get_encoder_spec("diver-4b"), max_length=limit)
    task = sample_task()
    prefixes = instruction_prefixes(spec, task_name, task.family, task.domain)
    our_query_inputs = [prefixes.query + q for q in qs]
    our_doc_inputs = project_doc_strings(spec, prefixes.doc, ds)
    assert len(their_docs) == len(ds) and their_docs[-1] != LONG_TEXT  # the 20,000-word text was cut
    cut = sum(s != t for s, t in zip(their_docs, [d.text for d in ds]))
    assert cut >= (len(ds) // 2 if limit == 64 else 1)

    # The ids the model sees: vLLM's embed tokenizes each of the authors' strings with the
    # tokenizer's own special tokens, whole; the project's backends make theirs from prefix + text.
    for side, inputs, theirs in (("query", our_query_inputs, their_queries), ("doc", our_doc_inputs, their_docs)):
        assert project_token_ids(spec, tiny_folder, inputs, side) == [tok(s)["input_ids"] for s in theirs], side

    # And the strings themselves, byte for byte: the project's cut of prefix + text.
    from r2med_agent.retrieval.dense.tokens import decoded_text_cut

    assert decoded_text_cut(tok, our_query_inputs, limit) == their_queries
    assert decoded_text_cut(tok, our_doc_inputs, limit) == their_docs
