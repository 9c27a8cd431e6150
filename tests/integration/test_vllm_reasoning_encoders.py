"""The reasoning retrievers of ``configs/encoders.yaml`` on vLLM's pooling engine: which entries it
runs, what ``auto`` picks and why not for the others (no engine), and (tier ``-m vllm``) the same
vectors as the transformers backend on tiny random models of each architecture class the entries
use: Qwen3 (ReasonEmbed-Qwen3, DIVER in both its settings, Qwen3-Embedding), Llama
(ReasonEmbed-Llama) and Qwen2 (RaDeR's class; its entry stays on transformers, see below). The
models and their byte-level tokenizers come from ``tests/tiny_embedders.py`` (through
``tests/unit/retrieval/test_reasoning_encoders.py``, which checks the same pipelines against
FlagEmbedding's recipe, DIVER's and sentence-transformers on transformers).
One engine at a time: the entries of one architecture share one model folder and so one engine,
shut down at the end of the test.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from r2med_agent.errors import ConfigError
from r2med_agent.retrieval.dense import vllm as dense_vllm
from r2med_agent.retrieval.dense.factory import make_encoder
from r2med_agent.retrieval.dense.hf import HFEncoder
from r2med_agent.retrieval.dense.spec import EncoderOptions, get_encoder_spec
from r2med_agent.retrieval.dense.vllm import VLLMEncoder, resolve_backend, vllm_unsupported_reason
from tests.unit.retrieval.test_reasoning_encoders import (
    DIVER_DOC,
    DIVER_QUERY,
    DOCS,
    FLAG_FORMAT,
    LAST_TOKEN_ENTRIES,
    MAX_LENGTH,
    QUERIES,
    REASONEMBED_R2MED,
    TOKENIZER_STYLES,
    _byte_bpe_tokenizer,
    _diver_cut,
    _prefixes,
    _tiny_model,
)

ON_VLLM = sorted(n for n, (_, _, backend) in LAST_TOKEN_ENTRIES.items() if backend == "auto")
ON_TRANSFORMERS = ("rader-7b", "reasonir-8b", "reasonir-8b-prompt-excluded")


# ------------------------------------------------------------------------------------------
# which backend (no engine)


def test_auto_picks_vllm_on_a_gpu_for_the_last_token_reasoning_entries(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert len(ON_VLLM) == 6 and set(ON_VLLM).isdisjoint(ON_TRANSFORMERS)
    monkeypatch.setattr(dense_vllm, "vllm_installed", lambda: True)
    monkeypatch.setattr(dense_vllm, "_gpu_count", lambda: 1)
    with caplog.at_level(logging.INFO, logger="r2med_agent.retrieval.dense.vllm"):
        for name in ON_VLLM:
            spec = get_encoder_spec(name)
            assert spec.backend == "auto" and vllm_unsupported_reason(spec) is None, name
            assert resolve_backend(spec) == "vllm", name
            assert resolve_backend(spec, device="cpu") == "transformers", name
        for name in ON_TRANSFORMERS:
            spec = get_encoder_spec(name)
            assert spec.backend == "transformers"
            assert resolve_backend(spec, "auto") == "transformers", name
            with pytest.raises(ConfigError, match=f"encoder '{name}' cannot run on vLLM"):
                resolve_backend(spec, "vllm")
    assert "encoder reasonembed-qwen3-8b: backend vllm (auto:" in caplog.text
    assert "encoder rader-7b: backend transformers (auto: vLLM cannot express it: it runs its repository's own" in caplog.text


def test_reasonir_names_both_things_vllm_cannot_reproduce() -> None:
    # Mean pooling without the instruction tokens, and its own (bidirectional) model code: the
    # reason lists every cause, not only the first.
    reason = str(vllm_unsupported_reason(get_encoder_spec("reasonir-8b-prompt-excluded")))
    assert "instruction tokens" in reason and "own modelling code" in reason, reason
    reason = str(vllm_unsupported_reason(get_encoder_spec("reasonir-8b")))  # ReasonEmbed's run pools every token
    assert "instruction tokens" not in reason and "own modelling code" in reason, reason
    rader = str(vllm_unsupported_reason(get_encoder_spec("rader-7b")))
    assert "own modelling code" in rader and "instruction tokens" not in rader, rader
    grit = str(vllm_unsupported_reason(get_encoder_spec("grit")))
    assert grit.startswith("its mean pooling leaves the instruction tokens out")
    assert "is_causal" in grit and "own modelling code" in grit, grit


# ------------------------------------------------------------------------------------------
# real vLLM CPU engine


# architecture class -> the registry entries whose pipeline its tiny model stands in for
ARCH_ENTRIES = {
    arch: sorted(n for n, (_, a, _) in LAST_TOKEN_ENTRIES.items() if a == arch)
    for arch in ("qwen3", "llama", "qwen2")
}


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("arch", sorted(ARCH_ENTRIES))
def test_reasoning_entries_same_vectors_on_vllm(arch: str, tmp_path: Path, one_engine: None) -> None:
    # 32-wide heads: vLLM's CPU attention takes no smaller head size.
    folder = tmp_path / f"tiny-{arch}"
    _, tok = _tiny_model(arch, folder, _byte_bpe_tokenizer(**TOKENIZER_STYLES[arch]), head_dim=32)
    instruction = REASONEMBED_R2MED["PMC-Clinical"]
    assert ARCH_ENTRIES[arch], arch
    for name in ARCH_ENTRIES[arch]:
        spec = dataclasses.replace(get_encoder_spec(name), model=str(folder), max_length=MAX_LENGTH, batch_size=2)
        if name == "rader-7b":
            # RaDeR's entry stays on transformers for its repository's own code (a gte-Qwen2
            # fine-tune); without it, the architecture class and every other setting run on vLLM.
            assert vllm_unsupported_reason(spec) is not None
            spec = dataclasses.replace(spec, trust_remote_code=False)
        prefixes = _prefixes(spec, "nano-PMC-Clinical")
        vl = make_encoder(spec, EncoderOptions(device="cpu", backend="vllm", show_progress=False))
        assert isinstance(vl, VLLMEncoder) and vl.precision() == "float32"

        # The instruction format as the authors' scripts write it, cut on the right at MAX_LENGTH.
        ids = vl.token_ids(QUERIES, side="query", prefix=prefixes.query)
        want = [tok(FLAG_FORMAT.format(instruction, q), truncation=True, max_length=MAX_LENGTH)["input_ids"]
                for q in QUERIES]
        assert ids == want, name
        assert len(ids[2]) == MAX_LENGTH

        hf = HFEncoder(spec, device="cpu")
        for side, texts, prefix in (("query", QUERIES, prefixes.query), ("doc", DOCS, prefixes.doc)):
            a = hf.encode(texts, side=side, prefix=prefix)
            b = vl.encode(texts, side=side, prefix=prefix)
            assert a.shape == b.shape == (len(texts), 64), (name, side)
            np.testing.assert_allclose(np.linalg.norm(b, axis=1), 1.0, atol=1e-5)  # normalize: true
            np.testing.assert_allclose(a, b, atol=1e-4, err_msg=f"{name} {side}")
            assert not np.allclose(b[0], b[1], atol=1e-3)  # the texts give different vectors


@pytest.mark.slow
@pytest.mark.vllm
def test_diver_same_tokens_and_vectors_on_vllm(tmp_path: Path, one_engine: None) -> None:
    # DIVER's own code (its instructed queries, diver-4b-instructed: the longer strings; diver-4b
    # differs only in leaving queries raw): the engine gets the decoded-text cut's tokens (with
    # the tokenizer's appended EOS) and a context of max_length plus the slack they may need.
    from r2med_agent.retrieval.dense.tokens import DECODED_TEXT_SLACK

    folder = tmp_path / "tiny-diver"
    _, tok = _tiny_model("qwen3", folder, _byte_bpe_tokenizer(**TOKENIZER_STYLES["qwen3"]), head_dim=32)
    spec = dataclasses.replace(get_encoder_spec("diver-4b-instructed"), model=str(folder), max_length=MAX_LENGTH,
                               batch_size=2)
    assert resolve_backend(spec, "vllm") == "vllm"
    prefixes = _prefixes(spec, "nano-PMC-Clinical")
    vl = make_encoder(spec, EncoderOptions(device="cpu", backend="vllm", show_progress=False))
    assert isinstance(vl, VLLMEncoder) and vl.engine_kwargs(spec.model)["max_model_len"] == MAX_LENGTH + DECODED_TEXT_SLACK
    ids = vl.token_ids(QUERIES, side="query", prefix=prefixes.query)
    assert ids == [tok(_diver_cut(tok, DIVER_QUERY["diver-4b-instructed"].format(q), MAX_LENGTH))["input_ids"] for q in QUERIES]
    assert len(ids[2]) > MAX_LENGTH  # cut by decoding, then the tokenizer's EOS on top
    assert vl.token_ids(DOCS, side="doc", prefix=prefixes.doc) == [
        tok(_diver_cut(tok, DIVER_DOC.format(d), MAX_LENGTH))["input_ids"] for d in DOCS]
    hf = HFEncoder(spec, device="cpu")
    for side, texts, prefix in (("query", QUERIES, prefixes.query), ("doc", DOCS, prefixes.doc)):
        a = hf.encode(texts, side=side, prefix=prefix)
        b = vl.encode(texts, side=side, prefix=prefix)
        np.testing.assert_allclose(a, b, atol=1e-4, err_msg=side)
