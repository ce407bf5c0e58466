"""docs/cli.md is what docs/gen_cli.py renders from the real ``kvserve`` parser."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_cli_md_is_the_parser_rendered() -> None:
    gen = _generator()
    assert (ROOT / "docs" / "cli.md").read_text(encoding="utf-8") == gen.render(), (
        "docs/cli.md is stale: run .venv/bin/python docs/gen_cli.py")


def test_every_subcommand_and_option_is_listed(monkeypatch) -> None:
    monkeypatch.setenv("KVSERVE_API_KEY", "not-on-the-page")
    gen = _generator()
    text = gen.render()
    assert "not-on-the-page" not in text
    for command, parser, _ in gen.parsers():
        assert f"## `{command}`" in text
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert flag in text, (command, flag)
    assert [c for c, _, _ in gen.parsers()] == [
        "kvserve serve", "kvserve run-batch", "kvserve generate", "kvserve chat", "kvserve fetch",
        "kvserve bench serve"]
