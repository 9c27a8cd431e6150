"""The documentation is true and self-contained: the protocol page the code cites is in the
repository with the sections cited, and nothing points at files outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _repo_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / line for line in out.splitlines()
            if line.endswith((".py", ".md", ".yaml", ".yml", ".j2", ".toml", ".txt"))]


def test_no_file_refers_to_a_protocol_file_outside_the_repository():
    offenders = [str(p.relative_to(ROOT)) for p in _repo_files()
                 if p.is_file() and p.name != "test_docs.py" and "PROTOCOL.md" in p.read_text(encoding="utf-8")]
    assert offenders == []


def test_cited_protocol_sections_exist():
    page = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    headings = {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", page, re.MULTILINE)}
    cited = set()
    for p in _repo_files():
        if p.is_file():
            cited |= {" ".join(c.split()) for c in re.findall(r'docs/protocol\.md[,(]? \(?"([^"]+)"', p.read_text(encoding="utf-8"))}
    assert cited, "no section citations found"
    assert cited <= headings, cited - headings


def _doc_block(page: str, section: str, lang: str = "python") -> str:
    text = (ROOT / page).read_text(encoding="utf-8")
    part = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    m = re.search(rf"```{lang}\n(.*?)```", part, re.DOTALL)
    assert m, f"no {lang} block in {page} section {section!r}"
    return m.group(1)


def test_python_api_page_example_runs(tmp_path, monkeypatch, capsys):
    """The Python API page's example, executed as written: an encoder function, a BEIR-style
    search function and an LLM function scored on the sample task, then compared from the CLI."""
    monkeypatch.chdir(tmp_path)
    page = "docs/python-api.md"
    exec(compile(_doc_block(page, "An example that runs"), page, "exec"), {"__name__": "docs"})
    printed = capsys.readouterr().out.split("\n")
    assert [line.split()[0] for line in printed if line] == [
        "results/none/none/bow-512", "results/none/none/word-overlap", "results/hyde/echo/bm25"]
    for line in filter(None, printed):
        assert 0.0 <= float(line.split()[1]) <= 1.0
    import json

    rec = json.loads((tmp_path / "results/none/none/bow-512/sample.json").read_text())
    assert rec["dataset_name"] == "sample" and rec["num_queries"] == 12
    gens = (tmp_path / "results/hyde/echo/bm25/sample.generations.jsonl").read_text().splitlines()
    assert len(gens) == 12
    from r2med_agent.cli import main

    assert main(["compare", "results", "--format", "csv"]) == 0
    table = capsys.readouterr().out
    assert "bow-512" in table and "word-overlap" in table and "echo" in table


def test_python_api_runs_tables_and_grids_example_runs(tmp_path, monkeypatch, capsys):
    """The page's example of the API of run, compare and reproduce, executed as written: a BM25
    run of the sample task, its table, the NanoR2MED grid's plan (nothing of it runs) and one
    run's resolved plan."""
    monkeypatch.chdir(tmp_path)
    page = "docs/python-api.md"
    exec(compile(_doc_block(page, "Runs, tables and grids"), page, "exec"),
         {"__name__": "docs"})
    out = capsys.readouterr().out
    folder, score = out.split("\n", 1)[0].split()
    assert folder == "results/none/none/bm25" and 0.0 < float(score) <= 1.0
    assert "| 0 | none | none | bm25 |" in out and "r2med-agent run --method none --retriever nano-bm25" in out
    assert not (tmp_path / "results/none/none/nano-bm25").exists()
    assert out.rstrip().endswith("hyde {} 0.7")  # a run resolved: the default temperature is no setting


def test_python_api_lists_each_public_name_of_run_compare_and_reproduce():
    """``r2med_agent.api``'s ``__all__`` is the API: every name of run, compare and reproduce is
    public, importable (the object of the module that defines it), and in the page's table under
    its command, and the table names nothing else."""
    import importlib

    from r2med_agent import api

    text = (ROOT / "docs/python-api.md").read_text(encoding="utf-8")
    table = text.split("| command | name | what it is |", 1)[1].split("\n\n", 1)[0]
    documented: dict[str, set[str]] = {}
    command = ""
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        command = cells[0].strip("`") or command
        names = {re.sub(r"\(.*", "", n) for n in re.findall(r"`([^`]+)`", cells[1])}
        documented.setdefault(command, set()).update(names)
    assert set(documented) == {"run", "compare", "reproduce"}
    assert set().union(*documented.values()) == set(api.__all__) - {"PythonLLM", "evaluate_encoder",
                                                                      "evaluate_llm", "evaluate_retriever"}
    assert not [n for n in api.__all__ if n.startswith("_")]
    for module, names in api._PUBLIC.items():
        for name in names:
            assert getattr(api, name) is getattr(importlib.import_module(module), name), name
    assert all(hasattr(api, n) for n in api.__all__) and set(api.__all__) <= set(dir(api))


def test_python_api_scores_equal_an_independent_computation(tmp_path):
    """The encoder path's nDCG@10 equals pytrec_eval run by hand on the same cosine ranking."""
    import numpy as np
    import pytrec_eval

    import r2med_agent
    from r2med_agent.data import load_task

    def embed(texts):
        rng = np.random.default_rng(0)
        table = rng.standard_normal((4096, 32)).astype(np.float32)
        return np.stack([table[[hash(w) % 4096 for w in t.lower().split()]].sum(0) for t in texts])

    result = r2med_agent.evaluate_encoder(embed, "rand-bow", "sample", output_dir=tmp_path)
    task = load_task("sample")
    d = embed([doc.full_text for doc in task.corpus])
    q = embed([query.text for query in task.queries])
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    scores = q @ d.T
    run = {}
    for i, query in enumerate(task.queries):
        top = np.argsort(-scores[i], kind="stable")[:100]
        run[query.query_id] = {task.corpus[j].doc_id: float(scores[i, j]) for j in top}
    ev = pytrec_eval.RelevanceEvaluator(task.qrels, {"ndcg_cut.10"}).evaluate(run)
    expected = sum(v["ndcg_cut_10"] for v in ev.values()) / len(task.queries)
    assert result.average["ndcg_at_10"] == pytest.approx(expected, abs=1e-6)


def test_python_api_llm_is_cached_under_its_name(tmp_path):
    import r2med_agent

    calls = []

    def llm(prompts):
        calls.append(len(prompts))
        return ["a passage about " + p[-1]["content"][-40:] for p in prompts]

    first = r2med_agent.evaluate_llm(llm, "my-llm", "sample", output_dir=tmp_path)
    again = r2med_agent.evaluate_llm(llm, "my-llm", "sample", output_dir=tmp_path)
    assert calls == [12]  # one batch; the second run is all cache hits
    assert again.outcomes[0].stats["cache_hits"] == 12
    assert first.average == again.average


def test_python_api_retriever_errors_are_clear(tmp_path):
    import r2med_agent
    from r2med_agent.errors import ConfigError

    with pytest.raises(ConfigError, match="not in the corpus"):
        r2med_agent.evaluate_retriever(lambda corpus, queries, k: {q: {"nope": 1.0} for q in queries},
                                       "bad-ids", "sample", output_dir=tmp_path)
    with pytest.raises(ConfigError, match="unknown option"):
        r2med_agent.evaluate_retriever(lambda c, q, k: {}, "x", "sample", colour="red")
    with pytest.raises(ConfigError, match="taken by the registry"):
        r2med_agent.evaluate_encoder(lambda texts: texts, "bm25", "sample")


# --- README size and links -------------------------------------------------------------------

README_MAX_LINES = 150

# Pages that the README links and that another branch writes; a link to one of them is accepted
# while the file is missing and checked like any other once it exists.

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _relative_links(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # code blocks hold no links
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # http(s)://, mailto: and in-page anchors
        targets.append(target.split("#", 1)[0])
    return targets


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_relative_links_point_at_files_that_exist():
    broken = []
    for page in _pages():
        for target in _relative_links(page):
            path = (page.parent / target).resolve()
            if path.exists():
                continue
            broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_readme_links_every_docs_page():
    linked = {(ROOT / t).resolve() for t in _relative_links(ROOT / "README.md")}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set()
    assert any(t.startswith("docs/") for t in _relative_links(ROOT / "README.md"))


README_FIRST = (
    'python3 -m venv .venv && . .venv/bin/activate && if nvidia-smi -L >/dev/null 2>&1; then E=local,gpu,hub,dev; '
    'else E=all; pip install --retries 1 "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu; fi && '
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAVA_BUILD=OFF" pip install -e ".[$E]" && '
    "r2med-agent run --method hyde --llm smollm2 --task sample"
)


README_TESTS = "python -m pytest -q -n 2"
"""The README's second command: the test suite on two pytest-xdist workers."""


def test_readme_starts_with_the_two_first_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"```bash\n{README_FIRST}\n{README_TESTS}\n```" in text


def test_ci_runs_the_readmes_test_command():
    """`.ci/run` ends with the README's test command, whatever options it exports before it."""
    lines = [ln for ln in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines() if ln.strip()]
    assert lines[-1] == README_TESTS


def _readme_first_command() -> str:
    """The first line of the README's first bash block, as a reader copies it."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return text.split("```bash\n", 1)[1].splitlines()[0]


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/bash\n{body}\n", encoding="utf-8")
    path.chmod(0o755)


def _run_first_command(tmp_path: Path, gpu: bool | None) -> list[str]:
    """The README's first command run by bash with python3, pip and r2med-agent replaced by stubs
    that log what they are asked (and CMAKE_ARGS); ``gpu``: a stub nvidia-smi that finds a GPU
    (True), none on PATH (False), or this machine's own (None)."""
    import shutil

    stubs, work = tmp_path / f"stubs-{gpu}", tmp_path / f"work-{gpu}"
    stubs.mkdir()
    work.mkdir()
    log = tmp_path / f"log-{gpu}"
    mkdir = shutil.which("mkdir") or "/bin/mkdir"  # PATH holds the stubs alone
    _stub(stubs, "python3", f'[ "$*" = "-m venv .venv" ] && {mkdir} -p .venv/bin && : > .venv/bin/activate; '
                            f'echo "python3 $*" >> {log}')
    _stub(stubs, "pip", f'echo "pip $* [CMAKE_ARGS=$CMAKE_ARGS]" >> {log}')
    _stub(stubs, "r2med-agent", f'echo "r2med-agent $*" >> {log}')
    path = str(stubs)
    if gpu:
        _stub(stubs, "nvidia-smi", 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"')
    elif gpu is None and shutil.which("nvidia-smi"):
        path += ":" + str(Path(shutil.which("nvidia-smi")).parent)
    bash = shutil.which("bash") or "/bin/bash"
    first = _readme_first_command()
    subprocess.run([bash, "-c", first], cwd=work, env={"PATH": path}, check=True, timeout=60)
    return log.read_text(encoding="utf-8").splitlines()


def test_the_first_command_takes_the_torch_build_the_machine_can_use(tmp_path):
    """Issue 30 item 11: on a CPU-only machine the one line installs the CPU build of torch from
    PyTorch's CPU index before the extras (it used to let pip take PyPI's CUDA build, several GB);
    on a GPU machine PyPI's CUDA build with [gpu]; the same CMAKE_ARGS and main job on both."""
    import tomllib

    flags = "[CMAKE_ARGS=-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAVA_BUILD=OFF]"
    main_job = "r2med-agent run --method hyde --llm smollm2 --task sample"
    assert _run_first_command(tmp_path, gpu=False) == [
        "python3 -m venv .venv",
        "pip install --retries 1 torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu [CMAKE_ARGS=]",
        f"pip install -e .[all] {flags}",
        main_job,
    ]
    assert _run_first_command(tmp_path, gpu=True) == [
        "python3 -m venv .venv", f"pip install -e .[local,gpu,hub,dev] {flags}", main_job]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert extras["all"] == ["r2med-agent[local,cpu,hub,dev]"] and "faiss-gpu-cu12>=1.8" in extras["gpu"]
    # This machine: a GPU that nvidia-smi finds takes the CUDA build, else the CPU one.
    import shutil

    here = _run_first_command(tmp_path, gpu=None)
    smi = shutil.which("nvidia-smi")
    found = smi is not None and subprocess.run([smi, "-L"], capture_output=True).returncode == 0
    assert (here[1] == f"pip install -e .[local,gpu,hub,dev] {flags}") == found, here


def test_link_checker_finds_links(tmp_path):
    """The checker itself: it sees relative links, skips URLs, anchors and code blocks."""
    page = tmp_path / "p.md"
    page.write_text("[a](docs/x.md) [b](https://e.org) [c](#top) [d](y.md#part)\n"
                    "```\n[e](in-code.md)\n```\n", encoding="utf-8")
    assert _relative_links(page) == ["docs/x.md", "y.md"]


def test_every_package_is_listed_for_the_wheel():
    """pyproject lists packages one by one: a subpackage left out would be missing from a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "r2med_agent").rglob("__init__.py")}
    assert found - listed == set()


def test_the_slurm_script_in_the_docs_is_the_tested_file():
    """docs/reproduce.md shows docs/slurm/ray-grid.sbatch verbatim, the file
    tests/integration/test_slurm_script.py runs: the two cannot drift apart."""
    script = (ROOT / "docs" / "slurm" / "ray-grid.sbatch").read_text(encoding="utf-8")
    assert f"```bash\n{script}```\n" in (ROOT / "docs" / "reproduce.md").read_text(encoding="utf-8")
