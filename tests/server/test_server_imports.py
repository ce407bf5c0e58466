"""server/ imports only downward: engine types, never models (and never back up)."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server"
OWN_PACKAGES = {"server", "engine", "models", "bench", "tests"}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_server_imports_only_engine_among_project_packages() -> None:
    files = sorted(SERVER.glob("*.py"))
    assert files
    for path in files:
        for name in imported_modules(path):
            top = name.split(".")[0]
            if top in OWN_PACKAGES:
                assert top in ("server", "engine"), f"{path.name} imports {name}"
