"""CORS for browser clients (vLLM's --allowed-origins ...) and --enable-log-requests."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from server.app import CORSSettings, build_app
from api_helpers import assert_error
from real_engine import ServedEngine

pytestmark = pytest.mark.anyio

PREFLIGHT = {"Origin": "http://chat.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@asynccontextmanager
async def serving(make_engine, **kwargs: Any) -> AsyncIterator[tuple[httpx.AsyncClient, ServedEngine]]:
    engine = make_engine()
    app = build_app(engine, **kwargs)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            yield c, engine


async def test_any_origin_by_default_and_a_preflight_needs_no_key(make_engine) -> None:
    async with serving(make_engine, api_key="secret") as (client, _):
        # A browser's preflight carries no Authorization header: answered before the key check.
        r = await client.options("/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]
        # The request itself still needs the key; its 401 carries the header the browser needs to read it.
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": "http://chat.example"})
        assert_error(r, 401)
        assert r.headers["access-control-allow-origin"] == "*"
        r = await client.post("/v1/chat/completions", json=CHAT,
                              headers={"Origin": "http://chat.example", "Authorization": "Bearer secret"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


async def test_only_the_allowed_origins_with_credentials(make_engine) -> None:
    cors = CORSSettings(allowed_origins=("http://chat.example",), allow_credentials=True,
                        allowed_methods=("GET", "POST"), allowed_headers=("content-type",))
    async with serving(make_engine, cors=cors) as (client, _):
        r = await client.options("/v1/chat/completions", headers={**PREFLIGHT, "Access-Control-Request-Headers":
                                                                   "content-type"})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://chat.example"
        assert r.headers["access-control-allow-credentials"] == "true"
        other = await client.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": "http://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        wrong_header = await client.options("/v1/chat/completions", headers=PREFLIGHT)  # asks for authorization
        assert wrong_header.status_code == 400


async def test_without_cors_no_headers(make_engine) -> None:
    async with serving(make_engine, cors=None) as (client, _):
        r = await client.get("/v1/models", headers={"Origin": "http://chat.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


async def test_requests_are_logged_only_when_asked_and_cut_to_max_log_len(caplog: pytest.LogCaptureFixture,
                                                                          make_engine) -> None:
    caplog.set_level(logging.INFO, logger="server.driver")
    async with serving(make_engine) as (client, _):
        await client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 2})
    assert "Received request" not in caplog.text
    async with serving(make_engine, log_requests=True, max_log_len=5) as (client, engine):
        r = await client.post("/v1/completions", json={"prompt": ["hello there, my good old friend", "ab"], "max_tokens": 2,
                                                       "temperature": 0.5})
        assert r.status_code == 200
    [line] = [rec.getMessage() for rec in caplog.records if "Received request" in rec.getMessage()]
    assert r.json()["id"] in line and "(model fake-model)" in line
    ids = engine.tokenizer.encode("hello there, my good old friend")
    assert len(ids) > 5
    assert f"prompt_token_ids: {ids[:5]!r}... ({len(ids)} in all)" in line
    assert "prompt 0: " in line and "... (" in line.split("prompt 0: ")[1].split(",")[0]
    assert f"prompt 1: {engine.tokenizer.decode(engine.tokenizer.encode('ab'), skip_special_tokens=False)!r}" in line
    assert "temperature=0.5" in line and "max_tokens=2" in line
