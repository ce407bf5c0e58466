"""OpenAI response bodies: completions, chat completions, their stream chunks.

Field order and presence follow OpenAI's wire format exactly, including the
explicit ``null``s (``logprobs``, ``finish_reason``) that clients look for.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer


def now() -> int:
    return int(time.time())


# JSON has no -inf, and a token the request's constraints rule out (a grammar's
# mask, min_tokens holding back EOS) has probability 0: such alternatives are
# reported with this floor, as vLLM does, instead of failing the response.
LOGPROB_FLOOR = -9999.0


def json_logprob(value: float) -> float:
    """``value``, or ``LOGPROB_FLOOR`` where it is below it (-inf) or not a number."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


# --- /v1/completions -------------------------------------------------------

class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token's entry in vLLM's ``prompt_logprobs`` (keyed by its token id)."""

    logprob: float
    rank: int | None = None  # among the whole vocabulary, 1 = most likely
    decoded_token: str


# Per prompt token: None for the first (it has no context), else the token's own
# entry and its top alternatives', by token id.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class _VllmExtras(BaseModel):
    """vLLM's extra fields on the wire only when a request asked for them (last, as vLLM
    sends them), so that every other answer keeps OpenAI's exact shape: ``prompt_logprobs``,
    and with ``return_token_ids`` the prompt's and the answer's token ids."""

    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        for name in ("prompt_logprobs", "prompt_token_ids", "token_ids"):
            value = out.pop(name, None)
            if value is not None:
                out[name] = value
        return out


class CompletionChoice(_VllmExtras):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# --- /v1/chat/completions --------------------------------------------------

class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    # A thinking model's reasoning, with --reasoning-parser (DeepSeek's and llama.cpp's name).
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _no_empty_tool_calls(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        for optional in ("tool_calls", "reasoning_content"):
            if out.get(optional) is None:
                out.pop(optional, None)
        return out


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: its id, type and name first, then arguments in pieces."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChoice(_VllmExtras):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_VllmExtras):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    """A chunk's delta: only the fields that are set appear on the wire."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_VllmExtras):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_VllmExtras):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


def sse(model: BaseModel, *, include_usage: bool) -> str:
    """One SSE event. With ``include_usage`` every chunk carries ``usage`` (null
    until the last), as OpenAI sends it; without, the key is left out."""
    exclude = None if include_usage else {"usage"}
    return f"data: {model.model_dump_json(exclude=exclude)}\n\n"


def sse_json(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
