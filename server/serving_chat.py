"""``POST /v1/chat/completions``: chat completions, streaming or not."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from server.answers import AnswerReader, plan_answer
from server.body import read_model
from server.engine_client import TokenizerLike
from server.errors import bad_request
from server.protocol import ChatCompletionRequest, template_messages, truncate_prompt
from server.protocol_responses import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                       ChatCompletionChunk, ChatCompletionResponse, ChatLogprobs,
                                       ChatTokenLogprob, DeltaMessage, FunctionCall, ToolCall, TopLogprob,
                                       json_logprob, now, sse)
from server.serving_common import (Choices, TokenIdDeltas, first_output, launch, run_to_completion,
                                   stream_response, token_name, vllm_prompt_logprobs)
from server.state import ServerState, new_request_id
from server.tools import ToolFormat


def _token(tokenizer: TokenizerLike, token_id: int, logprob: float, as_id: bool) -> TopLogprob:
    # The token's own bytes: for part of a character, the text is U+FFFD but the bytes
    # let a client put the character back together, as OpenAI means them to.
    return TopLogprob(token=token_name(tokenizer, token_id, as_id), logprob=json_logprob(logprob),
                      bytes=list(tokenizer.token_bytes(token_id)))


def chat_logprobs(tokenizer: TokenizerLike, lps: list[TokenLogprob], as_ids: bool = False) -> ChatLogprobs:
    """OpenAI's chat logprobs: one entry per token with its top alternatives (each named
    ``token_id:<id>`` with ``as_ids``: vLLM's ``return_tokens_as_token_ids``)."""
    content = []
    for lp in lps:
        head = _token(tokenizer, lp.token_id, lp.logprob, as_ids)
        content.append(ChatTokenLogprob(
            token=head.token, logprob=head.logprob, bytes=head.bytes,
            top_logprobs=[_token(tokenizer, t, v, as_ids) for t, v in lp.top]))
    return ChatLogprobs(content=content)


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
    text = apply_template(tokenizer, messages, body.generation_prompt,
                          [t.openai() for t in tools] if tools and fmt.native else None,
                          body.chat_template_kwargs, bool(body.continue_final_message))
    return tokenizer.encode(text, add_special_tokens=False)


def prepare_chat(state: ServerState, chat: ChatCompletionRequest
                 ) -> tuple[SamplingParams, AnswerReader, list[int]]:
    """A chat request's engine params, how its answer is read (``server.answers``) and
    its prompt; also for the APIs that translate into chat. A 400 names chat's field."""
    fmt = state.tool_format
    chat = state.with_model_defaults(chat)
    params, reader = plan_answer(state, chat.sampling_params(fmt), fmt if chat.tool_choice_name() != "none" else None)
    prompt = truncate_prompt(render_prompt(state.engine.tokenizer, chat, fmt), chat.truncate_prompt_tokens,
                             state.engine.max_model_len)
    return params, reader, prompt


async def create_chat_completion(state: ServerState, request: Request) -> Response:
    """Validate, run and render one chat completions request."""
    body = await read_model(request, ChatCompletionRequest)
    model = state.check_model(body.model)
    params, reader, prompt = prepare_chat(state, body)
    tok = state.engine.tokenizer
    request_id = new_request_id("chatcmpl")
    choices = Choices([len(prompt)], params.n)
    merged = await launch(state, request_id, [prompt], params,
                          {"prompt": "messages", "structured": body.structured_param}, model)
    want_logprobs = params.logprobs is not None
    as_ids = bool(body.return_tokens_as_token_ids)

    def message(text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
        reasoning, text, calls = reader.whole(text)
        if calls is None:
            return AssistantMessage(content=text, reasoning_content=reasoning), finish_reason
        return AssistantMessage(content=None, reasoning_content=reasoning, tool_calls=[
            ToolCall(id=state.tool_format.call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]), "tool_calls" if finish_reason == "stop" else finish_reason

    if not body.stream:
        await run_to_completion(request, merged, choices)
        answers = [message("".join(st.text), st.finish_reason) for st in choices.states]
        result = ChatCompletionResponse(id=request_id, model=model,
                                        usage=choices.usage(), choices=[
            ChatChoice(index=idx, message=msg, finish_reason=reason,
                       logprobs=chat_logprobs(tok, st.logprobs, as_ids) if want_logprobs else None,
                       token_ids=st.token_ids if body.return_token_ids else None)
            for idx, (st, (msg, reason)) in enumerate(zip(choices.states, answers))],
            # One prompt: every sample's prompt logprobs are the same (vLLM sends them once).
            prompt_logprobs=(vllm_prompt_logprobs(tok, choices.states[0].prompt_logprobs)
                             if body.prompt_logprobs is not None else None),
            prompt_token_ids=prompt if body.return_token_ids else None)
        return JSONResponse(result.model_dump(mode="json"))

    first = await first_output(request, merged)
    created = now()
    include_usage = body.include_usage

    ids = TokenIdDeltas(bool(body.return_token_ids))

    def chunk(choice: ChatChunkChoice | None, usage: bool = body.continuous_usage,
              prompt_ids: list[int] | None = None) -> str:
        return sse(ChatCompletionChunk(
            id=request_id, created=created, model=model,
            choices=[choice] if choice else [], usage=choices.usage() if usage else None,
            prompt_token_ids=prompt_ids), include_usage=include_usage)

    def prelude() -> Iterator[str]:
        # The first chunk of every choice announces the role, as OpenAI's do; with
        # return_token_ids the very first carries the prompt's ids, as vLLM's does.
        for idx in range(len(choices.states)):
            yield chunk(ChatChunkChoice(index=idx, delta=DeltaMessage(role="assistant", content=""),
                                        token_ids=ids.take(idx)),
                        prompt_ids=prompt if ids.enabled and idx == 0 else None)

    answers = [reader.stream() for _ in choices.states]

    def render(prompt_index: int, ro: RequestOutput) -> Iterator[str]:
        for idx, out, finished in choices.update(prompt_index, ro):
            ids.add(idx, out.token_ids)
            reasoning, text, calls = answers[idx].feed(out.text, finished)
            if text or reasoning or calls or out.logprobs:
                lps = chat_logprobs(tok, out.logprobs or [], as_ids) if want_logprobs else None
                yield chunk(ChatChunkChoice(index=idx, delta=DeltaMessage(
                    content=text if text or not (calls or reasoning) else None,
                    reasoning_content=reasoning or None, tool_calls=calls or None), logprobs=lps,
                    token_ids=ids.take(idx)))
            if finished:
                reason = choices.states[idx].finish_reason
                if answers[idx].were_calls and reason == "stop":
                    reason = "tool_calls"
                yield chunk(ChatChunkChoice(index=idx, delta=DeltaMessage(), finish_reason=reason,
                                            token_ids=ids.take(idx)))

    def epilogue() -> Iterator[str]:
        if include_usage:
            yield chunk(None, usage=True)

    return stream_response(state, request_id, first, merged, prelude(), render, epilogue)
