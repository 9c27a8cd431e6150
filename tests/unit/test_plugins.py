"""One registration style for the five groups of components, and plugin discovery through entry
points of the group ``r2med_agent.plugins`` (issue 36 item 2); the CLI side runs in
tests/integration/test_plugin_package.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from r2med_agent import plugins
from r2med_agent.errors import ConfigError
from r2med_agent.llm.registry import BACKENDS, LLMSpec, make_backend
from r2med_agent.methods import METHODS, HyDE, get_method
from r2med_agent.plugins import PluginError, register, registry
from r2med_agent.retrieval.registry import ENCODERS, RETRIEVER_KINDS, RetrieverKind, retriever_kind
from r2med_agent.rerank.kinds import RERANKER_KINDS, RerankerKind, reranker_kind


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    """Plugins not loaded yet, and every registry put back as it was after the test."""
    monkeypatch.setattr(plugins, "_state", {"loaded": False, "error": None, "current": None})
    monkeypatch.setenv(plugins.PLUGIN_ENV, "")  # set, so that the test's own changes are undone
    saved = {group: (dict(registry(group)._entries), dict(registry(group)._origins)) for group in plugins.GROUPS}
    yield
    for group, (entries, origins) in saved.items():
        registry(group)._entries.clear()
        registry(group)._entries.update(entries)
        registry(group)._origins.clear()
        registry(group)._origins.update(origins)


class Echo:
    def __init__(self, entry) -> None:
        self.model_id = entry.model


def test_every_group_registers_the_same_way_and_its_lookups_find_it(fresh) -> None:
    class Mine(HyDE):
        name = "mine"

    register("methods", "mine", Mine)
    register("retrievers", "mine", RetrieverKind(lambda: ["mine-word"], lambda w, t, o: None, combine="text"))
    register("rerankers", "mine", RerankerKind(lambda entry, options: None, has_model=True))
    register("encoders", "mine-encoder", lambda: None)
    register("llm-backends", "echo", Echo)
    assert get_method("Mine") is Mine and METHODS.origin("mine") == "Python"
    assert retriever_kind("mine-word") is RETRIEVER_KINDS["mine"]
    assert reranker_kind("mine").has_model and "mine" in RERANKER_KINDS
    assert retriever_kind("mine-encoder") is RETRIEVER_KINDS["encoders"] and "mine-encoder" in ENCODERS
    entry = LLMSpec(name="e", backend="echo", model="m")
    assert isinstance(make_backend(entry), Echo) and "echo" in BACKENDS
    with pytest.raises(ConfigError, match="unknown component group 'method'; allowed: methods, retrievers"):
        register("method", "x", Mine)


def test_a_taken_name_is_refused_and_replace_never_takes_a_built_in_one(fresh) -> None:
    with pytest.raises(PluginError, match="methods name 'hyde' is taken by the registry \\(built in\\)"):
        register("methods", "hyde", HyDE, replace=True)
    register("llm-backends", "echo", Echo)
    with pytest.raises(PluginError, match="'echo' is taken by the registry \\(Python\\)"):
        register("llm-backends", "echo", Echo)
    register("llm-backends", "echo", Echo, replace=True)
    # A word another retriever kind answers to, an encoder of the encoder registry: refused.
    with pytest.raises(PluginError, match="retriever name 'bm25' is taken by the registry \\(kind bm25\\)"):
        register("retrievers", "mine", RetrieverKind(lambda: ["bm25"], lambda w, t, o: None, combine="text"))
    with pytest.raises(PluginError, match="retriever name 'minilm' is taken by the registry \\(kind dense\\)"):
        register("encoders", "minilm", lambda: None)
    with pytest.raises(PluginError, match="must be a RerankerKind"):
        register("rerankers", "mine", lambda entry, options: None)
    with pytest.raises(PluginError, match="method 'x' must be a class"):
        register("methods", "x", HyDE())
    with pytest.raises(ValueError, match="backend 'nope' is not one of 'vllm', 'openai', 'local', 'python', 'echo'"):
        LLMSpec(name="e", backend="nope", model="m")


def _dist(site: Path, module: str, source: str, value: str | None = None) -> None:
    (site / f"{module}.py").write_text(source, encoding="utf-8")
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(f"[r2med_agent.plugins]\n{module} = {value or module}\n", encoding="utf-8")


def test_entry_points_load_once_lazily_when_a_registry_is_read(fresh, tmp_path: Path, monkeypatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    _dist(site, "toy_module", "from r2med_agent.methods import HyDE\nfrom r2med_agent.plugins import register\n"
                              "COUNT = [0]\nclass T(HyDE):\n    name = 't'\nregister('methods', 't', T)\n")
    _dist(site, "toy_callable", "from r2med_agent.plugins import register\nCALLS = []\n"
                                "def setup():\n    CALLS.append(1)\n    register('llm-backends', 'toy', 'x.y:Z')\n",
          value="toy_callable:setup")
    monkeypatch.syspath_prepend(str(site))
    assert "toy_module" not in sys.modules  # nothing loaded at import or at the path change
    assert "t" in METHODS and "toy" in BACKENDS  # the first read loads both
    assert METHODS.origin("t") == "plugin 'toy_module' (toy_module) of distribution toy_module 0.1"
    assert len(METHODS) and sys.modules["toy_callable"].CALLS == [1]  # once
    plugins.add_plugin_modules(["toy_module"])  # already imported: a second import registers nothing
    assert sys.modules["toy_callable"].CALLS == [1]
    assert os.environ[plugins.PLUGIN_ENV] == "toy_module"  # the processes this one starts load it too


def test_a_failing_plugin_fails_every_read_with_one_line(fresh, tmp_path: Path, monkeypatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    _dist(site, "toy_broken", "raise RuntimeError('no GPU here\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(site))
    for _ in range(2):
        with pytest.raises(PluginError) as err:
            get_method("hyde")
        assert str(err.value) == ("plugin 'toy_broken' (toy_broken) of distribution toy_broken 0.1 failed to load: "
                                  "RuntimeError: no GPU here")


def test_modules_named_by_the_environment_load_as_plugins(fresh, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "toy_env_plugin.py").write_text(
        "from r2med_agent.plugins import register\nregister('llm-backends', 'env-toy', 'x.y:Z')\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(plugins.PLUGIN_ENV, " toy_env_plugin , ")
    assert BACKENDS.origin("env-toy") is None
    assert "env-toy" in BACKENDS and BACKENDS.origin("env-toy") == "plugin module 'toy_env_plugin'"
