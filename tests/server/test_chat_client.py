"""The terminal chat client, against a canned SSE server (httpx.MockTransport)."""

from __future__ import annotations

import io
import json

import httpx
import pytest

from server.cli.chat import ChatError, ChatSession, iter_sse_data, run


def sse_reply(text: str) -> str:
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"content": ch}}]} for ch in text]
    chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


class Server:
    """Answers each chat request with the next reply, recording the bodies."""

    def __init__(self, *replies: httpx.Response) -> None:
        self.replies = list(replies)
        self.bodies: list[dict] = []
        self.headers: list[httpx.Headers] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        self.bodies.append(json.loads(request.content))
        self.headers.append(request.headers)
        return self.replies.pop(0)


def ok(text: str) -> httpx.Response:
    return httpx.Response(200, text=sse_reply(text), headers={"content-type": "text/event-stream"})


def scripted(*lines: str):
    """An ``input`` that types ``lines`` and then hits end of input."""
    it = iter(lines)

    def read(_prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read


def session(server: Server, **kwargs) -> ChatSession:
    return ChatSession("http://kv:8000/", client=httpx.Client(transport=httpx.MockTransport(server)),
                       **kwargs)


def test_conversation_is_kept_and_streamed() -> None:
    server = Server(ok("Hi!"), ok("Sure."))
    out = io.StringIO()
    code = run(session(server, system="be nice", api_key="k"),
               input_fn=scripted("hello", "", "again", "/exit", "never sent"), out=out)
    assert code == 0
    assert "assistant> Hi!" in out.getvalue() and "assistant> Sure." in out.getvalue()
    assert server.bodies[0]["stream"] is True
    assert server.bodies[1]["messages"] == [
        {"role": "system", "content": "be nice"}, {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "again"}]
    assert server.headers[0]["authorization"] == "Bearer k"


def test_failed_turn_is_reported_and_not_remembered() -> None:
    refused = httpx.Response(401, json={"error": {"message": "bad key", "type": "x",
                                                  "param": None, "code": None}})
    server = Server(refused, ok("ok"))
    s = session(server)
    err = io.StringIO()
    code = run(s, input_fn=scripted("one", "two"), out=io.StringIO(), err=err)
    assert code == 0
    assert "HTTP 401: bad key" in err.getvalue()
    assert [m["content"] for m in s.messages] == ["two", "ok"]


def test_error_event_mid_stream() -> None:
    lines = ['data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}', "",
             'data: {"error": {"message": "engine died"}}', "", "data: [DONE]"]
    it = iter_sse_data(lines)
    assert next(it)["choices"][0]["delta"]["content"] == "a"
    with pytest.raises(ChatError, match="engine died"):
        next(it)


def test_a_thinking_models_reasoning_is_shown_apart_and_not_remembered() -> None:
    chunks = [{"choices": [{"index": 0, "delta": {"reasoning_content": piece}}]} for piece in ("Let", " me see.")]
    chunks += [{"choices": [{"index": 0, "delta": {"content": piece}}]} for piece in ("Hi", "!")]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    server = Server(httpx.Response(200, text=body, headers={"content-type": "text/event-stream"}))
    chat, out = session(server), io.StringIO()
    assert run(chat, input_fn=scripted("hello"), out=out) == 0
    assert out.getvalue() == "assistant> (thinking) Let me see.\nHi!\n\n"
    assert chat.messages[-1] == {"role": "assistant", "content": "Hi!"}
