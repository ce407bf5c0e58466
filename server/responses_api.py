"""OpenAI's Responses API (``/v1/responses``): the request, its items, the response.

A Responses request is a chat in other words. ``instructions`` and the
``input`` items become chat messages, flat function tools become chat tools,
``text.format`` becomes a response format; ``ResponsesRequest.chat_request``
makes that translation, so the prompt, the tool grammar and the sampling
parameters come from the chat path alone. The answer goes back as output
items: a ``reasoning`` item where a reasoning parser found one, then one
assistant ``message`` with an ``output_text`` part, or one ``function_call``
item per call (``server.responses_output``). Stored responses are
``server.response_store``'s.
"""

from __future__ import annotations

import secrets
from contextlib import AbstractContextManager
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from engine.sampling_params import MAX_LOGPROBS
from server.body import validate
from server.errors import bad_request, renamed_params
from server.protocol import _Exact, _Strict
from server.protocol_chat import ChatCompletionRequest

# What a Responses body field is called in the chat body it is translated into,
# so that an error found on the chat side names the field the client sent.
_CHAT_TO_RESPONSES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                      "max_tokens": "max_output_tokens", "response_format": "text.format",
                      "reasoning_effort": "reasoning.effort"}

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def new_item_id(prefix: str) -> str:
    """An id in OpenAI's style: ``resp_...``, ``msg_...``, ``fc_...``."""
    return f"{prefix}_{secrets.token_hex(16)}"


# --- the request ------------------------------------------------------------

class TextPart(_Strict):
    """A content part; only text (``input_text``, or ``output_text`` sent back)."""

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> "TextPart":
        if self.type not in ("input_text", "output_text") or self.text is None:
            raise ValueError(f"only input_text and output_text content parts are supported, "
                             f"got type {self.type!r}")
        return self


def _text(content: str | list[TextPart]) -> str:
    # NOTE: parts are joined with newlines, as chat content parts are.
    return content if isinstance(content, str) else "\n".join(p.text or "" for p in content)


class MessageItem(_Strict):
    """A message: the client's turns, or an earlier answer sent back."""

    type: Literal["message"] = "message"
    id: str | None = None  # an earlier answer's item id (GET .../input_items lists it)
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    def item(self) -> dict[str, Any]:
        """As an input item of ``GET /v1/responses/{id}/input_items``."""
        kind = "output_text" if self.role == "assistant" else "input_text"
        parts = ([{"type": kind, "text": self.content}] if isinstance(self.content, str)
                 else [p.model_dump(exclude_none=True) for p in self.content])
        return {"id": self.id or new_item_id("msg"), "type": "message", "role": self.role,
                "status": "completed", "content": parts}


class FunctionCallItem(_Strict):
    """An earlier answer's function call, sent back."""

    type: Literal["function_call"]
    id: str | None = None
    call_id: str
    name: str
    arguments: str  # JSON text

    def item(self) -> dict[str, Any]:
        return {**self.model_dump(), "id": self.id or new_item_id("fc"), "status": "completed"}


class FunctionCallOutputItem(_Strict):
    """The result of a function call, for the model to read."""

    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: str | list[TextPart]

    def item(self) -> dict[str, Any]:
        return {**self.model_dump(exclude_none=True), "id": self.id or new_item_id("fco"), "status": "completed"}


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Strict):
    """An earlier answer's reasoning, sent back: the next assistant turn's ``reasoning_content``."""

    type: Literal["reasoning"]
    id: str | None = None
    content: list[ReasoningText] | None = None
    summary: list[Any] | None = None  # kvserve writes none; a client's own is not the model's text

    def text(self) -> str:
        return "".join(part.text for part in self.content or [])

    def item(self) -> dict[str, Any]:
        return {"id": self.id or new_item_id("rs"), "type": "reasoning", "summary": self.summary or [],
                "content": [part.model_dump() for part in self.content or []]}


def _item_type(item: Any) -> str:
    # An item without a type is a message ("easy input message").
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="invalid_item",
                  custom_error_message="input items must be of type message, function_call, "
                                       "function_call_output or reasoning (text only)")]


class FunctionTool(_Strict):
    """A Responses tool: flat, ``{"type": "function", "name", "description", "parameters"}``."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # kvserve always enforces the parameters

    @model_validator(mode="after")
    def _functions_only(self) -> "FunctionTool":
        if self.type != "function":
            raise ValueError(f"only function tools are supported, got type {self.type!r}")
        if self.name is None:
            raise ValueError("a function tool needs a name")
        return self

    def chat(self) -> dict[str, Any]:
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters,
              "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}

    def echo(self) -> dict[str, Any]:
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict}


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Exact):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (flat, unlike chat's)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # kvserve always enforces the schema

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> "TextFormat":
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError("schema is required with type json_schema, and only with it")
        return self

    def chat(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name or "response", "schema": self.schema_, "strict": self.strict,
                "description": self.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(_Strict):
    """``POST /v1/responses``: OpenAI's fields, and vLLM's sampling extras."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None  # its effort: the chat template's reasoning_effort (echoed)
    user: str | None = None
    # vLLM's extras, as in chat.
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    priority: int | None = None  # vLLM's: lower is admitted first (--scheduling-policy priority)
    cache_salt: str | None = None  # vLLM's: prefix-cache hits only among requests of the same salt

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        # Each of these changes what the answer is; ignoring it would answer something
        # else than was asked, so it is a 400 that says what to do instead.
        if isinstance(data, dict):
            refused = {
                "conversation": "conversations are not supported; send the earlier turns in input, "
                                "or previous_response_id",
                "prompt": "prompt templates are not supported; send the prompt in input",
            }
            for name, why in refused.items():
                if data.get(name) is not None:
                    raise bad_request(why, name)
            if data.get("background") is True:
                raise bad_request("background responses are not supported", "background")
            if data.get("truncation") == "auto":
                raise bad_request("truncation auto is not supported: an input over the context is "
                                  "a 400; shorten it, or leave truncation disabled", "truncation")
        return data

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_range(cls, value: int | None) -> int | None:
        # Checked here too: without include it reaches no sampling parameter.
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {value}")
        return value

    @field_validator("input")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if value == "" or value == []:
            raise ValueError("input must not be empty")
        return value

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    def input_items(self) -> list[dict[str, Any]]:
        """The input as OpenAI's input items, each with an id (the client's where it sent
        one): what ``GET /v1/responses/{id}/input_items`` lists."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input).item()]
        return [item.item() for item in self.input]

    def input_messages(self) -> list[dict[str, Any]]:
        """The input items as chat messages: consecutive function calls become one
        assistant turn with ``tool_calls`` (joined to the assistant text before them),
        their outputs ``tool`` messages."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        reasoning: str | None = None  # a reasoning item's text, for the assistant turn after it

        def assistant(turn: dict[str, Any]) -> dict[str, Any]:
            nonlocal reasoning
            if reasoning is not None:
                turn["reasoning_content"], reasoning = reasoning, None
            return turn

        for item in self.input:
            if isinstance(item, ReasoningItem):
                reasoning = (reasoning or "") + item.text()
            elif isinstance(item, MessageItem):
                turn = {"role": item.role, "content": _text(item.content)}
                out.append(assistant(turn) if item.role == "assistant" else turn)
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and reasoning is None:
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append(assistant({"role": "assistant", "content": None, "tool_calls": [call]}))
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        return out

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this one means, after the ``history`` of an earlier
        response (``previous_response_id``); a 400 names this API's field."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) \
            + history + self.input_messages()
        choice = self.tool_choice
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream,
            "logprobs": self.wants_logprobs,
            "top_logprobs": self.top_logprobs if self.wants_logprobs else None,
            "tools": [t.chat() for t in self.tools] if self.tools else None,
            "tool_choice": ({"type": "function", "function": {"name": choice.name}}
                            if isinstance(choice, FunctionChoice) else choice),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.text.format.chat() if self.text and self.text.format else None,
            "seed": self.seed, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "stop": self.stop, "priority": self.priority,
            "cache_salt": self.cache_salt,
            "reasoning_effort": (self.reasoning or {}).get("effort"),
        }
        with responses_params():
            return validate(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})


def input_items_page(items: list[dict[str, Any]], limit: int, order: str, after: str | None) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: a page of ``items`` (oldest first), OpenAI's
    list shape. ``order`` ``desc`` (OpenAI's default) lists the newest first; ``after``:
    the id of the item the page starts after. A bad ``limit``, ``order`` or ``after`` is a 400."""
    if not 1 <= limit <= 100:
        raise bad_request(f"limit must be between 1 and 100, got {limit}", "limit")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be asc or desc, got {order!r}", "order")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad_request(f"No input item with id '{after}' in this response", "after")
        start = ids.index(after) + 1
    page = ordered[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(ordered)}


def responses_params() -> AbstractContextManager[None]:
    """Rename the chat field a 400 raised inside names to this API's field."""
    return renamed_params(_CHAT_TO_RESPONSES)
