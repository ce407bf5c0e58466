"""How an answer's text is read, the same for chat, the Responses and the Messages APIs.

A thinking model's reasoning comes off first (``server.reasoning``, with
``--reasoning-parser``); what follows it is content or, where the request
can call tools, tool calls (``server.tools``). ``plan_answer`` decides this
for one request; ``AnswerReader.whole`` reads a finished answer and
``AnswerStream`` one arriving in pieces.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from server.protocol_responses import DeltaToolCall
from server.reasoning import ReasoningFormat
from server.state import ServerState
from server.tools import CallStream, ParsedCall, ToolFormat


@dataclass(frozen=True)
class AnswerReader:
    """``thinking``: the reasoning format to split off (None: all content), with
    ``trim`` the blanks after the block too (a constrained answer's grammar let them
    through); ``calls``: the tool format, where the request can call tools."""

    thinking: ReasoningFormat | None = None
    trim: bool = False
    calls: ToolFormat | None = None

    def whole(self, text: str) -> tuple[str | None, str, list[ParsedCall] | None]:
        """A finished answer as ``(reasoning, content, calls)``: reasoning None where
        there is none, calls None unless the content is calls."""
        reasoning, text = self.thinking.split(text, self.trim) if self.thinking is not None else (None, text)
        return reasoning, text, (self.calls.parse(text) if self.calls is not None else None)

    def stream(self) -> "AnswerStream":
        return AnswerStream(self)


class AnswerStream:
    """One answer read piece by piece (``AnswerReader.whole``'s streamed twin)."""

    def __init__(self, reader: AnswerReader) -> None:
        self.thought = reader.thinking.stream(reader.trim) if reader.thinking is not None else None
        self.calls = CallStream(reader.calls) if reader.calls is not None else None
        self.were_calls = False  # at the end: whether the content was calls

    @property
    def deciding(self) -> bool:
        """Content is held back until it shows whether it is text or calls."""
        return self.calls is not None and self.calls.mode is None

    @property
    def in_calls(self) -> bool:
        return self.calls is not None and self.calls.mode == "calls"

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[DeltaToolCall]]:
        """``(reasoning, content, call deltas)`` to send for ``text``; ``finished`` at the
        answer's last piece, which also sends what was held back."""
        reasoning = ""
        if self.thought is not None:
            reasoning, text = self.thought.feed(text)
            if finished:
                more, rest = self.thought.finish()
                reasoning, text = reasoning + more, text + rest
        calls: list[DeltaToolCall] = []
        if self.calls is not None:
            text, calls = self.calls.feed(text)
            if finished:
                rest, self.were_calls = self.calls.finish()
                text += rest
        return reasoning, text, calls


def plan_answer(state: ServerState, params: SamplingParams, tool_format: ToolFormat | None
                ) -> tuple[SamplingParams, AnswerReader]:
    """How one request's answer is read, and its params to match: with
    ``--reasoning-parser`` a constrained answer's grammar waits out the reasoning
    block where its markers are single tokens (then the blanks after it are trimmed),
    and holds from the first token where they are not (then nothing is split off); a
    tool format whose calls' grammar holds the reasoning too (``grammar_reasons``) is read
    as a free answer is. ``tool_format``: the request can call tools in it."""
    reasoning = state.reasoning
    if reasoning is None:
        return params, AnswerReader(None, False, tool_format)
    gated = params.structured is not None and not (tool_format is not None and tool_format.grammar_reasons)
    if gated and state.think_tokens is None:
        return params, AnswerReader(None, False, tool_format)  # (the grammar holds from the first token)
    if reasoning.keeps_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)  # (harmony's tags)
    if not gated:
        return params, AnswerReader(reasoning, False, tool_format)
    return dataclasses.replace(params, think=state.think_tokens), AnswerReader(reasoning, True, tool_format)
