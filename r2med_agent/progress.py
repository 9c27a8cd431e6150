"""Progress of a run's long stages, for every backend and every log.

Two kinds of progress share one display rule: a tqdm bar when the stream (stderr) is a
terminal, and otherwise (a SLURM or ``nohup`` log file) one plain, timestamped line at a steady
interval (:data:`PLAIN_INTERVAL_S`), since a bar's carriage returns make one endless line in a
file. Progress is on by default; ``run --no-progress`` turns both off and
``--progress-interval`` sets the interval (:func:`configure`).

- :class:`GenerationProgress` counts generations done out of a total with the rate, the ETA and
  output tokens per second where the backend knows them, and a final line when done. The vLLM
  offline engine drives it through ``use_tqdm`` (vLLM accepts a tqdm-like factory), the HTTP
  backend per finished request, the in-process llama.cpp engine per prompt. The cache wrapper
  opens one progress for all the misses of a ``generate`` call (:func:`tracking`), so a run
  split into chunks shows one count over the whole run; a backend called directly gets its own
  (:func:`for_backend`). Its bar is drawn once the backend is ready (or the first generation is
  done), so a model's loading messages never print into an empty bar.
- :func:`stage_bar` is the one helper every other long stage (BM25 analysis and search, dense
  encoding and its shards, reranking, embedding over an API) makes its bar with: tqdm's
  signature, the same rule.

:func:`log_handler` writes log records above a bar instead of through it.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import threading
import time
from collections.abc import Iterable, Iterator
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
        if interval_s < 0:
            from r2med_agent.errors import ConfigError

            raise ConfigError(f"the progress interval must be 0 seconds or more, got {interval_s:g}")
        _SETTINGS["interval_s"] = float(interval_s)


def enabled() -> bool:
    return bool(_SETTINGS["enabled"])


def plain_interval() -> float:
    """Seconds between plain progress lines (:func:`configure`)."""
    return float(_SETTINGS["interval_s"])


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _stamped(text: str) -> str:
    """A plain progress line as written to a log: the local wall time first."""
    return f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {text}"


def _print(text: str, stream: TextIO) -> None:
    """Write one line, ignoring a closed or broken stream (progress never stops a run)."""
    try:
        print(text, file=stream, flush=True)
    except (OSError, ValueError):
        pass


_CURRENT: contextvars.ContextVar[GenerationProgress | None] = contextvars.ContextVar(
    "r2med_generation_progress", default=None
)


_PART: contextvars.ContextVar[str] = contextvars.ContextVar("r2med_progress_part", default="")


@contextlib.contextmanager
def part(label: str) -> Iterator[None]:
    """Name the part of the work that progress opened inside the block counts (``sample 3/8``,
    one of several passes over the same prompts): it follows their description."""
    token = _PART.set(label)
    try:
        yield
    finally:
        _PART.reset(token)


def current_part() -> str:
    """The label of the enclosing :func:`part` ("" outside one)."""
    return _PART.get()


@contextlib.contextmanager
def tracking(total: int, desc: str, **kwargs: Any) -> Iterator[GenerationProgress]:
    """One progress for ``total`` generations made over several backend calls; backends inside
    the block feed it (:func:`for_backend`). Inside :func:`part`, its label follows ``desc``."""
    label = _PART.get()
    progress = GenerationProgress(total, f"{desc} {label}" if label else desc, **kwargs)
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


def _line_parts(desc: str, n: int, total: int | None, unit: str, elapsed: float) -> list[str]:
    """The parts of a plain progress line, to be joined with commas: ``desc: n/total unit (pct%)``,
    the rate, then the ETA while work remains or the time taken once it is done. ``total=None``
    (a stage that does not know how much there is) leaves out the total, the ETA and the end."""
    elapsed = max(elapsed, 1e-9)
    rate = n / elapsed
    head = f"{desc}: {n}" + ("" if total is None else f"/{total}") + f" {unit}"
    if total:
        head += f" ({100 * n / total:.0f}%)"
    parts = [head, f"{rate:.2f}/s"]
    if total is not None and 0 < n < total:
        parts.append(f"ETA {_fmt_eta((total - n) / rate)}")
    elif total is not None and n >= total:
        parts.append(f"done in {_fmt_eta(elapsed)}")
    return parts


class _PlainLines:
    """What both kinds of progress share in plain mode: a line is kept in ``lines`` (without its
    time) and written to the stream with the time first."""

    lines: list[str]
    _stream: TextIO
    _written_at: Any = None  # the count the last line was written at

    def _count(self) -> Any:
        """What a line reports: a last line at the same count would repeat the one before."""
        raise NotImplementedError

    def _write(self, text: str) -> None:
        self.lines.append(text)
        self._written_at = self._count()
        _print(_stamped(text), self._stream)

    def _repeats(self) -> bool:
        """Whether a line now would say what the last one said (a Ctrl-C right after a line:
        the closing line printed it twice)."""
        return bool(self.lines) and self._written_at == self._count()


class GenerationProgress(_PlainLines):
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
        self.failed = 0
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
        self._tty = _isatty(self._stream)
        self.lines: list[str] = []  # the plain lines written, without their time (tests, logs)

    def _draw_bar(self) -> Any:
        """The terminal bar, made when first needed: once the backend is ready or work is done,
        never while a model loads (its messages would print into an empty bar)."""
        if self._bar is None and self.show and self._tty and not self._closed:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.desc, unit="gen", file=self._stream,
                             dynamic_ncols=True, leave=False, initial=self.n)
        return self._bar

    @property
    def elapsed(self) -> float:
        return self._clock() - self._start

    def ready(self) -> None:
        """The engine is loaded: restart the clock if nothing is done yet, so loading a model
        (minutes for a large one) does not count in the rate and the ETA."""
        if self.n == 0 and self.tokens == 0:
            self._start = self._last_line = self._clock()
        self._draw_bar()

    def update(self, n: int = 1, tokens: int = 0) -> None:
        """``n`` more generations done, with ``tokens`` output tokens between them."""
        self.n += n
        self.tokens += tokens
        if not self.show or self._closed:  # after close (a Ctrl-C), workers still finishing say nothing more
            return
        if self._tty:
            bar = self._draw_bar()
            if bar is None:
                return
            if self.tokens:
                bar.set_postfix_str(f"{self.tokens / max(self.elapsed, 1e-9):.1f} tok/s", refresh=False)
            if bar.n < self.n:
                bar.update(self.n - bar.n)
            return
        now = self._clock()
        if now - self._last_line >= self._interval and self.n + self.failed < self.total:
            self._last_line = now
            self._write(self.line())

    def fail(self, n: int = 1) -> None:
        """``n`` generations failed (counted apart: the work is not done)."""
        self.failed += n
        if self.show and self._tty and not self._closed and self._draw_bar() is not None:
            self._bar.set_postfix_str(f"{self.failed} failed", refresh=False)

    def _count(self) -> Any:
        return self.n, self.failed

    def line(self) -> str:
        """The plain progress line: done/total, percent, rate, ETA, tokens/s; with failures, how
        many failed, and never "done"."""
        elapsed = max(self.elapsed, 1e-9)
        if not self.failed:
            parts = _line_parts(self.desc, self.n, self.total, "generations", elapsed)
        else:
            parts = _line_parts(self.desc, self.n, None, "generations", elapsed)
            parts[0] = (f"{self.desc}: {self.n}/{self.total} generations "
                        f"({100 * self.n / max(self.total, 1):.0f}%), {self.failed} failed")
            if self.n + self.failed >= self.total:
                parts.append(f"ended in {_fmt_eta(elapsed)}")
        if self.tokens:
            parts.append(f"{self.tokens / elapsed:.1f} output tok/s")
        return ", ".join(parts)

    def close(self) -> None:
        """Finish: the bar is removed; in plain mode a final line is written, unless the last
        line already said the same (closed by a Ctrl-C right after it)."""
        if self._closed:
            return
        self._closed = True
        if not self.show:
            return
        if self._tty:
            if self._bar is not None:
                self._bar.close()
            return
        if not self._repeats():
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


# -- the other long stages: encoding, indexing, searching, reranking ------------------------------
def stage_bar(
    iterable: Iterable[Any] | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    leave: bool = True,
    **options: Any,
) -> Any:
    """The progress of one long stage, with tqdm's signature (``update``, ``close``, iteration):
    a tqdm bar when stderr is a terminal, a :class:`StageProgress` writing plain timestamped
    lines at the interval otherwise, nothing with progress off (:func:`configure`). A stage
    opened inside another one is drawn below it.

    ``options`` may hold ``stream`` (default stderr), ``clock`` and ``interval_s`` (tests);
    the rest go to tqdm.
    """
    stream = options.pop("stream", None) or sys.stderr
    clock = options.pop("clock", time.monotonic)
    interval = options.pop("interval_s", None)
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    if not enabled():
        return StageProgress(iterable, total=total, desc=desc, unit=unit, stream=stream, show=False)
    if not _isatty(stream):
        return StageProgress(iterable, total=total, desc=desc, unit=unit, stream=stream,
                             interval_s=interval, clock=clock)
    from tqdm import tqdm

    # tqdm puts a bar opened while another is on screen on the next free line, below it.
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=stream, dynamic_ncols=True,
                leave=leave, **options)


class StageProgress(_PlainLines):
    """A stage's progress as plain lines (a log file): ``desc: n/total unit (pct%), rate, ETA``
    with the wall time first, one per interval while it runs, and a last one when it ends if it
    ran long enough to write any (a short stage writes nothing). Iterating over it iterates over
    the wrapped iterable and counts each item.
    """

    def __init__(
        self, iterable: Iterable[Any] | None = None, *, total: int | None = None, desc: str = "",
        unit: str = "it", stream: TextIO | None = None, interval_s: float | None = None,
        clock: Any = time.monotonic, show: bool = True,
    ) -> None:
        self.iterable = iterable
        self.total = total
        self.desc = desc
        self.unit = unit
        self.n = 0
        self.show = show
        self.lines: list[str] = []  # the lines written, without their time (tests)
        self._stream = stream if stream is not None else sys.stderr
        self._interval = plain_interval() if interval_s is None else float(interval_s)
        self._clock = clock
        self._start = self._last = clock()
        self._lock = threading.Lock()
        self._closed = False

    def __iter__(self) -> Iterator[Any]:
        try:
            for item in self.iterable or ():
                yield item
                self.update(1)
        finally:
            self.close()

    def __len__(self) -> int:
        return int(self.total or 0)

    def __enter__(self) -> StageProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.n += n
            now = self._clock()
            if self.show and not self._closed and now - self._last >= self._interval and (
                    self.total is None or self.n < self.total):
                self._last = now
                self._write(self.line())

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        pass

    def _count(self) -> Any:
        return self.n

    def line(self) -> str:
        """The plain line (:func:`_line_parts`); a total of 0 counts as none: the count and the
        rate alone."""
        elapsed = self._clock() - self._start
        return ", ".join(_line_parts(self.desc, self.n, self.total or None, self.unit, elapsed))

    def close(self) -> None:
        """Finish: a last line when the stage wrote any before (a long stage) and it would not
        repeat the last one."""
        if self._closed:
            return
        self._closed = True
        if self.show and self.lines and not self._repeats():
            self._write(self.line())


def vllm_stage(show: bool, desc: str) -> Any:
    """What to pass as a vLLM engine's ``use_tqdm`` for a stage (embedding, scoring): False
    when nothing is shown, True (vLLM's own bar) on a terminal, else a factory of
    :class:`StageProgress` lines (vLLM also reads ``n``, ``format_dict`` and ``postfix``)."""
    if not (show and enabled()):
        return False
    if _isatty(sys.stderr):
        return True

    def factory(iterable: Any = None, *args: Any, **kwargs: Any) -> Any:
        if iterable is not None:  # vLLM's prompt-rendering loop: left as it is
            return iterable
        return _VLLMStage(StageProgress(total=kwargs.get("total"), desc=desc, unit="text"))

    return factory


class _VLLMStage:
    """tqdm's interface as vLLM's engine uses it, over a :class:`StageProgress`."""

    def __init__(self, inner: StageProgress) -> None:
        self._inner = inner
        self.postfix = ""

    @property
    def n(self) -> int:
        return self._inner.n

    @property
    def format_dict(self) -> dict[str, float]:
        return {"elapsed": max(self._inner._clock() - self._inner._start, 1e-9)}

    def update(self, n: int = 1) -> None:
        self._inner.update(n)

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        self._inner.close()


# -- log records above a bar ---------------------------------------------------------------------
class _AboveBars(logging.StreamHandler):  # type: ignore[type-arg]
    """A stderr log handler that, while a tqdm bar is on screen, writes through ``tqdm.write``
    (the bar is cleared, the message printed, the bar redrawn) instead of into the bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            if getattr(tqdm, "_instances", None) and _isatty(self.stream):
                tqdm.write(self.format(record), file=self.stream)
                return
        except Exception:  # noqa: BLE001 - fall back to a plain write
            pass
        super().emit(record)


def log_handler(stream: TextIO | None = None) -> logging.Handler:
    """The CLI's log handler on ``stream`` (stderr): messages as they are, above any bar."""
    handler = _AboveBars(stream if stream is not None else sys.stderr)
    handler.setFormatter(_Redacting("%(message)s"))
    return handler


class _Redacting(logging.Formatter):
    """Log lines with API keys, bearer tokens and URL credentials masked
    (:func:`~r2med_agent.redaction.redact`): a library's message (httpx, openai) may quote them."""

    def format(self, record: logging.LogRecord) -> str:
        from r2med_agent.redaction import redact

        return redact(super().format(record))
