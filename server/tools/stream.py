"""A streamed answer read as it arrives, for any tool-call format: content or ``delta.tool_calls``."""

from __future__ import annotations

from server.protocol_responses import DeltaFunction, DeltaToolCall
from server.tools.base import ToolFormat


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
