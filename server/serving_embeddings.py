"""``POST /v1/embeddings``: OpenAI's embeddings, one engine request per input.

An embedding is the input's last token's hidden state after the model's final
norm (``engine.sampling_params.PoolingParams``), as vLLM pools a decoder-only
model and as embedding models built on one (Qwen3-Embedding) are trained.
"""

from __future__ import annotations

import base64
import struct

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.body import read_model
from server.protocol import EmbeddingRequest
from server.serving_common import Choices, encode_prompts, launch, run_to_completion
from server.state import ServerState, new_request_id


def encode(vector: list[float], encoding_format: str | None) -> list[float] | str:
    """A list of floats, or with ``base64`` (what the ``openai`` SDK asks for by default)
    their float32 little-endian bytes in base64, as OpenAI sends them."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


async def create_embedding(state: ServerState, request: Request) -> Response:
    """Validate, run and render one embeddings request."""
    body = await read_model(request, EmbeddingRequest)
    model = state.check_model(body.model)
    prompts = encode_prompts(state.engine.tokenizer, body.inputs(), body.add_special_tokens is not False)
    request_id = new_request_id("embd")
    merged = await launch(state, request_id, prompts, body.sampling_params(), {"prompt": "input"}, model)
    choices = await run_to_completion(request, merged, Choices([len(p) for p in prompts], 1))
    data = []
    for index, st in enumerate(choices.states):
        assert st.embedding is not None, "an embedding request ends with its embedding"
        data.append({"object": "embedding", "index": index, "embedding": encode(st.embedding, body.encoding_format)})
    usage = choices.usage(generated=False)
    return JSONResponse({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens}})
