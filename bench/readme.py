"""The README's measured-results section, between two markers that only the benchmark writes."""

from __future__ import annotations

from pathlib import Path

START = "<!-- bench:start -->"
END = "<!-- bench:end -->"
HEADING = "## Performance"


def replace_section(text: str, body: str) -> str:
    """``text`` with what lies between the markers replaced by ``body``; everything
    outside the markers is kept byte for byte. Without markers, a ``## Performance``
    section holding them is appended at the end."""
    body = body.strip("\n")
    start, end = text.find(START), text.find(END)
    if start == -1 and end == -1:
        sep = "" if not text or text.endswith("\n\n") else ("\n" if text.endswith("\n") else "\n\n")
        return f"{text}{sep}{HEADING}\n\n{START}\n{body}\n{END}\n"
    if start == -1 or end == -1 or end < start or text.count(START) != 1 or text.count(END) != 1:
        raise ValueError(f"the README must hold {START} once, followed by {END} once; fix the "
                         "markers by hand (or remove both to have the section appended)")
    return f"{text[:start + len(START)]}\n{body}\n{text[end:]}"


def write_section(path: Path, body: str) -> None:
    """Rewrite the marked section of the file at ``path`` (see ``replace_section``)."""
    text = path.read_text(encoding="utf-8")
    path.write_text(replace_section(text, body), encoding="utf-8")
