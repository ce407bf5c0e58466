"""The ``hermes`` tool-call format: Qwen2.5, Qwen3, Hermes and the chat templates that copy them.

The model's chat template renders ``tools`` itself and writes calls as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one after
another; the template gets ``tools`` and the messages' own ``tool_calls`` and
``tool_call_id``.
"""

from __future__ import annotations

import json
import re

from engine.sampling_params import StructuredOutput
from server.tools.base import (FunctionSpec, ParsedCall, ToolFormat, arguments_parse, call_schema, calls_grammar,
                               chosen_tools, grammar_tag, lark_json, max_calls, opens_with, scan_call)

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_END = re.compile(r"\s*" + re.escape(HERMES_CLOSE))
_BLANKS = re.compile(r"\s*")


class HermesFormat(ToolFormat):
    """Calls as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one per line
    (Qwen2.5/Qwen3 and Hermes templates); the template renders tools and history."""

    name = "hermes"
    native = True

    def grammar(self, tools: list[FunctionSpec], choice: str, parallel: bool) -> StructuredOutput | None:
        chosen = chosen_tools(tools, choice)
        if chosen is None:
            return None
        more = max_calls(chosen, parallel) - 1
        calls = (f'calls: call ("\\n" call){{0,{more}}}\n' if more else "calls: call\n")
        rules = (calls + f'call: "{HERMES_OPEN}\\n" body "\\n{HERMES_CLOSE}"\n'
                 f"body: %json {lark_json(call_schema(chosen))}\n")
        return calls_grammar(rules, choice, "<")

    def opens(self, head: str) -> bool | None:
        return opens_with(HERMES_OPEN, head)

    def _walk(self, body: str) -> tuple[list[ParsedCall], int]:
        """The calls in ``body`` so far, and where the last closed ``</tool_call>`` ends."""
        calls: list[ParsedCall] = []
        pos = done = 0
        while body.startswith(HERMES_OPEN, pos):
            call, close = scan_call(body, pos + len(HERMES_OPEN))
            if call is not None:
                calls.append(call)
            tag = _HERMES_END.match(body, close) if close is not None else None
            if tag is None:
                break
            done = tag.end()
            pos = _BLANKS.match(body, done).end()
        return calls, done

    def scan(self, text: str) -> list[ParsedCall] | None:
        if not text or opens_with(HERMES_OPEN, text) is False:
            return None
        return self._walk(text)[0]

    def parse(self, text: str) -> list[ParsedCall] | None:
        body = text.rstrip()
        calls, done = self._walk(body)
        if not calls or done != len(body) or not all(c.complete for c in calls):
            return None
        return calls if arguments_parse(calls) else None


class OpenAIHarmonyFormat(HermesFormat):
    """gpt-oss's calls (vLLM's ``openai`` parser): harmony messages to ``functions.NAME`` on the
    commentary channel, which the harmony reader (``server.harmony``) passes on in the hermes
    syntax; the chat template renders the tools and earlier calls. ``auto`` is the model's own
    choice (no grammar); ``required`` or a named function is a grammar of the whole answer,
    harmony's tags as their tokens (``tags``: the ids of those that are one token): analysis
    messages, free, then one call as gpt-oss writes it, ``<|channel|>commentary
    to=functions.NAME <|constrain|>json<|message|>`` and the arguments (its ``<|call|>`` ends the
    answer, as the grammar's end does). Where ``<|end|>`` or ``<|start|>`` is not one token an
    analysis message could not end, and the call opens the answer."""

    name = "openai"
    keeps_special_tokens = True
    # The grammar holds the whole answer, its reasoning too (no gate before it: server.answers).
    grammar_reasons = True
    TAGS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>")

    def __init__(self, tags: dict[str, int] | None = None) -> None:
        self.tags = tags or {}

    def _tag(self, tag: str) -> str:
        """``tag`` in the grammar: its token where it is one, else its text."""
        return grammar_tag(tag, self.tags.get(tag))

    def grammar(self, tools: list[FunctionSpec], choice: str, parallel: bool) -> StructuredOutput | None:
        if choice in ("auto", "none"):
            return None
        t = self._tag
        bodies = " | ".join(f'{json.dumps(f.name + " ")} {t("<|constrain|>")} "json" {t("<|message|>")} '
                            f"%json {lark_json(f.parameters)}" for f in chosen_tools(tools, choice))
        rules = f'call: {t("<|channel|>")} "commentary to=functions." ({bodies})\n'
        if all(tag in self.tags for tag in ("<|end|>", "<|start|>")):
            return StructuredOutput("grammar", "start: analysis* call\n" + rules +
                                    f'analysis: {t("<|channel|>")} "analysis" {t("<|message|>")} TEXT '
                                    f'{t("<|end|>")} {t("<|start|>")} "assistant"\nTEXT: /(?s:.*)/\n')
        return StructuredOutput("grammar", "start: call\n" + rules)
