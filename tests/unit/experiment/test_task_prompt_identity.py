"""A task's family and domain are part of a run's identity where the run renders them (issue 39,
items 13 and 16): a user config's task entry that gives a task of your own its domain is another
run than the one without it, both are kept, the result files say which domain ran, and a task of
your own that no entry describes is warned about at run time, with the fix."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from r2med_agent.cli.app import main
from r2med_agent.config import set_user_config
from r2med_agent.experiment.runner import RunConfig
from tests.unit.data.test_own_bright_names import own_split

ENTRY = "tasks:\n  pydocs: {source: local, family: qa, domain: Python programming}\n"


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    return own_split(tmp_path / "data", "pydocs")


def test_a_task_entrys_domain_is_another_run_where_prompts_render_it(root: Path, tmp_path: Path) -> None:
    def cfg(**kw) -> RunConfig:
        return RunConfig(tasks=("pydocs",), data_dir=root, **kw)

    plain_hyde = cfg(method="hyde", llm="smollm2")
    assert plain_hyde.entries is None
    assert RunConfig(tasks=("pydocs-long",), data_dir=root, method="hyde", llm="smollm2").entries is None
    config = tmp_path / "config.yaml"
    config.write_text(ENTRY)
    set_user_config(config)
    hyde = cfg(method="hyde", llm="smollm2")
    assert hyde.entries is not None and hyde.folder() != plain_hyde.folder()
    # the long setting of the split takes the entry's domain too
    assert RunConfig(tasks=("pydocs-long",), data_dir=root, method="hyde", llm="smollm2").entries is not None
    # a run that renders no prompt and no instruction is the same run with or without the entry
    assert cfg().entries is None
    assert cfg(retriever="minilm").entries is not None  # an encoder's instructions may name the domain
    config.write_text("tasks:\n  pydocs: {source: local, family: qa, domain: medical}\n")
    assert cfg(method="hyde", llm="smollm2").entries is None  # the domain it would get anyway


def _prompts(cache: Path) -> list[str]:
    with sqlite3.connect(cache) as db:
        rows = [json.loads(r[0]) for r in db.execute("SELECT request FROM generations")]
    return [m["content"] for r in rows for m in r["messages"] if m["role"] == "user"]


@pytest.mark.slow
def test_the_local_model_gets_the_entrys_domain_and_both_results_stay(root: Path, tmp_path: Path, smollm2_gguf,
                                                                      caplog) -> None:
    out = tmp_path / "out"
    args = ["run", "--task", "pydocs", "--data-dir", str(root), "--method", "hyde", "--llm", "smollm2",
            "--max-tokens", "8", "--retriever", "bm25-compat", "--no-progress", "-o", str(out)]
    assert main([*args, "--cache-path", str(tmp_path / "plain.sqlite")]) == 0
    warned = [r.getMessage() for r in caplog.records if "task pydocs has no task entry" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0]
    assert "medical post" in warned[0] and "domain: YOUR DOMAIN" in warned[0] and "--config FILE" in warned[0]
    caplog.clear()
    assert all("medical post" in p for p in _prompts(tmp_path / "plain.sqlite"))
    config = tmp_path / "config.yaml"
    config.write_text(ENTRY)
    assert main([*args, "--config", str(config), "--cache-path", str(tmp_path / "mine.sqlite")]) == 0
    assert "has no task entry" not in caplog.text
    prompts = _prompts(tmp_path / "mine.sqlite")
    assert prompts and all("Python programming post" in p for p in prompts)
    results = {json.loads(p.read_text())["domain"]: p for p in out.rglob("pydocs.json")}
    assert set(results) == {"medical", "Python programming"}  # two runs, two folders, both kept
    assert results["medical"].parent != results["Python programming"].parent
