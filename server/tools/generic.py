"""kvserve's own tool-call format, ``generic``, for chat templates that know nothing of tools.

The tools are listed in the system message (``tools_block``), and a call is the
answer's whole text: one JSON object ``{"name": ..., "arguments": {...}}`` or,
with ``parallel_tool_calls`` (the default), a JSON array of them. Earlier turns
are rendered the same way (``server.tools.history.history_content``).
"""

from __future__ import annotations

import json
from typing import Any

from engine.sampling_params import StructuredOutput
from server.tools.base import (FunctionSpec, ParsedCall, ToolFormat, call_schema, chosen_tools, json_answer,
                               max_calls, scan_call)

TOOLS_PREAMBLE = (
    "You can call the following tools. To call one, answer with only a JSON object "
    '{"name": <tool name>, "arguments": <the arguments as a JSON object>}'
)
PARALLEL_NOTE = ", or a JSON array of such objects to call several"


def tools_block(tools: list[FunctionSpec], parallel: bool) -> str:
    """The system text that lists ``tools`` and says how to call them (the generic format)."""
    lines = [TOOLS_PREAMBLE + (PARALLEL_NOTE if parallel else "") + ". Tools:"]
    lines += [json.dumps(t.openai()["function"], ensure_ascii=False) for t in tools]
    return "\n".join(lines)


def calls_schema(tools: list[FunctionSpec], parallel: bool) -> dict[str, Any]:
    """The JSON Schema of a generic-format answer that calls ``tools`` (one call, or an array)."""
    one = call_schema(tools)
    if not parallel:
        return one
    return {"type": "array", "items": one, "minItems": 1, "maxItems": max_calls(tools, parallel)}


class GenericFormat(ToolFormat):
    """kvserve's format: the answer is the calls' JSON (an object, or an array with parallel calls)."""

    name = "generic"
    native = False

    def grammar(self, tools: list[FunctionSpec], choice: str, parallel: bool) -> StructuredOutput | None:
        chosen = chosen_tools(tools, choice)
        if chosen is None:
            return None
        return json_answer(calls_schema(chosen, parallel), choice, "\\[{")

    def opens(self, head: str) -> bool | None:
        return head[0] in "{["

    def scan(self, text: str) -> list[ParsedCall] | None:
        if not text.startswith(("{", "[")):
            return None
        array = text.startswith("[")
        pos, calls = (1 if array else 0), []
        while True:
            call, close = scan_call(text, pos)
            if call is not None:
                calls.append(call)
            if close is None or not array:
                return calls
            pos = close
            while pos < len(text) and text[pos] in " ,\n":
                pos += 1

    def parse(self, text: str) -> list[ParsedCall] | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        calls = self.scan(text)
        items = value if isinstance(value, list) else [value]
        if not calls or len(calls) != len(items) or not all(c.complete for c in calls):
            return None
        return calls
