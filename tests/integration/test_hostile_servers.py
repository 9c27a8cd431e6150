"""Hostile servers (issue 39 items 2, 4-7), each a real HTTP server on 127.0.0.1
(:mod:`tests.hostile_http`): replies nested thousands deep, a body that trickles a byte a second, a
gzip that inflates past the cap, an endless chunked body, a declared 6 GB file, embeddings and
server-type answers of the wrong shape, and error pages that echo the request's key. Each ends in
one clear per-request error in bounded time and memory; no key or URL password is shown or stored.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from r2med_agent.errors import LLMError, PromptSourceError
from r2med_agent.llm.registry import make_backend
from r2med_agent.types import SamplingParams
from tests.hostile_http import (
    ScriptedServer, chat_reply, deep_json, echo_headers, embeddings_reply, endless_chunked, prompt_of, send,
    send_gzip_bomb, send_json, trickle,
)
from tests.llm_server import openai_spec

STOPS = SamplingParams(temperature=0.0, max_tokens=4, stop=("never",))
KEY = "sk-test-SECRET-4242424242"
PASSWORD = "pw-SECRET-777"


def _prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Say the number {i}."}] for i in range(n)]


def _number(body: Any) -> int:
    return int(prompt_of(body).split()[-1].rstrip("."))


def _bounded(fn: Any, limit_s: float, server: ScriptedServer) -> tuple[float, BaseException | None, Any]:
    """``fn()`` in a thread: (seconds, the exception it raised, its result); a call still running
    after ``limit_s`` fails the test (the server is closed first, which ends any trickle)."""
    out: dict[str, Any] = {}

    def go() -> None:
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t0 = time.monotonic()
    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(limit_s)
    elapsed = time.monotonic() - t0
    if thread.is_alive():
        server.close()
        thread.join(30)
        pytest.fail(f"still running after {limit_s:.0f}s")
    return elapsed, out.get("error"), out.get("result")


def _cached(url: str, tmp_path: Path, **fields: Any) -> Any:
    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.llm.cache.wrapper import CachedLLM

    spec = openai_spec([url], model="m", server="openai", backoff_initial_s=0.01, **fields)
    return CachedLLM(make_backend(spec), spec, cache=GenerationCache(tmp_path / "g.sqlite"), chunk_size=None)


# ---------------------------------------------------------------- item 4: nesting


def test_a_reply_nested_3000_deep_is_retried_as_a_malformed_one() -> None:
    def answer(srv, h, path, body, attempt):  # noqa: ANN001
        send(h, 200, deep_json(3000)) if attempt == 1 else send_json(h, 200, chat_reply(prompt_of(body)))

    with ScriptedServer(answer) as srv:
        backend = make_backend(openai_spec([srv.base_url], model="m", server="openai", backoff_initial_s=0.01))
        gens = backend.generate(_prompts(1), STOPS)
    assert gens[0].text == "answer: Say the number 0." and backend.attempts == 2


def test_a_third_of_a_batch_nested_deep_fails_only_those_requests(tmp_path: Path) -> None:
    """Before: RecursionError, exit 1, no retry, and the batch's other requests lost with it."""
    def answer(srv, h, path, body, attempt):  # noqa: ANN001
        send(h, 200, deep_json(3000)) if _number(body) % 3 == 0 else send_json(h, 200, chat_reply(prompt_of(body)))

    with ScriptedServer(answer) as srv:
        llm = _cached(srv.base_url, tmp_path, max_retries=1, max_concurrency=4)
        with pytest.raises(LLMError) as err:
            llm.generate(_prompts(12), STOPS)
    message = str(err.value)
    assert "malformed reply: the reply is not valid JSON (RecursionError" in message, message
    assert "4 of 12 requests failed, 8 succeeded" in message and len(llm.cache) == 8
    assert len(srv.requests) == 12 + 4  # each deep one retried once


# ---------------------------------------------------------------- item 5: a trickle


def test_a_trickling_server_is_bounded_by_the_retry_budget() -> None:
    """A byte a second: every read came within timeout_s, so an attempt never timed out (past
    150 s in the issue for timeout_s 15, max_retry_s 30). Now each attempt ends by timeout_s in
    all and the request by the budget."""
    import openai  # noqa: F401 - imported before the clock starts
    with ScriptedServer(lambda srv, h, path, body, attempt: trickle(srv, h, every_s=1.0)) as srv:
        backend = make_backend(openai_spec([srv.base_url], model="m", server="openai", timeout_s=3.0,
                                           max_retry_s=5.0, max_retries=10, backoff_initial_s=0.05))
        elapsed, error, _ = _bounded(lambda: backend.generate(_prompts(1), STOPS), 40, srv)
    assert isinstance(error, LLMError), error
    assert 4.5 < elapsed < 9, elapsed
    assert "failed after 2 attempts: timed out after" in str(error), str(error)
    assert backend.attempts == 2


def test_a_trickling_embeddings_server_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from r2med_agent.retrieval.dense import api

    monkeypatch.setattr(api, "ATTEMPTS", 2)
    monkeypatch.setattr(api, "BACKOFF_S", 0.01)
    with ScriptedServer(lambda srv, h, path, body, attempt: trickle(srv, h, every_s=1.0)) as srv:
        encoder = _encoder(srv.base_url, monkeypatch, timeout_s=2.0)
        elapsed, error, _ = _bounded(lambda: encoder.encode(["a", "b"], side="query"), 40, srv)
    assert isinstance(error, LLMError) and elapsed < 7, (elapsed, error)
    assert "after 2 attempt(s): the request timed out after 2s (the whole request, not one read)" in str(error)


def test_a_trickling_prompt_mirror_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from r2med_agent.prompts import sources as prompt_sources

    monkeypatch.setattr(prompt_sources, "FETCH_TIMEOUT_S", 2.0)
    monkeypatch.setattr(prompt_sources, "FETCH_ATTEMPTS", 1)
    with ScriptedServer(lambda srv, h, path, body, attempt: trickle(srv, h, every_s=0.5)) as srv:
        source = _source(srv, tmp_path, monkeypatch)
        elapsed, error, _ = _bounded(lambda: prompt_sources.fetch(source), 40, srv)
    assert isinstance(error, PromptSourceError) and elapsed < 5, (elapsed, error)
    assert "the download timed out after 2s" in str(error)


def test_a_trickling_server_type_probe_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from r2med_agent.llm import servers

    monkeypatch.setattr(servers, "_DETECTED", {})
    monkeypatch.setattr(servers, "PROBE_TIMEOUT_S", 1.0)
    with ScriptedServer(lambda srv, h, path, body, attempt: trickle(srv, h, every_s=0.3)) as srv:
        elapsed, error, found = _bounded(lambda: servers.detect_server(srv.base_url), 40, srv)
    assert error is None and found is None and elapsed < 3, (elapsed, error, found)


# ---------------------------------------------------------------- item 6: sizes

BIG = {
    "gzip": lambda srv, h: send_gzip_bomb(h, 256 * 2**20),
    "chunked": lambda srv, h: endless_chunked(srv, h),
    "declared": lambda srv, h: send(h, 200, b"{}", {"Content-Length": str(6 * 10**9)}),
}


@pytest.mark.parametrize("kind", BIG)
def test_a_reply_over_the_cap_fails_only_its_request(kind: str, tmp_path: Path) -> None:
    """A gzip inflating to 256 MiB (2 GB in the issue: 7.15 GB RSS, then MemoryError), an
    endless chunked body, a declared 6 GB: refused at the cap, not retried, the others kept."""
    def answer(srv, h, path, body, attempt):  # noqa: ANN001
        if _number(body) in (3, 7):
            BIG[kind](srv, h)
        else:
            send_json(h, 200, chat_reply(prompt_of(body)))

    with ScriptedServer(answer) as srv:
        llm = _cached(srv.base_url, tmp_path, max_retries=3, max_concurrency=4)
        elapsed, error, _ = _bounded(lambda: llm.generate(_prompts(12), STOPS), 60, srv)
    message = str(error)
    assert isinstance(error, LLMError) and "2 of 12 requests failed, 10 succeeded" in message, message
    assert "cap on a reply; refused" in message and "64 MiB" in message
    assert len(llm.cache) == 10 and len(srv.requests) == 12  # not retried


def test_embeddings_over_the_cap_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with ScriptedServer(lambda srv, h, path, body, attempt: send_gzip_bomb(h, 256 * 2**20)) as srv:
        encoder = _encoder(srv.base_url, monkeypatch)
        with pytest.raises(LLMError, match=r"over the 64 MiB cap on a reply; refused"):
            encoder.encode(["a"], side="query")
    assert len(srv.requests) == 1


def test_a_prompt_file_over_the_cap_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A declared 6 GB file (a MemoryError traceback) and a 1 GB file on a file:// mirror
    (1.09 GB of memory): refused at 16 MiB, nothing written."""
    from r2med_agent.prompts import sources as prompt_sources

    monkeypatch.setattr(prompt_sources, "FETCH_ATTEMPTS", 1)
    declared = lambda srv, h, path, body, attempt: send(h, 200, b"x", {"Content-Length": str(6 * 10**9)})  # noqa: E731
    with ScriptedServer(declared) as srv:
        source = _source(srv, tmp_path, monkeypatch)
        with pytest.raises(PromptSourceError, match="the reply declares 5722 MiB \\(Content-Length\\), over the 16 MiB cap on a reply; refused"):
            prompt_sources.fetch(source)
    mirror = tmp_path / "mirror"
    big = mirror / source.repo / source.commit / "prompts.py"
    big.parent.mkdir(parents=True)
    with open(big, "wb") as f:
        f.truncate(2**30)  # sparse: 1 GiB to read, no disk used
    monkeypatch.setenv(prompt_sources.BASE_URL_ENV, mirror.as_uri())
    with pytest.raises(PromptSourceError, match="the file is over the 16 MiB cap; refused"):
        prompt_sources.fetch(source)
    assert not (source.folder / "files").exists()


# ---------------------------------------------------------------- item 7: embeddings and probes

BAD_EMBEDDINGS = {
    "deep": lambda h, body: send(h, 200, b'{"data": ' + b"[" * 3000 + b"]" * 3000 + b"}"),
    "string": lambda h, body: send_json(h, 200, {"data": [{"index": i, "embedding": "abc"}
                                                          for i in range(len(body["input"]))]}),
    "missing": lambda h, body: send_json(h, 200, {"data": [{"index": i} for i in range(len(body["input"]))]}),
    "html": lambda h, body: send(h, 200, b"<html><body>Sign in to the portal</body></html>",
                                 {"Content-Type": "text/html"}),
}


@pytest.mark.parametrize("kind", BAD_EMBEDDINGS)
def test_a_malformed_embeddings_reply_is_retried_then_a_clear_error(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a traceback (TypeError, KeyError, JSONDecodeError, RecursionError), exit 1, no retry."""
    import numpy as np

    from r2med_agent.retrieval.dense import api

    monkeypatch.setattr(api, "BACKOFF_S", 0.01)
    flaky = lambda srv, h, path, body, attempt: (  # noqa: E731
        BAD_EMBEDDINGS[kind](h, body) if attempt == 1 else send_json(h, 200, embeddings_reply(body)))
    with ScriptedServer(flaky) as srv:
        got = _encoder(srv.base_url, monkeypatch).encode(["a", "bb"], side="query")
    assert got.shape == (2, 4) and np.isfinite(got).all() and len(srv.requests) == 2

    monkeypatch.setattr(api, "ATTEMPTS", 2)
    with ScriptedServer(lambda srv, h, path, body, attempt: BAD_EMBEDDINGS[kind](h, body)) as srv:
        with pytest.raises(LLMError) as err:
            _encoder(srv.base_url, monkeypatch).encode(["a", "bb"], side="query")
    assert f"no usable reply from {srv.base_url}/embeddings after 2 attempt(s)" in str(err.value), str(err.value)
    assert len(srv.requests) == 2


PROBE_ANSWERS = {
    "models-data-5": {"/v1/models": {"data": 5}},
    "openapi-info-list": {"/openapi.json": {"info": ["x"]}},
    "deep": {"/v1/models": "deep", "/openapi.json": "deep"},
}


@pytest.mark.parametrize("kind", PROBE_ANSWERS)
def test_a_server_type_answer_of_the_wrong_shape_says_nothing(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ``{"data": 5}`` a TypeError, ``{"info": ["x"]}`` an AttributeError, deep JSON a
    RecursionError: each a traceback. Now the probe goes on, and a server that says nothing
    usable gets the chat API with OpenAI's parameters."""
    from r2med_agent.llm import servers

    monkeypatch.setattr(servers, "_DETECTED", {})

    def answer(srv, h, path, body, attempt):  # noqa: ANN001
        what = PROBE_ANSWERS[kind].get(path)
        if what == "deep":
            send(h, 200, b"{" + b'"a": {' * 3000 + b"}" * 3001)
        elif what is not None:
            send_json(h, 200, what)
        else:
            send_json(h, 404, {"error": "no"})

    with ScriptedServer(answer) as srv:
        assert servers.detect_server(srv.base_url) == ("openai", "")
    assert [p for p, _, _ in srv.requests] == ["/v1/models", "/get_model_info", "/props", "/version", "/openapi.json"]


# ---------------------------------------------------------------- item 2: secrets


def test_no_key_and_no_url_password_in_any_output_stream_or_file(tmp_path: Path) -> None:
    """A server whose errors echo the request's headers: the embeddings encoder printed the key
    (``Authorization: Bearer sk-...``), the LLM path the password of its base URL
    (``http://user:secret@host``; httpx sends it as ``Authorization: Basic ...``). Two runs of
    the CLI; neither secret (nor the Basic form of user and password) in stdout, stderr or any
    file written."""
    from tests.unit.llm.cache.test_cache import write_task_dir

    data = write_task_dir(tmp_path / "data")
    with ScriptedServer(lambda srv, h, path, body, attempt: echo_headers(h, 400)) as srv:
        port = srv.base_url.split(":")[2].split("/")[0]
        url = f"http://user:{PASSWORD}@127.0.0.1:{port}/v1"
        config = tmp_path / "config.yaml"
        config.write_text(
            f"llms:\n  canned:\n    backend: openai\n    model: m\n    server: openai\n    base_urls: [{url}]\n"
            f"    api_key_env: R2MED_TEST_KEY\n    max_retries: 0\n"
            f"encoders:\n  echoing:\n    kind: api\n    provider: openai\n    model: m\n    base_url: {srv.base_url}\n"
            f"    api_key_env: R2MED_TEST_KEY\n    normalize: true\n    batch_size: 4\n"
        )
        env = {**os.environ, "R2MED_TEST_KEY": KEY, "R2MED_CACHE_DIR": str(tmp_path / "cache"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                           os.environ.get("PYTHONPATH")]))}
        outputs = []
        for method, llm, retriever in (("hyde", ["--llm", "canned"], "bm25"), ("none", [], "echoing")):
            done = subprocess.run(
                [sys.executable, "-m", "r2med_agent", "run", "--config", str(config), "--task", "Biology",
                 "--method", method, *llm, "--retriever", retriever, "--data-dir", str(data),
                 "--allow-count-mismatch", "--output-dir", str(tmp_path / "out"), "--no-progress", "--prompts", "own"],
                env=env, capture_output=True, text=True, timeout=300)
            outputs.append(done.stdout + done.stderr)
            assert done.returncode == 4 and "Traceback" not in done.stderr, done.stderr
            assert "bad request; you sent" in done.stderr and "Authorization': '" in done.stderr, done.stderr
    basic = base64.b64encode(f"user:{PASSWORD}".encode()).decode()
    files = [p for root in (tmp_path / "out", tmp_path / "cache") if root.exists() for p in root.rglob("*") if p.is_file()]
    for text in [*outputs, *(p.read_bytes().decode("utf-8", "replace") for p in files)]:
        for secret in (KEY, PASSWORD, basic):
            assert secret not in text, text[:2000]
    assert "http://***@127.0.0.1" in outputs[0] and "Bearer ***" in outputs[1], outputs


# ---------------------------------------------------------------- helpers


def _encoder(url: str, monkeypatch: pytest.MonkeyPatch, timeout_s: float = 30.0) -> Any:
    from r2med_agent.retrieval.dense.api import APIEncoder
    from r2med_agent.retrieval.dense.factory import get_encoder_spec

    monkeypatch.setenv("R2MED_TEST_KEY", KEY)
    spec = dataclasses.replace(get_encoder_spec("openai"), base_url=url, api_key_env="R2MED_TEST_KEY", max_tokens=None,
                               tiktoken_encoding="", json_inputs=False, batch_size=4, normalize=False)
    return APIEncoder(spec, timeout_s=timeout_s)


def _source(srv: ScriptedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A pinned source of one file, fetched from ``srv`` into a cache under ``tmp_path``."""
    from r2med_agent.prompts import sources as prompt_sources

    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(prompt_sources.BASE_URL_ENV, srv.base_url.removesuffix("/v1"))
    return prompt_sources.PromptSource(name="t", repo="o/r", commit="0" * 40, reader="none", folders=(),
                                       files={"prompts.py": hashlib.sha256(b"x").hexdigest()})
