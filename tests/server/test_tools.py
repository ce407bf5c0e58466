"""server.tools: kvserve's tool-call format, its grammar, and the streamed calls."""

from __future__ import annotations

import json

import pytest

from server.protocol import ChatMessage, template_messages
from server.tools import CallStream, FunctionSpec, call_grammar, calls_schema, parse_calls, scan_calls

WEATHER = FunctionSpec("get_weather", "Weather in a city.",
                       {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TIME = FunctionSpec("get_time", None, {"type": "object"})
ONE = '{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": [1, 2]}}'
TWO = '[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]'


def test_a_finished_answer_parses_into_its_calls():
    [call] = parse_calls(ONE)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": 'Pa"ris}', "days": [1, 2]}
    assert [(c.name, c.arguments) for c in parse_calls(TWO)] == [("get_weather", '{"city": "Rome"}'),
                                                                  ("get_time", "{}")]
    assert parse_calls("It is sunny.") is None
    assert parse_calls(ONE[:-5]) is None  # cut off by max_tokens: not a call


def test_scanning_a_growing_answer_never_goes_back():
    seen: list = []
    for end in range(1, len(TWO) + 1):
        calls = scan_calls(TWO[:end])
        assert calls is not None
        for i, c in enumerate(calls):
            if i < len(seen):
                assert c.arguments.startswith(seen[i])
        seen = [c.arguments for c in calls]
    assert [c.complete for c in scan_calls(TWO)] == [True, True]


def test_the_stream_sends_name_first_then_arguments_in_pieces():
    stream = CallStream()
    deltas = []
    for i in range(0, len(ONE), 4):
        text, calls = stream.feed(ONE[i:i + 4])
        assert text == ""
        deltas += calls
    rest, were_calls = stream.finish()
    assert rest == "" and were_calls
    head = deltas[0]
    assert head.index == 0 and head.id.startswith("call_") and head.function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert arguments == parse_calls(ONE)[0].arguments and len(deltas) > 3


def test_a_text_answer_streams_as_content():
    stream = CallStream()
    assert stream.feed("  ") == ("", [])
    assert stream.feed("Hi") == ("  Hi", [])
    assert stream.feed(" there") == (" there", [])
    assert stream.finish() == ("", False)


def test_grammars_for_each_tool_choice():
    assert call_grammar([WEATHER, TIME], "none", True) is None
    required = call_grammar([WEATHER, TIME], "required", False)
    assert required.kind == "json" and len(required.value["anyOf"]) == 2
    named = call_grammar([WEATHER, TIME], "get_time", True)
    assert named.value["items"]["properties"]["name"] == {"const": "get_time"}
    assert named.value["maxItems"] == 1
    auto = call_grammar([WEATHER], "auto", False)
    assert auto.kind == "grammar" and "%json" in auto.value and "TEXT" in auto.value
    assert calls_schema([WEATHER, TIME], True)["maxItems"] == 2


def test_the_prompt_lists_the_tools_and_earlier_calls():
    messages = [
        ChatMessage(role="user", content="Weather in Rome?"),
        ChatMessage(role="assistant", tool_calls=[{"id": "call_1", "type": "function",
                                                   "function": {"name": "get_weather",
                                                                "arguments": '{"city": "Rome"}'}}]),
        ChatMessage(role="tool", tool_call_id="call_1", content='{"temp": 20}'),
    ]
    out = template_messages(messages, [WEATHER], parallel=False)
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"name": "get_weather", "arguments": {"city": "Rome"}}
    assert out[3] == {"role": "tool", "content": '{"temp": 20}'}
    with pytest.raises(ValueError, match="tool_call_id"):
        ChatMessage(role="tool", content="x")
