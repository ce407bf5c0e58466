"""--reasoning-parser openai_gptoss: gpt-oss's harmony analysis channel as reasoning_content,
whole and streamed in any pieces, taken by ``auto`` where the chat template writes harmony's
channels (the real engine on the tiny checkpoint, made to write a harmony answer:
``ServedEngine.script``)."""

from __future__ import annotations

from typing import Any

import json

import httpx
import pytest

from api_helpers import MODEL, prompt_after_reasoning, sse_events
from real_engine import PLAIN_TEMPLATE, ServedEngine
from engine.sampling_params import ThinkTokens
from server.app import build_app
from server.harmony import HarmonyStream
from server.tools import OpenAIHarmonyFormat
from server.reasoning import REASONING_FORMATS, reasoning_format

pytestmark = pytest.mark.anyio

HARMONY = REASONING_FORMATS["openai_gptoss"]
ANSWER = "<|channel|>analysis<|message|>Let me see.<|end|><|start|>assistant<|channel|>final<|message|>Hello!"

CASES = [
    # (answer, reasoning, content)
    (ANSWER, "Let me see.", "Hello!"),
    ("<|channel|>final<|message|>Hi there.", None, "Hi there."),  # no analysis: no reasoning
    ("Plain text, no channels.", None, "Plain text, no channels."),  # the format ignored: content
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
     "<|start|>assistant<|channel|>final<|message|>c", "ab", "c"),
    # a preamble on the commentary channel is content, before the final answer
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary<|message|>Checking."
     "<|end|><|start|>assistant<|channel|>final<|message|>Done.", "x", "Checking.Done."),
    # a message to a function is a call: content in the hermes syntax the openai tool format reads,
    # its recipient after the channel or (right after the prompt's <|start|>assistant) before it
    ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}', "Need the weather.",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    (' to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>', None,
     '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'),
    (" to be, or not", None, " to be, or not"),  # (not a recipient)
    ("<|channel|>analysis<|message|>cut mid-thought <|en", "cut mid-thought <|en", ""),  # never a whole tag
    ("<|channel|>analysis<|message|>done<|end|><|start|>assist", "done", ""),  # cut inside a header
    ("<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>final<|message|>", "", ""),
    ("a <| b", None, "a <| b"),  # no header at the start: all content, "<|" and all
]


@pytest.mark.parametrize("answer, reasoning, content", CASES)
def test_every_split_of_a_harmony_answer_gives_its_parts(answer: str, reasoning: str | None, content: str) -> None:
    assert HARMONY.split(answer) == (reasoning, content)
    for size in range(1, len(answer) + 1):
        stream, got = HarmonyStream(), ["", ""]
        for i in range(0, len(answer), size):
            r, c = stream.feed(answer[i:i + size])
            for piece, whole in ((r, reasoning or ""), (c, content)):
                # no tag goes out, in whole or in part (but text that was never one)
                assert not any(t in piece for t in ("<|message|>", "<|channel|>", "<|end|>", "<|start|>", "to="))
                assert "<|" not in piece or "<|" in whole
            got[0] += r
            got[1] += c
        r, c = stream.finish()
        assert (got[0] + r, got[1] + c) == (reasoning or "", content), size


def test_auto_takes_harmony_where_the_template_writes_its_channels() -> None:
    from models.chat_template import template_tool_syntax
    assert template_tool_syntax(HARMONY_TEMPLATE) == "openai"
    assert reasoning_format("auto", "{{ '<|start|>assistant<|channel|>final<|message|>' }}") is HARMONY
    assert reasoning_format("auto", PLAIN_TEMPLATE) is None
    assert reasoning_format("auto", None) is None
    assert reasoning_format("openai_gptoss") is HARMONY and HARMONY.keeps_special_tokens


# gpt-oss's template, cut to its shape: each turn a harmony message; the answer opens at
# <|start|>assistant, where the model writes its channel.
HARMONY_TEMPLATE = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
                    "{% if tools %}<|start|>developer<|message|>namespace functions:"
                    "{% for t in tools %} type {{ t.function.name }};{% endfor %}<|end|>{% endif %}"
                    "{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}{% if m.thinking %}"
                    "<|channel|>analysis<|message|>{{ m.thinking }}<|end|><|start|>assistant{% endif %}"
                    "<|channel|>final{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


@pytest.fixture
async def harmony(make_engine) -> Any:
    engine = make_engine(chat_template=HARMONY_TEMPLATE)
    engine.script = ANSWER
    app = build_app(engine)  # (the parser left at auto)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            yield c


MESSAGES = [{"role": "user", "content": "hi"}]


async def test_chat_answers_carry_the_analysis_channel_as_reasoning(harmony: httpx.AsyncClient) -> None:
    state = harmony._transport.app.state.kvserve
    engine: ServedEngine = state.engine
    assert state.reasoning is HARMONY
    body = (await harmony.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello!",
                                             "reasoning_content": "Let me see."}
    # gpt-oss's tags are special tokens: the answer is read with them in its text
    assert engine.requests[-1].params.skip_special_tokens is False
    r = await harmony.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in sse_events(r.text)[:-1] if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me see."
    assert "".join(d.get("content") or "" for d in deltas) == "Hello!"
    assert not any("<|" in (d.get("content") or "") + d.get("reasoning_content", "") for d in deltas)
    body = (await harmony.post("/v1/responses", json={"model": MODEL, "input": "hi"})).json()
    assert [i["type"] for i in body["output"]] == ["reasoning", "message"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "Let me see."}]
    assert body["output"][1]["content"][0]["text"] == "Hello!"


async def test_an_earlier_turns_reasoning_goes_back_as_thinking(harmony: httpx.AsyncClient) -> None:
    # gpt-oss's template reads an assistant turn's reasoning as `thinking`
    assert await prompt_after_reasoning(harmony) == (
        "<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>analysis<|message|>Let me see.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello!<|end|><|start|>user<|message|>again<|end|>"
        "<|start|>assistant")


async def test_reasoning_effort_reaches_the_template(harmony: httpx.AsyncClient) -> None:
    # OpenAI's field, as gpt-oss's template reads it (chat_template_kwargs' own value wins)
    engine = harmony._transport.app.state.kvserve.engine

    def system_line() -> str:
        return engine.tokenizer.decode(engine.requests[-1].prompt_token_ids).split("<|end|>")[0]

    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
    await harmony.post("/v1/chat/completions", json={**chat, "reasoning_effort": "low"})
    assert system_line() == "<|start|>system<|message|>Reasoning: low"
    await harmony.post("/v1/chat/completions", json={**chat, "reasoning_effort": "low",
                                                     "chat_template_kwargs": {"reasoning_effort": "high"}})
    assert system_line() == "<|start|>system<|message|>Reasoning: high"
    await harmony.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 1,
                                              "reasoning": {"effort": "high"}})
    assert system_line() == "<|start|>system<|message|>Reasoning: high"
    r = await harmony.post("/v1/chat/completions", json={**chat, "reasoning_effort": "extreme"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    r = await harmony.post("/v1/responses", json={"model": MODEL, "input": "hi", "reasoning": {"effort": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')


async def test_a_message_to_a_function_is_a_tool_call(harmony: httpx.AsyncClient) -> None:
    state = harmony._transport.app.state.kvserve
    engine: ServedEngine = state.engine
    assert state.tool_format.name == "openai" and state.tool_format.native  # (the template's syntax)
    engine.script = CALL
    chat = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS}
    body = (await harmony.post("/v1/chat/completions", json=chat)).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == "Need the weather." and message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)
    assert "namespace functions: type get_weather;" in prompt  # the template rendered the tools
    assert engine.requests[-1].params.structured is None  # (the script's own choice: no grammar of ours)
    r = await harmony.post("/v1/chat/completions", json={**chat, "stream": True})
    chunks = [e["choices"][0] for e in sse_events(r.text)[:-1] if e["choices"]]
    calls = [c for ch in chunks for c in ch["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert "".join(c["function"].get("arguments") or "" for c in calls) == '{"city": "Paris"}'
    assert "".join(ch["delta"].get("reasoning_content") or "" for ch in chunks) == "Need the weather."
    assert not any(ch["delta"].get("content") for ch in chunks)
    assert chunks[-1]["finish_reason"] == "tool_calls"



# A tool whose arguments the grammar spells out whole: a random model's call is then one of two.
UNIT = [{"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}}, *TOOLS]


async def _required_call(client: httpx.AsyncClient, stream: bool = False, **extra) -> dict:
    chat = {"model": MODEL, "messages": MESSAGES, "tools": UNIT, "max_tokens": 120, "stream": stream,
            "tool_choice": {"type": "function", "function": {"name": "set_unit"}}, **extra}
    r = await client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    return r.json() if not stream else sse_events(r.text)


async def test_a_required_call_is_written_under_a_grammar_of_harmony(harmony: httpx.AsyncClient,
                                                                    make_think_engine) -> None:
    # The random model itself, held by the grammar (no script), calls the named tool: where
    # harmony's tags are tokens the grammar lets analysis messages come first, and where they
    # are not (SmolLM2's tokenizer) the call opens the answer, its tags as text.
    engine = make_think_engine(chat_template=HARMONY_TEMPLATE)
    app = build_app(engine)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as tagged:
            tok = engine.tokenizer
            tags = {tag: tok.encode(tag, add_special_tokens=False)[0] for tag in OpenAIHarmonyFormat.TAGS}
            assert app.state.kvserve.tool_format.tags == tags
            for client, analysis in ((harmony, False), (tagged, True)):
                served = client._transport.app.state.kvserve.engine
                choice = (await _required_call(client))["choices"][0]
                params = served.requests[-1].params
                assert params.structured.value.startswith("start: analysis* call" if analysis else "start: call")
                assert params.think is None and params.skip_special_tokens is False
                assert choice["finish_reason"] == "tool_calls"
                [call] = choice["message"]["tool_calls"]
                assert call["function"]["name"] == "set_unit"
                assert json.loads(call["function"]["arguments"]) in ({"unit": "c"}, {"unit": "f"})
                events = await _required_call(client, stream=True)
                deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
                calls = [c for d in deltas for c in d.get("tool_calls") or []]
                assert "".join(c["function"].get("arguments") or "" for c in calls) == call["function"]["arguments"]
                assert not any(d.get("content") for d in deltas)
            # The tagged grammar takes analysis messages of any text before the call, and
            # nothing else: no final answer, no call of another tool.
            grammars = engine.engine.grammars
            compiled = grammars.compile(params.structured)

            def accepts(text: str) -> bool:
                ids = tok.encode(text, add_special_tokens=False)
                return grammars.grammar(compiled).matcher.validate_tokens(ids) == len(ids)

            call_text = '<|channel|>commentary to=functions.set_unit <|constrain|>json<|message|>{"unit": "f"}'
            assert accepts("<|channel|>analysis<|message|>Let me see <b>.<|end|><|start|>assistant" * 2 + call_text)
            assert not accepts("<|channel|>final<|message|>Hi")
            assert not accepts(call_text.replace("set_unit", "get_weather"))


async def test_a_structured_output_holds_for_the_final_channel(harmony: httpx.AsyncClient,
                                                               make_think_engine) -> None:
    # vLLM's gate: the grammar waits for <|channel|>final ... <|message|> and holds for that
    # body; the analysis (and commentary) messages before it are free.
    state = harmony._transport.app.state.kvserve
    assert state.think_tokens is None  # SmolLM2's tokenizer: several tokens for each tag
    engine = make_think_engine(chat_template=HARMONY_TEMPLATE)
    app = build_app(engine)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            state = app.state.kvserve
            tok = engine.tokenizer
            [channel], [message] = (tok.encode(t, add_special_tokens=False) for t in ("<|channel|>", "<|message|>"))
            final = tuple(tok.encode("final", add_special_tokens=False))
            tags = ThinkTokens(channel, message, opens_in_prompt=True, end_after=(channel, *final))
            assert state.think_tokens == tags
            # (the script over the request's own grammar: no random model writes harmony on cue)
            engine.script, engine.script_over_constraints = ANSWER, True
            engine.script_grammar = ('start: <|channel|> "analysis" <|message|> "Let me see." <|end|> <|start|> '
                                     '"assistant" <|channel|> "final" <|message|> "{\\"a\\": 1}"')
            chat = {"model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_object"}}
            body = (await c.post("/v1/chat/completions", json=chat)).json()
            params = engine.requests[-1].params
            assert params.think == tags and params.skip_special_tokens is False
            assert body["choices"][0]["message"] == {"role": "assistant", "content": '{"a": 1}',
                                                     "reasoning_content": "Let me see."}
            r = await c.post("/v1/chat/completions", json={**chat, "stream": True})
            deltas = [e["choices"][0]["delta"] for e in sse_events(r.text)[:-1] if e["choices"]]
            assert "".join(d.get("content") or "" for d in deltas) == '{"a": 1}'
            assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Let me see."


async def test_a_completion_and_another_parser_keep_the_requests_own_choice(harmony: httpx.AsyncClient,
                                                                          make_engine) -> None:
    engine = harmony._transport.app.state.kvserve.engine
    await harmony.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert engine.requests[-1].params.skip_special_tokens is True  # no answer to read: as asked
    plain = make_engine(chat_template=HARMONY_TEMPLATE)
    plain.script = ANSWER
    app = build_app(plain, reasoning_parser="none")
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            body = (await c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    assert plain.requests[-1].params.skip_special_tokens is True
