"""The interface every tool-call format implements, and the pieces the formats share.

``ToolFormat`` is one way of writing calls (the prompt, the grammar, reading
the answer); ``FunctionSpec`` is a tool a request offers and ``ParsedCall`` a
call read from an answer. The helpers below build the formats' grammars (a
call's JSON Schema, the ``auto`` choice's text-or-calls grammar) and read the
calls' JSON as it streams in; the format modules import them from here, and
nothing here imports a format, so the package's imports run one way.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import StructuredOutput
from engine.structured import JSON_OPTIONS

MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True)
class FunctionSpec:
    """One tool a request offers: a function with a JSON Schema for its arguments."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request gives it (what chat templates iterate over)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass
class ParsedCall:
    """One call found in an answer, possibly still arriving (``complete`` False)."""

    name: str | None  # None until the whole name has arrived
    arguments: str  # the arguments' JSON text so far (OpenAI sends them as a string)
    complete: bool


def new_call_id() -> str:
    """A new call id as OpenAI writes them: ``call_`` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


class ToolFormat:
    """One way of writing tool calls: the prompt, the grammar, reading the answer."""

    name: str
    native: bool  # the chat template renders the tools and earlier calls itself
    # The answer's text keeps special tokens (its calls open with one).
    keeps_special_tokens = False
    # The calls' grammar holds the whole answer, the reasoning before the calls too, so a
    # reasoning parser's gate does not wait it out (gpt-oss's harmony: server.answers).
    grammar_reasons = False

    def describe(self) -> str:
        """The format as the start-up log names it."""
        return f"{self.name} format"

    def call_id(self) -> str:
        """A new call's id (OpenAI's ``tool_calls[].id``)."""
        return new_call_id()

    def template_call_id(self, call_id: str) -> str:
        """An earlier call's id as the chat template gets it."""
        return call_id

    def grammar(self, tools: list[FunctionSpec], choice: str, parallel: bool) -> StructuredOutput | None:
        """The structured output that enforces ``choice`` ("none", "auto", "required" or a tool's name)."""
        raise NotImplementedError

    def opens(self, head: str) -> bool | None:
        """Whether an answer starting with ``head`` is calls; None: too soon to say.

        Calls open at the answer's first character, as the grammar has them: an
        answer that starts with blanks is text (the grammar's text branch, so
        nothing in it was held to the tools' schemas), whatever follows."""
        raise NotImplementedError

    def scan(self, text: str) -> list[ParsedCall] | None:
        """The calls in an answer so far, or None when the answer is not calls."""
        raise NotImplementedError

    def parse(self, text: str) -> list[ParsedCall] | None:
        """A finished answer's calls, or None when it is text or calls cut off by max_tokens."""
        raise NotImplementedError


# The grammars.

def call_schema(tools: list[FunctionSpec], key: str = "arguments") -> dict[str, Any]:
    """One call of one of ``tools``: ``{"name": ..., key: <its arguments>}``."""
    options = [{"type": "object",
                "properties": {"name": {"const": t.name}, key: t.parameters},
                "required": ["name", key], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def max_calls(tools: list[FunctionSpec], parallel: bool) -> int:
    """How many calls an answer may make: one, or with ``parallel`` one per tool (up to
    ``MAX_PARALLEL_CALLS``)."""
    # At most as many calls as tools: unbounded, the default model repeated its
    # first call until max_tokens.
    return min(MAX_PARALLEL_CALLS, len(tools)) if parallel else 1


def grammar_tag(text: str, token: int | None) -> str:
    """A tag in a Lark grammar (llguidance's dialect): its token where the vocabulary has it
    as one (``token``), else its text."""
    return f"<[{token}]>" if token is not None else json.dumps(text)


def lark_json(schema: dict[str, Any]) -> str:
    """``schema`` as the argument of ``%json`` in a Lark grammar."""
    # %json inside a Lark grammar takes no defaults: the schema carries them (one
    # line, ", " and ": "), as structured outputs' JSON does.
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def calls_grammar(rules: str, choice: str, opening: str) -> StructuredOutput:
    """A grammar whose ``rules`` define ``calls``: the answer is calls (``required`` or a
    named tool) or, with ``auto``, either calls or a text that does not start with a
    character of ``opening`` (a Lark character class: llguidance's dialect), which keeps
    a text answer from opening as calls do."""
    if choice != "auto":
        return StructuredOutput("grammar", "start: calls\n" + rules)
    return StructuredOutput("grammar", f"start: TEXT | calls\nTEXT: /[^{opening}][\\s\\S]*/\n" + rules)


def json_answer(schema: dict[str, Any], choice: str, opening: str) -> StructuredOutput:
    """An answer that is the calls' JSON ``schema`` (``required`` or a named tool) or, with
    ``auto``, either that or a text that does not start with a character of ``opening``."""
    if choice != "auto":
        return StructuredOutput("json", schema)
    return calls_grammar(f"calls: %json {lark_json(schema)}\n", choice, opening)


def chosen_tools(tools: list[FunctionSpec], choice: str) -> list[FunctionSpec] | None:
    """The tools ``choice`` lets the answer call; None for "none" (no grammar: a text answer)."""
    if choice == "none":
        return None
    if choice in ("auto", "required"):
        return tools
    named = [t for t in tools if t.name == choice]
    assert named, "the server checks that a named tool exists"
    return named


# Reading the answer.

def _name_pattern(key: str) -> re.Pattern[str]:
    return re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"' + key + r'"\s*:\s*')


_NAME = {key: _name_pattern(key) for key in ("arguments", "parameters")}


def value_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at ``start`` ends (exclusive), None if it has not ended yet."""
    depth, in_string, escaped, i = 0, False, False, start
    while i < len(text):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and c in ",} \n":
            return i  # a bare number, true, false or null
        i += 1
    return None


def scan_call(text: str, pos: int, key: str = "arguments") -> tuple[ParsedCall | None, int | None]:
    """The call object starting at ``pos`` so far (its arguments under ``key``), and where
    it closes (None: not yet)."""
    m = _NAME[key].match(text, pos)
    if m is None:  # the call's name has not all arrived
        return None, None
    name = json.loads(f'"{m.group(1)}"')
    end = value_end(text, m.end())
    if end is None:
        return ParsedCall(name, text[m.end():], False), None
    close = text.find("}", end)
    return ParsedCall(name, text[m.end():end], True), (close + 1 if close >= 0 else None)


def arguments_parse(calls: list[ParsedCall]) -> bool:
    """Whether every call's arguments are JSON."""
    try:
        for c in calls:
            json.loads(c.arguments)
    except ValueError:
        return False
    return True


def opens_with(marker: str, head: str) -> bool | None:
    """Whether an answer starting with ``head`` opens with ``marker`` (None: too soon to say)."""
    if head.startswith(marker):
        return True
    return None if marker.startswith(head) else False
