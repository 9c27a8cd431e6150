"""Open a page in headless Chromium over the DevTools protocol and report everything that went wrong.

Chromium is started with ``--remote-debugging-pipe``: DevTools messages travel as NUL-terminated
JSON over two pipes (file descriptors 3 and 4 of the browser), so no port and no websocket client
are needed. While the page loads, the Runtime, Log and Network domains report:

* uncaught exceptions (``Runtime.exceptionThrown``) and ``console.error``/``console.assert`` calls;
* browser log entries of level error (failed loads, blocked requests, CSP and parser errors);
* every request the page makes: anything but ``data:`` URLs and the page's own file is an external
  reference (an ``<img src>``, a CSS ``url()``, an ``@import``, a ``fetch``), whether it succeeds or
  not. Host names resolve nowhere (``--host-resolver-rules``), so nothing leaves the machine.

After the load event and a short settling time, images that did not decode (``naturalWidth`` 0)
are listed, and the DOM is returned for the test's own checks.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Any

CHROMIUM = Path(shutil.which("chromium") or "/usr/bin/chromium")

_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-extensions", "--host-resolver-rules=MAP * ~NOTFOUND",
)

_IMAGES_JS = """JSON.stringify(Array.from(document.images).map(function (i) {
  return {src: (i.getAttribute("src") || "").slice(0, 80), complete: i.complete, width: i.naturalWidth};
}))"""


@dataclass
class PageReport:
    """What happened while a page loaded.

    Attributes:
        dom: ``document.documentElement.outerHTML`` after loading.
        values: what each of ``load_page``'s ``evaluate`` expressions returned (JSON values).
        screenshot: a PNG of the whole page as laid out (``load_page(screenshot=True)``).
        exceptions: uncaught script exceptions.
        console_errors: ``console.error`` / ``console.assert`` messages.
        log_errors: browser log entries of level error.
        external: URLs the page requested other than ``data:`` and itself.
        broken_images: ``src`` (cut) of images with ``naturalWidth`` 0.
    """

    dom: str = ""
    values: list[Any] = field(default_factory=list)
    screenshot: bytes = b""
    exceptions: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    log_errors: list[str] = field(default_factory=list)
    external: list[str] = field(default_factory=list)
    broken_images: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        """Every problem as one line each; empty for a clean page."""
        return (
            [f"exception: {e}" for e in self.exceptions]
            + [f"console error: {e}" for e in self.console_errors]
            + [f"log error: {e}" for e in self.log_errors]
            + [f"external request: {u}" for u in self.external]
            + [f"image did not decode: {s}" for s in self.broken_images]
        )


class _Pipe:
    """The DevTools connection: send commands, collect events until a condition holds."""

    def __init__(self, write_fd: int, read_fd: int) -> None:
        self.write_fd, self.read_fd = write_fd, read_fd
        self.buffer = b""
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def _messages(self, deadline: float):
        while True:
            while b"\0" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\0", 1)
                yield json.loads(raw)
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ready, _, _ = select.select([self.read_fd], [], [], left)
            if ready:
                chunk = os.read(self.read_fd, 1 << 16)
                if not chunk:
                    raise RuntimeError("Chromium closed the DevTools pipe")
                self.buffer += chunk

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 30.0) -> dict[str, Any]:
        self.next_id += 1
        msg: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.write_fd, json.dumps(msg).encode() + b"\0")
        for m in self._messages(time.monotonic() + timeout):
            if m.get("id") == self.next_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)
        raise TimeoutError(f"no answer to {method} within {timeout} s")

    def wait_for(self, method: str, timeout: float = 30.0) -> None:
        for m in self._messages(time.monotonic() + timeout):
            self.events.append(m)
            if m.get("method") == method:
                return
        raise TimeoutError(f"no {method} within {timeout} s")

    def drain(self, seconds: float) -> None:
        for m in self._messages(time.monotonic() + seconds):
            self.events.append(m)


def _text(args: list[dict[str, Any]]) -> str:
    return " ".join(str(a.get("value", a.get("description", a.get("type")))) for a in args)


def load_page(url: str, *, settle_s: float = 1.0, timeout: float = 60.0, evaluate: Sequence[str] = (),
              screenshot: bool = False, width: int = 1300) -> PageReport:
    """Open ``url`` (``file://``, a fragment allowed) in headless Chromium, laid out ``width``
    CSS pixels wide, and report on it: ``evaluate`` expressions are run in the page after it
    settled (their JSON values in ``values``), and with ``screenshot`` the whole page is
    captured as a PNG at one device pixel per CSS pixel."""
    page_file = url.split("#", 1)[0]
    cmd_read, cmd_write = os.pipe()  # we write commands; Chromium reads them on fd 3
    out_read, out_write = os.pipe()  # Chromium writes answers on fd 4; we read them

    def child_fds() -> None:
        os.dup2(cmd_read, 3)
        os.dup2(out_write, 4)

    profile = tempfile.mkdtemp(prefix="r2med-chromium-")
    stderr = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [str(CHROMIUM), *_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"],
        pass_fds=(3, 4), preexec_fn=child_fds, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=stderr,
    )
    os.close(cmd_read)
    os.close(out_write)
    pipe = _Pipe(cmd_write, out_read)
    report = PageReport()
    try:
        target = pipe.call("Target.createTarget", {"url": "about:blank"}, timeout=timeout)["targetId"]
        session = pipe.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Network", "Page"):
            pipe.call(f"{domain}.enable", session=session)
        pipe.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False}, session)
        pipe.events.clear()
        pipe.call("Page.navigate", {"url": url}, session=session)
        pipe.wait_for("Page.loadEventFired", timeout=timeout)
        pipe.drain(settle_s)  # late requests: CSS url() of laid-out elements, fetch, timers
        images = pipe.call("Runtime.evaluate", {"expression": _IMAGES_JS, "returnByValue": True}, session)
        report.broken_images = [
            i["src"] for i in json.loads(images["result"]["value"]) if not i["complete"] or i["width"] == 0
        ]
        dom = pipe.call(
            "Runtime.evaluate", {"expression": "document.documentElement.outerHTML", "returnByValue": True}, session
        )
        report.dom = dom["result"]["value"]
        for expression in evaluate:
            value = pipe.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
            report.values.append(value["result"].get("value"))
        if screenshot:
            size = pipe.call("Page.getLayoutMetrics", session=session)["cssContentSize"]
            clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
            shot = pipe.call("Page.captureScreenshot", {"format": "png", "clip": clip,
                                                        "captureBeyondViewport": True}, session, timeout=timeout)
            report.screenshot = base64.b64decode(shot["data"])
        for m in pipe.events:
            method, params = m.get("method"), m.get("params", {})
            if method == "Runtime.exceptionThrown":
                d = params["exceptionDetails"]
                report.exceptions.append(
                    (d.get("exception") or {}).get("description") or d.get("text", "exception")
                )
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                report.console_errors.append(_text(params.get("args", [])))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                entry = params["entry"]
                report.log_errors.append(f"{entry.get('text')} ({entry.get('url', '')})")
            elif method == "Network.requestWillBeSent":
                req = params["request"]["url"]
                if not req.startswith("data:") and req.split("#", 1)[0] != page_file:
                    report.external.append(req)
        try:
            pipe.call("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError):
            pass
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(cmd_write)
        os.close(out_read)
        stderr.close()
        shutil.rmtree(profile, ignore_errors=True)
    return report
