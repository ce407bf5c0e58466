"""The FastAPI application: routes, middleware and the engine's lifespan.

``build_app`` takes any object with the ``server.engine_client.EngineClient``
shape (the real ``AsyncEngine`` or a test fake), so swapping engines is one
argument.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from engine.validation import InvalidRequestError, check_token_ids
from server.body import parse_json, read_model
from server.engine_client import EngineClient
from server.errors import (APIError, ClientDisconnected, bad_request, install_exception_handlers, response_not_found,
                           unavailable)
from server.metrics import CONTENT_TYPE_LATEST, PrometheusStatLogger
from server.middleware import OPEN_PATHS, APIKeyMiddleware, BodySizeLimitMiddleware, DrainMiddleware
from server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from server.protocol_chat import (ApplyTemplateRequest, DetokenizeRequest, TokenizeRequest, apply_template,
                                  template_messages)
from server.serving_chat import create_chat_completion
from server.driver import client_disconnected
from server.serving_completions import create_completion
from server.serving_embeddings import create_embedding, create_llamacpp_embedding, create_rerank, create_score
from server.serving_llamacpp import create_llamacpp_completion, create_llamacpp_infill, llamacpp_defaults
from server.serving_messages import count_message_tokens, create_message
from server.serving_responses import create_response
from server.reasoning import reasoning_format
from server.response_store import ResponseStore
from server.responses_api import input_items_page
from server.state import DEFAULT_STORED_RESPONSES, ServerState
from server.tools import tool_format_for

logger = logging.getLogger(__name__)

MiB = 1024 * 1024


@dataclass(frozen=True)
class CORSSettings:
    """Which browsers' cross-origin requests are answered (vLLM's ``--allowed-origins``,
    ``--allow-credentials``, ``--allowed-methods``, ``--allowed-headers``; its defaults:
    any origin, method and header, no credentials)."""

    allowed_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)


def _version() -> str:
    try:
        return metadata.version("kvserve")
    except metadata.PackageNotFoundError:
        return "0.0.0+local"


def build_app(engine: EngineClient, *, api_key: str | None = None, max_queue: int | None = None,
              max_body_size: int = 4 * MiB, served_model_name: str | Sequence[str] | None = None,
              metrics_require_key: bool = False, tool_call_parser: str = "auto",
              max_stored_responses: int = DEFAULT_STORED_RESPONSES,
              reasoning_parser: str = "auto", runtime_lora: bool = False, log_requests: bool = False,
              max_log_len: int | None = None, cors: CORSSettings | None = CORSSettings()) -> FastAPI:
    """Build the HTTP app around ``engine``.

    The app's lifespan binds the engine to its event loop (``engine.start``; the loop
    itself runs wherever ``engine.run_loop`` is called) and shuts it down; ``api_key``
    (if set) is required on every route except ``/health`` (and ``/ping``), ``/ready`` and
    ``/metrics`` (that one too with ``metrics_require_key``); ``max_queue``
    (if set) bounds the generation requests in flight before new ones get 503;
    ``served_model_name`` defaults to ``engine.model_name`` (several names: the
    first answers, the others are accepted for it, as vLLM's); ``tool_call_parser``
    picks the tool-call format (``server.tools.tool_format_for``);
    ``max_stored_responses`` bounds the Responses API answers kept in memory
    for ``previous_response_id`` (0 stores none); ``reasoning_parser`` (``server.reasoning``)
    splits a thinking model's reasoning from its answer; ``runtime_lora`` adds vLLM's
    routes that load and unload LoRA adapters while serving; ``log_requests`` logs each
    generation request (``max_log_len``: its prompt cut to that many characters and ids);
    ``cors`` answers browsers' cross-origin requests (None: no CORS headers). Call
    ``app.state.kvserve.begin_drain(timeout)`` to start a graceful shutdown.
    """
    if metrics_require_key and not api_key:
        raise ValueError("metrics_require_key needs an api_key")
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or ())
    model_name = names[0] if names else engine.model_name
    metrics = PrometheusStatLogger(model_name, kv_blocks_total=engine.num_kv_blocks,
                                   lora_adapters=tuple(engine.lora_adapters))
    engine.add_stat_logger(metrics)
    state = ServerState(engine=engine, model_name=model_name, model_aliases=tuple(names[1:]), metrics=metrics,
                        api_key=api_key, max_queue=max_queue, responses=ResponseStore(max_stored_responses),
                        log_requests=log_requests, max_log_len=max_log_len,
                        reasoning=reasoning_format(reasoning_parser, engine.tokenizer.chat_template),
                        tool_format=tool_format_for(
                            tool_call_parser, engine.tokenizer.tool_call_syntax,
                            lambda text: engine.tokenizer.encode(text, add_special_tokens=False)))
    if state.reasoning is not None:
        state.think_tokens = state.reasoning.tokens(engine.tokenizer)
        if state.think_tokens is None and state.reasoning.keeps_special_tokens:
            logger.warning("the tokenizer has no single token for <|channel|> and <|message|>: constrained "
                           "answers (structured outputs) cannot reason first; their grammar holds from the start")
        elif state.think_tokens is None:
            logger.warning("the tokenizer has no single token for <think> and </think>: constrained answers "
                           "(tools, structured outputs) cannot think first; their grammar holds from the start")
    if engine.tokenizer.tool_call_syntax == "unknown" and tool_call_parser == "auto":
        logger.warning("the chat template renders tools in a syntax kvserve does not read; "
                       "tool calls use kvserve's generic format")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        await engine.start()
        state.started = True
        try:
            yield
        finally:
            # By now uvicorn has let in-flight requests finish (or cancelled
            # them, which aborted their engine requests).
            state.draining = True
            await engine.shutdown()

    # The routes parse bodies by hand (strict JSON), so a generated OpenAPI
    # schema would describe nothing useful; leave the docs routes out.
    app = FastAPI(title="kvserve", version=_version(), lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvserve = state
    install_exception_handlers(app)

    async def on_client_disconnect(request: Request, _: Exception) -> Response:
        # Hung up while its body was read or before its answer was ready; a stream
        # that loses its client counts itself (server.driver.SSEResponse).
        return client_disconnected(state, None)

    app.add_exception_handler(ClientDisconnected, on_client_disconnect)
    # Added innermost first: CORS runs first, then auth, then the drain gate, then the body limit.
    app.add_middleware(BodySizeLimitMiddleware, max_body_size=max_body_size)
    app.add_middleware(DrainMiddleware, is_draining=lambda: state.draining)
    if api_key:
        open_paths = OPEN_PATHS - {"/metrics"} if metrics_require_key else OPEN_PATHS
        app.add_middleware(APIKeyMiddleware, api_key=api_key, open_paths=open_paths)
    if cors is not None:
        # Outermost: a browser's preflight (OPTIONS, which carries no key) is answered here,
        # and every answer, a 401 or 413 too, carries the CORS headers.
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                           allow_credentials=cors.allow_credentials, allow_methods=list(cors.allowed_methods),
                           allow_headers=list(cors.allowed_headers))
    _add_routes(app, state)
    if runtime_lora:
        _add_lora_routes(app, state)
    return app


def _add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (its answers: a
    line of text; a 400 for an adapter that cannot be served, a 404 for one not served)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = await read_model(request, LoadLoRAAdapterRequest)
        if body.lora_name in state.model_aliases:
            raise bad_request(f"The model '{body.lora_name}' is already served.", "lora_name")
        try:
            await state.engine.load_adapter(body.lora_name, body.lora_path)
        except InvalidRequestError as e:
            raise bad_request(str(e), e.param) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = await read_model(request, UnloadLoRAAdapterRequest)
        try:
            await state.engine.unload_adapter(body.lora_name)
        except ValueError:
            raise APIError(404, f"The LoRA adapter '{body.lora_name}' cannot be found.", param="lora_name",
                           code="model_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _model_card(state: ServerState, served: str, adapters: dict[str, str]) -> dict[str, Any]:
    """``served`` as ``/v1/models`` shows it: a LoRA adapter (as vLLM shows one) has its
    directory (from ``adapters``) as ``root`` and the base model as ``parent``."""
    adapter = state.adapter(served)
    return {"id": served, "object": "model", "created": int(time.time()), "owned_by": "kvserve",
            "root": adapters.get(adapter, "") if adapter else state.model_name,
            "parent": state.model_name if adapter else None,
            "max_model_len": state.engine.max_model_len}


# /invocations: the first field of these a body has -> the API it is a request of.
_INVOCATION_KINDS: tuple[tuple[str, Callable[[ServerState, Request], Awaitable[Response]]], ...] = (
    ("messages", create_chat_completion), ("prompt", create_completion), ("input", create_embedding),
    ("text_1", create_score), ("query", create_rerank))


async def create_invocation(state: ServerState, request: Request) -> Response:
    """SageMaker's ``POST /invocations``: the request is told by its fields (as vLLM tells
    it): ``messages`` a chat, ``prompt`` a completion, ``input`` embeddings, ``text_1`` a
    score, ``query`` a rerank; then that route answers (it reads the same, cached, body)."""
    try:
        body = parse_json(await request.body())
    except ClientDisconnect:
        raise ClientDisconnected() from None
    for field_name, handler in _INVOCATION_KINDS:
        if field_name in body:
            return await handler(state, request)
    raise bad_request("cannot tell what this request is: send messages (chat), prompt (completions), input "
                      "(embeddings), text_1 and text_2 (score) or query and documents (rerank)")


# The API routes whose handler takes the server's state and the request: paths -> handler.
_API_ROUTES: list[tuple[tuple[str, ...], Callable[[ServerState, Request], Awaitable[Response]]]] = [
    (("/v1/completions",), create_completion),
    (("/v1/chat/completions",), create_chat_completion),
    (("/v1/embeddings",), create_embedding),
    (("/v1/score", "/score"), create_score),  # vLLM's paths (Cohere's clients post to /v2/rerank)
    (("/v1/rerank", "/rerank", "/v2/rerank"), create_rerank),
    (("/v1/messages",), create_message),
    (("/v1/messages/count_tokens",), count_message_tokens),
    (("/v1/responses",), create_response),
    (("/completion", "/completions"), create_llamacpp_completion),  # llama.cpp server's own API
    (("/infill",), create_llamacpp_infill),
    (("/embedding", "/embeddings"), create_llamacpp_embedding),
    (("/invocations",), create_invocation),  # Amazon SageMaker's one route (as vLLM's)
]

# Every path of those routes (what ``kvserve run-batch`` lines may post to).
API_PATHS = frozenset(path for paths, _ in _API_ROUTES for path in paths)


def _piece(data: bytes) -> str | list[int]:
    """A token's text for llama.cpp's ``with_pieces``: a string where its bytes are whole
    UTF-8, else the bytes (part of a character)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def _endpoint(handler: Callable[[ServerState, Request], Awaitable[Response]],
              state: ServerState) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await handler(state, request)

    endpoint.__name__ = handler.__name__  # the route's name (and OpenAPI operation id)
    return endpoint


def _add_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    for paths, handler in _API_ROUTES:
        endpoint = _endpoint(handler, state)
        for path in paths:
            app.add_api_route(path, endpoint, methods=["POST"])

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> JSONResponse:
        stored = state.responses.get(response_id)
        if stored is None:
            raise response_not_found(response_id)
        return JSONResponse(stored.body)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, limit: int = 20, order: str = "desc",
                               after: str | None = None) -> JSONResponse:
        stored = state.responses.get(response_id)
        if stored is None:
            raise response_not_found(response_id)
        return JSONResponse(input_items_page(stored.input_items, limit, order, after))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        if not state.responses.delete(response_id):
            raise response_not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        # A copy: the engine thread may load or unload an adapter meanwhile (--allow-runtime-lora).
        adapters = dict(engine.lora_adapters)
        return JSONResponse({"object": "list", "data": [
            _model_card(state, served, adapters) for served in [state.model_name, *state.model_aliases, *adapters]]})

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> JSONResponse:
        served = state.check_model(model)
        return JSONResponse(_model_card(state, model if model in state.model_aliases else served,
                                        dict(engine.lora_adapters)))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await read_model(request, TokenizeRequest)
        state.check_model(body.model)
        tok = engine.tokenizer
        if body.messages is not None:
            text = apply_template(tok, template_messages(body.messages, tool_format=state.tool_format),
                                  body.add_generation_prompt is not False and not body.continue_final_message,
                                  template_kwargs=body.chat_template_kwargs,
                                  continue_final_message=bool(body.continue_final_message))
            ids = tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
        elif body.content is not None:  # llama.cpp's shape
            ids = tok.encode(body.content, add_special_tokens=body.add_special)
        else:
            assert body.prompt is not None
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        tokens: list[Any] = [{"id": i, "piece": _piece(tok.token_bytes(i))} for i in ids] if body.with_pieces else ids
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": tokens})

    @app.post("/apply-template")
    async def apply_chat_template(request: Request) -> JSONResponse:
        """llama.cpp's route: the prompt the chat template makes of ``messages``."""
        body = await read_model(request, ApplyTemplateRequest)
        return JSONResponse({"prompt": apply_template(
            engine.tokenizer, template_messages(body.messages, tool_format=state.tool_format),
            body.add_generation_prompt, template_kwargs=body.chat_template_kwargs)})

    @app.get("/props")
    async def props() -> JSONResponse:
        """llama.cpp's route: what its clients read of the server (the context size, the
        chat template, the model's name and special tokens)."""
        tok = engine.tokenizer

        def text(token_id: int | None) -> str:
            return "" if token_id is None else tok.decode([token_id], skip_special_tokens=False)

        return JSONResponse({
            "default_generation_settings": {"n_ctx": engine.max_model_len, "model": state.model_name,
                                            "params": llamacpp_defaults(engine.sampling_overrides)},
            "model_alias": state.model_name, "chat_template": tok.chat_template or "",
            "bos_token": text(tok.bos_token_id), "eos_token": text(next(iter(tok.eos_token_ids), None)),
            "modalities": {"vision": False, "audio": False}, "build_info": f"kvserve {app.version}"})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await read_model(request, DetokenizeRequest)
        state.check_model(body.model)
        try:
            check_token_ids(body.tokens, engine.vocab_size, "tokens")
        except InvalidRequestError as e:
            raise bad_request(str(e), e.param) from None
        text = engine.tokenizer.decode(body.tokens)
        return JSONResponse({"prompt": text, "content": text})  # vLLM's key and llama.cpp's

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        """vLLM's route: the special tokens and the chat template, so that a client can
        tokenize through ``/tokenize`` alone (lm-evaluation-harness's remote tokenizer,
        which then needs no copy of the model's tokenizer)."""
        tok = engine.tokenizer

        def text(token_id: int | None) -> str | None:
            return None if token_id is None else tok.decode([token_id], skip_special_tokens=False)

        return JSONResponse({"tokenizer_class": "kvserve", "eos_token": text(next(iter(tok.eos_token_ids), None)),
                             "bos_token": text(tok.bos_token_id), "pad_token": None,
                             "chat_template": tok.chat_template, "model_max_length": engine.max_model_len})

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # Amazon SageMaker's health check (as vLLM's)
    async def health() -> Response:
        if not engine.is_alive:
            return unavailable("The engine loop has stopped.").response()
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if state.draining:
            return unavailable("The server is shutting down.").response()
        if not state.started or not engine.is_alive:
            return unavailable("The engine is not running.").response()
        if not getattr(engine, "is_ready", True):
            return unavailable("The engine loop is not making progress.").response()
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": app.version})
