"""The small routes: models, tokenize/detokenize, health, ready, version."""

from __future__ import annotations

import httpx
import pytest

from api_helpers import MODEL, assert_error, client_for
from real_engine import MAX_MODEL_LEN, ServedEngine
from server.app import build_app

pytestmark = pytest.mark.anyio


async def test_models(client: httpx.AsyncClient) -> None:
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN
    assert {"created", "owned_by"} <= set(card)
    assert (await client.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL


async def test_tokenize_prompt(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    tokens = engine.tokenizer.encode("hi, there")
    r = await client.post("/tokenize", json={"prompt": "hi, there"})
    assert r.json() == {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens}
    r = await client.post("/tokenize", json={"prompt": "hi, there", "add_special_tokens": False})
    assert r.json()["tokens"] == engine.tokenizer.encode("hi, there", add_special_tokens=False)


async def test_tokenize_messages_matches_chat_prompt(client: httpx.AsyncClient,
                                                     engine: ServedEngine) -> None:
    messages = [{"role": "user", "content": "hi"}]
    tokens = (await client.post("/tokenize", json={"messages": messages})).json()["tokens"]
    await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert tokens == engine.requests[-1].prompt_token_ids


@pytest.mark.parametrize("body", [{}, {"prompt": "a", "messages": []}, {"messages": []},
                                  {"prompt": 3}, {"prompt": "a", "content": "a"},
                                  {"content": "a", "parse_special": False}])
async def test_tokenize_400(client: httpx.AsyncClient, body: dict) -> None:
    assert_error(await client.post("/tokenize", json=body), 400)


async def test_detokenize(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await client.post("/detokenize", json={"tokens": engine.tokenizer.encode("hi, there")})
    assert r.json() == {"prompt": "hi, there", "content": "hi, there"}  # vLLM's key and llama.cpp's
    past_the_vocabulary = engine.vocab_size + 7
    assert_error(await client.post("/detokenize", json={"tokens": [104, past_the_vocabulary]}), 400,
                 param="tokens", contains=str(past_the_vocabulary))
    assert_error(await client.post("/detokenize", json={"tokens": "hi"}), 400, param="tokens")


async def test_tokenizer_info_names_the_special_tokens(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    info = (await client.get("/tokenizer_info")).json()
    tok = engine.tokenizer
    assert info["eos_token"] == tok.decode([tok.eos_token_ids[0]], skip_special_tokens=False) == "<|im_end|>"
    assert info["bos_token"] == tok.decode([tok.bos_token_id], skip_special_tokens=False) == "<|im_start|>"
    assert info["pad_token"] is None
    assert info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == MAX_MODEL_LEN


async def test_health_ready_version(engine: ServedEngine) -> None:
    app = build_app(engine)
    async with client_for(app) as c:
        # Neither alive nor ready until the lifespan has started the engine.
        assert_error(await c.get("/health"), 503)
        assert_error(await c.get("/ready"), 503)
        async with app.router.lifespan_context(app):
            assert engine.started
            assert (await c.get("/health")).status_code == 200
            assert (await c.get("/ready")).status_code == 200
            assert (await c.get("/version")).json()["version"]
        assert engine.shut_down


async def test_sagemaker_invocations_are_told_by_their_fields(client: httpx.AsyncClient, engine: ServedEngine) -> None:
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


async def test_sagemaker_ping_is_health(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    for method in ("GET", "POST"):
        r = await client.request(method, "/ping")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    await engine.inner.shutdown()  # the engine loop is gone
    assert_error(await client.get("/ping"), 503)
