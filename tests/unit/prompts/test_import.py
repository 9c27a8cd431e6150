"""``prompts import <clone>``: each reference repository's prompts, read with ast from a clone.

The fake clones below have the reference's file paths and Python structures (module-level dicts
of ``str.format`` templates, f-strings in functions and branches, attributes set in ``__init__``)
with this test's own dummy sentences. Every import is rendered through the project's methods (or
the template variables its rerankers pass) and compared with what the reference's construction
gives for the same inputs: its functions run here from their ast (the module-level code, which
would create ``EXECUTED``, never runs), its dicts evaluated as the reference evaluates them.

``R2MED_REFERENCE_CLONES`` (paths joined by the OS path separator) names real clones for the
last test; without it that test is skipped.
"""

from __future__ import annotations

import ast
import enum
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from r2med_agent.prompts import templates as prompts
from r2med_agent.cli.app import main
from r2med_agent.types import Doc, Query, Task

GUARD = "import os\nos.makedirs('EXECUTED')\nraise SystemExit(3)\n"
"""Module-level code of every fake file: the import must never run it."""


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch, tmp_path):
    monkeypatch.delenv(prompts.ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)


def write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def run_import(clone: Path, out: Path, capsys: Any = None) -> str:
    assert main(["prompts", "import", str(clone), "--out", str(out)]) == 0
    assert not (clone.parent / "EXECUTED").exists() and not Path("EXECUTED").exists()
    return capsys.readouterr().out if capsys is not None else ""


def functions(path: Path, names: set[str], scope: dict[str, Any] | None = None) -> dict[str, Any]:
    """The reference's own functions ``names`` (anywhere in the file, methods too), defined from
    their ast alone: the file's other code does not run."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {d.name for d in defs} == names
    ns = dict(scope or {})
    exec(compile(ast.Module(defs, type_ignores=[]), str(path), "exec"), ns)  # noqa: S102
    return ns


def task(name: str, family: str, domain: str, queries: tuple[Query, ...], corpus: tuple[Doc, ...] = ()) -> Task:
    return Task(name=name, family=family, domain=domain, queries=queries,  # type: ignore[arg-type]
                corpus=corpus or (Doc("d0", "x"),), qrels={}, source="inline", fingerprint=f"fp-{name}")


# -- R2MED: src/instrcution.py and src/example.py ------------------------------------------------

EXAMPLES = {
    "Stack-Biology": "Post: Why do owls turn their heads so far?\nPassage:\nOwls have fourteen neck vertebrae.\n\n"
                     "Post: How do cacti store water?\nPassage:\nTheir stems hold a mucilage that binds water.\n",
    "MedQA-Diag": "Exam: A child has a barking cough. What is it?\nPassage:\nCroup is a viral illness of the larynx.\n",
    "PMCPatients": "Case: A woman of 30 with joint pain.\nSimilar Case:\nA woman of 28 had swollen knees.\n",
}
HYDE = {
    "Stack-Biology": "Draft a text that answers the Biology post.\nPost: {TEXT}\nPassage: ",
    "Stack-Medical": "Draft a text that answers the Medical post.\nPost: {TEXT}\nPassage: ",
    "MedQA-Diag": "Draft a text that answers the exam.\nExam: {TEXT}\nPassage: ",
    "PMCPatients": "Draft a case like this one.\nCase: {TEXT}\nSimilar Case: ",
}
QUERY2DOC = {
    "Stack-Biology": "Draft a text for the Biology post.\n\n##Shots##\n{EXAMPLE}\n\n##Now##\nPost: {TEXT}\nPassage: ",
    "MedQA-Diag": "Draft a text for the exam.\n\n##Shots##\n{EXAMPLE}\n\n##Now##\nExam: {TEXT}\nPassage: ",
    "PMCPatients": "Draft a like case.\n\n##Shots##\n{EXAMPLE}\n\n##Now##\nCase: {TEXT}\nSimilar Case: ",
}
LAMER = {
    "Stack-Biology": "A Biology post and passages, most wrong. Draft a right one.\n\nPost: {TEXT}\n\nPassages: {PASSAGE}",
    "MedQA-Diag": "An exam and passages, most wrong. Draft a right one.\n\nExam: {TEXT}\n\nPassages: {PASSAGE}",
    "PMCPatients": "A case and cases, most unlike. Draft a like one.\n\nCase: {TEXT}\n\nCases: {PASSAGE}",
}


def r2med_clone(root: Path) -> Path:
    clone = root / "R2MED"
    write(clone, "src/example.py", GUARD + "Example = {\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in EXAMPLES.items())
          + "}\n")
    q2d = "".join(f"    {k!r}: {v!r}.format(EXAMPLE=Example[{k!r}], TEXT=\"{{TEXT}}\"),\n" for k, v in QUERY2DOC.items())
    write(clone, "src/instrcution.py", "from example import Example\n" + GUARD
          + "query_instruction = {'bge': 'Represent: '}\n"
          + "hyde = {\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in HYDE.items()) + "}\n"
          + "query2doc = {\n" + q2d + "}\n"
          + "lamer = {\n" + "".join(f"{k!r}: {v!r},\n" for k, v in LAMER.items()) + "}\n"
          + "generate_hy_doc = {'hyde': hyde, 'query2doc': query2doc, 'lamer': lamer}\n")
    return clone


def cut_text(text: str, threshold: int = 512) -> str:
    """R2MED's generate_func.cut_text."""
    words = text.split()
    return " ".join(words[:threshold] if len(words) > threshold else words)


R2MED_QUERIES = (Query("q1", "Why do {braces} stay?  "), Query("q2", "Second question\nover two lines"))


def test_r2med_prompts_render_as_the_reference_builds_them(tmp_path, capsys) -> None:
    from r2med_agent.methods.expansion import HyDE, Query2Doc

    out = tmp_path / "ref-prompts"
    printed = run_import(r2med_clone(tmp_path), out, capsys)
    assert "R2MED/R2MED (no .git: commit unknown): hyde, lamer, query2doc" in printed
    assert "hyde/qa.j2 <- src/instrcution.py:" in printed
    cases = [("nano-Biology", "Stack-Biology", "qa", "biology"), ("Medical-Sciences", "Stack-Medical", "qa", "medical sciences"),
             ("MedQA-Diag", "MedQA-Diag", "exam", "medicine"), ("PMC-Clinical", "PMCPatients", "case", "medicine")]
    for name, key, family, domain in cases:
        t = task(name, family, domain, R2MED_QUERIES)
        got = [c[0]["content"] for c in HyDE(prompts_dir=out).build_prompts(t)]
        # generate_func.process: base_prompt.format(TEXT=entry['text']); the trailing space stays.
        assert got == [HYDE[key].format(TEXT=q.text) for q in R2MED_QUERIES]
        if key in QUERY2DOC:
            got = [c[0]["content"] for c in Query2Doc(prompts_dir=out).build_prompts(t)]
            base = QUERY2DOC[key].format(EXAMPLE=EXAMPLES[key], TEXT="{TEXT}")
            assert got == [base.format(TEXT=q.text) for q in R2MED_QUERIES]


def test_r2med_lamer_renders_the_reference_passage_block(tmp_path) -> None:
    from r2med_agent.methods.expansion import LameR

    out = tmp_path / "ref-prompts"
    run_import(r2med_clone(tmp_path), out)
    long_text = "\n".join(f"word{i}" for i in range(600))
    corpus = tuple(Doc(f"d{i}", f"document {i}\nsecond  line") for i in range(11)) + (Doc("long", long_text),)
    t = task("MedQA-Diag", "exam", "medicine", R2MED_QUERIES, corpus)
    ranked = ["long"] + [f"d{i}" for i in range(11)]
    first_pass = {q.query_id: {d: 100.0 - i for i, d in enumerate(ranked)} for q in R2MED_QUERIES}
    got = [c[0]["content"] for c in LameR(prompts_dir=out).build_prompts(t, first_pass)]
    texts = {d.doc_id: d.text for d in corpus}
    # generate_func.read_data: "\n[n]. " + the text, newlines as spaces, cut to 512 words, top 10.
    passages = "".join(f"\n[{n + 1}]. {cut_text(texts[pid].replace(chr(10), ' '))}" for n, pid in enumerate(ranked[:10]))
    assert got == [LAMER["MedQA-Diag"].format(TEXT=q.text, PASSAGE=passages) for q in R2MED_QUERIES]


def test_a_task_the_reference_lacks_stops_with_an_error(tmp_path) -> None:
    from r2med_agent.errors import ConfigError
    from r2med_agent.methods.expansion import HyDE

    out = tmp_path / "ref-prompts"
    run_import(r2med_clone(tmp_path), out)
    with pytest.raises(ConfigError, match="the_reference_has_no_prompt_for_this_task"):
        HyDE(prompts_dir=out).build_prompts(task("Bioinformatics", "qa", "bioinformatics", R2MED_QUERIES))
    # The shipped templates are untouched: without the folder the project's own wording renders.
    own = HyDE().build_prompts(task("Biology", "qa", "biology", R2MED_QUERIES))[0][0]["content"]
    assert own == prompts.render("hyde/qa.j2", query=R2MED_QUERIES[0].text, domain="biology").rstrip()


# -- Search-R1 -----------------------------------------------------------------------------------

R1_PREFIX = ("Reply to the question. Think inside <think> and </think> each time. Search with <search> q </search>; "
             "results come between <information> and </information>. Answer in <answer> and </answer>, e.g. "
             "<answer> Oslo </answer>. Question: {question}\n")


def search_r1_clone(root: Path) -> Path:
    clone = root / "Search-R1"
    body = R1_PREFIX.replace("\n", "\\n")
    write(clone, "scripts/data_process/nq_search.py", GUARD + (
        "def make_prefix(dp, template_type):\n"
        "    question = dp['question']\n"
        "    if template_type == 'base':\n"
        f'        prefix = f"""{body}"""\n'
        "    else:\n"
        "        raise NotImplementedError\n"
        "    return prefix\n"))
    write(clone, "search_r1/llm_agent/generation.py", GUARD + (
        "class LLMGenerationManager:\n"
        "    def execute_predictions(self, predictions, pad_token, active_mask=None, do_search=True):\n"
        "        next_obs, dones = [], []\n"
        "        for action in predictions:\n"
        "            if action == 'answer':\n"
        "                next_obs.append('')\n"
        "                dones.append(1)\n"
        "            elif action == 'search':\n"
        "                next_obs.append(f'\\n\\n<information>{search_results.pop(0).strip()}</information>\\n\\n')\n"
        "            else:\n"
        "                next_obs.append(f'\\nThat step was not valid. \\\n"
        "Search with <search> and </search>, answer with <answer> and </answer>.\\n')\n"
        "        return next_obs\n"))
    return clone


def test_search_r1_prompt_and_corrective_message(tmp_path, monkeypatch) -> None:
    from r2med_agent.methods.agentic import SearchR1

    clone = search_r1_clone(tmp_path)
    out = tmp_path / "ref-prompts"
    run_import(clone, out)
    monkeypatch.setenv(prompts.ENV_VAR, str(out))
    make_prefix = functions(clone / "scripts/data_process/nq_search.py", {"make_prefix"})["make_prefix"]
    for text in ("  Why does {x} fall", "What is it?"):
        # nq_search.py process_fn: the question stripped, a "?" added when it lacks one.
        question = text.strip() + ("" if text.strip().endswith("?") else "?")
        got = SearchR1().initial_messages(task("Biology", "qa", "biology", ()), Query("q", text))
        assert got == [{"role": "user", "content": make_prefix({"question": question}, "base")}]
    invalid = ("\nThat step was not valid. Search with <search> and </search>, answer with <answer> and </answer>.\n")
    assert SearchR1().invalid_turn(None) == invalid  # type: ignore[arg-type]


# -- Search-o1 -----------------------------------------------------------------------------------

O1_PROMPTS = GUARD + '''
def get_singleqa_search_o1_instruction(MAX_SEARCH_LIMIT):
    return (
        "You reason and may search once or twice. "
        f"You may search {MAX_SEARCH_LIMIT} times at most.\\n\\n"
    )


def get_multiqa_search_o1_instruction(MAX_SEARCH_LIMIT):
    return (
        "You reason and may search. "
        "Write <|begin_search_query|> q <|end_search_query|>.\\n\\n"
        f"You may search {MAX_SEARCH_LIMIT} times at most.\\n\\n"
        "Example:\\nQuestion: \\"Who?\\"\\nAssistant thinks: then who else?\\n\\n"
    )


def get_webpage_to_reasonchain_instruction(prev_reasoning, search_query, document):
    return f"""**Task:** read the pages.

- **Steps so far:**  
{prev_reasoning}

- **Query:**  
{search_query}

- **Pages:**  
{document}

Now read them for "{search_query}".
"""


def get_task_instruction_openqa(question, model_name=None):
    if model_name == 'qwq':
        user_prompt = (
            'Answer the question. '
            'Give it as \\\\boxed{YOUR_ANSWER}.\\n\\n'
            f'Question:\\n{question}\\n\\n'
        )
    else:
        user_prompt = (
            'Answer the question step by step.\\n\\n'
            'Give it as \\\\boxed{YOUR_ANSWER}.\\n\\n'
            f'Question:\\n{question}\\n\\n'
        )
    return user_prompt
'''


def test_search_o1_prompts_for_qwq_and_others_and_reason_in_documents(tmp_path, monkeypatch) -> None:
    from r2med_agent.methods.agentic import SearchO1

    clone = tmp_path / "Search-o1"
    path = write(clone, "scripts/prompts.py", O1_PROMPTS)
    out = tmp_path / "ref-prompts"
    run_import(clone, out)
    monkeypatch.setenv(prompts.ENV_VAR, str(out))
    ref = functions(path, {"get_multiqa_search_o1_instruction", "get_task_instruction_openqa",
                           "get_webpage_to_reasonchain_instruction"})
    t, q = task("MedQA-Diag", "exam", "medicine", ()), Query("q", "A man of 60 {with} fever")
    # run_search_o1.py's multi-hop QA setting: its instruction + user_prompt, QwQ's variant for a
    # model path containing "qwq" (never the single-QA instruction, which goes with 5 searches).
    for loop, name in ((SearchO1(), None), (SearchO1().for_model("Qwen/QwQ-32B"), "qwq")):
        expected = ref["get_multiqa_search_o1_instruction"](10) + ref["get_task_instruction_openqa"](q.text, model_name=name)
        assert loop.initial_messages(t, q) == [{"role": "user", "content": expected}]
    got = prompts.render("search-o1/reason_in_documents.j2", previous_steps="Step 1: {a}", search_query="fever",
                         documents="**Document 1**\ntext")
    assert got == ref["get_webpage_to_reasonchain_instruction"]("Step 1: {a}", "fever", "**Document 1**\ntext")


# -- Rerankers: ReasonRank, Rank1, GroupRank -----------------------------------------------------

REASONRANK_UTILS = GUARD + '''
def add_prefix_prompt(promptmode: PromptMode, query: str, num: int) -> str:
    if promptmode in [str(PromptMode.RANK_GPT), str(PromptMode.RANK_GPT_reasoning)]:
        return f"I give you {num} passages marked []. Order them for the query: {query}.\\n"
    else:
        raise ValueError('not supported promptmode')


def add_post_prompt(promptmode: PromptMode, query: str, num: int,) -> str:
    if promptmode in [str(PromptMode.RANK_GPT_reasoning)]:
        example_ordering = "[2] > [1]"
        return f"Query: {query}.\\nOrder all {num} passages, most relevant first, as {example_ordering}."
    elif promptmode in [str(PromptMode.RANK_GPT)]:
        example_ordering = "[1] > [2]"
        return f"Query: {query}.\\nOnly the order, as {example_ordering}."
    else:
        raise ValueError('not supported promptmode')
'''


class PromptMode(str, enum.Enum):
    RANK_GPT = "rank_GPT"
    RANK_GPT_reasoning = "rank_GPT_reasoning"

    def __str__(self) -> str:
        return self.value


PASSAGES = ["first passage {x}", "second passage", "third"]


def test_reasonrank_user_message(tmp_path) -> None:
    clone = tmp_path / "ReasonRank"
    path = write(clone, "utils.py", REASONRANK_UTILS)
    write(clone, "rerank/rank_listwise_os_llm.py", GUARD)
    out = tmp_path / "ref-prompts"
    run_import(clone, out)
    ref = functions(path, {"add_prefix_prompt", "add_post_prompt"}, {"PromptMode": PromptMode})
    mode = str(PromptMode.RANK_GPT_reasoning)
    # rank_listwise_os_llm.py create_prompt: f"{prefix}\n", then f"[{rank}] {content}\n" each, then the post.
    expected = (f"{ref['add_prefix_prompt'](promptmode=mode, query='qq', num=3)}\n"
                + "".join(f"[{i}] {p}\n" for i, p in enumerate(PASSAGES, 1))
                + ref["add_post_prompt"](promptmode=mode, query="qq", num=3))
    for family in ("qa", "case"):
        rel = f"rerank-listwise-reasonrank/{family}.j2"
        assert prompts.render(rel, prompts_dir=out, query="qq", passages=PASSAGES, domain="x") == expected
        assert prompts.renders_exactly(rel, prompts_dir=out)
    assert not prompts.renders_exactly("rerank-listwise-reasonrank/qa.j2")


def test_rank1_prompt(tmp_path) -> None:
    clone = tmp_path / "rank1"
    path = write(clone, "rank1.py", GUARD + (
        "class rank1:\n"
        "    def return_prompt(self, query, doc_content, prompt) -> str:\n"
        "        query = prompt.replace('FILL_QUERY_HERE', query) if prompt else query\n"
        "        return \"Is the passage relevant? Say 'true' or 'false'.\\n\" \\\n"
        "                f\"Query: {query}\\n\" \\\n"
        "                f\"Passage: {doc_content}\\n\" \\\n"
        "                \"<think>\"\n"))
    out = tmp_path / "ref-prompts"
    run_import(clone, out)
    return_prompt = functions(path, {"return_prompt"})["return_prompt"]
    got = prompts.render("rerank-pointwise-rank1/exam.j2", prompts_dir=out, query="qq", document="doc {d}", domain="x")
    assert got == return_prompt(None, "qq", "doc {d}", None)


GROUP_SYSTEM = "Score documents by use.\n1. Use first.\n- 0: none\n"
GROUP_USER = ("I give you {TOPK} documents marked []. Score them.\nQuery:\n{QUERY}\n\nDocuments:\n{PASSAGES}\n\n"
              "## Output\nScores for all {TOPK} documents. \n<answer> \n```json\n{{\"[1]\": 5}}\n``` \n</answer>\n")


RANK_R1_TOML = (
    'prompt_system = "A dummy system line, with <think> </think> tags."\n\n'
    "prompt_user = '''Pick for: \"{query}\" among\n{docs}\nAnswer [n].'''\n\n"
    "pattern = '<answer>(.*?)</answer>'\n\n"
    'doc_separator = "\\n"\n\n'
    'doc_prefix = "[{num}]: "\n'
)


def test_rank_r1_system_and_user_prompts(tmp_path) -> None:
    """Rank-R1's TOML prompt file, read as data: the system text, and the user text with
    ``{docs}`` filled as R1SetwiseLlmRanker.compare (Rank-R1/run_setwise.py) fills it from the
    file's ``doc_prefix`` and ``doc_separator``: the authors' ``[i]: text``, one per line."""
    import tomllib

    clone = tmp_path / "llm-rankers"
    path = write(clone, "Rank-R1/prompts/prompt_setwise-R1.toml", RANK_R1_TOML)
    out = tmp_path / "ref-prompts"
    run_import(clone, out)
    ref = tomllib.loads(path.read_text(encoding="utf-8"))
    docs = "[1]: first passage {x}\n[2]: second passage\n[3]: third"
    for family in ("qa", "exam"):
        rel = f"rerank-setwise/{family}.j2"
        variables = dict(prompts_dir=out, query="q {x}", passages=PASSAGES, domain="x")
        assert prompts.render(rel, part="system", **variables) == ref["prompt_system"]
        assert prompts.render(rel, part="user", **variables) == ref["prompt_user"].format(query="q {x}", docs=docs)
    # The layout is the file's own: another prefix and separator give another layout.
    other = RANK_R1_TOML.replace('"[{num}]: "', '"<{num}> {{ "').replace('"\\n"', '"\\n\\n"')
    write(clone, "Rank-R1/prompts/prompt_setwise-R1.toml", other)
    run_import(clone, tmp_path / "o1")
    got = prompts.render("rerank-setwise/qa.j2", prompts_dir=tmp_path / "o1", part="user", query="q",
                         passages=["a", "b"], domain="x")
    assert "among\n<1> { a\n\n<2> { b\nAnswer" in got
    for bad in ("prompt_system = [1]\n", RANK_R1_TOML.replace('doc_prefix = "[{num}]: "', "")):
        write(clone, "Rank-R1/prompts/prompt_setwise-R1.toml", bad)
        assert main(["prompts", "import", str(clone), "--out", str(tmp_path / "o2")]) != 0


def test_grouprank_system_and_user_prompts(tmp_path) -> None:
    clone = tmp_path / "Diver"
    write(clone, "Reranker/rerank_groupwise.py", GUARD + (
        "class GroupReranker:\n"
        "    def __init__(self, model_path):\n"
        f"        self.group_system_prompt = '''{GROUP_SYSTEM}'''\n\n"
        f"        self.group_user_prompt = '''{GROUP_USER}'''\n"))
    out = tmp_path / "ref-prompts"
    run_import(clone, out)
    # prepare_groups_one_epoch: "[i]. text\n\n" per document, TOPK the group's size.
    docs_str = "".join("[{}]. {}\n\n".format(i + 1, p) for i, p in enumerate(PASSAGES))
    variables = dict(prompts_dir=out, query="qq", passages=PASSAGES, domain="x")
    assert prompts.render("rerank-groupwise/qa.j2", part="system", **variables) == GROUP_SYSTEM
    assert prompts.render("rerank-groupwise/qa.j2", part="user", **variables) == GROUP_USER.format(
        QUERY="qq", PASSAGES=docs_str, TOPK=len(PASSAGES))


# -- What a run records and what reproduce says --------------------------------------------------


def git_commit(clone: Path) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "clone"]):
        subprocess.run(["git", "-C", str(clone), *cmd], check=True, env=env, capture_output=True)
    return subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_the_run_records_the_import_and_its_commit(tmp_path) -> None:
    from r2med_agent.experiment.runner import RunConfig, _config_record

    clone = r2med_clone(tmp_path)
    commit = git_commit(clone)
    out = tmp_path / "ref-prompts"
    run_import(search_r1_clone(tmp_path), out)
    run_import(clone, out)
    record = json.loads((out / ".r2med-import.json").read_text())
    assert [(e["reference"], e["commit"]) for e in record["imports"]] == [
        ("PeterGriffinJin/Search-R1", None), ("R2MED/R2MED", commit)]
    cfg = RunConfig(tasks=("Biology",), method="hyde", llm="smollm2", prompts_dir=out)
    assert cfg.prompts is not None
    assert _config_record(cfg)["prompts_import"] == [{"reference": "R2MED/R2MED", "commit": commit, "folders": ["hyde"]}]
    own = RunConfig(tasks=("Biology",), method="hyde", llm="smollm2")
    assert _config_record(own)["prompts_import"] == []
    # The record is provenance: the run's identity is the folder's hash, as before.
    assert "prompts_import" not in cfg.spec().record()


def test_dry_run_says_whose_prompts_each_fresh_row_renders(tmp_path, monkeypatch) -> None:
    """A row renders the authors' prompts at their pinned commit unless it asks for its own
    wording; with its own wording, $R2MED_PROMPTS_DIR's imports are what it renders."""
    from r2med_agent.api import ReproduceOptions, format_plan, load_grid, plan

    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    clone = r2med_clone(tmp_path)
    commit = git_commit(clone)
    out = tmp_path / "ref-prompts"
    run_import(clone, out)
    grid_file = write(tmp_path, "grid.yaml", "title: t\nentries:\n"
                      "  - {method: hyde, llm: qwen-7b, retriever: bm25}\n"
                      "  - {method: hyde, llm: qwen-7b, retriever: bm25, args: {prompts_from: own}}\n"
                      "  - {method: search-r1, llm: qwen-7b, retriever: bm25, args: {prompts_from: own}}\n"
                      "  - {method: none, retriever: bm25}\n")
    opts = ReproduceOptions(output_dir=tmp_path / "results", tasks=("Biology",), generations="fresh")
    authors = ("    prompts: the authors', R2MED/R2MED@62b707460040 (src/instrcution.py, src/example.py): not at hand: "
               "fetched on first use from https://raw.githubusercontent.com")
    rows = format_plan(plan(load_grid(grid_file), opts)).split("\n[")
    assert authors in rows[0] and "--prompts" not in rows[0]
    assert "    prompts: the project's own\n" in rows[1] and "--prompts own" in rows[1]
    assert "    prompts: the project's own\n" in rows[2]
    assert "    prompts: none (no LLM reads a prompt in this row)\n" in rows[3]
    monkeypatch.setenv(prompts.ENV_VAR, str(out))
    rows = format_plan(plan(load_grid(grid_file), opts)).split("\n[")
    assert authors in rows[0]  # the pinned commit, whatever $R2MED_PROMPTS_DIR holds
    assert f"    prompts: the reference's, imported from R2MED/R2MED@{commit[:12]}\n" in rows[1]
    assert "prompts: the project's own\n" in rows[2]  # search-r1: not imported into this folder


def test_not_a_reference_clone(tmp_path, capsys) -> None:
    write(tmp_path / "other", "src/main.py", "x = 1\n")
    assert main(["prompts", "import", str(tmp_path / "other"), "--out", str(tmp_path / "o")]) != 0
    err = capsys.readouterr().err
    assert "not a clone of a known reference" in err and "Traceback" not in err
    clone = tmp_path / "bad"
    write(clone, "scripts/prompts.py", "def get_multiqa_search_o1_instruction(n):\n    return compute(n)\n")
    assert main(["prompts", "import", str(clone), "--out", str(tmp_path / "o")]) != 0
    assert "scripts/prompts.py:2" in capsys.readouterr().err


# -- Real clones ---------------------------------------------------------------------------------

REAL = [Path(p) for p in os.environ.get("R2MED_REFERENCE_CLONES", "").split(os.pathsep) if p]


@pytest.mark.skipif(not REAL, reason="set R2MED_REFERENCE_CLONES to clones of R2MED, Search-R1, Search-o1, "
                    "ReasonRank, rank1, Diver or llm-rankers (joined by the path separator) to check their real files")
@pytest.mark.parametrize("clone", REAL, ids=[p.name for p in REAL])
def test_real_clone_renders_the_reference_prompt(clone, tmp_path) -> None:
    from r2med_agent.prompts.importer import import_clone

    imported = import_clone(clone)
    out = tmp_path / "ref-prompts"
    run_import(clone, out)
    check = REAL_CHECKS[imported.reference]
    assert check(clone, out) > 0


def _real_r2med(clone: Path, out: Path) -> int:
    from r2med_agent.data import REFERENCE_NAMES, get_task_spec

    tree = ast.parse((clone / "src/instrcution.py").read_text(encoding="utf-8"))
    example = ast.parse((clone / "src/example.py").read_text(encoding="utf-8"))
    scope = {"Example": next(ast.literal_eval(n.value) for n in example.body if isinstance(n, ast.Assign))}
    tables = {n.targets[0].id: n.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)}
    docs = [f"document {i} text" for i in range(10)]
    n = 0
    for method in ("hyde", "query2doc", "lamer"):
        table = eval(compile(ast.Expression(tables[method]), "instrcution", "eval"), scope)  # noqa: S307
        for key, base in table.items():
            spec = get_task_spec(REFERENCE_NAMES.get(key, key))
            passage = "".join(f"\n[{i + 1}]. {d}" for i, d in enumerate(docs))
            expected = base.format(TEXT="Q {x}?", PASSAGE=passage) if method == "lamer" else base.format(TEXT="Q {x}?")
            got = prompts.render(f"{method}/{spec.family}.j2", prompts_dir=out, query="Q {x}?", domain=spec.domain,
                                 task=spec.name, documents=docs)
            assert got == expected, (method, key)
            n += 1
    return n


def _real_search_r1(clone: Path, out: Path) -> int:
    make_prefix = functions(clone / "scripts/data_process/nq_search.py", {"make_prefix"})["make_prefix"]
    assert prompts.render("search-r1/qa.j2", prompts_dir=out, query="Why?", domain="x") == make_prefix(
        {"question": "Why?"}, "base")
    return 1


def _real_search_o1(clone: Path, out: Path) -> int:
    ref = functions(clone / "scripts/prompts.py", {"get_multiqa_search_o1_instruction", "get_task_instruction_openqa",
                                                   "get_webpage_to_reasonchain_instruction"})
    for qwq in (False, True):
        expected = ref["get_multiqa_search_o1_instruction"](10) + ref["get_task_instruction_openqa"](
            "Q?", model_name="qwq" if qwq else None)
        assert prompts.render("search-o1/qa.j2", prompts_dir=out, query="Q?", domain="x", max_searches=10,
                              qwq=qwq) == expected
    got = prompts.render("search-o1/reason_in_documents.j2", prompts_dir=out, previous_steps="p", search_query="s",
                         documents="d")
    assert got == ref["get_webpage_to_reasonchain_instruction"]("p", "s", "d")
    return 3


def _real_reasonrank(clone: Path, out: Path) -> int:
    from types import SimpleNamespace

    tree = ast.parse((clone / "utils.py").read_text(encoding="utf-8"))
    modes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
             and n.value.id == "PromptMode"}
    ref = functions(clone / "utils.py", {"add_prefix_prompt", "add_post_prompt"},
                    {"PromptMode": SimpleNamespace(**{m: m for m in modes}), "Dict": dict, "Any": Any})
    mode = "RANK_GPT_reasoning"
    expected = (f"{ref['add_prefix_prompt'](promptmode=mode, query='qq', num=3)}\n"
                + "".join(f"[{i}] {p}\n" for i, p in enumerate(PASSAGES, 1))
                + ref["add_post_prompt"](promptmode=mode, query="qq", num=3))
    assert prompts.render("rerank-listwise-reasonrank/qa.j2", prompts_dir=out, query="qq", passages=PASSAGES,
                          domain="x") == expected
    return 1


def _real_rank1(clone: Path, out: Path) -> int:
    return_prompt = functions(clone / "rank1.py", {"return_prompt"})["return_prompt"]
    assert prompts.render("rerank-pointwise-rank1/qa.j2", prompts_dir=out, query="qq", document="dd",
                          domain="x") == return_prompt(None, "qq", "dd", None)
    return 1


def _real_grouprank(clone: Path, out: Path) -> int:
    tree = ast.parse((clone / "Reranker/rerank_groupwise.py").read_text(encoding="utf-8"))
    values = {n.targets[0].attr: ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
              and isinstance(n.targets[0], ast.Attribute) and n.targets[0].attr in ("group_system_prompt", "group_user_prompt")}
    docs_str = "".join("[{}]. {}\n\n".format(i + 1, p) for i, p in enumerate(PASSAGES))
    variables = dict(prompts_dir=out, query="qq", passages=PASSAGES, domain="x")
    assert prompts.render("rerank-groupwise/qa.j2", part="system", **variables) == values["group_system_prompt"]
    assert prompts.render("rerank-groupwise/qa.j2", part="user", **variables) == values["group_user_prompt"].format(
        QUERY="qq", PASSAGES=docs_str, TOPK=len(PASSAGES))
    return 2


def _real_rank_r1(clone: Path, out: Path) -> int:
    import tomllib

    ref = tomllib.loads((clone / "Rank-R1/prompts/prompt_setwise-R1.toml").read_text(encoding="utf-8"))
    docs = "\n".join(f"[{i + 1}]: {p}" for i, p in enumerate(PASSAGES))
    variables = dict(prompts_dir=out, query="qq", passages=PASSAGES, domain="x")
    assert prompts.render("rerank-setwise/qa.j2", part="system", **variables) == ref["prompt_system"]
    assert prompts.render("rerank-setwise/qa.j2", part="user", **variables) == ref["prompt_user"].format(
        query="qq", docs=docs)
    return 2


REAL_CHECKS = {"R2MED/R2MED": _real_r2med, "PeterGriffinJin/Search-R1": _real_search_r1,
               "sunnynexus/Search-o1": _real_search_o1, "8421BCD/ReasonRank": _real_reasonrank,
               "orionw/rank1": _real_rank1, "AQ-MedAI/Diver": _real_grouprank, "ielab/llm-rankers": _real_rank_r1}
