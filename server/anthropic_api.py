"""Anthropic's Messages API (``/v1/messages``): the request, and its translation into chat.

Like the Responses API (``server.responses_api``), a Messages request is a chat
in other words: ``system`` is a system message, each message's content blocks
become chat turns (``tool_use`` blocks an assistant turn's ``tool_calls``,
``tool_result`` blocks ``tool`` messages, ``thinking`` blocks its
``reasoning_content``), tools with an ``input_schema`` become chat tools. The
answer goes back as content blocks: ``thinking`` (with a reasoning parser),
then ``text``, or ``tool_use`` per call. Errors use Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import secrets
from contextlib import AbstractContextManager
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from server.body import validate
from server.errors import APIError, renamed_params
from server.protocol import _Strict
from server.protocol_chat import ChatCompletionRequest
from server.protocol_responses import Usage

# Anthropic's error type for an HTTP status (the rest are api_error).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}

# The chat field a 400 names, as this API calls it.
_CHAT_TO_MESSAGES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
                     "response_format": "messages", "parallel_tool_calls": "tool_choice",
                     "continue_final_message": "messages"}


def anthropic_error(error: APIError) -> dict[str, Any]:
    """``error`` in Anthropic's shape."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status_code, "api_error"),
                                       "message": error.message}}


def new_block_id(prefix: str) -> str:
    """``msg_...``, ``toolu_...``: ids in Anthropic's style."""
    return f"{prefix}_{secrets.token_hex(12)}"


class Block(_Strict):
    """A content block: ``text``, ``tool_use``, ``tool_result`` or ``thinking``; others are a 400."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list["Block"] | None = None
    is_error: bool | None = None
    thinking: str | None = None

    @model_validator(mode="after")
    def _known(self) -> "Block":
        needs = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",),
                 "thinking": ("thinking",), "redacted_thinking": ()}
        if self.type not in needs:
            raise ValueError(f"content blocks of type {self.type!r} are not supported (text, tool_use, "
                             "tool_result and thinking are)")
        missing = [f for f in needs[self.type] if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type} block needs {', '.join(missing)}")
        if isinstance(self.content, list) and (self.type != "tool_result"
                                               or any(b.type != "text" for b in self.content)):
            raise ValueError("only a tool_result block has content blocks, and only text ones")
        return self

    def result_text(self) -> str:
        """A tool result's content as text (text blocks joined)."""
        if isinstance(self.content, list):
            return "\n".join(b.text or "" for b in self.content if b.type == "text")
        text = self.content or ""
        return f"Error: {text}" if self.is_error else text


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Strict):
    """A client tool: ``name``, ``description``, ``input_schema``; server tools are a 400."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None

    @model_validator(mode="after")
    def _client_tool(self) -> "Tool":
        if self.type not in (None, "custom"):
            raise ValueError(f"only client tools (with an input_schema) are supported, got type {self.type!r}")
        if self.input_schema is None:
            raise ValueError(f"tool {self.name!r} needs an input_schema")
        return self


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(_Strict):
    """``POST /v1/messages``."""

    model: str | None = None
    max_tokens: int
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None  # accepted and ignored
    thinking: dict[str, Any] | None = None  # accepted: a thinking model thinks as its template says

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages."""
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "\n".join(b.text or "" for b in self.system)
            out.append({"role": "system", "content": system})
        for m in self.messages:
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            texts = [b.text or "" for b in m.content if b.type == "text"]
            if m.role == "user":
                # Tool results answer the calls of the turn before: tool messages first.
                out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.result_text()}
                        for b in m.content if b.type == "tool_result"]
                if texts or not any(b.type == "tool_result" for b in m.content):
                    out.append({"role": "user", "content": "\n".join(texts)})
                continue
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in m.content if b.type == "tool_use"]
            if calls:
                turn["tool_calls"] = calls
            thoughts = [b.thinking for b in m.content if b.type == "thinking"]
            if thoughts:
                turn["reasoning_content"] = "".join(t or "" for t in thoughts)
            if turn["content"] is None and not calls:
                turn["content"] = ""
            out.append(turn)
        return out

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this one means; a 400 names this API's field."""
        choice = self.tool_choice
        chat_choice: Any = None
        if choice is not None:
            chat_choice = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                           else {"any": "required"}.get(choice.type, choice.type))
        body: dict[str, Any] = {
            "model": self.model, "messages": self.chat_messages(), "max_completion_tokens": self.max_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "stream": self.stream,
            "stop": self.stop_sequences,
            "tools": [{"type": "function", "function": {k: v for k, v in (
                ("name", t.name), ("description", t.description), ("parameters", t.input_schema)) if v is not None}}
                for t in self.tools] if self.tools else None,
            "tool_choice": chat_choice,
            "parallel_tool_calls": (False if choice is not None and choice.disable_parallel_tool_use else None),
            # A last assistant message is a prefill: the answer goes on from it.
            "continue_final_message": self.messages[-1].role == "assistant" or None,
        }
        with messages_params():
            return validate(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})


def messages_params() -> AbstractContextManager[None]:
    """Rename the chat field a 400 raised inside names to this API's field."""
    return renamed_params(_CHAT_TO_MESSAGES)


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0

    @classmethod
    def of(cls, usage: Usage) -> "AnthropicUsage":
        return cls(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                   cache_read_input_tokens=usage.prompt_tokens_details.cached_tokens)


def stop_reason(finish_reason: str | None, matched: str | int | None, calls: bool) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for the engine's finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None
