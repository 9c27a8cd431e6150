"""The rules docs/architecture.md states, checked on the package's own source: no import cycle
outside cli/, no function over 80 lines, no public function with more than 8 parameters outside
the typer commands, no method name spelt in the runner or the analysis code, no class over 400
lines, no module over 600 lines outside tests/, and the public modules (``runner``, ``compare``,
``reproduce``) read by users, the CLI and the Python API only."""

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


def test_no_import_cycle_outside_cli() -> None:
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    cycles = [c for c in _cycles(graph) if any(not m.startswith("r2med_agent.cli") for m in c)]
    assert cycles == []


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
    for folder in ("experiment", "analysis"):
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


PUBLIC_MODULES = {"r2med_agent.runner", "r2med_agent.compare", "r2med_agent.reproduce"}


def test_the_public_modules_are_read_by_users_the_cli_and_the_python_api_only() -> None:
    """``runner``, ``compare`` and ``reproduce`` gather names for users (docs/python-api.md); the
    package's own layers import each name from the module that defines it."""
    modules = _modules()
    users = {m for m in modules if m.startswith("r2med_agent.cli") or m == "r2med_agent.api"} | PUBLIC_MODULES
    through = sorted(f"{m} imports {', '.join(sorted(_imports(m, p, modules) & PUBLIC_MODULES))}"
                     for m, p in modules.items() if m not in users and _imports(m, p, modules) & PUBLIC_MODULES)
    assert through == []
