"""Fetching a known model for the command line (``kvserve fetch``), which reaches
``models`` only through the engine."""

from __future__ import annotations

from pathlib import Path

from models import catalog


def known_models() -> list[str]:
    """The names ``fetch_model`` takes."""
    return sorted(catalog.MODELS)


def fetch_model(name: str, force: bool = False) -> Path:
    """Download, join and check model ``name`` into the cache; its file's path.

    ``ValueError`` (nothing kept) when the download or the check fails.
    """
    return catalog.fetch(name, force=force)
