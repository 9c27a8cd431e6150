"""End to end, through the CLI: a trained-format entry run on ``sample`` (its first two queries) with the local model
(SmolLM2 on llama.cpp) fetches its authors' prompts from a local mirror (a real HTTP server on
loopback serving the pinned files in raw.githubusercontent's layout, built from the pinned copy
under ``R2MED_REFERENCE_CODE``), records the commit, and is another run, in another folder and
another ``compare`` row, than the same run with ``--prompts own``. A later run with no network at
all finds the prompts in the cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from r2med_agent.prompts import sources as ps
from r2med_agent.cli.app import main
from tests.conformance.conftest import reference_repo
from tests.prompt_mirror import LoopbackMirror, closed_port_url, mirror_files
from tests.sample_subset import sample_subset


@pytest.mark.slow
def test_authors_prompts_fetched_recorded_and_labelled_apart(tmp_path, monkeypatch, capsys, smollm2_spec) -> None:
    source = ps.prompt_sources()["ReasonRank"]
    copy = reference_repo(source.repo)
    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("R2MED_PROMPTS_DIR", raising=False)
    results = tmp_path / "results"
    data = sample_subset(tmp_path / "data")  # two queries: two windows a run
    common = ["run", "--task", "sample", "--data-dir", str(data), "--allow-count-mismatch", "--reranker",
              "smollm2-reasonrank", "--rerank-k", "4", "--output-dir", str(results), "--cache-path",
              str(tmp_path / "gen.sqlite"), "--no-progress"]
    with LoopbackMirror(mirror_files(tmp_path / "mirror", source, copy)) as server:
        monkeypatch.setenv(ps.BASE_URL_ENV, server.url)
        assert main([*common, "--prompts", "authors"]) == 0
        assert server.paths == [f"/8421BCD/ReasonRank/{source.commit}/utils.py"]
    (authors_json,) = results.glob("none/none/*/sample.json")
    assert authors_json.parent.name == f"bm25__authors-ReasonRank@{source.commit[:8]}__rk4__smollm2-reasonrank__" \
                                      f"{authors_json.parent.name.rsplit('__', 1)[1]}"
    record = json.loads(authors_json.read_text())
    assert record["config"]["prompts_from"] == f"8421BCD/ReasonRank@{source.commit[:12]}"
    (imported,) = record["config"]["prompts_import"]
    assert imported["commit"] == source.commit and imported["files"] == {"utils.py": source.files["utils.py"]}
    assert record["stats"]["rerank"]["generations"] == 2  # one window of 4 per query

    # No network from here on: the run's own wording needs none, and the authors' is cached.
    monkeypatch.setenv(ps.BASE_URL_ENV, closed_port_url())
    assert main(common + ["--prompts", "own"]) == 0
    (own_json,) = [p for p in results.glob("none/none/*/sample.json") if p != authors_json]
    own = json.loads(own_json.read_text())
    assert own["config"]["prompts_from"] == "own" and own["config"]["prompts_import"] == []
    assert own["stats"]["rerank"]["generations"] == 2  # other prompts: nothing from the cache
    assert main([*common, "--prompts", "authors"]) == 0  # cached prompts, cached generations
    again = json.loads(authors_json.read_text())
    assert again["stats"]["rerank"]["generations"] == 0 and again["test"] == record["test"]

    capsys.readouterr()
    assert main(["compare", str(results), "--format", "csv"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "smollm2-reasonrank" in line]
    assert len(rows) == 2
    assert sum(f"prompts_from=8421BCD/ReasonRank@{source.commit[:12]}" in row for row in rows) == 1
