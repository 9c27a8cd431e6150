"""A result reads back, labels and migrates the same in a process that lacks the plugin that
wrote it (issue 28, item 1): the run spec is pure data, resolved against the registries only when
a run is built. Before, ``compare`` in a process without the method labelled a toy method's row
``keywords/scripted/bm25/t0.3__f7ee6500``, the settings token taken as the reranker."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from r2med_agent.cli.app import main
from r2med_agent.experiment.spec import RunSpec
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.registry import get_llm_spec
from r2med_agent.methods import METHODS, ExpansionMethod
from tests.fakes import ScriptedLLM

LLM = "qwen-7b"  # a vLLM entry; the scripted backend stands in for the engine


class Keywords(ExpansionMethod):
    """A toy method: asks for search keywords; BM25 searches with the query and the keywords."""

    name = "keywords"
    combine = "lamer"


def test_a_toy_methods_result_reads_back_whole_without_the_toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from r2med_agent.llm.cache.wrapper import CachedLLM

    def make_llm(name, **_):
        model = get_llm_spec(name).model
        backend = ScriptedLLM(lambda msgs, p: "fever, cough, rash", model_id=model)
        return CachedLLM(backend, model, "plain", GenerationCache(tmp_path / "gen.sqlite"))

    monkeypatch.setattr("r2med_agent.llm.make_llm", make_llm)
    monkeypatch.setitem(METHODS, "keywords", Keywords)  # the one registry line, in this process only
    prompts = tmp_path / "prompts"
    (prompts / "keywords").mkdir(parents=True)
    (prompts / "keywords" / "qa.j2").write_text("Give search keywords for this {{ domain }} question.\n\n{{ query }}\n")
    monkeypatch.setenv("R2MED_PROMPTS_DIR", str(prompts))
    out = tmp_path / "results"
    assert main(["run", "--method", "keywords", "--llm", LLM, "--prompts", "own", "--task", "sample",
                 "--temperature", "0.3", "-o", str(out), "--no-progress"]) == 0
    (result,) = out.glob("keywords/*/*/sample.json")
    written = RunSpec.from_record(json.loads(result.read_text())["config"])
    assert written.reranker is None and written.sampling == {"temperature": 0.3}
    label = written.label
    assert label.startswith(f"keywords/{LLM}/bm25 [") and "temperature=0.3" in label, label

    # Another process, without the toy method: the same spec, label, folder and compare row.
    env = {k: v for k, v in os.environ.items() if k != "R2MED_PROMPTS_DIR"}
    code = ("import json, sys; from pathlib import Path; from r2med_agent.experiment.spec import RunSpec; "
            "from r2med_agent.methods import METHODS; assert 'keywords' not in METHODS; "
            "s = RunSpec.from_record(json.loads(Path(sys.argv[1]).read_text())['config']); "
            "print(json.dumps([s.label, s.folder(), s.key(), RunSpec.from_key(s.key()) == s]))")
    proc = subprocess.run([sys.executable, "-c", code, str(result)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [label, written.folder(), written.key(), True]
    table = tmp_path / "compare.csv"
    proc = subprocess.run([sys.executable, "-m", "r2med_agent", "compare", str(out), "--format", "csv", "--out", str(table)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [r for r in csv.DictReader(table.read_text().splitlines()) if r["method"] != "average"]
    assert [(r["method"], r["llm"], r["retriever"], r["reranker"], r["settings"]) for r in rows] == [
        ("keywords", LLM, "bm25", "", label.partition(" [")[2].rstrip("]"))], rows
