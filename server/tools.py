"""Tool calling for chat completions: the prompt's tools, the call grammar, and the answer's calls.

A ``ToolFormat`` is one way of writing calls; the server picks one per model
(``tool_format_for``):

* ``hermes`` where the model's chat template renders ``tools`` itself and
  writes calls as ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``
  (Qwen2.5, Qwen3, Hermes and the templates that copy them). The template gets
  ``tools`` and the messages' own ``tool_calls`` and ``tool_call_id``.
* ``llama3_json`` where the template writes calls as Llama 3.1/3.2's do:
  one JSON object ``{"name": ..., "parameters": {...}}`` per answer, results in
  ``ipython`` turns (the template renders both).
* ``mistral`` where the template writes calls as Mistral's (7B v0.3, Nemo,
  Mixtral 8x22B): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``,
  results in ``[TOOL_RESULTS]``; call ids are 9 letters and digits, as those
  templates require. ``[TOOL_CALLS]`` is a control token of Mistral's
  vocabulary: the grammar names it as that token, and the answer keeps it.
  Mistral's newer templates and tokenizers (version 11 on: Mistral Small 3.1+,
  Devstral, Magistral) write each call as ``[TOOL_CALLS]name[ARGS]{...}``.
* ``generic``, kvserve's own, for every other template (the default model's
  knows nothing of tools): the tools are listed in the system message
  (``tools_block``), and a call is the answer's whole text, one JSON object
  ``{"name": ..., "arguments": {...}}`` or, with ``parallel_tool_calls`` (the
  default), a JSON array of them. Earlier turns are rendered the same way: an
  assistant message's ``tool_calls`` become its content in that JSON, and a
  ``tool`` message's result is a message of role ``tool``.

Either way the answer is generated under a grammar (``ToolFormat.grammar``), so
a call always names a given tool, its arguments validate against the tool's
``parameters``, and there are at most as many calls as tools:

* ``tool_choice: "required"``: calls, nothing else;
* a named function: a call of that function;
* ``"auto"`` (the default with tools): either a text answer that does not
  start the way calls do, or calls;
* ``"none"``: a text answer (the tools stay in the prompt, as OpenAI's do).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import StructuredOutput
from engine.structured import JSON_OPTIONS
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

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request gives it (what chat templates iterate over)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


def tools_block(tools: list[FunctionSpec], parallel: bool) -> str:
    """The system text that lists ``tools`` and says how to call them (the generic format)."""
    lines = [TOOLS_PREAMBLE + (PARALLEL_NOTE if parallel else "") + ". Tools:"]
    lines += [json.dumps(t.openai()["function"], ensure_ascii=False) for t in tools]
    return "\n".join(lines)


def _call_schema(tools: list[FunctionSpec], key: str = "arguments") -> dict[str, Any]:
    """One call of one of ``tools``: ``{"name": ..., key: <its arguments>}``."""
    options = [{"type": "object",
                "properties": {"name": {"const": t.name}, key: t.parameters},
                "required": ["name", key], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def max_calls(tools: list[FunctionSpec], parallel: bool) -> int:
    # At most as many calls as tools: unbounded, the default model repeated its
    # first call until max_tokens.
    return min(MAX_PARALLEL_CALLS, len(tools)) if parallel else 1


def calls_schema(tools: list[FunctionSpec], parallel: bool) -> dict[str, Any]:
    """The JSON Schema of a generic-format answer that calls ``tools`` (one call, or an array)."""
    one = _call_schema(tools)
    if not parallel:
        return one
    return {"type": "array", "items": one, "minItems": 1, "maxItems": max_calls(tools, parallel)}


def _lark_json(schema: dict[str, Any]) -> str:
    # %json inside a Lark grammar takes no defaults: the schema carries them (one
    # line, ", " and ": "), as structured outputs' JSON does.
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def _calls_grammar(rules: str, choice: str, opening: str) -> StructuredOutput:
    """A grammar whose ``rules`` define ``calls``: the answer is calls (``required`` or a
    named tool) or, with ``auto``, either calls or a text that does not start with a
    character of ``opening`` (a Lark character class: llguidance's dialect), which keeps
    a text answer from opening as calls do."""
    if choice != "auto":
        return StructuredOutput("grammar", "start: calls\n" + rules)
    return StructuredOutput("grammar", f"start: TEXT | calls\nTEXT: /[^{opening}][\\s\\S]*/\n" + rules)


def _json_answer(schema: dict[str, Any], choice: str, opening: str) -> StructuredOutput:
    """An answer that is the calls' JSON ``schema`` (``required`` or a named tool) or, with
    ``auto``, either that or a text that does not start with a character of ``opening``."""
    if choice != "auto":
        return StructuredOutput("json", schema)
    return _calls_grammar(f"calls: %json {_lark_json(schema)}\n", choice, opening)


def _chosen(tools: list[FunctionSpec], choice: str) -> list[FunctionSpec] | None:
    if choice == "none":
        return None
    if choice in ("auto", "required"):
        return tools
    named = [t for t in tools if t.name == choice]
    assert named, "the server checks that a named tool exists"
    return named


@dataclass
class ParsedCall:
    """One call found in an answer, possibly still arriving (``complete`` False)."""

    name: str | None  # None until the whole name has arrived
    arguments: str  # the arguments' JSON text so far (OpenAI sends them as a string)
    complete: bool


def _name_pattern(key: str) -> re.Pattern[str]:
    return re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"' + key + r'"\s*:\s*')


_NAME = {key: _name_pattern(key) for key in ("arguments", "parameters")}


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


def _scan_call(text: str, pos: int, key: str = "arguments") -> tuple[ParsedCall | None, int | None]:
    """The call object starting at ``pos`` so far (its arguments under ``key``), and where
    it closes (None: not yet)."""
    m = _NAME[key].match(text, pos)
    if m is None:  # the call's name has not all arrived
        return None, None
    name = json.loads(f'"{m.group(1)}"')
    end = _value_end(text, m.end())
    if end is None:
        return ParsedCall(name, text[m.end():], False), None
    close = text.find("}", end)
    return ParsedCall(name, text[m.end():end], True), (close + 1 if close >= 0 else None)


class ToolFormat:
    """One way of writing tool calls: the prompt, the grammar, reading the answer."""

    name: str
    native: bool  # the chat template renders the tools and earlier calls itself
    # The answer's text keeps special tokens (its calls open with one).
    keeps_special_tokens = False

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


def _arguments_parse(calls: list[ParsedCall]) -> bool:
    """Whether every call's arguments are JSON."""
    try:
        for c in calls:
            json.loads(c.arguments)
    except ValueError:
        return False
    return True


def _opens_with(marker: str, head: str) -> bool | None:
    """Whether an answer starting with ``head`` opens with ``marker`` (None: too soon to say)."""
    if head.startswith(marker):
        return True
    return None if marker.startswith(head) else False


class GenericFormat(ToolFormat):
    """kvserve's format: the answer is the calls' JSON (an object, or an array with parallel calls)."""

    name = "generic"
    native = False

    def grammar(self, tools: list[FunctionSpec], choice: str, parallel: bool) -> StructuredOutput | None:
        chosen = _chosen(tools, choice)
        if chosen is None:
            return None
        return _json_answer(calls_schema(chosen, parallel), choice, "\\[{")

    def opens(self, head: str) -> bool | None:
        return head[0] in "{["

    def scan(self, text: str) -> list[ParsedCall] | None:
        if not text.startswith(("{", "[")):
            return None
        array = text.startswith("[")
        pos, calls = (1 if array else 0), []
        while True:
            call, close = _scan_call(text, pos)
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


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


class HermesFormat(ToolFormat):
    """Calls as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one per line
    (Qwen2.5/Qwen3 and Hermes templates); the template renders tools and history."""

    name = "hermes"
    native = True

    def grammar(self, tools: list[FunctionSpec], choice: str, parallel: bool) -> StructuredOutput | None:
        chosen = _chosen(tools, choice)
        if chosen is None:
            return None
        more = max_calls(chosen, parallel) - 1
        calls = (f'calls: call ("\\n" call){{0,{more}}}\n' if more else "calls: call\n")
        rules = (calls + f'call: "{HERMES_OPEN}\\n" body "\\n{HERMES_CLOSE}"\n'
                 f"body: %json {_lark_json(_call_schema(chosen))}\n")
        return _calls_grammar(rules, choice, "<")

    def opens(self, head: str) -> bool | None:
        return _opens_with(HERMES_OPEN, head)

    def _walk(self, body: str) -> tuple[list[ParsedCall], int]:
        """The calls in ``body`` so far, and where the last closed ``</tool_call>`` ends."""
        calls: list[ParsedCall] = []
        pos = done = 0
        while body.startswith(HERMES_OPEN, pos):
            call, close = _scan_call(body, pos + len(HERMES_OPEN))
            if call is not None:
                calls.append(call)
            tag = _HERMES_END.match(body, close) if close is not None else None
            if tag is None:
                break
            done = tag.end()
            pos = _BLANKS.match(body, done).end()
        return calls, done

    def scan(self, text: str) -> list[ParsedCall] | None:
        if not text or _opens_with(HERMES_OPEN, text) is False:
            return None
        return self._walk(text)[0]

    def parse(self, text: str) -> list[ParsedCall] | None:
        body = text.rstrip()
        calls, done = self._walk(body)
        if not calls or done != len(body) or not all(c.complete for c in calls):
            return None
        return calls if _arguments_parse(calls) else None


_HERMES_END = re.compile(r"\s*" + re.escape(HERMES_CLOSE))
_BLANKS = re.compile(r"\s*")


class Llama3JsonFormat(ToolFormat):
    """Llama 3.1/3.2's JSON calls (vLLM's ``llama3_json``): the answer is one object
    ``{"name": ..., "parameters": {...}}``. Their templates render the tools, an earlier
    turn's call in that JSON and its result as an ``ipython`` turn, and take one call per
    turn, so an answer makes one call."""

    name = "llama3_json"
    native = True
    key = "parameters"

    def grammar(self, tools: list[FunctionSpec], choice: str, parallel: bool) -> StructuredOutput | None:
        chosen = _chosen(tools, choice)
        if chosen is None:
            return None
        return _json_answer(_call_schema(chosen, self.key), choice, "{")

    def opens(self, head: str) -> bool | None:
        return head[0] == "{"

    def scan(self, text: str) -> list[ParsedCall] | None:
        if not text.startswith("{"):
            return None
        call, _ = _scan_call(text, 0, self.key)
        return [call] if call is not None else []

    def parse(self, text: str) -> list[ParsedCall] | None:
        try:
            json.loads(text)
        except ValueError:
            return None
        calls = self.scan(text)
        return calls if calls and calls[0].complete else None


MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
_ALPHANUMERIC = string.ascii_letters + string.digits


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
        return f"<[{self.marker_token}]>" if self.marker_token is not None else json.dumps(MISTRAL_CALLS)

    def grammar(self, tools: list[FunctionSpec], choice: str, parallel: bool) -> StructuredOutput | None:
        chosen = _chosen(tools, choice)
        if chosen is None:
            return None
        schema = {"type": "array", "items": _call_schema(chosen), "minItems": 1,
                  "maxItems": max_calls(chosen, parallel)}
        # (A text answer that may not start with "[" cannot spell the marker out either.)
        return _calls_grammar(f'calls: {self._marker()} " " body\nbody: %json {_lark_json(schema)}\n', choice,
                              "\\[")

    def opens(self, head: str) -> bool | None:
        return _opens_with(MISTRAL_CALLS, head)

    def scan(self, text: str) -> list[ParsedCall] | None:
        if not text or _opens_with(MISTRAL_CALLS, text) is False:
            return None
        rest = text[len(MISTRAL_CALLS):].lstrip()
        # (The generic format reads an array that has begun: never None.)
        return FORMATS["generic"].scan(rest) if rest.startswith("[") else []

    def parse(self, text: str) -> list[ParsedCall] | None:
        if not text.startswith(MISTRAL_CALLS):
            return None
        rest = text[len(MISTRAL_CALLS):].strip()
        return FORMATS["generic"].parse(rest) if rest.startswith("[") else None


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
        chosen = _chosen(tools, choice)
        if chosen is None:
            return None
        args = f"<[{self.args_token}]>" if self.args_token is not None else json.dumps(MISTRAL_ARGS)
        more = max_calls(chosen, parallel) - 1
        rules = ("calls: call" + (f" call{{0,{more}}}" if more else "") + "\n"
                 f"call: {self._marker()} (" + " | ".join(f"fn{i}" for i in range(len(chosen))) + ")\n")
        for i, tool in enumerate(chosen):
            rules += f"fn{i}: {json.dumps(tool.name)} {args} body{i}\nbody{i}: %json {_lark_json(tool.parameters)}\n"
        return _calls_grammar(rules, choice, "\\[")

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
            end = _value_end(args, 0) if args.startswith("{") else None
            calls.append(ParsedCall(name.strip(), args if end is None else args[:end], end is not None))
            tidy = tidy and end is not None and not args[end:].strip()
        return calls, tidy

    def scan(self, text: str) -> list[ParsedCall] | None:
        if not text or _opens_with(MISTRAL_CALLS, text) is False:
            return None
        return self._calls(text)[0]

    def parse(self, text: str) -> list[ParsedCall] | None:
        if not text.startswith(MISTRAL_CALLS):
            return None
        calls, tidy = self._calls(text.rstrip())
        if not calls or not tidy:
            return None
        return calls if _arguments_parse(calls) else None


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (GenericFormat(), HermesFormat(), Llama3JsonFormat(),
                                                      MistralFormat())}
TOOL_PARSERS = ("auto", *FORMATS)


def tool_format_for(parser: str, template_syntax: str | None,
                    encode: Callable[[str], list[int]] | None = None) -> ToolFormat:
    """The format for ``--tool-call-parser`` ``parser``: ``auto`` takes the chat
    template's own syntax (``template_syntax``, e.g. "hermes"; "mistral_v11" is
    Mistral's ``[ARGS]`` syntax) where kvserve reads it, else the generic format.
    ``encode`` (the tokenizer's, without special tokens added) tells whether
    Mistral's markers are single tokens."""
    if parser not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {parser!r}")
    syntax = "mistral" if template_syntax == "mistral_v11" else template_syntax
    name = parser if parser != "auto" else syntax if syntax in FORMATS else "generic"
    if name != "mistral":
        return FORMATS[name]
    marker, args = (encode(MISTRAL_CALLS), encode(MISTRAL_ARGS)) if encode is not None else ([], [])
    marker_token = marker[0] if len(marker) == 1 else None
    # The newer syntax where the template writes it, or the vocabulary has [ARGS] as one
    # token (Mistral's tokenizers from version 11 on, which vLLM reads it by).
    if template_syntax == "mistral_v11" or len(args) == 1:
        return MistralArgsFormat(marker_token, args[0] if len(args) == 1 else None)
    return MistralFormat(marker_token)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _arguments_value(arguments: Any) -> Any:
    # OpenAI sends arguments as a JSON string; templates want the object.
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments


def history_content(tool_calls: list[dict[str, Any]], parallel: bool) -> str:
    """An earlier assistant turn's ``tool_calls`` as the text the generic format gives them."""
    calls = [{"name": c["function"]["name"], "arguments": _arguments_value(c["function"]["arguments"])}
             for c in tool_calls]
    value: Any = calls if parallel or len(calls) > 1 else calls[0]
    return json.dumps(value, ensure_ascii=False)


def template_tool_calls(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An earlier assistant turn's ``tool_calls`` as chat templates read them (arguments as objects)."""
    return [{"id": c.get("id"), "type": "function",
             "function": {"name": c["function"]["name"],
                          "arguments": _arguments_value(c["function"]["arguments"])}}
            for c in tool_calls]


class CallStream:
    """One streamed choice's text, turned into content or into OpenAI's ``delta.tool_calls``.

    Until the answer shows whether it is calls (``ToolFormat.opens``) it holds
    the text back; calls are sent as each call's id, type and name once the name
    has arrived, then its arguments in pieces as they are generated; anything
    else is content.
    """

    def __init__(self, fmt: ToolFormat) -> None:
        self.format = fmt
        self.buffer = ""
        self.mode: str | None = None  # None (undecided), "text" or "calls"
        self._sent: list[list] = []  # per call: [id, length of the arguments sent]

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        """The content to send for ``text`` and the tool-call deltas it completes."""
        self.buffer += text
        if self.mode is None:
            if not self.buffer:
                return "", []
            opens = self.format.opens(self.buffer)
            if opens is None:
                return "", []
            self.mode = "calls" if opens else "text"
            if self.mode == "text":
                return self.buffer, []
        if self.mode == "text":
            return text, []
        deltas = []
        for i, call in enumerate(self.format.scan(self.buffer) or []):
            if i == len(self._sent):
                self._sent.append([self.format.call_id(), 0])
                deltas.append(DeltaToolCall(index=i, id=self._sent[i][0], type="function",
                                            function=DeltaFunction(name=call.name, arguments="")))
            piece = call.arguments[self._sent[i][1]:]
            if piece:
                self._sent[i][1] = len(call.arguments)
                deltas.append(DeltaToolCall(index=i, function=DeltaFunction(arguments=piece)))
        return "", deltas

    def finish(self) -> tuple[str, bool]:
        """At the end: content still held back, and whether the answer was calls."""
        if self.mode != "calls":
            return ("" if self.mode == "text" else self.buffer), False
        return "", self.format.parse(self.buffer) is not None
