"""Progress of the slow part of a run, generation, for every backend.

:class:`GenerationProgress` counts generations done out of a total and shows the rate, the ETA
and output tokens per second where the backend knows them: a tqdm bar when stderr is a terminal,
and otherwise (a batch job's log file) one plain line at a steady interval
(:data:`PLAIN_INTERVAL_S`, plus one when done), since a bar's carriage returns make one endless
line in a file. ``run --no-progress`` turns both off (:func:`configure`).

The vLLM offline engine drives it through ``use_tqdm`` (vLLM accepts a tqdm-like factory), the
HTTP backend per finished request, the in-process llama.cpp engine per prompt. The cache
wrapper opens one progress for all the misses of a ``generate`` call (:func:`tracking`), so a
run split into chunks shows one count over the whole run; a backend called directly gets its
own (:func:`for_backend`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, TextIO

logger = logging.getLogger(__name__)

PLAIN_INTERVAL_S = 30.0
"""Seconds between plain progress lines when stderr is not a terminal."""

_SETTINGS: dict[str, Any] = {"enabled": True, "interval_s": PLAIN_INTERVAL_S, "min_total": 2}


def configure(*, enabled: bool | None = None, interval_s: float | None = None) -> None:
    """Turn progress display on or off, or change the plain-line interval (process-wide)."""
    if enabled is not None:
        _SETTINGS["enabled"] = bool(enabled)
    if interval_s is not None:
        _SETTINGS["interval_s"] = float(interval_s)


def enabled() -> bool:
    return bool(_SETTINGS["enabled"])


_CURRENT: contextvars.ContextVar[GenerationProgress | None] = contextvars.ContextVar(
    "r2med_generation_progress", default=None
)


@contextlib.contextmanager
def tracking(total: int, desc: str, **kwargs: Any) -> Iterator[GenerationProgress]:
    """One progress for ``total`` generations made over several backend calls; backends inside
    the block feed it (:func:`for_backend`)."""
    progress = GenerationProgress(total, desc, **kwargs)
    token = _CURRENT.set(progress)
    try:
        yield progress
    finally:
        _CURRENT.reset(token)
        progress.close()


def for_backend(total: int, desc: str) -> GenerationProgress:
    """The progress a backend call feeds: the enclosing :func:`tracking` one (closing it from
    the backend does nothing), else a new one for this call alone."""
    current = _CURRENT.get()
    if current is not None:
        return _Shared(current)  # type: ignore[return-value]
    return GenerationProgress(total, desc)


def _fmt_eta(seconds: float) -> str:
    return str(timedelta(seconds=int(round(seconds))))


class GenerationProgress:
    """Generations done / total for one backend call.

    Args:
        total: generations this call makes.
        desc: what is generating (shown first).
        stream: where to draw (default stderr); a terminal gets a bar, anything else lines.
        interval_s: seconds between plain lines (default :data:`PLAIN_INTERVAL_S`).
        show: False shows nothing (default: :func:`configure`'s setting; calls of a single
            generation show nothing either).
        clock: time source (tests).
    """

    def __init__(
        self,
        total: int,
        desc: str,
        *,
        stream: TextIO | None = None,
        interval_s: float | None = None,
        show: bool | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.total = int(total)
        self.desc = desc
        self.n = 0
        self.tokens = 0
        self._stream = stream if stream is not None else sys.stderr
        self._interval = float(_SETTINGS["interval_s"] if interval_s is None else interval_s)
        self._clock = clock
        self._start = clock()
        self._last_line = self._start
        self._closed = False
        visible = enabled() if show is None else show
        self.show = bool(visible) and self.total >= int(_SETTINGS["min_total"])
        self._bar: Any = None
        self.lines: list[str] = []  # the plain lines written (tests, logs)
        if self.show and self._isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=desc, unit="gen", file=self._stream,
                             dynamic_ncols=True, leave=False)

    def _isatty(self) -> bool:
        try:
            return bool(self._stream.isatty())
        except (AttributeError, ValueError):
            return False

    @property
    def elapsed(self) -> float:
        return self._clock() - self._start

    def ready(self) -> None:
        """The engine is loaded: restart the clock if nothing is done yet, so loading a model
        (minutes for a large one) does not count in the rate and the ETA."""
        if self.n == 0 and self.tokens == 0:
            self._start = self._last_line = self._clock()

    def update(self, n: int = 1, tokens: int = 0) -> None:
        """``n`` more generations done, with ``tokens`` output tokens between them."""
        self.n += n
        self.tokens += tokens
        if not self.show:
            return
        if self._bar is not None:
            if self.tokens:
                self._bar.set_postfix_str(f"{self.tokens / max(self.elapsed, 1e-9):.1f} tok/s",
                                          refresh=False)
            self._bar.update(n)
            return
        now = self._clock()
        if now - self._last_line >= self._interval and self.n < self.total:
            self._last_line = now
            self._write(self.line())

    def line(self) -> str:
        """The plain progress line: done/total, percent, rate, ETA, tokens/s."""
        elapsed = max(self.elapsed, 1e-9)
        rate = self.n / elapsed
        parts = [f"{self.desc}: {self.n}/{self.total} generations"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        parts.append(f"{rate:.2f}/s")
        if 0 < self.n < self.total:
            parts.append(f"ETA {_fmt_eta((self.total - self.n) / rate)}")
        elif self.n >= self.total:
            parts.append(f"done in {_fmt_eta(elapsed)}")
        if self.tokens:
            parts.append(f"{self.tokens / elapsed:.1f} output tok/s")
        return ", ".join(parts)

    def _write(self, text: str) -> None:
        self.lines.append(text)
        try:
            print(text, file=self._stream, flush=True)
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        """Finish: the bar is removed; in plain mode a final line is written."""
        if self._closed:
            return
        self._closed = True
        if not self.show:
            return
        if self._bar is not None:
            self._bar.close()
            return
        self._write(self.line())

    # -- vLLM: ``use_tqdm`` takes a tqdm-like factory -----------------------------------------
    @property
    def vllm_bar(self) -> Any:
        """What to pass as vLLM's ``use_tqdm``: False when nothing is shown, else a factory of
        a tqdm-like object that feeds this progress (vLLM calls ``update``, reads ``n`` and
        ``format_dict['elapsed']`` and sets ``postfix`` with its token rates); given an
        iterable (vLLM's rendering loop), the iterable itself."""
        if not self.show:
            return False

        def factory(iterable: Any = None, *args: Any, **kwargs: Any) -> Any:
            # vLLM also wraps its prompt-rendering loop with it (an iterable): left as it is.
            if iterable is not None:
                return iterable
            return _VLLMBar(self)

        return factory


class _VLLMBar:
    """The part of tqdm's interface vLLM's offline engine uses, forwarding to a
    :class:`GenerationProgress` (several engine calls of one ``generate`` share it)."""

    def __init__(self, progress: GenerationProgress) -> None:
        self._progress = progress
        self._base = progress.n
        self.postfix = ""

    @property
    def n(self) -> int:
        return self._progress.n - self._base

    @property
    def format_dict(self) -> dict[str, float]:
        return {"elapsed": max(self._progress.elapsed, 1e-9)}

    def update(self, n: int = 1) -> None:
        self._progress.update(n)

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Shared:
    """A backend's view of the enclosing progress: everything but ``close``."""

    def __init__(self, inner: GenerationProgress) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def close(self) -> None:
        pass
