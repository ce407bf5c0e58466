"""--reasoning-parser: a thinking model's <think> block apart from its answer, whole and
streamed in any pieces, on chat completions and the Responses API (the real engine on the tiny
checkpoint, made to write a thinking model's answer: ``ServedEngine.script``)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pydantic
import pytest
from openai.types.responses import ResponseStreamEvent

from api_helpers import MODEL, prompt_after_reasoning, sse_events
from real_engine import PLAIN_TEMPLATE, ServedEngine
from server.app import build_app
from engine.sampling_params import ThinkTokens
from server.reasoning import REASONING_FORMATS, ReasoningStream, reasoning_format

pytestmark = pytest.mark.anyio

QWEN3, R1 = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek_r1"]

CASES = [
    # (format, answer, reasoning, content)
    (QWEN3, "<think>\nstep 1</think>\n\nThe answer.", "\nstep 1", "\n\nThe answer."),
    (QWEN3, "The answer, no thinking.", None, "The answer, no thinking."),
    (QWEN3, "<thin", None, "<thin"),  # cut before the tag was whole: it was never one
    (QWEN3, "<think>cut mid-thought </thi", "cut mid-thought </thi", ""),
    (QWEN3, "<think></think>", "", ""),
    (QWEN3, "a <think>b</think> c", None, "a <think>b</think> c"),  # only at the start
    (R1, "step 1\nstep 2</think>The answer.", "step 1\nstep 2", "The answer."),
    (R1, "<think>step</think>Answer", "step", "Answer"),
    (R1, "still thinking when cut", "still thinking when cut", ""),
    (R1, "x</think>a</think>b", "x", "a</think>b"),
]


@pytest.mark.parametrize("fmt, answer, reasoning, content", CASES)
def test_every_split_of_the_stream_gives_the_whole_answers_parts(fmt, answer, reasoning, content) -> None:
    assert fmt.split(answer) == (reasoning, content)
    for size in range(1, len(answer) + 1):
        stream, got = ReasoningStream(fmt), ["", ""]
        for i in range(0, len(answer), size):
            r, c = stream.feed(answer[i:i + size])
            assert "<think>" not in r + c or "<think>" in content
            got[0] += r
            got[1] += c
        r, c = stream.finish()
        assert (got[0] + r, got[1] + c) == (reasoning or "", content), size


@pytest.mark.parametrize("fmt, answer, reasoning, content", [
    (QWEN3, "<think>a</think>\n\n {\"x\": 1}", "a", '{"x": 1}'),
    (QWEN3, "  {\"x\": 1}", None, '  {"x": 1}'),  # no block: nothing to trim (the grammar held)
    (R1, "a</think>\n\n", "a", ""),
])
def test_trimmed_the_blanks_after_the_block_go(fmt, answer, reasoning, content) -> None:
    # A constrained answer's grammar lets blanks through after the block, before the answer.
    assert fmt.split(answer, trim=True) == (reasoning, content)
    for size in range(1, len(answer) + 1):
        stream, got = ReasoningStream(fmt, trim=True), ""
        for i in range(0, len(answer), size):
            got += stream.feed(answer[i:i + size])[1]
        assert got + stream.finish()[1] == content, size


class _Vocab:
    """A tokenizer of whole words, ``<think>`` and ``</think>`` among them or not."""

    def __init__(self, words: list[str]) -> None:
        self.words = words

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.words.index(w) if w in self.words else 0 for w in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(self.words[i] for i in ids)


def test_the_tags_become_think_tokens_only_where_each_is_one_token(engine: ServedEngine) -> None:
    assert QWEN3.tokens(_Vocab(["<unk>", "a", "<think>", "</think>"])) == ThinkTokens(2, 3, opens_in_prompt=False)
    assert R1.tokens(_Vocab(["<unk>", "<think>", "</think>"])) == ThinkTokens(1, 2, opens_in_prompt=True)
    assert QWEN3.tokens(_Vocab(["<unk>", "<think>"])) is None  # </think> is the unknown token
    assert QWEN3.tokens(engine.tokenizer) is None  # SmolLM2's: several tokens for <think>


def test_an_unknown_parser_is_refused() -> None:
    assert reasoning_format("none") is None
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        reasoning_format("o1")


THOUGHT = "<think>\nLet me see.\n</think>\n\nHello!"


@pytest.fixture
def engine(make_engine) -> ServedEngine:
    return make_engine(chat_template=PLAIN_TEMPLATE)


async def serve_thinking(engine) -> Any:
    engine.script = THOUGHT
    app = build_app(engine, reasoning_parser="qwen3")
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            yield c


@pytest.fixture
async def thinking(engine: ServedEngine) -> Any:
    async for c in serve_thinking(engine):
        yield c


@pytest.fixture
async def tagged_thinking(make_think_engine) -> Any:
    """``thinking`` on the tiny checkpoint's twin whose tokenizer has ``<think>`` and
    ``</think>`` as single tokens (as Qwen3's has)."""
    async for c in serve_thinking(make_think_engine(chat_template=PLAIN_TEMPLATE)):
        yield c


MESSAGES = [{"role": "user", "content": "hi"}]


async def test_chat_answers_carry_reasoning_content(thinking: httpx.AsyncClient) -> None:
    body = (await thinking.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})).json()
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "\n\nHello!", "reasoning_content": "\nLet me see.\n"}
    r = await thinking.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "stream": True,
                                                         "n": 1})
    deltas = [e["choices"][0]["delta"] for e in sse_events(r.text)[:-1] if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert not any("<think>" in json.dumps(d) or "</think>" in json.dumps(d) for d in deltas)


async def test_an_earlier_turns_reasoning_goes_back_to_the_template(thinking: httpx.AsyncClient) -> None:
    # Qwen3's template renders an assistant turn's reasoning_content (PLAIN_TEMPLATE's as <think>...</think>).
    engine = thinking._transport.app.state.kvserve.engine
    expected = "<|user|>hi\n<|assistant|><think>Let me see.</think>Hello!\n<|user|>again\n<|assistant|>"
    assert await prompt_after_reasoning(thinking) == expected
    # The Responses API's reasoning item, sent back, is the next assistant turn's reasoning.
    items = [{"role": "user", "content": "hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Let me see."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
             {"role": "user", "content": "again"}]
    r = await thinking.post("/v1/responses", json={"model": MODEL, "input": items, "max_output_tokens": 1})
    assert r.status_code == 200, r.text
    assert engine.tokenizer.decode(engine.requests[-1].prompt_token_ids) == expected


async def test_responses_put_the_reasoning_in_its_own_item(thinking: httpx.AsyncClient) -> None:
    engine = thinking._transport.app.state.kvserve.engine
    body = (await thinking.post("/v1/responses", json={"model": MODEL, "input": "hi"})).json()
    reasoning, message = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "\nLet me see.\n"}]
    assert reasoning["summary"] == [] and reasoning["status"] == "completed"
    assert message["type"] == "message" and message["content"][0]["text"] == "\n\nHello!"

    r = await thinking.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    for event in events:  # every event is one the openai SDK's types read
        pydantic.TypeAdapter(ResponseStreamEvent).validate_python(event)
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert events[2]["item"]["type"] == "reasoning" and events[3]["part"]["type"] == "reasoning_text"
    pieces = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(pieces) == reasoning["content"][0]["text"] and len(pieces) > 1
    done = kinds.index("response.reasoning_text.done")
    assert kinds[done:done + 4] == ["response.reasoning_text.done", "response.content_part.done",
                                    "response.output_item.done", "response.output_item.added"]
    assert all(e["output_index"] == 1 for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert kinds[-1] == "response.completed"
    assert [(i["type"], i["status"]) for i in final["output"]] == [("reasoning", "completed"), ("message", "completed")]
    assert final["output"][1]["content"][0]["text"] == message["content"][0]["text"]

    # previous_response_id carries the reasoning into the next turn's prompt, as Qwen3's template wants it.
    await thinking.post("/v1/responses", json={"model": MODEL, "input": "again", "max_output_tokens": 1,
                                               "previous_response_id": body["id"]})
    assert engine.tokenizer.decode(engine.requests[-1].prompt_token_ids) == (
        "<|user|>hi\n<|assistant|><think>\nLet me see.\n</think>\n\nHello!\n<|user|>again\n<|assistant|>")


async def test_a_constrained_answer_thinks_first_where_the_tags_are_single_tokens(
        thinking: httpx.AsyncClient, tagged_thinking: httpx.AsyncClient) -> None:
    # Both engines write their script over the request's own constraint (no model writes a
    # <think> block that also matches it on cue); the recorded params are the server's.
    state = thinking._transport.app.state.kvserve
    engine = state.engine
    engine.script_over_constraints = True
    constrained = {"model": MODEL, "messages": MESSAGES, "structured_outputs": {"regex": "[a-zA-Z!]+"}}
    # SmolLM2's tokenizer has no single token for <think>: the grammar holds from the
    # first token, so nothing is split off.
    assert state.think_tokens is None
    body = (await thinking.post("/v1/chat/completions", json=constrained)).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": THOUGHT}
    assert engine.requests[-1].params.think is None
    # Where they are single tokens, the server has the engine's grammar wait out the block
    # (params.think), and the blanks it lets through after the block are not part of the answer.
    state, smollm2_vocab = tagged_thinking._transport.app.state.kvserve, engine.tokenizer.vocab_size
    engine = state.engine
    engine.script_over_constraints = True
    engine.script_grammar = r'start: <think> "\nLet me see.\n" </think> "\n\nHello!"'  # THOUGHT, tags as tokens
    [start], [end] = (engine.tokenizer.encode(tag, add_special_tokens=False) for tag in ("<think>", "</think>"))
    assert sorted([start, end]) == [smollm2_vocab, smollm2_vocab + 1]  # the two tokens added to SmolLM2's
    tags = ThinkTokens(start, end)
    assert state.think_tokens == tags
    thinking = tagged_thinking
    body = (await thinking.post("/v1/chat/completions", json=constrained)).json()
    assert engine.requests[-1].params.think == tags
    written = [t for out in engine.requests[-1].outputs for o in out.outputs for t in o.token_ids]
    assert written[0] == start and end in written  # the tags as the single tokens
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello!",
                                             "reasoning_content": "\nLet me see.\n"}
    r = await thinking.post("/v1/chat/completions", json={**constrained, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in sse_events(r.text)[:-1] if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Hello!"
    body = (await thinking.post("/v1/responses", json={"model": MODEL, "input": "hi",
                                                       "text": {"format": {"type": "json_object"}}})).json()
    assert engine.requests[-1].params.think == tags
    assert [i["type"] for i in body["output"]] == ["reasoning", "message"]
    assert body["output"][1]["content"][0]["text"] == "Hello!"


async def test_without_a_parser_the_tags_are_content(client: httpx.AsyncClient, engine: ServedEngine) -> None:
    engine.script = THOUGHT
    body = (await client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": THOUGHT}


def test_the_cli_takes_the_parser() -> None:
    from server.cli.args import build_parser
    args = build_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1"])
    assert args.reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "o1"])
