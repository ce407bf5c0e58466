"""Imports go one way, cli -> server -> engine -> models: checked with an AST walk.

``server/cli`` (the ``kvserve`` command) sits above the HTTP layer and may use
``bench/`` (``kvserve bench``); nothing else in ``server/`` may import either.
Imports inside functions count, and so do ``importlib.import_module`` and
``__import__`` with a literal name; a computed name cannot be checked and is an
offence in itself.

Nor may the project's modules import each other in a circle, within a package
too: a name two modules share moves down into one that both import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WEB = {"fastapi", "uvicorn", "prometheus_client", "starlette"}

# What the modules under each folder must never import (a name covers its submodules).
FORBIDDEN = {
    "models": {"engine", "server", "bench"} | WEB,
    "engine": {"server", "bench"} | WEB,
    "server": {"models", "bench", "server.cli"},
    "server/cli": {"models"},
    "bench": {"server"},
}
DYNAMIC = "a computed module name"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, package: str) -> set[str]:
    """Every module that ``source``, a module of ``package``, imports
    (``from a import b`` gives ``a`` and ``a.b``; relative imports are resolved)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[:len(parts) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func):
            arg = node.args[0] if node.args else None
            literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            names.add(arg.value if literal else DYNAMIC)
    return names


def package_of(path: Path) -> str:
    name = module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def covers(forbidden: str, name: str) -> bool:
    return name == forbidden or name.startswith(forbidden + ".")


def rules_for(path: Path) -> set[str]:
    """The forbidden set of the deepest folder in FORBIDDEN that holds ``path``."""
    rel = path.relative_to(ROOT).as_posix()
    folder = max((f for f in FORBIDDEN if rel.startswith(f + "/")), key=len)
    return FORBIDDEN[folder]


def offences(path: Path) -> list[str]:
    rules = rules_for(path)
    found = []
    for name in sorted(imported_modules(path.read_text(), package_of(path))):
        if name == DYNAMIC:
            found.append(f"{path.relative_to(ROOT)} imports {DYNAMIC}: use a plain import")
        elif any(covers(f, name) for f in rules):
            found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_module_imports_upwards(folder: str) -> None:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"no modules found in {folder}/"
    found = [o for p in files if rules_for(p) is FORBIDDEN[folder] for o in offences(p)]
    assert not found, found


def test_the_walk_sees_imports_in_functions_relative_and_through_importlib() -> None:
    source = ("import importlib\n"
              "def f():\n    import fastapi.routing\n    from server.app import build_app\n"
              "def g():\n    from . import cli\n    importlib.import_module('bench.serve')\n"
              "def h(name):\n    return __import__(name)\n")
    assert imported_modules(source, "server") >= {
        "fastapi.routing", "server.app", "server.app.build_app", "server.cli", "bench.serve", DYNAMIC}


def test_an_upward_import_through_importlib_is_an_offence() -> None:
    names = imported_modules("import importlib\nimportlib.import_module('server.app')\n", "engine")
    assert any(covers(f, n) for f in FORBIDDEN["engine"] for n in names)


def test_the_cli_is_held_to_its_own_rules() -> None:
    assert rules_for(ROOT / "server" / "cli" / "serve.py") is FORBIDDEN["server/cli"]
    assert rules_for(ROOT / "server" / "app.py") is FORBIDDEN["server"]


PACKAGES = ("server", "engine", "models", "bench")


def import_graph() -> dict[str, set[str]]:
    """Each of the project's modules -> the project's modules it imports
    (``from a import b`` counts ``a.b`` only where ``a.b`` is a module)."""
    paths = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
    return {name: {n for n in imported_modules(path.read_text(), package_of(path))
                   if n in paths and n != name}
            for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module
    (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            nxt = next((s for s in successors if s not in index or s in on_stack), None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif nxt in index:
                low[node] = min(low[node], index[nxt])
            else:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
    return found


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = [" <-> ".join(c) + ": " + "; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(c)))}" for m in c)
             for c in cycles(graph)]
    assert not found, "\n".join(found)


def test_the_cycle_check_finds_a_cycle_inside_a_package_and_ignores_a_chain() -> None:
    graph = {"models.ops": {"models.autotune"}, "models.autotune": {"models.llama"},
             "models.llama": {"models.ops", "models.rope"}, "models.rope": set(),
             "engine.a": {"models.ops"}}
    assert cycles(graph) == [["models.autotune", "models.llama", "models.ops"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
