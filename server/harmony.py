"""gpt-oss's harmony response format: an answer's analysis channel, final channel and calls.

A harmony answer is a run of messages, each a header, ``<|message|>``, a body and an
end tag; the prompt ends at ``<|start|>assistant``, so the first header is the channel
alone::

    <|channel|>analysis<|message|>Let me see.<|end|><|start|>assistant<|channel|>final<|message|>Hello!

The analysis channel is the model's reasoning (``reasoning_content``); the final channel,
and the commentary channel's preambles to the user, are content. A message to a function
(a header with ``to=functions.NAME``, before or after its channel) is a tool call: it goes
on as content in the ``hermes`` call syntax (``<tool_call>``, a newline, ``{"name": NAME,
"arguments": ARGS}``, a newline, ``</tool_call>``), which the ``openai`` tool format reads
(``server.tools.hermes``). The tags are the tokenizer's special tokens, so an answer read
this way is decoded with them (``ReasoningFormat.keeps_special_tokens``). Text with no
header (a model that ignores the format) is content, as it came.
"""

from __future__ import annotations

import json
import re

MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
# A header opens a message (after the prompt's <|start|>assistant: its channel, or its recipient).
HEADER_STARTS = ("<|start|>", CHANNEL, " to=")
_FUNCTION = re.compile(r"to=functions\.([^\s<]+)")
# A body ends at the end of its message, of the answer, or at a tool call.
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
# A header longer than this with no <|message|> is not one: it goes out as content.
_MAX_HEADER = 256


def partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could start one of ``tags`` (the text a
    reader holds back: here and in ``server.reasoning``'s ``<think>`` reader)."""
    for k in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-k:]) for tag in tags):
            return k
    return 0


def _call_opening(header: str) -> str | None:
    """A call's opening in the hermes syntax where the header sends the message to a
    function, else None."""
    to = _FUNCTION.search(header)
    return None if to is None else '<tool_call>\n{"name": ' + json.dumps(to[1]) + ', "arguments": '


CALL_CLOSING = "}\n</tool_call>"


def _channel(header: str) -> str:
    """The channel a header names ("" for none): the word after ``<|channel|>``."""
    at = header.rfind(CHANNEL)
    if at < 0:
        return ""
    rest = header[at + len(CHANNEL):]
    return rest.split("<|", 1)[0].split(" ", 1)[0].strip()


class HarmonyStream:
    """One harmony answer fed piece by piece, split into reasoning and content pieces
    (``server.reasoning.ReasoningStream``'s interface). Tags never go out, in whole or in
    part: text that could still be one is held back until the next piece shows what it is."""

    def __init__(self) -> None:
        self.reasoned = False  # an analysis message has begun
        self._header: str | None = ""  # a header being read (None: inside a body)
        self._to_reasoning = False  # the body's channel is analysis
        self._in_call = False  # the body is a call's arguments
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` to send for ``text``."""
        buf, self._held = self._held + text, ""
        reasoning = content = ""
        while buf:
            if self._header is not None:
                header = self._header + buf
                buf = ""
                at = header.find(MESSAGE)
                if at >= 0:
                    opening = _call_opening(header[:at])
                    self._in_call = opening is not None
                    self._to_reasoning = not self._in_call and _channel(header[:at]) == "analysis"
                    self.reasoned = self.reasoned or self._to_reasoning
                    self._header, buf = None, header[at + len(MESSAGE):]
                    content += opening or ""
                elif self._could_be_header(header):
                    self._header = header
                else:  # not a header: content, read as a body's
                    self._header, self._to_reasoning, buf = None, False, header
                continue
            end, tag = min(((buf.find(t), t) for t in BODY_ENDS if t in buf), default=(-1, ""))
            body = buf if end < 0 else buf[:end]
            if end < 0:
                keep = partial_tag(body, BODY_ENDS)
                self._held, body, buf = body[len(body) - keep:], body[:len(body) - keep], ""
            if self._to_reasoning:
                reasoning += body
            else:
                content += body
            if end >= 0:
                buf, self._header = buf[end + len(tag):], ""
                content += self._close_call()
        return reasoning, content

    def _close_call(self) -> str:
        closing, self._in_call = (CALL_CLOSING if self._in_call else ""), False
        return closing

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the answer: a body's last characters (a
        header cut before its ``<|message|>`` is markup, and goes)."""
        held, self._held = self._held, ""
        if self._header is not None:
            header, self._header = self._header, ""
            return "", ("" if self._could_be_header(header) else header)
        if self._to_reasoning:
            return held, ""
        return "", held + self._close_call()  # (a call ends at <|call|>, a stop token: not in the text)

    @staticmethod
    def _could_be_header(text: str) -> bool:
        """Whether ``text`` is, or may grow into, a header: it opens with a header tag (or
        part of one) and is not yet too long to be one."""
        if len(text) > _MAX_HEADER:
            return False
        return any(text.startswith(tag) or tag.startswith(text) for tag in HEADER_STARTS)
