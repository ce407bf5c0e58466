"""The ``mistral`` tool-call format: Mistral's chat templates (7B v0.3, Nemo, Mixtral 8x22B and later).

Calls are ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (``MistralFormat``),
results in ``[TOOL_RESULTS]``; call ids are 9 letters and digits, as those
templates require. ``[TOOL_CALLS]`` is a control token of Mistral's vocabulary:
the grammar names it as that token, and the answer keeps it. Mistral's newer
templates and tokenizers (version 11 on: Mistral Small 3.1+, Devstral,
Magistral) write each call as ``[TOOL_CALLS]name[ARGS]{...}``
(``MistralArgsFormat``).
"""

from __future__ import annotations

import json
import secrets
import string

from engine.sampling_params import StructuredOutput
from server.tools.base import (FunctionSpec, ParsedCall, ToolFormat, arguments_parse, call_schema, calls_grammar,
                               chosen_tools, grammar_tag, lark_json, max_calls, opens_with, value_end)
from server.tools.generic import GenericFormat

MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
_ALPHANUMERIC = string.ascii_letters + string.digits
# What follows [TOOL_CALLS] is the generic format's array, read by that format
# (an instance of its own: the registry, FORMATS, imports this module).
_GENERIC = GenericFormat()


class MistralFormat(ToolFormat):
    """Mistral's calls (vLLM's ``mistral``): ``[TOOL_CALLS] [{"name": ..., "arguments":
    {...}}, ...]``, always an array. ``marker_token``: the id of ``[TOOL_CALLS]`` where the
    vocabulary has it as one token (Mistral's control token), which the grammar then asks
    for as that token rather than spelt out; the text keeps special tokens so that the
    marker shows."""

    name = "mistral"
    native = True
    keeps_special_tokens = True
    ID_LENGTH = 9  # Mistral's templates refuse other call ids

    def __init__(self, marker_token: int | None = None) -> None:
        self.marker_token = marker_token

    def call_id(self) -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(self.ID_LENGTH))

    def template_call_id(self, call_id: str) -> str:
        # As vLLM does for Mistral: another API's longer id (call_..., toolu_...) by its end.
        return call_id[-self.ID_LENGTH:]

    def _marker(self) -> str:
        """``[TOOL_CALLS]`` in the grammar: its token where it is one, else its text."""
        return grammar_tag(MISTRAL_CALLS, self.marker_token)

    def grammar(self, tools: list[FunctionSpec], choice: str, parallel: bool) -> StructuredOutput | None:
        chosen = chosen_tools(tools, choice)
        if chosen is None:
            return None
        schema = {"type": "array", "items": call_schema(chosen), "minItems": 1,
                  "maxItems": max_calls(chosen, parallel)}
        # (A text answer that may not start with "[" cannot spell the marker out either.)
        return calls_grammar(f'calls: {self._marker()} " " body\nbody: %json {lark_json(schema)}\n', choice,
                             "\\[")

    def opens(self, head: str) -> bool | None:
        return opens_with(MISTRAL_CALLS, head)

    def scan(self, text: str) -> list[ParsedCall] | None:
        if not text or opens_with(MISTRAL_CALLS, text) is False:
            return None
        rest = text[len(MISTRAL_CALLS):].lstrip()
        # (The generic format reads an array that has begun: never None.)
        return _GENERIC.scan(rest) if rest.startswith("[") else []

    def parse(self, text: str) -> list[ParsedCall] | None:
        if not text.startswith(MISTRAL_CALLS):
            return None
        rest = text[len(MISTRAL_CALLS):].strip()
        return _GENERIC.parse(rest) if rest.startswith("[") else None


class MistralArgsFormat(MistralFormat):
    """Mistral's calls since its tokenizer version 11 (Mistral Small 3.1 and later,
    Devstral, Magistral; vLLM's ``mistral`` on such a tokenizer): each call is
    ``[TOOL_CALLS]name[ARGS]{...}``, the calls one after another. ``args_token``: the id
    of ``[ARGS]`` where it is one token (a control token of those vocabularies)."""

    def __init__(self, marker_token: int | None = None, args_token: int | None = None) -> None:
        super().__init__(marker_token)
        self.args_token = args_token

    def describe(self) -> str:
        return f"{self.name} format, {MISTRAL_CALLS}name{MISTRAL_ARGS}{{...}} per call"

    def grammar(self, tools: list[FunctionSpec], choice: str, parallel: bool) -> StructuredOutput | None:
        chosen = chosen_tools(tools, choice)
        if chosen is None:
            return None
        args = grammar_tag(MISTRAL_ARGS, self.args_token)
        more = max_calls(chosen, parallel) - 1
        rules = ("calls: call" + (f" call{{0,{more}}}" if more else "") + "\n"
                 f"call: {self._marker()} (" + " | ".join(f"fn{i}" for i in range(len(chosen))) + ")\n")
        for i, tool in enumerate(chosen):
            rules += f"fn{i}: {json.dumps(tool.name)} {args} body{i}\nbody{i}: %json {lark_json(tool.parameters)}\n"
        return calls_grammar(rules, choice, "\\[")

    def _calls(self, text: str) -> tuple[list[ParsedCall], bool]:
        """The calls in ``text`` so far, and whether each closed with nothing but blanks after it."""
        calls: list[ParsedCall] = []
        tidy = True
        for part in text.split(MISTRAL_CALLS)[1:]:
            name, sep, args = part.partition(MISTRAL_ARGS)
            if not sep:  # the name has not all arrived
                tidy = False
                break
            args = args.lstrip()
            end = value_end(args, 0) if args.startswith("{") else None
            calls.append(ParsedCall(name.strip(), args if end is None else args[:end], end is not None))
            tidy = tidy and end is not None and not args[end:].strip()
        return calls, tidy

    def scan(self, text: str) -> list[ParsedCall] | None:
        if not text or opens_with(MISTRAL_CALLS, text) is False:
            return None
        return self._calls(text)[0]

    def parse(self, text: str) -> list[ParsedCall] | None:
        if not text.startswith(MISTRAL_CALLS):
            return None
        calls, tidy = self._calls(text.rstrip())
        if not calls or not tidy:
            return None
        return calls if arguments_parse(calls) else None
