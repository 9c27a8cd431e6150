"""Download dataset snapshots from the Hugging Face hub, failing fast when it cannot be reached.

Snapshots land in ``paths.cache_dir() / "hub"`` (the usual huggingface_hub cache layout). A revision
that is a full commit hash is immutable, so a cached copy is used without touching the network; a
branch such as ``main`` is resolved online when the hub answers and falls back to the cached copy
when it does not. Before any download a single request with a short connect timeout checks that the
hub answers, so an unreachable hub costs a couple of seconds, not minutes of retries.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

from r2med_agent.errors import ConfigError, HubUnavailableError
from r2med_agent.paths import cache_dir

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 3.0
"""Seconds to wait for a TCP/TLS connection to the hub before declaring it unreachable."""

READ_TIMEOUT_S = 15.0
"""Seconds to wait for the reachability probe's answer once connected."""

_COMMIT = re.compile(r"[0-9a-f]{40}")
_DEFAULT_ENDPOINT = "https://huggingface.co"


def hub_cache_dir() -> Path:
    """Where hub snapshots are kept: ``cache_dir()/hub`` (``R2MED_CACHE_DIR`` moves it)."""
    return cache_dir() / "hub"


def hub_endpoint() -> str:
    """The hub URL, read from ``HF_ENDPOINT`` at call time (huggingface_hub reads it at import)."""
    return (os.environ.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT).rstrip("/")


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` asks for no network traffic."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


@functools.lru_cache(maxsize=None)
def _endpoint_unreachable(endpoint: str) -> str | None:
    import httpx

    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    try:
        httpx.head(endpoint, timeout=timeout)
    except httpx.TimeoutException:
        return f"no answer from {endpoint} within {CONNECT_TIMEOUT_S:g} s"
    except httpx.HTTPError as e:
        return f"{endpoint}: {_one_line(e) or type(e).__name__}"
    return None  # any HTTP answer: the hub is there


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached (one quick request per process and endpoint, remembered),
    or None when it answers or ``HF_HUB_OFFLINE`` is set (huggingface_hub then stays offline
    by itself). Model loaders use it to go ``local_files_only`` at once instead of retrying."""
    if hub_offline():
        return None
    return _endpoint_unreachable(hub_endpoint())


def is_commit(revision: str) -> bool:
    """True for a full 40-hex commit hash (an immutable revision)."""
    return bool(_COMMIT.fullmatch(revision))


def fetch_snapshot(
    repo_id: str, revision: str, allow_patterns: Sequence[str], *, hint: str
) -> Path:
    """Return a local folder holding the files of dataset ``repo_id@revision`` that match the patterns.

    Args:
        repo_id: hub dataset repo (``R2MED/Biology``).
        revision: commit hash, branch or tag.
        allow_patterns: glob patterns of the files to fetch (only those are downloaded).
        hint: what a local copy must look like, used in the error message (``--data-dir`` advice).

    Raises:
        HubUnavailableError: the hub cannot be reached (or offline mode is on) and no complete cached
            copy exists.
        ConfigError: the hub answers but does not know the repo or the revision.
    """
    patterns = list(allow_patterns)
    if is_commit(revision) or hub_offline():
        cached = _cached_snapshot(repo_id, revision, patterns)
        if cached is not None:
            return cached
    endpoint = hub_endpoint()
    where = f"{repo_id}@{revision[:12] if is_commit(revision) else revision}"
    if hub_offline():
        raise HubUnavailableError(
            f"HF_HUB_OFFLINE is set and no cached copy of {where} exists; unset it to download, "
            f"or pass --data-dir DIR where DIR holds {hint}."
        )
    reason = _probe(endpoint, repo_id, revision)
    if reason is not None:
        cached = None if is_commit(revision) else _cached_snapshot(repo_id, revision, patterns)
        if cached is not None:
            logger.warning("hub unreachable (%s); using the cached copy of %s", reason, where)
            return cached
        raise HubUnavailableError(
            f"Cannot reach the Hugging Face hub at {endpoint} to download {where} ({reason}); "
            f"pass --data-dir DIR where DIR holds {hint}."
        )
    from huggingface_hub import snapshot_download

    logger.info("downloading %s from %s into %s", where, endpoint, hub_cache_dir())
    try:
        folder = snapshot_download(
            repo_id,
            repo_type="dataset",
            revision=revision,
            cache_dir=str(hub_cache_dir()),
            allow_patterns=patterns,
            endpoint=endpoint,
        )
    except _hub_errors() as e:
        raise HubUnavailableError(
            f"Downloading {where} from {endpoint} failed ({type(e).__name__}: {_one_line(e)}); "
            f"pass --data-dir DIR where DIR holds {hint}."
        ) from None
    return Path(folder)


def fetch_file(repo_id: str, revision: str, filename: str, *, hint: str) -> Path | None:
    """Return a local copy of one file of dataset ``repo_id@revision``, or None when the repo has
    no such file at that revision.

    Unlike :func:`fetch_snapshot`, a cached snapshot of the same revision that lacks the file
    (e.g. one downloaded for the task's data only) does not count: the file itself must be cached,
    else it is downloaded.

    Raises:
        HubUnavailableError: the hub cannot be reached (or offline mode is on) and the file is not
            cached.
        ConfigError: the hub answers but does not know the repo or the revision.
    """
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    where = f"{repo_id}@{revision[:12] if is_commit(revision) else revision}"
    if is_commit(revision) or hub_offline():
        cached = try_to_load_from_cache(
            repo_id, filename, cache_dir=str(hub_cache_dir()), revision=revision, repo_type="dataset"
        )
        if isinstance(cached, str):
            return Path(cached)
    endpoint = hub_endpoint()
    if hub_offline():
        raise HubUnavailableError(
            f"HF_HUB_OFFLINE is set and {filename} of {where} is not cached; unset it to download, "
            f"or pass --data-dir DIR where DIR holds {hint}."
        )
    reason = _probe(endpoint, repo_id, revision)
    if reason is not None:
        raise HubUnavailableError(
            f"Cannot reach the Hugging Face hub at {endpoint} to download {filename} of {where} "
            f"({reason}); pass --data-dir DIR where DIR holds {hint}."
        )
    from huggingface_hub.errors import EntryNotFoundError

    logger.info("downloading %s of %s from %s", filename, where, endpoint)
    try:
        path = hf_hub_download(
            repo_id, filename, repo_type="dataset", revision=revision,
            cache_dir=str(hub_cache_dir()), endpoint=endpoint,
        )
    except EntryNotFoundError:
        return None
    except _hub_errors() as e:
        raise HubUnavailableError(
            f"Downloading {filename} of {where} from {endpoint} failed ({type(e).__name__}: "
            f"{_one_line(e)}); pass --data-dir DIR where DIR holds {hint}."
        ) from None
    return Path(path)


def _cached_snapshot(repo_id: str, revision: str, patterns: list[str]) -> Path | None:
    """The cached snapshot folder, or None when none is complete (no network traffic)."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            repo_id,
            repo_type="dataset",
            revision=revision,
            cache_dir=str(hub_cache_dir()),
            allow_patterns=patterns,
            local_files_only=True,
        )
    except _hub_errors() as e:
        logger.debug("no usable cached snapshot of %s@%s: %s", repo_id, revision, _one_line(e))
        return None
    return Path(folder)


def _probe(endpoint: str, repo_id: str, revision: str) -> str | None:
    """One quick request to the hub's API; returns why it is unusable, or None when it answers.

    Raises:
        ConfigError: the hub answered 404 (unknown repo or revision).
    """
    import httpx

    url = f"{endpoint}/api/datasets/{repo_id}/revision/{revision}"
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    try:
        response = httpx.get(url, timeout=timeout, follow_redirects=True)
    except httpx.TimeoutException:
        return f"no answer within {CONNECT_TIMEOUT_S:g} s"
    except httpx.HTTPError as e:
        return _one_line(e) or type(e).__name__
    if response.status_code == 404:
        raise ConfigError(
            f"the hub at {endpoint} has no dataset {repo_id} at revision {revision!r}; fix the task's "
            "'revision' (configs/tasks.yaml, or a 'tasks:' entry in your user config)"
        )
    if response.status_code == 429 or response.status_code >= 500:
        return f"HTTP {response.status_code} from {url}"
    # 2xx, or 401/403 for a gated or private repo: huggingface_hub sends the user's token and
    # reports any remaining problem itself.
    return None


def _hub_errors() -> tuple[type[BaseException], ...]:
    """Exceptions a failed hub download can raise across huggingface_hub versions."""
    errors: list[type[BaseException]] = [OSError]
    try:
        import httpx

        errors.append(httpx.HTTPError)
    except ImportError:  # pragma: no cover - httpx is a core dependency
        pass
    for module_name, attr in (("httpx2", "HTTPError"), ("requests", "RequestException")):
        try:
            module = __import__(module_name)
        except ImportError:
            continue
        cls = getattr(module, attr, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            errors.append(cls)
    return tuple(errors)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:200] + ("..." if len(text) > 200 else "")
