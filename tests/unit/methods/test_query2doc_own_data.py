"""Query2Doc on a task of your own: a task the registry does not know (family ``qa``, domain
``medical``) gets the package's medical-sciences worked examples, or its own from a prompts
folder, from the CLI and the Python API alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from r2med_agent.prompts import templates as prompt_templates
from r2med_agent.paths import prompts_dir, resources_dir

EXAMPLE = {"query": "Why does my knee swell after running?", "passage": "Exercise can inflame the synovium."}


def _small_task(folder: Path, queries: int = 2) -> Path:
    """The first ``queries`` queries of the packaged sample, with its corpus, as a folder of one's own."""
    shutil.copytree(resources_dir() / "sample", folder)
    kept = (folder / "query.jsonl").read_text(encoding="utf-8").splitlines()[:queries]
    (folder / "query.jsonl").write_text("\n".join(kept) + "\n", encoding="utf-8")
    ids = {json.loads(line)["id"] for line in kept}
    qrels = [line for line in (folder / "qrels.jsonl").read_text(encoding="utf-8").splitlines()
             if json.loads(line)["q_id"] in ids]
    (folder / "qrels.jsonl").write_text("\n".join(qrels) + "\n", encoding="utf-8")
    return folder


def test_a_task_of_ones_own_gets_the_medical_examples_or_its_own():
    medical = prompt_templates.load_examples("query2doc", "qa", "medical sciences")
    assert prompt_templates.load_examples("query2doc", "qa", "medical", task="my-medicine") == medical
    # Any domain a user config gives that the file lacks falls back the same way.
    assert prompt_templates.load_examples("query2doc", "qa", "cardiology", task="Cardio") == medical


def test_a_prompts_folder_gives_a_task_its_own_examples_or_a_default(tmp_path):
    folder = tmp_path / "query2doc" / "examples"
    folder.mkdir(parents=True)
    shutil.copy(prompts_dir() / "query2doc" / "examples" / "qa.yaml", folder / "qa.yaml")
    with (folder / "qa.yaml").open("a", encoding="utf-8") as f:
        f.write(f"my-medicine:\n  - query: {EXAMPLE['query']}\n    passage: {EXAMPLE['passage']}\n")
    got = prompt_templates.load_examples("query2doc", "qa", "medical", prompts_dir=tmp_path, task="my-medicine")
    assert got == [EXAMPLE]
    (folder / "qa.yaml").write_text(f"default:\n  - query: {EXAMPLE['query']}\n    passage: {EXAMPLE['passage']}\n",
                                    encoding="utf-8")
    assert prompt_templates.load_examples("query2doc", "qa", "medical", prompts_dir=tmp_path, task="x") == [EXAMPLE]


def test_query2doc_runs_on_a_folder_of_ones_own_from_the_python_api(tmp_path):
    import r2med_agent

    data = _small_task(tmp_path / "my-medicine")
    seen: list[str] = []

    def write(prompts: list[list[dict[str, str]]]) -> list[str]:
        seen.extend(p[-1]["content"] for p in prompts)
        return ["The answer is a diagnosis of the case."] * len(prompts)

    result = r2med_agent.evaluate_llm(write, "my-writer", data_dir=data, method="query2doc",
                                      output_dir=tmp_path / "results", cache_path=tmp_path / "gen.sqlite")
    assert [o.task for o in result.outcomes] == ["my-medicine"]
    medical = prompt_templates.load_examples("query2doc", "qa", "medical sciences")
    assert len(seen) == 2 and all(medical[0]["passage"][:60] in prompt for prompt in seen)


@pytest.mark.slow
def test_query2doc_runs_on_a_folder_of_ones_own_from_the_cli_with_the_local_model(tmp_path, smollm2_spec):
    from r2med_agent.cli import main

    data = _small_task(tmp_path / "my-medicine")
    out = tmp_path / "results"
    assert main(["run", "--method", "query2doc", "--llm", "smollm2", "--data-dir", str(data), "-o", str(out),
                 "--max-tokens", "16", "--cache-path", str(tmp_path / "gen.sqlite"), "--no-progress"]) == 0
    [record] = [p for p in out.rglob("my-medicine.json")]
    assert record.parent.parts[-3:-1] == ("query2doc", "smollm2")
    rows = [json.loads(r) for r in (record.parent / "my-medicine.generations.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["query_used"] == "query2doc" for r in rows)
    assert json.loads(record.read_text())["num_queries"] == 2
