"""A tiny OpenAI-compatible streaming server for the load generator's tests.

Words are tokens: ``/tokenize`` splits on whitespace (vLLM/kvserve or
llama-server body shapes), and ``/v1/completions`` streams ``max_tokens`` tokens,
``tokens_per_chunk`` per SSE event, ``delay`` seconds apart.

NOTE: tests/ has no __init__.py; the bench tests import this file by bare name.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "fake-model"


@dataclass
class FakeSettings:
    dialect: str = "vllm"          # /tokenize shape: "vllm", "llama" or "none" (404)
    usage: bool = True             # honour stream_options.include_usage
    tokens_per_chunk: int = 1
    delay: float = 0.002           # seconds before each chunk
    fail_every: int = 0            # every n-th completion answers 503 (0: never)
    bodies: list[dict] = field(default_factory=list)  # every /v1/completions body received


def build_app(s: FakeSettings) -> FastAPI:
    app = FastAPI()
    vocab: dict[str, int] = {}
    words: list[str] = []

    def ids(text: str) -> list[int]:
        for w in text.split():
            if w not in vocab:
                vocab[w] = len(words)
                words.append(w)
        return [vocab[w] for w in text.split()]

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await request.json()
        key = {"vllm": "prompt", "llama": "content"}.get(s.dialect)
        if key is None:
            return JSONResponse({"error": "no such route"}, status_code=404)
        if key not in body:
            return JSONResponse({"error": f"missing {key}"}, status_code=400)
        return JSONResponse({"tokens": ids(body[key])})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        text = " ".join(words[i] for i in (await request.json())["tokens"])
        return JSONResponse({"prompt" if s.dialect == "vllm" else "content": text})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        s.bodies.append(body)
        if s.fail_every and len(s.bodies) % s.fail_every == 0:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        n = body["max_tokens"]
        include_usage = s.usage and (body.get("stream_options") or {}).get("include_usage")

        def event(obj: dict) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        async def stream():
            sent = 0
            while sent < n:
                await asyncio.sleep(s.delay)
                k = min(s.tokens_per_chunk, n - sent)
                text = "".join(f" t{sent + j}" for j in range(k))
                sent += k
                yield event({"object": "text_completion",
                             "choices": [{"index": 0, "text": text, "finish_reason": None}]})
            yield event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            if include_usage:
                yield event({"choices": [], "usage": {
                    "prompt_tokens": len(body["prompt"].split()), "completion_tokens": n,
                    "total_tokens": len(body["prompt"].split()) + n}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(settings: FakeSettings) -> Iterator[str]:
    """The fake app on a free loopback port in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(settings), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
