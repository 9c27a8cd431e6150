"""Prompt templates with limits (issue 39 item 3): a template that would run without end, build a
huge string or call itself stops with its file and line; jinja2 older than 3.1.6 is refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from r2med_agent.prompts import sandbox as prompt_sandbox
from r2med_agent.prompts import templates as prompt_templates
from r2med_agent.errors import ConfigError

_LOOPS = ("more than 1,000,000 loop iterations", "rendering took more than 5 s")  # whichever comes first

HOSTILE = {
    # name: (template, its line that stops, what the message says)
    "nested-range": ("Post: {{ query }}\n{% for i in range(99999) %}{% for j in range(99999) %}"
                     "{% endfor %}{% endfor %}\n", 2, _LOOPS),
    "nested-range-output": ("{% for i in range(99999) %}\n{% for j in range(99999) %}.{% endfor %}{% endfor %}\n",
                            2, _LOOPS),
    "big-range": ("{{ query }}\n\n{% for i in range(10**9) %}{% endfor %}\n", 3, "range() of 1,000,000,000 items"),
    "repeat": ("{{ query }}\n{{ 'x' * 10**10 }}\n", 2, "'*' would make 10,000,000,000"),
    "indent": ("{{ query|indent(10**10) }}\n", 1, "the filter indent would make"),
    "center": ("{{ query|center(10**10) }}\n", 1, "the filter center would make"),
    "format-width": ("{{ '%10000000000d'|format(1) }}\n", 1, "format width"),
    "str-format": ("{{ '{:>10000000000}'.format(query) }}\n", 1, "a format width"),
    "slice": ("{{ range(10)|slice(10**9)|list }}\n", 1, "the filter slice"),
    "wordwrap": ("{{ query|wordwrap(1, wrapstring='x' * 1000000) }}\n", 1, "the filter wordwrap"),
    "ljust": ("{{ query.ljust(10**10) }}\n", 1, "str.ljust"),
    "power": ("{{ 7 ** (10 ** 9) }}\n", 1, "'**' would make an integer"),
    "recursive-macro": ("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}\n{{ m(0) }}\n", 1, "calls nested more than 50"),
    "doubling-macro": ("{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s|length }}{% endif %}"
                       "{% endmacro %}{{ d(query, 60) }}\n", 1, "'~' would make"),
    "doubling-namespace": ("{% set ns = namespace(x=query) %}\n{% for i in range(60) %}{% set ns.x = ns.x + ns.x %}"
                           "{% endfor %}{{ ns.x|length }}\n", 2, "'+' would make"),
    "join-bomb": ("{% set s = 'x' * 1000000 %}{{ ([s] * 100000)|join }}\n", 1, "'*' would make"),
    "macro-buffer": ("{% macro m() %}{% for i in range(99999) %}" + "y" * 1000 + "{% endfor %}{% endmacro %}"
                     "{{ m()|length }}\n", 1, "the output would pass"),
    "division-by-zero": ("{{ query }}\n{{ 1 / 0 }}\n", 2, "template failed: ZeroDivisionError"),
    "self-include": ("{{ query }}\n{% include 'hyde/qa.j2' %}\n", 2, "template includes itself (hyde/qa.j2 -> hyde/qa.j2)"),
}


def _says(message: str, what: str | tuple[str, ...]) -> bool:
    return any(w in message for w in ((what,) if isinstance(what, str) else what))


def _folder(tmp_path: Path, source: str) -> Path:
    folder = tmp_path / "prompts"
    (folder / "hyde").mkdir(parents=True, exist_ok=True)
    for family in ("qa", "exam", "treatment", "case"):
        (folder / "hyde" / f"{family}.j2").write_text(source, encoding="utf-8")
    return folder


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_template_stops_with_file_and_line(tmp_path, case):
    """Before: nested loops ran past 60 s, the others ended in OverflowError, MemoryError or
    RecursionError tracebacks (or, for the doubling cases, a process killed for memory)."""
    source, line, what = HOSTILE[case]
    folder = _folder(tmp_path, source)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        prompt_templates.render("hyde/qa.j2", prompts_dir=folder, query="what is insulin", domain="medical")
    assert f"{folder / 'hyde' / 'qa.j2'}:{line}: " in str(e.value) and _says(str(e.value), what), str(e.value)
    assert time.monotonic() - t0 < 60  # a bound on the test, not a claim (benchmarks/hostile.py measures)


def test_a_long_variable_is_no_hostile_output(tmp_path):
    """The limit on what a template makes counts beyond its variables: quoting a 12 MB document is
    fine, and so is a template that loops over a long list a bounded number of times."""
    folder = _folder(tmp_path, "{{ query }}\n{% for d in docs %}[{{ loop.index }}] {{ d }}\n{% endfor %}")
    doc = "word " * 2_400_000
    out = prompt_templates.render("hyde/qa.j2", prompts_dir=folder, query="q", docs=[doc, "short"])
    assert len(out) > 12_000_000 and out.endswith("[2] short\n")


def test_jinja2_older_than_3_1_6_is_refused(monkeypatch, tmp_path):
    """3.1.5 lets ``attr("format")`` read os.environ from a template; before, any 3.1 was taken."""
    prompt_sandbox.check_jinja2("3.1.6")
    prompt_sandbox.check_jinja2("3.2.0.dev1")
    for old in ("3.1.5", "3.0.3", "2.11.3", "3.1"):
        with pytest.raises(ConfigError, match=rf"jinja2 {old} is imported; r2med-agent needs jinja2>=3\.1\.6"):
            prompt_sandbox.check_jinja2(old)
    import jinja2

    monkeypatch.setattr(jinja2, "__version__", "3.1.5")
    prompt_templates._environment.cache_clear()
    folder = _folder(tmp_path, "{{ query }}")
    try:
        with pytest.raises(ConfigError, match=r"pip install 'jinja2>=3\.1\.6'"):
            prompt_templates.render("hyde/qa.j2", prompts_dir=folder, query="q")
        with pytest.raises(ConfigError, match=r"pip install 'jinja2>=3\.1\.6'"):
            prompt_templates.check_folder(folder)  # what a run checks before any work
    finally:
        prompt_templates._environment.cache_clear()


def test_a_run_with_an_old_jinja2_stops_before_any_work(tmp_path):
    """Through the CLI, with jinja2 reporting 3.1.5 (set by a sitecustomize in the child): one
    line, exit 2, nothing cached or written. Before: the run went on with the old sandbox."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import jinja2\njinja2.__version__ = '3.1.5'\n", encoding="utf-8")
    env = {**os.environ, "R2MED_CACHE_DIR": str(tmp_path / "cache"),
           prompt_templates.ENV_VAR: str(_folder(tmp_path, "{{ query }}")),
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "r2med_agent", "run", "--method", "hyde", "--llm", "smollm2",
                           "--task", "sample", "-o", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: jinja2 3.1.5 is imported; r2med-agent needs jinja2>=3.1.6: in older versions a prompt template "
        "escapes the sandbox through attr('format') and reads the environment (API keys included); upgrade it: "
        "pip install 'jinja2>=3.1.6'"], proc.stderr
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


def test_pyproject_requires_the_fixed_jinja2():
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text(encoding="utf-8"))
    assert "jinja2>=3.1.6" in pyproject["project"]["dependencies"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["nested-range", "big-range", "repeat", "indent", "recursive-macro",
                                  "doubling-macro", "self-include", "macro-buffer"])
def test_a_run_with_a_hostile_template_stops_with_one_line(tmp_path, smollm2_gguf, case):
    """Through the real CLI and the real local model's run (``--llm smollm2``): one line with the
    template's file and line, exit 2, no traceback, in bounded time."""
    source, line, what = HOSTILE[case]
    folder = _folder(tmp_path, source)
    env = {**os.environ, "R2MED_CACHE_DIR": str(tmp_path / "cache"), prompt_templates.ENV_VAR: str(folder)}
    proc = subprocess.run([sys.executable, "-m", "r2med_agent", "run", "--method", "hyde", "--llm", "smollm2",
                           "--task", "sample", "--max-tokens", "8", "-o", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=180)
    err = proc.stderr.strip()
    assert proc.returncode == 2, err
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert f"{folder / 'hyde' / 'qa.j2'}:{line}: " in last and _says(last, what), err
