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
from server.protocol import truncate_prompt
from server.protocol_chat import ChatCompletionRequest, template_messages
from server.protocol_responses import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                       ChatCompletionChunk, ChatCompletionResponse, ChatLogprobs,
                                       ChatTokenLogprob, DeltaMessage, FunctionCall, ToolCall, TopLogprob,
                                       json_logprob, now, sse)
from server.driver import First, Job, Renderer, respond
from server.serving_common import Choices, TokenIdDeltas, token_name, vllm_prompt_logprobs
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
    job = Job(new_request_id("chatcmpl"), model, [prompt], params,
              {"prompt": "messages", "structured": body.structured_param}, bool(body.stream))
    return await respond(state, request, job, ChatRenderer(state, body, job, reader))


class ChatRenderer(Renderer):
    """A chat completion: one message per choice, or its chunks (OpenAI's shapes, with
    vLLM's extensions: token ids, prompt logprobs)."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, job: Job, reader: AnswerReader) -> None:
        super().__init__(Choices([len(job.prompts[0])], job.params.n))
        self.tok, self.fmt, self.body, self.job, self.reader = state.engine.tokenizer, state.tool_format, body, job, reader
        self.want_logprobs = job.params.logprobs is not None
        self.as_ids = bool(body.return_tokens_as_token_ids)
        self.created = now()
        self.ids = TokenIdDeltas(bool(body.return_token_ids))
        self.answers = [reader.stream() for _ in self.choices.states]

    def _message(self, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
        reasoning, text, calls = self.reader.whole(text)
        if calls is None:
            return AssistantMessage(content=text, reasoning_content=reasoning), finish_reason
        return AssistantMessage(content=None, reasoning_content=reasoning, tool_calls=[
            ToolCall(id=self.fmt.call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]), "tool_calls" if finish_reason == "stop" else finish_reason

    def whole(self) -> Response:
        body, choices, tok = self.body, self.choices, self.tok
        answers = [self._message("".join(st.text), st.finish_reason) for st in choices.states]
        result = ChatCompletionResponse(id=self.job.request_id, model=self.job.model,
                                        usage=choices.usage(), choices=[
            ChatChoice(index=idx, message=msg, finish_reason=reason,
                       logprobs=chat_logprobs(tok, st.logprobs, self.as_ids) if self.want_logprobs else None,
                       token_ids=st.token_ids if body.return_token_ids else None)
            for idx, (st, (msg, reason)) in enumerate(zip(choices.states, answers))],
            # One prompt: every sample's prompt logprobs are the same (vLLM sends them once).
            prompt_logprobs=(vllm_prompt_logprobs(tok, choices.states[0].prompt_logprobs)
                             if body.prompt_logprobs is not None else None),
            prompt_token_ids=self.job.prompts[0] if body.return_token_ids else None)
        return JSONResponse(result.model_dump(mode="json"))

    def _chunk(self, choice: ChatChunkChoice | None, usage: bool | None = None,
               prompt_ids: list[int] | None = None) -> str:
        usage = self.body.continuous_usage if usage is None else usage
        return sse(ChatCompletionChunk(
            id=self.job.request_id, created=self.created, model=self.job.model,
            choices=[choice] if choice else [], usage=self.choices.usage() if usage else None,
            prompt_token_ids=prompt_ids), include_usage=self.body.include_usage)

    def prelude(self, first: First) -> Iterator[str]:
        # The first chunk of every choice announces the role, as OpenAI's do; with
        # return_token_ids the very first carries the prompt's ids, as vLLM's does.
        for idx in range(len(self.choices.states)):
            yield self._chunk(ChatChunkChoice(index=idx, delta=DeltaMessage(role="assistant", content=""),
                                              token_ids=self.ids.take(idx)),
                              prompt_ids=self.job.prompts[0] if self.ids.enabled and idx == 0 else None)

    def delta(self, prompt_index: int, ro: RequestOutput) -> Iterator[str]:
        for idx, out, finished in self.choices.update(prompt_index, ro):
            self.ids.add(idx, out.token_ids)
            answer = self.answers[idx]
            reasoning, text, calls = answer.feed(out.text, finished)
            if text or reasoning or calls or out.logprobs:
                lps = chat_logprobs(self.tok, out.logprobs or [], self.as_ids) if self.want_logprobs else None
                yield self._chunk(ChatChunkChoice(index=idx, delta=DeltaMessage(
                    content=text if text or not (calls or reasoning) else None,
                    reasoning_content=reasoning or None, tool_calls=calls or None), logprobs=lps,
                    token_ids=self.ids.take(idx)))
            if finished:
                reason = self.choices.states[idx].finish_reason
                if answer.were_calls and reason == "stop":
                    reason = "tool_calls"
                yield self._chunk(ChatChunkChoice(index=idx, delta=DeltaMessage(), finish_reason=reason,
                                                  token_ids=self.ids.take(idx)))

    def epilogue(self) -> Iterator[str]:
        if self.body.include_usage:
            yield self._chunk(None, usage=True)
