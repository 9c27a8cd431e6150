"""DIVER-Retriever-4B's entries against DIVER's own code: ``Qwen3EmbeddingModel`` of AQ-MedAI/Diver
``Retriever/retrievers.py`` (the class ``retrieval_qwen3_ft_diver`` runs), imported from two pinned
copies, each against its entry:

- ``diver-4b``: the class as it stood when DIVER's and GroupRank's numbers were made, from its first
  commit until commit 95b111b "fix retriever" (the copy ``older/AQ-MedAI+Diver@d067dff107fc``,
  named explicitly: the lookup of the newest copy by prefix never takes it): ``embed_queries``
  builds the instructed strings and embeds the raw queries;
- ``diver-4b-instructed``: the class since that commit (the newest copy), which embeds the
  instructed strings.

vLLM is replaced by a stand-in that records the strings handed to ``LLM.embed`` and the engine's
arguments (vLLM itself is not needed to build them); the tokenizer that vLLM's ``get_tokenizer``
would load is the real tokenizer of a tiny stand-in model folder. The strings the authors' methods
give the model are compared byte for byte with the project's, on the ``sample`` task and hostile
texts, at DIVER's 16,384 tokens and at a small limit that cuts most texts; then the token ids the
model sees; then the pooling: the authors' engine pools as the model does (``task="embed"``, no
pooler of its own), which DIVER's README writes out (``last_token_pool``, ``F.normalize``); that
function, run from the README, pools a tiny Qwen3's states into the project's vectors, and the
project's vLLM engine is asked for that pooling.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from r2med_agent.retrieval.dense.instructions import instruction_prefixes
from r2med_agent.retrieval.dense.spec import get_encoder_spec
from tests.conformance.conftest import (
    load_reference_module,
    older_reference_repo,
    reference_commit,
    reference_repo,
    stub,
)
from tests.conformance.embedder_inputs import (
    LONG_TEXT,
    docs,
    project_doc_strings,
    project_token_ids,
    queries,
    sample_task,
    tokenizer_corpus,
)
from tests.tiny_embedders import TOKENIZER_STYLES, byte_bpe_tokenizer, tiny_model

REPO = "AQ-MedAI/Diver"
FILE = "Retriever/retrievers.py"
BEFORE_FIX = "d067dff107fc"
"""The pinned copy of DIVER's retriever before commit 95b111b (2026-01-21), under ``older/``."""
ENTRIES = ("diver-4b", "diver-4b-instructed")
"""Each entry with the copy of DIVER's code it follows: the one before the fix, the newest."""


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


def _copy(entry: str) -> Path:
    return older_reference_repo(REPO, BEFORE_FIX) if entry == "diver-4b" else reference_repo(REPO)


def _load(folder: Path) -> types.ModuleType:
    import importlib.util

    stubs = {
        "vllm": stub("vllm", LLM=_RecordingLLM),
        "vllm.transformers_utils": stub("vllm.transformers_utils"),
        "vllm.transformers_utils.tokenizer": stub("vllm.transformers_utils.tokenizer", get_tokenizer=_get_tokenizer),
    }
    if importlib.util.find_spec("torchmetrics") is None:  # imported for a function these cases do not run
        stubs.update({name: stub(name) for name in
                      ("torchmetrics", "torchmetrics.functional", "torchmetrics.functional.pairwise")})
    return load_reference_module(folder, FILE, stubs=stubs)


@pytest.fixture(scope="module", params=ENTRIES)
def case(request: pytest.FixtureRequest) -> types.SimpleNamespace:
    """An entry, the copy of DIVER's code it follows and that copy's module."""
    folder = _copy(request.param)
    return types.SimpleNamespace(entry=request.param, folder=folder, diver=_load(folder))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-Embedding-style tokenizer (no BOS, <|endoftext|> appended) saved as a model folder."""
    folder = tmp_path_factory.mktemp("tiny-diver-tokenizer")
    byte_bpe_tokenizer(tokenizer_corpus(), **TOKENIZER_STYLES["qwen3"]).save_pretrained(folder)
    return folder


def test_the_older_copy_is_named_never_found_by_prefix() -> None:
    newest, older = reference_repo(REPO), older_reference_repo(REPO, BEFORE_FIX)
    assert reference_commit(newest) != BEFORE_FIX and older.parent.name == "older"
    assert newest.parent == older.parent.parent  # the prefix lookup reads the copies' folder alone


def test_each_entry_names_the_commit_of_its_copy(case: types.SimpleNamespace) -> None:
    assert f"{REPO}@{reference_commit(case.folder)} {FILE}" in get_encoder_spec(case.entry).reference


def test_queries_are_raw_before_the_fix_and_instructed_after(case: types.SimpleNamespace, tiny_folder: Path) -> None:
    # What tells the two copies apart, read from the authors' method itself.
    authors = case.diver.Qwen3EmbeddingModel(str(tiny_folder))
    authors.embed_queries(["what causes fever?"])
    (sent,) = authors.model.received
    raw = case.entry == "diver-4b"
    assert (sent == "what causes fever?") == raw
    assert sent.startswith("Instruct: Given a web search query") != raw


def test_limit_and_engine_are_divers(case: types.SimpleNamespace, tiny_folder: Path) -> None:
    spec = get_encoder_spec(case.entry)
    diver = case.diver
    default = inspect.signature(diver.Qwen3EmbeddingModel.__init__).parameters["max_length"].default
    # retrieval_qwen3_ft_diver builds the model with max_length=16384 (the class default too).
    tree = ast.parse(inspect.getsource(diver.retrieval_qwen3_ft_diver))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Qwen3EmbeddingModel"]
    (call,) = calls
    (given,) = [k.value.value for k in call.keywords if k.arg == "max_length"]
    assert spec.max_length == given == default == 16384 and spec.query_max_length is None
    model = diver.Qwen3EmbeddingModel(str(tiny_folder))
    assert model.max_length == spec.max_length
    assert spec.truncation == "decoded-text" and spec.precision == "auto"


@pytest.mark.parametrize("limit", [16384, 64])
@pytest.mark.parametrize("task_name", ["sample", "PMC-Clinical"])
def test_query_and_document_strings_are_divers(case: types.SimpleNamespace, tiny_folder: Path, limit: int,
                                                task_name: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_folder)
    authors = case.diver.Qwen3EmbeddingModel(str(tiny_folder), max_length=limit)
    qs, ds = queries(), docs()
    authors.embed_queries(qs)
    their_queries = list(authors.model.received)
    authors.model.received.clear()
    authors.embed_docs([d.text for d in ds])
    their_docs = list(authors.model.received)

    spec = dataclasses.replace(get_encoder_spec(case.entry), max_length=limit)
    task = sample_task()
    prefixes = instruction_prefixes(spec, task_name, task.family, task.domain)
    our_query_inputs = [prefixes.query + q for q in qs]
    our_doc_inputs = project_doc_strings(spec, prefixes.doc, ds)
    assert len(their_docs) == len(ds) and their_docs[-1] != LONG_TEXT  # the 20,000-word text was cut
    cut = sum(s != t for s, t in zip(their_docs, [d.text for d in ds]))
    assert cut >= (len(ds) // 2 if limit == 64 else 1)
    assert their_queries[-1] != LONG_TEXT  # the 20,000-word query was cut too

    # The ids the model sees: vLLM's embed tokenizes each of the authors' strings with the
    # tokenizer's own special tokens, whole; the project's backends make theirs from prefix + text.
    for side, inputs, theirs in (("query", our_query_inputs, their_queries), ("doc", our_doc_inputs, their_docs)):
        assert project_token_ids(spec, tiny_folder, inputs, side) == [tok(s)["input_ids"] for s in theirs], side

    # And the strings themselves, byte for byte: the project's cut of prefix + text.
    from r2med_agent.retrieval.dense.tokens import decoded_text_cut

    assert decoded_text_cut(tok, our_query_inputs, limit) == their_queries
    assert decoded_text_cut(tok, our_doc_inputs, limit) == their_docs


# --------------------------------------------------------------------------- pooling


def _readme_pooling(folder: Path) -> types.SimpleNamespace:
    """DIVER's README, read from the copy: its vLLM example builds ``LLM(..., task="embed")`` and
    scores with the embeddings as they come; its transformers example pools with its own
    ``last_token_pool`` and ``F.normalize`` (that function, compiled from the README's text)."""
    text = (folder / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    (usage,) = [b for b in blocks if "def last_token_pool" in b]
    tree = ast.parse(usage)
    (pool,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "last_token_pool"]
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    (vllm_example,) = [b for b in blocks if "LLM(model=" in b]
    engine = re.search(r"LLM\((.*?)\)", vllm_example).group(1)
    import torch

    namespace: dict = {"torch": torch, "Tensor": torch.Tensor}
    exec(compile(ast.Module(body=[pool], type_ignores=[]), str(folder / "README.md"), "exec"), namespace)  # noqa: S102
    return types.SimpleNamespace(last_token_pool=namespace["last_token_pool"], normalizes="F.normalize" in calls,
                                 engine=engine)


def test_the_model_pools_as_divers_readme_and_the_engine_is_asked_for_that(
        case: types.SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from r2med_agent.retrieval.dense.hf import HFEncoder
    from r2med_agent.retrieval.dense.vllm import VLLMEncoder

    # The authors' engine: vLLM's embedding runner with no pooler of its own, so the model's own
    # pooling, which the README writes out for transformers.
    readme = _readme_pooling(case.folder)
    assert 'task="embed"' in readme.engine and "pool" not in readme.engine
    folder = tmp_path / "tiny-diver"
    model, tok = tiny_model("qwen3", folder, byte_bpe_tokenizer(tokenizer_corpus(), **TOKENIZER_STYLES["qwen3"]),
                            positions=1024)
    authors = case.diver.Qwen3EmbeddingModel(str(folder), max_length=64)
    assert authors.model.kwargs["task"] == "embed"
    assert not {"override_pooler_config", "pooler_config"} & set(authors.model.kwargs)
    assert readme.normalizes

    # The README's pooling of the tiny model's states, one string at a time as vLLM embeds them,
    # is the project's vector for the same text.
    qs, ds = queries()[:4] + [queries()[-1]], [d.text for d in docs()[:4]]
    authors.embed_queries(qs)
    authors.embed_docs(ds)
    theirs = []
    for string in authors.model.received:
        batch = tok([string], return_tensors="pt")
        with torch.inference_mode():
            states = model(**batch).last_hidden_state
        theirs.append(torch.nn.functional.normalize(readme.last_token_pool(states, batch["attention_mask"]), p=2, dim=1)[0])
    spec = dataclasses.replace(get_encoder_spec(case.entry), model=str(folder), max_length=64, backend="transformers")
    prefixes = instruction_prefixes(spec, "sample", "", "")
    enc = HFEncoder(spec, device="cpu")
    ours = np.concatenate([enc.encode(qs, side="query", prefix=prefixes.query),
                           enc.encode(ds, side="doc", prefix=prefixes.doc)])
    np.testing.assert_allclose(ours, torch.stack(theirs).numpy(), atol=1e-5)

    # The project's vLLM engine (a stand-in records what it is asked for): that pooling, the
    # activation left to the encoder, which normalises as the README does.
    asked: list[dict] = []

    class _Engine:
        def __init__(self, **kwargs) -> None:
            asked.append(kwargs)

        def embed(self, prompts, **kwargs):
            return [types.SimpleNamespace(outputs=types.SimpleNamespace(embedding=[3.0, 4.0])) for _ in prompts]

    class _PoolerConfig:
        def __init__(self, **kwargs) -> None:
            self.__dict__.update(kwargs)

    vllm = stub("vllm", LLM=_Engine, PoolingParams=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.config", stub("vllm.config", PoolerConfig=_PoolerConfig))
    monkeypatch.setitem(sys.modules, "vllm.inputs", stub("vllm.inputs", TokensPrompt=lambda **kw: kw))
    monkeypatch.setattr("r2med_agent.retrieval.dense.vllm.vllm_installed", lambda: True)
    monkeypatch.setattr("r2med_agent.retrieval.dense.vllm._ENGINES", {})  # the stand-in stays out of the real ones
    got = VLLMEncoder(dataclasses.replace(spec, backend="vllm"), device="cpu").encode(qs[:2], side="query",
                                                                                      prefix=prefixes.query)
    (kwargs,) = asked
    assert kwargs["runner"] == "pooling" and "task" not in kwargs
    pooler = kwargs["pooler_config"]
    assert (pooler.pooling_type, pooler.use_activation) == ("LAST", False)
    np.testing.assert_allclose(got, [[0.6, 0.8]] * 2)
