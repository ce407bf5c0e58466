"""Imports go one way, server -> engine -> models: checked with an AST walk."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What each package must never import (project packages and third-party ones).
FORBIDDEN = {
    "models": {"engine", "server", "bench", "fastapi", "uvicorn", "prometheus_client", "starlette"},
    "engine": {"server", "bench", "fastapi", "uvicorn", "prometheus_client", "starlette"},
}


def imported_top_levels(path: Path) -> set[str]:
    tops = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            tops.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            tops.add(node.module.split(".")[0])
    return tops


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_never_imports_upwards(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no modules found in {package}/"
    offences = {f"{p.relative_to(ROOT)} imports {name}"
                for p in files for name in imported_top_levels(p) & FORBIDDEN[package]}
    assert not offences, sorted(offences)


def test_the_walk_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    import fastapi.routing\n    from server.app import build_app\n")
    assert imported_top_levels(module) == {"fastapi", "server"}
