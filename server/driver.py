"""The one request driver: every API dialect's request runs through ``respond``.

An endpoint parses its body, translates it into a ``Job`` (the engine requests:
prompts, sampling parameters, the served model) and a ``Renderer`` for its
dialect, and hands both here. This module owns what is the same for all of
them: the engine's checks and admission (``launch``), the race against a
client that hangs up, collecting a whole answer, and the server-sent events of
a streamed one, with the error and end-of-stream protocol. A new dialect is a
parser and a renderer, nothing else::

    endpoint:  read_model -> translate -> respond(state, request, job, renderer)
    respond:   launch -> (collect -> renderer.whole) | (first delta -> SSE:
               renderer.prelude, renderer.delta..., renderer.epilogue | renderer.error)

Every path closes the engine streams (which aborts their requests and frees
their KV blocks) and gives back the admission place however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import anyio

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from server.errors import APIError, ClientDisconnected, engine_fault, unavailable
from server.generation import AdmittedStream, EngineFault, RequestAborted, close_quietly, merge_outputs
from server.protocol_responses import SSE_DONE, sse_json
from server.serving_common import Choices
from server.state import ServerState, start_generation

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Not an HTTP status the client sees (it is gone); it marks the access log.
CLIENT_CLOSED_REQUEST = 499

# What a drain that ran out of time tells a client whose request it aborted.
ABORTED_BY_SHUTDOWN = ("The server is shutting down: this request was aborted before it "
                       "finished; retry it.")

# How often a non-streaming request checks whether its client went away.
DISCONNECT_POLL_SECONDS = 0.25

First = tuple[int, RequestOutput] | None  # a stream's first delta: (prompt index, output), or none


@dataclass(frozen=True)
class Job:
    """What one API request asks of the engine: one engine request per prompt (a
    group, named ``request_id`` and ``request_id-i``), all with ``params``.

    ``model`` is the served name that answers (``ServerState.check_model``: the base
    model or a LoRA adapter); ``fields`` names the body field behind an engine
    parameter where the two differ (``prompt``: ``messages``), so that a 400 names
    what the client sent."""

    request_id: str
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    fields: Mapping[str, str]
    stream: bool = False


class Renderer:
    """A dialect's answer to one request, from the ``choices`` the driver fills.

    ``whole`` renders a finished answer; a stream is ``prelude`` (given the first
    delta, or None when there was none), one ``delta`` per engine output,
    ``epilogue``, then ``done`` (None: the dialect sends no end marker). A failure
    after the stream started is sent as ``error``'s events, then ``done``."""

    done: str | None = SSE_DONE

    def __init__(self, choices: Choices) -> None:
        self.choices = choices

    def whole(self) -> Response:
        """The finished answer (``choices`` holds it all)."""
        raise NotImplementedError

    def prelude(self, first: First) -> Iterable[str]:
        """Events before the first delta's."""
        return ()

    def delta(self, prompt_index: int, ro: RequestOutput) -> Iterable[str]:
        """The events of one engine output of prompt ``prompt_index``."""
        raise NotImplementedError

    def epilogue(self) -> Iterable[str]:
        """Events after the last delta's."""
        return ()

    def error(self, error: APIError) -> Iterable[str]:
        """How a stream reports a failure: by default OpenAI's ``data: {"error": ...}``."""
        return [sse_json(error.body_json())]


async def respond(state: ServerState, request: Request, job: Job, renderer: Renderer) -> Response:
    """Run ``job`` and answer with ``renderer``: whole, or streamed when ``job.stream``."""
    merged = await launch(state, job)
    if not job.stream:
        await run_to_completion(request, merged, renderer.choices)
        return renderer.whole()
    first = await first_output(request, merged)
    return SSEResponse(sse_stream(first, merged, renderer), merged,
                       lambda: client_disconnected(state, job.request_id))


async def collect_all(state: ServerState, request: Request, job: Job) -> Choices:
    """Run ``job`` to the end and return its choices (one per prompt), for endpoints
    that compute on the outputs (embeddings, scores) rather than render them."""
    merged = await launch(state, job)
    return await run_to_completion(request, merged, Choices([len(p) for p in job.prompts], job.params.n))


def _cut(items: str | list[int], limit: int | None) -> str:
    if limit is None or len(items) <= limit:
        return repr(items)
    return f"{items[:limit]!r}... ({len(items)} in all)"


def log_request(state: ServerState, job: Job) -> None:
    """vLLM's request log line (``--enable-log-requests``): the id, the model, the sampling
    parameters and each prompt's text and token ids, cut to ``state.max_log_len``."""
    shown = [f"prompt {i}: {_cut(state.engine.tokenizer.decode(ids, skip_special_tokens=False), state.max_log_len)}, "
             f"prompt_token_ids: {_cut(ids, state.max_log_len)}" for i, ids in enumerate(job.prompts)]
    logger.info("Received request %s (model %s): %s, params: %s", job.request_id, job.model, "; ".join(shown),
                job.params)


async def launch(state: ServerState, job: Job) -> AdmittedStream:
    """One engine request per prompt, their streams merged; then admission.

    Every prompt is checked by the engine first (a 400 names the parameter at
    fault, as its body field in ``job.fields``: ``start_generation``), then the
    queue bound (503). Nothing has entered the engine yet when either is raised:
    a stream starts on first iteration. The prompts form one group, which takes
    turns with other requests for the engine's admission. The caller must close
    the result. A structured output's grammar is compiled in that check, on a
    worker thread: it may take milliseconds (seconds at its limit), which the
    event loop does not wait for.
    """
    adapter = state.adapter(job.model)
    if state.log_requests:
        log_request(state, job)
    prompts, request_id = job.prompts, job.request_id

    def start_all() -> list:
        return [start_generation(state.engine, request_id if len(prompts) == 1 else f"{request_id}-{i}",
                                 ids, job.params, job.fields, group=request_id, adapter=adapter)
                for i, ids in enumerate(prompts)]

    gens = await asyncio.to_thread(start_all) if job.params.structured is not None else start_all()
    return AdmittedStream(merge_outputs(gens), state.admit(request_id))


async def _collect(merged: AdmittedStream, choices: Choices) -> Choices:
    async for prompt_index, ro in merged:
        choices.update(prompt_index, ro)
    return choices


def _as_api_error(e: EngineFault | RequestAborted) -> APIError:
    if isinstance(e, RequestAborted):
        return unavailable(ABORTED_BY_SHUTDOWN)
    return engine_fault(str(e))


async def run_to_completion(request: Request, merged: AdmittedStream, choices: Choices) -> Choices:
    """Collect every output into ``choices``, raced against client disconnect
    (``ClientDisconnected``); an engine fault becomes a 500, an abort by a drain a
    503. Closes ``merged`` however it ends."""
    try:
        return await race_disconnect(request, _collect(merged, choices))
    except (EngineFault, RequestAborted) as e:
        raise _as_api_error(e) from None
    finally:
        await merged.aclose()


async def first_output(request: Request, merged: AdmittedStream) -> First:
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


async def sse_stream(first: First, merged: AdmittedStream, renderer: Renderer) -> AsyncIterator[str]:
    """The SSE body: prelude, rendered deltas, epilogue, then ``renderer.done``.

    A failure after the stream started is sent as ``renderer.error``'s events
    followed by ``done``. Closing this generator (client disconnect) closes the
    engine streams, which aborts them.
    """
    try:
        for event in renderer.prelude(first):
            yield event
        if first is not None:
            for event in renderer.delta(*first):
                yield event
            async for prompt_index, ro in merged:
                for event in renderer.delta(prompt_index, ro):
                    yield event
        for event in renderer.epilogue():
            yield event
    except (EngineFault, RequestAborted) as e:
        for event in renderer.error(_as_api_error(e)):
            yield event
    except APIError as e:
        for event in renderer.error(e):
            yield event
    except Exception:
        logger.exception("stream failed")
        for event in renderer.error(APIError(500, "Internal server error.", type="server_error")):
            yield event
    finally:
        await merged.aclose()
    if renderer.done is not None:
        yield renderer.done


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


async def race_disconnect(request: Request, work: Awaitable[T], poll: float | None = None) -> T:
    """Await ``work`` unless the client disconnects first.

    On disconnect ``work`` is cancelled (which aborts its engine requests) and
    ``ClientDisconnected`` is raised.
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll or DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True), contextlib.suppress(BaseException):
                await task


def client_disconnected(state: ServerState, request_id: str | None) -> Response:
    """Count and log (at info: it is no error of the server's) a client that hung up
    before its response was complete; everything it held is freed by then."""
    state.metrics.client_disconnected.inc()
    logger.info("client disconnected before the response to %s was complete",
                request_id or "its request")
    return Response(status_code=CLIENT_CLOSED_REQUEST)
