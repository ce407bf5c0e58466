"""POST /v1/chat/completions: the wire format, streaming and not, against the real engine on the
tiny checkpoint, served with a plain chat template (``PLAIN_TEMPLATE``) so rendered prompts read easily.
Answers are the engine's own for the same prompt and params, run directly (``greedy``)."""

from __future__ import annotations

import httpx
import pytest

from api_helpers import MODEL, assert_error, sse_events
from real_engine import GREEDY, PLAIN_TEMPLATE, ServedEngine, a_stop_string, greedy, logprob_entry, name

pytestmark = pytest.mark.anyio

HELLO = [{"role": "user", "content": "hi"}]
@pytest.fixture
def engine(make_engine) -> ServedEngine:
    return make_engine(chat_template=PLAIN_TEMPLATE)


def chat_prompt(engine: ServedEngine, messages=HELLO) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages), add_special_tokens=False)


async def chat(client: httpx.AsyncClient, messages=HELLO, **body) -> httpx.Response:
    return await client.post("/v1/chat/completions",
                             json={"model": MODEL, "messages": messages, **body})


async def test_non_streaming_shape(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await chat(client, max_tokens=5, **GREEDY)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    prompt = engine.tokenizer.encode("<|user|>hi\n<|assistant|>", add_special_tokens=False)
    content = (await greedy(engine, prompt, 5)).text
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": content},
                                "logprobs": None, "finish_reason": "length"}]
    assert engine.requests[-1].prompt_token_ids == prompt
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 5,
                             "total_tokens": len(prompt) + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_default_max_tokens_is_rest_of_context(client: httpx.AsyncClient,
                                                     engine: ServedEngine) -> None:
    r = await chat(client, ignore_eos=True)
    usage = r.json()["usage"]
    assert engine.requests[-1].params.max_tokens is None
    assert usage["total_tokens"] == engine.max_model_len


async def test_max_completion_tokens_wins(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    await chat(client, max_tokens=9, max_completion_tokens=3)
    assert engine.requests[-1].params.max_tokens == 3


async def test_chat_template_kwargs_reach_the_template(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await chat(client, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200, r.text
    assert engine.tokenizer.decode(engine.requests[-1].prompt_token_ids) == \
        "<|user|>hi\n<|assistant|>[enable_thinking=False]"
    tokenized = await client.post("/tokenize", json={"messages": HELLO, "chat_template_kwargs": {"x": 1}})
    assert engine.tokenizer.decode(tokenized.json()["tokens"]) == "<|user|>hi\n<|assistant|>[x=1]"
    err = assert_error(await chat(client, chat_template_kwargs={"messages": []}), 400, "chat_template_kwargs")
    assert "may not set 'messages'" in err["message"]
    assert_error(await chat(client, chat_template_kwargs=["enable_thinking"]), 400, "chat_template_kwargs")


async def test_continue_final_message_goes_on_with_the_last_turn(client: httpx.AsyncClient,
                                                                  engine: ServedEngine) -> None:
    prefill = HELLO + [{"role": "assistant", "content": "Sure: "}]
    r = await chat(client, prefill, max_tokens=1, continue_final_message=True)
    assert r.status_code == 200, r.text
    assert engine.tokenizer.decode(engine.requests[-1].prompt_token_ids) == "<|user|>hi\n<|assistant|>Sure: "
    tokenized = await client.post("/tokenize", json={"messages": prefill, "continue_final_message": True})
    assert tokenized.json()["tokens"] == engine.requests[-1].prompt_token_ids
    assert_error(await chat(client, continue_final_message=True), 400, "continue_final_message")
    assert_error(await chat(client, prefill, continue_final_message=True, add_generation_prompt=True), 400,
                 "add_generation_prompt")
    assert_error(await client.post("/tokenize", json={"messages": HELLO, "continue_final_message": True}), 400,
                 "continue_final_message")


async def test_content_parts_and_system(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]}]
    r = await chat(client, messages, max_tokens=1)
    assert r.status_code == 200, r.text
    text = engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)
    assert text == "<|system|>be brief\n<|user|>a\nb\n<|assistant|>"


async def test_n_and_stop(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    text = (await greedy(engine, chat_prompt(engine), 20)).text
    stop = a_stop_string(text)
    r = await chat(client, n=2, stop=[stop], max_tokens=20, **GREEDY)
    choices = r.json()["choices"]
    cut = text[:text.find(stop)]
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in choices] == [
        (0, cut, "stop"), (1, cut, "stop")]


async def test_prompt_logprobs_once_for_the_response(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    body = (await client.post("/v1/chat/completions", json={
        "messages": HELLO, "max_tokens": 2, "n": 2, "prompt_logprobs": 0})).json()
    prompt = engine.requests[-1].prompt_token_ids
    entries = body["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    first = (await greedy(engine, prompt, 1, prompt_logprobs=0)).prompt_logprobs[1]
    assert entries[1] == {str(prompt[1]): {"logprob": first.logprob, "rank": first.rank,
                                           "decoded_token": name(engine, prompt[1])}}
    assert list(body)[-1] == "prompt_logprobs"
    plain = (await client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 1})).json()
    assert "prompt_logprobs" not in plain


async def test_logprobs(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await chat(client, max_tokens=2, logprobs=True, top_logprobs=2, **GREEDY)
    content = r.json()["choices"][0]["logprobs"]["content"]
    g = await greedy(engine, chat_prompt(engine), 2, logprobs=2)
    first = g.logprobs[0]
    assert content[0] == {**logprob_entry(engine, first.token_id, first.logprob),
                          "top_logprobs": [logprob_entry(engine, t, v) for t, v in first.top]}
    assert len(content[0]["top_logprobs"]) == 2
    assert [c["token"] for c in content] == [name(engine, t) for t in g.token_ids]


@pytest.mark.parametrize("stream", [False, True])
async def test_tokens_as_token_ids(client: httpx.AsyncClient, engine: ServedEngine, stream: bool) -> None:
    r = await chat(client, max_tokens=2, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True,
                   stream=stream, **GREEDY)
    if stream:
        content = [e for c in sse_events(r.text)[:-1] if c["choices"] and c["choices"][0]["logprobs"]
                   for e in c["choices"][0]["logprobs"]["content"]]
    else:
        content = r.json()["choices"][0]["logprobs"]["content"]
    # Named by id; the bytes are still the token's own.
    g = await greedy(engine, chat_prompt(engine), 2, logprobs=2)
    first = g.logprobs[0]
    assert content[0] == {**logprob_entry(engine, first.token_id, first.logprob, as_id=True),
                          "top_logprobs": [logprob_entry(engine, t, v, as_id=True) for t, v in first.top]}
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in g.token_ids]


async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client: httpx.AsyncClient) -> None:
    plain = (await chat(client, max_tokens=4, **GREEDY)).json()
    events = sse_events((await chat(client, max_tokens=4, stream=True, **GREEDY, stream_options={
        "include_usage": True, "continuous_usage_stats": True})).text)[:-1]
    generated = [e["usage"]["completion_tokens"] for e in events]
    assert generated[0] == 0 and generated == sorted(generated)  # the role chunk comes first
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # the second request hits the cache
    assert [events[-1]["usage"][k] for k in counts] == [plain["usage"][k] for k in counts]
    assert events[-1]["choices"] == []


async def test_streaming_wire_format(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await chat(client, max_tokens=4, stream=True, **GREEDY)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for c in chunks:
        assert set(c) == {"id", "object", "created", "model", "choices"}
        assert c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-")
        assert set(c["choices"][0]) == {"index", "delta", "logprobs", "finish_reason"}
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        (await greedy(engine, chat_prompt(engine), 4)).text
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": "length"}
    assert [c["choices"][0]["finish_reason"] for c in chunks].count(None) == len(chunks) - 1


async def test_streaming_n2_include_usage(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await chat(client, n=2, max_tokens=3, stream=True, stream_options={"include_usage": True}, **GREEDY)
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert all(c["usage"] is None for c in chunks)
    text = (await greedy(engine, chat_prompt(engine), 3)).text
    for idx in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == idx]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(m["delta"].get("content", "") for m in mine) == text
        assert [m["finish_reason"] for m in mine if m["finish_reason"]] == ["length"]


async def test_streaming_stop_never_leaks_stop_text(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    text = (await greedy(engine, chat_prompt(engine), 30)).text
    stop = a_stop_string(text)
    r = await chat(client, stop=[stop], max_tokens=30, stream=True, **GREEDY)
    chunks = sse_events(r.text)[:-1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text[:text.find(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_stream_equals_non_stream(client: httpx.AsyncClient) -> None:
    plain = (await chat(client, max_tokens=12, **GREEDY)).json()["choices"][0]["message"]["content"]
    chunks = sse_events((await chat(client, max_tokens=12, stream=True, **GREEDY)).text)[:-1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == plain


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("body, kind, value", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": SCHEMA, "strict": True}}},
     "json", SCHEMA),
    ({"response_format": {"type": "json_object"}}, "json_object", None),
    ({"response_format": {"type": "text"}}, None, None),
    ({"structured_outputs": {"json": SCHEMA}}, "json", SCHEMA),
    ({"structured_outputs": {"regex": "[ab]+"}}, "regex", "[ab]+"),
    ({"structured_outputs": {"choice": ["x", "y"]}}, "choice", ("x", "y")),
    ({"structured_outputs": {"grammar": "start: \"a\""}}, "grammar", "start: \"a\""),
    ({"structured_outputs": {"json_object": True}}, "json_object", None),
    # llama.cpp's server's fields.
    ({"grammar": 'root ::= "a" | "b"'}, "grammar", 'root ::= "a" | "b"'),
    ({"json_schema": SCHEMA}, "json", SCHEMA),
])
async def test_structured_output_reaches_the_engine(client: httpx.AsyncClient, engine: ServedEngine,
                                                    body: dict, kind: str | None, value) -> None:
    for route, extra in (("/v1/chat/completions", {"messages": HELLO}), ("/v1/completions", {"prompt": "hi"})):
        r = await client.post(route, json={"model": MODEL, "max_tokens": 2, **extra, **body})
        assert r.status_code == 200, r.text
        structured = engine.requests[-1].params.structured
        assert (structured.kind, structured.value) == (kind, value) if kind else structured is None


def test_logprob_bytes_put_a_split_character_back_together(gguf_tokenizer) -> None:
    # SmolLM2 writes "🙂" as two tokens; each one's text is U+FFFD, its bytes half the emoji.
    from engine.outputs import TokenLogprob
    from server.chat_output import chat_logprobs

    ids = gguf_tokenizer.encode("🙂!", add_special_tokens=False)
    lps = chat_logprobs(gguf_tokenizer, [TokenLogprob(t, -1.0, [(t, -1.0)]) for t in ids])
    assert all(set(e.token) == {"\ufffd"} for e in lps.content[:2])
    assert bytes(b for e in lps.content for b in e.bytes).decode() == "🙂!"
    assert [t.bytes for e in lps.content for t in e.top_logprobs] == [e.bytes for e in lps.content]


async def test_return_token_ids(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    # vLLM's return_token_ids: the prompt's ids once at the top, each choice's answer ids.
    whole = (await chat(client, max_tokens=6, n=2, return_token_ids=True, **GREEDY)).json()
    prompt = engine.requests[-1].prompt_token_ids
    assert whole["prompt_token_ids"] == prompt
    answer = (await greedy(engine, prompt, 6)).token_ids
    for k, choice in enumerate(whole["choices"]):
        assert choice["token_ids"] == answer
        assert engine.tokenizer.decode(choice["token_ids"]) == choice["message"]["content"]
    events = [e for e in sse_events((await chat(client, max_tokens=6, n=2, return_token_ids=True,
                                                stream=True, **GREEDY)).text) if e != "[DONE]"]
    assert events[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in e for e in events[1:])
    for k, choice in enumerate(whole["choices"]):
        assert [t for e in events for c in e["choices"] if c["index"] == k for t in c["token_ids"]] == \
            choice["token_ids"]
    plain = (await chat(client, max_tokens=2)).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
