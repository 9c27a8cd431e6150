"""Components from the user's own package (issue 36 item 2): the code blocks of the "Adding a ..."
sections (a method, a retriever, a reranker) and of docs/python-api.md (an encoder, an LLM
backend), written as they stand into a package of their own, installed as a separate distribution
(a ``.dist-info`` with an ``r2med_agent.plugins`` entry point on the path, found through
importlib.metadata), run through the CLI in a fresh process; the result then reads back, with the
same labels and numbers, in a process that lacks the plugin."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from r2med_agent.data import load_task
from r2med_agent.evaluation import evaluate, read_trec_run

ROOT = Path(__file__).resolve().parents[2]
DOCS = [("docs/methods.md", "Adding a method"), ("docs/retrievers.md", "Adding a retriever"),
        ("docs/rerankers.md", "Adding a reranker"), ("docs/python-api.md", "Registering components")]
RUN = ["run", "--method", "keywords", "--llm", "parrot", "--retriever", "word-overlap+hash-64",
       "--reranker", "upside-down", "--rerank-k", "10", "--task", "sample", "--no-progress"]


def doc_blocks(lang: str) -> list[str]:
    """Every ``lang`` code block of the sections of :data:`DOCS`, dedented, in order."""
    blocks = []
    for page, section in DOCS:
        text = (ROOT / page).read_text(encoding="utf-8")
        part = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
        for m in re.finditer(rf"^( *)```{lang}\n(.*?)^ *```", part, re.DOTALL | re.MULTILINE):
            indent = len(m.group(1))
            blocks.append("\n".join(line[indent:] for line in m.group(2).splitlines()) + "\n")
    return blocks


def install(site: Path, dist: str, module: str, source: str, entry_point: bool = True) -> None:
    """``module`` with ``source`` in ``site``, as the distribution ``dist`` 0.1 would install it."""
    (site / module).mkdir(parents=True)
    (site / module / "__init__.py").write_text(source, encoding="utf-8")
    if entry_point:
        info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n", encoding="utf-8")
        (info / "entry_points.txt").write_text(f"[r2med_agent.plugins]\ntoy = {module}\n", encoding="utf-8")


def cli(args: list[str], *paths: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m r2med_agent ARGS`` in a fresh process with ``paths`` after the repository on its path."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(ROOT), *map(str, paths)])}
    env.pop("R2MED_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "r2med_agent", *args], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)


@pytest.fixture
def toy(tmp_path: Path) -> dict[str, Path]:
    """The docs' code installed as ``r2med-toy`` 0.1 (module ``r2med_toy``), its config and prompts."""
    site = tmp_path / "site"
    install(site, "r2med-toy", "r2med_toy", "\n\n".join(doc_blocks("python")))
    config = tmp_path / "toy.yaml"
    config.write_text("".join(doc_blocks("yaml")), encoding="utf-8")
    prompts = tmp_path / "prompts"
    (prompts / "keywords").mkdir(parents=True)
    (prompts / "keywords" / "qa.j2").write_text("Search keywords for this {{ domain }} question: {{ query }}\n")
    return {"site": site, "config": config, "prompts": prompts}


def test_a_separate_package_runs_through_the_cli_and_reads_back_without_it(toy: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = {"R2MED_PROMPTS_DIR": str(toy["prompts"])}
    proc = cli([*RUN, "--config", str(toy["config"]), "-o", str(out)], toy["site"], env=env)
    assert proc.returncode == 0, proc.stderr
    (result,) = out.glob("keywords/parrot/*/sample.json")
    record = json.loads(result.read_text())
    config = record["config"]
    assert (config["method"], config["llm"], config["retriever"], config["reranker"]) == (
        "keywords", "parrot", "word-overlap+hash-64", "upside-down")
    # Which package made the components the run used: recorded with the result (built-ins are not).
    assert {"methods keywords", "rerankers reverse", "encoders hash-64"} <= set(record["plugins"]), record["plugins"]
    assert all("of distribution r2med-toy 0.1" in who for who in record["plugins"].values()), record["plugins"]
    summary = json.loads(result.with_name("summary.json").read_text())
    assert summary["plugins"] == record["plugins"]
    task = load_task("sample")
    run = read_trec_run(result.with_name("sample.run"))
    assert record["test"]["ndcg_at_10"] == pytest.approx(evaluate(run, task.qrels).mean["ndcg_at_10"])
    gens = [json.loads(line) for line in result.with_name("sample.generations.jsonl").read_text().splitlines()]
    assert [g["id"] for g in gens] == [q.query_id for q in task.queries]
    assert all(q.text in g["final"] for g, q in zip(gens, task.queries, strict=True))  # the parrot's answers

    # The same run without the reranker: the plugin's reranker turned each top 10 upside down.
    proc = cli([*RUN[:-7], *RUN[-3:], "--config", str(toy["config"]), "-o", str(out)], toy["site"], env=env)
    assert proc.returncode == 0, proc.stderr
    (first,) = [p for p in out.glob("keywords/parrot/*/sample.run") if p != result.with_name("sample.run")]
    first_run = read_trec_run(first)
    for query_id, docs in run.items():
        ranked = sorted(first_run[query_id], key=lambda d: (-first_run[query_id][d], d))
        reranked = sorted(docs, key=lambda d: (-docs[d], d))
        assert reranked[:10] == ranked[:10][::-1] and reranked[10:] == ranked[10:], query_id

    # A process without the plugin: the registries lack it, and compare reads the same rows.
    table = tmp_path / "compare.csv"
    proc = cli(["compare", str(out), "--format", "csv", "--out", str(table)])
    assert proc.returncode == 0, proc.stderr
    rows = {r["reranker"]: r for r in csv.DictReader(table.read_text().splitlines()) if r["method"] != "average"}
    assert sorted((r["method"], r["llm"], r["retriever"], r["reranker"]) for r in rows.values()) == [
        ("keywords", "parrot", "word-overlap+hash-64", ""), ("keywords", "parrot", "word-overlap+hash-64", "upside-down")]
    assert float(rows["upside-down"]["sample"]) == pytest.approx(record["test"]["ndcg_at_10"], abs=5e-5), rows
    code = ("from r2med_agent.methods import METHODS; from r2med_agent.rerank.kinds import RERANKER_KINDS; "
            "from r2med_agent.retrieval.registry import retriever_names; "
            "print('keywords' in METHODS, 'reverse' in RERANKER_KINDS, 'word-overlap' in retriever_names())")
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(ROOT), "R2MED_PLUGINS": ""})
    assert plain.stdout.split() == ["False", "False", "False"], plain.stderr


def test_plugin_on_the_command_line_and_plugins_that_fail(toy: dict[str, Path], tmp_path: Path) -> None:
    # --plugin MODULE: the same module on the path, not installed (no entry point).
    bare = tmp_path / "bare"
    install(bare, "r2med-toy", "r2med_toy", (toy["site"] / "r2med_toy" / "__init__.py").read_text(), entry_point=False)
    env = {"R2MED_CONFIG": str(toy["config"])}
    listed = cli(["--plugin", "r2med_toy", "rerankers"], bare, env=env)
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"upside-down\s.*reverse", listed.stdout), listed.stdout
    without = cli(["rerankers"], bare, env=env)  # without it, the entry's kind is unknown
    assert without.returncode != 0 and "reverse" in without.stderr, without.stderr

    # An installed plugin that fails to import: one line naming it and its distribution, no traceback.
    broken = tmp_path / "broken"
    install(broken, "r2med-broken", "r2med_broken", "import a_module_nobody_has\n")
    proc = cli(["tasks"], broken)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "plugin 'toy' (r2med_broken) of distribution r2med-broken 0.1 failed to load" in proc.stderr, proc.stderr
    assert "No module named 'a_module_nobody_has'" in proc.stderr
    proc = cli(["--plugin", "no_such_plugin_module", "tasks"])
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "plugin module 'no_such_plugin_module' failed to load: ModuleNotFoundError" in proc.stderr

    # A plugin that takes a built-in name is refused, naming the plugin and the name.
    taken = tmp_path / "taken"
    install(taken, "r2med-taken", "r2med_taken",
            "from r2med_agent.methods import HyDE\nfrom r2med_agent.plugins import register\n"
            "register('methods', 'hyde', HyDE)\n")
    proc = cli(["tasks"], taken)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert ("plugin 'toy' (r2med_taken) of distribution r2med-taken 0.1: methods name 'hyde' is taken by the "
            "registry (built in)") in proc.stderr, proc.stderr
