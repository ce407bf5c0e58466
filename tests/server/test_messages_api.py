"""POST /v1/messages (Anthropic's Messages API) against the real engine on the tiny checkpoint: the wire format,
the stream's events, the ``anthropic`` SDK's own parsing, tool turns, and errors in
Anthropic's shape."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import httpx2
import pytest

from api_helpers import MODEL
from real_engine import PLAIN_TEMPLATE, ServedEngine, a_stop_string, generated_tokens, greedy
from server.app import build_app

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "hi"}]
SCRIPT = "hello world"  # what the engine is made to answer, then EOS (ServedEngine.script)


@pytest.fixture
def engine(make_engine) -> ServedEngine:
    return make_engine(chat_template=PLAIN_TEMPLATE)


async def create(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/v1/messages", json={"model": MODEL, "max_tokens": 50, "messages": HI, **body})


def events_of(body: str) -> list[dict[str, Any]]:
    """Every event is ``event: <type>`` then ``data: {...}`` of that type; no ``[DONE]``."""
    out = []
    for block in body[:-2].split("\n\n"):
        head, data = block.split("\n")
        payload = json.loads(data[len("data: "):])
        assert head == f"event: {payload['type']}", block
        out.append(payload)
    return out


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    return body["error"]["message"]


def prompt_text(engine: ServedEngine) -> str:
    return engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)


async def test_a_text_answer(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    engine.script = SCRIPT
    r = await create(client, system="be brief", temperature=0.5, top_k=3)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("msg_") and body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == [{"type": "text", "text": SCRIPT}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("end_turn", None)
    assert prompt_text(engine) == "<|system|>be brief\n<|user|>hi\n<|assistant|>"
    params = engine.requests[-1].params
    assert (params.max_tokens, params.temperature, params.top_k) == (50, 0.5, 3)
    n = len(engine.requests[-1].prompt_token_ids)
    assert body["usage"] == {"input_tokens": n, "output_tokens": generated_tokens(engine), "cache_read_input_tokens": 0,
                             "cache_creation_input_tokens": 0}
    engine.script = None
    prompt = engine.tokenizer.encode("<|user|>hi\n<|assistant|>", add_special_tokens=False)
    answer = (await greedy(engine, prompt, 50)).text
    cut = (await create(client, max_tokens=4, temperature=0)).json()
    assert cut["stop_reason"] == "max_tokens" and cut["content"][0]["text"] == (await greedy(engine, prompt, 4)).text
    stop = a_stop_string(answer)
    stopped = (await create(client, stop_sequences=[stop], temperature=0)).json()
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", stop)
    assert stopped["content"][0]["text"] == answer[:answer.find(stop)]


async def test_the_stream_is_anthropics_event_sequence(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    engine.script = SCRIPT
    whole = (await create(client, temperature=0)).json()
    r = await create(client, stream=True, temperature=0)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = events_of(r.text)
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "content_block_delta"]
    assert kinds == ["message_start", "content_block_start"] + ["content_block_delta"] * len(deltas) + [
        "content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["usage"]["input_tokens"] == \
        whole["usage"]["input_tokens"]
    assert events[1]["content_block"] == {"type": "text", "text": ""}
    assert "".join(d["delta"]["text"] for d in deltas) == whole["content"][0]["text"]
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2]["usage"] == {"output_tokens": whole["usage"]["output_tokens"]}


async def test_tool_turns_become_chat_turns(make_engine) -> None:
    # Room for the tools listed in the system message.
    engine = make_engine(chat_template=PLAIN_TEMPLATE, max_model_len=1024)
    app = build_app(engine)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        await _tool_turns(client, engine)


async def _tool_turns(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "thanks"}]},
    ]
    tools = [{"name": "get_weather", "description": "Weather.",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    r = await create(client, messages=messages, tools=tools, tool_choice={"type": "none"}, max_tokens=1)
    assert r.status_code == 200, r.text
    # kvserve's generic tool format: the tools in the system message, a call as its JSON.
    text = prompt_text(engine)
    assert text.startswith("<|system|>") and '"name": "get_weather"' in text
    assert text.endswith("<|user|>weather?\n<|assistant|>Let me look.\n"
                         '[{"name": "get_weather", "arguments": {"city": "Paris"}}]\n'
                         "<|tool|>sunny\n<|user|>thanks\n<|assistant|>")


async def test_a_last_assistant_message_is_a_prefill(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await create(client, messages=HI + [{"role": "assistant", "content": [{"type": "text", "text": "Sure:"}]}],
                     max_tokens=3, temperature=0)
    assert r.status_code == 200, r.text
    assert prompt_text(engine) == "<|user|>hi\n<|assistant|>Sure:"  # the turn is left open
    # The continuation alone, as Anthropic's.
    continuation = (await greedy(engine, engine.requests[-1].prompt_token_ids, 3)).text
    assert r.json()["content"] == [{"type": "text", "text": continuation}]


async def test_the_anthropic_sdk_reads_it(engine: ServedEngine) -> None:
    engine.script = SCRIPT
    app = build_app(engine, api_key="k3y")
    async with app.router.lifespan_context(app):
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test")
        sdk = anthropic.AsyncAnthropic(api_key="k3y", base_url="http://test", http_client=http)  # x-api-key
        message = await sdk.messages.create(model=MODEL, max_tokens=50, messages=HI)
        assert message.content[0].text == SCRIPT and message.stop_reason == "end_turn"
        async with sdk.messages.stream(model=MODEL, max_tokens=50, messages=HI) as stream:
            pieces = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
        assert "".join(pieces) == final.content[0].text == message.content[0].text
        assert final.usage.output_tokens == message.usage.output_tokens
        assert (await sdk.messages.count_tokens(model=MODEL, messages=HI)).input_tokens == message.usage.input_tokens
        with pytest.raises(anthropic.BadRequestError, match="not supported"):
            await sdk.messages.create(model=MODEL, max_tokens=5, messages=[
                {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}])
        with pytest.raises(anthropic.AuthenticationError):
            await anthropic.AsyncAnthropic(api_key="wrong", base_url="http://test", http_client=http).messages.create(
                model=MODEL, max_tokens=5, messages=HI)


async def test_a_fault_mid_stream_is_an_error_event(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    engine.fail_after_steps = 2
    r = await create(client, stream=True)
    events = events_of(r.text)
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error"
    assert "simulated engine fault" in events[-1]["error"]["message"]
    assert engine.num_unfinished_requests == 0


@pytest.mark.parametrize("body, status, kind, says", [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": []}, 400, "invalid_request_error", "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, 400, "invalid_request_error",
     "not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}]}, 400, "invalid_request_error",
     "only text ones"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
     "only client tools"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "g"}},
     400, "invalid_request_error", "not among the tools"),
    ({"max_tokens": 10_000}, 400, "invalid_request_error", "maximum context length"),
    ({"model": "claude-sonnet-4-5"}, 404, "not_found_error", "does not exist"),
])
async def test_errors_are_in_anthropics_shape(client: httpx.AsyncClient, engine: ServedEngine, body: dict,
                                              status: int, kind: str, says: str) -> None:
    payload = {"model": MODEL, "max_tokens": 50, "messages": HI, **body}
    payload = {k: v for k, v in payload.items() if v is not None}
    message = anthropic_error(await client.post("/v1/messages", json=payload), status, kind)
    assert says in message
    assert engine.num_unfinished_requests == 0


async def test_thinking_comes_back_as_a_thinking_block(engine: ServedEngine) -> None:
    thought = "<think>Let me see.</think>\n\nHello!"
    engine.script = thought
    app = build_app(engine, reasoning_parser="qwen3")
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        body = (await create(client)).json()
        assert body["content"] == [{"type": "thinking", "thinking": "Let me see.", "signature": ""},
                                   {"type": "text", "text": "\n\nHello!"}]
        events = events_of((await create(client, stream=True)).text)
        starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
        assert starts == ["thinking", "text"]
        assert "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta") == \
            "Let me see."
        # A thinking block sent back is the assistant turn's reasoning, for the template.
        turns = HI + [{"role": "assistant", "content": body["content"]}, {"role": "user", "content": "more"}]
        await create(client, messages=turns, max_tokens=1)
        assert prompt_text(engine) == ("<|user|>hi\n<|assistant|><think>Let me see.</think>\n\nHello!\n"
                                       "<|user|>more\n<|assistant|>")
