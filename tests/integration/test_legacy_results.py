"""Results written by the release before run specs (tests/data/legacy-results, made on the embedded
sample with that release's CLI: plain BM25, BM25 at depth 10, HyDE with SmolLM2 run twice into one
folder (defaults, then --max-tokens 24 --temperature 0.9, which overwrote the first), and MiniLM at
bfloat16 reranked by smollm2-listwise at depth 5) load in `compare` and `report` with their own
numbers and the settings they were made with, and `results migrate` moves each to its own folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from r2med_agent.cli.app import main
from r2med_agent.api import build_table, load_results
from r2med_agent.experiment.spec import RunSpec
from r2med_agent.experiment.store import ResultStore

LEGACY = Path(__file__).resolve().parents[1] / "data" / "legacy-results"

EXPECTED_LABELS = {
    "none/none/bm25": "none/none/bm25",
    "none/none/bm25__k10": "none/none/bm25 [top_k=10]",
    "hyde/smollm2/bm25": "hyde/smollm2/bm25 [sampling.max_tokens=24, sampling.temperature=0.9]",
    "none/none/minilm__bfloat16__smollm2-listwise": "none/none/minilm/smollm2-listwise [precision=bfloat16, rerank_k=5]",
}


@pytest.fixture
def legacy(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    shutil.copytree(LEGACY, root)
    return root


def _recorded(root: Path) -> dict[str, float]:
    """Folder (as the old release named it) -> the nDCG@10 its result file holds."""
    return {str(p.parent.relative_to(root)): json.loads(p.read_text())["test"]["ndcg_at_10"]
            for p in root.rglob("sample.json")}


def test_the_fixture_is_what_the_old_release_wrote() -> None:
    assert set(_recorded(LEGACY)) == set(EXPECTED_LABELS)
    assert not any(LEGACY.rglob("spec.json"))


def test_compare_reads_old_folders_by_their_recorded_settings(legacy: Path) -> None:
    recorded = _recorded(legacy)
    table = build_table(load_results([legacy]), "ndcg_at_10")
    by_label = {r.row.label: r.values["sample"] for r in table.rows}
    assert by_label == {EXPECTED_LABELS[folder]: score for folder, score in recorded.items()}
    # The precision is a setting of the row, never a reranker called bfloat16.
    row = next(r.row for r in table.rows if r.row.retriever == "minilm")
    assert row.reranker == "smollm2-listwise" and row.settings["precision"] == "bfloat16"


def test_compare_and_report_commands_show_the_same_numbers(legacy: Path, tmp_path: Path, capsys) -> None:
    assert main(["compare", str(legacy), "--format", "csv"]) == 0
    out = capsys.readouterr().out
    for folder, score in _recorded(legacy).items():
        assert f"{score:.4f}" in out
    assert main(["compare", str(legacy), "--format", "rich"]) == 0
    shown = capsys.readouterr().out
    assert "[top_k=10]" in shown and "precision=bfloat16" in shown  # settings shown, not eaten as markup
    assert main(["compare", str(legacy), "--format", "md"]) == 0
    assert "| none | none | bm25 | — | top_k=10 |" in capsys.readouterr().out
    assert main(["report", str(legacy), "--out", str(tmp_path / "report"), "--no-texts"]) == 0
    html = (tmp_path / "report" / "report.html").read_text()
    for score in _recorded(legacy).values():
        assert f"{score:.4f}" in html
    assert "precision=bfloat16" in html


def test_a_new_run_never_writes_over_an_old_result_of_other_settings(legacy: Path, capsys) -> None:
    # hyde/smollm2/bm25 holds the t=0.9 run: the default HyDE run's folder has the same name.
    before = (legacy / "hyde" / "smollm2" / "bm25" / "sample.json").read_bytes()
    code = main(["run", "--task", "sample", "-o", str(legacy), "--method", "hyde", "--llm", "smollm2",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "results migrate" in err and "temperature=0.9" in err
    assert (legacy / "hyde" / "smollm2" / "bm25" / "sample.json").read_bytes() == before


def test_migrate_moves_each_result_to_its_own_folder(legacy: Path, capsys) -> None:
    recorded = _recorded(legacy)
    assert main(["results", "migrate", str(legacy), "--dry-run"]) == 0
    assert "3 task result(s) to move" in capsys.readouterr().out
    assert _recorded(legacy) == recorded  # a dry run moves nothing
    assert main(["results", "migrate", str(legacy)]) == 0
    assert "3 task result(s) moved" in capsys.readouterr().out
    store = ResultStore(legacy)
    for found in store.results():
        assert found.folder == store.folder(found.spec)
        assert json.loads((found.folder / "spec.json").read_text())["key"] == found.spec.key()
        for suffix in (".run", ".json"):
            assert (found.folder / f"sample{suffix}").is_file()
    assert (legacy / "hyde" / "smollm2" / RunSpec(method="hyde", llm="smollm2", sampling={
        "max_tokens": 24, "temperature": 0.9}).leaf / "sample.generations.jsonl").is_file()
    # The same rows and numbers as before the move; migrating again moves nothing.
    table = build_table(load_results([legacy]), "ndcg_at_10")
    assert {r.row.label: r.values["sample"] for r in table.rows} == {
        EXPECTED_LABELS[f]: s for f, s in recorded.items()}
    assert main(["results", "migrate", str(legacy)]) == 0
    assert "0 task result(s) moved" in capsys.readouterr().out
    assert main(["results", "list", str(legacy)]) == 0
    listing = capsys.readouterr().out
    assert "[top_k=10]" in listing and "precision=bfloat16" in listing
