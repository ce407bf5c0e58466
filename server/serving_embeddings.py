"""``POST /v1/embeddings``: OpenAI's embeddings, one engine request per input;
llama.cpp's own ``/embedding``; and on them vLLM's ``/v1/score`` and the rerank
API (Jina's, Cohere's), which rank texts by the cosine similarity of their
embeddings, as vLLM scores with an embedding model.

An embedding is the input's last token's hidden state after the model's final
norm (``engine.sampling_params.PoolingParams``), as vLLM pools a decoder-only
model and as embedding models built on one (Qwen3-Embedding) are trained.
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.sampling_params import SamplingParams
from server.body import read_model, validate
from server.errors import bad_request, renamed_params
from server.protocol import _Strict, encode_prompts
from server.protocol_pooling import EmbeddingRequest, RerankRequest, ScoreRequest
from server.protocol_responses import now
from server.driver import Job, collect_all
from server.state import ServerState, new_request_id


def encode(vector: list[float], encoding_format: str | None) -> list[float] | str:
    """A list of floats, or with ``base64`` (what the ``openai`` SDK asks for by default)
    their float32 little-endian bytes in base64, as OpenAI sends them."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


async def embed(state: ServerState, request: Request, request_id: str, inputs: list[str | list[int]],
                params: SamplingParams, model: str, field: str, add_special_tokens: bool = True,
                truncate: int | None = None) -> tuple[list[list[float]], int]:
    """Each input's embedding (engine requests of one group) and their prompt tokens
    (each input's last ``truncate`` only, where given); a 400 for an input the engine
    refuses names ``field``."""
    prompts = encode_prompts(state.engine.tokenizer, inputs, truncate, state.engine.max_model_len,
                             add_special_tokens)
    choices = await collect_all(state, request, Job(request_id, model, prompts, params, {"prompt": field}))
    vectors = []
    for st in choices.states:
        assert st.embedding is not None, "an embedding request ends with its embedding"
        vectors.append(st.embedding)
    return vectors, choices.usage(generated=False).prompt_tokens


async def create_embedding(state: ServerState, request: Request) -> Response:
    """Validate, run and render one embeddings request."""
    body = await read_model(request, EmbeddingRequest)
    model = state.check_model(body.model)
    vectors, tokens = await embed(state, request, new_request_id("embd"), body.inputs(), body.sampling_params(),
                                  model, "input", body.add_special_tokens is not False, body.truncate_prompt_tokens)
    data = [{"object": "embedding", "index": i, "embedding": encode(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


class LlamaCppEmbeddingRequest(_Strict):
    """llama.cpp's ``POST /embedding``: ``content`` (or ``input``, as its ``/v1``), a text,
    token ids or a list of either; ``embd_normalize`` as its ``common_embd_normalize``."""

    model: str | None = None
    content: str | list[Any] | None = None
    input: str | list[Any] | None = None
    embd_normalize: int = 2


def llamacpp_normalize(vector: list[float], how: int) -> list[float]:
    """llama.cpp's ``common_embd_normalize``: -1 as it is, 0 scaled so the largest magnitude
    is 32760 (an int16's range), 1 taxicab, 2 Euclidean, p > 2 the p-norm; a zero vector
    stays zero."""
    if how == -1:
        total = 1.0
    elif how == 0:
        total = max((abs(v) for v in vector), default=0.0) / 32760.0
    elif how == 2:
        total = math.sqrt(math.fsum(v * v for v in vector))
    else:
        # The p-norm over the largest magnitude, so that a large p cannot overflow.
        top = max((abs(v) for v in vector), default=0.0)
        total = top * math.fsum((abs(v) / top) ** how for v in vector) ** (1.0 / how) if top > 0 else 0.0
    scale = 1.0 / total if total > 0 else 0.0
    return [v * scale for v in vector]


async def create_llamacpp_embedding(state: ServerState, request: Request) -> Response:
    """llama.cpp's non-OpenAI embeddings: ``[{"index": i, "embedding": [[...]]}]``, each
    input's pooled vector (one row, as llama.cpp answers a pooled model) normalised by
    ``embd_normalize``."""
    body = await read_model(request, LlamaCppEmbeddingRequest)
    field = "input" if body.input is not None else "content"
    value = body.input if body.input is not None else body.content
    if value is None:
        raise bad_request("input or content must be given", "content")
    if body.embd_normalize < -1:
        raise bad_request(f"embd_normalize must be -1 (none), 0 (max absolute), 1 (taxicab), 2 (Euclidean) or "
                          f"a p-norm's p above 2, got {body.embd_normalize}", "embd_normalize")
    with renamed_params({"input": field}):
        # The raw vectors, normalised here as llama.cpp normalises them.
        oai = validate(EmbeddingRequest, {"model": body.model, "input": value, "normalize": False})
        model = state.check_model(oai.model)
        vectors, _ = await embed(state, request, new_request_id("embd"), oai.inputs(), oai.sampling_params(),
                                 model, field)
    return JSONResponse([{"index": i, "embedding": [llamacpp_normalize(v, body.embd_normalize)]}
                         for i, v in enumerate(vectors)])


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two (normalised) embeddings: their dot product, in float64."""
    return math.fsum(x * y for x, y in zip(a, b))


async def _similarities(state: ServerState, request: Request, request_id: str, pairs: list[tuple[str, str]],
                        model: str, field: str) -> tuple[list[float], int]:
    """Each pair's cosine similarity, every distinct text embedded once; and the tokens."""
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    vectors, tokens = await embed(state, request, request_id, texts, SamplingParams.embedding(), model, field)
    by_text = dict(zip(texts, vectors))
    return [cosine(by_text[a], by_text[b]) for a, b in pairs], tokens


async def create_score(state: ServerState, request: Request) -> Response:
    """vLLM's score API: ``text_1`` against each ``text_2``."""
    body = await read_model(request, ScoreRequest)
    model = state.check_model(body.model)
    request_id = new_request_id("score")
    scores, tokens = await _similarities(state, request, request_id, body.pairs(), model, "text_2")
    return JSONResponse({"id": request_id, "object": "list", "created": now(), "model": model,
                         "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def create_rerank(state: ServerState, request: Request) -> Response:
    """The rerank API (Jina's, Cohere's): the documents, most relevant first."""
    body = await read_model(request, RerankRequest)
    model = state.check_model(body.model)
    documents = body.texts()
    request_id = new_request_id("rerank")
    scores, tokens = await _similarities(state, request, request_id, [(body.query, d) for d in documents],
                                         model, "documents")
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    if body.top_n is not None:
        order = order[:body.top_n]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": documents[i]}} if body.return_documents is not False else {})}
               for i in order]
    return JSONResponse({"id": request_id, "model": model, "results": results,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
