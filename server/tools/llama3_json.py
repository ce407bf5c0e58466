"""The ``llama3_json`` tool-call format: Llama 3.1/3.2's JSON calls (vLLM's ``llama3_json``).

The answer is one JSON object ``{"name": ..., "parameters": {...}}``; the chat
template renders the tools, an earlier turn's call in that JSON and its result
as an ``ipython`` turn.
"""

from __future__ import annotations

import json

from engine.sampling_params import StructuredOutput
from server.tools.base import FunctionSpec, ParsedCall, ToolFormat, call_schema, chosen_tools, json_answer, scan_call


class Llama3JsonFormat(ToolFormat):
    """Llama 3.1/3.2's JSON calls (vLLM's ``llama3_json``): the answer is one object
    ``{"name": ..., "parameters": {...}}``. Their templates render the tools, an earlier
    turn's call in that JSON and its result as an ``ipython`` turn, and take one call per
    turn, so an answer makes one call."""

    name = "llama3_json"
    native = True
    key = "parameters"

    def grammar(self, tools: list[FunctionSpec], choice: str, parallel: bool) -> StructuredOutput | None:
        chosen = chosen_tools(tools, choice)
        if chosen is None:
            return None
        return json_answer(call_schema(chosen, self.key), choice, "{")

    def opens(self, head: str) -> bool | None:
        return head[0] == "{"

    def scan(self, text: str) -> list[ParsedCall] | None:
        if not text.startswith("{"):
            return None
        call, _ = scan_call(text, 0, self.key)
        return [call] if call is not None else []

    def parse(self, text: str) -> list[ParsedCall] | None:
        try:
            json.loads(text)
        except ValueError:
            return None
        calls = self.scan(text)
        return calls if calls and calls[0].complete else None
