"""Failing fast and clearly without a network, with real sockets on loopback: a refused port, a
host name that cannot resolve (``.invalid``), a server that always answers 500, and a hub
endpoint nobody listens on."""

from __future__ import annotations

import http.server
import logging
import os
import socket
import subprocess
import sys
import threading

import pytest

from r2med_agent.errors import LLMError
from r2med_agent.llm.base import UnreachableError
from tests.llm_server import openai_spec

PROMPTS = [[{"role": "user", "content": f"question {i}"}] for i in range(8)]


def _refused_port() -> int:
    """A loopback port nothing listens on (bound to find it, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(url: str, **fields):
    from r2med_agent.llm.openai_compat import OpenAICompatBackend

    settings = {"max_retries": 5, "backoff_initial_s": 0.5, "backoff_max_s": 4.0, **fields}
    spec = openai_spec([url], **settings)
    return OpenAICompatBackend(spec)


@pytest.fixture()
def no_proxy(monkeypatch):
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)


def _generate(backend):
    from r2med_agent.types import SamplingParams

    return backend.generate(PROMPTS, SamplingParams(max_tokens=4))


@pytest.mark.parametrize("url", [f"http://127.0.0.1:{_refused_port()}/v1", "http://no-such-host.invalid/v1"],
                         ids=["refused-port", "unresolvable-name"])  # the same ids in every xdist worker
def test_refused_port_and_unresolvable_name_are_not_retried(url, no_proxy, caplog):
    caplog.set_level(logging.WARNING)
    backend = _backend(url)
    with pytest.raises(UnreachableError, match="is not reachable"):
        _generate(backend)
    # One attempt per request in flight (max_concurrency 4), no retry, the rest never sent.
    assert backend.attempts <= 4
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


class _Always500(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        body = b'{"error": {"message": "boom"}}'
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture()
def always_500():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Always500)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_retry_lines_are_one_per_attempt_not_per_prompt(always_500, no_proxy, caplog):
    caplog.set_level(logging.WARNING)
    backend = _backend(always_500, max_retries=2, backoff_initial_s=0.05, backoff_max_s=0.1)
    with pytest.raises(LLMError, match="failed after 3 attempts"):
        _generate(backend)
    lines = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(lines) == 2, lines  # attempt 1 and attempt 2, not 8 prompts x 2
    assert "attempt 1 failed" in lines[0] and "attempt 2 failed" in lines[1]


def test_total_retry_time_is_bounded(always_500, no_proxy):
    backend = _backend(always_500, max_retries=1000, backoff_initial_s=0.2, backoff_max_s=0.2,
                       max_retry_s=1.0)
    with pytest.raises(LLMError, match=r"failed after \d+ attempts"):
        _generate(backend)
    # 1 s of retries at 0.2 s waits: a handful of attempts per request, not 1001.
    assert backend.attempts < 8 * 20


def test_unreachable_hub_fails_a_missing_dense_model_in_seconds(tmp_path):
    """A dense model not in the cache, the hub endpoint a refused loopback port: one message,
    exit 2, no hub retry lines (the time left is importing torch and transformers)."""
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{_refused_port()}",
           "HF_HOME": str(tmp_path / "hf"), "R2MED_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("HF_HUB_OFFLINE", None)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-m", "r2med_agent", "run", "--task", "sample", "--retriever", "bge",
         "--no-progress", "-o", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "cannot load encoder 'bge'" in proc.stderr and "the hub is unreachable" in proc.stderr
    assert proc.stderr.count("cannot load encoder") == 1
    assert "retry" not in proc.stderr.lower() and "Traceback" not in proc.stderr
