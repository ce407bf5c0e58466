"""POST /v1/responses (OpenAI's Responses API) against the real engine on the tiny checkpoint: the wire format,
the stream's events, the ``openai`` SDK's own parsing, stored responses, and errors."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import (ResponseCompletedEvent, ResponseFunctionCallArgumentsDeltaEvent,
                                    ResponseTextDeltaEvent)

from api_helpers import MODEL, assert_error
from real_engine import PLAIN_TEMPLATE, ServedEngine, generated_tokens, greedy, logprob_entry, name
from server.app import build_app
from server.protocol_responses import Usage
from server.response_store import ResponseStore, StoredResponse
from server.responses_api import ResponsesRequest
from server.responses_output import ResponseObject
from server.serving_responses import ResponseEvents
from server.tools import FORMATS, CallStream

pytestmark = pytest.mark.anyio

SCRIPT = "hello world, this is kvserve"  # what the engine is made to answer, then EOS (ServedEngine.script)
# A prompt of more than one 16-token block, so that a second request hits the prefix cache.
LONG = "hi, please tell me all about the weather in Paris today and tomorrow"


@pytest.fixture
def engine(make_engine) -> ServedEngine:
    return make_engine(chat_template=PLAIN_TEMPLATE)


async def respond(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/v1/responses", json={"model": MODEL, **body})


def events_of(body: str) -> list[dict[str, Any]]:
    """Parse a Responses stream: every event is ``event: <type>`` then ``data: {...}``
    with the same type, numbered 0, 1, 2, ...; there is no ``[DONE]``."""
    assert body.endswith("\n\n")
    out = []
    for block in body[:-2].split("\n\n"):
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == head[len("event: "):]
        assert payload["sequence_number"] == len(out)
        out.append(payload)
    return out


def prompt_text(engine: ServedEngine) -> str:
    return engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)


async def test_a_text_answer_with_instructions(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    engine.script = SCRIPT
    r = await respond(client, input="hi", instructions="be brief", metadata={"k": "v"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("resp_") and body["object"] == "response"
    assert body["status"] == "completed" and body["incomplete_details"] is None and body["error"] is None
    assert body["instructions"] == "be brief" and body["metadata"] == {"k": "v"} and body["store"] is True
    [item] = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["id"].startswith("msg_")
    assert item["content"] == [{"type": "output_text", "text": SCRIPT, "annotations": [], "logprobs": []}]
    # Instructions are a system message first; the input a user message.
    assert prompt_text(engine) == "<|system|>be brief\n<|user|>hi\n<|assistant|>"
    n_prompt = len(engine.requests[-1].prompt_token_ids)
    n = generated_tokens(engine)
    assert body["usage"] == {"input_tokens": n_prompt, "output_tokens": n, "total_tokens": n_prompt + n,
                             "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                             "output_tokens_details": {"reasoning_tokens": 0}}


async def test_cut_by_max_output_tokens_is_incomplete(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    engine.script = SCRIPT
    r = await respond(client, input="hi", max_output_tokens=5, temperature=0.5, top_p=0.9)
    body = r.json()
    assert engine.requests[-1].params.max_tokens == 5
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    # The five tokens the engine wrote: the start of its answer.
    text = body["output"][0]["content"][0]["text"]
    assert generated_tokens(engine) == 5 and SCRIPT.startswith(text) and text != SCRIPT
    assert body["output"][0]["status"] == "incomplete"
    assert text == engine.tokenizer.decode([t for out in engine.requests[-1].outputs for t in out.outputs[0].token_ids])
    assert (body["max_output_tokens"], body["temperature"], body["top_p"]) == (5, 0.5, 0.9)


async def test_input_items_become_chat_turns(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    items = [{"role": "developer", "content": "rules"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                             {"type": "input_text", "text": "b"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling",
                                                                    "annotations": []}]},
             {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"x": 1}'},
             {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "42"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "ok"}]}]
    r = await respond(client, input=items, max_output_tokens=1)
    assert r.status_code == 200, r.text
    # kvserve's generic tool format (the fake template knows nothing of tools): an
    # assistant turn's calls follow its text as their JSON.
    calls = '[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]'
    # A template that never names the developer role renders it as system (models.chat_template).
    assert prompt_text(engine) == (f"<|system|>rules\n<|user|>a\nb\n<|assistant|>calling\n{calls}\n"
                                   "<|tool|>42\n<|tool|>ok\n<|assistant|>")


async def test_the_stream_is_openais_event_sequence(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    engine.script = SCRIPT
    plain = (await respond(client, input=LONG, temperature=0)).json()
    r = await respond(client, input=LONG, stream=True, temperature=0)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = events_of(r.text)
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.completed"])
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    text = "".join(d["delta"] for d in deltas)
    assert text == plain["output"][0]["content"][0]["text"] == SCRIPT
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id and e["output_index"] == 0 for e in deltas)
    assert events[-4]["text"] == text and events[-2]["item"]["status"] == "completed"
    final = events[-1]["response"]
    assert final["id"] == events[0]["response"]["id"] and final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == text and final["output"][0]["id"] == item_id
    # The same prompt again: its full blocks come from the prefix cache this time.
    assert final["usage"] == {**plain["usage"], "input_tokens_details": {"cached_tokens": 16,
                                                                         "cache_write_tokens": 0}}


async def test_logprobs_come_with_include(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    r = await respond(client, input="hi", max_output_tokens=3, top_logprobs=2)
    assert r.json()["output"][0]["content"][0]["logprobs"] == []  # not without include
    asked = {"input": "hi", "max_output_tokens": 3, "top_logprobs": 2,
             "include": ["message.output_text.logprobs"], "temperature": 0}
    plain = (await respond(client, **asked)).json()["output"][0]["content"][0]["logprobs"]
    g = await greedy(engine, engine.requests[-1].prompt_token_ids, 3, logprobs=2)
    assert [e["token"] for e in plain] == [name(engine, t) for t in g.token_ids]
    first = g.logprobs[0]
    assert plain[0] == {**logprob_entry(engine, first.token_id, first.logprob),
                        "top_logprobs": [logprob_entry(engine, t, v) for t, v in first.top]}
    assert len(plain[0]["top_logprobs"]) == 2
    events = events_of((await respond(client, stream=True, **asked)).text)
    streamed = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert streamed == plain
    assert [e for e in events if e["type"] == "response.output_text.done"][0]["logprobs"] == plain


async def test_previous_response_id_continues_the_conversation(client: httpx.AsyncClient,
                                                               engine: ServedEngine) -> None:
    engine.script = "hello"
    first = (await respond(client, input="hi", instructions="be brief")).json()
    second = (await respond(client, input="more", previous_response_id=first["id"], stream=True)).text
    # The earlier turns (not its instructions, as OpenAI does) come before the new input.
    assert prompt_text(engine) == "<|user|>hi\n<|assistant|>hello\n<|user|>more\n<|assistant|>"
    second_id = events_of(second)[-1]["response"]["id"]
    third = (await respond(client, input="again", previous_response_id=second_id)).json()
    assert third["previous_response_id"] == second_id
    assert prompt_text(engine) == ("<|user|>hi\n<|assistant|>hello\n<|user|>more\n<|assistant|>hello\n"
                                   "<|user|>again\n<|assistant|>")
    got = await client.get(f"/v1/responses/{first['id']}")
    assert got.status_code == 200 and got.json() == first
    deleted = await client.delete(f"/v1/responses/{first['id']}")
    assert deleted.json() == {"id": first["id"], "object": "response", "deleted": True}
    assert_error(await client.get(f"/v1/responses/{first['id']}"), 404, "response_id")
    assert_error(await client.delete(f"/v1/responses/{first['id']}"), 404, "response_id")
    err = assert_error(await respond(client, input="x", previous_response_id=first["id"]), 400,
                       "previous_response_id")
    assert err["code"] == "previous_response_not_found"


async def test_input_items_list_every_item_up_to_the_answer(client: httpx.AsyncClient,
                                                           engine: ServedEngine) -> None:
    engine.script = "hello"
    first = (await respond(client, input="hi", instructions="be brief")).json()
    items = [{"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
             {"type": "function_call", "id": "fc_mine", "call_id": "call_1", "name": "weather",
              "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    second = (await respond(client, input=items, previous_response_id=first["id"])).json()

    def listed(response_id: str, **query: Any) -> Any:
        return client.get(f"/v1/responses/{response_id}/input_items", params=query)

    page = (await listed(first["id"])).json()
    assert page["object"] == "list" and page["has_more"] is False
    [hi] = page["data"]
    assert {k: hi[k] for k in ("type", "role", "content")} == {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    assert hi["id"].startswith("msg_") and page["first_id"] == page["last_id"] == hi["id"]
    # The second: the first's input and output items, then its own; newest first by default.
    everything = (await listed(second["id"], order="asc")).json()["data"]
    assert [i["type"] for i in everything] == ["message", "message", "message", "function_call",
                                               "function_call_output"]
    assert everything[0] == hi and everything[1] == first["output"][0]
    assert everything[3]["id"] == "fc_mine" and everything[4]["output"] == "sunny"
    assert (await listed(second["id"])).json()["data"] == everything[::-1]
    # Pages: limit, and after an item's id.
    head = (await listed(second["id"], order="asc", limit=2)).json()
    assert head["data"] == everything[:2] and head["has_more"] is True
    rest = (await listed(second["id"], order="asc", after=head["last_id"])).json()
    assert rest["data"] == everything[2:] and rest["has_more"] is False
    for query, param in [({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
                         ({"after": "msg_nope"}, "after")]:
        assert_error(await listed(second["id"], **query), 400, param)
    assert_error(await listed("resp_nope"), 404, "response_id")


async def test_store_false_and_the_store_bound(engine: ServedEngine, make_engine) -> None:
    app = build_app(engine, max_stored_responses=2)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        unstored = (await respond(client, input="a", max_output_tokens=1, store=False)).json()
        assert unstored["store"] is False
        assert_error(await client.get(f"/v1/responses/{unstored['id']}"), 404)
        ids = [(await respond(client, input="a", max_output_tokens=1)).json()["id"] for _ in range(3)]
        assert [(await client.get(f"/v1/responses/{i}")).status_code for i in ids] == [404, 200, 200]
    app = build_app(make_engine(), max_stored_responses=0)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        body = (await respond(client, input="a", max_output_tokens=1)).json()
        assert body["store"] is False
        assert_error(await client.get(f"/v1/responses/{body['id']}"), 404)


async def test_the_openai_sdk_reads_it(engine: ServedEngine) -> None:
    engine.script = SCRIPT
    app = build_app(engine)
    async with app.router.lifespan_context(app):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1")
        sdk = openai.AsyncOpenAI(api_key="unused", base_url="http://test/v1", http_client=http)
        first = await sdk.responses.create(model=MODEL, input="hi")
        assert first.output_text == SCRIPT and first.status == "completed"
        assert first.usage.output_tokens == generated_tokens(engine) and first.usage.input_tokens_details.cached_tokens == 0
        events = [e async for e in await sdk.responses.create(model=MODEL, input="hi", stream=True)]
        assert isinstance(events[-1], ResponseCompletedEvent)
        assert "".join(e.delta for e in events if isinstance(e, ResponseTextDeltaEvent)) == first.output_text
        async with sdk.responses.stream(model=MODEL, input="more", previous_response_id=first.id) as stream:
            final = await stream.get_final_response()
        assert final.output_text == first.output_text and final.previous_response_id == first.id
        assert (await sdk.responses.retrieve(first.id)).output_text == first.output_text
        listed = [item async for item in sdk.responses.input_items.list(final.id, order="asc")]
        assert [(item.type, item.role) for item in listed] == [("message", "user"), ("message", "assistant"),
                                                               ("message", "user")]
        assert listed[2].content[0].text == "more" and listed[1].id == first.output[0].id
        await sdk.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.retrieve(first.id)
        with pytest.raises(openai.BadRequestError, match="only function tools"):
            await sdk.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])


async def test_a_fault_mid_stream_is_response_failed(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    engine.fail_after_steps = 2
    r = await respond(client, input="hi", stream=True, max_output_tokens=10, temperature=0)
    assert r.status_code == 200
    events = events_of(r.text)
    assert events[-1]["type"] == "response.failed"
    engine.fail_after_steps = None
    first_two = (await greedy(engine, engine.requests[-1].prompt_token_ids, 2)).text
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "simulated engine fault" in failed["error"]["message"]
    assert failed["output"][0]["status"] == "incomplete" and failed["output"][0]["content"][0]["text"] == first_two
    assert engine.num_unfinished_requests == 0


@pytest.mark.parametrize("body, param, says", [
    ({"input": ""}, "input", "must not be empty"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "message, function_call"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "only input_text"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "message, function_call"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice", "not among the tools"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "truncation": "auto"}, "truncation", "not supported"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "not supported"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text", "schema is required"),
    ({"input": "x", "max_output_tokens": 1000}, "input", "maximum context length"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", None),
    ({"input": "x", "temperature": -1}, "temperature", None),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ({"input": "x", "stream": "yes"}, "stream", None),
])
async def test_bad_requests_are_400s_naming_the_field(client: httpx.AsyncClient, engine: ServedEngine,
                                                      body: dict, param: str, says: str | None) -> None:
    err = assert_error(await respond(client, **body), 400)
    assert err["param"] is not None and err["param"].startswith(param), err
    if says is not None:
        assert says in err["message"], err["message"]
    assert engine.num_unfinished_requests == 0


def test_streamed_calls_become_function_call_items() -> None:
    body = ResponsesRequest(input="x", tools=[{"type": "function", "name": "get_weather"},
                                              {"type": "function", "name": "get_time"}])
    response = ResponseObject(id="resp_1", created_at=0, model=MODEL)
    events, calls = ResponseEvents(response), CallStream(FORMATS["generic"])
    answer = '[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]'
    out = list(events.start())
    for i in range(0, len(answer), 5):
        text, deltas = calls.feed(answer[i:i + 5])
        assert text == ""
        for d in deltas:
            out += events.call(d)
    assert calls.finish() == ("", True)
    out += events.finish("stop", Usage.of(3, 30, 0))
    parsed = [json.loads(e.split("\n")[1][len("data: "):]) for e in out]
    kinds = [p["type"] for p in parsed]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds.count("response.output_item.added") == 2 and kinds.count("response.output_item.done") == 2
    assert kinds[-1] == "response.completed" and "response.output_text.delta" not in kinds
    final = parsed[-1]["response"]["output"]
    assert [(c["type"], c["name"], json.loads(c["arguments"]), c["status"]) for c in final] == [
        ("function_call", "get_weather", {"city": "Rome"}, "completed"),
        ("function_call", "get_time", {}, "completed")]
    for index, call in enumerate(final):
        pieces = [p["delta"] for p in parsed if p["type"] == "response.function_call_arguments.delta"
                  and p["output_index"] == index]
        assert "".join(pieces) == call["arguments"] and len(pieces) >= 1
        assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    # The SDK's own types read the events.
    deltas = [ResponseFunctionCallArgumentsDeltaEvent.model_validate(p) for p in parsed
              if p["type"] == "response.function_call_arguments.delta"]
    assert deltas and all(d.item_id.startswith("fc_") for d in deltas)
    assert body.chat_request([]).tool_choice_name() == "auto"


def test_the_store_keeps_the_newest_within_its_count_and_bytes() -> None:
    def stored(n: int) -> StoredResponse:
        return StoredResponse({"id": "x" * n}, [{"role": "user", "content": "y" * n}])

    store = ResponseStore(3, max_bytes=stored(1000).size * 2 + 10)
    for i in range(3):
        store.put(f"r{i}", stored(10))
    store.get("r0")  # read: now the newest
    store.put("r3", stored(10))
    assert [store.get(k) is not None for k in ("r0", "r1", "r2", "r3")] == [True, False, True, True]
    store.put("big1", stored(1000))
    store.put("big2", stored(1000))  # over the bytes: the oldest go, whatever the count
    assert len(store) == 2 and store.get("big1") and store.get("big2")
    assert store.bytes == 2 * stored(1000).size
    store.put("huge", stored(10**5))  # alone over the bound: not kept, nothing evicted for it
    assert store.get("huge") is None and len(store) == 2
    assert store.delete("big1") and not store.delete("big1") and store.bytes == stored(1000).size
