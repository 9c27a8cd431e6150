"""Local mirrors of the authors' prompt files for the tests: a folder in raw.githubusercontent's
layout (``<root>/<owner>/<repo>/<commit>/<path>``), reached as a ``file://`` URL or through a real
HTTP server on loopback (:class:`LoopbackMirror`, Python's own ``http.server`` in a thread), which
counts the files it served."""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path

from r2med_agent.prompts.sources import PromptSource


def mirror_files(root: Path, source: PromptSource, files_from: Path, *, commit: str | None = None) -> Path:
    """Copy ``source``'s files from the folder ``files_from`` (a clone or pinned copy) into the
    mirror ``root``, under ``commit`` (default: the pinned one). Returns ``root``."""
    for rel in source.files:
        dst = root / source.repo / (commit or source.commit) / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(files_from / rel, dst)
    return root


def copies_mirror(root: Path, sources: Iterable[PromptSource], copies: Path) -> Path:
    """A mirror of ``sources`` built from the pinned copies under ``copies``
    (``<owner>+<repo>@<12 hex>`` folders, as ``R2MED_REFERENCE_CODE`` holds them)."""
    for source in sources:
        copy = copies / f"{source.repo.replace('/', '+')}@{source.commit[:12]}"
        mirror_files(root, source, copy)
    return root


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        super().do_GET()


class LoopbackMirror:
    """A real HTTP server on 127.0.0.1 serving ``root``; ``url`` is its base URL and ``paths`` the
    request paths it was asked for."""

    def __init__(self, root: Path) -> None:
        handler = functools.partial(_Handler, directory=str(root))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.paths = []  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def paths(self) -> list[str]:
        return self.server.paths  # type: ignore[attr-defined]

    def __enter__(self) -> LoopbackMirror:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def closed_port_url() -> str:
    """A loopback URL where nothing listens (a machine without network, as the fetch sees it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
