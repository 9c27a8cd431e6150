"""A loopback HTTP server whose every reply the test writes byte by byte, for the replies no real
engine sends on purpose: a body that trickles a byte every few seconds, a small gzip that inflates
to gigabytes, an endless chunked body, a JSON nested thousands deep, an error page that echoes the
request's headers (with its key). Used by ``tests/integration/test_hostile_servers.py`` and
``benchmarks/hostile.py``.

Everything binds to 127.0.0.1; every long reply ends when the server is closed, when the client
goes away, or at its own deadline.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import zlib
from collections.abc import Callable
from functools import lru_cache
from typing import Any

LOOPBACK = "127.0.0.1"

Handler = http.server.BaseHTTPRequestHandler
Answer = Callable[["ScriptedServer", Handler, str, Any, int], None]
"""``answer(server, handler, path, body, attempt)`` writes the whole reply to a request for
``path`` with the JSON ``body`` (None for a GET); ``attempt`` counts the requests with that
body (from 1)."""


class ScriptedServer:
    """HTTP/1.1 on 127.0.0.1 whose replies ``answer`` writes (:data:`Answer`; the helpers below).

    Attributes:
        base_url: ``http://127.0.0.1:<port>/v1``.
        requests: ``(path, body, headers)`` of every request, in order.
        stop: set by :meth:`close`; long replies end when it is.
    """

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[tuple[str, Any, dict[str, str]]] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        server = self

        class _Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

            def _serve(self, body: Any) -> None:
                with server._lock:
                    server.requests.append((self.path, body, dict(self.headers.items())))
                    attempt = sum(1 for _, b, _ in server.requests if b == body)
                try:
                    server.answer(server, self, self.path, body, attempt)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client gave up: what a cap or deadline does

            def do_GET(self) -> None:  # noqa: N802
                self._serve(None)

            def do_POST(self) -> None:  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._serve(json.loads(raw or b"{}"))

        class _Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                return  # a client that went away (a cap, a deadline) is what these tests make

        self._server = _Server((LOOPBACK, 0), _Handler)
        self.base_url = f"http://{LOOPBACK}:{self._server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.stop.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> ScriptedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def send(handler: Handler, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
    """A whole reply with a Content-Length (``headers`` may declare another)."""
    handler.send_response(status)
    for k, v in {"Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}.items():
        handler.send_header(k, v)
    handler.end_headers()
    handler.wfile.write(body)
    handler.wfile.flush()


def send_json(handler: Handler, status: int, payload: Any) -> None:
    send(handler, status, json.dumps(payload).encode())


def chat_reply(prompt: str, content: str | None = None) -> dict[str, Any]:
    """A well-formed chat completion answering ``answer: <prompt>``."""
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content or f"answer: {prompt}"}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


def prompt_of(body: Any) -> str:
    """The last message of a chat request's body."""
    return str(body.get("messages", [{}])[-1].get("content", "")) if isinstance(body, dict) else ""


def embeddings_reply(body: Any, dims: int = 4) -> dict[str, Any]:
    """A well-formed ``/embeddings`` reply: for each input, its length and ones."""
    return {"object": "list", "model": "m",
            "data": [{"index": i, "embedding": [float(len(t))] + [1.0] * (dims - 1)}
                     for i, t in enumerate(body["input"])]}


def deep_json(depth: int = 3000) -> bytes:
    """A chat-completion-looking reply whose content is a list nested ``depth`` deep."""
    return b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": ' + b"[" * depth \
        + b"]" * depth + b"}}]}"


def trickle(server: ScriptedServer, handler: Handler, every_s: float = 3.0, declared: int = 10**6) -> None:
    """Headers at once (declaring ``declared`` bytes), then one byte of a JSON body every
    ``every_s`` seconds, until the client leaves or the server closes."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(declared))
    handler.end_headers()
    handler.wfile.flush()
    body = b'{"choices": [' + b" " * declared
    for i in range(declared):
        if server.stop.wait(every_s if i else 0.0):
            break
        handler.wfile.write(body[i : i + 1])
        handler.wfile.flush()
    handler.close_connection = True


@lru_cache(maxsize=4)
def gzip_bomb(inflated: int) -> bytes:
    """A gzip body that inflates to ``inflated`` bytes of spaces (about a thousandth of that)."""
    out = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = b" " * 2**20
    parts = [out.compress(block) for _ in range(inflated // len(block))]
    parts.append(out.compress(b" " * (inflated % len(block))))
    return b"".join(parts) + out.flush()


def send_gzip_bomb(handler: Handler, inflated: int) -> None:
    send(handler, 200, gzip_bomb(inflated), {"Content-Encoding": "gzip"})


def endless_chunked(server: ScriptedServer, handler: Handler, limit_s: float = 120.0) -> None:
    """A chunked body of 64 kB chunks of spaces that never ends (until the client leaves, the
    server closes, or ``limit_s`` passes)."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    chunk = b" " * 65536
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    handler.wfile.write(b"1\r\n{\r\n")
    end = time.monotonic() + limit_s
    while not server.stop.is_set() and time.monotonic() < end:
        handler.wfile.write(frame)
    handler.close_connection = True


def echo_headers(handler: Handler, status: int = 400) -> None:
    """An error whose message quotes the request's headers, as some gateways' debug pages do."""
    send_json(handler, status, {"error": {"message": f"bad request; you sent {dict(handler.headers.items())}"}})
