"""Tool calling for chat completions: the prompt's tool block, the call grammar, and the answer's calls.

kvserve's generic format (the default model's chat template knows nothing of
tools): the tools are listed in the system message (``tools_block``), and a
call is the answer's whole text, one JSON object ``{"name": ..., "arguments":
{...}}`` or, with ``parallel_tool_calls`` (the default), a JSON array of them,
at most as many as there are tools to choose from. The answer is
generated under a grammar (``call_grammar``), so a call always names a given
tool and its arguments validate against the tool's ``parameters``:

* ``tool_choice: "required"``: one of the calls' JSON, nothing else;
* a named function: a call of that function;
* ``"auto"`` (the default with tools): either a text answer that does not
  start with ``{`` or ``[``, or the calls' JSON;
* ``"none"``: a text answer (the tools stay in the prompt, as OpenAI's do).

Earlier turns are rendered the same way: an assistant message's
``tool_calls`` become its content in that JSON, and a ``tool`` message's
result is a message of role ``tool``.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import StructuredOutput
from server.protocol_responses import DeltaFunction, DeltaToolCall

MAX_PARALLEL_CALLS = 8

TOOLS_PREAMBLE = (
    "You can call the following tools. To call one, answer with only a JSON object "
    '{"name": <tool name>, "arguments": <the arguments as a JSON object>}'
)
PARALLEL_NOTE = ", or a JSON array of such objects to call several"


@dataclass(frozen=True)
class FunctionSpec:
    """One tool a request offers: a function with a JSON Schema for its arguments."""

    name: str
    description: str | None
    parameters: dict[str, Any]


def tools_block(tools: list[FunctionSpec], parallel: bool) -> str:
    """The system text that lists ``tools`` and says how to call them."""
    lines = [TOOLS_PREAMBLE + (PARALLEL_NOTE if parallel else "") + ". Tools:"]
    for t in tools:
        entry: dict[str, Any] = {"name": t.name}
        if t.description:
            entry["description"] = t.description
        entry["parameters"] = t.parameters
        lines.append(json.dumps(entry, ensure_ascii=False))
    return "\n".join(lines)


def _call_schema(tools: list[FunctionSpec]) -> dict[str, Any]:
    options = [{"type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def calls_schema(tools: list[FunctionSpec], parallel: bool) -> dict[str, Any]:
    """The JSON Schema of an answer that calls ``tools`` (one call, or an array of calls)."""
    one = _call_schema(tools)
    if not parallel:
        return one
    # At most as many calls as tools: unbounded, the default model repeated its
    # first call until max_tokens.
    return {"type": "array", "items": one, "minItems": 1, "maxItems": min(MAX_PARALLEL_CALLS, len(tools))}


def call_grammar(tools: list[FunctionSpec], choice: str, parallel: bool) -> StructuredOutput | None:
    """The structured output that enforces ``choice`` ("none", "auto", "required" or a tool's name)."""
    if choice == "none":
        return None
    if choice not in ("auto", "required"):
        tools = [t for t in tools if t.name == choice]
        assert tools, "the server checks that a named tool exists"
    schema = calls_schema(tools, parallel)
    if choice != "auto":
        return StructuredOutput("json", schema)
    # Lark (llguidance's dialect): a text answer, or the calls' JSON.
    grammar = ("start: TEXT | calls\n"
               "TEXT: /[^\\[{][\\s\\S]*/\n"
               f"calls: %json {json.dumps(schema)}\n")
    return StructuredOutput("grammar", grammar)


@dataclass
class ParsedCall:
    """One call found in an answer, possibly still arriving (``complete`` False)."""

    name: str | None  # None until the whole name has arrived
    arguments: str  # the arguments' JSON text so far (OpenAI sends them as a string)
    complete: bool


_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _value_end(text: str, start: int) -> int | None:
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


def scan_calls(text: str) -> list[ParsedCall] | None:
    """The calls in an answer so far (kvserve's format), or None when the answer is not calls."""
    body = text.lstrip()
    if not body.startswith(("{", "[")):
        return None
    pos = 1 if body.startswith("[") else 0
    calls: list[ParsedCall] = []
    while True:
        m = _NAME.match(body, pos)
        if m is None:  # the next call's name has not all arrived
            break
        name = json.loads(f'"{m.group(1)}"')
        end = _value_end(body, m.end())
        if end is None:
            calls.append(ParsedCall(name, body[m.end():], False))
            break
        calls.append(ParsedCall(name, body[m.end():end], True))
        close = body.find("}", end)
        if close < 0 or not body.startswith("["):
            break
        pos = close + 1
        while pos < len(body) and body[pos] in " ,\n":
            pos += 1
    return calls


def parse_calls(text: str) -> list[ParsedCall] | None:
    """A finished answer's calls, or None when it is text or a call cut off by max_tokens."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    calls = scan_calls(text)
    items = value if isinstance(value, list) else [value]
    if not calls or len(calls) != len(items) or not all(c.complete for c in calls):
        return None
    return calls


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def history_content(tool_calls: list[dict[str, Any]], parallel: bool) -> str:
    """An earlier assistant turn's ``tool_calls`` as the text kvserve's format gives them."""
    calls = []
    for call in tool_calls:
        fn = call["function"]
        try:
            arguments = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
        except ValueError:
            arguments = fn["arguments"]
        calls.append({"name": fn["name"], "arguments": arguments})
    value: Any = calls if parallel or len(calls) > 1 else calls[0]
    return json.dumps(value, ensure_ascii=False)


class CallStream:
    """One streamed choice's text, turned into content or into OpenAI's ``delta.tool_calls``.

    Until the first non-blank character it holds the text back; an answer that
    opens with ``{`` or ``[`` is calls (each call's id, type and name once the
    name has arrived, then its arguments in pieces as they are generated),
    anything else is content.
    """

    def __init__(self) -> None:
        self.buffer = ""
        self.mode: str | None = None  # None (undecided), "text" or "calls"
        self._sent: list[list] = []  # per call: [id, length of the arguments sent]

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        """The content to send for ``text`` and the tool-call deltas it completes."""
        self.buffer += text
        if self.mode is None:
            head = self.buffer.lstrip()
            if not head:
                return "", []
            self.mode = "calls" if head[0] in "{[" else "text"
            if self.mode == "text":
                return self.buffer, []
        if self.mode == "text":
            return text, []
        deltas = []
        for i, call in enumerate(scan_calls(self.buffer) or []):
            if i == len(self._sent):
                self._sent.append([new_call_id(), 0])
                deltas.append(DeltaToolCall(index=i, id=self._sent[i][0], type="function",
                                            function=DeltaFunction(name=call.name, arguments="")))
            piece = call.arguments[self._sent[i][1]:]
            if piece:
                self._sent[i][1] = len(call.arguments)
                deltas.append(DeltaToolCall(index=i, function=DeltaFunction(arguments=piece)))
        return "", deltas

    def finish(self) -> tuple[str, bool]:
        """At the end: content still held back (an all-blank answer), and whether the answer was calls."""
        if self.mode is None:
            return self.buffer, False
        return "", self.mode == "calls" and parse_calls(self.buffer) is not None
