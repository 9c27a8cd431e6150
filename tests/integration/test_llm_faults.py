"""LLM backends under faults: malformed 200 replies, ``content: null``, a hung server, an
over-long prompt in a llama.cpp batch, and what ``server: auto`` finds behind a base URL.

Every server here is real: ``llama_cpp.server`` over the SmolLM2 GGUF on loopback with the
fault-injecting :class:`~tests.llm_server.FaultProxy` in front, plain loopback HTTP servers
that answer like the native endpoints of other servers, and vLLM's own server (vllm tier).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from r2med_agent.errors import LLMError
from r2med_agent.llm.registry import make_backend
from r2med_agent.types import SamplingParams
from tests.llm_server import CannedChatServer, FaultProxy, openai_spec

COUNT = [{"role": "user", "content": "Count from 1 to 20, one number per line."}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def _prompts(n: int) -> list[list[dict[str, str]]]:
    """``n`` distinct short prompts."""
    return [[{"role": "user", "content": f"Say the number {i}."}] for i in range(n)]


# ---------------------------------------------------------------- malformed 200 replies


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["truncated", "html", "empty_choices"])
def test_http_malformed_200_reply_is_retried(fault_proxy: FaultProxy, fault: str) -> None:
    backend = make_backend(openai_spec([fault_proxy.base_url]))
    fault_proxy.inject(fault, 1)
    gens = backend.generate([COUNT], GREEDY)
    assert gens[0].text and gens[0].completion_tokens > 0
    assert fault_proxy.outcomes() == [fault, "forwarded"]
    assert backend.attempts == 2


@pytest.mark.slow
def test_http_malformed_replies_that_persist_fail_alone_and_the_good_ones_are_cached(
    fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.llm.cache.wrapper import CachedLLM

    # No retries: the two requests that meet a fault fail for good.
    spec = openai_spec([fault_proxy.base_url], max_concurrency=4, max_retries=0)
    prompts = _prompts(12)
    fault_proxy.inject("truncated", 1)
    fault_proxy.inject("html", 1)

    def wrapper() -> CachedLLM:
        return CachedLLM(make_backend(spec), spec, cache=GenerationCache(tmp_path / "g.sqlite"), chunk_size=None)

    first = wrapper()
    with pytest.raises(LLMError) as err:
        first.generate(prompts, GREEDY)
    message = str(err.value)
    assert "malformed reply" in message and "2 of 12 requests failed, 10 succeeded" in message
    assert "10 generations of that batch were saved to the generation cache" in message
    assert len(first.cache) == 10

    fault_proxy.reset()
    second = wrapper()
    gens = second.generate(prompts, GREEDY)
    assert sum(not g.cached for g in gens) == 2 and all(g.text for g in gens)
    assert fault_proxy.outcomes() == ["forwarded", "forwarded"]


@pytest.mark.slow
def test_http_null_content_is_a_failed_generation_counted_and_never_cached(
    fault_proxy: FaultProxy, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.llm.cache.wrapper import CachedLLM

    spec = openai_spec([fault_proxy.base_url], max_concurrency=1)
    backend = make_backend(spec)
    llm = CachedLLM(backend, spec, cache=GenerationCache(tmp_path / "g.sqlite"), chunk_size=None)
    fault_proxy.inject("null_content", 1)
    with caplog.at_level(logging.WARNING, logger="r2med_agent.llm.openai_compat"):
        gens = llm.generate(_prompts(3), GREEDY)
    assert [g.finish_reason == "error" for g in gens] == [True, False, False]
    assert gens[0].text == "" and gens[1].text and gens[2].text
    assert backend.null_replies == 1
    assert "1 of 3 replies had no content (content: null)" in caplog.text
    assert len(llm.cache) == 2  # the failed one is asked for again by the next run


# ---------------------------------------------------------------- mistyped 200 replies

MISTYPED = {
    # valid JSON whose fields have the wrong types (issue 29 item 2): before, a TypeError,
    # AttributeError or ValueError after the batch, a traceback, and nothing of the batch cached
    "content-int": lambda p: CannedChatServer.good(p, content=123),
    "content-list": lambda p: CannedChatServer.good(p, content=[{"type": "text", "text": "hi"}]),
    "message-string": lambda p: {**CannedChatServer.good(p),
                                 "choices": [{"index": 0, "finish_reason": "stop", "message": "hi"}]},
    "usage-string": lambda p: {**CannedChatServer.good(p), "usage": {"prompt_tokens": "ten", "completion_tokens": 5}},
    "finish-reason-list": lambda p: {**CannedChatServer.good(p),
                                     "choices": [{**CannedChatServer.good(p)["choices"][0], "finish_reason": [1]}]},
}
STOPS = SamplingParams(temperature=0.0, max_tokens=4, stop=("never",))


@pytest.mark.parametrize("kind", MISTYPED)
def test_http_mistyped_200_reply_is_retried(kind: str) -> None:
    bad = MISTYPED[kind]
    with CannedChatServer(lambda prompt, attempt: bad(prompt) if attempt == 1 else CannedChatServer.good(prompt)) as srv:
        backend = make_backend(openai_spec([srv.base_url], model="m", server="openai"))
        gens = backend.generate(_prompts(1), STOPS)
    assert gens[0].text == "answer: Say the number 0." and gens[0].prompt_tokens == 10
    assert len(srv.requests) == 2 and backend.attempts == 2


@pytest.mark.parametrize("kind", MISTYPED)
def test_http_mistyped_replies_that_persist_fail_alone_and_the_good_ones_are_cached(kind: str, tmp_path: Path) -> None:
    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.llm.cache.wrapper import CachedLLM

    bad = MISTYPED[kind]
    spec = openai_spec(["http://127.0.0.1:9/v1"], model="m", server="openai", max_retries=1, backoff_initial_s=0.01)

    def wrapper(url: str) -> CachedLLM:
        from dataclasses import replace

        return CachedLLM(make_backend(replace(spec, base_urls=(url,))), spec,
                         cache=GenerationCache(tmp_path / "g.sqlite"), chunk_size=None)

    persistent = ("Say the number 3.", "Say the number 7.")
    with CannedChatServer(lambda prompt, attempt: bad(prompt) if prompt in persistent else CannedChatServer.good(prompt)) as srv:
        first = wrapper(srv.base_url)
        with pytest.raises(LLMError) as err:
            first.generate(_prompts(12), STOPS)
    message = str(err.value)
    assert "malformed reply" in message and "2 of 12 requests failed, 10 succeeded" in message
    assert len(first.cache) == 10 and len(srv.requests) == 12 + 2  # each bad one retried once

    with CannedChatServer() as fixed:  # the server answers well again: only the two are paid for
        gens = wrapper(fixed.base_url).generate(_prompts(12), STOPS)
    assert sorted(fixed.requests) == list(persistent)
    assert [g.text for g in gens] == [f"answer: Say the number {i}." for i in range(12)]


def test_a_run_whose_server_sends_a_mistyped_reply_exits_with_one_message_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from r2med_agent.cli.app import main
    from tests.unit.llm.cache.test_cache import write_task_dir

    data = write_task_dir(tmp_path / "data")
    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))

    def run(url: str) -> int:
        config = tmp_path / "config.yaml"
        config.write_text(f"llms:\n  canned:\n    backend: openai\n    model: m\n    server: openai\n"
                          f"    base_urls: [{url}]\n    max_retries: 1\n    backoff_initial_s: 0.01\n")
        return main(["run", "--config", str(config), "--task", "Biology", "--method", "hyde", "--llm", "canned",
                     "--retriever", "bm25", "--data-dir", str(data), "--allow-count-mismatch", "--output-dir", str(tmp_path / "out"),
                     "--no-progress", "--prompts", "own"])

    nostril = "one nostril"
    with CannedChatServer(lambda p, a: MISTYPED["content-int"](p) if nostril in p else CannedChatServer.good(p)) as srv:
        code = run(srv.base_url)
    err = capsys.readouterr().err
    assert code == 4, err
    assert "malformed reply: message.content is int '123', not str" in err and "Traceback" not in err
    assert "1 of 2 requests failed, 1 succeeded" in err
    with CannedChatServer() as fixed:
        assert run(fixed.base_url) == 0, capsys.readouterr().err
    assert len(fixed.requests) == 1 and nostril in fixed.requests[0]


# ---------------------------------------------------------------- retries (issue 29 item 8)


def test_one_warning_per_attempt_whatever_the_details_of_each_error(caplog: pytest.LogCaptureFixture) -> None:
    """Twelve replies cut at twelve different bytes fail attempt 1 with twelve different texts
    (the JSON error names its byte offset): before, up to one line each."""
    import json

    def reply(prompt: str, attempt: int) -> bytes:
        body = json.dumps(CannedChatServer.good(prompt)).encode()
        return body[: 40 + 7 * int(prompt.split()[-1].rstrip("."))] if attempt == 1 else body

    with CannedChatServer(reply) as srv, caplog.at_level(logging.WARNING, logger="r2med_agent.llm.openai_compat"):
        backend = make_backend(openai_spec([srv.base_url], model="m", server="openai", max_concurrency=12))
        gens = backend.generate(_prompts(12), STOPS)
    assert all(g.text for g in gens) and len(srv.requests) == 24
    lines = [r.getMessage() for r in caplog.records if "attempt" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("llm smollm2-http: attempt 1 failed (malformed reply"), lines


def test_the_last_attempt_waits_only_for_what_the_retry_budget_has_left() -> None:
    """timeout_s 3, max_retry_s 4.5, a server that never answers: the second attempt used to wait
    its whole 3 s (6 s in all; in the issue 73 s for a 50 s budget); now it stops at the budget."""
    import time

    with CannedChatServer(delay_s=60) as srv:
        backend = make_backend(openai_spec([srv.base_url], model="m", server="openai", timeout_s=3.0,
                                           max_retry_s=4.5, max_retries=10, backoff_initial_s=0.05))
        t0 = time.monotonic()
        with pytest.raises(LLMError) as err:
            backend.generate(_prompts(1), STOPS)
        elapsed = time.monotonic() - t0
    assert 4.3 < elapsed < 5.3, elapsed
    assert backend.attempts == 2
    assert "failed after 2 attempts: timed out after 1." in str(err.value)
    assert "what the retry budget max_retry_s had left" in str(err.value)


def test_progress_never_says_done_when_the_requests_failed(capsys: pytest.CaptureFixture[str],
                                                           tmp_path: Path) -> None:
    """Every request timed out: the last progress line said ``12/12 generations (100%), done``."""
    from r2med_agent import progress
    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.llm.cache.wrapper import CachedLLM

    was = progress.enabled()
    progress.configure(enabled=True)
    try:
        with CannedChatServer(delay_s=60) as srv:
            spec = openai_spec([srv.base_url], model="m", server="openai", timeout_s=1.0, max_retry_s=1.5,
                               max_concurrency=12)
            with pytest.raises(LLMError):
                make_backend(spec).generate(_prompts(12), STOPS)
        err = capsys.readouterr().err
        assert "0/12 generations (0%), 12 failed" in err and "12/12" not in err and "done" not in err, err
        # through the cache wrapper (one progress for the run), half of them failing for good
        odd = lambda p, a: b"{" if int(p.split()[-1].rstrip(".")) % 2 else CannedChatServer.good(p)  # noqa: E731
        with CannedChatServer(odd) as srv:
            spec = openai_spec([srv.base_url], model="m", server="openai", max_retries=0, max_concurrency=12)
            llm = CachedLLM(make_backend(spec), spec, cache=GenerationCache(tmp_path / "g.sqlite"), chunk_size=None)
            with pytest.raises(LLMError):
                llm.generate(_prompts(12), STOPS)
        err = capsys.readouterr().err
        assert "6/12 generations (50%), 6 failed" in err and "done" not in err, err
    finally:
        progress.configure(enabled=was)


# ---------------------------------------------------------------- llama.cpp in-process


@pytest.mark.slow
def test_local_prompt_over_n_ctx_fails_alone_and_the_others_are_cached(
    smollm2_spec, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dataclasses import replace

    from r2med_agent import progress
    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.llm.cache.wrapper import CachedLLM

    spec = replace(smollm2_spec, n_ctx=512)
    prompts = _prompts(4)
    prompts[2] = [{"role": "user", "content": "Too long: " + "lorem ipsum " * 400}]
    llm = CachedLLM(make_backend(spec), spec, cache=GenerationCache(tmp_path / "g.sqlite"), chunk_size=None)
    was = progress.enabled()
    progress.configure(enabled=True)
    try:
        with pytest.raises(LLMError) as err:
            llm.generate(prompts, GREEDY)
    finally:
        progress.configure(enabled=was)
    # the failed prompt is counted apart, never as done (issue 29 item 8)
    assert "3/4 generations (75%), 1 failed" in capsys.readouterr().err
    message = str(err.value)
    assert message.startswith("prompt 3 of 4 ('Too long: lorem ipsum")
    assert "raise n_ctx in its llms entry, now 512" in message
    assert "1 of 4 requests failed, 3 succeeded" in message
    assert len(llm.cache) == 3


# ---------------------------------------------------------------- a hung server

_HUNG_CLIENT = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)  # as the CLI
logging.getLogger("r2med_agent").setLevel(logging.INFO)
from r2med_agent.llm import openai_compat
from r2med_agent.llm.registry import LLMSpec, make_backend
from r2med_agent.types import SamplingParams
from tests.llm_server import FaultProxy
openai_compat.HEARTBEAT_S = 0.5
proxy = FaultProxy("http://127.0.0.1:9/v1")  # never forwarded to: every request hangs
proxy.inject("hang", 100)
spec = LLMSpec(name="hung", backend="openai", model="m", base_urls=(proxy.base_url,))  # defaults
print("sending", file=sys.stderr, flush=True)
make_backend(spec).generate([[{"role": "user", "content": "hi"}]] * 2, SamplingParams(max_tokens=3))
"""


@pytest.mark.slow
def test_a_hung_server_with_the_default_config_is_not_silent(tmp_path: Path) -> None:
    import os
    import signal
    import time

    stderr_path = tmp_path / "stderr.txt"
    root = Path(__file__).resolve().parents[2]
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_HUNG_CLIENT)], cwd=root,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "none came for" not in stderr_path.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, stderr_path.read_text()
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    lines = [x for x in stderr_path.read_text().splitlines() if "none came for" in x]
    assert lines, stderr_path.read_text()
    assert lines[0].startswith("llm hung: waiting for 2 replies (2 at http://127.0.0.1:")
    assert lines[0].endswith("an attempt times out after 300s (timeout_s)")


# ---------------------------------------------------------------- server: auto

CONTINUE = [
    {"role": "user", "content": "Count from 1 to 20, one number per line."},
    {"role": "assistant", "content": "1\n2\n3\n"},
]


@pytest.fixture
def fresh_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget what earlier tests found behind their URLs (ports are reused)."""
    from r2med_agent.llm import servers

    monkeypatch.setattr(servers, "_DETECTED", {})


@pytest.mark.slow
def test_auto_finds_llama_cpp_python_behind_the_url(
    llama_server, fresh_detection: None, caplog: pytest.LogCaptureFixture
) -> None:
    from r2med_agent.llm.servers import detect_server, resolve_server

    spec = openai_spec([llama_server.base_url], server="auto")
    with caplog.at_level(logging.INFO, logger="r2med_agent.llm.servers"):
        assert resolve_server(spec) == "llamacpp"
    assert detect_server(llama_server.base_url) == (
        "llamacpp", f"llama-cpp-python's server (GET {llama_server.base_url.removesuffix('/v1')}/openapi.json)"
    )
    assert f"{llama_server.base_url} is llama-cpp-python's server" in caplog.text
    # A continuation goes to the chat API as it is: no tokenizer is needed.
    gen = make_backend(spec).generate([CONTINUE], GREEDY)[0]
    assert gen.completion_tokens > 0


@pytest.mark.slow
def test_auto_on_a_server_that_does_not_say_uses_the_chat_api_with_one_notice(
    fault_proxy: FaultProxy, fresh_detection: None, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from r2med_agent.llm.cache.wrapper import RequestBuilder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a tokenizer lookup would fail at once
    fault_proxy.opaque = True
    spec = openai_spec([fault_proxy.base_url], server="auto", model="smollm2")
    with caplog.at_level(logging.INFO, logger="r2med_agent.llm.servers"):
        first = make_backend(spec).generate([CONTINUE], GREEDY)[0]
        again = make_backend(spec).generate([CONTINUE, COUNT], GREEDY)
    assert first.completion_tokens > 0 and all(g.completion_tokens > 0 for g in again)
    sent = fault_proxy.events_for()[0].json()
    assert sent["messages"][-1] == CONTINUE[-1] and "top_k" not in sent  # OpenAI's parameters
    assert caplog.text.count("did not say what it is (not vLLM, SGLang or llama.cpp)") == 1
    probes = [e for e in fault_proxy.events if e.method == "GET"]
    assert len(probes) == 5  # asked once per URL and process
    # The kind found is what the cache keys say: the same as an explicit server: openai.
    explicit = openai_spec([fault_proxy.base_url], server="openai", model="smollm2")
    assert RequestBuilder.from_spec(spec).key(CONTINUE, GREEDY) == RequestBuilder.from_spec(explicit).key(
        CONTINUE, GREEDY)


@pytest.mark.slow
@pytest.mark.vllm
def test_auto_finds_vllm_behind_the_url(vllm_server: str, vllm_model_dir: Path, fresh_detection: None) -> None:
    from r2med_agent.llm.servers import detect_server, resolve_server
    from r2med_agent.llm.registry import LLMSpec

    # The session's vLLM server, served as "smol"; continuations render with the checkpoint's tokenizer.
    spec = LLMSpec(name="served", backend="openai", model="smol", tokenizer=str(vllm_model_dir), server="auto",
                   base_urls=(vllm_server,), seed=None, max_retries=1)
    assert resolve_server(spec) == "vllm"
    assert detect_server(vllm_server) == ("vllm", f"vLLM (GET {vllm_server}/models)")
    # Continued as raw text on the completions endpoint, with the model's chat template.
    gen = make_backend(spec).generate([CONTINUE], GREEDY)[0]
    assert gen.completion_tokens > 0
