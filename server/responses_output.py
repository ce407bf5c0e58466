"""The Responses API's answer: the response object and its output items, as
``POST /v1/responses`` returns them and its stream events carry them
(``server.serving_responses``); the request is ``server.responses_api``'s."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from server.protocol_chat import ChatCompletionRequest
from server.protocol_responses import ChatTokenLogprob, Usage
from server.responses_api import FunctionChoice, ResponsesRequest


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    call_id: str
    name: str
    arguments: str = ""


class OutputReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class OutputReasoning(BaseModel):
    """A thinking model's reasoning (``--reasoning-parser``), before the answer's items."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    summary: list[Any] = Field(default_factory=list)
    content: list[OutputReasoningText] = Field(default_factory=list)


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    # OpenAI's explicit cache writes; kvserve's prefix cache is not written on request.
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, usage: Usage) -> "ResponseUsage":
        return cls(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                   total_tokens=usage.total_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens))


class ResponseObject(BaseModel):
    """A response, as ``POST /v1/responses`` returns it and its stream events carry it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    background: bool = False
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float = 1.0
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def start(cls, response_id: str, created_at: int, model: str, body: ResponsesRequest,
              chat: ChatCompletionRequest, stored: bool) -> "ResponseObject":
        """The response before any output: the request's settings echoed, as OpenAI does."""
        choice = body.tool_choice
        params_temperature = chat.temperature if chat.temperature is not None else 1.0
        return cls(
            id=response_id, created_at=created_at, model=model, instructions=body.instructions,
            max_output_tokens=body.max_output_tokens, parallel_tool_calls=chat.parallel_calls,
            previous_response_id=body.previous_response_id, reasoning=body.reasoning, store=stored,
            temperature=params_temperature, top_p=chat.top_p if chat.top_p is not None else 1.0,
            text={"format": body.text.format.echo() if body.text and body.text.format else {"type": "text"}},
            tool_choice=choice.model_dump() if isinstance(choice, FunctionChoice) else (choice or "auto"),
            tools=[t.echo() for t in body.tools or []], top_logprobs=body.top_logprobs,
            user=body.user, metadata=body.metadata or {})

    def finish(self, finish_reason: str | None, usage: Usage) -> None:
        """Set the status from the engine's finish reason: cut by the token limit is
        ``incomplete`` (OpenAI's ``max_output_tokens``), as is an aborted answer."""
        self.usage = ResponseUsage.of(usage)
        if finish_reason in ("stop", "tool_calls"):
            self.status = "completed"
        else:
            self.status = "incomplete"
            self.incomplete_details = {"reason": "max_output_tokens" if finish_reason == "length" else None}
        item_status = "completed" if self.status == "completed" else "incomplete"
        for item in self.output:
            if item.status == "in_progress":
                item.status = item_status

    def conversation(self) -> list[dict[str, Any]]:
        """The answer as chat messages, for a later ``previous_response_id``."""
        text = "".join(part.text for item in self.output if isinstance(item, OutputMessage)
                       for part in item.content)
        calls = [{"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in self.output if isinstance(c, OutputFunctionCall)]
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = calls
        reasoning = [part.text for item in self.output if isinstance(item, OutputReasoning) for part in item.content]
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        return [message]
