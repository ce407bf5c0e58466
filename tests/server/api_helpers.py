"""Small builders and parsers shared by the server tests."""

from __future__ import annotations

import json
from typing import Any

import httpx
from fastapi import FastAPI

MODEL = "fake-model"


def client_for(app: FastAPI, **headers: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                             headers=headers)


def sse_events(body: str) -> list[Any]:
    """Parse an SSE body into its payloads (dicts, and the string ``"[DONE]"``).

    Asserts the framing: every event is exactly one ``data: ...`` line
    followed by a blank line.
    """
    assert body.endswith("\n\n"), body[-50:]
    events = []
    for block in body[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(response: httpx.Response, status: int, param: str | None = "__any__",
                 contains: str | None = None) -> dict[str, Any]:
    """Assert an OpenAI-shaped error and return its ``error`` object."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "__any__":
        assert err["param"] == param, err
    if contains is not None:
        assert contains in err["message"], err["message"]
    return err


# A chat whose earlier assistant turn carries its reasoning.
AFTER_REASONING = [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "Hello!", "reasoning_content": "Let me see."},
                   {"role": "user", "content": "again"}]


async def prompt_after_reasoning(client: httpx.AsyncClient) -> str:
    """The prompt the served engine got for ``AFTER_REASONING`` (a one-token chat), as text."""
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": AFTER_REASONING, "max_tokens": 1})
    assert r.status_code == 200, r.text
    engine = client._transport.app.state.kvserve.engine
    return engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)
