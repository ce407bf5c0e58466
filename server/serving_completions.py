"""``POST /v1/completions``: legacy text completions, streaming or not."""

from __future__ import annotations

from collections.abc import Iterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.outputs import RequestOutput, TokenLogprob
from server.body import read_model
from server.engine_client import TokenizerLike
from server.protocol import CompletionRequest
from server.protocol_responses import (CompletionChoice, CompletionLogprobs, CompletionResponse,
                                       json_logprob, now, sse)
from server.serving_common import (Choices, first_output, launch, run_to_completion,
                                   stream_response)
from server.state import ServerState, new_request_id


def completion_logprobs(tokenizer: TokenizerLike, lps: list[TokenLogprob],
                        offset: int) -> CompletionLogprobs:
    """OpenAI's parallel-list logprobs; ``offset`` is where the first token's text starts."""
    out = CompletionLogprobs()
    for lp in lps:
        token = tokenizer.decode([lp.token_id], skip_special_tokens=False)
        out.tokens.append(token)
        out.token_logprobs.append(json_logprob(lp.logprob))
        # The alternatives and the sampled token, as OpenAI ("up to logprobs + 1") and vLLM
        # send them: so logprobs=0 gives the sampled token's entry, never null.
        top = {tokenizer.decode([t], skip_special_tokens=False): json_logprob(v) for t, v in lp.top}
        top.setdefault(token, json_logprob(lp.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out


async def create_completion(state: ServerState, request: Request) -> Response:
    """Validate, run and render one completions request."""
    body = await read_model(request, CompletionRequest)
    state.check_model(body.model)
    params = body.sampling_params()
    tok = state.engine.tokenizer
    prompts = [tok.encode(p) if isinstance(p, str) else p for p in body.prompts()]
    request_id = new_request_id("cmpl")
    merged = await launch(state, request_id, prompts, params,
                          {"prompt": "prompt", "structured": body.structured_param})
    # NOTE: echo of a token-id prompt returns its decoded text.
    echoes = [(p if isinstance(p, str) else tok.decode(p)) if body.echo else ""
              for p in body.prompts()]
    choices = Choices([len(p) for p in prompts], params.n)
    want_logprobs = params.logprobs is not None

    if not body.stream:
        await run_to_completion(request, merged, choices)
        result = CompletionResponse(id=request_id, model=state.model_name, usage=choices.usage(),
                                    choices=[])
        for idx, st in enumerate(choices.states):
            echo = echoes[idx // params.n]
            lps = completion_logprobs(tok, st.logprobs, len(echo)) if want_logprobs else None
            result.choices.append(CompletionChoice(index=idx, text=echo + "".join(st.text),
                                                   logprobs=lps, finish_reason=st.finish_reason))
        return JSONResponse(result.model_dump(mode="json"))

    first = await first_output(request, merged)
    created = now()
    include_usage = body.include_usage
    offsets = [len(echoes[i // params.n]) for i in range(len(choices.states))]

    def chunk(idx: int, text: str, finish_reason: str | None = None,
              logprobs: CompletionLogprobs | None = None) -> str:
        return sse(CompletionResponse(
            id=request_id, created=created, model=state.model_name,
            choices=[CompletionChoice(index=idx, text=text, logprobs=logprobs,
                                      finish_reason=finish_reason)]),
            include_usage=include_usage)

    def prelude() -> Iterator[str]:
        for idx in range(len(choices.states)):
            if echoes[idx // params.n]:
                yield chunk(idx, echoes[idx // params.n])

    def render(prompt_index: int, ro: RequestOutput) -> Iterator[str]:
        for idx, out, finished in choices.update(prompt_index, ro):
            if out.text or out.logprobs:
                lps = None
                if want_logprobs:
                    lps = completion_logprobs(tok, out.logprobs or [], offsets[idx])
                    offsets[idx] += sum(len(t) for t in lps.tokens)
                yield chunk(idx, out.text, logprobs=lps)
            if finished:
                yield chunk(idx, "", finish_reason=choices.states[idx].finish_reason)

    def epilogue() -> Iterator[str]:
        if include_usage:
            yield sse(CompletionResponse(id=request_id, created=created, model=state.model_name,
                                         choices=[], usage=choices.usage()), include_usage=True)

    return stream_response(state, request_id, first, merged, prelude(), render, epilogue)
