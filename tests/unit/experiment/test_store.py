"""The result store: one folder per spec, never another spec's folder, replacement said aloud,
migration that moves and never overwrites."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from r2med_agent.errors import ConfigError
from r2med_agent.experiment.resolve import resolve_spec
from r2med_agent.experiment.spec import RunSpec
from r2med_agent.experiment.store import SPEC_FILE, ResultStore, legacy_leaf
from r2med_agent.api import RunConfig, run_experiment


def _run(out: Path, **kw) -> Path:
    return run_experiment(RunConfig(tasks=("sample",), output_dir=out, show_progress=False, **kw)).result_dir


def test_a_rerun_replaces_its_own_result_and_says_so(tmp_path: Path, caplog) -> None:
    folder = _run(tmp_path, top_k=10)
    first = json.loads((folder / "sample.json").read_text())
    with caplog.at_level(logging.INFO, logger="r2med_agent.experiment.store"):
        assert _run(tmp_path, top_k=10) == folder
    assert f"replacing {folder / 'sample.json'} (the same run spec, made {first['evaluated_at']})" in caplog.text
    spec = json.loads((folder / SPEC_FILE).read_text())
    assert spec["key"] == resolve_spec(RunSpec(top_k=10)).key() and spec["folder"] == resolve_spec(RunSpec(top_k=10)).folder()


def test_a_folder_of_another_spec_is_never_written(tmp_path: Path) -> None:
    spec = resolve_spec(RunSpec(top_k=10))
    folder = tmp_path / spec.folder()
    folder.mkdir(parents=True)
    (folder / SPEC_FILE).write_text(json.dumps({"key": resolve_spec(RunSpec(top_k=11)).key()}))
    with pytest.raises(ConfigError, match="holds results of another run spec"):
        _run(tmp_path, top_k=10)
    assert sorted(p.name for p in folder.iterdir()) == [SPEC_FILE]


def test_migrate_never_overwrites_and_never_moves_a_link(tmp_path: Path) -> None:
    # An old folder (no spec.json) holding a depth-10 result, and that spec's own folder already
    # holding a result of the same task: the old one stays where it is.
    own = _run(tmp_path / "r", top_k=10)
    old = tmp_path / "r" / "none" / "none" / legacy_leaf(resolve_spec(RunSpec(top_k=10)))
    old.mkdir()
    for name in ("sample.json", "sample.run"):
        (old / name).write_bytes((own / name).read_bytes())
    assert ResultStore(tmp_path / "r").migrate() == []
    assert (old / "sample.json").is_file() and (own / "sample.json").is_file()
    # Once the target is free, the result moves; a symlinked run file beside it is left alone.
    (own / "sample.json").unlink()
    (own / "sample.run").unlink()
    (old / "sample.run").unlink()
    os.symlink(tmp_path / "elsewhere.run", old / "sample.run")
    moves = ResultStore(tmp_path / "r").migrate()
    assert moves == [(old / "sample.json", own / "sample.json")]
    assert (own / "sample.json").is_file() and not (own / "sample.run").exists()
    assert (old / "sample.run").is_symlink()


def test_find_takes_an_old_folder_only_for_its_own_spec(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    folder = _run(tmp_path, top_k=10)
    assert store.find(resolve_spec(RunSpec(top_k=10)), "sample") == folder / "sample.json"
    assert store.find(resolve_spec(RunSpec(top_k=11)), "sample") is None
    assert store.find(resolve_spec(RunSpec(top_k=10)), "Biology") is None
