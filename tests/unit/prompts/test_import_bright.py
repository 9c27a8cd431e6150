"""``prompts import`` of a BRIGHT clone: ``reason.py``'s reasoning prompt, read with ast.

The fake clone has BRIGHT's file path and structure (a ``__main__`` loop that sets ``cur_post`` from
the example's query with ``.replace`` and builds ``prompt`` as adjacent f-strings) with this test's
own dummy sentences; its module-level code must never run. The rendered template is compared with
the prompt the fake's own construction gives (the loop body run on its own, from the ast).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from r2med_agent.methods import get_method
from r2med_agent.prompts.importer import BRIGHT_FILES, BRIGHT_REPO, READERS, import_clone, write_prompts
from r2med_agent.types import Doc, Query, Task
from tests.unit.prompts.test_import import GUARD, _no_env_override, run_import, write  # noqa: F401  (autouse)

REASON = GUARD + '''
if __name__ == '__main__':
    for e in examples:
        cur_post = e["query"].replace('\\n', ' ').replace('\\t', '  ')
        prompt = (f'Consider: {cur_post}\\n\\n'
                  f'Steps:\\n'
                  f'A. say what it asks; {{braces}} stay.\\n')
        output = model.generate(prompt)
'''


def _theirs(source: str, query: str) -> str:
    """The fake's loop body, run from its ast on one example."""
    tree = ast.parse(source)
    loop = next(n for n in ast.walk(tree) if isinstance(n, ast.For))
    body = [s for s in loop.body if isinstance(s, ast.Assign) and s.targets[0].id in ("cur_post", "prompt")]
    ns = {"e": {"query": query}}
    exec(compile(ast.Module(body, type_ignores=[]), "reason.py", "exec"), ns)  # noqa: S102
    return ns["prompt"]


def test_the_reader_is_registered_with_brights_repo_commit_and_files() -> None:
    from r2med_agent.prompts.sources import prompt_sources, source_of_folder

    assert READERS["BRIGHT"][0] == BRIGHT_FILES == ("reason.py",)
    pin = prompt_sources()["BRIGHT"]
    assert BRIGHT_REPO == pin.repo == "xlang-ai/BRIGHT" and len(pin.commit) == 40 and int(pin.commit, 16) >= 0
    assert set(pin.files) == set(BRIGHT_FILES) and source_of_folder("reason") is pin


def test_bright_reasoning_prompt_renders_as_reason_py_builds_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    clone = tmp_path / "BRIGHT"
    write(clone, "reason.py", REASON)
    out = tmp_path / "prompts"
    printed = run_import(clone, out, capsys)
    assert "reason/qa.j2 <- reason.py:" in printed
    method = get_method("reason")(prompts_dir=out)
    queries = ("multi\nline\tpost  ", "one line", "x\n")
    for family in ("qa", "exam", "treatment", "case"):
        task = Task(name="t", family=family, domain="d", queries=tuple(Query(str(i), q) for i, q in enumerate(queries)),  # type: ignore[arg-type]
                    corpus=(Doc("d0", "x"),), qrels={}, source="inline", fingerprint="fp")
        got = [c[0]["content"] for c in method.build_prompts(task)]
        assert got == [_theirs(REASON, q) for q in queries]
        assert got[0].endswith("stay.\n")  # the trailing newline kept (an exact template)


def test_a_reason_py_of_another_shape_is_refused_with_file_and_line(tmp_path: Path) -> None:
    from r2med_agent.errors import DataError

    clone = tmp_path / "BRIGHT"
    write(clone, "reason.py", GUARD + "cur_post = e['text'].replace('\\n', ' ')\nprompt = f'{cur_post}'\n")
    with pytest.raises(DataError, match=r"reason\.py:\d+: cur_post is not the example's 'query' field"):
        import_clone(clone)
    write(clone, "reason.py", GUARD + "cur_post = e['query']\nprompt = f'{cur_post} {other}'\n")
    with pytest.raises(DataError, match=r"reason\.py:\d+: an f-string field other than cur_post"):
        write_prompts(import_clone(clone), tmp_path / "out")
