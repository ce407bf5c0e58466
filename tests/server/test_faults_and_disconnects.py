"""Engine faults mid-stream, and client disconnects aborting engine requests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
import pytest

import server.driver
from api_helpers import assert_error, sse_events
from engine.sampling_params import SamplingParams
from real_engine import ServedEngine, answer
from server.app import build_app

pytestmark = pytest.mark.anyio

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("fault", ["error", "raise"])
async def test_fault_mid_stream_sends_error_then_done(engine: ServedEngine,
                                                      client: httpx.AsyncClient, fault: str) -> None:
    engine.fail_after_steps, engine.fault = 2, fault
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 10,
                                                        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    chunks = events[:-2]
    engine.fail_after_steps = None
    [(first_two, _)] = await answer(engine, engine.requests[-1].prompt_token_ids,
                                    SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert first_two and "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == first_two
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    if fault == "raise":
        assert_error(await client.get("/health"), 503)


@pytest.mark.parametrize("stream", [False, True])
async def test_fault_before_output_is_500(engine: ServedEngine, client: httpx.AsyncClient,
                                          stream: bool) -> None:
    engine.fail_after_steps = 0
    r = await client.post("/v1/completions", json={"prompt": "hi", "stream": stream})
    err = assert_error(r, 500)
    assert err["code"] == "engine_error" and "simulated engine fault" in err["message"]


async def test_fault_in_one_of_several_prompts(engine: ServedEngine, client: httpx.AsyncClient) -> None:
    engine.fail_after_steps = 3
    r = await client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 8})
    assert_error(r, 500)
    assert engine.num_unfinished_requests == 0


# --- disconnects, driven through raw ASGI so the client can vanish mid-request ---

async def drive(app: Any, body: dict[str, Any], path: str,
                disconnect_when: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
    """Run one request; the client disconnects once ``disconnect_when(sent)`` holds."""
    raw = json.dumps(body).encode()
    sent: list[dict[str, Any]] = []
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if disconnect_when(sent):
            gone.set()

    async def watchdog() -> None:
        while not gone.is_set():
            if disconnect_when(sent):
                gone.set()
            await asyncio.sleep(0.005)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1234), "server": ("test", 80)}
    dog = asyncio.ensure_future(watchdog())
    try:
        with anyio.fail_after(10):
            await app(scope, receive, send)
    finally:
        dog.cancel()
    return sent


@pytest.fixture
async def slow_engine(engine: ServedEngine, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ServedEngine]:
    """The engine, started (the tests drive the app without its lifespan), 10 ms a step."""
    engine.step_delay = 0.01  # 200 tokens would take 2 s
    monkeypatch.setattr(server.driver, "DISCONNECT_POLL_SECONDS", 0.01)
    await engine.start()
    yield engine
    await engine.shutdown()


def after(seconds: float) -> Callable[[list[dict[str, Any]]], bool]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    return lambda sent: loop.time() >= deadline


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 200}),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 200}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 200}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 200}),
    ("/v1/messages", {**CHAT, "max_tokens": 200}),
])
async def test_non_streaming_disconnect_aborts(slow_engine: ServedEngine, path: str,
                                               body: dict) -> None:
    app = build_app(slow_engine)
    await drive(app, body, path, after(0.1))
    assert slow_engine.requests and all(r.aborted for r in slow_engine.requests)
    assert sorted(slow_engine.aborted) == sorted(r.request_id for r in slow_engine.requests)
    assert all(sum(len(o.token_ids) for out in r.outputs for o in out.outputs if o.index == i) < 200
               for r in slow_engine.requests for i in range(r.params.n))
    assert slow_engine.num_unfinished_requests == 0


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 200, "stream": True}),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 200, "stream": True}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 200, "stream": True, "n": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 200, "stream": True}),
    ("/v1/messages", {**CHAT, "max_tokens": 200, "stream": True}),
])
async def test_streaming_disconnect_aborts(slow_engine: ServedEngine, path: str, body: dict) -> None:
    app = build_app(slow_engine)
    sent = await drive(app, body, path,
                       lambda sent: sum(m["type"] == "http.response.body" for m in sent) >= 5)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert not any(b"[DONE]" in m.get("body", b"") for m in sent)
    assert slow_engine.requests and all(r.aborted for r in slow_engine.requests)
    assert slow_engine.num_unfinished_requests == 0


async def test_streaming_disconnect_seen_by_send_aborts(slow_engine: ServedEngine) -> None:
    # ASGI spec 2.4 servers report a gone client by failing ``send`` (OSError)
    # instead of a disconnect message; the stream must still abort at once.
    app = build_app(slow_engine)
    raw = json.dumps({"prompt": "hi", "max_tokens": 200, "stream": True}).encode()
    bodies = 0

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal bodies
        bodies += message["type"] == "http.response.body"
        if bodies > 3:
            raise OSError("connection reset")

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1234), "server": ("test", 80)}
    with anyio.fail_after(10):
        await app(scope, receive, send)  # a gone client is no error of the server's
    assert slow_engine.requests[0].aborted
    assert slow_engine.num_unfinished_requests == 0
    assert app.state.kvserve.metrics.client_disconnected._value.get() == 1


async def test_disconnect_while_waiting_for_first_token(slow_engine: ServedEngine) -> None:
    slow_engine.step_delay = 5.0
    app = build_app(slow_engine)
    sent = await drive(app, {"prompt": "hi", "stream": True}, "/v1/completions", after(0.05))
    assert all(r.aborted for r in slow_engine.requests)
    assert sent[0]["status"] == 499
