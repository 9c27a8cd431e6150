"""Find, render and hash the prompt templates: the Jinja environment over the prompts folder.

The templates live in the repository's top-level ``prompts/`` folder (a wheel carries it as
``r2med_agent/_data/prompts``; ``r2med_agent.paths.prompts_dir()`` finds it in a checkout, an
editable install and a wheel alike): one sub-folder per method (``hyde/``, ``query2doc/``,
``lamer/``, ...) with one template per task family (``qa.j2``, ``exam.j2``, ``treatment.j2``,
``case.j2``); files whose name starts with ``_`` are shared pieces that the family templates
include. Query2Doc's worked examples live in ``query2doc/examples/<family>.yaml``.

Overriding prompts: point ``R2MED_PROMPTS_DIR`` (or the ``prompts_dir`` argument of the functions
below) at a folder with the same layout. A file there replaces the package's file of the same
relative name; every file it does not have comes from the package. Templates render with
``StrictUndefined``, so a template that uses a variable the caller did not pass is an error, not
an empty string.

Templates come from users' folders and clones of other repositories, so they render in Jinja's
sandbox (``ImmutableSandboxedEnvironment``): a template can use its variables, filters and tests,
but not Python's internals (``cycler.__init__.__globals__`` reached ``os``) nor change the values
it is given. A template that names such an attribute is refused with its file and line when it
is first loaded, and a run checks every template of its prompt folder before any work
(:func:`check_folder`); one that reaches one by a computed name fails when rendered, also with
its file and line.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from r2med_agent.errors import ConfigError, R2MedError

__all__ = [
    "ENV_VAR",
    "EXACT_MARK",
    "check_folder",
    "environment",
    "load_examples",
    "render",
    "renders_exactly",
    "resolve_file",
    "search_path",
    "template_hash",
]

ENV_VAR = "R2MED_PROMPTS_DIR"
"""Environment variable naming a folder whose files override the package's prompts."""

EXACT_MARK = "{# r2med-agent: rendered exactly (trailing whitespace kept) from"
"""How a template's first line starts when its text is kept exactly as rendered, trailing
whitespace included (``r2med-agent prompts import`` writes such templates: a reference's prompt
may end with a space); other templates have the trailing whitespace of their text dropped."""

FALLBACK_KEYS = ("default", "medical sciences")
"""Keys of a per-task or per-domain examples file used, in this order, for a task it does not
list by name or domain (a task of your own is a Q&A task of domain ``medical``): the file's own
``default`` list, else its medical-sciences list (the package's ``qa.yaml`` has no ``default``)."""

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


def _package_dir() -> Path:
    from r2med_agent.paths import prompts_dir

    return prompts_dir()


def search_path(prompts_dir: PathLike | None = None) -> list[Path]:
    """Folders searched for a prompt file, first match wins.

    Args:
        prompts_dir: a user folder of prompts; when None, ``$R2MED_PROMPTS_DIR`` if set.

    Returns:
        ``[user folder, package folder]``, or just the package folder when there is no override.

    Raises:
        ConfigError: the override folder does not exist.
    """
    override: Path | None = None
    source = "prompts_dir"
    if prompts_dir is not None:
        override = Path(prompts_dir)
    elif os.environ.get(ENV_VAR):
        override = Path(os.environ[ENV_VAR])
        source = f"${ENV_VAR}"
    package = _package_dir()
    if override is None:
        return [package]
    override = override.expanduser()
    if not override.is_dir():
        raise ConfigError(f"{source}: prompt folder '{override}' does not exist or is not a folder")
    if override.resolve() == package.resolve():
        return [package]
    return [override, package]


@lru_cache(maxsize=16)
def _environment(paths: tuple[str, ...]) -> jinja2.Environment:
    from r2med_agent.prompts.sandbox import BoundedSandbox

    return BoundedSandbox(
        loader=jinja2.FileSystemLoader(list(paths), encoding="utf-8"),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        auto_reload=True,
    )


def environment(prompts_dir: PathLike | None = None) -> jinja2.Environment:
    """The Jinja environment over :func:`search_path` (cached per search path).

    Jinja's immutable sandbox with resource limits (:mod:`r2med_agent.prompts.sandbox`; it refuses a
    jinja2 older than 3.1.6), ``StrictUndefined``, no autoescaping, trailing newlines kept,
    ``trim_blocks`` on. Templates are re-read when their file changes on disk.
    """
    return _environment(tuple(str(p) for p in search_path(prompts_dir)))


def resolve_file(relpath: str, prompts_dir: PathLike | None = None) -> Path | None:
    """The file that ``relpath`` (e.g. ``"query2doc/examples/qa.yaml"``) resolves to, or None."""
    for root in search_path(prompts_dir):
        candidate = root / relpath
        if candidate.is_file():
            return candidate
    return None


def _not_found(name: str, prompts_dir: PathLike | None) -> ConfigError:
    roots = search_path(prompts_dir)
    method = name.split("/", 1)[0]
    available = sorted(
        {
            f"{method}/{p.name}"
            for root in roots
            if (root / method).is_dir()
            for p in (root / method).glob("*.j2")
            if not p.name.startswith("_")
        }
    )
    hint = f"; available: {', '.join(available)}" if available else ""
    where = ", ".join(str(r) for r in roots)
    return ConfigError(f"no prompt template '{name}' in {where}{hint}")


_INTERNALS = frozenset({"mro", "gi_frame", "gi_code", "cr_frame", "cr_code", "ag_code", "ag_frame",
                        "tb_frame", "tb_next", "f_globals", "f_locals", "f_builtins", "f_code"})
"""Attribute names the sandbox refuses besides those starting with ``_``."""

def _check_safe(ast: jinja2.nodes.Template, filename: str) -> None:
    """Refuse a template that names an attribute the sandbox refuses (``x.__class__``,
    ``x["__init__"]``, ``x|attr("__globals__")``), with its file and line."""
    for node in ast.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem, jinja2.nodes.Filter)):
        if isinstance(node, jinja2.nodes.Getattr):
            name: Any = node.attr
        elif isinstance(node, jinja2.nodes.Getitem):
            name = node.arg.value if isinstance(node.arg, jinja2.nodes.Const) else None
        else:
            arg = node.args[0] if node.name == "attr" and node.args else None
            name = arg.value if isinstance(arg, jinja2.nodes.Const) else None
        if isinstance(name, str) and (name.startswith("_") or name in _INTERNALS):
            raise ConfigError(
                f"{filename}:{node.lineno}: unsafe template: it reads {name!r}, which templates may "
                "not (they render in a sandbox: their variables, filters and tests, no Python "
                "internals); remove it"
            )


def _checked_source(env: jinja2.Environment, name: str, source: str, filename: str | None) -> jinja2.nodes.Template:
    """``source`` parsed and checked by :func:`_check_safe` (syntax errors with file and line)."""
    try:
        ast = env.parse(source, name, filename)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"{e.filename or name}:{e.lineno}: template syntax error: {e.message}") from None
    _check_safe(ast, filename or name)
    return ast


def check_folder(folder: PathLike) -> None:
    """Check every template (``*.j2``) of a prompt folder with :func:`_check_safe` (a run does
    so before any work). Syntax errors are left to the template's first use.

    Raises:
        ConfigError: a template names an attribute the sandbox refuses (file and line), or the
            jinja2 imported is older than the sandbox needs.
    """
    from r2med_agent.prompts.sandbox import check_jinja2

    check_jinja2()
    env = jinja2.sandbox.ImmutableSandboxedEnvironment()
    for path in sorted(Path(folder).rglob("*.j2")):
        try:
            source = path.read_text(encoding="utf-8")
            ast = env.parse(source, path.name, str(path))
        except (OSError, UnicodeDecodeError, jinja2.TemplateSyntaxError):
            continue
        _check_safe(ast, str(path))


def _literal_references(ast: jinja2.nodes.Template) -> list[tuple[str, int]]:
    """``(name, line)`` of each template that ``ast`` includes, imports or extends by a literal name."""
    out = []
    for node in ast.find_all((jinja2.nodes.Include, jinja2.nodes.Import, jinja2.nodes.FromImport,
                              jinja2.nodes.Extends)):
        value = node.template.value if isinstance(node.template, jinja2.nodes.Const) else None
        for name in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(name, str):
                out.append((name, node.lineno))
    return out


def _check_no_loop(env: jinja2.Environment, name: str) -> None:
    """Refuse a template that reaches itself through what it includes, imports or extends
    (rendering it would never end), with the file and line of the reference that closes the loop."""
    loader = env.loader
    done: set[str] = set()

    def visit(current: str, path: list[str]) -> None:
        try:
            source, filename, _ = loader.get_source(env, current)  # type: ignore[union-attr]
        except jinja2.TemplateNotFound:
            return  # reported where it is used
        for ref, line in _literal_references(_checked_source(env, current, source, filename)):
            chain = [*path, current]
            if ref in chain:
                loop = " -> ".join([*chain[chain.index(ref):], ref])
                raise ConfigError(f"{filename or current}:{line}: template includes itself ({loop}): "
                                  "its rendering would never end; remove that include")
            if ref not in done:
                visit(ref, chain)
        done.add(current)

    visit(name, [])


def _get_template(name: str, prompts_dir: PathLike | None) -> jinja2.Template:
    env = environment(prompts_dir)
    try:
        template = env.get_template(name)
        if not getattr(template, "_r2med_checked", False):  # once per loaded (or reloaded) file
            source, filename, _ = env.loader.get_source(env, name)  # type: ignore[union-attr]
            _checked_source(env, name, source, filename)
            _check_no_loop(env, name)
            template._r2med_checked = True  # type: ignore[attr-defined]
        return template
    except jinja2.TemplateNotFound as e:
        # A missing include names the include, not the outer template.
        raise _not_found(e.name or name, prompts_dir) from None
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"{e.filename or name}:{e.lineno}: template syntax error: {e.message}") from None


def render(template_path: str, /, *, prompts_dir: PathLike | None = None, **variables: Any) -> str:
    """Render one prompt template.

    Args:
        template_path: path relative to the prompts folder, e.g. ``"hyde/qa.j2"``.
        prompts_dir: override folder (see :func:`search_path`).
        **variables: the template's variables; every variable the template uses must be given.

    Returns:
        The rendered text, exactly as the template lays it out.

    Raises:
        ConfigError: unknown template, syntax error, a variable the template needs is missing, or
            the template went past a limit on time, size or depth (file and line).
    """
    from r2med_agent.prompts.sandbox import TemplateLimit, render_bounded

    template = _get_template(template_path, prompts_dir)
    try:
        return render_bounded(template, variables)
    except jinja2.sandbox.SecurityError as e:
        raise ConfigError(f"{_template_line(e, template)}: unsafe template: {e}") from None
    except (TemplateLimit, OverflowError, MemoryError) as e:
        raise ConfigError(f"{_template_line(e, template)}: template stopped: {e}") from None
    except RecursionError:
        raise ConfigError(f"{template.filename or template_path}: template stopped: it includes, imports "
                          "or calls itself without end") from None
    except jinja2.UndefinedError as e:
        given = ", ".join(sorted(variables)) or "none"
        raise ConfigError(
            f"{template.filename or template_path}: {e.message}; variables given: {given}"
        ) from None
    except jinja2.TemplateNotFound as e:
        raise _not_found(e.name or template_path, prompts_dir) from None
    except R2MedError:
        raise
    except Exception as e:  # noqa: BLE001 - a template's own error (1/0, int('x')): its line, no traceback
        raise ConfigError(f"{_template_line(e, template)}: template failed: {type(e).__name__}: {e}") from None


def _template_line(exc: BaseException, template: jinja2.Template) -> str:
    """``file:line`` of the template line that raised ``exc`` (Jinja's traceback holds template
    frames), else the template's file."""
    where = template.filename or template.name or "template"
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if filename.endswith(".j2"):
            where = f"{filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def renders_exactly(template_path: str, /, *, prompts_dir: PathLike | None = None) -> bool:
    """Whether the template ``template_path`` resolves to starts with :data:`EXACT_MARK` (its
    rendered text is used as it is, trailing whitespace included).

    Raises:
        ConfigError: no such template.
    """
    env = environment(prompts_dir)
    try:
        source, _, _ = env.loader.get_source(env, template_path)  # type: ignore[union-attr]
    except jinja2.TemplateNotFound:
        raise _not_found(template_path, prompts_dir) from None
    return source.startswith(EXACT_MARK)


def _referenced(env: jinja2.Environment, name: str, source: str, filename: str | None) -> list[str]:
    ast = _checked_source(env, name, source, filename)
    refs = list(jinja2.meta.find_referenced_templates(ast))
    if any(r is None for r in refs):
        raise ConfigError(
            f"{filename or name}: includes a template whose name is computed at render time; "
            "use a literal name so that template_hash can follow it"
        )
    return [r for r in refs if r is not None]


def template_hash(method: str, family: str, *, prompts_dir: PathLike | None = None) -> str:
    """SHA-256 of everything that shapes a method's prompt for one task family.

    Covers ``<method>/<family>.j2``, every template it includes, imports or extends (recursively),
    and the data file ``<method>/examples/<family>.yaml`` when there is one, each as resolved
    through the override folder. Editing any of them changes the hash. The hash depends on file
    contents and relative names only, not on where the folder is.

    Raises:
        ConfigError: the template does not exist, or includes a template by a computed name.
    """
    env = environment(prompts_dir)
    loader = env.loader
    if loader is None:  # pragma: no cover - environment() always sets one
        raise ConfigError("prompt environment has no loader")
    h = hashlib.sha256()
    seen: set[str] = set()
    pending = [f"{method}/{family}.j2"]
    while pending:
        name = pending.pop(0)
        if name in seen:
            continue
        seen.add(name)
        try:
            source, filename, _ = loader.get_source(env, name)
        except jinja2.TemplateNotFound:
            raise _not_found(name, prompts_dir) from None
        h.update(f"template\0{name}\0{len(source)}\0".encode())
        h.update(source.encode("utf-8"))
        pending.extend(sorted(_referenced(env, name, source, filename)))
    data_name = f"{method}/examples/{family}.yaml"
    data_file = resolve_file(data_name, prompts_dir)
    if data_file is not None:
        data = data_file.read_bytes()
        h.update(f"data\0{data_name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def load_examples(
    method: str, family: str, domain: str, *, prompts_dir: PathLike | None = None, task: str | None = None
) -> list[dict[str, str]]:
    """Worked examples for a method and task family from ``<method>/examples/<family>.yaml``.

    The file holds either a list of ``{query, passage}`` mappings (the same examples for every
    task of the family) or a mapping whose keys are task names (``task``: examples of one task,
    as ``r2med-agent prompts import-examples`` writes them) or domains (Q&A tasks: one list per
    domain); a task's own list comes first, then its domain's, then the first of
    :data:`FALLBACK_KEYS` the file has (logged: a task the registry does not know still gets
    worked examples).

    Returns:
        The examples, each ``{"query": ..., "passage": ...}``.

    Raises:
        ConfigError: missing or malformed file, unknown domain, or an entry with other keys.
    """
    relpath = f"{method}/examples/{family}.yaml"
    path = resolve_file(relpath, prompts_dir)
    if path is None:
        where = ", ".join(str(r) for r in search_path(prompts_dir))
        raise ConfigError(f"no examples file '{relpath}' in {where}")
    from r2med_agent.config import read_yaml

    doc = read_yaml(path)
    if isinstance(doc, Mapping):
        key = _examples_key(doc, path, domain, task)
        entries, where = doc[key], f"{path}: {key}"
    else:
        entries, where = doc, str(path)
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: expected a non-empty list of {{query, passage}} examples")
    return _checked_examples(entries, where)


def _examples_key(doc: Mapping[str, Any], path: Path, domain: str, task: str | None) -> str:
    """The key of ``doc`` whose examples a task uses: its name, its domain, else a fallback."""
    if task is not None and task in doc:
        return task
    if domain in doc:
        return domain
    for key in FALLBACK_KEYS:
        if key in doc:
            log.info(
                "%s: no examples for %sdomain '%s'; using the '%s' examples (give the task its own: "
                "a list under its name in <folder>/%s, with %s=<folder>)",
                path, f"task {task!r} or " if task else "", domain, key, "/".join(path.parts[-3:]), ENV_VAR,
            )
            return key
    raise ConfigError(
        f"{path}: no examples for domain '{domain}'{f' or task {task!r}' if task else ''}; "
        f"keys: {', '.join(map(str, doc))} "
        f"(add a '{task or domain}' list in a prompts folder of your own, see ${ENV_VAR})"
    )


def _checked_examples(entries: Any, where: str) -> list[dict[str, str]]:
    """``entries`` as ``[{query, passage}, ...]``, each checked."""
    out: list[dict[str, str]] = []
    for i, entry in enumerate(entries, 1):
        if not isinstance(entry, Mapping) or set(entry) != {"query", "passage"}:
            keys = ", ".join(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
            raise ConfigError(f"{where}: example {i} must have exactly the keys query, passage (got {keys})")
        query, passage = entry["query"], entry["passage"]
        if not all(isinstance(v, str) and v.strip() for v in (query, passage)):
            raise ConfigError(f"{where}: example {i}: query and passage must be non-empty text")
        out.append({"query": query.strip(), "passage": passage.strip()})
    return out
