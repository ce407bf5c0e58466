"""``POST /v1/completions``: legacy text completions, streaming or not."""

from __future__ import annotations

from collections.abc import Iterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.outputs import RequestOutput, TokenLogprob
from server.body import read_model
from server.engine_client import TokenizerLike
from server.fim import suffix_prompt
from server.protocol import CompletionRequest, truncate_prompt
from server.protocol_responses import (CompletionChoice, CompletionLogprobs, CompletionResponse, Usage,
                                       json_logprob, now, sse)
from server.serving_common import (ChoiceState, Choices, TokenIdDeltas, encode_prompts, first_output, launch,
                                   run_to_completion, stream_response, token_name, vllm_prompt_logprobs)
from server.state import ServerState, new_request_id


class LogprobsWriter:
    """Writes OpenAI's parallel-list logprobs for one choice, keeping each token's
    ``text_offset``: where its text starts, counted in the tokens' texts."""

    def __init__(self, tokenizer: TokenizerLike, as_ids: bool) -> None:
        """``as_ids``: vLLM's ``return_tokens_as_token_ids`` (each token named ``token_id:<id>``)."""
        self.tokenizer = tokenizer
        self.offset = 0  # where the next token's text starts
        self.as_ids = as_ids

    def name(self, token_id: int) -> str:
        return token_name(self.tokenizer, token_id, self.as_ids)

    def _place(self, token_id: int) -> str:
        """The token's name; its text's place goes into the offsets."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        self.offset += len(text)
        return token_name(self.tokenizer, token_id, True) if self.as_ids else text

    def prompt(self, prompt: list[int], entries: list[TokenLogprob | None] | None) -> CompletionLogprobs:
        """An echoed prompt's logprobs: its first token has none (``null``, as OpenAI sends
        it), each later one its logprob given the tokens before it."""
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        out = CompletionLogprobs(text_offset=[self.offset], tokens=[self._place(prompt[0])],
                                 token_logprobs=[None], top_logprobs=[None])
        return self.tokens(entries[1:], out)  # type: ignore[arg-type]

    def tokens(self, lps: list[TokenLogprob], out: CompletionLogprobs | None = None) -> CompletionLogprobs:
        """``lps``' entries, appended to ``out`` if given."""
        out = out if out is not None else CompletionLogprobs()
        for lp in lps:
            out.text_offset.append(self.offset)
            token = self._place(lp.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(json_logprob(lp.logprob))
            # The alternatives and the sampled token, as OpenAI ("up to logprobs + 1") and vLLM
            # send them: so logprobs=0 gives the sampled token's entry, never null.
            top = {self.name(t): json_logprob(v) for t, v in lp.top}
            top.setdefault(token, json_logprob(lp.logprob))
            out.top_logprobs.append(top)
        return out


async def create_completion(state: ServerState, request: Request) -> Response:
    """Validate, run and render one completions request."""
    body = state.with_model_defaults(await read_model(request, CompletionRequest))
    model = state.check_model(body.model)
    params = body.sampling_params()
    tok = state.engine.tokenizer
    keep = body.truncate_prompt_tokens
    prompts = [truncate_prompt(p, keep, state.engine.max_model_len) for p in encode_prompts(tok, body.prompts())]
    if body.suffix:
        prompts = [suffix_prompt(tok, p, body.suffix) for p in prompts]
    request_id = new_request_id("cmpl")
    merged = await launch(state, request_id, prompts, params,
                          {"prompt": "prompt", "structured": body.structured_param}, model)
    # NOTE: echo of a token-id (or truncated) prompt returns its decoded text.
    echoes = [(p if isinstance(p, str) and keep is None else tok.decode(ids)) if body.echo else ""
              for p, ids in zip(body.prompts(), prompts)]
    choices = Choices([len(p) for p in prompts], params.n)
    want_logprobs = params.logprobs is not None
    # echo with max_tokens 0: the prompt alone; the token the engine sampled is dropped.
    echo_only = body.echo_only
    # One writer per choice. With echo the prompt's tokens come first, so the generated
    # ones' text_offset starts after theirs (which may hold a BOS the echoed text does not).
    writers = [LogprobsWriter(tok, bool(body.return_tokens_as_token_ids)) for _ in choices.states]

    def echo_logprobs(idx: int, st: ChoiceState) -> CompletionLogprobs | None:
        if not want_logprobs:
            return None
        if not body.echo:
            return CompletionLogprobs()
        return writers[idx].prompt(prompts[idx // params.n], st.prompt_logprobs)

    def finish_reason(st: ChoiceState) -> str | None:
        return "length" if echo_only else st.finish_reason

    def usage() -> Usage:
        return choices.usage(generated=not echo_only)

    if not body.stream:
        await run_to_completion(request, merged, choices)
        result = CompletionResponse(id=request_id, model=model,
                                    usage=usage(), choices=[])
        for idx, st in enumerate(choices.states):
            echo = echoes[idx // params.n]
            lps = echo_logprobs(idx, st)
            if lps is not None and not echo_only:
                writers[idx].tokens(st.logprobs, lps)
            text = echo if echo_only else echo + "".join(st.text)
            result.choices.append(CompletionChoice(
                index=idx, text=text, logprobs=lps, finish_reason=finish_reason(st),
                prompt_logprobs=(vllm_prompt_logprobs(tok, st.prompt_logprobs)
                                 if body.prompt_logprobs is not None else None),
                prompt_token_ids=prompts[idx // params.n] if body.return_token_ids else None,
                token_ids=([] if echo_only else st.token_ids) if body.return_token_ids else None))
        return JSONResponse(result.model_dump(mode="json"))

    first = await first_output(request, merged)
    created = now()
    include_usage = body.include_usage
    echoed = [False] * len(choices.states)
    ids = TokenIdDeltas(bool(body.return_token_ids))
    sent_prompt_ids: set[int] = set()

    def chunk(idx: int, text: str, finish_reason: str | None = None,
              logprobs: CompletionLogprobs | None = None) -> str:
        # With return_token_ids: the prompt's ids on a choice's first chunk, and the new ids on each.
        prompt_ids = None
        if ids.enabled and idx not in sent_prompt_ids:
            sent_prompt_ids.add(idx)
            prompt_ids = prompts[idx // params.n]
        return sse(CompletionResponse(
            id=request_id, created=created, model=model,
            choices=[CompletionChoice(index=idx, text=text, logprobs=logprobs, finish_reason=finish_reason,
                                      prompt_token_ids=prompt_ids, token_ids=ids.take(idx))],
            usage=usage() if body.continuous_usage else None),
            include_usage=include_usage)

    def render(prompt_index: int, ro: RequestOutput) -> Iterator[str]:
        for idx, out, finished in choices.update(prompt_index, ro):
            st = choices.states[idx]
            if body.echo and not echoed[idx]:
                # On the choice's first delta, which carries the prompt's logprobs.
                echoed[idx] = True
                yield chunk(idx, echoes[prompt_index], logprobs=echo_logprobs(idx, st))
            if not echo_only:
                ids.add(idx, out.token_ids)
            if not echo_only and (out.text or out.logprobs):
                lps = writers[idx].tokens(out.logprobs or []) if want_logprobs else None
                yield chunk(idx, out.text, logprobs=lps)
            if finished:
                yield chunk(idx, "", finish_reason=finish_reason(st))

    def epilogue() -> Iterator[str]:
        if include_usage:
            yield sse(CompletionResponse(id=request_id, created=created, model=model,
                                         choices=[], usage=usage()), include_usage=True)

    return stream_response(state, request_id, first, merged, (), render, epilogue)
