"""What a hostile client tries, over ASGI with the real engine on the tiny checkpoint: a burst past --max-queue,
a drain that runs out of time, one body of many prompts, min_tokens past the context,
a client that hangs up while its body is read, and /metrics behind the key."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest

from api_helpers import assert_error, client_for, sse_events
from real_engine import MAX_MODEL_LEN, ServedEngine
from server.app import build_app
from server.protocol import MAX_PROMPTS

pytestmark = pytest.mark.anyio


def disconnects(app: Any) -> float:
    return app.state.kvserve.metrics.client_disconnected._value.get()


async def test_a_burst_is_bounded_by_max_queue_exactly(make_engine) -> None:
    engine = make_engine()
    engine.step_delay = 0.05  # 20 tokens: a second each, longer than the burst
    app = build_app(engine, max_queue=4)
    body = {"prompt": "hi", "max_tokens": 20, "ignore_eos": True}
    async with app.router.lifespan_context(app), client_for(app) as c:
        responses = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(20)))
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * 4 + [503] * 16
    assert all(int(r.headers["retry-after"]) >= 1 for r in responses if r.status_code == 503)
    assert len(engine.requests) == 4, "a refused request never reached the engine"
    assert app.state.kvserve.in_flight == {}


async def test_a_drain_past_its_timeout_ends_every_stream_with_an_error_and_done(
        caplog: pytest.LogCaptureFixture, make_engine) -> None:
    engine = make_engine()
    engine.step_delay = 0.02
    app = build_app(engine)
    state = app.state.kvserve
    long = {"prompt": "hi", "max_tokens": 250, "ignore_eos": True}
    async with app.router.lifespan_context(app), client_for(app) as c:
        streams = [asyncio.ensure_future(c.post("/v1/completions", json={**long, "stream": True}))
                   for _ in range(3)]
        whole = asyncio.ensure_future(c.post("/v1/completions", json=long))
        while len(engine.requests) < 4:
            await asyncio.sleep(0.01)
        with caplog.at_level(logging.WARNING, logger="server.state"):
            state.begin_drain(0.2)
            results = await asyncio.wait_for(asyncio.gather(*streams, whole), 10)
    for r in results[:3]:
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["code"] == "service_unavailable" and "shutting down" in error["message"]
        assert any(e["choices"] for e in events[:-2]), "the stream had started"
    err = assert_error(results[3], 503)
    assert "shutting down" in err["message"]
    aborted = [r for r in caplog.records if "aborting request" in r.getMessage()]
    assert len(aborted) == 4  # one line per aborted request
    assert engine.num_unfinished_requests == 0 and state.in_flight == {}


async def test_requests_that_finish_within_the_drain_are_not_aborted(make_engine) -> None:
    engine = make_engine()
    engine.step_delay = 0.01
    app = build_app(engine)
    async with app.router.lifespan_context(app), client_for(app) as c:
        pending = asyncio.ensure_future(
            c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "ignore_eos": True, "stream": True}))
        while not engine.requests:
            await asyncio.sleep(0.01)
        app.state.kvserve.begin_drain(5.0)
        r = await asyncio.wait_for(pending, 10)
        assert_error(await c.post("/v1/completions", json={"prompt": "hi"}), 503)
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


async def test_prompts_per_request_are_bounded(engine: ServedEngine, client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": ["x"] * (MAX_PROMPTS + 1), "max_tokens": 1})
    err = assert_error(r, 400, param="prompt")
    assert str(MAX_PROMPTS) in err["message"]
    r = await client.post("/v1/completions", json={"prompt": ["x"] * MAX_PROMPTS, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_PROMPTS


async def test_the_prompts_of_one_request_form_one_group(engine: ServedEngine,
                                                         client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 1})
    assert r.status_code == 200
    assert len(set(engine.groups.values())) == 1 and len(engine.groups) == 3
    assert r.json()["id"] in engine.groups.values()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": None, "min_tokens": 4000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 2**63}),
])
async def test_min_tokens_past_the_context_is_400(client: httpx.AsyncClient, path: str,
                                                  body: dict) -> None:
    err = assert_error(await client.post(path, json=body), 400, param="min_tokens")
    assert f"{MAX_MODEL_LEN} tokens" in err["message"]  # the engine's context


async def test_a_client_that_hangs_up_while_its_body_is_read_is_counted_not_an_error(
        engine: ServedEngine, caplog: pytest.LogCaptureFixture) -> None:
    app = build_app(engine)
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": b'{"prompt": "hi', "more_body": True},
                {"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("t", 80),
             "headers": [(b"content-type", b"application/json")]}
    with caplog.at_level(logging.INFO):
        await app(scope, receive, send)
    assert sent[0]["status"] == 499
    assert disconnects(app) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert any("client disconnected" in r.getMessage() for r in caplog.records)
    assert engine.requests == []


async def test_metrics_can_require_the_key(engine: ServedEngine, make_engine) -> None:
    open_app = build_app(engine, api_key="k")
    async with client_for(open_app) as c:
        assert (await c.get("/metrics")).status_code == 200
    app = build_app(make_engine(), api_key="k", metrics_require_key=True)
    async with app.router.lifespan_context(app), client_for(app) as c:
        assert_error(await c.get("/metrics"), 401)
        assert (await c.get("/metrics", headers={"Authorization": "Bearer k"})).status_code == 200
        assert (await c.get("/health")).status_code == 200
    with pytest.raises(ValueError, match="api_key"):
        build_app(engine, metrics_require_key=True)
