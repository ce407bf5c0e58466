"""A terminal chat client that streams replies from a running kvserve server.

``kvserve chat --url http://127.0.0.1:8000`` keeps the conversation in memory
and sends it whole each turn; ``/exit`` (or end of input) quits.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

import httpx

EXIT_COMMANDS = frozenset({"/exit", "/quit"})


class ChatError(RuntimeError):
    """The server refused the request or failed mid-reply."""


def iter_sse_data(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON payloads of an SSE stream's ``data:`` lines, up to ``[DONE]``.

    Raises ``ChatError`` for an in-stream error event.
    """
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        payload = json.loads(data)
        if "error" in payload:
            raise ChatError(payload["error"].get("message", "server error"))
        yield payload


class ChatSession:
    """One conversation with the server; ``send`` streams a reply and records it."""

    def __init__(self, url: str, *, api_key: str | None = None, system: str | None = None,
                 model: str | None = None, temperature: float | None = None,
                 client: httpx.Client | None = None) -> None:
        self.url = url.rstrip("/") + "/v1/chat/completions"
        self.model = model
        self.temperature = temperature
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No read timeout: the first token can take long on a busy CPU server, and
        # a fixed cap would cut off legitimate replies.
        self.client = client or httpx.Client(timeout=httpx.Timeout(10.0, read=None))
        self.client.headers.update(headers)
        self.messages: list[dict[str, str]] = []
        if system:
            self.messages.append({"role": "system", "content": system})

    def send(self, text: str, on_delta: Callable[[str], None],
             on_reasoning: Callable[[str], None] | None = None) -> str:
        """Send one user turn; ``on_delta`` sees the reply as it streams (``on_reasoning``
        a thinking model's reasoning, where the server splits it off: ``--reasoning-parser``).
        Returns the reply (without the reasoning)."""
        messages = self.messages + [{"role": "user", "content": text}]
        body: dict[str, Any] = {"messages": messages, "stream": True}
        if self.model:
            body["model"] = self.model
        if self.temperature is not None:
            body["temperature"] = self.temperature
        parts: list[str] = []
        with self.client.stream("POST", self.url, json=body) as response:
            if response.status_code != 200:
                response.read()
                try:
                    message = response.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = response.text
                raise ChatError(f"HTTP {response.status_code}: {message}")
            for chunk in iter_sse_data(response.iter_lines()):
                for choice in chunk.get("choices", []):
                    thought = choice.get("delta", {}).get("reasoning_content")
                    if thought and on_reasoning is not None:
                        on_reasoning(thought)
                    delta = choice.get("delta", {}).get("content")
                    if delta:
                        parts.append(delta)
                        on_delta(delta)
        reply = "".join(parts)
        # Only a completed exchange joins the history, so a failed turn can be retried.
        self.messages = messages + [{"role": "assistant", "content": reply}]
        return reply


def run(session: ChatSession, *, input_fn: Callable[[str], str] = input,
        out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """The read-send-print loop. Returns the process exit code."""
    while True:
        try:
            line = input_fn("you> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text in EXIT_COMMANDS:
            return 0
        out.write("assistant> ")
        out.flush()

        thinking = False  # inside the reasoning's "(thinking) ..." line

        def show(delta: str) -> None:
            nonlocal thinking
            if thinking:
                out.write("\n")
                thinking = False
            out.write(delta)
            out.flush()

        def think(delta: str) -> None:
            nonlocal thinking
            if not thinking:
                out.write("(thinking) ")
                thinking = True
            out.write(delta)
            out.flush()

        try:
            session.send(text, show, think)
        except (ChatError, httpx.HTTPError) as e:
            err.write(f"\nerror: {e}\n")
        out.write("\n")
