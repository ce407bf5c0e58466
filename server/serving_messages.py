"""``/v1/messages``: Anthropic's Messages API, streaming or not, on the chat path.

The request is translated into a chat request (``server.anthropic_api``), run
as one, and its answer rendered as content blocks. Streamed, it is Anthropic's
events (``event: <type>`` lines): ``message_start``, per block
``content_block_start``, its ``content_block_delta`` events (``text_delta``,
``thinking_delta``, ``input_json_delta``) and ``content_block_stop``, then
``message_delta`` (the stop reason and usage) and ``message_stop``; a failure
after the start is an ``error`` event.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.outputs import RequestOutput
from server.anthropic_api import (AnthropicUsage, MessagesRequest, anthropic_error, messages_params, new_block_id,
                                  stop_reason)
from server.answers import AnswerReader
from server.body import read_model
from server.chat_input import prepare_chat
from server.errors import APIError
from server.protocol_chat import render_prompt
from server.protocol_responses import DeltaToolCall
from server.driver import First, Job, Renderer, respond
from server.serving_common import Choices
from server.state import ServerState


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a Messages request without ``max_tokens``."""

    max_tokens: int = 1


async def count_message_tokens(state: ServerState, request: Request) -> Response:
    """The prompt's token count, as the Messages request would run it."""
    try:
        body = await read_model(request, CountTokensRequest)
        state.check_model(body.model)
        chat = body.chat_request()
        with messages_params():
            prompt = render_prompt(state.engine.tokenizer, chat, state.tool_format)
    except APIError as e:
        return JSONResponse(anthropic_error(e), status_code=e.status_code, headers=e.headers)
    return JSONResponse({"input_tokens": len(prompt)})


async def create_message(state: ServerState, request: Request) -> Response:
    """Validate, run and render one Messages request; errors in Anthropic's shape."""
    try:
        return await _create_message(state, request)
    except APIError as e:
        return JSONResponse(anthropic_error(e), status_code=e.status_code, headers=e.headers)


def answer_blocks(reasoning: str | None, text: str, calls: list | None) -> list[dict[str, Any]]:
    """A finished answer's content blocks: its thinking, its text, its tool uses."""
    blocks: list[dict[str, Any]] = []
    if reasoning is not None:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if calls is None and (text or reasoning is None):  # (an answer of calls is all calls)
        blocks.append({"type": "text", "text": text})
    for c in calls or []:
        blocks.append({"type": "tool_use", "id": new_block_id("toolu"), "name": c.name,
                       "input": json.loads(c.arguments)})
    return blocks


async def _create_message(state: ServerState, request: Request) -> Response:
    body = await read_model(request, MessagesRequest)
    model = state.check_model(body.model)
    chat = body.chat_request()
    with messages_params():
        params, reader, prompt = prepare_chat(state, state.with_model_defaults(chat))
    job = Job(new_block_id("msg"), model, [prompt], params,
              {"prompt": "messages", "max_tokens": "max_tokens", "structured": "tools"}, bool(body.stream))
    return await respond(state, request, job, MessageRenderer(job, reader))


class MessageRenderer(Renderer):
    """An Anthropic message: content blocks, or their stream of typed events."""

    done = None  # Anthropic's stream ends with message_stop

    def __init__(self, job: Job, reader: AnswerReader) -> None:
        super().__init__(Choices([len(job.prompts[0])], 1))
        self.job, self.reader = job, reader
        self.answer = reader.stream()
        self.events: MessageEvents | None = None  # made with the first delta (its cached tokens)

    def whole(self) -> Response:
        st = self.choices.states[0]
        reasoning, text, calls = self.reader.whole("".join(st.text))
        reason, sequence = stop_reason(st.finish_reason, st.stop_reason, calls is not None)
        return JSONResponse({"id": self.job.request_id, "type": "message", "role": "assistant",
                             "model": self.job.model, "content": answer_blocks(reasoning, text, calls),
                             "stop_reason": reason, "stop_sequence": sequence,
                             "usage": AnthropicUsage.of(self.choices.usage()).model_dump()})

    def prelude(self, first: First) -> Iterator[str]:
        self.events = MessageEvents(self.job.request_id, self.job.model, len(self.job.prompts[0]),
                                    first[1].num_cached_tokens if first else 0)
        return self.events.start()

    def delta(self, prompt_index: int, ro: RequestOutput) -> Iterator[str]:
        assert self.events is not None, "the prelude comes first"
        for _, out, finished in self.choices.update(prompt_index, ro):
            reasoning, text, calls = self.answer.feed(out.text, finished)
            if reasoning:
                yield from self.events.thinking(reasoning)
            if text:
                yield from self.events.text(text)
            for call in calls:
                yield from self.events.call(call)

    def epilogue(self) -> Iterator[str]:
        assert self.events is not None, "the prelude comes first"
        st = self.choices.states[0]
        yield from self.events.finish(*stop_reason(st.finish_reason, st.stop_reason, self.answer.were_calls),
                                      self.choices.usage().completion_tokens)

    def error(self, error: APIError) -> Iterator[str]:
        assert self.events is not None, "the prelude comes first"
        return self.events.failed(error)


class MessageEvents:
    """The stream events of one message: blocks opened, filled and closed in order."""

    def __init__(self, message_id: str, model: str, input_tokens: int, cached_tokens: int) -> None:
        self.message = {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
                        "stop_reason": None, "stop_sequence": None,
                        "usage": {"input_tokens": input_tokens, "output_tokens": 0,
                                  "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}}
        self.index = -1  # the open block's
        self.open: str | None = None  # its type
        self.opened_any = False

    @staticmethod
    def _event(kind: str, payload: dict[str, Any]) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"

    def start(self) -> Iterator[str]:
        yield self._event("message_start", {"message": self.message})

    def _begin(self, block: dict[str, Any]) -> Iterator[str]:
        yield from self._close()
        self.index += 1
        self.open, self.opened_any = block["type"], True
        yield self._event("content_block_start", {"index": self.index, "content_block": block})

    def _close(self) -> Iterator[str]:
        if self.open is not None:
            self.open = None
            yield self._event("content_block_stop", {"index": self.index})

    def _delta(self, delta: dict[str, Any]) -> str:
        return self._event("content_block_delta", {"index": self.index, "delta": delta})

    def thinking(self, piece: str) -> Iterator[str]:
        if self.open != "thinking":
            yield from self._begin({"type": "thinking", "thinking": "", "signature": ""})
        yield self._delta({"type": "thinking_delta", "thinking": piece})

    def text(self, piece: str) -> Iterator[str]:
        if self.open != "text":
            yield from self._begin({"type": "text", "text": ""})
        yield self._delta({"type": "text_delta", "text": piece})

    def call(self, delta: DeltaToolCall) -> Iterator[str]:
        """A piece of a call: its id and name open a ``tool_use`` block, its input follows."""
        if delta.id is not None:
            tool_id = "toolu_" + delta.id.removeprefix("call_")
            yield from self._begin({"type": "tool_use", "id": tool_id, "name": delta.function.name, "input": {}})
        if delta.function.arguments:
            yield self._delta({"type": "input_json_delta", "partial_json": delta.function.arguments})

    def finish(self, reason: str, sequence: str | None, output_tokens: int) -> Iterator[str]:
        if not self.opened_any:
            yield from self._begin({"type": "text", "text": ""})  # an empty answer: one empty text block
        yield from self._close()
        yield self._event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                            "usage": {"output_tokens": output_tokens}})
        yield self._event("message_stop", {})

    def failed(self, error: APIError) -> Iterator[str]:
        yield self._event("error", {"error": anthropic_error(error)["error"]})
