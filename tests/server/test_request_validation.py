"""Every client mistake in a request body is a 400 with an OpenAI error body."""

from __future__ import annotations

import httpx
import pytest

from api_helpers import MODEL, assert_error
from engine.validation import InvalidRequestError
from real_engine import MAX_MODEL_LEN, ServedEngine

pytestmark = pytest.mark.anyio

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
VOCAB = 49152  # the tiny model's (SmolLM2's) vocabulary: the first id past it


@pytest.mark.parametrize("raw, contains", [
    (b"{not json", "Invalid JSON"),
    (b"", "empty"),
    (b"[1, 2]", "JSON object"),
    (b'{"prompt": "hi", "temperature": NaN}', "NaN"),
    (b'{"prompt": "hi", "temperature": Infinity}', "Infinity"),
    (b'{"prompt": "hi", "temperature": -Infinity}', "Infinity"),
    (b'{"prompt": "hi", "temperature": 1e999}', "out of range"),
    (b'{"prompt": "\\ud800"}', "surrogate"),
    (b'{"prompt": "ok", "stop": ["\\udfff"]}', "surrogate"),
    (b'{"prompt": "\xff\xfe"}', "UTF-8"),
    (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "Invalid JSON"),
])
async def test_malformed_bodies(client: httpx.AsyncClient, raw: bytes, contains: str) -> None:
    r = await client.post(CMPL, content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400, contains=contains)


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "hi", "max_tokens": "16"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "n": True}, "n"),
    ({"prompt": "hi", "stop": [1]}, "stop"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["ok", ""]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": [1, VOCAB]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "hi", "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"prompt": "hi", "logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 1000}, "n"),
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, None),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "logprobs": -1}, "logprobs"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hi", "top_k": -2}, "top_k"),
    ({"prompt": "hi", "min_p": 2}, "min_p"),
    ({"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "hi", "seed": 2**64}, "seed"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, None),
    ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ({"prompt": "hi", "best_of": 3}, None),
    ({"prompt": "hi", "echo": True, "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "echo": True, "max_tokens": 0, "min_tokens": 2}, None),
    ({"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
])
async def test_completion_400s(client: httpx.AsyncClient, body: dict, param: str | None) -> None:
    r = await client.post(CMPL, json={"model": MODEL, **body})
    assert_error(r, 400, param=param)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ({"messages": MSGS, "max_completion_tokens": 0}, "max_tokens"),
    ({"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "logprobs"),
    ({"messages": MSGS, "top_logprobs": 2}, None),
    ({"messages": MSGS, "logprobs": 1}, "logprobs"),
    ({"messages": MSGS, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": MSGS, "tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "colour": "red"}}]}, "tools"),
    ({"messages": MSGS, "tools": [TOOL, TOOL]}, "tools"),
    ({"messages": MSGS, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"messages": MSGS, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MSGS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": MSGS, "tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages"),
    ({"messages": MSGS, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": MSGS, "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"messages": MSGS, "response_format": {"type": "json_object", "schema": {}}}, "response_format"),
    ({"messages": MSGS, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"messages": MSGS, "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"messages": MSGS, "grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "json_schema"),
    ({"messages": MSGS, "response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar"),
    ({"messages": MSGS, "grammar": ""}, "grammar"),
    ({"messages": MSGS, "json_schema": "an object, please"}, "json_schema"),
    ({"messages": MSGS, "structured_outputs": {}}, "structured_outputs"),
    ({"messages": MSGS, "structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"messages": MSGS, "structured_outputs": {"json": "{oops"}}, "structured_outputs"),
    ({"messages": MSGS, "structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
    ({"messages": MSGS, "temperature": -1}, "temperature"),
])
async def test_chat_400s(client: httpx.AsyncClient, body: dict, param: str | None) -> None:
    r = await client.post(CHAT, json={"model": MODEL, **body})
    assert_error(r, 400, param=param)


async def test_prompt_plus_max_tokens_over_context(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    n = len(engine.tokenizer.encode("hi"))
    over = MAX_MODEL_LEN - n + 1
    r = await client.post(CMPL, json={"prompt": "hi", "max_tokens": over})
    err = assert_error(r, 400, param="prompt")
    assert str(MAX_MODEL_LEN) in err["message"] and str(MAX_MODEL_LEN + 1) in err["message"]
    assert f"{n} in the prompt" in err["message"] and f"{over} for the completion" in err["message"]
    ok = await client.post(CMPL, json={"prompt": "hi", "max_tokens": over - 1})
    assert ok.status_code == 200


async def test_prompt_alone_fills_context(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    content = "x " * 300
    assert len(engine.tokenizer.encode(content)) > MAX_MODEL_LEN
    r = await client.post(CHAT, json={"messages": [{"role": "user", "content": content}]})
    err = assert_error(r, 400, param="messages")
    assert str(MAX_MODEL_LEN) in err["message"] and "tokens" in err["message"]


async def test_engine_value_error_is_400(client: httpx.AsyncClient, engine) -> None:
    # A limit only the engine knows still reaches the client as a 400, streaming or not.
    saved = engine.generate

    def refusing(*args, **kwargs):
        raise InvalidRequestError("prompt (3) + max_tokens (2) exceeds max_model_len (4)", "max_tokens")

    engine.generate = refusing
    try:
        for stream in (False, True):
            r = await client.post(CMPL, json={"prompt": "hi", "max_tokens": 2, "stream": stream})
            assert_error(r, 400, param="max_tokens", contains="exceeds max_model_len (4)")
    finally:
        engine.generate = saved


async def test_unknown_fields_are_ignored(client: httpx.AsyncClient) -> None:
    r = await client.post(CMPL, json={"prompt": "hi", "max_tokens": 1, "something_new": 1})
    assert r.status_code == 200


@pytest.mark.parametrize("path, field, value, advice", [
    (CMPL, "guided_json", {"type": "object"}, 'structured_outputs: {"json": ...}'),
    (CHAT, "guided_choice", ["a", "b"], 'structured_outputs: {"choice": ...}'),
    (CHAT, "guided_regex", "[a-z]+", 'structured_outputs: {"regex": ...}'),
    (CHAT, "functions", [{"name": "f", "parameters": {"type": "object"}}], "tools: "),
    (CHAT, "function_call", "auto", "tool_choice"),
])
async def test_constraints_asked_in_other_apis_words_are_400_not_ignored(
        client: httpx.AsyncClient, path: str, field: str, value, advice: str) -> None:
    # Ignored like an unknown field, the answer would come back unconstrained.
    body = {"prompt": "hi"} if path == CMPL else {"messages": [{"role": "user", "content": "hi"}]}
    r = await client.post(path, json={**body, "max_tokens": 1, field: value})
    assert_error(r, 400, param=field, contains=f"{field} is not supported; use {advice}")
    assert (await client.post(path, json={**body, "max_tokens": 1, field: None})).status_code == 200


async def test_client_errors_never_5xx(client: httpx.AsyncClient) -> None:
    # A grab bag of nonsense on every POST route.
    junk = [b"null", b"1", b'"s"', b"{}", b'{"prompt": {"a": 1}}', b'{"messages": [null]}',
            b'{"tokens": ["a"]}', b'{"model": 5}']
    for path in (CMPL, CHAT, "/tokenize", "/detokenize"):
        for raw in junk:
            r = await client.post(path, content=raw)
            assert 400 <= r.status_code < 500, (path, raw, r.status_code, r.text)
