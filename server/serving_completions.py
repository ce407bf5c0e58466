"""``POST /v1/completions``: legacy text completions, streaming or not.

The handler reads one way through the server: the body (``server.body``), the served
model and its defaults (``server.state``), the prompts' tokens (``server.protocol``),
a fill-in-the-middle layout (``server.fim``), the answer's renderer
(``server.completion_output``), then the driver (``server.driver``)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from server.body import read_model
from server.completion_output import CompletionRenderer
from server.driver import Job, respond
from server.fim import suffix_prompt
from server.protocol import CompletionRequest, encode_prompts
from server.state import ServerState, new_request_id


async def create_completion(state: ServerState, request: Request) -> Response:
    """Validate, run and render one completions request."""
    received = await read_model(request, CompletionRequest)
    model = state.check_model(received.model)
    body: CompletionRequest = state.with_model_defaults(received)
    params = body.sampling_params()
    given = body.prompts()
    tok = state.engine.tokenizer
    prompts = encode_prompts(tok, given, body.truncate_prompt_tokens, state.engine.max_model_len)
    if body.suffix:
        prompts = [suffix_prompt(tok, p, body.suffix) for p in prompts]
    job = Job(new_request_id("cmpl"), model, prompts, params,
              {"prompt": "prompt", "structured": body.structured_param}, bool(body.stream))
    return await respond(state, request, job, CompletionRenderer(tok, body, job, given))
