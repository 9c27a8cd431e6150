"""Results of the agentic loops made before they followed the originals' code (loop_rules 1) are
another run: a result tree such a version wrote (its records lack ``loop_rules``) is refused as
another spec's, migrated to its own folder, stale for ``reproduce`` and its own ``compare`` row;
the records of every other method are read as before.

The old trees are what this version writes with the one field it added taken out of every record,
which is what the version before it wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from r2med_agent.cli.app import main
from r2med_agent.api import build_table, load_results
from r2med_agent.errors import ConfigError
from r2med_agent.experiment.resolve import resolve_spec
from r2med_agent.experiment.spec import LOOP_RULES, RunSpec
from r2med_agent.experiment.store import ResultStore
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.api import ReproduceOptions, RunConfig, format_plan, load_grid, plan, run_experiment
from tests.fakes import ScriptedLLM
from tests.result_trees import GOOD, MIXED, write_result

OLD = resolve_spec(RunSpec(method="search-o1", llm="scripted", loop_rules=1))
"""The spec an old Search-o1 run of the default settings reads as."""


@pytest.fixture
def scripted(monkeypatch):
    from r2med_agent.llm.registry import LLMSpec

    monkeypatch.setattr("r2med_agent.llm.registry.get_llm_spec",
                        lambda name: LLMSpec(name="scripted", backend="local", model="scripted"))


def _run(root: Path, method: str, answer: str) -> Path:
    """A real run of ``method`` on the sample task whose scripted LLM answers every prompt with
    ``answer``; returns its result folder."""
    llm = CachedLLM(ScriptedLLM(lambda messages, params: answer), "scripted", "plain",
                    GenerationCache(root.parent / f"gen-{answer[:8]}.sqlite"))
    cfg = RunConfig(tasks=("sample",), method=method, llm="scripted", output_dir=root, show_progress=False)
    return run_experiment(cfg, llm=llm).result_dir


def _drop_loop_rules(folder: Path) -> None:
    """Turn a folder this version wrote into what the version before ``loop_rules`` wrote."""
    for path in [*folder.glob("*.json")]:
        obj = json.loads(path.read_text(encoding="utf-8"))
        for block in (obj.get("config"), obj.get("spec")):
            if isinstance(block, dict):
                assert block.pop("loop_rules") == LOOP_RULES
        path.write_text(json.dumps(obj, indent=2), encoding="utf-8")


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _old_tree(root: Path, method: str = "search-o1", spec_json: bool = True) -> Path:
    folder = _run(root, method, "Insects fly towards light because they navigate by it.")
    _drop_loop_rules(folder)
    if not spec_json:  # as versions before spec.json left it
        (folder / "spec.json").unlink()
    return folder


@pytest.mark.parametrize("spec_json", [True, False], ids=["spec-era", "before-spec-json"])
def test_a_new_run_never_replaces_an_old_loop_result(tmp_path, scripted, spec_json) -> None:
    root = tmp_path / "results"
    folder = _old_tree(root, spec_json=spec_json)
    assert folder == root / "search-o1" / "scripted" / "bm25"  # the folder a new run of it gets
    before = _files(folder)
    with pytest.raises(ConfigError, match=r"results migrate") as err:
        _run(root, "search-o1", "Another answer.")
    assert "loop_rules=1" in str(err.value) and "nothing was written" in str(err.value)
    assert _files(folder) == before


def test_migrate_files_an_old_loop_result_in_its_own_folder(tmp_path, scripted, capsys) -> None:
    root = tmp_path / "results"
    folder = _old_tree(root)
    old = _files(folder)
    assert main(["results", "migrate", str(root)]) == 0
    assert "1 task result(s) moved" in capsys.readouterr().out
    target = root / OLD.folder()
    assert target.name.startswith("bm25__loops-v1__") and target != folder
    moved = {n: b for n, b in old.items() if n.startswith("sample.")}
    assert set(moved) >= {"sample.json", "sample.run", "sample.traces.jsonl"}
    assert {n: b for n, b in _files(target).items() if n.startswith("sample.")} == moved
    assert json.loads((target / "spec.json").read_text())["key"] == OLD.key()
    assert not [p.name for p in folder.iterdir() if not p.name.startswith(".")]  # spec.json went too
    # A new run now has the folder to itself; the old result stays where migrate put it.
    new = _run(root, "search-o1", "Another answer.")
    assert new == folder and (target / "sample.json").read_bytes() == old["sample.json"]
    assert main(["results", "migrate", str(root)]) == 0
    assert "0 task result(s) moved" in capsys.readouterr().out
    assert (target / "sample.json").read_bytes() == old["sample.json"]


def test_migrate_never_overwrites_a_result_in_the_old_loops_folder(tmp_path, scripted, capsys, caplog) -> None:
    root = tmp_path / "results"
    folder = _old_tree(root)
    target = root / OLD.folder()
    target.mkdir(parents=True)
    (target / "sample.json").write_text(json.dumps({"test": {}, "config": OLD.record()}))
    kept = (target / "sample.json").read_bytes()
    assert main(["results", "migrate", str(root)]) == 0
    assert "0 task result(s) moved" in capsys.readouterr().out
    assert f"{target} already holds this task's result; left where it is" in caplog.text
    assert (target / "sample.json").read_bytes() == kept and (folder / "sample.json").is_file()


def test_compare_shows_the_old_loops_as_their_own_row(tmp_path, scripted) -> None:
    root = tmp_path / "results"
    _old_tree(root)
    assert main(["results", "migrate", str(root)]) == 0
    _run(root, "search-o1", "Another answer.")
    labels = sorted(r.row.label for r in build_table(load_results([root]), "ndcg_at_10").rows)
    assert labels == ["search-o1/scripted/bm25", "search-o1/scripted/bm25 [loop_rules=1]"]


def test_other_methods_old_results_keep_their_spec_and_folder(tmp_path, scripted) -> None:
    root = tmp_path / "results"
    folder = _old_tree(root, method="hyde")
    assert folder == root / "hyde" / "scripted" / "bm25"
    found = list(ResultStore(root).results())
    assert [f.spec for f in found] == [resolve_spec(RunSpec(method="hyde", llm="scripted"))]
    assert main(["results", "migrate", str(root)]) == 0
    assert sorted(p.name for p in (root / "hyde" / "scripted").iterdir()) == ["bm25"]
    before = (folder / "sample.json").read_bytes()
    _run(root, "hyde", "A passage about light.")  # the same run: replaced, as before
    assert (folder / "sample.json").read_bytes() != before


def _strip(folder: Path, task: str) -> None:
    path = folder / f"{task}.json"
    rec = json.loads(path.read_text())
    del rec["config"]["loop_rules"]
    path.write_text(json.dumps(rec))


def test_reproduce_runs_an_old_loop_cell_again(tmp_path) -> None:
    out = tmp_path / "results"
    grid_file = tmp_path / "grid.yaml"
    # Both rows in the project's wording, as the results below were made (a grid's default is
    # the authors' prompts, another run).
    grid_file.write_text("title: t\nentries:\n  - {method: search-o1, llm: qwen3-32b, retriever: bge, "
                         "args: {prompts_from: own}}\n"
                         "  - {method: hyde, llm: qwen-7b, retriever: bm25, args: {prompts_from: own}}\n")
    grid = load_grid(grid_file)
    opts = ReproduceOptions(output_dir=out, tasks=("Biology",), generations="fresh")
    agentic = write_result(out, "search-o1", "qwen3-32b", "bge", "Biology", GOOD)
    hyde = write_result(out, "hyde", "qwen-7b", "bm25", "Biology", MIXED)
    assert [p.done for p in plan(grid, opts)] == [("Biology",), ("Biology",)]
    _strip(agentic, "Biology")
    _strip(hyde, "Biology")
    loop, other = plan(grid, opts)
    assert loop.stale == {"Biology": f"loop_rules 1, the entry {LOOP_RULES}"} and loop.pending == ("Biology",)
    assert "`r2med-agent results migrate` files it under its own folder" in format_plan([loop, other])
    assert other.done == ("Biology",) and not other.stale
