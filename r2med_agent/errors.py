"""Errors a user can act on. The CLI prints their message (no traceback) and exits with ``exit_code``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'X'?)`` for the closest of ``choices`` to a misspelt ``name`` (case
    ignored), or an empty string when none is close."""
    import difflib

    by_low: dict[str, str] = {}
    for c in choices:
        by_low.setdefault(c.lower(), c)
    close = difflib.get_close_matches(name.strip().lower(), list(by_low), n=1, cutoff=0.6)
    return f" (did you mean '{by_low[close[0]]}'?)" if close else ""


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception in its chain of causes and contexts, each once."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]


class R2MedError(Exception):
    """Base class: a problem the user can fix; the message says what and how."""

    exit_code = 1


class DataError(R2MedError):
    """Malformed or inconsistent input data; the message names the file and line."""

    exit_code = 2

    def __init__(self, message: str, path: object | None = None, line: int | None = None) -> None:
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)
        self.path = path
        self.line = line


class ConfigError(R2MedError):
    """A bad option or configuration value; the message names the key and the allowed values."""

    exit_code = 2


class MissingExtraError(R2MedError):
    """An optional dependency is not installed; the message gives the install command."""

    exit_code = 3

    def __init__(self, package: str, extra: str, alternative: str = "") -> None:
        message = f"{package} is not installed; install it with: pip install 'r2med-agent[{extra}]'"
        super().__init__(f"{message} ({alternative})" if alternative else message)


class LLMError(R2MedError):
    """An LLM backend failed in a way retrying will not fix (bad key, bad request, model missing)."""

    exit_code = 4


def _size(n: int) -> str:
    """``n`` bytes for a person: kB below a megabyte (rounded up: never "0.0 MB"), else MB or GB."""
    if n < 1_000_000:
        return f"{max(-(-n // 1000), 1)} kB"
    if n < 1_000_000_000:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e9:.1f} GB"


class HubUnavailableError(R2MedError):
    """The Hugging Face hub could not be reached."""

    exit_code = 5


class DiskFullError(R2MedError):
    """A write ran out of space (or quota); what was written before it is intact."""

    exit_code = 6

    def __init__(self, path: object, needed_bytes: int | None = None) -> None:
        need = f" (about {_size(needed_bytes)} more needed)" if needed_bytes else ""
        super().__init__(
            f"{path}: no space left on the device{need}; free some space (or point the cache "
            "or output folder elsewhere) and run the same command again: finished work is kept"
        )
        self.path = path
        self.needed_bytes = needed_bytes


class PromptSourceError(R2MedError):
    """The authors' prompts of a run could not be had: no network and no clone, a mirror or clone
    at another commit, or a fetched file whose hash differs from the pinned one. Raised before any
    work; nothing already written is touched."""

    exit_code = 7
