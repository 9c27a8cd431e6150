"""The readers of ``prompts import``: one per reference repository, each turning the prompts
its code builds into the project's template files (see :mod:`~r2med_agent.prompts.importer`), read
statically through :mod:`~r2med_agent.prompts.static_python`."""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from r2med_agent.errors import ConfigError, DataError
from r2med_agent.prompts.static_python import CloneFile, Piece, clone_commit, exact_template, format_pieces, jinja_literal, jinja_source, param_exprs, parse_file, returned_value, str_constants, string_pieces

FAMILIES = ("qa", "exam", "treatment", "case")


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
# R2MED: src/instrcution.py (+ src/example.py)

R2MED_FILES = ("src/instrcution.py", "src/instruction.py")
"""R2MED keeps its generation prompts in src/instrcution.py (the file's own spelling)."""

R2MED_METHODS = ("hyde", "query2doc", "lamer")

LAMER_PASSAGES = '{% for document in documents %}{{ "\\n" }}[{{ loop.index }}]. {{ document }}{% endfor %}'
"""R2MED's ``{PASSAGE}``: ``"\\n[i]. text"`` per first-pass document (generate_hypothetical_doc.py
read_data), each already one line cut to 512 words as the project's LameR cuts it."""


def _r2med_names(mod: CloneFile, clone: Path) -> dict[str, dict[str, str]]:
    """Module-level dicts of text imported with ``from X import Y`` (R2MED's ``Example``)."""
    out: dict[str, dict[str, str]] = {}
    for node in mod.tree.body:
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        rel = str(Path(mod.rel).parent / (node.module.replace(".", "/") + ".py"))
        if not (clone / rel).is_file():
            continue
        other = parse_file(clone, rel)
        for alias in node.names:
            try:
                value = ast.literal_eval(other.assigned(alias.name))
            except (DataError, ValueError):
                continue
            if isinstance(value, dict):
                out[alias.asname or alias.name] = value
    return out


def _r2med_text(mod: CloneFile, node: ast.expr, imported: dict[str, dict[str, str]]) -> str:
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
    pieces = format_pieces(mod, node, call.func.value.value, {k: k for k in values})
    return "".join(p[1] if p[0] == "text" else values[p[1]] for p in pieces)


def read_r2med(clone: Path) -> ImportedPrompts:
    """HyDE, Query2Doc and LameR per task, from R2MED's ``src/instrcution.py``: its ``hyde``,
    ``query2doc`` and ``lamer`` dicts from task key to a ``str.format`` template of ``{TEXT}``
    (and ``{PASSAGE}``); Query2Doc's worked examples come in from ``src/example.py``."""
    from r2med_agent.data import REFERENCE_NAMES, get_task_spec

    rel = next(r for r in R2MED_FILES if (clone / r).is_file())
    mod = parse_file(clone, rel)
    imported = _r2med_names(mod, clone)
    out = ImportedPrompts("R2MED/R2MED", clone_commit(clone))
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
                body += jinja_source(format_pieces(mod, node, text, fields))
            # A task the reference has no prompt for stops with this name in the error.
            body += "{% else %}{{ the_reference_has_no_prompt_for_this_task }}{% endif %}"
            relpath = f"{method}/{family}.j2"
            out.templates[relpath] = exact_template(mod.at(entries[0][2]), out.reference, body)
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
    out = ImportedPrompts("PeterGriffinJin/Search-R1", clone_commit(clone))
    mod = parse_file(clone, SEARCH_R1_PREFIX)
    func = mod.function("make_prefix")
    value = next((n.value for n in ast.walk(func) if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "prefix" for t in n.targets)), None)
    if value is None:
        raise mod.error("make_prefix() assigns no prefix", func)
    body = jinja_source(string_pieces(mod, value, {"question": ("expr", "query")}))
    for family in FAMILIES:
        out.templates[f"search-r1/{family}.j2"] = exact_template(mod.at(value), out.reference, body)
        out.origins[f"search-r1/{family}.j2"] = mod.at(value)
    loop = parse_file(clone, SEARCH_R1_LOOP)
    texts = []
    for node in ast.walk(loop.function("execute_predictions")):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
                and len(node.args) == 1 and (isinstance(node.args[0], ast.JoinedStr) or (
                    isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)))):
            pieces = string_pieces(loop, node.args[0], {}) if _fixed(node.args[0]) else []
            text = "".join(p[1] for p in pieces)
            if text.strip():
                texts.append((text, node))
    if len(texts) != 1:
        raise loop.error(f"expected one fixed corrective message in execute_predictions(), found {len(texts)}")
    text, node = texts[0]
    if text != "\n" + text.strip() + "\n":
        raise loop.error("the corrective message must sit between single newlines (the loop adds them)", node)
    out.templates["search-r1/invalid.j2"] = exact_template(loop.at(node), out.reference, jinja_literal(text.strip()))
    out.origins["search-r1/invalid.j2"] = loop.at(node)
    return out


def _fixed(node: ast.expr) -> bool:
    """Whether a string expression has no fields (the loop's other messages carry results)."""
    return not any(isinstance(n, ast.FormattedValue) for n in ast.walk(node))


# ----------------------------------------------------------------------------------------------
# Search-o1: scripts/prompts.py

SEARCH_O1_PROMPTS = "scripts/prompts.py"
SEARCH_O1_INSTRUCTION = "get_multiqa_search_o1_instruction"
"""The instruction of Search-o1's multi-hop QA setting: ``run_search_o1.py`` gives it to hotpotqa,
2wiki, musique and bamboogle with 10 searches and 15 turns, the pair the loop runs (its single-QA
instruction goes with 5 searches, to nq and triviaqa; docs/protocol.md, "Search-o1")."""


def _o1_task_prompt(mod: CloneFile) -> tuple[list[Piece], list[Piece], ast.AST]:
    """``get_task_instruction_openqa``: (QwQ's prompt, the others'), from its ``if model_name ==
    'qwq'`` branches."""
    func = mod.function("get_task_instruction_openqa")
    names = param_exprs(func, ["query"])
    branch = next((n for n in ast.walk(func) if isinstance(n, ast.If)), None)
    if branch is None:
        raise mod.error("get_task_instruction_openqa() has no QwQ branch", func)

    def assigned(body: list[ast.stmt]) -> list[Piece]:
        for stmt in body:
            if isinstance(stmt, ast.Assign):
                return string_pieces(mod, stmt.value, names)
        raise mod.error("a branch of get_task_instruction_openqa() assigns no prompt", branch)

    return assigned(branch.body), assigned(branch.orelse), branch


def read_search_o1(clone: Path) -> ImportedPrompts:
    """Search-o1's multi-hop QA prompt (:data:`SEARCH_O1_INSTRUCTION` followed by
    ``get_task_instruction_openqa``, QwQ's variant when the loop runs QwQ) for every family, and
    its Reason-in-Documents request (``get_webpage_to_reasonchain_instruction``)."""
    out = ImportedPrompts("sunnynexus/Search-o1", clone_commit(clone))
    mod = parse_file(clone, SEARCH_O1_PROMPTS)
    head = mod.function(SEARCH_O1_INSTRUCTION)
    instruction = string_pieces(mod, returned_value(mod, head), param_exprs(head, ["max_searches"]))
    qwq, other, branch = _o1_task_prompt(mod)
    body = (jinja_source(instruction) + "{% if qwq %}" + jinja_source(qwq) + "{% else %}" + jinja_source(other) + "{% endif %}")
    for family in FAMILIES:
        out.templates[f"search-o1/{family}.j2"] = exact_template(mod.at(head), out.reference, body)
        out.origins[f"search-o1/{family}.j2"] = f"{mod.at(head)}, {mod.at(branch)}"
    condense = mod.function("get_webpage_to_reasonchain_instruction")
    names = param_exprs(condense, ["previous_steps", "search_query", "documents"])
    out.templates["search-o1/reason_in_documents.j2"] = exact_template(
        mod.at(condense), out.reference, jinja_source(string_pieces(mod, returned_value(mod, condense), names)))
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


def _mode_branch(mod: CloneFile, func: ast.FunctionDef, attr: str) -> list[ast.stmt]:
    """The body of the first ``if`` of ``func`` whose test names ``<Enum>.<attr>``."""
    for node in ast.walk(func):
        if isinstance(node, ast.If) and any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(node.test)):
            return node.body
    raise mod.error(f"{func.name}() has no branch for {attr}", func)


def _branch_return(mod: CloneFile, func: ast.FunctionDef, attr: str) -> list[Piece]:
    """The string the ``attr`` branch of ``func`` returns; ReasonRank calls these functions with
    the keywords ``query`` and ``num``."""
    body = _mode_branch(mod, func, attr)
    params = {a.arg for a in func.args.args}
    if not {"query", "num"} <= params:
        raise mod.error(f"{func.name}() takes no query and num", func)
    names = {"query": ("expr", "query"), "num": NUM, **str_constants(body)}
    value = next((s.value for s in body if isinstance(s, ast.Return) and s.value is not None), None)
    if value is None:
        raise mod.error(f"the {attr} branch of {func.name}() returns nothing", func)
    return string_pieces(mod, value, names)


def read_reasonrank(clone: Path) -> ImportedPrompts:
    """ReasonRank's user message in its reasoning prompt mode: ``add_prefix_prompt``, a newline,
    ``[i] passage`` and a newline per candidate, ``add_post_prompt`` (as its ``create_prompt``
    joins them; the system message stays the project's copy in ``rerank/formats.py``)."""
    out = ImportedPrompts("8421BCD/ReasonRank", clone_commit(clone))
    mod = parse_file(clone, REASONRANK_UTILS)
    prefix = _branch_return(mod, mod.function("add_prefix_prompt"), REASONRANK_MODE)
    post = _branch_return(mod, mod.function("add_post_prompt"), REASONRANK_MODE)
    # rerank/rank_listwise_os_llm.py create_prompt: f"{prefix}\n", f"[{rank}] {content}\n" each, then post.
    body = (jinja_source(prefix) + jinja_literal("\n") + '{% for p in passages %}[{{ loop.index }}] {{ p }}{{ "\\n" }}{% endfor %}'
            + jinja_source(post))
    origin = mod.at(mod.function("add_prefix_prompt"))
    for family in FAMILIES:
        rel = f"rerank-listwise-reasonrank/{family}.j2"
        out.templates[rel] = exact_template(origin, out.reference, body)
        out.origins[rel] = f"{origin}, {mod.at(mod.function('add_post_prompt'))}"
    return out


def read_rank1(clone: Path) -> ImportedPrompts:
    """Rank1's raw-text prompt: the return value of ``return_prompt(query, doc_content, ...)``."""
    out = ImportedPrompts("orionw/rank1", clone_commit(clone))
    mod = parse_file(clone, RANK1_FILE)
    func = mod.function("return_prompt")
    body = jinja_source(string_pieces(mod, returned_value(mod, func), param_exprs(func, ["query", "document"])))
    for family in FAMILIES:
        rel = f"rerank-pointwise-rank1/{family}.j2"
        out.templates[rel] = exact_template(mod.at(func), out.reference, body)
        out.origins[rel] = mod.at(func)
    return out


def _attribute(mod: CloneFile, name: str) -> ast.expr:
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
    out = ImportedPrompts("AQ-MedAI/Diver", clone_commit(clone))
    mod = parse_file(clone, GROUPRANK_FILE)
    system_node, user_node = _attribute(mod, "group_system_prompt"), _attribute(mod, "group_user_prompt")
    system = "".join(p[1] for p in string_pieces(mod, system_node, {}))
    user = "".join(p[1] for p in string_pieces(mod, user_node, {}))
    fields = {"TOPK": NUM[1], "QUERY": "query", "PASSAGES": GROUPRANK_PASSAGES}
    body = ('{% if part == "system" %}' + jinja_literal(system) + "{% else %}"
            + jinja_source(format_pieces(mod, user_node, user, fields)) + "{% endif %}")
    for family in FAMILIES:
        rel = f"rerank-groupwise/{family}.j2"
        out.templates[rel] = exact_template(mod.at(system_node), out.reference, body)
        out.origins[rel] = f"{mod.at(system_node)}, {mod.at(user_node)}"
    return out


RANK_R1_PROMPTS = "Rank-R1/prompts/prompt_setwise-R1.toml"
"""Rank-R1's trained prompt file in ielab/llm-rankers (the one its README's runs pass)."""

RANK_R1_DOC_KEYS = ("doc_prefix", "doc_separator")
"""The keys of Rank-R1's TOML file that lay out ``{docs}``: ``R1SetwiseLlmRanker.compare``
(Rank-R1/run_setwise.py) writes ``doc_prefix.format(num=i + 1) + text`` per document and joins
them with ``doc_separator``."""


def _rank_r1_docs(mod: CloneFile, prefix: str, separator: str) -> str:
    """``{docs}`` as ``R1SetwiseLlmRanker.compare`` fills it from the file's ``doc_prefix`` (a
    ``str.format`` template of ``{num}``, the 1-based position) and ``doc_separator``, as Jinja."""
    head = jinja_source(format_pieces(mod, mod.tree, prefix, {"num": "loop.index"}))
    return ("{% for p in passages %}{% if not loop.first %}" + jinja_literal(separator) + "{% endif %}"
            + head + "{{ p }}{% endfor %}")


def read_rank_r1(clone: Path) -> ImportedPrompts:
    """Rank-R1's system and user prompts: ``prompt_system`` and ``prompt_user`` (a ``str.format``
    template of ``{query}`` and ``{docs}``) of its TOML prompt file, read as data, with ``{docs}``
    laid out by the file's own ``doc_prefix`` and ``doc_separator`` (:func:`_rank_r1_docs`)."""
    out = ImportedPrompts("ielab/llm-rankers", clone_commit(clone))
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
    keys = ("prompt_system", "prompt_user", *RANK_R1_DOC_KEYS)
    if not all(isinstance(doc.get(k), str) for k in keys):
        raise DataError(f"expected text keys {', '.join(keys)} (the reference's layout)", path)
    system, user, prefix, separator = (doc[k] for k in keys)
    mod = CloneFile(path, RANK_R1_PROMPTS, ast.Module([], type_ignores=[]))
    fields = {"query": "query", "docs": _rank_r1_docs(mod, prefix, separator)}
    body = ('{% if part == "system" %}' + jinja_literal(system) + "{% else %}"
            + jinja_source(format_pieces(mod, mod.tree, user, fields)) + "{% endif %}")
    for family in FAMILIES:
        rel = f"rerank-setwise/{family}.j2"
        out.templates[rel] = exact_template(RANK_R1_PROMPTS, out.reference, body)
        out.origins[rel] = f"{RANK_R1_PROMPTS}: {', '.join(keys)}"
    return out


# ----------------------------------------------------------------------------------------------
# BRIGHT: reason.py

BRIGHT_REPO = "xlang-ai/BRIGHT"
"""BRIGHT's code repository (Su et al., ICLR 2025)."""

BRIGHT_REASON = "reason.py"
BRIGHT_FILES = (BRIGHT_REASON,)
"""The files BRIGHT's prompts come from: its reasoning prompt is built in ``reason.py``'s main loop."""


def _assigned_anywhere(mod: CloneFile, name: str) -> ast.expr:
    """The value of the first ``name = ...`` anywhere in the file (a script's main loop)."""
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
    raise mod.error(f"no {name} = ... (the reference's layout)")


def _bright_post(mod: CloneFile) -> str:
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
    out = ImportedPrompts(BRIGHT_REPO, clone_commit(clone))
    mod = parse_file(clone, BRIGHT_REASON)
    value = _assigned_anywhere(mod, "prompt")
    body = jinja_source(string_pieces(mod, value, {"cur_post": ("expr", _bright_post(mod))}))
    for family in FAMILIES:
        rel = f"reason/{family}.j2"
        out.templates[rel] = exact_template(mod.at(value), out.reference, body)
        out.origins[rel] = mod.at(value)
    return out


# ----------------------------------------------------------------------------------------------
# Recognising a clone

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
