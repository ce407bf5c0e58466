"""The small routes: models, tokenize/detokenize, health, ready, version."""

from __future__ import annotations

import httpx
import pytest

from api_helpers import MODEL, assert_error, client_for
from fake_engine import FakeEngine
from server.app import build_app

pytestmark = pytest.mark.anyio


async def test_models(client: httpx.AsyncClient) -> None:
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == 256
    assert {"created", "owned_by"} <= set(card)
    assert (await client.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL


async def test_tokenize_prompt(client: httpx.AsyncClient) -> None:
    r = await client.post("/tokenize", json={"prompt": "hi"})
    assert r.json() == {"count": 3, "max_model_len": 256, "tokens": [256, 104, 105]}
    r = await client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False})
    assert r.json()["tokens"] == [104, 105]


async def test_tokenize_messages_matches_chat_prompt(client: httpx.AsyncClient,
                                                     engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "hi"}]
    tokens = (await client.post("/tokenize", json={"messages": messages})).json()["tokens"]
    await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert tokens == engine.requests[-1].prompt_token_ids


@pytest.mark.parametrize("body", [{}, {"prompt": "a", "messages": []}, {"messages": []},
                                  {"prompt": 3}, {"prompt": "a", "content": "a"},
                                  {"content": "a", "parse_special": False}])
async def test_tokenize_400(client: httpx.AsyncClient, body: dict) -> None:
    assert_error(await client.post("/tokenize", json=body), 400)


async def test_detokenize(client: httpx.AsyncClient) -> None:
    r = await client.post("/detokenize", json={"tokens": [256, 104, 105]})
    assert r.json() == {"prompt": "hi", "content": "hi"}  # vLLM's key and llama.cpp's
    assert_error(await client.post("/detokenize", json={"tokens": [104, 9999]}), 400,
                 param="tokens", contains="9999")
    assert_error(await client.post("/detokenize", json={"tokens": "hi"}), 400, param="tokens")


async def test_tokenizer_info_names_the_special_tokens(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    info = (await client.get("/tokenizer_info")).json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>" and info["pad_token"] is None
    assert info["chat_template"] == engine.tokenizer.chat_template
    assert info["model_max_length"] == 256


async def test_health_ready_version(engine: FakeEngine) -> None:
    app = build_app(engine)
    async with client_for(app) as c:
        assert (await c.get("/health")).status_code == 200
        # Not ready until the lifespan has started the engine.
        assert_error(await c.get("/ready"), 503)
        async with app.router.lifespan_context(app):
            assert engine.started
            assert (await c.get("/ready")).status_code == 200
            assert (await c.get("/version")).json()["version"]
        assert engine.shut_down


async def test_sagemaker_invocations_are_told_by_their_fields(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    chat = (await client.post("/invocations", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2})).json()
    assert chat["object"] == "chat.completion"
    assert (await client.post("/invocations", json={"prompt": "hi", "max_tokens": 2})).json()["object"] == \
        "text_completion"
    assert (await client.post("/invocations", json={"input": "hi"})).json()["object"] == "list"
    score = (await client.post("/invocations", json={"text_1": "a", "text_2": "b"})).json()
    assert score["data"][0]["object"] == "score"
    rerank = (await client.post("/invocations", json={"query": "a", "documents": ["b", "c"]})).json()
    assert len(rerank["results"]) == 2
    # Each route's own checks still answer: a bad chat body is the chat route's 400.
    assert_error(await client.post("/invocations", json={"messages": [], "max_tokens": 2}), 400, "messages")
    err = assert_error(await client.post("/invocations", json={"model": MODEL}), 400)
    assert "messages (chat)" in err["message"]
    assert_error(await client.post("/invocations", content=b"[1]"), 400)


async def test_sagemaker_ping_is_health(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    for method in ("GET", "POST"):
        r = await client.request(method, "/ping")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    engine.is_alive = False
    assert_error(await client.get("/ping"), 503)
