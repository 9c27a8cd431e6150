"""A new query-expansion method is one class, one registry line and its templates: a toy method
added that way runs end to end through the CLI with the real local model (SmolLM2 on llama.cpp),
and its results land in a folder of their own, scored as pytrec_eval scores its run file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from r2med_agent.cli.app import main
from r2med_agent.data import load_task
from r2med_agent.evaluation import evaluate, read_trec_run
from r2med_agent.methods import METHODS, ExpansionMethod

pytestmark = pytest.mark.slow


class Keywords(ExpansionMethod):
    """Asks the model for search keywords; BM25 searches with the query and the keywords."""

    name = "keywords"
    combine = "lamer"  # the query, then the generated text


def test_a_toy_method_runs_end_to_end(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(METHODS, "keywords", Keywords)  # the one registry line
    prompts = tmp_path / "prompts"
    (prompts / "keywords").mkdir(parents=True)
    (prompts / "keywords" / "qa.j2").write_text(
        "Give five search keywords, comma-separated, for this {{ domain }} question.\n\n{{ query }}\n\nKeywords:"
    )
    monkeypatch.setenv("R2MED_PROMPTS_DIR", str(prompts))
    out = tmp_path / "results"
    code = main(["run", "--method", "keywords", "--llm", "smollm2", "--task", "sample", "--max-tokens", "16",
                 "-o", str(out), "--no-progress"])
    assert code == 0
    (result,) = out.glob("keywords/smollm2/*/sample.json")
    record = json.loads(result.read_text())
    assert record["config"]["method"] == "keywords" and record["config"]["prompts"]
    gens = [json.loads(line) for line in result.with_name("sample.generations.jsonl").read_text().splitlines()]
    task = load_task("sample")
    assert [g["id"] for g in gens] == [q.query_id for q in task.queries]
    assert {g["query_used"] for g in gens} <= {"lamer", "none"} and any(g["query_used"] == "lamer" for g in gens)
    ev = evaluate(read_trec_run(result.with_name("sample.run")), task.qrels)
    assert record["test"]["ndcg_at_10"] == pytest.approx(ev.mean["ndcg_at_10"])
    assert "keywords/smollm2/bm25" in capsys.readouterr().out
