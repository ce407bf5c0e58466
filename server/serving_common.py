"""Pieces shared by the completions and chat endpoints.

``Choices`` accumulates the per-choice state of one API request (text,
finish reason, token counts) from engine deltas; ``sse_stream`` wraps an
endpoint's chunk renderer with the error-event and ``[DONE]`` protocol.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from server.errors import APIError, engine_fault, unavailable
from server.generation import (AdmittedStream, EngineFault, RequestAborted, close_quietly,
                               merge_outputs, race_disconnect)
from server.engine_client import TokenizerLike
from server.protocol_responses import SSE_DONE, PromptLogprob, PromptLogprobs, Usage, json_logprob, sse_json
from server.state import ServerState, start_generation

logger = logging.getLogger(__name__)

# Not an HTTP status the client sees (it is gone); it marks the access log.
CLIENT_CLOSED_REQUEST = 499

# What a drain that ran out of time tells a client whose request it aborted.
ABORTED_BY_SHUTDOWN = ("The server is shutting down: this request was aborted before it "
                       "finished; retry it.")


@dataclass
class ChoiceState:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended it, if one did
    # The prompt's own logprobs (first entry None), when the request asked for them.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # an embedding request's answer

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class Choices:
    """Per-choice accumulation for ``len(prompts) * n`` choices.

    Choice ``i * n + k`` is sample ``k`` of prompt ``i``, as OpenAI numbers them.
    """

    def __init__(self, prompt_lens: list[int], n: int) -> None:
        self.n = n
        self.prompt_lens = prompt_lens
        self.cached = [0] * len(prompt_lens)
        self.states = [ChoiceState() for _ in range(len(prompt_lens) * n)]

    def index(self, prompt_index: int, out: CompletionOutput) -> int:
        return prompt_index * self.n + out.index

    def update(self, prompt_index: int,
               ro: RequestOutput) -> list[tuple[int, CompletionOutput, bool]]:
        """Fold one delta in; returns ``(choice, output, newly_finished)`` per output."""
        self.cached[prompt_index] = ro.num_cached_tokens
        changed = []
        for out in ro.outputs:
            idx = self.index(prompt_index, out)
            st = self.states[idx]
            st.text.append(out.text)
            st.token_ids.extend(out.token_ids)
            if out.logprobs:
                st.logprobs.extend(out.logprobs)
            if out.prompt_logprobs is not None:
                st.prompt_logprobs = out.prompt_logprobs
            if out.embedding is not None:
                st.embedding = out.embedding
            newly = out.finish_reason is not None and st.finish_reason is None
            if newly:
                st.finish_reason, st.stop_reason = out.finish_reason, out.stop_reason
            changed.append((idx, out, newly))
        return changed

    def usage(self, generated: bool = True) -> Usage:
        """Token counts; ``generated=False`` when the sampled tokens are not returned
        (a completions ``echo`` with ``max_tokens: 0``)."""
        completion = sum(s.num_tokens for s in self.states) if generated else 0
        return Usage.of(sum(self.prompt_lens), completion, sum(self.cached))


class TokenIdDeltas:
    """With vLLM's ``return_token_ids``, a stream's token ids: each choice's ids not yet
    sent go with its next chunk (a token whose text is held back waits for one)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._pending: dict[int, list[int]] = {}

    def add(self, idx: int, token_ids: list[int]) -> None:
        if self.enabled:
            self._pending.setdefault(idx, []).extend(token_ids)

    def take(self, idx: int) -> list[int] | None:
        """Choice ``idx``'s ids for its next chunk (None: not asked for)."""
        return self._pending.pop(idx, []) if self.enabled else None


def token_name(tokenizer: TokenizerLike, token_id: int, as_id: bool) -> str:
    """How a logprob entry names its token: its text, or with vLLM's
    ``return_tokens_as_token_ids`` ``token_id:<id>``, which names it exactly where a
    text cannot (part of a character, or two tokens of one text)."""
    return f"token_id:{token_id}" if as_id else tokenizer.decode([token_id], skip_special_tokens=False)


def vllm_prompt_logprobs(tokenizer: TokenizerLike, entries: list[TokenLogprob | None] | None) -> PromptLogprobs:
    """The prompt's logprobs in vLLM's ``prompt_logprobs`` shape: per token, None for
    the first, else its own entry (with its rank) then its top alternatives', by token id."""
    assert entries is not None, "the engine sends prompt logprobs with a sample's first tokens"

    def entry(token_id: int, logprob: float, rank: int | None) -> PromptLogprob:
        return PromptLogprob(logprob=json_logprob(logprob), rank=rank,
                             decoded_token=tokenizer.decode([token_id], skip_special_tokens=False))

    out: PromptLogprobs = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        tokens = {str(e.token_id): entry(e.token_id, e.logprob, e.rank)}
        for rank, (token_id, logprob) in enumerate(e.top, start=1):
            tokens.setdefault(str(token_id), entry(token_id, logprob, rank))
        out.append(tokens)
    return out


def encode_prompts(tokenizer: TokenizerLike, prompts: list[str | list[int]],
                   add_special_tokens: bool = True) -> list[list[int]]:
    """Each prompt as token ids: a text encoded, a list of ids as it is."""
    return [tokenizer.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str) else p
            for p in prompts]


def _cut(items: str | list[int], limit: int | None) -> str:
    if limit is None or len(items) <= limit:
        return repr(items)
    return f"{items[:limit]!r}... ({len(items)} in all)"


def log_request(state: ServerState, request_id: str, prompts: list[list[int]], params: SamplingParams,
                model: str) -> None:
    """vLLM's request log line (``--enable-log-requests``): the id, the model, the sampling
    parameters and each prompt's text and token ids, cut to ``state.max_log_len``."""
    shown = [f"prompt {i}: {_cut(state.engine.tokenizer.decode(ids, skip_special_tokens=False), state.max_log_len)}, "
             f"prompt_token_ids: {_cut(ids, state.max_log_len)}" for i, ids in enumerate(prompts)]
    logger.info("Received request %s (model %s): %s, params: %s", request_id, model, "; ".join(shown), params)


async def launch(state: ServerState, request_id: str, prompts: list[list[int]],
                 params: SamplingParams, body_fields: Mapping[str, str], model: str) -> AdmittedStream:
    """One engine request per prompt, their streams merged; then admission.

    Every prompt is checked by the engine first (a 400 names the parameter at
    fault, as its body field in ``body_fields``: ``start_generation``), then
    the queue bound (503). Nothing has
    entered the engine yet when either is raised: a stream starts on first
    iteration. The prompts form one group, which takes turns with other
    requests for the engine's admission; ``model`` (``ServerState.check_model``) is
    the served name that answers, the base model or a LoRA adapter. The caller must
    close the result.
    A structured output's grammar is compiled in that check, on a worker
    thread: it may take milliseconds (seconds at its limit), which the event
    loop does not wait for.
    """
    adapter = state.adapter(model)
    if state.log_requests:
        log_request(state, request_id, prompts, params, model)

    def start_all() -> list:
        return [start_generation(state.engine, request_id if len(prompts) == 1 else f"{request_id}-{i}",
                                 ids, params, body_fields, group=request_id, adapter=adapter)
                for i, ids in enumerate(prompts)]

    gens = await asyncio.to_thread(start_all) if params.structured is not None else start_all()
    return AdmittedStream(merge_outputs(gens), state.admit(request_id))


async def collect(merged: AdmittedStream, choices: Choices) -> Choices:
    """Run a non-streaming request to the end."""
    async for prompt_index, ro in merged:
        choices.update(prompt_index, ro)
    return choices


def _as_api_error(e: EngineFault | RequestAborted) -> APIError:
    if isinstance(e, RequestAborted):
        return unavailable(ABORTED_BY_SHUTDOWN)
    return engine_fault(str(e))


async def run_to_completion(request: Request, merged: AdmittedStream, choices: Choices) -> Choices:
    """``collect`` raced against client disconnect (``ClientDisconnected``); an engine
    fault becomes a 500, an abort by a drain a 503. Closes ``merged`` however it ends."""
    try:
        return await race_disconnect(request, collect(merged, choices))
    except (EngineFault, RequestAborted) as e:
        raise _as_api_error(e) from None
    finally:
        await merged.aclose()


async def first_output(request: Request,
                       merged: AdmittedStream) -> tuple[int, RequestOutput] | None:
    """Wait for the first delta before sending headers, so that a failure before
    it (an engine fault, an abort by a drain) gets a proper status code rather
    than a 200 with an error event. Closes ``merged`` if it raises."""
    try:
        return await race_disconnect(request, anext(merged))
    except StopAsyncIteration:
        return None
    except (EngineFault, RequestAborted) as e:
        await merged.aclose()
        raise _as_api_error(e) from None
    except BaseException:
        await merged.aclose()
        raise


Render = Callable[[int, RequestOutput], Iterable[str]]


def error_event(error: APIError) -> Iterable[str]:
    """How completions and chat streams report a failure: ``data: {"error": ...}``."""
    return [sse_json(error.body_json())]


async def sse_stream(first: tuple[int, RequestOutput] | None, merged: AdmittedStream,
                     prelude: Iterable[str], render: Render,
                     epilogue: Callable[[], Iterable[str]],
                     on_error: Callable[[APIError], Iterable[str]] = error_event,
                     done: str | None = SSE_DONE) -> AsyncIterator[str]:
    """The SSE body: prelude, rendered deltas, epilogue, then ``done`` (``[DONE]``;
    the Responses API sends no such marker).

    A failure after the stream started is sent as ``on_error``'s events followed
    by ``done``. Closing this generator (client disconnect) closes the engine
    streams, which aborts them.
    """
    try:
        for event in prelude:
            yield event
        if first is not None:
            for event in render(*first):
                yield event
            async for prompt_index, ro in merged:
                for event in render(prompt_index, ro):
                    yield event
        for event in epilogue():
            yield event
    except (EngineFault, RequestAborted) as e:
        for event in on_error(_as_api_error(e)):
            yield event
    except APIError as e:
        for event in on_error(e):
            yield event
    except Exception:
        logger.exception("stream failed")
        for event in on_error(APIError(500, "Internal server error.", type="server_error")):
            yield event
    finally:
        await merged.aclose()
    if done is not None:
        yield done


class SSEResponse(StreamingResponse):
    """Server-sent events that always close their body and the engine streams.

    Starlette leaves an interrupted iterator to the garbage collector; closing
    it here aborts the engine requests (and gives back the admission place) as
    soon as the stream ends, even when the body never started. A stream that
    did not end with its last event lost its client: ``on_disconnect`` runs.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], merged: AdmittedStream,
                 on_disconnect: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._merged = merged
        self._on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # ASGI 2.4: a failed send; counted in stream_response
            pass

    async def stream_response(self, send: Send) -> None:
        completed = False
        try:
            await super().stream_response(send)
            completed = True
        finally:
            await close_quietly(self.body_iterator)
            await self._merged.aclose()
            if not completed:
                self._on_disconnect()


def stream_response(state: ServerState, request_id: str, first: tuple[int, RequestOutput] | None,
                    merged: AdmittedStream, prelude: Iterable[str], render: Render,
                    epilogue: Callable[[], Iterable[str]],
                    on_error: Callable[[APIError], Iterable[str]] = error_event,
                    done: str | None = SSE_DONE) -> SSEResponse:
    """The streaming response of one request (see ``sse_stream``)."""
    return SSEResponse(sse_stream(first, merged, prelude, render, epilogue, on_error, done), merged,
                       lambda: client_disconnected(state, request_id))


def client_disconnected(state: ServerState, request_id: str | None) -> Response:
    """Count and log (at info: it is no error of the server's) a client that hung up
    before its response was complete; everything it held is freed by then."""
    state.metrics.client_disconnected.inc()
    logger.info("client disconnected before the response to %s was complete",
                request_id or "its request")
    return Response(status_code=CLIENT_CLOSED_REQUEST)

