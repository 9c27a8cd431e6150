"""``prompts import``: the reference repositories' exact prompts, read from the user's clone.

The shipped templates are this project's own wording. A user who has a clone of a reference
repository turns its prompts into a prompts folder of the same layout::

    r2med-agent prompts import path/to/R2MED --out ref-prompts
    export R2MED_PROMPTS_DIR=ref-prompts

The clone's Python files are parsed with :mod:`ast`; nothing in them is imported or run. Each
recognised repository gives the templates of the methods it defines (see :data:`READERS`); every
template renders, through the project's template variables, the text the reference's own code
builds for the same question and documents, byte for byte: its first line is
:data:`~r2med_agent.prompt_templates.EXACT_MARK`, which tells the methods to keep the rendered
text's trailing whitespace (the shipped templates have it dropped). What the reference builds
around the prompt (the documents' own layout, the chat template) stays the project's.

The folder also gets :data:`RECORD` (JSON): per import, the reference, the clone's commit when it
has a ``.git``, and the prompt folders it wrote. A run records it beside its configuration
(:func:`imported_prompts`); the run's identity already holds the folder's hash (``prompts``).
"""

from __future__ import annotations

import ast
import json
import string
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from r2med_agent.errors import ConfigError, DataError
from r2med_agent.prompt_templates import ENV_VAR, EXACT_MARK

__all__ = ["READERS", "RECORD", "ImportedPrompts", "describe", "import_clone", "imported_prompts", "run_prompt_folders",
           "write_prompts"]

RECORD = ".r2med-import.json"
"""The file in an imported prompts folder that says where its templates came from."""

FAMILIES = ("qa", "exam", "treatment", "case")

Piece = tuple[str, str]
"""One part of a prompt: ``("text", literal)``, ``("expr", Jinja expression)`` or ``("code",
Jinja source spliced as it is)``."""


@dataclass
class ImportedPrompts:
    """What one clone gave: template files (relative path -> Jinja source) and their origins."""

    reference: str
    commit: str | None
    templates: dict[str, str] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    """relative path -> ``file:line`` of the clone it was read from."""

    @property
    def folders(self) -> list[str]:
        return sorted({rel.split("/", 1)[0] for rel in self.templates})


# ----------------------------------------------------------------------------------------------
# Jinja from literal text and expressions


def _literal(text: str) -> str:
    """``text`` as template source that renders to exactly ``text``: a ``{`` that would open a
    Jinja tag (or ends the piece), a carriage return, and a leading newline (which ``trim_blocks``
    drops after a block tag) are written as expressions."""
    out = []
    for i, ch in enumerate(text):
        nxt = text[i + 1] if i + 1 < len(text) else ""
        if (ch == "{" and nxt in ("{", "%", "#", "")) or ch == "\r" or (ch == "\n" and i == 0):
            out.append("{{ " + json.dumps(ch) + " }}")
        else:
            out.append(ch)
    return "".join(out)


def _source(pieces: Iterable[Piece]) -> str:
    merged: list[Piece] = []
    for piece in pieces:  # adjacent literals as one, so that only real tag openings are escaped
        if merged and piece[0] == merged[-1][0] == "text":
            merged[-1] = ("text", merged[-1][1] + piece[1])
        else:
            merged.append(piece)
    parts = []
    for kind, value in merged:
        parts.append(_literal(value) if kind == "text" else value if kind == "code" else "{{ " + value + " }}")
    return "".join(parts)


def _template(origin: str, reference: str, body: str) -> str:
    """A template file: the exact-rendering mark (naming the source), then the body."""
    return f"{EXACT_MARK} {reference}: {origin} #}}\n{body}"


# ----------------------------------------------------------------------------------------------
# Static reading of string expressions


@dataclass
class _Module:
    """One parsed file of the clone."""

    path: Path
    rel: str
    tree: ast.Module

    def at(self, node: ast.AST) -> str:
        return f"{self.rel}:{getattr(node, 'lineno', 0)}"

    def error(self, message: str, node: ast.AST | None = None) -> DataError:
        return DataError(message, self.path, getattr(node, "lineno", None))

    def function(self, name: str) -> ast.FunctionDef:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
        raise self.error(f"no function {name}() (the reference's layout)")

    def assigned(self, name: str) -> ast.expr:
        """The value of the module-level ``name = ...``."""
        for node in self.tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return node.value
        raise self.error(f"no module-level {name} = ... (the reference's layout)")


def _parse(clone: Path, rel: str) -> _Module:
    path = clone / rel
    try:
        source = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError("not UTF-8 text", path) from None
    except OSError as e:
        raise DataError(f"cannot read it ({e.strerror})", path) from None
    try:
        return _Module(path, rel, ast.parse(source, filename=str(path)))
    except SyntaxError as e:
        raise DataError(f"not valid Python: {e.msg}", path, e.lineno) from None


def _pieces(mod: _Module, node: ast.expr, names: dict[str, Piece]) -> list[Piece]:
    """A string expression as pieces: literals, f-strings whose fields are the names in ``names``
    (Python name -> the piece it stands for), and ``+`` of those. Anything else is an error."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [("text", node.value)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _pieces(mod, node.left, names) + _pieces(mod, node.right, names)
    if isinstance(node, ast.JoinedStr):
        out: list[Piece] = []
        for value in node.values:
            if isinstance(value, ast.FormattedValue):
                inner = value.value
                if not (isinstance(inner, ast.Name) and inner.id in names) or value.conversion != -1 or value.format_spec:
                    raise mod.error(f"an f-string field other than {', '.join(sorted(names)) or 'none'}", node)
                out.append(names[inner.id])
            else:
                out.extend(_pieces(mod, value, names))
        return out
    raise mod.error(f"expected literal text or an f-string, found {type(node).__name__}", node)


def _format_pieces(mod: _Module, node: ast.AST, text: str, fields: dict[str, str]) -> list[Piece]:
    """``text`` (a ``str.format`` template) as pieces: each ``{NAME}`` becomes ``fields[NAME]``,
    a Jinja expression, or Jinja code spliced as it is when it starts with ``{%`` (a loop)."""
    out: list[Piece] = []
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as e:
        raise mod.error(f"not a valid format string: {e}", node) from None
    for literal, name, spec, conversion in parsed:
        if literal:
            out.append(("text", literal))
        if name is None:
            continue
        if name not in fields or spec or conversion:
            raise mod.error(f"a format field {{{name}}} other than {', '.join('{' + f + '}' for f in fields)}", node)
        value = fields[name]
        out.append(("code", value) if value.startswith("{%") else ("expr", value))
    return out


def _return_value(mod: _Module, func: ast.FunctionDef) -> ast.expr:
    for node in ast.walk(func):
        if isinstance(node, ast.Return) and node.value is not None:
            return node.value
    raise mod.error(f"{func.name}() returns nothing", func)


def _params(func: ast.FunctionDef, exprs: Sequence[str]) -> dict[str, Piece]:
    """The function's first parameters (after ``self``), by position, mapped to Jinja expressions."""
    args = [a for a in func.args.args if a.arg != "self"]
    return {a.arg: ("expr", e) for a, e in zip(args, exprs)}


def _constants(body: Iterable[ast.stmt]) -> dict[str, Piece]:
    """``NAME = "text"`` assignments among ``body``'s statements, as literal pieces."""
    out: dict[str, Piece] = {}
    for stmt in body:
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)):
            out[stmt.targets[0].id] = ("text", stmt.value.value)
    return out


def _commit(clone: Path) -> str | None:
    """The clone's HEAD commit, or None without a ``.git`` (or without git)."""
    if not (clone / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


# ----------------------------------------------------------------------------------------------
# R2MED: src/instrcution.py (+ src/example.py)

R2MED_FILES = ("src/instrcution.py", "src/instruction.py")
"""R2MED keeps its generation prompts in src/instrcution.py (the file's own spelling)."""

R2MED_METHODS = ("hyde", "query2doc", "lamer")

LAMER_PASSAGES = '{% for document in documents %}{{ "\\n" }}[{{ loop.index }}]. {{ document }}{% endfor %}'
"""R2MED's ``{PASSAGE}``: ``"\\n[i]. text"`` per first-pass document (generate_hypothetical_doc.py
read_data), each already one line cut to 512 words as the project's LameR cuts it."""


def _r2med_names(mod: _Module, clone: Path) -> dict[str, dict[str, str]]:
    """Module-level dicts of text imported with ``from X import Y`` (R2MED's ``Example``)."""
    out: dict[str, dict[str, str]] = {}
    for node in mod.tree.body:
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        rel = str(Path(mod.rel).parent / (node.module.replace(".", "/") + ".py"))
        if not (clone / rel).is_file():
            continue
        other = _parse(clone, rel)
        for alias in node.names:
            try:
                value = ast.literal_eval(other.assigned(alias.name))
            except (DataError, ValueError):
                continue
            if isinstance(value, dict):
                out[alias.asname or alias.name] = value
    return out


def _r2med_text(mod: _Module, node: ast.expr, imported: dict[str, dict[str, str]]) -> str:
    """One prompt's text: literal, or ``"...".format(NAME=literal or Table["key"], ...)`` as
    R2MED builds its Query2Doc prompts (evaluated here, never run)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    call = node
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "format"
            and not call.args and isinstance(call.func.value, ast.Constant) and isinstance(call.func.value.value, str)):
        raise mod.error("expected literal text or \"...\".format(NAME=...)", node)
    values: dict[str, str] = {}
    for kw in call.keywords:
        v = kw.value
        if isinstance(v, ast.Constant) and isinstance(v.value, str):
            values[kw.arg or ""] = v.value
        elif (isinstance(v, ast.Subscript) and isinstance(v.value, ast.Name) and v.value.id in imported
              and isinstance(v.slice, ast.Constant) and v.slice.value in imported[v.value.id]):
            values[kw.arg or ""] = str(imported[v.value.id][v.slice.value])
        else:
            raise mod.error(f"format argument {kw.arg} is neither literal text nor an imported table entry", node)
    pieces = _format_pieces(mod, node, call.func.value.value, {k: k for k in values})
    return "".join(p[1] if p[0] == "text" else values[p[1]] for p in pieces)


def read_r2med(clone: Path) -> ImportedPrompts:
    """HyDE, Query2Doc and LameR per task, from R2MED's ``src/instrcution.py``: its ``hyde``,
    ``query2doc`` and ``lamer`` dicts from task key to a ``str.format`` template of ``{TEXT}``
    (and ``{PASSAGE}``); Query2Doc's worked examples come in from ``src/example.py``."""
    from r2med_agent.data import REFERENCE_NAMES, get_task_spec

    rel = next(r for r in R2MED_FILES if (clone / r).is_file())
    mod = _parse(clone, rel)
    imported = _r2med_names(mod, clone)
    out = ImportedPrompts("R2MED/R2MED", _commit(clone))
    fields = {"TEXT": "query", "PASSAGE": LAMER_PASSAGES}
    for method in R2MED_METHODS:
        table = mod.assigned(method)
        if not isinstance(table, ast.Dict):
            raise mod.error(f"{method} is not a dict of task -> prompt", table)
        by_family: dict[str, list[tuple[str, str, ast.AST]]] = {}
        for key_node, value in zip(table.keys, table.values):
            if not (isinstance(key_node, ast.Constant) and isinstance(key_node.value, str)):
                raise mod.error(f"a key of {method} is not a task name", table)
            try:
                spec = get_task_spec(REFERENCE_NAMES.get(key_node.value, key_node.value))
            except ConfigError:
                raise mod.error(f"{key_node.value!r} names no task", key_node) from None
            by_family.setdefault(spec.family, []).append((spec.name, _r2med_text(mod, value, imported), key_node))
        for family, entries in by_family.items():
            body = ""
            for i, (task, text, node) in enumerate(entries):
                body += ("{% if" if i == 0 else "{% elif") + f" task == {json.dumps(task)} %}}"
                body += _source(_format_pieces(mod, node, text, fields))
            # A task the reference has no prompt for stops with this name in the error.
            body += "{% else %}{{ the_reference_has_no_prompt_for_this_task }}{% endif %}"
            relpath = f"{method}/{family}.j2"
            out.templates[relpath] = _template(mod.at(entries[0][2]), out.reference, body)
            out.origins[relpath] = mod.at(entries[0][2])
    return out


# ----------------------------------------------------------------------------------------------
# Search-R1: scripts/data_process/nq_search.py make_prefix, search_r1/llm_agent/generation.py

SEARCH_R1_PREFIX = "scripts/data_process/nq_search.py"
SEARCH_R1_LOOP = "search_r1/llm_agent/generation.py"


def read_search_r1(clone: Path) -> ImportedPrompts:
    """Search-R1's training prompt (``make_prefix`` of its data preparation: an f-string of the
    question, which the project strips and ends with ``?`` as the reference does) for every
    family, and the corrective message of its loop (``execute_predictions``)."""
    out = ImportedPrompts("PeterGriffinJin/Search-R1", _commit(clone))
    mod = _parse(clone, SEARCH_R1_PREFIX)
    func = mod.function("make_prefix")
    value = next((n.value for n in ast.walk(func) if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "prefix" for t in n.targets)), None)
    if value is None:
        raise mod.error("make_prefix() assigns no prefix", func)
    body = _source(_pieces(mod, value, {"question": ("expr", "query")}))
    for family in FAMILIES:
        out.templates[f"search-r1/{family}.j2"] = _template(mod.at(value), out.reference, body)
        out.origins[f"search-r1/{family}.j2"] = mod.at(value)
    loop = _parse(clone, SEARCH_R1_LOOP)
    texts = []
    for node in ast.walk(loop.function("execute_predictions")):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
                and len(node.args) == 1 and (isinstance(node.args[0], ast.JoinedStr) or (
                    isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)))):
            pieces = _pieces(loop, node.args[0], {}) if _fixed(node.args[0]) else []
            text = "".join(p[1] for p in pieces)
            if text.strip():
                texts.append((text, node))
    if len(texts) != 1:
        raise loop.error(f"expected one fixed corrective message in execute_predictions(), found {len(texts)}")
    text, node = texts[0]
    if text != "\n" + text.strip() + "\n":
        raise loop.error("the corrective message must sit between single newlines (the loop adds them)", node)
    out.templates["search-r1/invalid.j2"] = _template(loop.at(node), out.reference, _literal(text.strip()))
    out.origins["search-r1/invalid.j2"] = loop.at(node)
    return out


def _fixed(node: ast.expr) -> bool:
    """Whether a string expression has no fields (the loop's other messages carry results)."""
    return not any(isinstance(n, ast.FormattedValue) for n in ast.walk(node))


# ----------------------------------------------------------------------------------------------
# Search-o1: scripts/prompts.py

SEARCH_O1_PROMPTS = "scripts/prompts.py"


def _o1_task_prompt(mod: _Module) -> tuple[list[Piece], list[Piece], ast.AST]:
    """``get_task_instruction_openqa``: (QwQ's prompt, the others'), from its ``if model_name ==
    'qwq'`` branches."""
    func = mod.function("get_task_instruction_openqa")
    names = _params(func, ["query"])
    branch = next((n for n in ast.walk(func) if isinstance(n, ast.If)), None)
    if branch is None:
        raise mod.error("get_task_instruction_openqa() has no QwQ branch", func)

    def assigned(body: list[ast.stmt]) -> list[Piece]:
        for stmt in body:
            if isinstance(stmt, ast.Assign):
                return _pieces(mod, stmt.value, names)
        raise mod.error("a branch of get_task_instruction_openqa() assigns no prompt", branch)

    return assigned(branch.body), assigned(branch.orelse), branch


def read_search_o1(clone: Path) -> ImportedPrompts:
    """Search-o1's open-QA prompt (``get_singleqa_search_o1_instruction`` followed by
    ``get_task_instruction_openqa``, QwQ's variant when the loop runs QwQ) for every family, and
    its Reason-in-Documents request (``get_webpage_to_reasonchain_instruction``)."""
    out = ImportedPrompts("sunnynexus/Search-o1", _commit(clone))
    mod = _parse(clone, SEARCH_O1_PROMPTS)
    head = mod.function("get_singleqa_search_o1_instruction")
    instruction = _pieces(mod, _return_value(mod, head), _params(head, ["max_searches"]))
    qwq, other, branch = _o1_task_prompt(mod)
    body = (_source(instruction) + "{% if qwq %}" + _source(qwq) + "{% else %}" + _source(other) + "{% endif %}")
    for family in FAMILIES:
        out.templates[f"search-o1/{family}.j2"] = _template(mod.at(head), out.reference, body)
        out.origins[f"search-o1/{family}.j2"] = f"{mod.at(head)}, {mod.at(branch)}"
    condense = mod.function("get_webpage_to_reasonchain_instruction")
    names = _params(condense, ["previous_steps", "search_query", "documents"])
    out.templates["search-o1/reason_in_documents.j2"] = _template(
        mod.at(condense), out.reference, _source(_pieces(mod, _return_value(mod, condense), names)))
    out.origins["search-o1/reason_in_documents.j2"] = mod.at(condense)
    return out


# ----------------------------------------------------------------------------------------------
# Rerankers: ReasonRank (utils.py), Rank1 (rank1.py), GroupRank (AQ-MedAI/Diver)

REASONRANK_UTILS = "utils.py"
REASONRANK_MARK = "rerank/rank_listwise_os_llm.py"
REASONRANK_MODE = "RANK_GPT_reasoning"
"""The prompt mode ReasonRank's models were trained with (the project's ``format: reasonrank``)."""

RANK1_FILE = "rank1.py"
GROUPRANK_FILE = "Reranker/rerank_groupwise.py"

NUM = ("expr", "passages | length")


def _mode_branch(mod: _Module, func: ast.FunctionDef, attr: str) -> list[ast.stmt]:
    """The body of the first ``if`` of ``func`` whose test names ``<Enum>.<attr>``."""
    for node in ast.walk(func):
        if isinstance(node, ast.If) and any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(node.test)):
            return node.body
    raise mod.error(f"{func.name}() has no branch for {attr}", func)


def _branch_return(mod: _Module, func: ast.FunctionDef, attr: str) -> list[Piece]:
    """The string the ``attr`` branch of ``func`` returns; ReasonRank calls these functions with
    the keywords ``query`` and ``num``."""
    body = _mode_branch(mod, func, attr)
    params = {a.arg for a in func.args.args}
    if not {"query", "num"} <= params:
        raise mod.error(f"{func.name}() takes no query and num", func)
    names = {"query": ("expr", "query"), "num": NUM, **_constants(body)}
    value = next((s.value for s in body if isinstance(s, ast.Return) and s.value is not None), None)
    if value is None:
        raise mod.error(f"the {attr} branch of {func.name}() returns nothing", func)
    return _pieces(mod, value, names)


def read_reasonrank(clone: Path) -> ImportedPrompts:
    """ReasonRank's user message in its reasoning prompt mode: ``add_prefix_prompt``, a newline,
    ``[i] passage`` and a newline per candidate, ``add_post_prompt`` (as its ``create_prompt``
    joins them; the system message stays the project's copy in ``rerank/formats.py``)."""
    out = ImportedPrompts("8421BCD/ReasonRank", _commit(clone))
    mod = _parse(clone, REASONRANK_UTILS)
    prefix = _branch_return(mod, mod.function("add_prefix_prompt"), REASONRANK_MODE)
    post = _branch_return(mod, mod.function("add_post_prompt"), REASONRANK_MODE)
    # rerank/rank_listwise_os_llm.py create_prompt: f"{prefix}\n", f"[{rank}] {content}\n" each, then post.
    body = (_source(prefix) + _literal("\n") + '{% for p in passages %}[{{ loop.index }}] {{ p }}{{ "\\n" }}{% endfor %}'
            + _source(post))
    origin = mod.at(mod.function("add_prefix_prompt"))
    for family in FAMILIES:
        rel = f"rerank-listwise-reasonrank/{family}.j2"
        out.templates[rel] = _template(origin, out.reference, body)
        out.origins[rel] = f"{origin}, {mod.at(mod.function('add_post_prompt'))}"
    return out


def read_rank1(clone: Path) -> ImportedPrompts:
    """Rank1's raw-text prompt: the return value of ``return_prompt(query, doc_content, ...)``."""
    out = ImportedPrompts("orionw/rank1", _commit(clone))
    mod = _parse(clone, RANK1_FILE)
    func = mod.function("return_prompt")
    body = _source(_pieces(mod, _return_value(mod, func), _params(func, ["query", "document"])))
    for family in FAMILIES:
        rel = f"rerank-pointwise-rank1/{family}.j2"
        out.templates[rel] = _template(mod.at(func), out.reference, body)
        out.origins[rel] = mod.at(func)
    return out


def _attribute(mod: _Module, name: str) -> ast.expr:
    """The value of ``self.<name> = ...`` anywhere in the file."""
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == name for t in node.targets):
            return node.value
    raise mod.error(f"no self.{name} = ... (the reference's layout)")


GROUPRANK_PASSAGES = '{% for p in passages %}[{{ loop.index }}]. {{ p }}{{ "\\n\\n" }}{% endfor %}'
"""GroupRank's ``{PASSAGES}``: ``"[i]. text\n\n"`` per document (prepare_groups_one_epoch)."""


def read_grouprank(clone: Path) -> ImportedPrompts:
    """GroupRank's system and user prompts (``group_system_prompt``, ``group_user_prompt`` of its
    reranker), the user one a ``str.format`` template of ``{TOPK}``, ``{QUERY}`` and ``{PASSAGES}``."""
    out = ImportedPrompts("AQ-MedAI/Diver", _commit(clone))
    mod = _parse(clone, GROUPRANK_FILE)
    system_node, user_node = _attribute(mod, "group_system_prompt"), _attribute(mod, "group_user_prompt")
    system = "".join(p[1] for p in _pieces(mod, system_node, {}))
    user = "".join(p[1] for p in _pieces(mod, user_node, {}))
    fields = {"TOPK": NUM[1], "QUERY": "query", "PASSAGES": GROUPRANK_PASSAGES}
    body = ('{% if part == "system" %}' + _literal(system) + "{% else %}"
            + _source(_format_pieces(mod, user_node, user, fields)) + "{% endif %}")
    for family in FAMILIES:
        rel = f"rerank-groupwise/{family}.j2"
        out.templates[rel] = _template(mod.at(system_node), out.reference, body)
        out.origins[rel] = f"{mod.at(system_node)}, {mod.at(user_node)}"
    return out


RANK_R1_PROMPTS = "Rank-R1/prompts/prompt_setwise-R1.toml"
"""Rank-R1's trained prompt file in ielab/llm-rankers (the one its README's runs pass)."""

RANK_R1_DOCS = '{% for p in passages %}{{ "\\n" if not loop.first else "" }}[{{ loop.index }}] {{ p }}{% endfor %}'
"""Rank-R1's ``{docs}``: ``"[i] text"`` per document joined by newlines, as
``RankR1SetwiseLlmRanker.compare`` (llmrankers/setwise.py) joins them."""


def read_rank_r1(clone: Path) -> ImportedPrompts:
    """Rank-R1's system and user prompts: ``prompt_system`` and ``prompt_user`` (a ``str.format``
    template of ``{query}`` and ``{docs}``) of its TOML prompt file, read as data."""
    out = ImportedPrompts("ielab/llm-rankers", _commit(clone))
    path = clone / RANK_R1_PROMPTS
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise ConfigError("reading Rank-R1's TOML prompt file needs Python 3.11 or the tomli package") from None
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read it ({e})", path) from None
    except tomllib.TOMLDecodeError as e:
        raise DataError(f"not valid TOML: {e}", path) from None
    system, user = doc.get("prompt_system"), doc.get("prompt_user")
    if not (isinstance(system, str) and isinstance(user, str)):
        raise DataError("expected text keys prompt_system and prompt_user (the reference's layout)", path)
    mod = _Module(path, RANK_R1_PROMPTS, ast.Module([], type_ignores=[]))
    fields = {"query": "query", "docs": RANK_R1_DOCS}
    body = ('{% if part == "system" %}' + _literal(system) + "{% else %}"
            + _source(_format_pieces(mod, mod.tree, user, fields)) + "{% endif %}")
    for family in FAMILIES:
        rel = f"rerank-setwise/{family}.j2"
        out.templates[rel] = _template(RANK_R1_PROMPTS, out.reference, body)
        out.origins[rel] = f"{RANK_R1_PROMPTS}: prompt_system, prompt_user"
    return out


# ----------------------------------------------------------------------------------------------
# BRIGHT: reason.py

BRIGHT_REPO = "xlang-ai/BRIGHT"
"""BRIGHT's code repository (Su et al., ICLR 2025)."""

BRIGHT_REASON = "reason.py"
BRIGHT_FILES = (BRIGHT_REASON,)
"""The files BRIGHT's prompts come from: its reasoning prompt is built in ``reason.py``'s main loop."""


def _assigned_anywhere(mod: _Module, name: str) -> ast.expr:
    """The value of the first ``name = ...`` anywhere in the file (a script's main loop)."""
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
    raise mod.error(f"no {name} = ... (the reference's layout)")


def _bright_post(mod: _Module) -> str:
    """``cur_post``, the query as BRIGHT's prompt shows it, as a Jinja expression: ``e["query"]``
    with the ``.replace(old, new)`` calls ``reason.py`` applies."""
    node = _assigned_anywhere(mod, "cur_post")
    calls: list[tuple[str, str]] = []
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "replace":
        args = node.args
        if len(args) != 2 or not all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in args):
            raise mod.error("cur_post's .replace() takes other than two literal strings", node)
        calls.append((args[0].value, args[1].value))  # type: ignore[union-attr]
        node = node.func.value
    if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "query"):
        raise mod.error("cur_post is not the example's 'query' field", node)
    expr = "query"
    for old, new in reversed(calls):
        expr += f" | replace({json.dumps(old)}, {json.dumps(new)})"
    return expr


def read_bright(clone: Path) -> ImportedPrompts:
    """BRIGHT's reasoning prompt for ``reason`` (every family): the f-string ``reason.py`` assigns
    to ``prompt`` for each example, of ``cur_post`` (the query with its newlines made spaces)."""
    out = ImportedPrompts(BRIGHT_REPO, _commit(clone))
    mod = _parse(clone, BRIGHT_REASON)
    value = _assigned_anywhere(mod, "prompt")
    body = _source(_pieces(mod, value, {"cur_post": ("expr", _bright_post(mod))}))
    for family in FAMILIES:
        rel = f"reason/{family}.j2"
        out.templates[rel] = _template(mod.at(value), out.reference, body)
        out.origins[rel] = mod.at(value)
    return out


# ----------------------------------------------------------------------------------------------
# Recognising a clone, writing the folder, reading the record

READERS: dict[str, tuple[tuple[str, ...], Callable[[Path], ImportedPrompts]]] = {
    "R2MED": (R2MED_FILES, read_r2med),
    "Search-R1": ((SEARCH_R1_PREFIX,), read_search_r1),
    "Search-o1": ((SEARCH_O1_PROMPTS,), read_search_o1),
    "ReasonRank": ((REASONRANK_MARK,), read_reasonrank),
    "Rank1": ((RANK1_FILE,), read_rank1),
    "GroupRank": ((GROUPRANK_FILE,), read_grouprank),
    "BRIGHT": (BRIGHT_FILES, read_bright),
    "Rank-R1": ((RANK_R1_PROMPTS,), read_rank_r1),
}
"""Reference -> (files that identify its clone, any one of them; its reader)."""


def import_clone(clone: str | Path) -> ImportedPrompts:
    """Recognise the clone's repository by its files and read its prompts (never running them).

    Raises:
        ConfigError: not a folder, or no recognised repository layout.
        DataError: a recognised file that is not in the reference's shape (file and line).
    """
    clone = Path(clone).expanduser()
    if not clone.is_dir():
        raise ConfigError(f"'{clone}' is not a folder (give the root of a clone of a reference repository)")
    for _name, (marks, reader) in READERS.items():
        if any((clone / m).is_file() for m in marks):
            return reader(clone)
    known = "; ".join(f"{n}: {' or '.join(m)}" for n, (m, _) in READERS.items())
    raise ConfigError(f"'{clone}' is not a clone of a known reference (looked for {known})")


def write_prompts(imported: ImportedPrompts, out_dir: str | Path, *, force: bool = False) -> list[Path]:
    """Write the templates under ``out_dir`` and add the import to its :data:`RECORD`.

    Raises:
        ConfigError: a template file exists there and ``force`` is False.
    """
    from r2med_agent.io import atomic_write_text

    out_dir = Path(out_dir)
    existing = [str(out_dir / rel) for rel in imported.templates if (out_dir / rel).exists()]
    if existing and not force:
        raise ConfigError(f"{', '.join(existing[:3])}{' ...' if len(existing) > 3 else ''} already exist; "
                          "pass --force to replace them")
    written = [atomic_write_text(out_dir / rel, text) for rel, text in sorted(imported.templates.items())]
    record = read_record(out_dir)
    entries = [e for e in record if e.get("reference") != imported.reference]
    entries.append({"reference": imported.reference, "commit": imported.commit, "folders": imported.folders,
                    "files": dict(sorted(imported.origins.items()))})
    written.append(atomic_write_text(out_dir / RECORD, json.dumps({"imports": entries}, indent=2) + "\n"))
    return written


def read_record(folder: Path) -> list[dict[str, Any]]:
    """The imports listed in ``folder``'s :data:`RECORD` ([] without one or when unreadable)."""
    try:
        doc = json.loads((folder / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    imports = doc.get("imports") if isinstance(doc, dict) else None
    return [e for e in imports if isinstance(e, dict)] if isinstance(imports, list) else []


def imported_prompts(folders: Iterable[str], prompts_dir: Any = None) -> list[dict[str, Any]]:
    """The imports behind the prompt folders a run renders (``hyde``, ``rerank-groupwise`` ...):
    ``{reference, commit, folders}`` of each import in the overriding folder (``prompts_dir``,
    else ``$R2MED_PROMPTS_DIR``) that wrote one of them; [] when the prompts are the project's."""
    from r2med_agent.prompt_templates import search_path

    paths = search_path(prompts_dir)
    if len(paths) < 2:
        return []
    wanted = set(folders)
    out = []
    for entry in read_record(paths[0]):
        used = sorted(wanted & set(entry.get("folders", [])))
        if used:
            out.append({"reference": entry.get("reference"), "commit": entry.get("commit"), "folders": used})
    return out


def run_prompt_folders(method: str, generations: str, reranker: str) -> list[str]:
    """The prompt folders a run renders: its method's when it generates fresh, its reranker's
    (the prompt folder its kind declares: ``rerank-listwise-reasonrank`` ...); an unknown reranker
    adds none."""
    folders = [method] if generations == "fresh" and _generates(method) else []
    if reranker:
        from r2med_agent.retrieval.rerank.spec import get_reranker_spec

        try:
            folder = get_reranker_spec(reranker).prompt_folder
        except ConfigError:
            return folders
        if folder is not None:
            folders.append(folder)
    return folders


def _generates(method: str) -> bool:
    """Whether ``method`` renders prompts: a registered method that declares ``uses_llm``; its
    registry name is its prompt folder (an unknown name renders none)."""
    from r2med_agent.methods import METHODS

    return bool(getattr(METHODS.get(method), "uses_llm", False))


def describe(folders: Sequence[str], prompts_dir: Any = None) -> str:
    """One phrase for ``reproduce --dry-run``: whose prompts a run rendering ``folders`` uses:
    the reference's (imported), the user's own files, or the project's own."""
    from r2med_agent.prompt_templates import search_path

    imports = imported_prompts(folders, prompts_dir)
    if imports:
        refs = ", ".join(f"{e['reference']}" + (f"@{str(e['commit'])[:12]}" if e.get("commit") else "")
                         for e in imports)
        return f"the reference's, imported from {refs}"
    paths = search_path(prompts_dir)
    if len(paths) > 1 and any((paths[0] / f).is_dir() for f in folders):
        return f"your own files in {paths[0]} (${ENV_VAR}) over the project's own"
    return "the project's own"
