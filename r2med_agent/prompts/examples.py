"""Import R2MED's Query2Doc few-shot examples (its ``src/example.py``) into a prompts folder.

The reference keeps two worked (query, passage) pairs per task in one Python file: a module-level
dict from its task keys (``Stack-Biology``, ``PMC-Treat``, ...) to one text block per task, where
each pair is a labelled query (``Post:``, ``Exam:`` or ``Case:``) followed by a labelled passage
(``Passage:`` or ``Similar Case:``). This project does not ship those texts; a user who has the
reference repository turns them into the project's examples files with::

    r2med-agent prompts import-examples path/to/R2MED/src/example.py --out my-prompts
    export R2MED_PROMPTS_DIR=my-prompts

The file is read with :mod:`ast` and :func:`ast.literal_eval`: its code never runs. The result is
``<out>/query2doc/examples/<family>.yaml``, a mapping from task name to that task's examples,
which :func:`r2med_agent.prompts.templates.load_examples` looks up by task before the package's per-domain
or per-family examples.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from r2med_agent.errors import ConfigError, DataError
from r2med_agent.prompts.static_python import read_python

QUERY_LABEL = re.compile(r"(?:Post|Exam|Case):[ \t]?(.*)$")
"""A line that opens an example's query (the reference's labels)."""

ANSWER_LABEL = re.compile(r"(?:Passage|Similar Case):[ \t]*(.*)$")
"""A line that opens an example's passage."""


@dataclass(frozen=True)
class ImportedExamples:
    """What :func:`read_reference_examples` found: task name -> examples, and where each came from."""

    examples: dict[str, list[dict[str, str]]]
    lines: dict[str, int]
    """task name -> line of its entry in the source file."""


def _find_dict(tree: ast.Module, path: Path) -> ast.Dict:
    """The module-level ``NAME = {...}`` holding the examples (the first such dict of strings)."""
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Dict) and value.keys and all(
            isinstance(k, ast.Constant) and isinstance(k.value, str) for k in value.keys
        ):
            return value
    raise DataError("no module-level dict of task name -> examples text (the layout of R2MED's src/example.py)", path)


def split_pairs(text: str) -> list[dict[str, str]]:
    """``[{query, passage}, ...]`` from one task's text block (labels removed, text stripped).

    A query starts at a query-label line that begins the block or follows a blank line after a
    passage; its passage starts at the next answer-label line and runs until the next query.

    Raises:
        ValueError: text before the first label, a query without a passage, or an empty part.
    """
    pairs: list[dict[str, list[str]]] = []
    part = ""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        q = QUERY_LABEL.match(line)
        starts_query = q is not None and (not pairs or (part == "passage" and not lines[i - 1].strip()))
        if starts_query:
            pairs.append({"query": [q.group(1)], "passage": []})  # type: ignore[union-attr]
            part = "query"
            continue
        a = ANSWER_LABEL.match(line)
        if a is not None and part == "query":
            pairs[-1]["passage"].append(a.group(1))
            part = "passage"
            continue
        if not pairs:
            if line.strip():
                raise ValueError(f"text before the first query label: {line.strip()[:60]!r}")
            continue
        pairs[-1][part].append(line)
    out = []
    for n, p in enumerate(pairs, 1):
        query, passage = "\n".join(p["query"]).strip(), "\n".join(p["passage"]).strip()
        if not query or not passage:
            raise ValueError(f"example {n} has {'no passage' if query else 'an empty query'}")
        out.append({"query": query, "passage": passage})
    if not out:
        raise ValueError("no labelled example (Post:/Exam:/Case: then Passage:/Similar Case:)")
    return out


def read_reference_examples(path: str | Path) -> ImportedExamples:
    """Parse a file laid out as R2MED's ``src/example.py`` without running it.

    Raises:
        DataError: unreadable file, a syntax error, no examples dict, a key that names no task, or a
            value that is not literal text or splits into no (query, passage) pairs (file and line).
    """
    from r2med_agent.data import REFERENCE_NAMES, get_task_spec

    path = Path(path)
    table = _find_dict(read_python(path, "the examples file"), path)
    examples: dict[str, list[dict[str, str]]] = {}
    lines: dict[str, int] = {}
    for key_node, value_node in zip(table.keys, table.values):
        key = key_node.value  # type: ignore[union-attr]
        line = key_node.lineno  # type: ignore[union-attr]
        try:
            text = ast.literal_eval(value_node)
        except ValueError:
            raise DataError(f"the examples of {key!r} are not literal text", path, line) from None
        if not isinstance(text, str):
            raise DataError(f"the examples of {key!r} must be a string, got {type(text).__name__}", path, line)
        try:
            task = get_task_spec(REFERENCE_NAMES.get(key, key)).name
        except ConfigError:
            raise DataError(f"{key!r} names no task (known reference keys: {', '.join(REFERENCE_NAMES)})",
                            path, line) from None
        try:
            examples[task] = split_pairs(text)
        except ValueError as e:
            raise DataError(f"the examples of {key!r}: {e}", path, line) from None
        lines[task] = line
    return ImportedExamples(examples, lines)


def write_examples(imported: ImportedExamples, out_dir: str | Path, *, force: bool = False) -> list[Path]:
    """Write ``<out_dir>/query2doc/examples/<family>.yaml`` (task name -> examples) per family.

    Raises:
        ConfigError: a file exists and ``force`` is False.
    """
    import yaml

    from r2med_agent.data import get_task_spec
    from r2med_agent.io import atomic_write_text

    by_family: dict[str, dict[str, list[dict[str, str]]]] = {}
    for task, pairs in imported.examples.items():
        by_family.setdefault(get_task_spec(task).family, {})[task] = pairs
    folder = Path(out_dir) / "query2doc" / "examples"
    targets = {family: folder / f"{family}.yaml" for family in sorted(by_family)}
    existing = [str(p) for p in targets.values() if p.exists()]
    if existing and not force:
        raise ConfigError(f"{', '.join(existing)} already exist; pass --force to replace them")
    written = []
    for family, path in targets.items():
        header = (
            "# Query2Doc worked examples per task, imported by `r2med-agent prompts import-examples`\n"
            "# from a file in the layout of R2MED's src/example.py. Used when R2MED_PROMPTS_DIR points\n"
            "# at this folder's parent; tasks not listed here make Query2Doc stop with an error.\n"
        )
        body = yaml.safe_dump(_literal_blocks(by_family[family]), allow_unicode=True, sort_keys=False, width=100)
        written.append(atomic_write_text(path, header + body))
    return written


class _Block(str):
    """A string dumped as a YAML literal block (keeps line breaks readable)."""


def _block_representer(dumper: object, data: _Block) -> object:
    return dumper.represent_scalar("tag:yaml.org,2002:str", str(data), style="|")  # type: ignore[attr-defined]


def _literal_blocks(doc: Mapping[str, list[dict[str, str]]]) -> dict[str, list[dict[str, str]]]:
    import yaml

    yaml.SafeDumper.add_representer(_Block, _block_representer)

    def wrap(text: str) -> str:
        # PyYAML falls back to a quoted scalar itself where a literal block cannot hold the text.
        return _Block(text) if "\n" in text else text

    return {task: [{k: wrap(v) for k, v in pair.items()} for pair in pairs] for task, pairs in doc.items()}
