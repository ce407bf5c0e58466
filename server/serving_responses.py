"""``/v1/responses``: OpenAI's Responses API, streaming or not, on the chat path.

The request is translated into a chat request (``server.responses_api``), run
as one, and its answer rendered as output items. Streamed, the answer goes
out as OpenAI's typed events (``event: <type>`` lines, each numbered by
``sequence_number``, no ``[DONE]``): ``response.created``, then per item
``response.output_item.added``, its deltas and ``...done``, then
``response.completed`` (or ``response.incomplete``, or ``response.failed``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.outputs import RequestOutput
from server.answers import AnswerReader
from server.body import read_model
from server.chat_input import prepare_chat
from server.chat_output import chat_logprobs
from server.errors import APIError
from server.protocol_responses import ChatTokenLogprob, DeltaToolCall, Usage, now
from server.response_store import StoredResponse
from server.responses_api import ResponsesRequest, new_item_id, responses_params
from server.responses_output import (OutputFunctionCall, OutputItem, OutputMessage, OutputReasoning,
                                     OutputReasoningText, OutputText, ResponseObject)
from server.driver import First, Job, Renderer, respond
from server.serving_common import Choices
from server.state import ServerState
from server.tools import ToolFormat


def _previous(state: ServerState, body: ResponsesRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The earlier response's conversation (chat messages) and input items with its
    output items after them; none without ``previous_response_id``."""
    if body.previous_response_id is None:
        return [], []
    stored = state.responses.get(body.previous_response_id)
    if stored is None:
        raise APIError(400, f"Previous response with id '{body.previous_response_id}' not found "
                            f"(kvserve keeps the newest {state.responses.capacity} stored responses, "
                            "in memory, per server).",
                       param="previous_response_id", code="previous_response_not_found")
    return stored.conversation, stored.input_items + stored.body.get("output", [])


def answer_items(text: str, calls: list | None, logprobs: list[ChatTokenLogprob], fmt: ToolFormat,
                 reasoning: str | None = None) -> list[OutputItem]:
    """A finished answer's output items: its reasoning, then its calls, else one message."""
    items: list[OutputItem] = []
    if reasoning is not None:
        items.append(OutputReasoning(id=new_item_id("rs"), content=[OutputReasoningText(text=reasoning)]))
    if calls is not None:
        return items + [OutputFunctionCall(id=new_item_id("fc"), call_id=fmt.call_id(), name=c.name,
                                           arguments=c.arguments) for c in calls]
    return items + [OutputMessage(id=new_item_id("msg"), content=[OutputText(text=text, logprobs=logprobs)])]


async def create_response(state: ServerState, request: Request) -> Response:
    """Validate, run and render one Responses request; store it when asked."""
    body = await read_model(request, ResponsesRequest)
    model = state.check_model(body.model)
    history, earlier_items = _previous(state, body)
    chat = body.chat_request(history)
    with responses_params():
        params, reader, prompt = prepare_chat(state, state.with_model_defaults(chat))
    job = Job(new_item_id("resp"), model, [prompt], params,
              {"prompt": "input", "max_tokens": "max_output_tokens",
               "structured": "tools" if reader.calls is not None else "text.format"}, bool(body.stream))
    stored = bool(body.store) and state.responses.capacity > 0
    response = ResponseObject.start(job.request_id, now(), model, body, chat, stored)

    def keep(sent: dict[str, Any]) -> None:
        """Store the response as ``sent``, with the conversation up to it."""
        if stored:
            state.responses.put(job.request_id, StoredResponse(
                sent, history + body.input_messages() + response.conversation(),
                earlier_items + body.input_items()))

    return await respond(state, request, job, ResponseRenderer(state, body, job, reader, response, keep))


class ResponseRenderer(Renderer):
    """A response object, or its stream of numbered typed events; ``keep`` stores what
    was sent (the whole object, or the final one a stream built)."""

    done = None  # the Responses API's stream ends with response.completed (or .incomplete, .failed)

    def __init__(self, state: ServerState, body: ResponsesRequest, job: Job, reader: AnswerReader,
                 response: ResponseObject, keep: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(Choices([len(job.prompts[0])], 1))
        self.tok, self.fmt, self.body, self.reader = state.engine.tokenizer, state.tool_format, body, reader
        self.response, self.keep = response, keep
        self.events = ResponseEvents(response)
        self.answer = reader.stream()
        # Logprobs of text held back until the answer shows whether it is calls: they go
        # out with that text, or nowhere (a function call item has none).
        self.held: list[ChatTokenLogprob] = []

    def whole(self) -> Response:
        st = self.choices.states[0]
        reasoning, text, calls = self.reader.whole("".join(st.text))
        lps = chat_logprobs(self.tok, st.logprobs).content if self.body.wants_logprobs else []
        self.response.output = answer_items(text, calls, lps, self.fmt, reasoning)
        self.response.finish(st.finish_reason, self.choices.usage())
        sent = self.response.model_dump(mode="json")
        self.keep(sent)
        return JSONResponse(sent)

    def prelude(self, first: First) -> Iterator[str]:
        return self.events.start()

    def delta(self, prompt_index: int, ro: RequestOutput) -> Iterator[str]:
        answer, events, held = self.answer, self.events, self.held
        for _, out, finished in self.choices.update(prompt_index, ro):
            reasoning, text, calls = answer.feed(out.text, finished)
            if reasoning:
                yield from events.reasoning(reasoning)
            if self.body.wants_logprobs:
                held.extend(chat_logprobs(self.tok, out.logprobs or []).content)
            if answer.in_calls:
                held.clear()
            elif text or (held and not answer.deciding):
                yield from events.text(text, list(held))
                held.clear()
            for call in calls:
                yield from events.call(call)

    def epilogue(self) -> Iterator[str]:
        yield from self.events.finish(self.choices.states[0].finish_reason, self.choices.usage())
        self.keep(self.response.model_dump(mode="json"))

    def error(self, error: APIError) -> Iterator[str]:
        return self.events.failed(error)


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class ResponseEvents:
    """The stream events of one response, numbered in order; ``response`` holds the
    output so far (every event that carries an item or the response shows it)."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.sequence = 0
        self.open_reasoning: OutputReasoning | None = None  # the open reasoning item
        self.open_message: OutputMessage | None = None  # the open message item
        self.open_call: OutputFunctionCall | None = None  # the open function call item

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, **{k: _plain(v) for k, v in fields.items()}, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _index(self, item: OutputItem) -> int:
        return self.response.output.index(item)

    def _add(self, item: OutputItem) -> str:
        self.response.output.append(item)
        return self._event("response.output_item.added", output_index=self._index(item), item=item)

    def start(self) -> Iterator[str]:
        yield self._event("response.created", response=self.response)
        yield self._event("response.in_progress", response=self.response)

    def _open_part(self, item: OutputReasoning | OutputMessage,
                   part: OutputReasoningText | OutputText) -> Iterator[str]:
        """Add ``item`` with its one content ``part`` (still empty)."""
        yield self._add(item)
        item.content.append(part)  # type: ignore[arg-type]
        yield self._event("response.content_part.added", item_id=item.id, output_index=self._index(item),
                          content_index=0, part=part)

    def _close_part(self, item: OutputReasoning | OutputMessage, done: str, **fields: Any) -> Iterator[str]:
        """``item``'s ``done`` event (its text, and ``fields``), its part's and its own."""
        part, index = item.content[0], self._index(item)
        yield self._event(done, item_id=item.id, output_index=index, content_index=0, text=part.text, **fields)
        yield self._event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                          part=part)
        yield self._event("response.output_item.done", output_index=index, item=item)

    def reasoning(self, delta: str) -> Iterator[str]:
        """Reasoning text, into the reasoning item (opened at the first piece)."""
        if self.open_reasoning is None:
            self.open_reasoning = OutputReasoning(id=new_item_id("rs"))
            yield from self._open_part(self.open_reasoning, OutputReasoningText())
        self.open_reasoning.content[0].text += delta
        yield self._event("response.reasoning_text.delta", item_id=self.open_reasoning.id,
                          output_index=self._index(self.open_reasoning), content_index=0, delta=delta)

    def _close_reasoning(self) -> Iterator[str]:
        item, self.open_reasoning = self.open_reasoning, None
        if item is None:
            return
        if item.status == "in_progress":
            item.status = "completed"
        yield from self._close_part(item, "response.reasoning_text.done")

    def text(self, delta: str, logprobs: list[ChatTokenLogprob]) -> Iterator[str]:
        """Answer text (and its tokens' logprobs), into the message item (opened at the first)."""
        if self.open_message is None:
            yield from self._close_reasoning()
            yield from self._close_call("completed")
            self.open_message = OutputMessage(id=new_item_id("msg"))
            yield from self._open_part(self.open_message, OutputText())
        part = self.open_message.content[0]
        part.text += delta
        part.logprobs.extend(logprobs)
        yield self._event("response.output_text.delta", item_id=self.open_message.id,
                          output_index=self._index(self.open_message), content_index=0, delta=delta,
                          logprobs=logprobs)

    def call(self, delta: DeltaToolCall) -> Iterator[str]:
        """A piece of a call: its id and name open an item, arguments follow in pieces."""
        if delta.id is not None:
            yield from self._close_reasoning()
            yield from self._close_call("completed")
            self.open_call = OutputFunctionCall(id=new_item_id("fc"), call_id=delta.id,
                                           name=delta.function.name or "")
            yield self._add(self.open_call)
        assert self.open_call is not None, "a call's arguments come after its name"
        piece = delta.function.arguments
        if piece:
            self.open_call.arguments += piece
            yield self._event("response.function_call_arguments.delta", item_id=self.open_call.id,
                              output_index=self._index(self.open_call), delta=piece)

    def _close_call(self, status: str) -> Iterator[str]:
        call, self.open_call = self.open_call, None
        if call is None:
            return
        call.status = status  # type: ignore[assignment]
        yield self._event("response.function_call_arguments.done", item_id=call.id,
                          output_index=self._index(call), arguments=call.arguments)
        yield self._event("response.output_item.done", output_index=self._index(call), item=call)

    def _close_message(self) -> Iterator[str]:
        message, self.open_message = self.open_message, None
        if message is not None:
            yield from self._close_part(message, "response.output_text.done", logprobs=message.content[0].logprobs)

    def finish(self, finish_reason: str | None, usage: Usage) -> Iterator[str]:
        """Close the open item and send the final response (an answer with no message or
        call, reasoning or not, gets an empty message)."""
        if not any(not isinstance(item, OutputReasoning) for item in self.response.output):
            yield from self.text("", [])
        self.response.finish(finish_reason, usage)
        status = "completed" if self.response.status == "completed" else "incomplete"
        yield from self._close_reasoning()
        yield from self._close_message()
        yield from self._close_call(status)
        yield self._event(f"response.{self.response.status}", response=self.response)

    def failed(self, error: APIError) -> Iterator[str]:
        """The answer could not be finished: ``response.failed`` with the error."""
        self.response.status = "failed"
        self.response.error = {"code": "server_error", "message": error.message}
        for item in self.response.output:
            if item.status == "in_progress":
                item.status = "incomplete"
        yield self._event("response.failed", response=self.response)
