"""Tool calling through the real server and the official ``openai`` SDK, unmodified: in
kvserve's generic format (the default model's own template knows nothing of tools), and in
the hermes and llama3_json formats, each with a chat template that renders tools that way
(``--chat-template``)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jsonschema
import openai
import pytest

from e2e_helpers import MODEL, KVServe, free_port

pytestmark = pytest.mark.slow

# The anthropic SDK (2.x) takes no temperature argument; kvserve reads the field from the body.
GREEDY = {"temperature": 0}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 30},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                       "required": ["timezone"], "additionalProperties": False},
    },
}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


DATA = Path(__file__).parents[1] / "data"


@contextmanager
def template_server(tmp_path_factory: pytest.TempPathFactory, template: str, *log_lines: str,
                    extra: tuple[str, ...] = ()) -> Iterator[openai.OpenAI]:
    """A server of its own with ``--chat-template tests/data/<template>`` whose start-up log
    says each of ``log_lines`` (the tool format it found); its client."""
    srv = KVServe(free_port(), tmp_path_factory.mktemp(template.split("_")[0]) / "server.log",
                  api_key="e2e-" + secrets.token_hex(8), shutdown_timeout=10.0,
                  extra=["--chat-template", str(DATA / template), *extra])
    try:
        srv.wait_http_ok(f"{srv.url}/health", 120.0)
        assert all(line in srv.log(tail=10**6) for line in log_lines), srv.describe()
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=120.0)
    finally:
        rc = srv.stop(30.0)
    assert rc == 0, srv.describe()


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """A second server whose chat template renders tools the hermes way (and which reads
    answers with Qwen3's reasoning parser: SmolLM2 never thinks, so they are all content)."""
    with template_server(tmp_path_factory, "hermes_chat_template.jinja", "tool calls: hermes format",
                         "reasoning: qwen3 parser", extra=("--reasoning-parser", "qwen3")) as client:
        yield client


@pytest.fixture(scope="module")
def llama3_json(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """A third server, whose chat template renders tools as Llama 3.1/3.2's do (the
    llama3_json format, found by --tool-call-parser auto)."""
    with template_server(tmp_path_factory, "llama3_json_chat_template.jinja",
                         "tool calls: llama3_json format") as client:
        yield client


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """A fourth server, whose chat template renders tools as Mistral's do ([TOOL_CALLS] and a
    JSON array of calls, 9-character call ids: the mistral format, found by --tool-call-parser
    auto). SmolLM2 has no [TOOL_CALLS] token: its grammar spells the marker out."""
    with template_server(tmp_path_factory, "mistral_chat_template.jinja",
                         "tool calls: mistral format") as client:
        yield client


@pytest.fixture(scope="module")
def mistral_v11(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """A fifth server, whose chat template writes calls as Mistral's newer ones do
    ([TOOL_CALLS]name[ARGS]{...} per call: the mistral format's newer syntax, found by
    --tool-call-parser auto). SmolLM2 has neither marker as a token: its grammar spells them."""
    with template_server(tmp_path_factory, "mistral_v11_chat_template.jinja",
                         "tool calls: mistral format, [TOOL_CALLS]name[ARGS]{...} per call") as client:
        yield client


def format_client(request: pytest.FixtureRequest) -> openai.OpenAI:
    """The client of the server whose tool-call format is ``request.param``: the default server
    for the generic format, else the fixture named after it."""
    return request.getfixturevalue({"generic": "client"}.get(request.param, request.param))


@pytest.fixture(params=["generic", "hermes", "llama3_json", "mistral", "mistral_v11"])
def tool_client(request: pytest.FixtureRequest) -> openai.OpenAI:
    """The client of the default server (generic format), or of the hermes, llama3_json,
    mistral or mistral_v11 one."""
    return format_client(request)


@pytest.fixture(params=["generic", "hermes", "mistral_v11"])
def api_tool_client(request: pytest.FixtureRequest) -> openai.OpenAI:
    """``tool_client`` for the Responses and Messages APIs, whose calls and results are chat's
    (the formats' own parsing and templates are each tested through chat above): the generic
    format, a tagged one and one of markers."""
    return format_client(request)


def is_call_id(call_id: str) -> bool:
    """kvserve's call ids: call_..., or for Mistral's templates 9 letters and digits."""
    return call_id.startswith("call_") or (len(call_id) == 9 and call_id.isalnum())


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and is_call_id(call.id)
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_validate(tool_client: openai.OpenAI, choice) -> None:
    r = tool_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                       max_tokens=80, temperature=0)
    choice_out = r.choices[0]
    assert choice_out.finish_reason == "tool_calls"
    assert choice_out.message.content is None
    check_calls(choice_out.message.tool_calls)
    if isinstance(choice, dict):
        assert {c.function.name for c in choice_out.message.tool_calls} == {"get_time"}


def test_streamed_tool_calls_arrive_in_pieces_and_equal_the_whole_answer(tool_client: openai.OpenAI) -> None:
    client = tool_client
    body = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0,
                parallel_tool_calls=False)
    whole = client.chat.completions.create(**body).choices[0]
    calls: dict[int, dict] = {}
    pieces, finish = 0, None
    for chunk in client.chat.completions.create(stream=True, **body):
        for c in chunk.choices:
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    call["id"], call["name"] = d.id, d.function.name
                if d.function and d.function.arguments:
                    call["arguments"] += d.function.arguments
                    pieces += 1
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and pieces > 1
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_auto_and_none_and_a_two_turn_conversation(tool_client: openai.OpenAI) -> None:
    client = tool_client
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0)
    choice = r.choices[0]
    if choice.message.tool_calls:  # auto: a call that validates, or a text answer
        check_calls(choice.message.tool_calls)
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.message.content and choice.message.content.lstrip()[0] not in "{[<"
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                       max_tokens=20, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")

    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})},
    ]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                            max_tokens=30, temperature=0)
    assert second.choices[0].message.content and second.choices[0].message.tool_calls is None


def test_bad_tools_are_400s(client: openai.OpenAI) -> None:
    cases = [
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(tools=[WEATHER, WEATHER]),
        dict(tools=[{"type": "function", "function": {"name": "x", "parameters": {"type": "string",
                                                                                  "not": {"const": "a"}}}}],
             tool_choice="required"),
        dict(tool_choice="required"),
    ]
    for extra in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **extra)
        if '"not":' in json.dumps(extra.get("tools", [])):  # the grammar refused: the field named is tools
            assert err.value.body["param"] == "tools" and "not" in err.value.body["message"]


def test_responses_function_calls_and_their_outputs(api_tool_client: openai.OpenAI) -> None:
    """Through the Responses API: flat function tools give function_call items (the
    same calls chat makes), streamed in pieces, and a function_call_output item
    answers one as a tool message does."""
    client = api_tool_client
    flat = [{"type": "function", **WEATHER["function"]}]
    ask = ASK[0]["content"]
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=60, temperature=0)
    [chat_call] = chat.choices[0].message.tool_calls
    r = client.responses.create(model=MODEL, input=ask, tools=flat, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    [call] = r.output
    assert r.status == "completed" and call.type == "function_call" and call.status == "completed"
    assert (call.name, call.arguments) == (chat_call.function.name, chat_call.function.arguments)
    assert is_call_id(call.call_id) and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])

    events = list(client.responses.create(model=MODEL, input=ask, tools=flat, tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=60, temperature=0,
                                          stream=True))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == call.arguments
    assert not any(e.type == "response.output_text.delta" for e in events)
    assert events[-1].type == "response.completed"

    result = json.dumps({"temperature": 18, "sky": "clear"})
    second = client.responses.create(
        model=MODEL, tools=flat, tool_choice="none", max_output_tokens=30, temperature=0,
        input=[{"role": "user", "content": ask},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": result}])
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result}]
    again = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                           max_tokens=30, temperature=0)
    assert second.output_text and second.output_text == again.choices[0].message.content


def test_anthropic_tool_use_and_its_result(api_tool_client: openai.OpenAI) -> None:
    """Through Anthropic's Messages API: a tool with an input_schema gives a tool_use block
    (chat's call), streamed as input_json_delta pieces, and a tool_result answers it."""
    import anthropic

    client = api_tool_client
    claude = anthropic.Anthropic(base_url=str(client.base_url).removesuffix("/v1/"), api_key=client.api_key,
                                 max_retries=0, timeout=120.0)
    tool = {"name": "get_weather", "description": WEATHER["function"]["description"],
            "input_schema": WEATHER["function"]["parameters"]}
    ask = ASK[0]["content"]
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=60, temperature=0)
    [chat_call] = chat.choices[0].message.tool_calls
    body = dict(model=MODEL, messages=[{"role": "user", "content": ask}], tools=[tool], max_tokens=60,
                extra_body=GREEDY, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    message = claude.messages.create(**body)
    [use] = message.content
    assert message.stop_reason == "tool_use" and use.type == "tool_use" and use.name == chat_call.function.name
    assert use.input == json.loads(chat_call.function.arguments)
    jsonschema.validate(use.input, PARAMETERS[use.name])
    with claude.messages.stream(**body) as stream:
        pieces = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert len(pieces) > 1 and json.loads("".join(pieces)) == use.input and final.content[0].input == use.input

    result = json.dumps({"temperature": 18, "sky": "clear"})
    second = claude.messages.create(
        model=MODEL, tools=[tool], tool_choice={"type": "none"}, max_tokens=30, extra_body=GREEDY,
        messages=[{"role": "user", "content": ask},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                     "input": use.input}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}])
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": result}]
    again = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                           max_tokens=30, temperature=0)
    assert second.content[0].text and second.content[0].text == again.choices[0].message.content
