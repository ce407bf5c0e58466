"""A chat completion's answer, OpenAI's shapes with vLLM's extensions: one message per
choice, or its chunks; ``chat_logprobs`` is also the Responses API's."""

from __future__ import annotations

from collections.abc import Iterator

from starlette.responses import JSONResponse, Response

from engine.outputs import RequestOutput, TokenLogprob
from server.answers import AnswerReader
from server.driver import First, Job, Renderer
from server.engine_client import TokenizerLike
from server.protocol_chat import ChatCompletionRequest
from server.protocol_responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                       ChatCompletionResponse, ChatLogprobs, ChatTokenLogprob, DeltaMessage,
                                       FunctionCall, ToolCall, TopLogprob, json_logprob, now, sse)
from server.serving_common import Choices, TokenIdDeltas, token_name, vllm_prompt_logprobs
from server.state import ServerState


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
