"""``POST /v1/chat/completions``: chat completions, streaming or not.

The handler reads one way through the server: the body (``server.body``), the served
model and its defaults (``server.state``), the engine's input (``server.chat_input``),
the answer's renderer (``server.chat_output``), then the driver (``server.driver``)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from server.body import read_model
from server.chat_input import prepare_chat
from server.chat_output import ChatRenderer
from server.driver import Job, respond
from server.protocol_chat import ChatCompletionRequest
from server.state import ServerState, new_request_id


async def create_chat_completion(state: ServerState, request: Request) -> Response:
    """Validate, run and render one chat completions request."""
    body = await read_model(request, ChatCompletionRequest)
    model = state.check_model(body.model)
    chat = state.with_model_defaults(body)
    params, reader, prompt = prepare_chat(state, chat)
    job = Job(new_request_id("chatcmpl"), model, [prompt], params,
              {"prompt": "messages", "structured": body.structured_param}, bool(body.stream))
    return await respond(state, request, job, ChatRenderer(state, body, job, reader))
