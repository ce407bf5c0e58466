"""The chat request bodies: ``/v1/chat/completions`` (whose messages and tools the
Responses and Messages APIs translate into), and the routes that take messages too
(``/tokenize``, llama.cpp's ``/apply-template``); ``template_messages`` turns messages
into what a chat template reads, ``apply_template`` renders them and ``render_prompt``
makes a chat request's prompt tokens of them."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from engine.sampling_params import SamplingParams
from server.engine_client import TokenizerLike
from server.errors import bad_request
from server.protocol import _Exact, _SamplingRequest, _Strict
from server.tools import FORMATS, FunctionSpec, ToolFormat, history_content, template_tool_calls, tools_block


class ContentPart(_Strict):
    """One part of a message's content; only text parts are supported."""

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> "ContentPart":
        if self.type != "text" or self.text is None:
            raise ValueError(f"only text content parts are supported, got type {self.type!r}")
        return self


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text


class ToolCallIn(_Strict):
    """An earlier assistant turn's tool call, as the client sends it back."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class FunctionDef(_Exact):
    """A tool's function: its name, what it does, and the JSON Schema of its arguments."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # kvserve always enforces the parameters


class ToolDef(_Exact):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    """One chat message; content is text or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool results
    reasoning_content: str | None = None  # an assistant turn's reasoning, for templates that render it

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # NOTE: parts are joined with newlines, as vLLM does for text-only content.
        return "\n".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    REPLACED_FIELDS: ClassVar[dict[str, str]] = {
        **_SamplingRequest.REPLACED_FIELDS,
        "functions": 'tools: [{"type": "function", "function": {...}}] (OpenAI deprecated functions)',
        "function_call": "tool_choice (OpenAI deprecated function_call)",
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = True  # vLLM extension
    # vLLM's: more variables for the chat template (Qwen3's enable_thinking, ...).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the model goes on with the last (assistant) message instead of a new turn.
    continue_final_message: bool | None = False
    # OpenAI's: how hard a reasoning model thinks; the chat template's `reasoning_effort`
    # (gpt-oss's writes it into its system message), unless chat_template_kwargs sets it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    @model_validator(mode="after")
    def _check_continue(self) -> "ChatCompletionRequest":
        if self.continue_final_message:
            if self.messages[-1].role != "assistant":
                raise bad_request("continue_final_message needs the last message to be the assistant's",
                                  "continue_final_message")
            if "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt:
                raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                                  "add_generation_prompt")
        return self

    @property
    def generation_prompt(self) -> bool:
        """Whether the template opens a new assistant turn after the messages."""
        return self.add_generation_prompt is not False and not self.continue_final_message

    @model_validator(mode="after")
    def _check_tools(self) -> "ChatCompletionRequest":
        # 400s naming their field (a model-level ValueError would name none).
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise bad_request("tool names must be unique", "tools")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                              "tool_choice")
        if choice == "required" and not names:
            raise bad_request("tool_choice required needs tools", "tool_choice")
        return self

    def tool_choice_name(self) -> str:
        """``none``, ``auto``, ``required`` or the named function; ``none`` without tools."""
        if not self.tools:
            return "none"
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return choice.function.name
        return choice or "auto"

    def tool_specs(self) -> list[FunctionSpec]:
        return [FunctionSpec(t.function.name, t.function.description,
                             t.function.parameters if t.function.parameters is not None else {"type": "object"})
                for t in self.tools or []]

    @property
    def parallel_calls(self) -> bool:
        return self.parallel_tool_calls is not False

    @property
    def structured_param(self) -> str:
        return "tools" if self.tool_choice_name() != "none" else super().structured_param

    @model_validator(mode="after")
    def _check_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def sampling_params(self, tool_format: ToolFormat = FORMATS["generic"]) -> SamplingParams:
        """The engine's parameters; with tools, a grammar for ``tool_format``'s calls."""
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self.max_tokens)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self.to_sampling_params(max_tokens=max_tokens, logprobs=logprobs,
                                         prompt_logprobs=self.prompt_logprobs)
        choice = self.tool_choice_name()
        if choice == "none":
            return params
        if params.structured is not None:
            raise bad_request("tools (with a tool_choice other than none) and a structured output "
                              "cannot be combined", "tool_choice")
        try:
            structured = tool_format.grammar(self.tool_specs(), choice, self.parallel_calls)
            # (A format whose calls open with a special token keeps it in the answer's text.)
            skip = params.skip_special_tokens and not tool_format.keeps_special_tokens
            return dataclasses.replace(params, structured=structured, skip_special_tokens=skip)
        except ValueError as e:
            raise bad_request(str(e), "tools") from None


class TokenizeRequest(_Strict):
    """``POST /tokenize``: vLLM's ``prompt`` or ``messages``, or llama.cpp's ``content``
    (with its ``add_special``, default off, and ``with_pieces``)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool | None = False
    content: str | None = None
    add_special: bool = False
    with_pieces: bool = False
    parse_special: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if sum(x is not None for x in (self.prompt, self.messages, self.content)) != 1:
            raise ValueError("send exactly one of prompt, messages or content")
        if not self.parse_special:
            raise bad_request("parse_special false is not supported: special tokens' texts are always "
                              "read as the special tokens", "parse_special")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.continue_final_message and (not self.messages or self.messages[-1].role != "assistant"):
            raise bad_request("continue_final_message needs the last message to be the assistant's",
                              "continue_final_message")
        return self


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM shape)."""

    model: str | None = None
    tokens: list[int]


class ApplyTemplateRequest(_Strict):
    """``POST /apply-template`` (llama.cpp's): the chat template's rendering of ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


def template_messages(messages: list[ChatMessage], tools: list[FunctionSpec] | None = None,
                      parallel: bool = True, tool_format: ToolFormat = FORMATS["generic"]) -> list[dict[str, Any]]:
    """Messages as the plain dicts a chat template expects. With a native
    ``tool_format`` the template renders tools itself: assistant turns keep their
    ``tool_calls`` and tool results their ``tool_call_id``. Otherwise the generic
    format (``server.tools``): the tools listed in the system message, earlier
    calls as their JSON."""
    out = []
    for m in messages:
        text = m.text()
        d: dict[str, Any] = {"role": m.role, "content": text}
        if m.tool_calls and tool_format.native:
            d["tool_calls"] = [{**c, "id": tool_format.template_call_id(c["id"]) if c["id"] is not None else None}
                               for c in template_tool_calls([c.model_dump() for c in m.tool_calls])]
        elif m.tool_calls:
            calls = history_content([c.model_dump() for c in m.tool_calls], parallel)
            d["content"] = f"{text}\n{calls}" if text else calls
        if m.tool_call_id is not None and tool_format.native:
            d["tool_call_id"] = tool_format.template_call_id(m.tool_call_id)
        if m.name is not None:
            d["name"] = m.name
        if m.reasoning_content is not None and m.role == "assistant":
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    if tools and not tool_format.native:
        block = tools_block(tools, parallel)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def apply_template(tokenizer: TokenizerLike, messages: list[dict[str, Any]],
                   add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None,
                   template_kwargs: dict[str, Any] | None = None, continue_final_message: bool = False) -> str:
    """Render messages with the model's chat template (and a request's
    ``chat_template_kwargs``; the last message left open with ``continue_final_message``);
    a template error is a 400."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tools=tools or None, template_kwargs=template_kwargs or None,
                                             continue_final_message=continue_final_message)
    except ValueError as e:
        # (the renderer's TemplateArgumentError names the argument at fault; server/
        # does not import models/, so it is read by its attribute)
        argument = getattr(e, "argument", None)
        if argument is not None:
            raise bad_request(str(e), argument) from None
        raise bad_request(f"Invalid messages: {e}", "messages") from None


def render_prompt(tokenizer: TokenizerLike, body: ChatCompletionRequest, fmt: ToolFormat) -> list[int]:
    """Chat template then tokens. The template already holds any BOS, so the
    tokenizer must not add special tokens a second time. A native tool format
    hands the tools to the template; the generic one lists them in the messages."""
    tools = body.tool_specs() if body.tools else None
    messages = template_messages(body.messages, tools, body.parallel_calls, fmt)
    kwargs = body.chat_template_kwargs
    if body.reasoning_effort is not None:
        kwargs = {"reasoning_effort": body.reasoning_effort, **(kwargs or {})}
    text = apply_template(tokenizer, messages, body.generation_prompt,
                          [t.openai() for t in tools] if tools and fmt.native else None,
                          kwargs, bool(body.continue_final_message))
    return tokenizer.encode(text, add_special_tokens=False)
