"""The Jinja prompt environment: strict rendering, user overrides, template hashes, examples."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from r2med_agent.prompts import templates as prompt_templates
from r2med_agent.errors import ConfigError
from r2med_agent.paths import prompts_dir

METHODS = ("hyde", "query2doc", "lamer")
FAMILIES = ("qa", "exam", "treatment", "case")
ENDING = {"qa": "Passage:", "exam": "Passage:", "treatment": "Passage:", "case": "Similar Case:"}
QUERY = "A 30-year-old presents with QUERY-MARKER symptoms."
EXAMPLES = [
    {"query": "EXAMPLE-Q1", "passage": "EXAMPLE-P1"},
    {"query": "EXAMPLE-Q2", "passage": "EXAMPLE-P2"},
]
DOCUMENTS = ["first document", "second document"]


def full_variables(method: str) -> dict:
    variables = {"query": QUERY, "domain": "biology", "family": "qa"}
    if method == "query2doc":
        variables["examples"] = EXAMPLES
    if method == "lamer":
        variables["documents"] = DOCUMENTS
    return variables


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(prompt_templates.ENV_VAR, raising=False)


# -- every template ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", METHODS)
def test_every_template_renders_with_query_and_ending(method, family):
    text = prompt_templates.render(f"{method}/{family}.j2", **full_variables(method))
    assert QUERY in text
    assert text.rstrip().endswith(ENDING[family])
    # The query comes after the instruction (and after any examples/documents).
    assert text.index(QUERY) > 0
    if method == "query2doc":
        assert text.index("EXAMPLE-P2") < text.index(QUERY)
    if method == "lamer":
        assert "[1]. first document\n[2]. second document\n" in text
        assert "wrong" in text or "not similar" in text


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", METHODS)
def test_every_template_fails_on_a_missing_variable(method, family):
    variables = full_variables(method)
    del variables["query"]
    with pytest.raises(ConfigError, match="query"):
        prompt_templates.render(f"{method}/{family}.j2", **variables)


@pytest.mark.parametrize("method", ["query2doc", "lamer"])
def test_method_specific_variable_is_required(method):
    variables = full_variables(method)
    variables.pop("examples" if method == "query2doc" else "documents")
    with pytest.raises(ConfigError, match="examples|documents"):
        prompt_templates.render(f"{method}/qa.j2", **variables)


def test_qa_templates_name_the_domain():
    for method in METHODS:
        text = prompt_templates.render(f"{method}/qa.j2", **{**full_variables(method), "domain": "bioinformatics"})
        assert "bioinformatics post" in text


def test_hyde_layout_is_exact():
    text = prompt_templates.render("hyde/case.j2", query="Q", domain="medicine")
    assert text == (
        "Please write a similar clinical case that helps diagnose the following case.\n"
        "Case: Q\n"
        "Similar Case:\n"
    )


def test_query_text_is_not_interpreted_as_template():
    query = "What does {{ domain }} or {% raw %} mean in my notes?"
    text = prompt_templates.render("hyde/qa.j2", query=query, domain="biology")
    assert query in text


def test_unknown_template_lists_available():
    with pytest.raises(ConfigError, match=r"hyde/nosuch\.j2.*available: .*hyde/qa\.j2"):
        prompt_templates.render("hyde/nosuch.j2", query="q", domain="d")


def test_templates_ship_in_package_folder():
    for method in METHODS:
        for family in FAMILIES:
            assert (prompts_dir() / method / f"{family}.j2").is_file()


def test_repo_prompts_folder_holds_no_code():
    """The repository's top-level prompts/ folder holds templates, example files and its README,
    no code, and is the folder this checkout renders from. The code is r2med_agent.prompts.templates,
    importable from a checkout without installing."""
    folder = Path(__file__).resolve().parents[3] / "prompts"
    kinds = {p.suffix for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert kinds == {".j2", ".yaml", ".md"}
    assert prompts_dir() == folder
    assert Path(prompt_templates.__file__).parent == folder.parent / "r2med_agent" / "prompts"


# -- overrides ---------------------------------------------------------------------------------


def test_override_folder_replaces_same_name_and_falls_back(tmp_path):
    (tmp_path / "hyde").mkdir()
    (tmp_path / "hyde" / "qa.j2").write_text("MINE {{ query }}\nPassage:\n", encoding="utf-8")
    assert prompt_templates.render("hyde/qa.j2", prompts_dir=tmp_path, query="q", domain="d") == "MINE q\nPassage:\n"
    # A file the override folder lacks comes from the package.
    packaged = prompt_templates.render("hyde/exam.j2", query="q", domain="d")
    assert prompt_templates.render("hyde/exam.j2", prompts_dir=tmp_path, query="q", domain="d") == packaged
    assert prompt_templates.search_path(tmp_path) == [tmp_path, prompts_dir()]


def test_env_var_override(tmp_path, monkeypatch):
    (tmp_path / "hyde").mkdir()
    (tmp_path / "hyde" / "qa.j2").write_text("ENV {{ query }}", encoding="utf-8")
    monkeypatch.setenv(prompt_templates.ENV_VAR, str(tmp_path))
    assert prompt_templates.render("hyde/qa.j2", query="q", domain="d") == "ENV q"
    # An explicit argument wins over the environment variable.
    other = tmp_path / "other"
    (other / "hyde").mkdir(parents=True)
    (other / "hyde" / "qa.j2").write_text("ARG {{ query }}", encoding="utf-8")
    assert prompt_templates.render("hyde/qa.j2", prompts_dir=other, query="q", domain="d") == "ARG q"


def test_missing_override_folder_is_an_error(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="does not exist"):
        prompt_templates.render("hyde/qa.j2", prompts_dir=tmp_path / "nope", query="q", domain="d")
    monkeypatch.setenv(prompt_templates.ENV_VAR, str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="R2MED_PROMPTS_DIR"):
        prompt_templates.render("hyde/qa.j2", query="q", domain="d")


def test_syntax_error_names_file_and_line(tmp_path):
    (tmp_path / "hyde").mkdir()
    (tmp_path / "hyde" / "qa.j2").write_text("line one\n{% if %}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"qa\.j2:2: template syntax error"):
        prompt_templates.render("hyde/qa.j2", prompts_dir=tmp_path, query="q", domain="d")


# -- the sandbox (issue 29 item 5) -------------------------------------------------------------

UNSAFE = "Write about {{ domain }}.\n{{ cycler.__init__.__globals__.os.popen('touch %s').read() }}\n{{ query }}\n"


def test_a_template_reaching_python_internals_is_refused_with_file_and_line(tmp_path):
    """Before: a plain Jinja environment ran the shell command and rendered its output."""
    marker = tmp_path / "PWNED"
    (tmp_path / "p" / "hyde").mkdir(parents=True)
    (tmp_path / "p" / "hyde" / "qa.j2").write_text(UNSAFE % marker, encoding="utf-8")
    with pytest.raises(ConfigError, match=r"hyde/qa\.j2:2: unsafe template: it reads '__(globals|init)__'"):
        prompt_templates.render("hyde/qa.j2", prompts_dir=tmp_path / "p", query="q", domain="d")
    with pytest.raises(ConfigError, match=r"hyde/qa\.j2:2: unsafe template"):
        prompt_templates.template_hash("hyde", "qa", prompts_dir=tmp_path / "p")
    # a name computed at render time is stopped by the sandbox itself, also with file and line
    (tmp_path / "p" / "hyde" / "qa.j2").write_text(
        "{{ domain }}\n\n{{ (cycler|attr(domain)).__name__ }}\n", encoding="utf-8")
    (tmp_path / "p" / "hyde" / "exam.j2").write_text("{{ (cycler|attr(query))|string }}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"hyde/qa\.j2:3: unsafe template"):
        prompt_templates.render("hyde/qa.j2", prompts_dir=tmp_path / "p", query="q", domain="__init__")
    with pytest.raises(ConfigError, match=r"hyde/exam\.j2:1: unsafe template: access to attribute '__init__'"):
        prompt_templates.render("hyde/exam.j2", prompts_dir=tmp_path / "p", query="__init__")
    # values passed in cannot be changed either (the immutable sandbox)
    (tmp_path / "p" / "hyde" / "case.j2").write_text("{{ documents.append('x') }}{{ query }}\n", encoding="utf-8")
    documents = ["a"]
    with pytest.raises(ConfigError, match=r"hyde/case\.j2:1: unsafe template"):
        prompt_templates.render("hyde/case.j2", prompts_dir=tmp_path / "p", query="q", documents=documents)
    assert documents == ["a"] and not marker.exists()


def test_a_run_with_an_unsafe_template_stops_before_any_work(tmp_path, monkeypatch, capsys):
    from r2med_agent.cli.app import main
    from tests.unit.llm.cache.test_cache import write_task_dir

    marker = tmp_path / "PWNED"
    prompts = tmp_path / "prompts"
    (prompts / "hyde" / "deep").mkdir(parents=True)
    (prompts / "hyde" / "qa.j2").write_text("{{ query }}\n", encoding="utf-8")
    (prompts / "hyde" / "deep" / "_part.j2").write_text("ok\n\n" + UNSAFE % marker, encoding="utf-8")
    monkeypatch.setenv(prompt_templates.ENV_VAR, str(prompts))
    cache = tmp_path / "cache"
    monkeypatch.setenv("R2MED_CACHE_DIR", str(cache))
    code = main(["run", "--task", "Biology", "--method", "hyde", "--llm", "smollm2", "--retriever", "bm25",
                 "--data-dir", str(write_task_dir(tmp_path / "data")), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{prompts / 'hyde' / 'deep' / '_part.j2'}:4: unsafe template" in err and "Traceback" not in err
    assert not marker.exists() and not cache.exists() and not (tmp_path / "out").exists()


def _every_variable(part: str, qwq: bool) -> dict:
    return {"query": "QUERY text", "domain": "biology", "examples": EXAMPLES, "documents": DOCUMENTS,
            "passages": ["first passage", "second passage"], "part": part, "qwq": qwq, "max_searches": 5,
            "previous_steps": "STEP one", "search_query": "SEARCH q", "document": "DOC text",
            "answer_label": "Answer", "query_label": "Query", "label": "Question", "subject": "SUBJ",
            "task_line": "TASK line", "example": "EX", "example_query": "EXQ", "example_question": "EXQQ",
            "example_step": "EXSTEP", "scores": {"1": 3, "2": 5}}


def test_every_shipped_template_renders_in_the_sandbox_as_in_a_plain_environment():
    import jinja2

    plain = jinja2.Environment(loader=jinja2.FileSystemLoader(str(prompts_dir()), encoding="utf-8"),
                               undefined=jinja2.StrictUndefined, autoescape=False,
                               keep_trailing_newline=True, trim_blocks=True)
    names = sorted(p.relative_to(prompts_dir()).as_posix() for p in prompts_dir().rglob("*.j2")
                   if not p.name.startswith("_"))
    assert len(names) >= 50
    for name in names:
        rendered = 0
        for part in ("system", "user"):
            for qwq in (True, False):
                for scores in ({"1": 3, "2": 5}, [3, 5]):
                    variables = {**_every_variable(part, qwq), "scores": scores}
                    try:
                        want = plain.get_template(name).render(**variables)
                    except jinja2.UndefinedError:  # not this template's variables
                        with pytest.raises(ConfigError):
                            prompt_templates.render(name, **variables)
                        continue
                    assert prompt_templates.render(name, **variables) == want, name
                    rendered += 1
        assert rendered, name


def test_edited_template_is_reread(tmp_path):
    (tmp_path / "hyde").mkdir()
    path = tmp_path / "hyde" / "qa.j2"
    path.write_text("one {{ query }}", encoding="utf-8")
    assert prompt_templates.render("hyde/qa.j2", prompts_dir=tmp_path, query="q", domain="d") == "one q"
    path.write_text("two {{ query }}", encoding="utf-8")
    st = path.stat()  # make sure the modification time moves on coarse clocks
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert prompt_templates.render("hyde/qa.j2", prompts_dir=tmp_path, query="q", domain="d") == "two q"


# -- template_hash -----------------------------------------------------------------------------


def copy_prompts(dst: Path) -> Path:
    shutil.copytree(prompts_dir(), dst, ignore=shutil.ignore_patterns("*.py", "__pycache__", "*.md"))
    return dst


def test_hash_is_stable_and_distinct():
    hashes = {(m, f): prompt_templates.template_hash(m, f) for m in METHODS for f in FAMILIES}
    assert len(set(hashes.values())) == len(hashes)
    assert all(len(h) == 64 for h in hashes.values())
    assert prompt_templates.template_hash("hyde", "qa") == hashes[("hyde", "qa")]


def test_hash_depends_on_content_not_location(tmp_path):
    copy = copy_prompts(tmp_path / "copy")
    for m in METHODS:
        for f in FAMILIES:
            assert prompt_templates.template_hash(m, f, prompts_dir=copy) == prompt_templates.template_hash(m, f)


def test_hash_changes_when_template_changes(tmp_path):
    copy = copy_prompts(tmp_path / "copy")
    before = prompt_templates.template_hash("hyde", "qa", prompts_dir=copy)
    path = copy / "hyde" / "qa.j2"
    path.write_text(path.read_text(encoding="utf-8").replace("Please write", "Write"), encoding="utf-8")
    assert prompt_templates.template_hash("hyde", "qa", prompts_dir=copy) != before
    # Other families are untouched.
    assert prompt_templates.template_hash("hyde", "exam", prompts_dir=copy) == prompt_templates.template_hash("hyde", "exam")


def test_hash_changes_when_an_override_shadows_a_file(tmp_path):
    override = tmp_path / "mine"
    (override / "hyde").mkdir(parents=True)
    template = "Write something.\nPost: {{ query }}\nPassage:\n"
    (override / "hyde" / "qa.j2").write_text(template, encoding="utf-8")
    assert prompt_templates.template_hash("hyde", "qa", prompts_dir=override) != prompt_templates.template_hash("hyde", "qa")


def test_hash_follows_included_files(tmp_path):
    copy = copy_prompts(tmp_path / "copy")
    before = {f: prompt_templates.template_hash("lamer", f, prompts_dir=copy) for f in FAMILIES}
    shared = copy / "lamer" / "_documents.j2"
    shared.write_text(shared.read_text(encoding="utf-8").replace("]. ", "] "), encoding="utf-8")
    for f in FAMILIES:
        assert prompt_templates.template_hash("lamer", f, prompts_dir=copy) != before[f]


def test_hash_follows_examples_file(tmp_path):
    copy = copy_prompts(tmp_path / "copy")
    before = prompt_templates.template_hash("query2doc", "exam", prompts_dir=copy)
    examples = copy / "query2doc" / "examples" / "exam.yaml"
    examples.write_text(examples.read_text(encoding="utf-8").replace("Graves", "Basedow"), encoding="utf-8")
    assert prompt_templates.template_hash("query2doc", "exam", prompts_dir=copy) != before


def test_hash_refuses_computed_include(tmp_path):
    (tmp_path / "hyde").mkdir()
    (tmp_path / "hyde" / "qa.j2").write_text('{% include "hyde/" ~ family ~ ".j2" %}', encoding="utf-8")
    with pytest.raises(ConfigError, match="computed"):
        prompt_templates.template_hash("hyde", "qa", prompts_dir=tmp_path)


def test_hash_of_unknown_template_is_an_error():
    with pytest.raises(ConfigError, match="hyde/nosuch.j2"):
        prompt_templates.template_hash("hyde", "nosuch")


# -- examples ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, domain",
    [("qa", "biology"), ("qa", "bioinformatics"), ("qa", "medical sciences"),
     ("exam", "medicine"), ("treatment", "medicine"), ("case", "medicine")],
)
def test_packaged_examples_are_two_per_family(family, domain):
    examples = prompt_templates.load_examples("query2doc", family, domain)
    assert len(examples) == 2
    for ex in examples:
        assert set(ex) == {"query", "passage"}
        assert len(ex["query"].split()) >= 10 and len(ex["passage"].split()) >= 50


def test_qa_examples_differ_by_domain():
    bio = prompt_templates.load_examples("query2doc", "qa", "biology")
    bioinf = prompt_templates.load_examples("query2doc", "qa", "bioinformatics")
    assert {e["query"] for e in bio}.isdisjoint({e["query"] for e in bioinf})


def test_unknown_domain_is_an_error_where_the_file_has_no_fallback(tmp_path):
    # (The package's qa.yaml falls back to its medical-sciences examples: tests/unit/methods/
    # test_query2doc_own_data.py.)
    (tmp_path / "query2doc" / "examples").mkdir(parents=True)
    (tmp_path / "query2doc" / "examples" / "qa.yaml").write_text(
        "biology:\n  - query: q\n    passage: p\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="no examples for domain 'chemistry'.*biology"):
        prompt_templates.load_examples("query2doc", "qa", "chemistry", prompts_dir=tmp_path)


@pytest.mark.parametrize(
    "content, message",
    [
        ("- query: q\n  passage: p\n  answer: x\n", "exactly the keys query, passage"),
        ("- query: q\n", "exactly the keys query, passage"),
        ("- query: ''\n  passage: p\n", "non-empty"),
        ("[]\n", "non-empty list"),
        ("medicine:\n  - query: q\n- stray\n", r"exam\.yaml:3: malformed YAML"),
    ],
)
def test_bad_examples_file(tmp_path, content, message):
    (tmp_path / "query2doc" / "examples").mkdir(parents=True)
    (tmp_path / "query2doc" / "examples" / "exam.yaml").write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        prompt_templates.load_examples("query2doc", "exam", "medicine", prompts_dir=tmp_path)


def test_examples_file_that_is_not_utf8(tmp_path):
    (tmp_path / "query2doc" / "examples").mkdir(parents=True)
    (tmp_path / "query2doc" / "examples" / "exam.yaml").write_bytes(
        b"medicine:\n  - query: q\n    passage: caf\xe9\n"
    )
    with pytest.raises(ConfigError, match=r"exam\.yaml:3: not UTF-8 text"):
        prompt_templates.load_examples("query2doc", "exam", "medicine", prompts_dir=tmp_path)


def test_override_examples_file(tmp_path):
    (tmp_path / "query2doc" / "examples").mkdir(parents=True)
    (tmp_path / "query2doc" / "examples" / "qa.yaml").write_text(
        "chemistry:\n  - query: Why is water polar?\n    passage: Oxygen is more electronegative.\n",
        encoding="utf-8",
    )
    assert prompt_templates.load_examples("query2doc", "qa", "chemistry", prompts_dir=tmp_path) == [
        {"query": "Why is water polar?", "passage": "Oxygen is more electronegative."}
    ]
