"""ReasonIR-8B's two entries against the authors' own code.

``reasonir-8b`` is ReasonIR as ReasonEmbed ran it on R2MED: their ``ReasonIREncoder``
(``reasonir_models.py``, built by ``R2MEDEvalRunner.get_models`` from ``eval_reasonir_8b.sh``)
over a real ``SentenceTransformer``, which pools as the model folder's sentence-transformers
config says and, without one, as sentence-transformers does by default: every token, the prompt
included. That ReasonIR-8B's own config includes the prompt is inferred, not read
(docs/protocol.md). ``reasonir-8b-prompt-excluded`` pools as ReasonIR's own modelling code
(``ReasonIRModel.encode`` in facebookresearch/ReasonIR ``training/modeling_llama.py``): the
instruction's tokens, BOS included, left out of the mean.

Both run on a tiny random Llama (ReasonIR-8B is a Llama 3.1) with a Llama-3-style tokenizer. The
bidirectional attention of ReasonIR's model code is not what these cases check: the authors'
``encode`` is called with a stand-in ``self`` whose forward pass is the tiny model's, the same one
the project's encoder runs.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from r2med_agent.retrieval.dense.hf import HFEncoder
from r2med_agent.retrieval.dense.spec import get_encoder_spec
from tests.conformance.conftest import load_reference_module, reference_repo
from tests.conformance.embedder_inputs import (
    docs,
    project_doc_strings,
    project_token_ids,
    queries,
    task_prefixes,
    tokenizer_corpus,
)
from tests.conformance.reasonembed_code import Code, RecordingTokenizer, scripts
from tests.tiny_embedders import TOKENIZER_STYLES, byte_bpe_tokenizer, tiny_model

TASK = "MedQA-Diag"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The runner picks ReasonIR's encoder by "ReasonIR-8B" in the model's path.
    path = tmp_path_factory.mktemp("tiny") / "ReasonIR-8B"
    tiny_model("llama", path, byte_bpe_tokenizer(tokenizer_corpus(), **TOKENIZER_STYLES["llama"]), positions=1024)
    return path


class _RecordingPool:
    """ReasonIR's ``MultiGPUModel`` run in this process: each ``encode`` call's texts and
    arguments are kept, and the same ``SentenceTransformer`` encodes them."""

    calls: list[dict[str, Any]] = []

    def __init__(self, model: Any) -> None:
        self.model = model

    def encode(self, sentences: Any, **kwargs: Any) -> Any:
        self.calls.append({"sentences": list(sentences), "max_seq_length": self.model.max_seq_length, **kwargs})
        return self.model.encode(sentences, **kwargs)


def test_reasonembeds_reasonir_run(folder: Path) -> None:
    code = Code()
    _, model_args = code.args(scripts(code.agentic)["scripts/baselines/eval_reasonir_8b.sh"])
    spec = dataclasses.replace(get_encoder_spec("reasonir-8b"), model=str(folder), trust_remote_code=False)
    assert model_args.embedder_name_or_path == get_encoder_spec("reasonir-8b").model
    assert spec.max_length == model_args.embedder_query_max_length == model_args.embedder_passage_max_length
    assert model_args.trust_remote_code and get_encoder_spec("reasonir-8b").trust_remote_code
    assert spec.normalize == model_args.normalize_embeddings is True
    assert (spec.pooling, spec.pool_exclude_prefix) == ("mean", False)

    code.runner.ReasonIREncoder.__init__.__globals__["MultiGPUModel"] = _RecordingPool
    _RecordingPool.calls.clear()
    embedder, _ = code.runner.R2MEDEvalRunner.get_models(
        dataclasses.replace(model_args, embedder_name_or_path=str(folder)))
    assert type(embedder).__name__ == "ReasonIREncoder"
    embedder.query_instruction_for_retrieval = code.instructions[TASK]  # as R2MEDEvalRunner.run sets it
    qs, ds = queries(), docs()
    their_q = embedder.encode_queries(qs)
    their_d = embedder.encode_corpus([d.text for d in ds])
    q_call, d_call = _RecordingPool.calls
    assert q_call["sentences"] == qs and d_call["sentences"] == [d.text for d in ds]
    assert q_call["max_seq_length"] == d_call["max_seq_length"] == spec.max_length
    assert q_call["normalize_embeddings"] is d_call["normalize_embeddings"] is True

    prefixes = task_prefixes(spec, TASK)
    assert (prefixes.query, prefixes.doc) == (q_call["prompt"], d_call["prompt"])  # sentence-transformers: prompt + text
    assert project_doc_strings(spec, prefixes.doc, ds) == [d_call["prompt"] + d.text for d in ds]
    st = embedder.model.model
    for side, texts, prompt in (("query", qs, q_call["prompt"]), ("doc", [d.text for d in ds], d_call["prompt"])):
        strings = [prompt + t for t in texts]
        batch = st.tokenize(strings)
        theirs = [[int(t) for t, m in zip(ids, mask) if m] for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
        assert theirs == project_token_ids(spec, folder, strings, side), side
        assert max(len(x) for x in theirs) == spec.max_length  # the 20,000-word text was cut

    ours = HFEncoder(dataclasses.replace(spec, batch_size=8), device="cpu")
    np.testing.assert_allclose(ours.encode(qs, side="query", prefix=prefixes.query), their_q, atol=2e-5)
    np.testing.assert_allclose(ours.encode([d.text for d in ds], side="doc", prefix=prefixes.doc), their_d, atol=2e-5)


class _Self:
    """What ``ReasonIRModel.encode`` reads from ``self``, with the tiny model's forward pass (the
    ``is_causal`` flag it passes belongs to ReasonIR's own attention code)."""

    def __init__(self, model: Any, tokenizer: Any, pooling: Any) -> None:
        self.model, self.tokenizer, self.device = model, tokenizer, "cpu"
        self.pooling_method, self.normalized, self.embed_eos = "mean", True, ""
        self.pooling = functools.partial(pooling, self)

    def eval(self) -> None:
        self.model.eval()

    def __call__(self, is_causal: bool = True, **inputs: Any) -> Any:
        return self.model(**inputs)


def test_reasonirs_own_encode(folder: Path) -> None:
    import transformers

    modeling = load_reference_module(reference_repo("facebookresearch/ReasonIR"), "training/modeling_llama.py")
    cls = modeling.ReasonIRModel
    # As ReasonIRModel.__init__ loads it: right padding.
    recorder = RecordingTokenizer(transformers.AutoTokenizer.from_pretrained(folder, padding_side="right"))
    fake = _Self(transformers.AutoModel.from_pretrained(folder), recorder, cls.pooling)
    spec = dataclasses.replace(get_encoder_spec("reasonir-8b-prompt-excluded"), model=str(folder),
                               trust_remote_code=False, batch_size=8)
    assert (spec.pooling, spec.pool_exclude_prefix, spec.normalize) == ("mean", True, True)
    prefixes = task_prefixes(spec, TASK)
    ours = HFEncoder(spec, device="cpu")
    qs, ds = queries(), [d.text for d in docs()]
    for side, texts, prefix in (("query", qs, prefixes.query), ("doc", ds, prefixes.doc)):
        recorder.texts.clear()
        recorder.ids.clear()
        recorder.singles.clear()
        theirs = cls.encode(fake, texts, batch_size=8, max_length=spec.max_length, instruction=prefix)
        strings = [prefix + t for t in texts]
        assert recorder.texts == strings, side  # instruction + text + embed_eos ("")
        assert set(recorder.singles) == {prefix}  # the instruction measured alone, BOS included, for the mask
        assert recorder.ids == project_token_ids(spec, folder, strings, side), side
        mine = ours.encode(texts, side=side, prefix=prefix)
        # A text with no token after the instruction (the empty query or document) leaves nothing
        # to average: ReasonIR's encode divides 0 by 0 (NaN), the project returns a zero vector
        # (cosine 0 with every document). Every other text: the same vector.
        finite = np.isfinite(theirs).all(axis=1)
        n_prompt = len(recorder.inner(prefix)["input_ids"])
        assert [len(recorder.ids[i]) for i in np.flatnonzero(~finite)] == [n_prompt] * int((~finite).sum())
        assert (~finite).sum() == 1 and not mine[~finite].any()  # the empty text
        np.testing.assert_allclose(mine[finite], theirs[finite], atol=2e-5, err_msg=side)
