"""The rules docs/architecture.md states, checked on the package's own source: no import cycle
anywhere, no function over 80 lines, no public function with more than 8 parameters outside
the typer commands, no method name spelt in the runner or the analysis code, no class over 400
lines, no module over 600 lines outside tests/, and the public API module (``api``) read by
users and the CLI only."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "r2med_agent"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every package module ``name`` imports, at the top or inside a function."""

    def owner(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            targets = [t for t in subs if t in modules] + ([node.module] if any(t not in modules for t in subs) else [])
        for t in targets:
            found = owner(t) if t.startswith("r2med_agent") else None
            if found and found != name:
                out.add(found)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_anywhere() -> None:
    """Every import of every module (top level or inside a function) is an edge; no module reaches
    itself. The CLI's command modules import ``app`` from cli/common.py, and cli/app.py imports
    them, so the CLI has no circle either."""
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_circle() -> None:
    """The check itself: a circle of three modules is found, a chain is not."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _functions():
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(PACKAGE.parent), node


def test_no_function_over_80_lines() -> None:
    long = [f"{p}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p, n in _functions() if n.end_lineno - n.lineno + 1 > 80]
    assert long == []


def test_no_public_function_over_8_parameters_outside_the_typer_commands() -> None:
    many = []
    for path, node in _functions():
        a = node.args
        count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
        if a.args and a.args[0].arg in ("self", "cls"):
            count -= 1
        typer_command = path.parts[1] == "cli" and any(
            isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "command" for d in node.decorator_list)
        if count > 8 and not node.name.startswith("_") and not typer_command:
            many.append(f"{path}:{node.lineno} {node.name} ({count})")
    assert many == []


def test_no_method_name_in_the_runner_or_the_analysis() -> None:
    from r2med_agent.methods import METHODS

    spelt = []
    for folder in ("experiment", "analysis", "grids"):
        for path in (PACKAGE / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and node.value in set(METHODS) - {"none"}:
                    spelt.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.value!r}")
    assert spelt == []


def test_no_class_over_400_lines() -> None:
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []


def test_no_module_over_600_lines_outside_tests() -> None:
    long = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "tests" or rel.parts[0].startswith("."):
            continue
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > 600:
            long.append(f"{rel} ({lines} lines)")
    assert long == []


PUBLIC_MODULES = {"r2med_agent.api"}


def test_the_public_api_is_read_by_users_and_the_cli_only() -> None:
    """``api`` gathers names for users (docs/python-api.md); the package's own layers import each
    name from the module that defines it (the package's ``__init__`` re-exports from it)."""
    modules = _modules()
    users = {m for m in modules if m.startswith("r2med_agent.cli") or m == "r2med_agent"} | PUBLIC_MODULES
    through = sorted(f"{m} imports {', '.join(sorted(_imports(m, p, modules) & PUBLIC_MODULES))}"
                     for m, p in modules.items() if m not in users and _imports(m, p, modules) & PUBLIC_MODULES)
    assert through == []


# -- issue 28: the seams --------------------------------------------------------------------

COMPONENT_FIELDS = {"method", "llm", "retriever", "reranker", "first_pass", "loop_retriever"}
"""Spec settings that name a component (a registry entry or kind)."""


def _component_names() -> set[str]:
    """Every name a registry knows: methods, retriever kinds and their words, reranker kinds and
    entries, LLM entries, and ``none``."""
    from r2med_agent.config import load_registry
    from r2med_agent.llm.registry import LLMSpec
    from r2med_agent.methods import METHODS
    from r2med_agent.retrieval import retriever_names
    from r2med_agent.retrieval.registry import RETRIEVER_KINDS
    from r2med_agent.rerank.kinds import RERANKER_KINDS
    from r2med_agent.rerank.spec import reranker_registry

    return ({"none"} | set(METHODS) | set(RETRIEVER_KINDS) | set(retriever_names()) | set(RERANKER_KINDS)
            | set(reranker_registry()) | set(load_registry("llms", LLMSpec)))


def _names_a_component(node: ast.AST) -> bool:
    """``x.method``, ``spec.reranker``, ``v["retriever"]`` and the like."""
    if isinstance(node, ast.Attribute):
        return node.attr in COMPONENT_FIELDS
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value in COMPONENT_FIELDS
    return False


def _literal_names(node: ast.AST, names: set[str]) -> bool:
    """A literal string, or a literal collection holding one, that a registry knows as a name, or
    a module constant (``NO_MODEL``)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in names
    if isinstance(node, (ast.Tuple, ast.Set, ast.List)):
        return any(_literal_names(e, names) for e in node.elts)
    return isinstance(node, ast.Name) and node.id.isupper()


def _name_tests(path: Path, names: set[str]) -> list[str]:
    """Comparisons of a component-naming setting with a literal name or a constant set of names
    (``spec.method == "none"``, ``retriever in NO_MODEL``, ``reranker.kind == "listwise"``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_a_component(s) or (isinstance(s, ast.Attribute) and s.attr == "kind") for s in sides) \
                    and any(_literal_names(s, names) for s in sides):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_the_run_spec_imports_no_registry_and_tests_no_name() -> None:
    """RunSpec, from_key, from_record and the label are pure data: a result reads back and labels
    the same in any process, whatever is registered there (resolution is experiment/resolve.py's)."""
    modules = _modules()
    spec = "r2med_agent.experiment.spec"
    assert _imports(spec, modules[spec], modules) <= {"r2med_agent.errors", "r2med_agent.names", "r2med_agent.types"}
    for name in ("r2med_agent.names",):  # what the spec imports is pure too
        assert _imports(name, modules[name], modules) == set()
    tree = ast.parse(modules[spec].read_text(encoding="utf-8"))
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert not calls & {"open", "Path", "read_text", "read_bytes"}, "the spec reads no file"
    assert _name_tests(modules[spec], _component_names()) == []


def test_the_runner_imports_no_concrete_component() -> None:
    """experiment/runner.py reaches methods, retrievers, rerankers and LLMs through their
    registries and protocols only (what they write goes through their own output objects)."""
    modules = _modules()
    runner = "r2med_agent.experiment.runner"
    allowed = {"r2med_agent.methods", "r2med_agent.methods.base", "r2med_agent.retrieval",
               "r2med_agent.retrieval.base", "r2med_agent.retrieval.registry", "r2med_agent.rerank",
               "r2med_agent.rerank.base", "r2med_agent.rerank.kinds", "r2med_agent.llm",
               "r2med_agent.llm.base", "r2med_agent.llm.registry"}
    concrete = sorted(m for m in _imports(runner, modules[runner], modules)
                      if m.split(".")[1] in ("methods", "retrieval", "llm") and m not in allowed)
    assert concrete == []
    assert _name_tests(modules[runner], _component_names()) == []  # not even `method != "none"`


def test_no_untyped_attribute_access_in_the_methods() -> None:
    """A loop declares what LoopMethod.run_tasks reads of it; nothing needs ``type: ignore[attr-defined]``."""
    found = [f"{p.relative_to(PACKAGE.parent)}:{i}" for p in (PACKAGE / "methods").rglob("*.py")
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if "type: ignore[attr-defined]" in line]
    assert found == []


def test_the_run_command_takes_at_most_8_named_parameters() -> None:
    """``run``'s options are generated from the RunSpec fields, not spelt as parameters."""
    tree = ast.parse((PACKAGE / "cli" / "run_cmd.py").read_text(encoding="utf-8"))
    (run,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "run_command"]
    a = run.args
    assert len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) <= 8


def test_each_default_is_stated_once() -> None:
    """The sampling knobs' defaults (on SamplingParams), rerank_k's 100 and RRF's 60 (in names.py)
    have one definition each: no parameter or field spells them as its default."""
    spelt = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            args = node.args if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
            if args is not None:
                params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
                defaults = [None] * (len(args.posonlyargs) + len(args.args) - len(args.defaults)) + list(args.defaults)
                defaults += list(args.kw_defaults)
                pairs = zip([p.arg for p in params], defaults)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                pairs = [(node.target.id, node.value)]
            else:
                continue
            for name, default in pairs:
                if isinstance(default, ast.Constant) and (name, default.value) in {
                        ("rrf_k", 60), ("rerank_k", 100), ("temperature", 0.7), ("max_tokens", 10240)}:
                    spelt.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}={default.value}")
    assert spelt == []


def test_no_code_asks_whether_the_method_is_none() -> None:
    """``method == "none"`` stood for "no LLM" in four places: the method's declared ``uses_llm``
    (or a resolved spec's ``llm``) says it now, so a method of one's own without an LLM works too."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Attribute) and s.attr == "method"
                       or isinstance(s, ast.Subscript) and isinstance(s.slice, ast.Constant) and s.slice.value == "method"
                       for s in sides) and any(isinstance(s, ast.Constant) and s.value == "none" for s in sides):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {ast.unparse(node)}")
    assert found == []


REGISTRY_LOOKUPS = {"Registries", "METHODS", "get_method", "get_llm_spec", "load_llm_specs", "lookup",
                    "get_reranker_spec", "reranker_registry", "reranker_kind", "RERANKER_KINDS", "encoder_registry",
                    "retriever_kind", "RETRIEVER_KINDS", "default_sampling", "loop_sampling"}
"""What reads a registry entry by name (or merges an entry's sampling): resolution's business."""
RESOLUTION = {"r2med_agent.experiment.resolve", "r2med_agent.experiment.run_config"}
"""The modules that resolve a run into its plan (and may read the registries for it)."""
PLAN_READERS = ("r2med_agent.experiment.runner", "r2med_agent.grids.estimates", "r2med_agent.grids.needs",
                "r2med_agent.grids.first_stage", "r2med_agent.grids.schedule")
"""Modules that run or cost a resolved run (the runner; ``reproduce --dry-run``'s estimates, needs,
first stage and cluster resources): they read its plan, never a registry."""


def _imported_names(path: Path) -> set[str]:
    return {a.asname or a.name for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.ImportFrom) for a in node.names}


def test_no_registry_read_outside_resolution_in_what_runs_a_plan() -> None:
    """The runner and the estimates read the run's plan (experiment/plan.py), built by resolution
    (RESOLUTION); they look up no entry by name and merge no sampling."""
    modules = _modules()
    assert not RESOLUTION & set(PLAN_READERS)
    found = [f"{m}: {sorted(_imported_names(modules[m]) & REGISTRY_LOOKUPS)}" for m in PLAN_READERS
             if _imported_names(modules[m]) & REGISTRY_LOOKUPS]
    assert found == []


def test_one_class_says_what_resolution_reads() -> None:
    """One ``Registries`` (resolution's, experiment/resolve.py), not one per consumer: the grid
    planner's needs and estimates read the rows' plans instead."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}" for path in PACKAGE.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.ClassDef) and node.name == "Registries"]
    assert [f.split(":")[0] for f in found] == ["r2med_agent/experiment/resolve.py"], found


def test_no_benchmark_named_in_the_runner() -> None:
    """Released generations come from the plan's registered source (data/sources.py): the runner
    imports no benchmark's module and spells no source's name."""
    from r2med_agent.data.sources import GENERATION_SOURCES

    modules = _modules()
    path = modules["r2med_agent.experiment.runner"]
    named = sorted(m for m in _imports("r2med_agent.experiment.runner", path, modules)
                   if any(b in m.rsplit(".", 1)[-1] for b in (*GENERATION_SOURCES, "released")))
    named += [f"{node.lineno} {node.value!r}" for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
              if isinstance(node, ast.Constant) and node.value in GENERATION_SOURCES]
    assert named == []


def test_the_runner_reads_no_undeclared_member() -> None:
    """What the runner calls of a component its protocol declares (Method, Retriever with
    ``keeps_order``, BatchReranker's ``share_llm``, ``rerank_tasks``, ``built_llm``): no
    ``getattr(component, "name", default)`` guesses."""
    path = PACKAGE / "experiment" / "runner.py"
    guessed = [f"{n.lineno} {n.args[1].value}" for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
               if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "getattr" and len(n.args) > 1
               and isinstance(n.args[1], ast.Constant)]
    assert guessed == []
