"""The README's measured-results section, between two markers that only the benchmark writes."""

from __future__ import annotations

from pathlib import Path

START = "<!-- bench:start -->"
END = "<!-- bench:end -->"
HEADING = "## Performance"


def markers(model: str | None = None) -> tuple[str, str]:
    """The start and end markers of the default model's section (``model`` None) or of ``model``'s."""
    return (START, END) if model is None else (f"<!-- bench:{model}:start -->", f"<!-- bench:{model}:end -->")


def replace_section(text: str, body: str, model: str | None = None) -> str:
    """``text`` with what lies between the markers (``markers(model)``) replaced by ``body``;
    everything outside the markers is kept byte for byte. Without markers: the default
    model's section is appended at the end under ``## Performance``; another model's is
    put after the default model's end marker (or at the end), under a heading naming it."""
    body = body.strip("\n")
    start_marker, end_marker = markers(model)
    start, end = text.find(start_marker), text.find(end_marker)
    if start == -1 and end == -1 and model is not None:
        section = f"### {model}\n\n{start_marker}\n{body}\n{end_marker}\n"
        anchor = text.find(END)
        if anchor != -1:
            cut = anchor + len(END) + 1
            return f"{text[:cut]}\n{section}{text[cut:]}"
        sep = "" if not text or text.endswith("\n\n") else ("\n" if text.endswith("\n") else "\n\n")
        return f"{text}{sep}{section}"
    if start == -1 and end == -1:
        sep = "" if not text or text.endswith("\n\n") else ("\n" if text.endswith("\n") else "\n\n")
        return f"{text}{sep}{HEADING}\n\n{START}\n{body}\n{END}\n"
    if (start == -1 or end == -1 or end < start or text.count(start_marker) != 1
            or text.count(end_marker) != 1):
        raise ValueError(f"the README must hold {start_marker} once, followed by {end_marker} once; fix "
                         "the markers by hand (or remove both to have the section appended)")
    return f"{text[:start + len(start_marker)]}\n{body}\n{text[end:]}"


def write_section(path: Path, body: str, model: str | None = None) -> None:
    """Rewrite the marked section of the file at ``path`` (see ``replace_section``)."""
    text = path.read_text(encoding="utf-8")
    path.write_text(replace_section(text, body, model), encoding="utf-8")
